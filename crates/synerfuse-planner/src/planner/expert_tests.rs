//! Expert parallelism in the planner: searched where it fits or is faster, experts
//! placed by each member's pace, memory and the measured tokens per expert.

use super::context::Ctx;
use super::plan_context::candidate_ctx;
use super::*;
use crate::cost::CostModel;
use synerfuse_plan::{ExpertShape, ModelShape};

/// Two MoE layers of 8 experts so wide that one layer's experts (32 GB of state) fill
/// no A10, while half of them (16 GB) do: on 4 A10s a two-stage pipeline of two
/// replicas dividing the experts fits, or four replicas holding a quarter each.
fn wide_experts(load: Option<Vec<Vec<f64>>>) -> CostModel {
    let cluster = crate::cluster::ClusterSpec::from_toml(
        "[[group]]\nkind = \"a10\"\ncount = 4\nnode = \"a\"\n[network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n",
    )
    .unwrap();
    let model = ModelShape {
        num_layers: 2,
        hidden_size: 1024,
        num_heads: 8,
        num_kv_heads: 8,
        ffn_hidden_size: 2816,
        vocab_size: 32_000,
        seq_length: 512,
        tied: false,
        experts: Some(ExpertShape {
            num_experts: 8,
            top_k: 2,
            ffn_hidden_size: 65_536,
            layer_freq: 1,
        }),
    };
    CostModel {
        expert_load: load,
        ..CostModel::new(model, cluster, None)
    }
}

/// The groups `first` (node a) and `second` (node b), links of 32 and 12 GB/s.
fn two_nodes(first: &str, second: &str) -> crate::cluster::ClusterSpec {
    crate::cluster::ClusterSpec::from_toml(&format!(
        "[[group]]\n{first}\nnode = \"a\"\n[[group]]\n{second}\nnode = \"b\"\n\
         [network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n"
    ))
    .unwrap()
}

fn request(expert_parallel_sizes: Vec<usize>) -> PlanRequest {
    PlanRequest {
        global_batch_size: 8,
        micro_batch_sizes: vec![1, 2],
        top_k: 3,
        tensor_parallel_sizes: vec![1],
        context_parallel_sizes: Vec::new(),
        recompute: Choice::Off,
        distributed_optimizer: Choice::Off,
        expert_parallel_sizes,
    }
}

#[test]
fn expert_parallelism_makes_a_plan_fit_and_writes_megatrons_even_parts() {
    let cost = wide_experts(None);
    let without = plan(&cost, &request(Vec::new()));
    assert!(
        matches!(without, Err(PlanningError::Infeasible(_))),
        "{without:?}"
    );
    // Four replicas each holding a quarter of the experts fit a stage each and reduce no
    // expert's gradient (each expert held once): faster than a pipeline.
    let outcome = plan(&cost, &request(vec![2, 4])).unwrap();
    let best = &outcome.plans[0];
    let shape = (best.layers.len(), best.micro_batches.len());
    assert_eq!(
        (best.options.expert_parallel, shape),
        (4, (1, 4)),
        "{best:?}"
    );
    let outcome = plan(&cost, &request(vec![2])).unwrap();
    let best = &outcome.plans[0];
    assert_eq!(best.options.expert_parallel, 2, "{best:?}");
    assert_eq!((best.layers.len(), best.micro_batches.len()), (2, 2));
    let written = best.to_plan(&cost).unwrap();
    written.check(&cost.model, false).unwrap();
    // Alike members on an even load: Megatron's parts, and its flag.
    for (r, replica) in written.replicas().iter().enumerate() {
        let part: Vec<usize> = (r * 4..r * 4 + 4).collect();
        for s in 0..2 {
            assert_eq!(replica.experts(s, 8), Some(part.clone()), "{written:?}");
        }
    }
    let flags = written.grid_flags().expect("a grid").args.join(" ");
    assert!(flags.contains("--expert-model-parallel-size 2"), "{flags}");
    // Memory: each member holds half the experts' state.
    let holding = |ep| {
        let variant = CostModel {
            expert_parallel: ep,
            ..cost.clone()
        };
        variant.stage_params(1, true, false)
    };
    let experts_per_layer = 8.0 * 3.0 * 1024.0 * 65_536.0;
    assert!((holding(1) - holding(2) - experts_per_layer / 2.0).abs() < 1.0);
}

