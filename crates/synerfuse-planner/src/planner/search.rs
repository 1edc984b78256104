//! The searches under each option a request allows: the grid search (recomputation
//! where memory binds, sharding where it binds or re-priced, each tensor- and
//! context-parallel size) and the per-replica-pipeline search (each recomputation and
//! expert-parallel size, re-timed with the distributed optimizer).

use super::{
    context::Ctx,
    error::{PlanningError, Violation},
    grid::{grid_search, reprice, Search},
    outcome::{Candidate, PooledCandidate},
    plan_context::expert_groups,
    pooled::plan_pooled_noting_memory,
    refine::refine_samples,
    request::{micro_batch_sizes, Choice, PlanRequest, TrainOptions},
    shapes::{GridShape, PooledShape, UnitShape},
    simulate::simulate_pools,
    tensor::TpGroup,
};
use crate::cost::{CostModel, Recompute};
use std::collections::{BTreeSet, HashMap, HashSet};

/// What the grid search found: candidates, how many were considered, and the
/// infeasible one closest to fitting.
#[derive(Default)]
pub(super) struct GridsFound {
    pub(super) candidates: Vec<Candidate>,
    pub(super) considered: usize,
    pub(super) closest: Option<Violation>,
}

/// The grid search under each option the request allows (recomputation tried where
/// memory bound; sharding where it binds, else re-priced) at each tensor-parallel size;
/// with `only`, just those grids.
pub(super) fn search_grids(
    cost: &CostModel,
    variants: &[(TrainOptions, CostModel)],
    request: &PlanRequest,
    only: Option<&HashSet<GridShape>>,
) -> Result<GridsFound, PlanningError> {
    let (mut candidates, mut considered) = (Vec::new(), 0);
    let mut closest: Option<Violation> = None;
    let devices = cost.cluster.devices();
    // Per option and unit shape (tensor-, context-parallel size), whether memory ruled
    // anything out, and the layouts found without it.
    type Searched = HashMap<(TrainOptions, UnitShape), (bool, Vec<Candidate>)>;
    let mut searched: Searched = HashMap::new();
    let optimizer_priced = (devices.iter()).any(|d| cost.optimizer_seconds(d, 1.0).is_some());
    let tp = (request.tp_sizes().into_iter())
        .filter(|&t| only.is_none_or(|s| s.iter().any(|x| x.tensor_parallel_size == t)))
        .map(|t| (t, 1));
    let tp: Vec<UnitShape> = tp.collect();
    // Context parallelism (of each tensor-parallel size searched) on grids a folded copy
    // did not choose from: none.
    let cp: Vec<UnitShape> = (request.cp_sizes().into_iter())
        .filter(|_| only.is_none())
        .flat_map(|c| tp.iter().map(move |&(t, _)| (t, c)))
        .collect();
    let shapes: Vec<UnitShape> = tp.into_iter().chain(cp).collect();
    let grids = (variants.iter()).flat_map(|v| shapes.iter().map(move |&t| (v, t)));
    for ((options, variant), t) in grids {
        let options = *options;
        // Splitting sequences only saves memory (at the price of the exchange):
        // searched where memory ruled layouts out without it.
        let without_bound = |searched: &Searched| {
            (searched.iter()).any(|((o, (_, c)), (bound, _))| *o == options && *c == 1 && *bound)
        };
        if t.1 > 1 && !without_bound(&searched) {
            continue;
        }
        let Some(mut ctx) = grid_context(variant, t)? else {
            continue;
        };
        // Whether memory bound the search without recomputation, or without sharding.
        let bound = |recompute, distributed_optimizer| {
            let options = TrainOptions {
                recompute,
                distributed_optimizer,
                ..options
            };
            searched.get(&(options, t)).map(|(bound, _)| *bound)
        };
        let (d, plain) = (
            options.distributed_optimizer,
            options.recompute == Recompute::Never,
        );
        let unsharded = bound(Recompute::Never, false);
        // Shapes a folded cluster's copy chose are laid out as chosen.
        let search = if only.is_none()
            && options.recompute == Recompute::WhereNeeded
            && bound(Recompute::Never, d) == Some(false)
        {
            // Recomputation only saves memory at a cost in time: tried where memory bound.
            Search::default()
        } else if only.is_none() && plain && d && unsharded == Some(false) {
            // Sharding saves memory and the optimizer's time: where memory did not bind,
            // the same layouts re-priced (nothing to gain where the optimizer is unpriced).
            match optimizer_priced {
                true => {
                    let unsharded = TrainOptions {
                        recompute: Recompute::Never,
                        distributed_optimizer: false,
                        ..options
                    };
                    reprice(&mut ctx, &searched[&(unsharded, t)].1)?
                }
                false => Search::default(),
            }
        } else {
            let shapes = only.map(|s| {
                (s.iter())
                    .filter(|x| x.recompute == options.recompute && x.tensor_parallel_size == t.0)
                    .map(|x| (x.stages, x.arrangement))
                    .collect()
            });
            grid_search(&mut ctx, request, shapes.as_ref())?
        };
        considered += search.considered;
        if let Some(v) = search.closest {
            if closest.as_ref().is_none_or(|c| v.ratio < c.ratio) {
                closest = Some(v);
            }
        }
        let found = search.candidates.clone();
        searched.insert((options, t), (ctx.memory_bound.get(), found));
        candidates.extend(search.candidates);
    }
    Ok(GridsFound {
        candidates,
        considered,
        closest,
    })
}

