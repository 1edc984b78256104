//! The closed-form price of a grid layout: stage times (and a pool's), the memory
//! check, the 1F1B formula, the reduction and the optimizer step.

use super::{
    buckets::{
        gather_waits_s, grid_reductions, pieces_of, reductions_end_s, BucketedReduction,
        PieceWeights, StagePass,
    },
    context::Ctx,
    error::{Infeasibility, MemoryShortfall, PlanningError, Violation},
    memory_fit::{memory_need, stage_fits, Shares, StageFit},
    outcome::{Grid, PoolLayout, Prediction},
    reduction::{expert_allreduce_s, experts_apart, holders_allreduce_s},
};
use crate::cost::StageCosts;

/// Per (stage, replica): per-micro-batch time (at the replica's micro-batch size in
/// `sizes`, recomputing where [`stage_fit`](super::memory_fit::stage_fit) says with `m`
/// micro-batches), and p2p seconds to the next stage.
pub(super) fn stage_times(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<(Grid<f64>, Grid<f64>), PlanningError> {
    let times = stage_times_fits(ctx, grid, layers, sizes, m)?;
    Ok((times.t, times.c))
}

/// [`stage_times`]'s, and how each (stage, replica) fits.
pub(super) struct StageTimes {
    pub(super) t: Grid<f64>,
    pub(super) c: Grid<f64>,
    pub(super) fits: Grid<StageFit>,
}

/// [`stage_times`], and how each (stage, replica) fits.
pub(super) fn stage_times_fits(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<StageTimes, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let fits = stage_fits(ctx, grid, layers, sizes, m)?;
    let mut t = vec![vec![0.0; d]; p];
    let mut c = vec![vec![0.0; d]; p];
    for i in 0..p {
        for r in 0..d {
            let b = sizes[r];
            t[i][r] = stage_seconds(&fits[i][r].costs, layers[i], i, p);
            if i + 1 < p {
                c[i][r] =
                    ctx.cost
                        .p2p_seconds(&ctx.devices[grid[i][r]], &ctx.devices[grid[i + 1][r]], b);
            }
        }
        expert_group_times(ctx, (&grid[i], layers[i]), sizes, &fits[i], &mut t[i])?;
    }
    Ok(StageTimes { t, c, fits })
}

/// A stage's micro-batch times `t` (per replica) under expert parallelism: each member's
/// experts compute the group's mean tokens (an even part of every member's; its own
/// micro-batch's in `t`), and the members meet at every MoE layer's all-to-all, so each
/// micro-batch takes the group's slowest member's time.
fn expert_group_times(
    ctx: &mut Ctx<'_>,
    (units, layers): (&[usize], usize),
    sizes: &[usize],
    fits: &[StageFit],
    t: &mut [f64],
) -> Result<(), PlanningError> {
    let ep = ctx.expert_parallel(units[0]);
    if ep == 1 {
        return Ok(());
    }
    for (start, group) in (0..t.len()).step_by(ep).zip(t.chunks_mut(ep)) {
        let members = start..start + group.len();
        let mean = sizes[members.clone()].iter().sum::<usize>() as f64 / group.len() as f64;
        for (r, time) in members.zip(group.iter_mut()) {
            let (unit, b) = (units[r], sizes[r]);
            // As recomputation stretches the layer (its forward twice), so its experts.
            let again = fits[r].costs.layer_s / ctx.costs(unit, b)?.layer_s.max(1e-30);
            let experts = layers as f64 * ctx.expert_seconds(unit, b)? * again;
            *time += experts * (mean / b as f64 - 1.0);
        }
        let slowest = group.iter().copied().fold(0.0, f64::max);
        group.fill(slowest);
    }
    Ok(())
}

/// One micro-batch of `size` samples through stage `i` of `p` holding `layers` layers on
/// `unit`, recomputed where `recompute` (a short micro-batch priced at its own size).
pub(super) fn micro_batch_seconds(
    ctx: &mut Ctx<'_>,
    unit: usize,
    size: usize,
    recompute: bool,
    (layers, i, p): (usize, usize, usize),
) -> Result<f64, PlanningError> {
    let mut costs = ctx.costs(unit, size)?;
    if recompute {
        costs = costs.recomputed();
    }
    Ok(stage_seconds(&costs, layers, i, p))
}

/// One micro-batch's forward and backward through stage `i` of `p` holding `layers`
/// layers (and the embedding or head at the ends).
pub(super) fn stage_seconds(k: &StageCosts, layers: usize, i: usize, p: usize) -> f64 {
    layers as f64 * k.layer_s
        + if i == 0 { k.embedding_s } else { 0.0 }
        + if i + 1 == p { k.head_s } else { 0.0 }
}

/// The 1F1B time of a replica: fill and drain plus (m − 1) of its slowest stage.
pub(super) fn pipeline_time(t: &[Vec<f64>], c: &[Vec<f64>], r: usize, m: usize) -> f64 {
    one_f_one_b(pipeline_parts(t, c, r), m)
}

/// 1F1B with `m` micro-batches of a replica's (fill and drain, slowest stage).
fn one_f_one_b((fill, slowest): (f64, f64), m: usize) -> f64 {
    fill + (m.saturating_sub(1)) as f64 * slowest
}

/// A replica's fill and drain, and its slowest stage.
fn pipeline_parts(t: &[Vec<f64>], c: &[Vec<f64>], r: usize) -> (f64, f64) {
    let sum: f64 = t.iter().map(|s| s[r]).sum();
    let comm: f64 = c.iter().map(|s| 2.0 * s[r]).sum();
    let max = t.iter().map(|s| s[r]).fold(0.0, f64::max);
    (sum + comm, max)
}

/// Every replica's [`pipeline_time`] parts, gathered once for the many micro-batch
/// counts a split tries (the same bits as asking it each time).
pub(super) struct PipelineTimes(Vec<(f64, f64)>);

impl PipelineTimes {
    pub(super) fn new(t: &[Vec<f64>], c: &[Vec<f64>]) -> Self {
        let replicas = t.first().map_or(0, Vec::len);
        Self((0..replicas).map(|r| pipeline_parts(t, c, r)).collect())
    }

    /// Replica `r`'s 1F1B time with `m` micro-batches.
    pub(super) fn time(&self, r: usize, m: usize) -> f64 {
        one_f_one_b(self.0[r], m)
    }
}

/// Scores a layout by the closed form; `Err(violation)` when a rank runs out of memory.
pub(super) fn evaluate(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<Result<Prediction, Violation>, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let shares = Shares::of_grid(ctx, grid);
    let mut stage_memory = vec![0.0f64; p];
    for i in 0..p {
        for r in 0..d {
            let (need, have) = memory_need(ctx, grid, &shares, (i, r), layers[i], sizes[r], m[r])?;
            // A group's need is its whole stage's: its most loaded member holds its share.
            stage_memory[i] = stage_memory[i].max(need * ctx.state_fraction(grid[i][r]));
            if let Some(have) = have {
                if ctx.exceeds(need, Some(have)) {
                    let dev = &ctx.devices[grid[i][r]];
                    return Ok(Err(Violation {
                        ratio: need / have.max(1.0),
                        reason: Infeasibility::OutOfMemory(MemoryShortfall {
                            stage: i,
                            layers: layers[i],
                            pp: p,
                            dp: d,
                            kind: dev.kind.clone(),
                            device: dev.index,
                            need_bytes: need,
                            usable_bytes: have,
                            micro_batch_size: sizes[r],
                            in_flight: (p - i).min(m[r]),
                        }),
                    }));
                }
            }
        }
    }
    let times = stage_times_fits(ctx, grid, layers, sizes, m)?;
    let (t, c) = (&times.t, &times.c);
    let pipeline_s = (0..d)
        .map(|r| pipeline_time(t, c, r, m[r]))
        .fold(0.0, f64::max);
    let allreduce_s = max(&allreduce_times(ctx, grid, layers));
    let optimizer_s = max(&optimizer_times(ctx, grid, layers).concat());
    let reductions = match ctx.cost.overlap_grad_reduce || ctx.cost.distributed_optimizer {
        true => grid_reductions(ctx, grid, layers),
        false => Vec::new(),
    };
    let reduced = match ctx.cost.overlap_grad_reduce {
        false => pipeline_s + allreduce_s,
        true => pipeline_s.max(overlapped_end_s(ctx, layers, &times, m, &reductions)),
    };
    let param_gather_s = gather_wait_s(ctx, layers, &times, &reductions);
    let step = reduced + optimizer_s + param_gather_s + ctx.cost.step_overhead_s();
    let busy: Vec<Vec<f64>> = (0..p)
        .map(|i| (0..d).map(|r| t[i][r] * m[r] as f64).collect())
        .collect();
    let total_busy: f64 = busy.iter().flatten().sum();
    Ok(Ok(Prediction {
        step_time_s: step,
        pipeline_s,
        allreduce_s,
        optimizer_s,
        param_gather_s,
        bubble_fraction: 1.0 - total_busy / (step * (p * d) as f64).max(1e-30),
        stage_time_s: t
            .iter()
            .map(|s| s.iter().copied().fold(0.0, f64::max))
            .collect(),
        stage_memory_bytes: stage_memory,
        busy_s: busy,
        simulated: false,
    }))
}

/// The closed form's end of the last reduction in buckets inside the last backwards:
/// each replica's stage `i` ends its last backward as 1F1B drains (its pipeline's end
/// less the later backwards and sends of the stages before it).
fn overlapped_end_s(
    ctx: &Ctx<'_>,
    layers: &[usize],
    StageTimes { t, c, fits }: &StageTimes,
    m: &[usize],
    reductions: &[(Vec<usize>, BucketedReduction)],
) -> f64 {
    let (p, d) = (t.len(), t[0].len());
    let l = ctx.cost.model.num_layers;
    let pieces = pieces_of(layers, l);
    // Per (stage, replica), queue i·d + r.
    let mut backward = Vec::with_capacity(p * d);
    for i in 0..p {
        for r in 0..d {
            let backward_s = |j: usize| t[j][r] * (1.0 - fits[j][r].costs.forward_fraction);
            let drain: f64 = (0..i).map(|j| backward_s(j) + c[j][r]).sum();
            let end_s = pipeline_time(t, c, r, m[r]) - drain;
            backward.push(StagePass {
                start_s: end_s - backward_s(i),
                end_s,
                pieces: pieces[i],
                weights: PieceWeights::new(&fits[i][r].costs, l),
            });
        }
    }
    max(&reductions_end_s(reductions, &backward))
}

/// The closed form's wait for the distributed optimizer's parameter gathers
/// ([`gather_waits_s`]): the slowest queue's, each (stage, replica)'s first forward
/// starting once the stages before it have passed one micro-batch forward and sent it.
fn gather_wait_s(
    ctx: &Ctx<'_>,
    layers: &[usize],
    StageTimes { t, c, fits }: &StageTimes,
    reductions: &[(Vec<usize>, BucketedReduction)],
) -> f64 {
    if !ctx.cost.distributed_optimizer {
        return 0.0;
    }
    let (p, d) = (t.len(), t[0].len());
    let l = ctx.cost.model.num_layers;
    let pieces = pieces_of(layers, l);
    let forward_s = |j: usize, r: usize| t[j][r] * fits[j][r].costs.forward_fraction;
    let forwards: Vec<StagePass> = (0..p)
        .flat_map(|i| (0..d).map(move |r| (i, r)))
        .map(|(i, r)| {
            let start_s: f64 = (0..i).map(|j| forward_s(j, r) + c[j][r]).sum();
            StagePass {
                start_s,
                end_s: start_s + forward_s(i, r),
                pieces: pieces[i],
                weights: PieceWeights::new(&fits[i][r].costs, l),
            }
        })
        .collect();
    let overlapped = ctx.cost.overlaps_param_gather().then_some(&forwards[..]);
    max(&gather_waits_s(reductions, p * d, overlapped))
}

/// The largest of `values` (0 for none).
pub(super) fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(0.0, f64::max)
}

