use super::context::Ctx;
use super::memory_fit::{memory_need, Shares};
use super::*;
use crate::cost::{CostModel, Recompute};

/// A 1.1B-parameter model at sequence 4096 on A10s (24 GB), `count` on one node.
fn a10s(count: usize, seq_length: usize) -> CostModel {
    let cluster = crate::cluster::ClusterSpec::from_toml(&format!(
        "[[group]]\nkind = \"a10\"\ncount = {count}\nnode = \"a\"\n[network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n"
    ))
    .unwrap();
    let model = synerfuse_plan::ModelShape {
        num_layers: 24,
        hidden_size: 2048,
        num_heads: 16,
        num_kv_heads: 16,
        ffn_hidden_size: 5632,
        vocab_size: 32_000,
        seq_length,
        tied: false,
        experts: None,
    };
    CostModel::new(model, cluster, None)
}

fn request(g: usize, recompute: Choice, distributed_optimizer: Choice) -> PlanRequest {
    PlanRequest {
        global_batch_size: g,
        micro_batch_sizes: vec![1, 2, 4],
        top_k: 3,
        tensor_parallel_sizes: vec![1],
        context_parallel_sizes: Vec::new(),
        recompute,
        distributed_optimizer,
        expert_parallel_sizes: Vec::new(),
    }
}

/// Two A10s hold the model's state in a two-stage pipeline but not its activations
/// at sequence 5120: recomputing them makes it fit, at a forward's extra cost.
#[test]
fn recomputation_makes_a_plan_fit() {
    let cost = a10s(2, 5120);
    let off = plan(&cost, &request(16, Choice::Off, Choice::Off));
    assert!(
        matches!(
            off,
            Err(PlanningError::Infeasible(Infeasibility::OutOfMemory(_)))
        ),
        "{off:?}"
    );
    let outcome = plan(&cost, &request(16, Choice::Auto, Choice::Off)).unwrap();
    let best = &outcome.plans[0];
    assert_eq!(best.options.recompute, Recompute::WhereNeeded, "{best:?}");
    // Only the stages that need it: the last keeps one micro-batch in flight, the
    // first two.
    let stages: Vec<bool> = best.recompute.iter().map(|row| row[0]).collect();
    assert_eq!(stages, [true, false], "{best:?}");
    // The plan file says so; no train flag is needed.
    assert!(best.options.train_flags().is_empty());
    let file = best.to_plan(&cost).unwrap();
    assert_eq!(file.replicas()[0].recompute, [true, false]);
    // Each stage's forward runs twice: a third more compute than without.
    let plain = plan(&a10s(2, 2048), &request(32, Choice::Off, Choice::Off)).unwrap();
    let busy = |c: &Candidate| c.prediction.busy_s.iter().flatten().sum::<f64>();
    let again = plan(&a10s(2, 2048), &request(32, Choice::On, Choice::Off)).unwrap();
    // A layout both searches rank among their best, priced both ways.
    let layout = |c: &Candidate| {
        (
            c.layers.clone(),
            c.micro_batch_sizes.clone(),
            c.micro_batches.clone(),
        )
    };
    let (without, with) = (plain.plans.iter())
        .find_map(|p| {
            let same = again.plans.iter().find(|a| layout(a) == layout(p))?;
            Some((p, same))
        })
        .expect("a layout among the best with recomputation and without");
    let ratio = busy(with) / busy(without);
    assert!((ratio - 4.0 / 3.0).abs() < 1e-9, "{ratio}");
}