#[test]
fn measured_tokens_per_expert_move_experts_and_stretch_the_price() {
    // Experts 0 and 1 take four times the others' tokens in both layers.
    let load = vec![vec![4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]; 2];
    let even = wide_experts(None);
    let skewed = wide_experts(Some(load.clone()));
    let best = plan(&skewed, &request(vec![2])).unwrap().plans[0].clone();
    assert_eq!(best.options.expert_parallel, 2);
    let placement = best.expert_placement(&skewed).unwrap().unwrap();
    let members = [ExpertMember {
        speed: 1.0,
        capacity: 8,
    }; 2];
    for stage in &placement {
        for group in stage.chunks(2) {
            // Both hot experts on one member would take 10 of 14 tokens' time.
            assert_eq!(
                slowest_time(&load[0], &members, group),
                7.0,
                "{placement:?}"
            );
        }
    }
    best.to_plan(&skewed)
        .unwrap()
        .check(&skewed.model, false)
        .unwrap();
    // Priced: one member of two cannot take more than its half when experts can be
    // balanced, so no stretch; a single hot expert (8 of 15 tokens) stretches it.
    let with_ep = |cost: &CostModel| CostModel {
        expert_parallel: 2,
        ..cost.clone()
    };
    assert_eq!(with_ep(&skewed).expert_imbalance(), 1.0);
    let hot = wide_experts(Some(vec![vec![8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]; 2]));
    let imbalance = with_ep(&hot).expert_imbalance();
    assert!((imbalance - 16.0 / 15.0).abs() < 1e-12, "{imbalance}");
    let layer = |cost: &CostModel| {
        let variant = with_ep(cost);
        let mut ctx = Ctx::new(&variant);
        ctx.costs(0, 1).unwrap().layer_s
    };
    assert!(layer(&hot) > layer(&even));
    assert_eq!(layer(&skewed), layer(&even));
    // The exchange itself is priced: more than the layer without expert parallelism.
    let mut plain = Ctx::new(&even);
    assert!(layer(&even) > plain.costs(0, 1).unwrap().layer_s);
}

