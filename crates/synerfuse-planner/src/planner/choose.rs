//! Choosing the plan: the grid search and the per-replica searches (on a folded
//! cluster's copy where it is one), the front runners re-timed by simulation, split
//! down to the sample and given their own expert-parallel sizes where faster, beside
//! what an expert would write by hand and what a perfect job would reach.

use super::{
    context::Ctx,
    error::{Infeasibility, PlanningError},
    expert::best_expert,
    fold::{self, Fold, FOLD_ABOVE},
    grid::retime_front,
    outcome::{ExpertLayout, PlanOutcome, PooledCandidate, ThroughputBound},
    refine::refine_grid,
    request::{micro_batch_sizes, PlanRequest, TrainOptions},
    search::{plan_pooled_options, search_grids, variants, GridsFound},
    stage_experts::{per_pool_expert_parallel, per_stage_expert_parallel},
};
use crate::cluster::Device;
use crate::cost::CostModel;

/// Plans `request` on `cost`'s cluster and model (a cluster of more than
/// [`FOLD_ABOVE`] devices, folded where it is copies of a smaller one: see `fold`).
pub fn plan(cost: &CostModel, request: &PlanRequest) -> Result<PlanOutcome, PlanningError> {
    plan_folding_above(cost, request, FOLD_ABOVE)
}

/// [`plan`], folding clusters of more than `fold_above` devices.
pub(super) fn plan_folding_above(
    cost: &CostModel,
    request: &PlanRequest,
    fold_above: usize,
) -> Result<PlanOutcome, PlanningError> {
    let mut ctx = Ctx::new(cost);
    let n = ctx.devices.len();
    let g = request.global_batch_size;
    check_request(cost, request)?;
    let keep = request.top_k.max(1);
    let fold = fold::fold(cost, request, fold_above);
    let variants = variants(cost, request);
    let GridsFound {
        candidates,
        considered,
        closest,
    } = search_whole_grids(cost, &variants, request, fold.as_ref())?;
    // Per-replica pipelines may fit where no grid does (a small device in a pipeline of
    // its own, or a tensor-parallel group).
    // What an expert would write by hand, priced alike: a floor under the written plan.
    let (pooled, expert) = match &fold {
        Some(fold) => fold::per_replica_plans(cost, request, fold)?,
        None => (
            plan_pooled_options(cost, request, None)?,
            best_expert(cost, request, None)?,
        ),
    };
    let (mut plans, uniform_layouts) = match candidates.is_empty() {
        true => (Vec::new(), Vec::new()),
        false => retime_front(&variants, candidates, keep)?,
    };
    // Pools of their own expert-parallel sizes, where faster.
    let pooled = match &pooled {
        Some(p) => per_pool_expert_parallel(cost, request, p)?.or(pooled),
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
        Some(best) if best.options.expert_parallel == 1 => refine_grid(cost, best, g)?,
        _ => None,
    };
    // Stages of their own expert-parallel sizes, where faster.
    if let Some(best) = plans.first() {
        if let Some(mixed) = per_stage_expert_parallel(cost, request, best)? {
            plans.insert(0, mixed);
            plans.truncate(keep);
        }
    }
    let pooled = fastest_per_replica(pooled, refined, expert.as_ref());
    let uniform = uniform_layouts.first().cloned();
    let bound = throughput_bound(&mut ctx, request)?;
    Ok(PlanOutcome {
        plans,
        uniform,
        uniform_layouts,
        pooled,
        expert,
        considered,
        bound,
        unpriced_optimizer: unpriced_optimizer(cost, &ctx.devices),
        folded: fold.as_ref().map_or(1, |f| f.factor),
    })
}

/// Refuses a request with nothing to plan (no layers, or no samples), or whose
/// expert-parallel sizes divide none of the model's experts.
fn check_request(cost: &CostModel, request: &PlanRequest) -> Result<(), PlanningError> {
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
    Ok(())
}

/// The grid search on the whole cluster: of a folded one, only the grids its copy
/// chose (every grid where those lay out none).
fn search_whole_grids(
    cost: &CostModel,
    variants: &[(TrainOptions, CostModel)],
    request: &PlanRequest,
    fold: Option<&Fold>,
) -> Result<GridsFound, PlanningError> {
    let only = match fold {
        Some(fold) => fold::grid_shapes(fold)?,
        None => None,
    };
    let found = search_grids(cost, variants, request, only.as_ref())?;
    if only.is_some() && found.candidates.is_empty() {
        // The copy prices sharded state over fewer holders: what it chose may not be
        // what fits the whole.
        return search_grids(cost, variants, request, None);
    }
    Ok(found)
}

/// The per-replica plan written: the fastest of what the per-replica search found
/// (`pooled`), the best grid plan split down to the sample (`refined`) and the
/// expert's layout.
fn fastest_per_replica(
    pooled: Option<PooledCandidate>,
    refined: Option<PooledCandidate>,
    expert: Option<&ExpertLayout>,
) -> Option<PooledCandidate> {
    let pooled = match (pooled, refined) {
        (Some(p), Some(r)) if r.step_time_s < p.step_time_s => Some(r),
        (None, Some(r)) => Some(r),
        (p, _) => p,
    };
    match (pooled, expert) {
        (Some(p), Some(e)) if e.candidate.step_time_s < p.step_time_s => Some(e.candidate.clone()),
        (None, Some(e)) => Some(e.candidate.clone()),
        (p, _) => p,
    }
}

/// The kinds of `devices` whose optimizer step `cost` has no price for, each once.
fn unpriced_optimizer(cost: &CostModel, devices: &[Device]) -> Vec<String> {
    let mut kinds: Vec<String> = (devices.iter())
        .filter(|d| cost.optimizer_seconds(d, 1.0).is_none())
        .map(|d| d.kind.clone())
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

/// Each device alone: the global batch through the whole model at the pace of the
/// request's micro-batch size it computes a sample fastest at (whether or not it
/// divides the batch: plans mix sizes), plus its optimizer step.
pub(super) fn throughput_bound(
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