/// Four A10s, sequences of 2304: without the distributed optimizer two replicas of two stages run out of
/// memory at micro-batch size 2; sharding the optimizer state over the replicas
/// makes that plan fit, and it beats the four-stage pipeline. Priced with the
/// reductions after the pipeline: overlapped, four replicas of the whole model win
/// ([`overlapped_reductions_make_data_parallelism_win`]).
#[test]
fn distributed_optimizer_makes_a_faster_plan_fit() {
    let cost = CostModel {
        overlap_grad_reduce: false,
        ..a10s(4, 2304)
    };
    let off = plan(&cost, &request(16, Choice::Off, Choice::Off)).unwrap();
    assert!(!off
        .plans
        .iter()
        .any(|c| c.layers.len() == 2 && c.micro_batch_sizes[0] == 2));
    let auto = plan(&cost, &request(16, Choice::Off, Choice::Auto)).unwrap();
    let best = &auto.plans[0];
    assert!(best.options.distributed_optimizer, "{best:?}");
    assert_eq!((best.layers.len(), best.micro_batch_sizes[0]), (2, 2));
    assert!(best.prediction.step_time_s < off.plans[0].prediction.step_time_s);
    // Each rank holds its share of the optimizer state: half, on equal devices.
    let variant = best.options.cost(&cost);
    let mut ctx = Ctx::new(&variant);
    let shares = Shares::of_grid(&ctx, &best.devices);
    let (need, have) = memory_need(
        &mut ctx,
        &best.devices,
        &shares,
        (0, 0),
        best.layers[0],
        2,
        best.micro_batches[0],
    )
    .unwrap();
    let whole = plan_memory_without_sharding(&cost, best);
    let optimizer =
        cost.model.stage_params(best.layers[0], true, false) * variant.optimizer_bytes_per_param();
    assert!(
        (whole - need - optimizer / 2.0).abs() < 1.0,
        "{whole} {need} {optimizer}"
    );
    assert!(need <= have.unwrap() && whole > have.unwrap());
}

/// Stage 0's need of `c` on its first rank, the optimizer state whole.
fn plan_memory_without_sharding(cost: &CostModel, c: &Candidate) -> f64 {
    let variant = TrainOptions {
        distributed_optimizer: false,
        ..c.options
    }
    .cost(cost);
    let mut ctx = Ctx::new(&variant);
    let shares = Shares::of_grid(&ctx, &c.devices);
    memory_need(
        &mut ctx,
        &c.devices,
        &shares,
        (0, 0),
        c.layers[0],
        c.micro_batch_sizes[0],
        c.micro_batches[0],
    )
    .unwrap()
    .0
}

/// Two nodes of 8 H100s and a 7B-class model: a grid of tensor-parallel groups (one
/// node's devices, Megatron's flags) beats every grid of single devices, and its plan
/// is the grid its flags give, each stage's group inside one node.
#[test]
fn grid_plans_take_tensor_parallel_groups_where_faster() {
    let cluster = crate::cluster::ClusterSpec::from_toml(
        "[[group]]\nkind = \"h100-sxm\"\ncount = 8\nnode = \"a\"\n[[group]]\nkind = \"h100-sxm\"\ncount = 8\nnode = \"b\"\n[network]\nintra_node_gbs = 200\ninter_node_gbs = 25\n",
    )
    .unwrap();
    let model = synerfuse_plan::ModelShape {
        num_layers: 32,
        hidden_size: 4096,
        num_heads: 32,
        num_kv_heads: 32,
        ffn_hidden_size: 11008,
        vocab_size: 32_000,
        seq_length: 4096,
        tied: false,
        experts: None,
    };
    let cost = CostModel::new(model, cluster, None);
    let planned = |tp: Vec<usize>| {
        let request = PlanRequest {
            micro_batch_sizes: vec![1, 2, 4, 8],
            tensor_parallel_sizes: tp,
            context_parallel_sizes: Vec::new(),
            ..request(64, Choice::Auto, Choice::Auto)
        };
        plan(&cost, &request).unwrap().plans.remove(0)
    };
    let (single, grouped) = (planned(vec![1]), planned(vec![1, 2, 4, 8]));
    let t = grouped.tensor_parallel_size();
    assert_eq!(single.tensor_parallel_size(), 1);
    assert!(t > 1, "{grouped:?}");
    assert!(
        grouped.prediction.step_time_s < single.prediction.step_time_s,
        "tp {t}: {} s, tp 1: {} s",
        grouped.prediction.step_time_s,
        single.prediction.step_time_s
    );
    let plan = grouped.to_plan(&cost).unwrap();
    let flags = plan.grid_flags().expect("a grid's flags");
    let at = flags
        .args
        .iter()
        .position(|a| a == "--tensor-model-parallel-size");
    assert_eq!(
        flags.args[at.unwrap() + 1],
        t.to_string(),
        "{:?}",
        flags.args
    );
    let devices = cost.cluster.devices();
    let ranks = grouped.rank_devices().unwrap();
    let mut used = ranks.clone();
    used.sort_unstable();
    assert_eq!(used, (0..16).collect::<Vec<_>>());
    for replica in plan.replicas() {
        for stage in &replica.ranks {
            assert_eq!(stage.len(), t);
            let node = &devices[ranks[stage[0]]].node;
            assert!(stage.iter().all(|&r| &devices[ranks[r]].node == node));
        }
    }
}