/// `cost` under each option the request's grids are searched with.
pub(super) fn variants(cost: &CostModel, request: &PlanRequest) -> Vec<(TrainOptions, CostModel)> {
    let experts = cost.model.experts.map(|e| e.num_experts);
    (request
        .grid_options(experts, TrainOptions::of(cost))
        .into_iter())
    .map(|options| (options, options.cost(cost)))
    .collect()
}

/// The units of a grid of tensor-parallel size `t`: groups of one node's devices with
/// even shares (Megatron's flags split evenly; uneven groups are per-replica
/// pipelines'), `None` where the cluster does not cut so. Of context-parallel size `c`:
/// groups of `c` such units of one node with the token shares that suit them (a plan
/// file's `cp_shares`; even shares are Megatron's `--context-parallel-size`).
fn grid_context(cost: &CostModel, (t, c): UnitShape) -> Result<Option<Ctx<'_>>, PlanningError> {
    if c > 1 {
        return Ctx::context_parallel(cost, c, t);
    }
    let even = |g: &TpGroup| g.shares.iter().all(|&s| s == g.shares[0]);
    Ok(Ctx::tensor_parallel(cost, t)?.filter(|ctx| ctx.groups.iter().all(even)))
}

/// The best per-replica-pipeline plan with and without recomputation (as asked), with
/// the distributed optimizer where asked for (auto: where it is faster), searched
/// without it (its shards only lower what the plans need) and re-timed with it; with
/// `only`, just that recomputation and those pools' shapes.
pub(super) fn plan_pooled_options(
    cost: &CostModel,
    request: &PlanRequest,
    only: Option<&PooledShape>,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let mut best: Option<PooledCandidate> = None;
    let experts = cost.model.experts.map(|e| e.num_experts);
    let ep_sizes: BTreeSet<usize> = (request.grid_options(experts, TrainOptions::of(cost)).iter())
        .map(|o| o.expert_parallel)
        .filter(|&ep| only.is_none_or(|s| s.expert_parallel == ep))
        .collect();
    for ep in ep_sizes {
        let found = plan_pooled_at(cost, request, only, ep)?;
        if let Some(c) =
            found.filter(|c| best.as_ref().is_none_or(|b| c.step_time_s < b.step_time_s))
        {
            best = Some(c);
        }
    }
    Ok(best)
}

/// [`plan_pooled_options`] at expert-parallel size `ep` (groups of `ep` alike replicas of
/// a pool dividing each stage's experts, each member the same micro-batches; the batch
/// then not refined down to the sample).
fn plan_pooled_at(
    cost: &CostModel,
    request: &PlanRequest,
    only: Option<&PooledShape>,
    ep: usize,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let (g, sizes, tp, cp) = (
        request.global_batch_size,
        micro_batch_sizes(request),
        request.tp_sizes(),
        request.cp_sizes(),
    );
    let (mut best, mut bound): (Option<PooledCandidate>, Option<bool>) = (None, None);
    for &recompute in request.recompute.recompute() {
        // Recomputation only saves memory at a cost in time: tried where memory bound.
        if recompute == Recompute::WhereNeeded && bound == Some(false) {
            continue;
        }
        if only.is_some_and(|s| s.recompute != recompute) {
            continue;
        }
        let options = TrainOptions {
            recompute,
            distributed_optimizer: request.distributed_optimizer == Choice::On,
            expert_parallel: ep,
            ..TrainOptions::of(cost)
        };
        let variant = TrainOptions {
            distributed_optimizer: false,
            ..options
        }
        .cost(cost);
        let (found, memory_bound) =
            plan_pooled_noting_memory(&variant, g, &sizes, (&tp, &cp), only.map(|s| &s.pools[..]))?;
        bound = Some(memory_bound);
        if let Some(found) = found {
            let devices = variant.cluster.devices();
            let mut ctx = Ctx::with_groups(&variant, devices, found.groups.clone());
            let mut c = match ep {
                1 => refine_samples(&mut ctx, &found, g)?,
                _ => found,
            };
            c.options = options;
            // Sharding is priced as for grid plans (its memory is not: it only lowers it).
            let shardable = c.replicas().count() > 1;
            if request.distributed_optimizer != Choice::Off && shardable {
                let sharded = retime_sharded(cost, &c, recompute)?;
                if request.distributed_optimizer == Choice::On
                    || sharded.step_time_s < c.step_time_s
                {
                    c = sharded;
                }
            }
            if best.as_ref().is_none_or(|b| c.step_time_s < b.step_time_s) {
                best = Some(c);
            }
        }
    }
    Ok(best)
}

/// `c` re-timed with the distributed optimizer: each segment's optimizer state sharded
/// over its holders in proportion to their memory.
fn retime_sharded(
    cost: &CostModel,
    c: &PooledCandidate,
    recompute: Recompute,
) -> Result<PooledCandidate, PlanningError> {
    let variant = TrainOptions {
        recompute,
        distributed_optimizer: true,
        ..c.options
    }
    .cost(cost);
    let mut ctx = Ctx::with_groups(&variant, variant.cluster.devices(), c.groups.clone());
    ctx.lockstep = expert_groups(&c.pools, c.options.expert_parallel);
    let (mut sharded, _) = simulate_pools(&mut ctx, c.pools.clone(), false)?;
    sharded.options.expert_parallel = c.options.expert_parallel;
    Ok(sharded)
}
