//! A pool's options: the pools of alike units, and each way to cut one into replicas of
//! one depth (a layer split that fits, a micro-batch size) with its steady-state rate.

use crate::planner::{
    context::Ctx,
    error::PlanningError,
    grid::arrange,
    outcome::{Arrangement, Grid},
    pricing::stage_times,
    shapes::PoolShape,
    split::split_layers,
};

/// One way to cut a pool: depth, micro-batch size, and the layer split that fits.
#[derive(Clone)]
pub(in crate::planner) struct PoolOption {
    pub(in crate::planner) devices: Grid<usize>,
    pub(in crate::planner) layers: Vec<usize>,
    pub(in crate::planner) micro_batch_size: usize,
    /// Samples per second per device in the steady state.
    pub(in crate::planner) rate: f64,
}

/// What pools devices: their class (group, speed) and usable memory's bits.
pub(in crate::planner) type PoolKey = (usize, Option<u64>);

/// Unit indices (devices, or tensor-parallel groups) pooled by unit class and usable
/// memory, fastest pool first (per-layer time at micro-batch size 1).
pub(in crate::planner) fn pools(ctx: &mut Ctx<'_>) -> Result<Vec<Vec<usize>>, PlanningError> {
    let mut pools: Vec<(PoolKey, Vec<usize>)> = Vec::new();
    for i in 0..ctx.devices.len() {
        let key = (ctx.classes[i], ctx.memory[i].map(f64::to_bits));
        match pools.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => pools.push((key, vec![i])),
        }
    }
    let mut speed = Vec::with_capacity(pools.len());
    for (_, members) in &pools {
        speed.push(ctx.costs(members[0], 1)?.layer_s);
    }
    let mut order: Vec<usize> = (0..pools.len()).collect();
    order.sort_by(|&a, &b| speed[a].total_cmp(&speed[b]));
    Ok(order.into_iter().map(|k| pools[k].1.clone()).collect())
}

/// A pool's feasible cuts (every depth dividing it and size, or only `shape`'s), its
/// fastest per device first: the layer split that fits with every 1F1B micro-batch in
/// flight.
pub(in crate::planner) fn pool_options(
    ctx: &mut Ctx<'_>,
    pool: &[usize],
    sizes: &[usize],
    shape: Option<PoolShape>,
) -> Result<Vec<PoolOption>, PlanningError> {
    let (n, l, ep) = (
        pool.len(),
        ctx.cost.model.num_layers,
        ctx.cost.expert_parallel,
    );
    let mut options = Vec::new();
    let depths = (1..=n.min(l)).filter(|&p| whole_groups(n, p, ep));
    for p in depths.filter(|&p| shape.is_none_or(|s| s.stages == p)) {
        let d = n / p;
        let devices = arrange(pool, p, d, Arrangement::ByReplica);
        for &b in sizes
            .iter()
            .filter(|&&b| shape.is_none_or(|s| s.micro_batch_size == b))
        {
            let bs = vec![b; d];
            // Split for a full pipeline; a pool that only fits with fewer micro-batches in
            // flight is tried with one per replica (the batch split decides).
            let layers = match split_layers(ctx, &devices, &bs, &vec![p; d], l)? {
                Some(layers) => Some(layers),
                None => split_layers(ctx, &devices, &bs, &vec![1; d], l)?,
            };
            let Some(layers) = layers else {
                continue;
            };
            let (t, _) = stage_times(ctx, &devices, &layers, &bs, &vec![p; d])?;
            let slowest = t.iter().map(|s| s[0]).fold(0.0, f64::max);
            options.push(PoolOption {
                rate: (d * b) as f64 / slowest.max(1e-30) / n as f64,
                devices: devices.clone(),
                layers,
                micro_batch_size: b,
            });
        }
    }
    options.sort_by(|a, b| b.rate.total_cmp(&a.rate));
    Ok(options)
}

/// Whether a pool of `n` units cuts into replicas of `p` stages in whole groups of `ep`.
pub(in crate::planner) fn whole_groups(n: usize, p: usize, ep: usize) -> bool {
    n % p == 0 && (n / p) % ep.max(1) == 0
}
