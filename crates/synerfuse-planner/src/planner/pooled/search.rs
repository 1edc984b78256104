//! The per-replica search: unit shapes (tensor- and context-parallel sizes, a size per
//! pool where its groups align with the pools), each pool's options combined, the best
//! few combinations balanced and polished, the best simulated.

use super::{
    balance::balance,
    options::{pool_options, pools, PoolOption},
    polish::polish,
};
use crate::cluster::Device;
use crate::cost::CostModel;
use crate::planner::{
    context::Ctx,
    error::PlanningError,
    outcome::{PoolLayout, PooledCandidate},
    plan_context::expert_groups,
    shapes::{PoolShape, UnitShape},
    simulate::simulate_pools,
    tensor::TpGroup,
};

/// The most combinations of pool options tried: each pool keeps its fastest options
/// per device, as many as keep the product under this (every option on small clusters).
pub(in crate::planner) const MOST_COMBINATIONS: usize = 81;

/// The best plan whose replicas are pipelines of their own shape, over every
/// tensor-parallel size of `tp_sizes` the cluster's nodes cut into; `None` when none
/// fits, or when the cluster is one pool of devices and no tensor-parallel size above 1
/// is asked for (the grid planner covers that).
pub fn plan_pooled(
    cost: &CostModel,
    global_batch: usize,
    sizes: &[usize],
    tp_sizes: &[usize],
) -> Result<Option<PooledCandidate>, PlanningError> {
    // The distributed optimizer's shards are not priced for per-replica pipelines.
    let cost = CostModel {
        distributed_optimizer: false,
        ..cost.clone()
    };
    Ok(plan_pooled_noting_memory(&cost, global_batch, sizes, (tp_sizes, &[]), None)?.0)
}

/// [`plan_pooled`], and whether memory ruled anything out. Tensor-parallel sizes whose
/// groups each lie within one pool of alike devices are chosen pool by pool (a size per
/// device kind); a size whose groups mix pools (nodes of mixed devices) is tried for the
/// whole cluster. Context-parallel groups of `cp_sizes` (of each tensor-parallel size)
/// are searched where memory ruled plans out without them, with the others, so that a
/// pool of small devices can split sequences beside a pool that does not.
pub(in crate::planner) fn plan_pooled_noting_memory(
    cost: &CostModel,
    global_batch: usize,
    sizes: &[usize],
    (tp_sizes, cp_sizes): (&[usize], &[usize]),
    only: Option<&[PoolShape]>,
) -> Result<(Option<PooledCandidate>, bool), PlanningError> {
    let tp: Vec<UnitShape> = tp_sizes.iter().map(|&t| (t, 1)).collect();
    let (best, bound) = plan_shapes(cost, global_batch, sizes, &tp, only)?;
    let cp: Vec<UnitShape> = (cp_sizes.iter().filter(|&&c| c > 1))
        .flat_map(|&c| tp_sizes.iter().map(move |&t| (t, c)))
        .collect();
    let chosen = only.is_none_or(|s| s.iter().any(|x| x.context_parallel_size > 1));
    if cp.is_empty() || !chosen || (only.is_none() && !bound) {
        return Ok((best, bound));
    }
    let shapes: Vec<UnitShape> = tp.into_iter().chain(cp).collect();
    let (found, _) = plan_shapes(cost, global_batch, sizes, &shapes, only)?;
    let best = match (best, found) {
        (Some(b), Some(f)) if f.step_time_s >= b.step_time_s => Some(b),
        (b, f) => f.or(b),
    };
    Ok((best, bound))
}

/// The best per-replica plan over units of `shapes`, and whether memory ruled anything
/// out (see [`plan_pooled_noting_memory`]).
fn plan_shapes(
    cost: &CostModel,
    global_batch: usize,
    sizes: &[usize],
    shapes: &[UnitShape],
    only: Option<&[PoolShape]>,
) -> Result<(Option<PooledCandidate>, bool), PlanningError> {
    let (mut best, mut bound): (Option<PooledCandidate>, bool) = (None, false);
    let mut keep = |found: Option<PooledCandidate>| {
        if let Some(c) = found {
            if best.as_ref().is_none_or(|b| c.step_time_s < b.step_time_s) {
                best = Some(c);
            }
        }
    };
    let mut single = Ctx::new(cost);
    let single_pools = pools(&mut single)?;
    let kinds = device_sets(&single, &single_pools);
    let mut aligned: Vec<AlignedSize> = Vec::new();
    let chosen = |shape: UnitShape| only.is_none_or(|s| s.iter().any(|x| x.unit() == shape));
    for &(t, c) in shapes.iter().filter(|&&shape| chosen(shape)) {
        let ctx = match c {
            1 => Ctx::tensor_parallel(cost, t)?,
            _ => Ctx::context_parallel(cost, c, t)?,
        };
        let Some(mut ctx) = ctx else {
            continue;
        };
        let units = pools(&mut ctx)?;
        match align(&device_sets(&ctx, &units), &kinds) {
            Some(order) => {
                let units = order.into_iter().map(|k| units[k].clone()).collect();
                aligned.push(((t, c), std::sync::Arc::unwrap_or_clone(ctx.groups), units));
            }
            None => {
                let found = plan_units(&mut ctx, global_batch, sizes, t * c > 1, only)?;
                bound |= ctx.memory_bound.get();
                keep(found);
            }
        }
    }
    if !aligned.is_empty() {
        let (found, memory_bound) =
            plan_sizes_per_pool(cost, &single.all, aligned, global_batch, sizes, only)?;
        bound |= memory_bound;
        keep(found);
    }
    Ok((best, bound))
}

