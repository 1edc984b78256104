use super::tests::{data_parallel, job, model, two_stage_pipeline};
use super::*;
use crate::cost::CostModel;
use crate::planner::PlanRequest;
use synerfuse_plan::{ModelShape, Plan};

fn experts() -> ModelShape {
    ModelShape {
        experts: Some(synerfuse_plan::ExpertShape {
            num_experts: 4,
            top_k: 2,
            ffn_hidden_size: 128,
            layer_freq: 1,
        }),
        ..model()
    }
}

fn expert_job<'a>(plan: &'a Plan, paces: &'a [f64], hosts: &'a [String]) -> RunningJob<'a> {
    RunningJob {
        model: experts(),
        ..job(plan, paces, hosts)
    }
}

/// A running plan of expert parallelism is priced with its exchange, and its groups'
/// members meet at every MoE layer: two replicas of two stages whose slow ranks sit
/// at different stages run as if both stages of both were slow (as each stage waits
/// for its group's slow member), and a plan of groups of different sizes is priced
/// stage by stage.
#[test]
fn an_expert_parallel_plan_is_priced_with_its_exchange_in_lockstep() {
    let hosts = vec!["h".to_owned(); 4];
    let whole = data_parallel(2);
    let split = data_parallel(2).with_even_experts(2).unwrap();
    let cost = fitted_cost(&expert_job(&whole, &[1.0, 1.0], &hosts[..2])).unwrap();
    let (plain, exchanged) = (
        predict_step_s(&cost, &whole).unwrap(),
        predict_step_s(&cost, &split).unwrap(),
    );
    assert!(exchanged > plain, "{exchanged} vs {plain}");
    let pipelines = Plan::from_toml(
        &"[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 4\n\n".repeat(2),
        None,
    )
    .unwrap()
    .with_even_experts(2)
    .unwrap();
    let predicted = |paces: &[f64]| {
        let cost = fitted_cost(&expert_job(&pipelines, paces, &hosts)).unwrap();
        predict_step_s(&cost, &pipelines).unwrap()
    };
    let apart = predicted(&[4.0, 1.0, 1.0, 4.0]);
    let together = predicted(&[4.0, 1.0, 4.0, 1.0]);
    assert!(apart > 1.1 * together, "{apart} vs {together}");
    let mixed = pipelines
        .clone()
        .with_even_experts_by_stage(|s| [2, 1][s])
        .unwrap();
    // Stages of their own sizes are priced each at its own: the second stage's
    // exchange gone (less than the plan dividing both), its experts reduced over the
    // replicas (more than the plan dividing neither, whose pipelines wait no peer).
    let paced = |plan: &Plan| {
        let cost = fitted_cost(&expert_job(plan, &[1.0; 4], &hosts)).unwrap();
        predict_step_s(&cost, plan).unwrap()
    };
    let whole = Plan::from_toml(
        &"[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 4\n\n".repeat(2),
        None,
    )
    .unwrap();
    let (divided, part, none) = (paced(&pipelines), paced(&mixed), paced(&whole));
    assert!(none < part && part < divided, "{none} < {part} < {divided}");
}

/// A mixture of experts on two ranks of 45 MB each, running a pipeline of two stages:
/// its experts (3.1 M parameters, 63 MB of state) fit no rank whole, so the
/// re-planner's only other plans divide them; each replica holding half of every
/// layer's experts (expert parallelism 2) runs without the pipeline's bubble, and the
/// re-planner switches into it, its experts placed (a part per replica, all held).
#[test]
fn a_job_is_switched_into_expert_parallelism_where_memory_binds() {
    let (plan, cost) = fitted_memory_bound_pipeline(0.045, &[1.0, 1.0]);
    let running_s = predict_step_s(&cost, &plan).unwrap();
    let placed: Vec<_> = (0..2).map(|r| plan.placement(r).cloned()).collect();
    let request = running_job_request(8, false, false);
    let (best, step) = best_plan_for(&cost, &request, &placed).unwrap();
    let groups = best.expert_groups(8).unwrap();
    assert_eq!(best.replicas().len(), 2, "{best:?}");
    assert_eq!(groups.len(), 1, "{groups:?}");
    let mut held: Vec<usize> = groups[0].placement.concat();
    held.sort_unstable();
    assert_eq!(held, (0..8).collect::<Vec<_>>());
    assert!(step < 0.95 * running_s, "{step} vs {running_s}");
    let without = PlanRequest {
        expert_parallel_sizes: vec![1],
        ..request
    };
    // Without it, memory keeps the run a pipeline (every expert held by a stage).
    let (kept, _) = best_plan_for(&cost, &without, &placed).unwrap();
    assert!(kept.expert_groups(8).unwrap().is_empty(), "{kept:?}");
    assert!(kept.replicas()[0].stages.num_stages() > 1, "{kept:?}");
}

/// [`two_stage_pipeline`] with 8 micro-batches, and a mixture of 8 experts (3.1 M
/// parameters of experts, 63 MB of state).
fn memory_bound_pipeline(memory_gb: f64) -> (Plan, ModelShape) {
    let plan = two_stage_pipeline(memory_gb, 8);
    let model = ModelShape {
        num_kv_heads: 1,
        experts: Some(synerfuse_plan::ExpertShape {
            num_experts: 8,
            top_k: 2,
            ffn_hidden_size: 512,
            layer_freq: 1,
        }),
        ..model()
    };
    (plan, model)
}

/// [`memory_bound_pipeline`] on one host, its ranks measured at `paces`, and the cost
/// model fitted to them.
fn fitted_memory_bound_pipeline(memory_gb: f64, paces: &[f64]) -> (Plan, CostModel) {
    let (plan, model) = memory_bound_pipeline(memory_gb);
    let hosts = vec!["h".to_owned(); 2];
    let job = RunningJob {
        model,
        ..job(&plan, paces, &hosts)
    };
    let cost = fitted_cost(&job).unwrap();
    (plan, cost)
}

/// Experts placed by measured pace: two ranks measured at speeds 1 and about 0.5
/// (the pipeline above, unbounded memory), asked for EP 2: the faster rank's replica
/// holds more of the experts (5 of 8).
#[test]
fn experts_are_placed_by_the_measured_paces() {
    let (_, cost) = fitted_memory_bound_pipeline(1.0, &[1.0, 2.0]);
    let request = PlanRequest {
        expert_parallel_sizes: vec![2],
        ..running_job_request(8, false, false)
    };
    let outcome = crate::planner::plan(&cost, &request).unwrap();
    let best = &outcome.plans[0];
    let placement = best
        .expert_placement(&cost)
        .unwrap()
        .expect("experts divided");
    // Replica r runs on device (rank) best.devices[0][r].
    let held = |rank: usize| {
        let r = best.devices[0].iter().position(|&u| u == rank).unwrap();
        placement[0][r].len()
    };
    assert!(held(0) > held(1), "{placement:?} {best:?}");
}
