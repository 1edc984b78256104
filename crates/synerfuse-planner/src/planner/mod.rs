//! The planner: for every (pp, dp) factorization, device arrangement and micro-batch
//! size (one for every replica, or one per replica), an exact layer split (dynamic
//! programme on the slowest stage, subject to memory) alternated with an exact split of
//! the batch over the replicas (greedy on monotone pipeline times; with sizes that
//! differ, a bisection over reachable sample totals), scored by the 1F1B formula, the
//! best re-timed by simulating the real schedule.

mod convert;
mod error;
mod expert;
mod expert_pricing;
mod fold;
mod grid;
mod measured_load;

mod outcome;
mod pooled;
mod pricing;
mod refine;
mod request;
mod running;
mod samples;
mod simulate;
mod split;
mod stage_experts;
mod tensor;

use crate::cost::{CostModel, Recompute};
use error::Violation;
pub use fold::FOLD_ABOVE;
use fold::{GridShape, PooledShape};
use grid::{grid_search, reprice, retime_front, Search};
pub use measured_load::{measured_expert_load, MeasuredLoadError};
use pooled::plan_pooled_noting_memory;
use pricing::Ctx;
use request::micro_batch_sizes;
use simulate::simulate_pools;
use std::collections::{BTreeSet, HashMap, HashSet};

pub use crate::expert_placement::{place_experts, slowest_time, ExpertMember, PlacementError};
pub use error::{Infeasibility, MemoryShortfall, PlanningError};
pub use expert::ExpertLayout;
pub use outcome::{
    Arrangement, BehindBy, Candidate, CandidateOrigin, PlanOutcome, PoolLayout, PooledCandidate,
    Prediction, StepBreakdown, ThroughputBound,
};
pub use pooled::plan_pooled;
pub use request::{Choice, ChoiceError, PlanRequest, TrainOptions};
pub use running::{
    best_plan_for, fitted_cost, fitted_cost_of, predict_step_s, predict_timeline,
    running_job_request, ReplanError, RunningJob,
};
pub use samples::{min_max_samples, ReplicaPace};
pub use simulate::{pooled_timeline, timeline};
pub use split::{min_max_layers, min_max_split};
pub use tensor::{best_context_group, best_group, TpGroup, MOST_SHARE};

/// Plans `request` on `cost`'s cluster and model (a cluster of more than
/// [`FOLD_ABOVE`] devices, folded where it is copies of a smaller one: see `fold`).
pub fn plan(cost: &CostModel, request: &PlanRequest) -> Result<PlanOutcome, PlanningError> {
    plan_folding_above(cost, request, FOLD_ABOVE)
}

/// [`plan`], folding clusters of more than `fold_above` devices.
fn plan_folding_above(
    cost: &CostModel,
    request: &PlanRequest,
    fold_above: usize,
) -> Result<PlanOutcome, PlanningError> {
    let mut ctx = Ctx::new(cost);
    let n = ctx.devices.len();
    let l = cost.model.num_layers;
    let g = request.global_batch_size;
    if l == 0 || g == 0 {
        return Err(PlanningError::EmptyRequest {
            layers: l,
            global_batch_size: g,
        });
    }
    if let Some(e) = cost.model.experts.map(|e| e.num_experts) {
        let sizes = &request.expert_parallel_sizes;
        if !sizes.is_empty() && !sizes.iter().any(|&x| x > 0 && e % x == 0) {
            return Err(PlanningError::ExpertParallelSizes {
                sizes: sizes.clone(),
                experts: e,
            });
        }
    }
    let keep = request.top_k.max(1);
    let fold = fold::fold(cost, request, fold_above);
    let only = match &fold {
        Some(fold) => fold::grid_shapes(fold)?,
        None => None,
    };
    let variants = variants(cost, request);
    let mut found = search_grids(cost, &variants, request, only.as_ref())?;
    if only.is_some() && found.candidates.is_empty() {
        // The copy prices sharded state over fewer holders: what it chose may not be
        // what fits the whole.
        found = search_grids(cost, &variants, request, None)?;
    }
    let GridsFound {
        candidates,
        considered,
        closest,
    } = found;
    // Per-replica pipelines may fit where no grid does (a small device in a pipeline of
    // its own, or a tensor-parallel group).
    // What an expert would write by hand, priced alike: a floor under the written plan.
    let (pooled, expert) = match &fold {
        Some(fold) => fold::per_replica_plans(cost, request, fold)?,
        None => (
            plan_pooled_options(cost, request, None)?,
            expert::best_expert(cost, request, None)?,
        ),
    };
    let (mut plans, uniform_layouts) = match candidates.is_empty() {
        true => (Vec::new(), Vec::new()),
        false => retime_front(&variants, candidates, keep)?,
    };
    // Pools of their own expert-parallel sizes, where faster.
    let pooled = match &pooled {
        Some(p) => stage_experts::per_pool_expert_parallel(cost, request, p)?.or(pooled),
        None => None,
    };
    if plans.is_empty() && pooled.is_none() && expert.is_none() {
        return Err(PlanningError::Infeasible(closest.map_or(
            Infeasibility::BatchTooSmall {
                global_batch_size: g,
                devices: n,
            },
            |v| v.reason,
        )));
    }
    // The best grid plan split down to the sample, when that beats what the per-replica
    // search found (not one whose experts are divided: a group's members take the same
    // micro-batches).
    let refined = match plans.first() {
        Some(best) if best.options.expert_parallel == 1 => refine::refine_grid(cost, best, g)?,
        _ => None,
    };
    // Stages of their own expert-parallel sizes, where faster.
    if let Some(best) = plans.first() {
        if let Some(mixed) = stage_experts::per_stage_expert_parallel(cost, request, best)? {
            plans.insert(0, mixed);
            plans.truncate(keep);
        }
    }
    let pooled = match (pooled, refined) {
        (Some(p), Some(r)) if r.step_time_s < p.step_time_s => Some(r),
        (None, Some(r)) => Some(r),
        (p, _) => p,
    };
    let pooled = match (pooled, &expert) {
        (Some(p), Some(e)) if e.candidate.step_time_s < p.step_time_s => Some(e.candidate.clone()),
        (None, Some(e)) => Some(e.candidate.clone()),
        (p, _) => p,
    };
    let uniform = uniform_layouts.first().cloned();
    let bound = throughput_bound(&mut ctx, request)?;
    let mut unpriced_optimizer: Vec<String> = (ctx.devices.iter())
        .filter(|d| cost.optimizer_seconds(d, 1.0).is_none())
        .map(|d| d.kind.clone())
        .collect();
    unpriced_optimizer.sort();
    unpriced_optimizer.dedup();
    Ok(PlanOutcome {
        plans,
        uniform,
        uniform_layouts,
        pooled,
        expert,
        considered,
        bound,
        unpriced_optimizer,
        folded: fold.as_ref().map_or(1, |f| f.factor),
    })
}

