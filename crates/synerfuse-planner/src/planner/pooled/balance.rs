//! A combination of pool options balanced: the batch split over every replica by pace,
//! each pool's layers split again for its counts, every rank's memory checked, and the
//! step in closed form.

use super::options::PoolOption;
use crate::cost::StageHolding;
use crate::planner::{
    context::Ctx,
    error::PlanningError,
    memory_fit::stage_fit,
    outcome::PoolLayout,
    pricing::{max, pipeline_time},
    samples::{min_max_samples, ReplicaPace},
    segments::{gather_s, optimizer_s, pooled_segments, reduce_s},
    split::split_layers,
};

/// The batch split over the pools' replicas (exact min-max over samples), then each
/// pool's layers re-split for its counts, twice; the closed-form step and the layouts
/// (to polish),
/// or `None` when the sizes cannot make the batch or a split stops fitting.
pub(in crate::planner) fn balance(
    ctx: &mut Ctx<'_>,
    chosen: &[&PoolOption],
    global_batch: usize,
) -> Result<Option<(f64, Vec<PoolLayout>)>, PlanningError> {
    let mut layouts: Vec<PoolLayout> = (chosen.iter())
        .map(|o| PoolLayout {
            devices: o.devices.clone(),
            layers: o.layers.clone(),
            micro_batch_size: o.micro_batch_size,
            micro_batches: vec![1; o.devices[0].len()],
            short: Vec::new(),
        })
        .collect();
    for _ in 0..2 {
        let mut paces = Vec::new();
        for pool in &layouts {
            let most = most_micro_batches(ctx, pool)?;
            paces.extend(group_paces(ctx, pool, most)?);
        }
        let Some(counts) = min_max_samples(global_batch, &paces) else {
            return Ok(None);
        };
        let mut counts = counts.into_iter();
        for pool in &mut layouts {
            let d = pool.micro_batches.len();
            let ep = ctx.expert_parallel(pool.devices[0][0]);
            pool.micro_batches = per_member(counts.by_ref().take(d / ep).collect(), ep).collect();
            let bs = vec![pool.micro_batch_size; d];
            let l = ctx.cost.model.num_layers;
            match split_layers(ctx, &pool.devices, &bs, &pool.micro_batches, l)? {
                Some(layers) => pool.layers = layers,
                None => return Ok(None),
            }
        }
    }
    Ok(Some((closed_form_step_s(ctx, &layouts)?, layouts)))
}

/// The paces the batch is split by: one per replica, or under expert parallelism one
/// per group of `ep` consecutive replicas (alike members taking the same micro-batches:
/// the group takes `ep` micro-batches at a time), each holding at most `most`.
pub(in crate::planner) fn group_paces(
    ctx: &mut Ctx<'_>,
    pool: &PoolLayout,
    most: usize,
) -> Result<Vec<ReplicaPace>, PlanningError> {
    let ep = ctx.expert_parallel(pool.devices[0][0]);
    let (t, c) = pool.stage_times(ctx)?;
    Ok((0..pool.micro_batches.len())
        .step_by(ep)
        .map(|r| ReplicaPace {
            micro_batch_size: pool.micro_batch_size * ep,
            first_s: pipeline_time(&t, &c, r, 1),
            each_s: t.iter().map(|s| s[r]).fold(0.0, f64::max),
            most_micro_batches: most,
        })
        .collect())
}

/// Each group's count of [`group_paces`]' split for each of its `ep` members.
pub(in crate::planner) fn per_member(counts: Vec<usize>, ep: usize) -> impl Iterator<Item = usize> {
    counts.into_iter().flat_map(move |m| vec![m; ep.max(1)])
}

/// Whether every rank of every pool holds its stage with its 1F1B micro-batches in
/// flight.
pub(in crate::planner) fn fits_all(
    ctx: &mut Ctx<'_>,
    layouts: &[PoolLayout],
) -> Result<bool, PlanningError> {
    for pool in layouts {
        let (p, b) = (pool.layers.len(), pool.micro_batch_size);
        for (i, row) in pool.devices.iter().enumerate() {
            // Alike units with the same micro-batches in flight fit alike: checked once.
            let mut checked = std::collections::HashSet::new();
            for (&dev, &m) in row.iter().zip(&pool.micro_batches) {
                let key = (
                    ctx.classes[dev],
                    ctx.memory[dev].map(f64::to_bits),
                    (p - i).min(m),
                );
                if !checked.insert(key) {
                    continue;
                }
                let holding = StageHolding {
                    layers: pool.layers[i],
                    first: i == 0,
                    last: i + 1 == p,
                    in_flight: (p - i).min(m),
                    micro_batch_size: b,
                    optimizer_share: 1.0,
                    recompute: false,
                    loss_in_chunks: ctx.loss_in_chunks(dev),
                };
                let fit = stage_fit(ctx, dev, holding)?;
                if ctx.exceeds(fit.need, ctx.memory[dev]) {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

/// The most micro-batches per replica the pool's ranks hold with its layers (a stage
/// keeps at most its depth in flight, so fitting that many fits any count).
pub(in crate::planner) fn most_micro_batches(
    ctx: &mut Ctx<'_>,
    pool: &PoolLayout,
) -> Result<usize, PlanningError> {
    let p = pool.layers.len();
    let mut most = 0;
    for m in 1..=p {
        let trial = PoolLayout {
            micro_batches: vec![m; pool.micro_batches.len()],
            ..pool.clone()
        };
        if !fits_all(ctx, std::slice::from_ref(&trial))? {
            return Ok(most);
        }
        most = m;
    }
    Ok(usize::MAX)
}

/// The step in closed form: the slowest replica's 1F1B, the busiest rank's reduction,
/// the slowest optimizer step, the busiest rank's parameter gathers.
pub(in crate::planner) fn closed_form_step_s(
    ctx: &mut Ctx<'_>,
    layouts: &[PoolLayout],
) -> Result<f64, PlanningError> {
    let segments = pooled_segments(ctx, layouts);
    let reduce = max(&reduce_s(ctx, &segments));
    let gather = max(&gather_s(ctx, &segments));
    Ok(pipelines_s(ctx, layouts)? + reduce + optimizer_s(ctx, layouts, &segments) + gather)
}

/// The slowest replica's 1F1B closed form.
pub(in crate::planner) fn pipelines_s(
    ctx: &mut Ctx<'_>,
    layouts: &[PoolLayout],
) -> Result<f64, PlanningError> {
    let mut slowest = 0.0f64;
    for pool in layouts {
        let (t, c) = pool.stage_times(ctx)?;
        for (r, &m) in pool.micro_batches.iter().enumerate() {
            slowest = slowest.max(pipeline_time(&t, &c, r, m));
        }
    }
    Ok(slowest)
}