#[test]
fn expert_parallel_sizes_that_do_not_divide_the_experts_are_not_searched() {
    let cost = wide_experts(None);
    let outcome = plan(&cost, &request(vec![2, 3])).unwrap();
    assert!(outcome
        .plans
        .iter()
        .all(|c| [1, 2].contains(&c.options.expert_parallel)));
    assert!(matches!(
        plan(&cost, &request(vec![3])),
        Err(PlanningError::ExpertParallelSizes { experts: 8, .. })
    ));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Every expert-parallel plan the search keeps, on any small cluster of two kinds,
    /// is one the trainer runs: its groups cover every expert once per stage, with as
    /// many micro-batches and recomputation alike in each.
    #[test]
    fn every_expert_parallel_plan_forms_valid_groups(
        fast in 1usize..4,
        slow in 0usize..4,
        experts in proptest::sample::select(vec![2usize, 4, 8]),
        layers in 1usize..4,
        global_batch_size in 2usize..13,
        skew in proptest::collection::vec(0.0f64..10.0, 8),
    ) {
        let slow = match slow {
            0 => String::new(),
            n => format!("[[group]]\nkind = \"a10\"\ncount = {n}\nnode = \"b\"\n"),
        };
        let cluster = crate::cluster::ClusterSpec::from_toml(&format!(
            "[[group]]\nkind = \"a100-80g\"\ncount = {fast}\nnode = \"a\"\n{slow}\
             [network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n"
        ))
        .unwrap();
        let model = ModelShape {
            num_layers: layers,
            hidden_size: 256,
            num_heads: 4,
            num_kv_heads: 4,
            ffn_hidden_size: 512,
            vocab_size: 1024,
            seq_length: 128,
            tied: false,
            experts: Some(ExpertShape {
                num_experts: experts,
                top_k: 2.min(experts),
                ffn_hidden_size: 256,
                layer_freq: 1 + layers % 2,
            }),
        };
        let load = vec![skew[..experts].iter().map(|x| x + 0.5).collect(); model.moe_layers_in(0, layers)];
        let cost = CostModel {
            expert_load: Some(load),
            ..CostModel::new(model, cluster, None)
        };
        // Every size, so that stages may also take their own (1 among them).
        let request = PlanRequest {
            global_batch_size,
            ..request(vec![1, 2, 4])
        };
        let Ok(outcome) = plan(&cost, &request) else {
            return Ok(());
        };
        for c in outcome.plans.iter().chain(&outcome.uniform_layouts) {
            let sizes = c.expert_parallel_sizes();
            let written = c.to_plan(&cost).unwrap();
            written.check(&cost.model, false).unwrap();
            if sizes.iter().all(|&ep| ep == 1) {
                continue;
            }
            // Megatron's even parts, as its flags say them (one size for every stage).
            let even = c.to_even_plan(&cost).unwrap();
            even.check(&cost.model, false).unwrap();
            let uniform = sizes.iter().all(|&ep| ep == sizes[0]);
            proptest::prop_assert_eq!(even.grid_flags().is_some(), uniform);
            let groups = written.expert_groups(experts).unwrap();
            let d = written.replicas().len();
            let divided: usize = sizes.iter().filter(|&&ep| ep > 1).map(|&ep| d / ep).sum();
            proptest::prop_assert_eq!(groups.len(), divided);
            for g in &groups {
                proptest::prop_assert_eq!(g.replicas.len(), sizes[g.stage]);
            }
            for g in &groups {
                let counts: Vec<usize> = (g.replicas.iter())
                    .map(|&r| written.replicas()[r].batch.num_micro_batches())
                    .collect();
                proptest::prop_assert!(counts.iter().all(|&m| m == counts[0]), "{:?}", counts);
            }
        }
    }
}

// The members of an expert-parallel group route to each other's experts: with
// micro-batches of 3 and 1 samples each member's experts compute 2 samples' tokens (on
// an even load), so the member of 3 is priced below its own micro-batch's experts and
// the member of 1 above, and the group at the slower of the two.
#[test]
fn a_group_of_unequal_micro_batches_computes_its_mean_tokens_on_each_member() {
    let narrow = wide_experts(None);
    let model = ModelShape {
        experts: (narrow.model.experts).map(|e| ExpertShape {
            ffn_hidden_size: 2048,
            ..e
        }),
        ..narrow.model.clone()
    };
    let cost = CostModel {
        expert_parallel: 2,
        model,
        ..narrow
    };
    let mut ctx = Ctx::new(&cost);
    let (t, _) = pricing::stage_times(&mut ctx, &[vec![0, 1]], &[2], &[3, 1], &[1, 1]).unwrap();
    let mut own = |unit: usize, b: usize| {
        let costs = ctx.costs(unit, b).unwrap();
        let experts = 2.0 * ctx.expert_seconds(unit, b).unwrap();
        assert!(experts > 0.0);
        (pricing::stage_seconds(&costs, 2, 0, 1), experts)
    };
    let ((three, experts_3), (one, experts_1)) = (own(0, 3), own(1, 1));
    let member_3 = three + experts_3 * (2.0 / 3.0 - 1.0);
    let member_1 = one + experts_1 * (2.0 - 1.0);
    assert!((t[0][0] - member_3.max(member_1)).abs() < 1e-12, "{t:?}");
    assert_eq!(t[0][0], t[0][1]);
    assert!(t[0][0] < three, "{t:?} against {three}");
}