/// Per unit shape whose groups align with the pools of alike devices: its groups, and
/// each pool's units (pools in one order for every shape).
type AlignedSize = (UnitShape, Vec<TpGroup>, Vec<Vec<usize>>);

/// The best plan taking one of `aligned`'s sizes per pool, and whether memory ruled
/// anything out: one context holds every size's groups (they overlap: a plan takes one
/// size per pool), so that each pool's options are priced once and combined.
fn plan_sizes_per_pool(
    cost: &CostModel,
    all: &[Device],
    aligned: Vec<AlignedSize>,
    global_batch: usize,
    sizes: &[usize],
    only: Option<&[PoolShape]>,
) -> Result<(Option<PooledCandidate>, bool), PlanningError> {
    let kinds = aligned.first().map_or(0, |(_, _, units)| units.len());
    let mut groups = Vec::new();
    let mut pools_by_size = Vec::new();
    for (shape, size_groups, units) in aligned {
        let offset = groups.len();
        groups.extend(size_groups);
        // One pool of devices and no tensor parallelism: the grid planner's case.
        if shape == (1, 1) && kinds < 2 {
            continue;
        }
        pools_by_size.push((shape, offset, units));
    }
    let mut ctx = Ctx::with_groups(cost, all.to_vec(), groups);
    let mut options: Vec<Vec<PoolOption>> = vec![Vec::new(); kinds];
    for (shape, offset, units) in pools_by_size {
        for (k, pool) in units.iter().enumerate() {
            if !PoolShape::allows(only, k, shape) {
                continue;
            }
            let pool: Vec<usize> = pool.iter().map(|u| u + offset).collect();
            let shape = only.map(|s| s[k]);
            options[k].extend(pool_options(&mut ctx, &pool, sizes, shape)?);
        }
    }
    for pool_options in &mut options {
        pool_options.sort_by(|a, b| b.rate.total_cmp(&a.rate));
    }
    let found = match best_combination(&mut ctx, options, global_batch, sizes)? {
        Some(layouts) => {
            let (groups, layouts) = used_units(&ctx.groups, layouts);
            let mut used = Ctx::with_groups(cost, all.to_vec(), groups);
            used.lockstep = expert_groups(&layouts, cost.expert_parallel);
            Some(simulate_pools(&mut used, layouts, false)?.0)
        }
        None => None,
    };
    Ok((found, ctx.memory_bound.get()))
}

/// Per pool of units, the sorted devices its units cover.
fn device_sets(ctx: &Ctx<'_>, pools: &[Vec<usize>]) -> Vec<Vec<usize>> {
    (pools.iter())
        .map(|units| {
            let mut devices: Vec<usize> = (units.iter())
                .flat_map(|&u| ctx.groups[u].members.iter().copied())
                .collect();
            devices.sort_unstable();
            devices
        })
        .collect()
}

/// For each of `kinds`' device sets, the index of the one of `sets` that covers the
/// same devices; `None` unless they match one to one.
fn align(sets: &[Vec<usize>], kinds: &[Vec<usize>]) -> Option<Vec<usize>> {
    if sets.len() != kinds.len() {
        return None;
    }
    kinds
        .iter()
        .map(|kind| sets.iter().position(|s| s == kind))
        .collect()
}

/// `layouts`' units renumbered by their first device, and the groups they use (a
/// plan of single devices keeps the devices' indices).
fn used_units(groups: &[TpGroup], mut layouts: Vec<PoolLayout>) -> (Vec<TpGroup>, Vec<PoolLayout>) {
    let first = |u: usize| groups[u].members.iter().copied().min().unwrap_or(0);
    let mut used: Vec<usize> = layouts
        .iter()
        .flat_map(|p| p.devices.iter().flatten().copied())
        .collect();
    used.sort_unstable_by_key(|&u| first(u));
    used.dedup();
    let renumbered: std::collections::HashMap<usize, usize> = used
        .iter()
        .enumerate()
        .map(|(new, &old)| (old, new))
        .collect();
    for unit in layouts
        .iter_mut()
        .flat_map(|p| p.devices.iter_mut().flatten())
    {
        *unit = renumbered[unit];
    }
    (used.iter().map(|&u| groups[u].clone()).collect(), layouts)
}

