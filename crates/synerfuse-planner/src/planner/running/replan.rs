//! The re-planning decision: what a running job is re-planned for, and the planner's
//! best plan placed on the job's own ranks.

use super::job::ReplanError;
use super::predict::predict_step_s;
use crate::cost::CostModel;
use crate::planner::{
    choose::plan,
    request::{Choice, PlanRequest},
};
use synerfuse_plan::{Plan, PlanError, RankPlacement, ReplicaPipeline};

/// What a running job is re-planned for (a switch, or the survivors of lost ranks): its
/// own global batch and the options `synerfuse plan` searches by default: micro-batch
/// sizes 1 to 8, tensor- and context-parallel sizes 1 to 8 (within a host; context
/// parallelism where memory binds without it), expert-parallel sizes 1 to 8 (of a
/// mixture of experts: those dividing its experts), recomputation where a
/// stage needs it (every stage when the job runs `--recompute-activations`: the run
/// recomputes whatever the plan says), and the distributed optimizer exactly when the
/// job runs it (a run flag, not the plan's).
pub fn running_job_request(
    global_batch_size: usize,
    recompute: bool,
    distributed_optimizer: bool,
) -> PlanRequest {
    PlanRequest {
        global_batch_size,
        micro_batch_sizes: vec![1, 2, 4, 8],
        top_k: 1,
        tensor_parallel_sizes: vec![1, 2, 4, 8],
        context_parallel_sizes: vec![1, 2, 4, 8],
        recompute: match recompute {
            true => Choice::On,
            false => Choice::Auto,
        },
        distributed_optimizer: match distributed_optimizer {
            true => Choice::On,
            false => Choice::Off,
        },
        // Expert-parallel sizes as `synerfuse plan` searches them (grid plans of one size;
        // a running plan of one size is priced with its exchange, members' parts and
        // lockstep): a run may switch into expert parallelism where it pays, or out of it.
        expert_parallel_sizes: vec![1, 2, 4, 8],
    }
}

/// `request` confined to the kinds of parallelism `plan` uses: tensor- and
/// context-parallel sizes up to its largest, expert parallelism only if it splits
/// experts. A switch whose plan measured far slower than predicted is answered from
/// these: the fitted model prices them as the run measured them, not the kinds it
/// mispriced.
pub fn confined_request(mut request: PlanRequest, plan: &Plan) -> PlanRequest {
    let largest = |size: &dyn Fn(&ReplicaPipeline, usize) -> usize| {
        (plan.replicas().iter())
            .flat_map(|r| (0..r.stages.num_stages()).map(move |s| size(r, s)))
            .max()
            .unwrap_or(1)
    };
    let tp = largest(&|r, s| r.tp_size(s));
    let cp = largest(&|r, s| r.cp_size(s));
    request.tensor_parallel_sizes.retain(|&t| t <= tp);
    request.context_parallel_sizes.retain(|&c| c <= cp);
    if !plan.replicas().iter().any(ReplicaPipeline::splits_experts) {
        request.expert_parallel_sizes.retain(|&e| e == 1);
    }
    request
}

/// The planner's best plan for `request` on `cost`'s cluster (the best grid plan or the
/// best per-replica-pipeline plan, whichever [`predict_step_s`] prices faster), with
/// rank `r` on device `r`, placed at `placements[r]` (where every rank has one); and
/// its predicted step.
pub fn best_plan_for(
    cost: &CostModel,
    request: &PlanRequest,
    placements: &[Option<RankPlacement>],
) -> Result<(Plan, f64), ReplanError> {
    let outcome = plan(cost, request)?;
    let mut found = Vec::new();
    if let Some(grid) = outcome.plans.first() {
        let general = grid.to_plan(cost)?;
        found.push(on_devices(&general, &grid.rank_devices()?, placements)?);
    }
    if let Some(pooled) = &outcome.pooled {
        let general = pooled.to_plan(cost)?;
        found.push(on_devices(&general, &pooled.rank_devices(), placements)?);
    }
    let mut best: Option<(Plan, f64)> = None;
    for plan in found {
        let step_s = predict_step_s(cost, &plan)?;
        if best.as_ref().is_none_or(|(_, s)| step_s < *s) {
            best = Some((plan, step_s));
        }
    }
    // `plan` returns an error when neither kind of plan fits.
    Ok(best.expect("the planner found a plan"))
}

/// `plan` with its rank `k` renamed `device_of[k]`, rank `r` placed at `placements[r]`.
fn on_devices(
    plan: &Plan,
    device_of: &[usize],
    placements: &[Option<RankPlacement>],
) -> Result<Plan, PlanError> {
    let replicas = (plan.replicas().iter())
        .map(|r| {
            let ranks: Vec<Vec<usize>> = (r.ranks.iter())
                .map(|stage| stage.iter().map(|&k| device_of[k]).collect())
                .collect();
            // Every rank its own placement (a default one where it has none), or none
            // at all when no rank has one.
            let placed = placements.iter().any(Option::is_some);
            let placements = (ranks.iter().flatten())
                .filter(|_| placed)
                .map(|&rank| placements.get(rank).cloned().flatten().unwrap_or_default())
                .collect();
            ReplicaPipeline {
                ranks,
                placements,
                ..r.clone()
            }
        })
        .collect();
    let replanned = Plan::new(replicas)?;
    match plan.network() {
        Some(network) => replanned.with_network(network.clone()),
        None => Ok(replanned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> PlanRequest {
        running_job_request(16, false, false)
    }

    #[test]
    fn a_confined_request_keeps_the_kinds_of_parallelism_a_plan_uses() {
        let data_parallel = Plan::from_toml(
            "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 8\nranks = [0]\n\n\
             [[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 8\nranks = [1]\n",
            None,
        )
        .unwrap();
        let confined = confined_request(request(), &data_parallel);
        assert_eq!(confined.tensor_parallel_sizes, [1]);
        assert_eq!(confined.context_parallel_sizes, [1]);
        assert_eq!(confined.expert_parallel_sizes, [1]);
        // The rest of the search is the request's.
        assert_eq!(confined.micro_batch_sizes, request().micro_batch_sizes);

        let tensor_parallel = Plan::from_toml(
            "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 16\ntp = [2]\nranks = [0, 1]\n",
            None,
        )
        .unwrap();
        let confined = confined_request(request(), &tensor_parallel);
        assert_eq!(confined.tensor_parallel_sizes, [1, 2]);
        assert_eq!(confined.context_parallel_sizes, [1]);
    }
}
