//! Plans whose stages (grid plans) or pools (per-replica pipelines) divide the experts
//! over groups of their own sizes, as SynerFuse's meshes each take their own
//! expert-parallel size: where reducing a stage's expert gradients costs less than its
//! all-to-alls, or its devices have memory to spare, it keeps every expert; elsewhere
//! it divides them. Searched from the best plan of one size, a stage or pool at a time.

use super::{
    context::Ctx,
    error::PlanningError,
    grid::{Arranged, Search},
    outcome::{Arrangement, Candidate, PooledCandidate},
    plan_context::{candidate_ctx, pool_sizes, stage_sizes},
    pooled::{balance, polish, PoolOption},
    request::{PlanRequest, TrainOptions},
    simulate::{simulate_candidate, simulate_pools},
};
use crate::cost::CostModel;

/// The most units (devices, or tensor-parallel groups) a plan may have for its stages or
/// pools to be tried at other sizes: each try splits and simulates the whole plan again.
const SEARCHED_UNITS: usize = 4096;

/// The request's expert-parallel sizes dividing the model's experts, ascending.
fn searched_sizes(request: &PlanRequest, experts: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = (request
        .grid_options(Some(experts), TrainOptions::default())
        .iter())
    .map(|o| o.expert_parallel)
    .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// `best` with each stage at its own expert-parallel size (of the request's, dividing
/// the experts and the replicas), a stage at a time while that makes the simulated step
/// faster, its layers and batch split again at each; `None` where no stage is faster at
/// another size.
pub(super) fn per_stage_expert_parallel(
    cost: &CostModel,
    request: &PlanRequest,
    best: &Candidate,
) -> Result<Option<Candidate>, PlanningError> {
    let Some(shape) = cost.model.experts else {
        return Ok(None);
    };
    let (p, d) = (best.layers.len(), best.micro_batches.len());
    let sizes: Vec<usize> = (searched_sizes(request, shape.num_experts).into_iter())
        .filter(|&ep| d % ep == 0)
        .collect();
    // Megatron's tp-pp-dp order (by replica) has no expert-parallel dimension.
    let by_replica = best.arrangement == Arrangement::ByReplica;
    if p < 2 || sizes.len() < 2 || p * d > SEARCHED_UNITS || by_replica {
        return Ok(None);
    }
    let variant = best.options.cost(cost);
    descend(
        best,
        best.expert_parallel_sizes(),
        (&sizes, |_, _| true),
        |c| c.prediction.step_time_s,
        |from, trial| priced(&variant, from, trial, request.global_batch_size),
    )
}

/// `from`'s grid with stage `i`'s experts divided over groups of `by_stage[i]`: its
/// layout and the layouts of splitting its layers and batch again, the fastest by the
/// closed form, simulated; `None` where none fits.
fn priced(
    variant: &CostModel,
    from: &Candidate,
    by_stage: &[usize],
    samples: usize,
) -> Result<Option<Candidate>, PlanningError> {
    let mut ctx = candidate_ctx(variant, from);
    stage_sizes(&mut ctx, &from.devices, by_stage);
    let grid = Arranged {
        devices: &from.devices,
        arrangement: from.arrangement,
    };
    let layout = (
        from.layers.clone(),
        from.micro_batch_sizes.clone(),
        from.micro_batches.clone(),
    );
    let mut search = Search::default();
    search.consider(&mut ctx, grid, layout, from.origin)?;
    let (sizes, m) = (&from.micro_batch_sizes, from.micro_batches.clone());
    search.alternate(&mut ctx, grid, sizes, samples, m)?;
    let fastest = (search.candidates.into_iter())
        .min_by(|a, b| (a.prediction.step_time_s).total_cmp(&b.prediction.step_time_s));
    let Some(mut c) = fastest else {
        return Ok(None);
    };
    c.prediction = simulate_candidate(&mut ctx, &c)?;
    // Every stage at one size: the grid plan of that size.
    c.options.expert_parallel = by_stage.iter().copied().max().unwrap_or(1);
    if by_stage.iter().all(|&ep| ep == by_stage[0]) {
        c.stage_expert_parallel.clear();
    }
    Ok(Some(c))
}

/// `best` with each pool's replicas at their own expert-parallel size (of the request's,
/// dividing the experts and the pool's replicas), a pool at a time while that makes the
/// simulated step faster, the batch and each pool's layers split again at each; `None`
/// where no pool is faster at another size.
pub(super) fn per_pool_expert_parallel(
    cost: &CostModel,
    request: &PlanRequest,
    best: &PooledCandidate,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let Some(shape) = cost.model.experts else {
        return Ok(None);
    };
    let pools = best.pools.len();
    let sizes = searched_sizes(request, shape.num_experts);
    let units: usize = (best.pools.iter())
        .map(|pool| pool.devices.len() * pool.micro_batches.len())
        .sum();
    if pools < 2 || sizes.len() < 2 || units > SEARCHED_UNITS {
        return Ok(None);
    }
    // Every unit at its own size below: the base holds every expert.
    let variant = TrainOptions {
        expert_parallel: 1,
        ..best.options
    }
    .cost(cost);
    let first: Vec<usize> = (0..pools).map(|k| best.expert_parallel_of(k)).collect();
    let replicas = |k: usize| best.pools[k].micro_batches.len();
    descend(
        best,
        first,
        (&sizes, |k, ep| replicas(k) % ep == 0),
        |c| c.step_time_s,
        |from, trial| priced_pools(&variant, from, trial, request),
    )
}

/// From `first` (a size per stage or pool), each in turn at each of `sizes` it allows,
/// a trial (priced by `price` from the plan so far) kept where its step (`step_s`) is
/// faster, until none is; the plan where its sizes moved from `first`.
fn descend<C: Clone>(
    best: &C,
    first: Vec<usize>,
    (sizes, allows): (&[usize], impl Fn(usize, usize) -> bool),
    step_s: impl Fn(&C) -> f64,
    mut price: impl FnMut(&C, &[usize]) -> Result<Option<C>, PlanningError>,
) -> Result<Option<C>, PlanningError> {
    let (mut current, mut by_slot) = (best.clone(), first.clone());
    let mut improved = true;
    while improved {
        improved = false;
        for slot in 0..first.len() {
            for &ep in sizes.iter().filter(|&&ep| allows(slot, ep)) {
                if ep == by_slot[slot] {
                    continue;
                }
                let mut trial = by_slot.clone();
                trial[slot] = ep;
                let Some(c) = price(&current, &trial)? else {
                    continue;
                };
                if step_s(&c) < step_s(&current) * (1.0 - 1e-9) {
                    (current, by_slot, improved) = (c, trial, true);
                }
            }
        }
    }
    Ok((by_slot != first).then_some(current))
}

/// `from`'s pools with pool `k`'s experts divided over groups of `by_pool[k]`
/// consecutive replicas: the batch and layers split again for it, polished, simulated;
/// `None` where the batch does not split so or a split does not fit.
fn priced_pools(
    variant: &CostModel,
    from: &PooledCandidate,
    by_pool: &[usize],
    request: &PlanRequest,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let devices = variant.cluster.devices();
    let mut ctx = Ctx::with_groups(variant, devices, from.groups.clone());
    pool_sizes(&mut ctx, &from.pools, by_pool);
    let options: Vec<PoolOption> = (from.pools.iter())
        .map(|pool| PoolOption {
            devices: pool.devices.clone(),
            layers: pool.layers.clone(),
            micro_batch_size: pool.micro_batch_size,
            rate: 0.0,
        })
        .collect();
    let chosen: Vec<&PoolOption> = options.iter().collect();
    let Some((step, layouts)) = balance(&mut ctx, &chosen, request.global_batch_size)? else {
        return Ok(None);
    };
    let (_, layouts) = polish(&mut ctx, layouts, step)?;
    let (mut c, _) = simulate_pools(&mut ctx, layouts, false)?;
    c.options = TrainOptions {
        expert_parallel: by_pool.iter().copied().max().unwrap_or(1),
        ..from.options
    };
    c.pool_expert_parallel = match by_pool.iter().all(|&ep| ep == by_pool[0]) {
        true => Vec::new(),
        false => by_pool.to_vec(),
    };
    Ok(Some(c))
}