/// The best plan over `ctx`'s units (devices, or tensor-parallel groups), when more
/// than one pool of them (or `one_pool`) and one fits.
pub(in crate::planner) fn plan_units(
    ctx: &mut Ctx<'_>,
    global_batch: usize,
    sizes: &[usize],
    one_pool: bool,
    only: Option<&[PoolShape]>,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let pools = pools(ctx)?;
    if pools.len() < 2 && !one_pool {
        return Ok(None);
    }
    let shape = ctx.groups.first().map_or((1, 1), |g| (g.tp_size(), g.cp));
    let mut options = Vec::with_capacity(pools.len());
    for (k, pool) in pools.iter().enumerate() {
        if !PoolShape::allows(only, k, shape) {
            return Ok(None);
        }
        options.push(pool_options(ctx, pool, sizes, only.map(|s| s[k]))?);
    }
    match best_combination(ctx, options, global_batch, sizes)? {
        Some(layouts) => {
            ctx.lockstep = expert_groups(&layouts, ctx.cost.expert_parallel);
            Ok(Some(simulate_pools(ctx, layouts, false)?.0))
        }
        None => Ok(None),
    }
}

/// Balanced combinations polished on large clusters, best balanced first (on small ones,
/// every one: the local search from a worse start can end lower, 7 % in one case found).
const POLISHED: usize = 3;

/// Units up to which every balanced combination is polished.
const POLISH_ALL_UP_TO: usize = 512;

/// The best layouts taking one of each pool's `options` (fastest first): every
/// combination of the fastest few balanced, then polished (on clusters of more than
/// [`POLISH_ALL_UP_TO`] units, the best [`POLISHED`] of them).
fn best_combination(
    ctx: &mut Ctx<'_>,
    mut options: Vec<Vec<PoolOption>>,
    global_batch: usize,
    sizes: &[usize],
) -> Result<Option<Vec<PoolLayout>>, PlanningError> {
    // Each other pool takes at least one micro-batch of the smallest size: an option
    // whose replicas need more than the rest of the batch cannot be part of a plan.
    let smallest = sizes.iter().copied().min().unwrap_or(1);
    let room = global_batch.saturating_sub((options.len().max(1) - 1) * smallest);
    for pool_options in &mut options {
        pool_options.retain(|o| o.devices[0].len() * o.micro_batch_size <= room);
    }
    if options.is_empty() || options.iter().any(Vec::is_empty) {
        return Ok(None);
    }
    let keep = options_kept(&options.iter().map(Vec::len).collect::<Vec<_>>());
    let limits: Vec<usize> = options.iter().map(|o| o.len().min(keep)).collect();
    let mut balanced: Vec<(f64, Vec<PoolLayout>)> = Vec::new();
    for choice in combinations(&limits) {
        let chosen: Vec<&PoolOption> = (choice.iter().enumerate())
            .map(|(k, &i)| &options[k][i])
            .collect();
        if let Some(found) = balance(ctx, &chosen, global_batch)? {
            balanced.push(found);
        }
    }
    balanced.sort_by(|a, b| a.0.total_cmp(&b.0));
    let polished = match ctx.devices.len() <= POLISH_ALL_UP_TO {
        true => balanced.len(),
        false => POLISHED,
    };
    let mut best: Option<(f64, Vec<PoolLayout>)> = None;
    for (step, layouts) in balanced.into_iter().take(polished) {
        let (step, layouts) = polish(ctx, layouts, step)?;
        if best.as_ref().is_none_or(|(s, _)| step < *s) {
            best = Some((step, layouts));
        }
    }
    Ok(best.map(|(_, layouts)| layouts))
}

/// Options kept per pool: the most k with every pool's min(k, options) multiplying to at
/// most [`MOST_COMBINATIONS`] (at least 1).
pub(in crate::planner) fn options_kept(counts: &[usize]) -> usize {
    // Saturating: a cluster of many pools would overflow the product.
    let product = |k: usize| (counts.iter()).fold(1usize, |a, &n| a.saturating_mul(n.min(k)));
    let most = counts.iter().copied().max().unwrap_or(1);
    (1..=most)
        .take_while(|&k| product(k) <= MOST_COMBINATIONS)
        .last()
        .unwrap_or(1)
}

/// Every index vector below `limits`, the first index fastest.
pub(in crate::planner) fn combinations(limits: &[usize]) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new()];
    for &limit in limits {
        out = (out.into_iter())
            .flat_map(|prefix| {
                (0..limit).map(move |i| {
                    let mut next = prefix.clone();
                    next.push(i);
                    next
                })
            })
            .collect();
    }
    out
}