/// What the grid search found: candidates, how many were considered, and the
/// infeasible one closest to fitting.
#[derive(Default)]
struct GridsFound {
    candidates: Vec<Candidate>,
    considered: usize,
    closest: Option<Violation>,
}

/// The grid search under each option the request allows (recomputation tried where
/// memory bound; sharding where it binds, else re-priced) at each tensor-parallel size;
/// with `only`, just those grids.
fn search_grids(
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
                        expert_parallel: options.expert_parallel,
                        ..TrainOptions::default()
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
fn variants(cost: &CostModel, request: &PlanRequest) -> Vec<(TrainOptions, CostModel)> {
    let experts = cost.model.experts.map(|e| e.num_experts);
    (request.grid_options(experts).into_iter())
        .map(|options| (options, options.cost(cost)))
        .collect()
}

/// A grid's units: (tensor-parallel size, context-parallel size).
type UnitShape = (usize, usize);

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
fn plan_pooled_options(
    cost: &CostModel,
    request: &PlanRequest,
    only: Option<&PooledShape>,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let mut best: Option<PooledCandidate> = None;
    let experts = cost.model.experts.map(|e| e.num_experts);
    let ep_sizes: BTreeSet<usize> = (request.grid_options(experts).iter())
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
                1 => refine::refine_samples(&mut ctx, &found, g)?,
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
        expert_parallel: c.options.expert_parallel,
    }
    .cost(cost);
    let mut ctx = Ctx::with_groups(&variant, variant.cluster.devices(), c.groups.clone());
    ctx.lockstep = expert::expert_groups(&c.pools, c.options.expert_parallel);
    let (mut sharded, _) = simulate_pools(&mut ctx, c.pools.clone(), false)?;
    sharded.options.expert_parallel = c.options.expert_parallel;
    Ok(sharded)
}

/// Each device alone: the global batch through the whole model at the pace of the
/// request's micro-batch size it computes a sample fastest at (whether or not it
/// divides the batch: plans mix sizes), plus its optimizer step.
fn throughput_bound(
    ctx: &mut Ctx<'_>,
    request: &PlanRequest,
) -> Result<ThroughputBound, PlanningError> {
    let g = request.global_batch_size;
    let sizes = micro_batch_sizes(request);
    let model = &ctx.cost.model;
    let (layers, params) = (
        model.num_layers as f64,
        model.stage_params(model.num_layers, true, true),
    );
    let tokens = (g * model.seq_length) as f64;
    let mut device_tokens_per_s = Vec::with_capacity(ctx.devices.len());
    for i in 0..ctx.devices.len() {
        let optimizer = ctx
            .cost
            .optimizer_seconds(&ctx.devices[i], params)
            .unwrap_or(0.0);
        let mut best = f64::INFINITY;
        for &b in &sizes {
            let k = ctx.costs(i, b)?;
            let pass = layers * k.layer_s + k.embedding_s + k.head_s;
            best = best.min(g as f64 / b as f64 * pass + optimizer);
        }
        device_tokens_per_s.push(tokens / best);
    }
    Ok(ThroughputBound::new(device_tokens_per_s, g))
}

#[cfg(test)]
mod expert_tests;
#[cfg(test)]
mod tests;
