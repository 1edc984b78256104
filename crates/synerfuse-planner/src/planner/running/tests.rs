use super::*;
use crate::planner::{Choice, PlanRequest};
use synerfuse_plan::{ModelShape, Plan, RankPlacement, ReplicaBatch, ReplicaPipeline, StageLayout};

pub(super) fn model() -> ModelShape {
    ModelShape {
        num_layers: 4,
        hidden_size: 64,
        num_heads: 4,
        num_kv_heads: 4,
        ffn_hidden_size: 128,
        vocab_size: 256,
        seq_length: 32,
        tied: false,
        experts: None,
    }
}

/// `ranks` data-parallel replicas of the whole model, 4 micro-batches of 1 each.
pub(super) fn data_parallel(ranks: usize) -> Plan {
    let replicas = (0..ranks)
        .map(|r| {
            ReplicaPipeline::single_ranks(
                StageLayout::new(vec![4], 4).unwrap(),
                ReplicaBatch::uniform(1, 4),
                vec![r],
                Vec::new(),
            )
        })
        .collect();
    Plan::new(replicas).unwrap()
}

pub(super) fn job<'a>(plan: &'a Plan, paces_s: &'a [f64], hosts: &'a [String]) -> RunningJob<'a> {
    RunningJob {
        plan,
        model: model(),
        paces_s,
        hosts,
        network: None,
        recompute: false,
        compute_bytes: 4.0,
        overlap_grad_reduce: true,
        ddp_bucket_size: None,
        overlap_param_gather: false,
        hierarchical_reduction: true,
    }
}

fn request(global_batch_size: usize) -> PlanRequest {
    PlanRequest {
        global_batch_size,
        micro_batch_sizes: vec![1, 2],
        top_k: 1,
        tensor_parallel_sizes: vec![1],
        context_parallel_sizes: Vec::new(),
        recompute: Choice::Off,
        distributed_optimizer: Choice::Off,
        expert_parallel_sizes: Vec::new(),
    }
}

#[test]
fn the_fitted_model_predicts_the_measured_paces() {
    let plan = data_parallel(4);
    let hosts = vec!["h".to_owned(); 4];
    let paces = [1.0, 4.0, 1.0, 1.0];
    let cost = fitted_cost(&job(&plan, &paces, &hosts)).unwrap();
    let step = predict_step_s(&cost, &plan).unwrap();
    // The slowest replica, plus a reduction of a small model's gradients.
    assert!((4.0..4.1).contains(&step), "{step}");
}

/// A running plan of a context-parallel pair is priced from its members' paces (each
/// on its tokens), predicts the pace measured, and is switched from: with one member
/// four times slower than measured, the best plan for the new paces is faster than
/// the pair.
#[test]
fn a_context_parallel_plan_is_priced_and_switched_from() {
    let plan = Plan::from_toml(
        "[[replica]]\nlayers = [4]\ncp = [2]\nmicro_batch_size = 1\nnum_micro_batches = 4\n",
        None,
    )
    .unwrap();
    let hosts = vec!["h".to_owned(); 2];
    let cost = fitted_cost(&job(&plan, &[1.0, 1.0], &hosts)).unwrap();
    let step = predict_step_s(&cost, &plan).unwrap();
    assert!((1.0..1.1).contains(&step), "{step}");
    let slowed = fitted_cost(&job(&plan, &[1.0, 4.0], &hosts)).unwrap();
    let current = predict_step_s(&slowed, &plan).unwrap();
    assert!((3.9..4.2).contains(&current), "{current}");
    let placed = vec![None, None];
    let (best, _) = best_plan_for(&slowed, &request(4), &placed).unwrap();
    let best_s = predict_step_s(&slowed, &best).unwrap();
    assert!(best_s < current, "{best_s} vs {current}");
}

