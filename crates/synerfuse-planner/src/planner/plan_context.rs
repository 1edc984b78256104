//! The pricing context of a plan already laid out: its units (devices, or its
//! tensor-parallel groups), each stage's or pool's own expert-parallel size, and the
//! expert-parallel groups whose members meet at every MoE layer.

use super::{
    context::Ctx,
    outcome::{Candidate, PoolLayout},
};
use crate::cost::CostModel;

/// A context pricing `c`'s units (devices, or its tensor-parallel groups) on `cost`.
pub(super) fn candidate_ctx<'a>(cost: &'a CostModel, c: &Candidate) -> Ctx<'a> {
    match c.groups.is_empty() {
        true => Ctx::new(cost),
        false => Ctx::with_groups(cost, cost.cluster.devices(), c.groups.clone()),
    }
}

/// Gives each unit of stage `i` of `grid` the size `by_stage[i]`.
pub(super) fn stage_sizes(ctx: &mut Ctx<'_>, grid: &[Vec<usize>], by_stage: &[usize]) {
    let mut per_unit = vec![1; ctx.devices.len()];
    for (row, &ep) in grid.iter().zip(by_stage) {
        for &unit in row {
            per_unit[unit] = ep;
        }
    }
    ctx.set_expert_parallel(per_unit);
}

/// Gives each unit of pool `k` the size `by_pool[k]`, and each pool's groups lockstep.
pub(super) fn pool_sizes(ctx: &mut Ctx<'_>, pools: &[PoolLayout], by_pool: &[usize]) {
    let mut per_unit = vec![1; ctx.devices.len()];
    for (pool, &ep) in pools.iter().zip(by_pool) {
        for &unit in pool.devices.iter().flatten() {
            per_unit[unit] = ep;
        }
    }
    ctx.set_expert_parallel(per_unit);
    ctx.lockstep = pool_groups(pools, by_pool);
}

/// The units of each expert-parallel group of `layouts` (groups of `ep` consecutive
/// replicas of a pool, stage by stage): none without expert parallelism.
pub(super) fn expert_groups(layouts: &[PoolLayout], ep: usize) -> Vec<Vec<usize>> {
    pool_groups(layouts, &vec![ep; layouts.len()])
}

/// Each pool's expert-parallel groups (consecutive replicas of `by_pool[k]`), one unit
/// per member, stage by stage: the units that meet at every MoE layer.
pub(super) fn pool_groups(pools: &[PoolLayout], by_pool: &[usize]) -> Vec<Vec<usize>> {
    (pools.iter().zip(by_pool))
        .filter(|(_, &ep)| ep > 1)
        .flat_map(|(pool, &ep)| pool.devices.iter().flat_map(move |row| row.chunks(ep)))
        .map(<[usize]>::to_vec)
        .collect()
}