/// A stage's expert gradients are all-reduced over the replicas holding the same experts
/// (Megatron's expert-data-parallel groups, side by side), the rest over every replica:
/// with four replicas, EP 2 reduces its half of the experts over pairs, EP 4 none.
#[test]
fn expert_gradients_reduce_over_the_replicas_holding_the_same_experts() {
    let cost = wide_experts(None);
    let grid = vec![vec![0, 1, 2, 3]];
    let reduce = |ep: usize| {
        let variant = CostModel {
            expert_parallel: ep,
            ..cost.clone()
        };
        let ctx = Ctx::new(&variant);
        let dense = variant.stage_params(2, true, true) - 2.0 * variant.expert_part_params();
        let experts = 2.0 * variant.expert_part_params();
        let pair = ctx.allreduce_seconds(vec![0, 2], experts * 4.0);
        let all = ctx.allreduce_seconds(vec![0, 1, 2, 3], dense * 4.0);
        (pricing::allreduce_times(&ctx, &grid, &[2])[0], all, pair)
    };
    let (four, dense, _) = reduce(4);
    assert!((four - dense).abs() < 1e-12, "{four} vs {dense}");
    let (two, dense, pair) = reduce(2);
    assert!(
        pair > 0.0 && (two - dense - pair).abs() < 1e-12,
        "{two} vs {dense} + {pair}"
    );
    // Without expert parallelism every expert reduces over all four.
    let (one, _, _) = reduce(1);
    let whole =
        Ctx::new(&cost).allreduce_seconds(vec![0, 1, 2, 3], cost.stage_params(2, true, true) * 4.0);
    assert!((one - whole).abs() < 1e-12, "{one} vs {whole}");
}

/// A running plan may give its stages or replicas their own expert-parallel sizes: a
/// pair holding half the experts each beside two replicas holding every expert; each
/// half reduces over its pair member and the two whole holders, one half after the
/// other on the whole holders, and a whole holder holds (and steps) twice the pair's.
#[test]
fn experts_held_in_parts_of_different_sizes_reduce_over_every_holder_of_each_part() {
    let cost = wide_experts(None);
    let mut ctx = Ctx::new(&cost);
    ctx.set_expert_parallel(vec![2, 2, 1, 1]);
    ctx.lockstep = vec![vec![0, 1]];
    let model = &cost.model;
    let experts = 2.0 * model.expert_layer_params();
    let dense = model.stage_params(2, true, true) - experts;
    let all = ctx.allreduce_seconds(vec![0, 1, 2, 3], dense * 4.0);
    let half = ctx.allreduce_seconds(vec![0, 2, 3], experts / 2.0 * 4.0);
    let reduce = pricing::allreduce_times(&ctx, &[vec![0, 1, 2, 3]], &[2])[0];
    assert!(
        half > 0.0 && (reduce - all - 2.0 * half).abs() < 1e-12,
        "{reduce}"
    );
    let held = |unit: usize| ctx.cost_of(unit).stage_params(2, true, true);
    assert!((held(2) - held(0) - experts / 2.0).abs() < 1e-6);
}

