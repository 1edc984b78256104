//! The layouts a Megatron user would start from, priced with the planner's own model as
//! a floor under what it writes: one tensor-parallel size in every node (1, 2, 4, 8),
//! as few pipeline stages as memory allows with the layers split evenly, data
//! parallelism over the rest; either one layout for the whole cluster (every replica
//! the same depth and batch, as Megatron runs) or one per pool of alike devices (each
//! pool its own depth, the batch split by pace). Of a mixture of experts, at each
//! expert-parallel size asked for: groups of that many consecutive replicas of a pool
//! (alike devices, one depth) divide each stage's experts, each group's members taking
//! the same micro-batches.

use super::{
    context::Ctx,
    error::PlanningError,
    grid::arrange,
    outcome::{Arrangement, ExpertLayout, PoolLayout},
    plan_context::expert_groups,
    pooled::{closed_form_step_s, fits_all, group_paces, per_member, pools, whole_groups},
    request::{micro_batch_sizes, Choice, PlanRequest, TrainOptions},
    samples::min_max_samples,
    simulate::simulate_pools,
    split::even_layers,
};
use crate::cost::{CostModel, Recompute};
use std::collections::BTreeSet;

/// The fastest expert layout (closed form to choose, then simulated), if any fits; with
/// `only`, of that layout's recomputation, sizes and depths rule.
pub(super) fn best_expert(
    cost: &CostModel,
    request: &PlanRequest,
    only: Option<&ExpertLayout>,
) -> Result<Option<ExpertLayout>, PlanningError> {
    let (g, sizes) = (request.global_batch_size, micro_batch_sizes(request));
    let mut best: Option<(f64, TrainOptions, usize, bool, Vec<PoolLayout>)> = None;
    let chosen = |options: TrainOptions, t, per_pool, b| {
        only.is_none_or(|e| {
            e.candidate.options.recompute == options.recompute
                && e.candidate.options.expert_parallel == options.expert_parallel
                && e.tensor_parallel_size == t
                && e.per_pool == per_pool
                && e.candidate.pools.first().map(|p| p.micro_batch_size) == Some(b)
        })
    };
    let experts = cost.model.experts.map(|e| e.num_experts);
    let ep_sizes: BTreeSet<usize> = (request.grid_options(experts, TrainOptions::of(cost)).iter())
        .map(|o| o.expert_parallel)
        .collect();
    let choices = (recompute_choices(request.recompute).iter())
        .flat_map(|&r| ep_sizes.iter().map(move |&ep| (r, ep)));
    for (recompute, expert_parallel) in choices {
        let options = TrainOptions {
            recompute,
            distributed_optimizer: request.distributed_optimizer != Choice::Off,
            expert_parallel,
            ..TrainOptions::of(cost)
        };
        let variant = options.cost(cost);
        for t in request.tp_sizes() {
            if only.is_some_and(|e| e.tensor_parallel_size != t) {
                continue;
            }
            let Some(mut ctx) = Ctx::tensor_parallel(&variant, t)? else {
                continue;
            };
            let pools = pools(&mut ctx)?;
            for per_pool in [false, true] {
                for &b in &sizes {
                    if !chosen(options, t, per_pool, b) {
                        continue;
                    }
                    let Some(layouts) = expert_layouts(&mut ctx, &pools, g, b, per_pool)? else {
                        continue;
                    };
                    let step = closed_form_step_s(&mut ctx, &layouts)?;
                    if best.as_ref().is_none_or(|(s, ..)| step < *s) {
                        best = Some((step, options, t, per_pool, layouts));
                    }
                }
            }
        }
    }
    let Some((_, options, t, per_pool, layouts)) = best else {
        return Ok(None);
    };
    let variant = options.cost(cost);
    let mut ctx = Ctx::tensor_parallel(&variant, t)?.expect("the size cut the cluster before");
    ctx.lockstep = expert_groups(&layouts, options.expert_parallel);
    let (mut candidate, _) = simulate_pools(&mut ctx, layouts, false)?;
    candidate.options = options;
    Ok(Some(ExpertLayout {
        tensor_parallel_size: t,
        per_pool,
        candidate,
    }))
}