/// A hand-written ragged plan in any order of sizes is priced as its samples in
/// micro-batches of its largest, the last one short; a shorter last micro-batch
/// costs less than a full one.
#[test]
fn ragged_plans_in_any_order_are_priced() {
    let hosts = vec!["h".to_owned(); 2];
    let paces = [1.0, 1.0];
    let fitted = fitted_cost(&job(&data_parallel(2), &paces, &hosts)).unwrap();
    let with = |sizes: [Vec<usize>; 2]| {
        let replicas = (sizes.into_iter().enumerate())
            .map(|(r, sizes)| {
                ReplicaPipeline::single_ranks(
                    StageLayout::new(vec![4], 4).unwrap(),
                    ReplicaBatch::ragged(sizes),
                    vec![r],
                    Vec::new(),
                )
            })
            .collect();
        predict_step_s(&fitted, &Plan::new(replicas).unwrap()).unwrap()
    };
    let any_order = with([vec![1, 4, 1], vec![2, 2, 4]]);
    let filled = with([vec![4, 2], vec![4, 4]]);
    assert!(
        (any_order - filled).abs() < 1e-12,
        "{any_order} vs {filled}"
    );
    let short = with([vec![4, 1], vec![4, 1]]);
    let full = with([vec![4, 4], vec![4, 4]]);
    assert!(short < full, "{short} vs {full}");
}

#[test]
fn a_slow_rank_gets_less_work_and_every_rank_a_place() {
    let plan = data_parallel(4);
    let hosts = vec!["h".to_owned(); 4];
    let paces = [1.0, 4.0, 1.0, 1.0];
    let cost = fitted_cost(&job(&plan, &paces, &hosts)).unwrap();
    let (best, step) = best_plan_for(&cost, &request(16), &[]).unwrap();
    assert_eq!(best.world_size(), 4);
    assert_eq!(best.global_batch_size(), 16);
    // Rank 1 computes a sample in 1 s, the others in 0.25 s: 5 samples each for
    // ranks 0, 2, 3 and 1 for rank 1 take 1.25 s, against 4 s now.
    assert!(step < 1.6, "{step}: {best:?}");
    let (replica, _) = best.position(1).unwrap();
    let samples = |r: &ReplicaPipeline| r.batch.samples();
    let slow = samples(&best.replicas()[replica]);
    assert!(
        best.replicas().iter().all(|r| samples(r) >= slow),
        "{best:?}"
    );
}

/// The re-planner prices each rank within the memory its placement names: a rank
/// too small for the whole model's state (about 3.9 MB here) holds a whole replica
/// no longer, though its pace alone would give it one (tensor parallelism, searched
/// as `synerfuse plan` searches it, may share it out).
#[test]
fn a_rank_keeps_to_the_memory_it_was_placed_with() {
    let hosts = vec!["h".to_owned(); 2];
    let paces = [1.0, 1.0];
    let held_by_rank_1 = |memory_gb: f64| {
        let placements = [
            RankPlacement {
                memory_gb: Some(1.0),
                ..RankPlacement::default()
            },
            RankPlacement {
                memory_gb: Some(memory_gb),
                ..RankPlacement::default()
            },
        ];
        let replicas = (0..2)
            .map(|r| {
                ReplicaPipeline::single_ranks(
                    StageLayout::new(vec![4], 4).unwrap(),
                    ReplicaBatch::uniform(1, 8),
                    vec![r],
                    vec![placements[r].clone()],
                )
            })
            .collect();
        let plan = Plan::new(replicas).unwrap();
        let cost = fitted_cost(&job(&plan, &paces, &hosts)).unwrap();
        let request = running_job_request(16, false, false);
        let placed: Vec<_> = (0..2).map(|r| plan.placement(r).cloned()).collect();
        let (best, _) = best_plan_for(&cost, &request, &placed).unwrap();
        assert_eq!(best.placement(1).unwrap().memory_gb, Some(memory_gb));
        let (replica, stage) = best.position(1).unwrap();
        let r = &best.replicas()[replica];
        (r.stages.layers()[stage], r.ranks[stage].len())
    };
    assert_eq!(held_by_rank_1(1.0), (4, 1));
    // Fewer layers, or a tensor-parallel share of them.
    let small = held_by_rank_1(0.0035);
    assert!(small.0 < 4 || small.1 > 1, "{small:?}");
}

#[test]
fn bad_paces_are_refused_by_rank() {
    let plan = data_parallel(2);
    let hosts = vec!["h".to_owned(); 2];
    let error = fitted_cost(&job(&plan, &[1.0, 0.0], &hosts)).unwrap_err();
    assert_eq!(
        error,
        ReplanError::Pace {
            rank: 1,
            pace_s: 0.0
        }
    );
    let error = fitted_cost(&job(&plan, &[1.0], &hosts)).unwrap_err();
    assert!(
        error.to_string().contains("one pace per rank: got 1 for 2"),
        "{error}"
    );
}