/// Per stage, the fp32 gradient all-reduce over its replicas, s: under expert
/// parallelism the experts each member holds over the replicas holding the same
/// ([`expert_allreduce_s`]), the rest over all.
pub(super) fn allreduce_times(ctx: &Ctx<'_>, grid: &[Vec<usize>], layers: &[usize]) -> Vec<f64> {
    let p = grid.len();
    let model = &ctx.cost.model;
    (0..p)
        .map(|i| {
            let whole = model.stage_params(layers[i], i == 0, i + 1 == p);
            let experts = match experts_apart(ctx, &grid[i]) {
                true => layers[i] as f64 * model.expert_layer_params(),
                false => 0.0,
            };
            holders_allreduce_s(ctx, &grid[i], whole - experts)
                + expert_allreduce_s(ctx, &grid[i], layers[i] as f64)
        })
        .collect()
}

/// Per (stage, replica), the optimizer step over the stage's parameters, s (0 where
/// not priced).
pub(super) fn optimizer_times(ctx: &Ctx<'_>, grid: &[Vec<usize>], layers: &[usize]) -> Grid<f64> {
    let p = grid.len();
    (0..p)
        .map(|i| {
            let shares = Shares::of_stage(ctx, &grid[i]);
            (grid[i].iter())
                .map(|&k| {
                    let params = ctx.cost_of(k).stage_params(layers[i], i == 0, i + 1 == p);
                    let share = shares.of(ctx, k);
                    ctx.optimizer_seconds(k, params * share).unwrap_or(0.0)
                })
                .collect()
        })
        .collect()
}

impl PoolLayout {
    /// Per (stage, replica) the seconds of one micro-batch, and of its send to the next stage.
    pub(super) fn stage_times(
        &self,
        ctx: &mut Ctx<'_>,
    ) -> Result<(Grid<f64>, Grid<f64>), PlanningError> {
        let sizes = vec![self.micro_batch_size; self.micro_batches.len()];
        stage_times(
            ctx,
            &self.devices,
            &self.layers,
            &sizes,
            &self.micro_batches,
        )
    }

    /// Per (stage, replica) how it fits: its costs, whether it recomputes, its memory.
    pub(super) fn stage_fits(&self, ctx: &mut Ctx<'_>) -> Result<Grid<StageFit>, PlanningError> {
        let sizes = vec![self.micro_batch_size; self.micro_batches.len()];
        stage_fits(
            ctx,
            &self.devices,
            &self.layers,
            &sizes,
            &self.micro_batches,
        )
    }
}