/// An expert recomputes everything or nothing (Megatron's `--recompute-activations`).
fn recompute_choices(choice: Choice) -> &'static [Recompute] {
    match choice {
        Choice::Off => &[Recompute::Never],
        Choice::On => &[Recompute::Always],
        Choice::Auto => &[Recompute::Never, Recompute::Always],
    }
}

/// The expert's layouts of `pools` at micro-batch size `b`: each pool as shallow as
/// fits with even layers (all as deep as the deepest needs, unless `per_pool`), the
/// batch split evenly over every replica (Megatron's data parallelism; `None` unless it
/// divides) or, `per_pool`, by pace.
fn expert_layouts(
    ctx: &mut Ctx<'_>,
    pools: &[Vec<usize>],
    global_batch: usize,
    b: usize,
    per_pool: bool,
) -> Result<Option<Vec<PoolLayout>>, PlanningError> {
    let mut depths = Vec::with_capacity(pools.len());
    for pool in pools {
        match shallowest(ctx, pool, b, 1)? {
            Some(p) => depths.push(p),
            None => return Ok(None),
        }
    }
    if !per_pool {
        let deepest = depths.iter().copied().max().unwrap_or(1);
        for (pool, p) in pools.iter().zip(&mut depths) {
            match shallowest(ctx, pool, b, deepest)? {
                Some(q) if q == deepest => *p = q,
                _ => return Ok(None),
            }
        }
    }
    let l = ctx.cost.model.num_layers;
    let mut layouts: Vec<PoolLayout> = (pools.iter().zip(&depths))
        .map(|(pool, &p)| {
            let d = pool.len() / p;
            PoolLayout {
                devices: arrange(pool, p, d, Arrangement::ByReplica),
                layers: even_layers(l, p),
                micro_batch_size: b,
                micro_batches: vec![1; d],
                short: Vec::new(),
            }
        })
        .collect();
    let replicas: usize = layouts.iter().map(|p| p.micro_batches.len()).sum();
    let counts = match per_pool {
        false if global_batch % (b * replicas) == 0 => {
            vec![global_batch / (b * replicas); replicas]
        }
        false => return Ok(None),
        true => {
            let mut paces = Vec::with_capacity(replicas);
            for pool in &layouts {
                paces.extend(group_paces(ctx, pool, usize::MAX)?);
            }
            match min_max_samples(global_batch, &paces) {
                Some(counts) => per_member(counts, ctx.cost.expert_parallel).collect(),
                None => return Ok(None),
            }
        }
    };
    let mut counts = counts.into_iter();
    for pool in &mut layouts {
        let d = pool.micro_batches.len();
        pool.micro_batches = counts.by_ref().take(d).collect();
    }
    Ok(fits_all(ctx, &layouts)?.then_some(layouts))
}

/// The fewest stages, at least `from`, dividing the pool and the model's layers into
/// replicas (as many as expert-parallel groups fill) that hold their even layer split
/// with a full pipeline in flight.
fn shallowest(
    ctx: &mut Ctx<'_>,
    pool: &[usize],
    b: usize,
    from: usize,
) -> Result<Option<usize>, PlanningError> {
    let (n, l, ep) = (
        pool.len(),
        ctx.cost.model.num_layers,
        ctx.cost.expert_parallel,
    );
    for p in (from.max(1)..=n.min(l)).filter(|&p| whole_groups(n, p, ep)) {
        let d = n / p;
        let trial = PoolLayout {
            devices: arrange(pool, p, d, Arrangement::ByReplica),
            layers: even_layers(l, p),
            micro_batch_size: b,
            micro_batches: vec![p; d],
            short: Vec::new(),
        };
        if fits_all(ctx, std::slice::from_ref(&trial))? {
            return Ok(Some(p));
        }
    }
    Ok(None)
}