/// On unequal pools (A100s of 40 GB, A10s of 24 GB; sequences of 640) per-replica plans divide the
/// experts too: groups of two alike replicas of a pool holding half of each stage's
/// experts, the members of a group taking the same micro-batches, the batch split by
/// the pools' paces; asked for expert parallelism only, both the expert's layout and
/// the per-replica search find such a plan (before, per-replica plans held every
/// expert and neither did).
#[test]
fn per_replica_plans_divide_the_experts_over_groups_of_alike_replicas() {
    let cluster = two_nodes(
        "kind = \"a100-40g\"\ncount = 4",
        "kind = \"a10\"\ncount = 4",
    );
    let mut model = wide_experts(None).model;
    model.seq_length = 640;
    let cost = CostModel::new(model, cluster, None);
    let outcome = plan(&cost, &request(vec![2])).unwrap();
    let layout = outcome.expert.expect("an expert's layout");
    assert!(layout.per_pool, "{layout:?}");
    let pooled = outcome.pooled.expect("a per-replica plan");
    for candidate in [&layout.candidate, &pooled] {
        assert_eq!(candidate.options.expert_parallel, 2, "{candidate:?}");
        groups_of_alike_replicas(&cost, candidate);
    }
}

/// `candidate`'s plan: valid, its expert-parallel groups of alike members holding half
/// the experts each with the same micro-batches, and the A100s' replicas taking more of
/// the batch than the A10s'.
fn groups_of_alike_replicas(cost: &CostModel, candidate: &PooledCandidate) {
    let written = candidate.to_plan(cost).unwrap();
    written.check(&cost.model, false).unwrap();
    let groups = written.expert_groups(8).unwrap();
    assert!(!groups.is_empty(), "{written:?}");
    let kinds = |r: usize, s: usize| {
        let rank = written.replicas()[r].ranks[s][0];
        written.placement(rank).and_then(|p| p.kind.clone())
    };
    for group in &groups {
        let first = kinds(group.replicas[0], group.stage);
        assert!(group
            .replicas
            .iter()
            .all(|&r| kinds(r, group.stage) == first));
        assert!(group.placement.iter().all(|p| p.len() == 4), "{group:?}");
        let batches: Vec<_> = (group.replicas.iter())
            .map(|&r| written.replicas()[r].batch.clone())
            .collect();
        assert!(batches.windows(2).all(|w| w[0] == w[1]), "{batches:?}");
    }
    assert_eq!(written.global_batch_size(), 8);
    let samples = |kind: &str| {
        (0..written.replicas().len())
            .filter(|&r| kinds(r, 0).as_deref() == Some(kind))
            .map(|r| written.replicas()[r].batch.samples())
            .min()
    };
    assert!(samples("a100-40g") > samples("a10"), "{written:?}");
}

/// [`wide_experts`] on `cluster` with four layers, sequences of 2048 and experts `ffn`
/// wide.
fn four_layers_on(cluster: crate::cluster::ClusterSpec, ffn: usize) -> CostModel {
    let mut cost = wide_experts(None);
    cost.cluster = cluster;
    cost.model.num_layers = 4;
    cost.model.seq_length = 2048;
    cost.model.experts.as_mut().unwrap().ffn_hidden_size = ffn;
    cost
}

/// Two A100s and two A10s, a four-layer mixture of 8 experts, long sequences and a
/// batch of many micro-batches: the planner's grid holds three layers on the A100s and
/// one on the A10s. Dividing the first stage's experts over both replicas (no expert
/// gradient to reduce) and keeping the second's whole on each (no all-to-all on the
/// pipeline's slowest stage) is faster than either size on both, and the plan written
/// says so stage by stage: Megatron's one flag cannot, so it has no grid flags.
#[test]
fn stages_take_their_own_expert_parallel_sizes_where_faster() {
    let cluster = two_nodes(
        "kind = \"a100-80g\"\ncount = 2",
        "kind = \"a10\"\ncount = 2",
    );
    let cost = four_layers_on(cluster, 16_384);
    let request = PlanRequest {
        global_batch_size: 64,
        ..request(vec![1, 2])
    };
    let outcome = plan(&cost, &request).unwrap();
    let best = &outcome.plans[0];
    assert_eq!(best.expert_parallel_sizes(), vec![2, 1], "{best:?}");
    // The same grid at one size on both stages: slower.
    for ep in [1, 2] {
        let uniform = Candidate {
            stage_expert_parallel: Vec::new(),
            options: TrainOptions {
                expert_parallel: ep,
                ..best.options
            },
            ..best.clone()
        };
        let variant = uniform.options.cost(&cost);
        let mut ctx = candidate_ctx(&variant, &uniform);
        let step = simulate::simulate_candidate(&mut ctx, &uniform).map(|p| p.step_time_s);
        // At EP 1 the first stage's experts may not fit: priced all the same.
        assert!(
            step.as_ref()
                .is_ok_and(|&s| s > best.prediction.step_time_s),
            "{ep}: {step:?} vs {}",
            best.prediction.step_time_s
        );
    }
    let written = best.to_plan(&cost).unwrap();
    written.check(&cost.model, false).unwrap();
    let groups = written.expert_groups(8).unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!((groups[0].stage, groups[0].replicas.len()), (0, 2));
    assert!(best.to_even_plan(&cost).unwrap().grid_flags().is_none());
    // Its timeline is the step predicted, each stage at its own size.
    let title = simulate::timeline(&cost, best).unwrap().title;
    let step = format!("step {:.4} s", best.prediction.step_time_s);
    assert!(title.contains(&step), "{title} vs {step}");
}