/// A narrow 4-layer model (hidden 256, 4 heads) with `vocab_size` rows at sequence 32768
/// on the device groups of `groups` (a cluster file's `[[group]]` tables), 32 GB/s within
/// a node.
pub(super) fn long_sequence(groups: &str, vocab_size: usize) -> CostModel {
    let toml = format!("{groups}[network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n");
    let model = synerfuse_plan::ModelShape {
        num_layers: 4,
        hidden_size: 256,
        num_heads: 4,
        num_kv_heads: 4,
        ffn_hidden_size: 1024,
        vocab_size,
        seq_length: 32768,
        tied: false,
        experts: None,
    };
    CostModel {
        // The whole logits (Megatron's loss): these cases are of a head too large for a
        // lone device, as the runtime's chunked loss does not hold it.
        loss_in_chunks: false,
        ..CostModel::new(
            model,
            crate::cluster::ClusterSpec::from_toml(&toml).unwrap(),
            None,
        )
    }
}

/// Two devices of 2.5 GB and a sequence of 32768 tokens: no plan without context
/// parallelism fits (a stage's activations, or the head's logits, exceed a device); a
/// context-parallel pair does, each member holding half of every sequence (a plan file
/// that round-trips and checks).
#[test]
fn context_parallelism_makes_a_long_sequence_fit() {
    let cost = || {
        let toml = "[[group]]\nkind = \"a10\"\ncount = 2\nnode = \"a\"\nmemory_gb = 2.5\n";
        long_sequence(toml, 1000)
    };
    let mut r = request(2, Choice::Auto, Choice::Auto);
    r.micro_batch_sizes = vec![1];
    let without = plan(&cost(), &r);
    assert!(
        matches!(
            without,
            Err(PlanningError::Infeasible(Infeasibility::OutOfMemory(_)))
        ),
        "{without:?}"
    );
    r.context_parallel_sizes = vec![2];
    let outcome = plan(&cost(), &r).unwrap();
    let best = &outcome.plans[0];
    assert_eq!(
        (best.context_parallel_size(), best.layers.as_slice()),
        (2, &[4][..])
    );
    let file = best.to_plan(&cost()).unwrap();
    let replica = &file.replicas()[0];
    assert_eq!((replica.cp_size(0), replica.context_shares(0)), (2, None));
    assert_eq!(file.check(&cost().model, false), Ok(()));
    assert_eq!(
        synerfuse_plan::Plan::from_toml(&file.to_toml().unwrap(), None),
        Ok(file)
    );
}

/// Four 6 GB devices, a 32,000-row head and a sequence of 32768 tokens: neither
/// tensor-parallel pairs nor context-parallel pairs (nor pipelines of them) fit; a
/// context-parallel pair of tensor-parallel pairs does (each device a quarter of the
/// activations and the logits, half the state), written as a plan that checks.
#[test]
fn context_parallel_pairs_of_tensor_parallel_pairs_fit_where_neither_does() {
    let cost = || {
        let toml = "[[group]]\nkind = \"a10\"\ncount = 4\nnode = \"a\"\nmemory_gb = 6\n";
        long_sequence(toml, 32_000)
    };
    let mut r = request(1, Choice::Auto, Choice::Auto);
    r.micro_batch_sizes = vec![1];
    let out_of_memory = |r: &PlanRequest| {
        let outcome = plan(&cost(), r);
        assert!(
            matches!(
                outcome,
                Err(PlanningError::Infeasible(Infeasibility::OutOfMemory(_)))
            ),
            "{outcome:?}"
        );
    };
    r.tensor_parallel_sizes = vec![1, 2];
    out_of_memory(&r);
    (r.tensor_parallel_sizes, r.context_parallel_sizes) = (vec![1], vec![2]);
    out_of_memory(&r);
    r.tensor_parallel_sizes = vec![1, 2];
    let outcome = plan(&cost(), &r).unwrap();
    let best = &outcome.plans[0];
    let shape = (best.tensor_parallel_size(), best.context_parallel_size());
    assert_eq!((shape, best.layers.as_slice()), ((2, 2), &[4][..]));
    let file = best.to_plan(&cost()).unwrap();
    let replica = &file.replicas()[0];
    assert_eq!((replica.cp_size(0), replica.tp_size(0)), (2, 2));
    assert_eq!(replica.tp_group(0, 1), [2, 3]);
    assert_eq!(file.check(&cost().model, true), Ok(()));
}

