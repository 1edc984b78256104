//! Any plan of a job's ranks priced on a cost model: each replica a pipeline of its own,
//! simulated as the planner simulates per-replica pipelines (the schedule, the
//! reduction, the optimizer), under expert parallelism each group in lockstep.

use super::job::ReplanError;
use crate::cost::CostModel;
use crate::planner::{
    context::Ctx, outcome::PoolLayout, simulate::simulate_pools, tensor::TpGroup,
};
use synerfuse_plan::timeline::RankTimeline;
use synerfuse_plan::{ModelShape, Plan};

/// The unit of `replica`'s `stage`: a rank alone, a tensor-parallel group, or a
/// context-parallel group (of tensor-parallel groups).
pub(super) fn stage_group(
    model: &ModelShape,
    plan: &Plan,
    replica: usize,
    stage: usize,
) -> Result<TpGroup, ReplanError> {
    let r = &plan.replicas()[replica];
    let ranks = r.ranks[stage].clone();
    if ranks.len() == 1 {
        return Ok(TpGroup::single(ranks[0]));
    }
    let shares = r.shares(stage);
    let c = r.cp_size(stage);
    if c > 1 {
        let cp_shares = (r.context_shares(stage)).unwrap_or_else(|| vec![1; c]);
        return TpGroup::context_of_tensor(model, ranks, cp_shares.clone(), shares.clone())
            .ok_or_else(
                || match TpGroup::context(model, (0..c).collect(), cp_shares.clone()) {
                    None => ReplanError::ContextShares {
                        replica,
                        stage,
                        shares: cp_shares,
                    },
                    Some(_) => ReplanError::Shares {
                        replica,
                        stage,
                        shares,
                    },
                },
            );
    }
    TpGroup::new(model, ranks, shares.clone()).ok_or(ReplanError::Shares {
        replica,
        stage,
        shares,
    })
}

/// The simulated step of `plan` on `cost`'s cluster, rank `r` on device `r`: each
/// replica a pipeline of its own, priced as the planner prices per-replica pipelines.
pub fn predict_step_s(cost: &CostModel, plan: &Plan) -> Result<f64, ReplanError> {
    Ok(simulate_plan(cost, plan, false)?.0)
}

/// [`predict_step_s`] with every rank's simulated spans, in `plan`'s rank order.
pub fn predict_timeline(
    cost: &CostModel,
    plan: &Plan,
) -> Result<(f64, Vec<RankTimeline>), ReplanError> {
    let (step_s, rows) = simulate_plan(cost, plan, true)?;
    // The simulation numbers ranks replica by replica, stage by stage; the plan may not.
    let order: Vec<usize> = plan.replicas().iter().flat_map(|r| r.all_ranks()).collect();
    let mut by_rank: Vec<Option<RankTimeline>> = vec![None; rows.len()];
    for (row, &rank) in rows.into_iter().zip(&order) {
        by_rank[rank] = Some(row);
    }
    let rows = by_rank.into_iter().map(Option::unwrap_or_default).collect();
    Ok((step_s, rows))
}

/// The simulated step of `plan` (see [`predict_step_s`]), with its spans when `record`.
fn simulate_plan(
    cost: &CostModel,
    plan: &Plan,
    record: bool,
) -> Result<(f64, Vec<RankTimeline>), ReplanError> {
    if plan.has_chunks() {
        return Err(ReplanError::Interleaved);
    }
    let (mut groups, mut pools) = (Vec::new(), Vec::new());
    let mut first_unit = Vec::with_capacity(plan.replicas().len());
    for (replica, r) in plan.replicas().iter().enumerate() {
        first_unit.push(groups.len());
        let mut devices = Vec::with_capacity(r.ranks.len());
        for stage in 0..r.ranks.len() {
            devices.push(vec![groups.len()]);
            groups.push(stage_group(&cost.model, plan, replica, stage)?);
        }
        // Priced as its samples in micro-batches of its largest, the last one short
        // (micro-batch sizes in another order or mix are priced so too).
        let (largest, samples) = (r.batch.micro_batch_size(), r.batch.samples());
        let count = samples.div_ceil(largest);
        pools.push(PoolLayout {
            devices,
            layers: r.stages.layers(),
            micro_batch_size: largest,
            micro_batches: vec![count],
            short: vec![count * largest - samples],
        });
    }
    let units = groups.len();
    let mut ctx = Ctx::with_groups(cost, cost.cluster.devices(), groups);
    // Under expert parallelism each member priced holding its part of the experts and
    // exchanging every MoE layer's tokens, its group meeting at each exchange; each
    // stage at its own group's size.
    let (sizes, lockstep) = expert_lockstep(cost, plan, &first_unit, units)?;
    ctx.set_expert_parallel(sizes);
    ctx.lockstep = lockstep;
    let (candidate, rows) = simulate_pools(&mut ctx, pools, record)?;
    Ok((candidate.step_time_s, rows))
}

/// Per unit of `plan` (replica `r`'s stage `s` is unit `first_unit[r] + s`, of
/// `units`), its expert-parallel group's size (1: it holds every expert), and each
/// group's units.
fn expert_lockstep(
    cost: &CostModel,
    plan: &Plan,
    first_unit: &[usize],
    units: usize,
) -> Result<(Vec<usize>, Vec<Vec<usize>>), ReplanError> {
    let mut sizes = vec![1; units];
    let Some(shape) = cost.model.experts else {
        return Ok((sizes, Vec::new()));
    };
    let lockstep: Vec<Vec<usize>> = (plan.expert_groups(shape.num_experts)?.iter())
        .map(|g| {
            g.replicas
                .iter()
                .map(|&r| first_unit[r] + g.stage)
                .collect()
        })
        .collect();
    for group in &lockstep {
        for &unit in group {
            sizes[unit] = group.len();
        }
    }
    Ok((sizes, lockstep))
}