#[test]
fn survivors_get_a_plan_of_their_own() {
    let plan = data_parallel(4);
    let hosts = vec!["h".to_owned(); 4];
    let paces = [1.0, 1.0, 1.0, 1.0];
    let kept = [0, 1, 3];
    let cost = fitted_cost_of(&job(&plan, &paces, &hosts), &kept).unwrap();
    let placements: Vec<_> = (kept.iter())
        .map(|&r| {
            Some(RankPlacement {
                kind: Some(format!("rank {r}")),
                ..RankPlacement::default()
            })
        })
        .collect();
    let (best, _) = best_plan_for(&cost, &request(16), &placements).unwrap();
    assert_eq!(best.world_size(), 3);
    assert_eq!(best.global_batch_size(), 16);
    // Survivor 2 was rank 3.
    assert_eq!(best.placement(2).unwrap().kind.as_deref(), Some("rank 3"));
}

/// A context-parallel pair of tensor-parallel pairs is priced from its ranks' paces
/// and predicts the pace measured.
#[test]
fn a_plan_of_context_parallel_tensor_parallel_groups_is_priced() {
    let text = "[[replica]]\nlayers = [4]\ncp = [2]\ncp_shares = [[3, 1]]\n\
                micro_batch_size = 1\nnum_micro_batches = 4\n";
    let plan = Plan::from_toml(text, None).unwrap();
    let replicas = vec![ReplicaPipeline {
        ranks: vec![vec![0, 1, 2, 3]],
        ..plan.replicas()[0].clone()
    }];
    let plan = Plan::new(replicas).unwrap();
    assert_eq!(
        (plan.replicas()[0].tp_size(0), plan.replicas()[0].cp_size(0)),
        (2, 2)
    );
    let hosts = vec!["h".to_owned(); 4];
    let cost = fitted_cost(&job(&plan, &[1.0; 4], &hosts)).unwrap();
    let step = predict_step_s(&cost, &plan).unwrap();
    assert!((1.0..1.1).contains(&step), "{step}");
}

/// A job on two ranks of 0.15 GB at sequence 1024 (one query group: no tensor
/// parallelism) runs a two-stage pipeline; rank 1 runs at half speed. Neither rank
/// holds the whole model's activations, so without context parallelism the pipeline
/// stays the best plan; the re-planner switches into a context-parallel pair that
/// splits every sequence 2 : 1, faster.
#[test]
fn a_job_is_switched_into_context_parallelism_where_memory_binds() {
    let plan = two_stage_pipeline(0.15, 4);
    let hosts = vec!["h".to_owned(); 2];
    let model = ModelShape {
        seq_length: 1024,
        num_kv_heads: 1,
        ..model()
    };
    let job = RunningJob {
        model,
        ..job(&plan, &[1.0, 2.0], &hosts)
    };
    let cost = fitted_cost(&job).unwrap();
    let placed: Vec<_> = (0..2).map(|r| plan.placement(r).cloned()).collect();
    let mut request = running_job_request(4, false, false);
    let (best, step) = best_plan_for(&cost, &request, &placed).unwrap();
    let replica = &best.replicas()[0];
    assert_eq!(
        (replica.cp_size(0), replica.context_shares(0)),
        (2, Some(vec![2, 1])),
        "{best:?}"
    );
    request.context_parallel_sizes = vec![1];
    let (without, without_s) = best_plan_for(&cost, &request, &placed).unwrap();
    assert!(!without.has_context_parallelism());
    assert!(step < 0.9 * without_s, "{step} vs {without_s}");
}

/// A pipeline of two stages (layers [2, 2]) on ranks 0 and 1 of `memory_gb` each,
/// `micro_batches` micro-batches of 1.
pub(super) fn two_stage_pipeline(memory_gb: f64, micro_batches: usize) -> Plan {
    let placement = RankPlacement {
        memory_gb: Some(memory_gb),
        ..RankPlacement::default()
    };
    Plan::new(vec![ReplicaPipeline::single_ranks(
        StageLayout::new(vec![2, 2], 4).unwrap(),
        ReplicaBatch::uniform(1, micro_batches),
        vec![0, 1],
        vec![placement; 2],
    )])
    .unwrap()
}