/// Four A100s and four small accelerators (6 GB) training a four-layer mixture of 8
/// experts: per-replica pipelines hold the model whole on each A100, its experts whole
/// (no all-to-all; their gradients reduced over four), and divide the experts over pairs
/// of the small devices' two-stage pipelines, where they would not fit whole: faster
/// than every pool at either size, and than the grid plans. Priced with the reductions
/// after the pipeline: overlapped, the pools at size 1 (the small devices a four-stage
/// pipeline of one replica) are the faster start, and the search, which moves one
/// pool's size at a time from the best single size, cannot divide a replica's experts.
#[test]
fn pools_take_their_own_expert_parallel_sizes_where_faster() {
    let cluster = two_nodes(
        "kind = \"a100-80g\"\ncount = 4",
        "kind = \"custom\"\ntflops_bf16 = 100\nmemory_gb = 6\nmem_bw_gbs = 500\ncount = 4",
    );
    // The whole logits (Megatron's loss) on the small devices' last stages, whose
    // memory this case is about.
    let cost = CostModel {
        overlap_grad_reduce: false,
        loss_in_chunks: false,
        ..four_layers_on(cluster, 4096)
    };
    let asked = |sizes: Vec<usize>| PlanRequest {
        global_batch_size: 256,
        ..request(sizes)
    };
    let outcome = plan(&cost, &asked(vec![1, 2])).unwrap();
    let pooled = outcome.pooled.clone().expect("per-replica pipelines");
    assert_eq!(pooled.pool_expert_parallel, vec![1, 2], "{pooled:?}");
    assert_eq!(outcome.pooled_wins(), Some(&pooled));
    for one in [1, 2] {
        let step = (plan(&cost, &asked(vec![one])).ok())
            .and_then(|o| o.pooled)
            .map_or(f64::INFINITY, |p| p.step_time_s);
        assert!(
            step > pooled.step_time_s,
            "{one}: {step} vs {}",
            pooled.step_time_s
        );
    }
    let title = simulate::pooled_timeline(&cost, &pooled).unwrap().title;
    let step = format!("step {:.4} s", pooled.step_time_s);
    assert!(title.contains(&step), "{title} vs {step}");
    let written = pooled.to_plan(&cost).unwrap();
    written.check(&cost.model, false).unwrap();
    let groups = written.expert_groups(8).unwrap();
    // The small devices' two replicas of two stages: a pair per stage.
    assert_eq!(groups.len(), 2, "{groups:?}");
    for g in &groups {
        let kinds: Vec<_> = (g.replicas.iter())
            .map(|&r| written.replicas()[r].placements[0].kind.clone())
            .collect();
        assert!(
            kinds.iter().all(|k| k.as_deref() == Some("custom")),
            "{kinds:?}"
        );
    }
}