/// A tensor-parallel pair and a context-parallel pair of the same two devices, both at
/// even shares, are different units: one context prices each as itself (per-replica
/// plans hold both kinds in one context).
#[test]
fn a_tensor_and_a_context_parallel_pair_of_the_same_devices_are_priced_apart() {
    let cost = long_sequence("[[group]]\nkind = \"a10\"\ncount = 2\nnode = \"a\"\n", 1000);
    let model = &cost.model;
    let tp = TpGroup::new(model, vec![0, 1], vec![1, 1]).unwrap();
    let cp = TpGroup::context(model, vec![0, 1], vec![1, 1]).unwrap();
    let mut both = Ctx::with_groups(&cost, cost.cluster.devices(), vec![tp.clone(), cp.clone()]);
    let alone = |g: TpGroup| {
        let mut ctx = Ctx::with_groups(&cost, cost.cluster.devices(), vec![g]);
        ctx.costs(0, 1).unwrap().layer_s
    };
    let (tp_s, cp_s) = (alone(tp), alone(cp));
    assert_ne!(tp_s, cp_s);
    assert_eq!(both.costs(0, 1).unwrap().layer_s, tp_s);
    assert_eq!(both.costs(1, 1).unwrap().layer_s, cp_s);
}

/// The same four A10s with the runtime's overlapped reduction: the reduction of four
/// replicas of the whole model (sharded, so they fit) hides in the last micro-batch's
/// backward but for its last buckets, and they beat the two-stage pipelines, which win
/// when it runs after the pipeline.
#[test]
fn overlapped_reductions_make_data_parallelism_win() {
    let request = request(16, Choice::Off, Choice::Auto);
    let after = CostModel {
        overlap_grad_reduce: false,
        ..a10s(4, 2048)
    };
    let overlapped = plan(&a10s(4, 2048), &request).unwrap();
    let best = &overlapped.plans[0];
    assert!(best.options.distributed_optimizer, "{best:?}");
    assert_eq!((best.layers.len(), best.micro_batches.len()), (1, 4));
    let p = &best.prediction;
    // Its gradients reduce-scattered, the updated parameters gathered after the step.
    let exposed = p.step_time_s - p.pipeline_s - p.optimizer_s - p.param_gather_s;
    assert!(exposed < p.allreduce_s / 4.0, "{p:?}");
    assert!(p.param_gather_s > 0.0, "{p:?}");
    // Without overlap the same layout pays its whole reduction, and loses.
    let whole = plan(&after, &request).unwrap();
    assert_eq!(whole.plans[0].layers.len(), 2);
    let variant = TrainOptions {
        overlap_grad_reduce: false,
        ..best.options
    }
    .cost(&after);
    let mut ctx = plan_context::candidate_ctx(&variant, best);
    let same = simulate::simulate_candidate(&mut ctx, best).unwrap();
    assert!(same.step_time_s > whole.plans[0].prediction.step_time_s);
    assert!(same.step_time_s > best.prediction.step_time_s + p.allreduce_s / 2.0);
}

/// The same plan with `--overlap-param-gather`: the parameters of a 1.3B model come in
/// 40M-element buckets, each waited for just before the next forward reads it, and the
/// forward outpaces all but the first; the plan says to train so.
#[test]
fn overlapped_parameter_gathers_hide_behind_the_next_forward() {
    let request = request(16, Choice::Off, Choice::Auto);
    let gathered_after = plan(&a10s(4, 2048), &request).unwrap();
    let overlapping = CostModel {
        overlap_param_gather: true,
        ..a10s(4, 2048)
    };
    let overlapped = plan(&overlapping, &request).unwrap();
    let (after, best) = (&gathered_after.plans[0], &overlapped.plans[0]);
    assert_eq!(
        (&best.layers, &best.micro_batches),
        (&after.layers, &after.micro_batches)
    );
    assert!(best
        .options
        .train_flags()
        .contains(&"--overlap-param-gather".to_owned()));
    let (a, b) = (&after.prediction, &best.prediction);
    assert!(b.param_gather_s < a.param_gather_s / 4.0, "{b:?} vs {a:?}");
    let saved = a.step_time_s - b.step_time_s;
    assert!((saved - (a.param_gather_s - b.param_gather_s)).abs() < 1e-9);
}
