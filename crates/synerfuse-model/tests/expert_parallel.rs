//! Expert parallelism (one thread per rank, the collectives over shared memory): members
//! of an expert-parallel group each run their own micro-batch and hold some experts of
//! every MoE layer; tokens go to their experts' members and back. Each member's output
//! and input gradient are the whole stage's on its micro-batch, its dense and router
//! gradients too, and an expert's gradient (on the member holding it) is the sum of the
//! whole stage's over every member's micro-batch. Even and uneven placements, with
//! tensor and sequence parallelism inside each member, recomputation, a middle stage.

mod biases;
mod threads;
use threads::{thread_groups, ThreadGroup};

use std::collections::BTreeMap;
use std::sync::Mutex;
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::tp::TpBackwardFrom;
use synerfuse_model::{
    BackwardFrom, ExpertGroup, LlamaConfig, LoadBalancing, MoeConfig, Stage, StageError,
};
use synerfuse_plan::TpLayout;

static INIT: Mutex<()> = Mutex::new(());

fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 3,
        num_heads: 8,
        num_kv_heads: 4,
        head_dim: 4,
        max_position_embeddings: 32,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        init_std: 0.1,
        moe: Some(MoeConfig {
            aux_loss_coeff: 0.3,
            load_balancing: LoadBalancing::AuxLoss,
            ..MoeConfig::every_layer(8, 2, 32)
        }),
    }
}

const SCALE: f64 = 1.0 / 5.0;

struct Inputs {
    input: Tensor,
    labels: Tensor,
    output_grad: Tensor,
}

/// Member `m`'s micro-batch (each member its own data).
fn inputs(c: &LlamaConfig, first: bool, m: i64) -> Inputs {
    let _one_at_a_time = INIT.lock().unwrap();
    tch::manual_seed(10 + m);
    let (b, s, h) = (2, 8, c.hidden_size as i64);
    Inputs {
        input: match first {
            true => Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu)),
            false => Tensor::randn([b, s, h], (Kind::Float, Device::Cpu)),
        },
        labels: Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu)),
        output_grad: Tensor::randn([b, s, h], (Kind::Float, Device::Cpu)),
    }
}

struct Outcome {
    output: Tensor,
    input_grad: Option<Tensor>,
    grads: BTreeMap<String, Tensor>,
    slices: BTreeMap<String, (usize, std::ops::Range<i64>)>,
}

fn grads(stage: &Stage) -> BTreeMap<String, Tensor> {
    (stage.var_store().variables().into_iter())
        .map(|(n, p)| (n, p.grad().copy()))
        .collect()
}

/// The whole stage on one member's micro-batch.
fn whole(c: &LlamaConfig, layers: std::ops::Range<usize>, x: &Inputs) -> Outcome {
    let stage = {
        let _one_at_a_time = INIT.lock().unwrap();
        let mut stage = Stage::new(c, layers, Device::Cpu).unwrap();
        stage.init_by_name(3);
        biases::randomize_biases(&stage);
        stage
    };
    let pass = stage.forward_train(&x.input, None, None).unwrap();
    let output = pass.output.shallow_clone();
    let input_grad = match stage.is_last() {
        true => {
            let loss_of = |l: &Tensor| Stage::loss(l, &x.labels, None).0 * SCALE;
            stage.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap()
        }
        false => (stage.backward(pass, BackwardFrom::OutputGrad(&x.output_grad))).unwrap(),
    };
    Outcome {
        output,
        input_grad,
        grads: grads(&stage),
        slices: BTreeMap::new(),
    }
}

/// Each member's outcome (member `m * tp + t`: expert-parallel member `m`, tensor rank
/// `t`) with experts `placement` per member.
fn expert_parallel(
    c: &LlamaConfig,
    layers: std::ops::Range<usize>,
    placement: &[Vec<usize>],
    (tp, sequence_parallel, recompute): (usize, bool, bool),
    xs: &[Inputs],
) -> Vec<Outcome> {
    let n = placement.len();
    let moe = c.moe.unwrap();
    let layout = TpLayout::new(None, tp, c.num_kv_heads, c.intermediate_size, c.vocab_size)
        .unwrap()
        .with_expert_ffn(moe.ffn_hidden_size)
        .unwrap();
    let mut tp_groups: Vec<Vec<ThreadGroup>> = (0..n).map(|_| thread_groups(tp)).collect();
    let mut ep_groups: Vec<Vec<ThreadGroup>> = (0..tp).map(|_| thread_groups(n)).collect();
    let mut members = Vec::new();
    for m in (0..n).rev() {
        for t in (0..tp).rev() {
            let (tp_group, ep_group) = (tp_groups[m].pop(), ep_groups[t].pop());
            members.push((m, t, tp_group.unwrap(), ep_group.unwrap()));
        }
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = (members.into_iter().rev())
            .map(|(m, t, tp_group, ep_group)| {
                let layers = layers.clone();
                let x = &xs[m];
                let mut shard = layout.shard(t).unwrap();
                shard.experts = Some(placement[m].clone());
                let rows = |y: &Tensor| match sequence_parallel && layers.start > 0 {
                    true => y.chunk(tp as i64, 1)[t].copy(),
                    false => y.copy(),
                };
                let (input, output_grad) = (rows(&x.input), rows(&x.output_grad));
                let labels = x.labels.copy();
                scope.spawn(move || {
                    tch::set_num_threads(1);
                    let stage = {
                        let _one_at_a_time = INIT.lock().unwrap();
                        let mut stage = Stage::new_sharded(c, layers, shard, Device::Cpu).unwrap();
                        stage.init_by_name(3);
                        biases::randomize_biases(&stage);
                        stage.set_sequence_parallel(sequence_parallel);
                        stage.set_recompute(recompute);
                        stage
                    };
                    let ep = ExpertGroup {
                        collectives: &ep_group,
                        placement: placement.to_vec(),
                        exchange_kind: None,
                    };
                    let pass = (stage.forward_train_parallel(
                        &input,
                        None,
                        None,
                        &tp_group,
                        None,
                        Some(&ep),
                    ))
                    .unwrap();
                    let output = pass.output.shallow_clone();
                    let from = match stage.is_last() {
                        true => TpBackwardFrom::Loss {
                            labels: &labels,
                            loss_mask: None,
                            scale: SCALE,
                        },
                        false => TpBackwardFrom::OutputGrad(&output_grad),
                    };
                    let input_grad =
                        (stage.backward_parallel(pass, from, &tp_group, None, Some(&ep))).unwrap();
                    stage.all_reduce_norm_grads(&tp_group).unwrap();
                    let slices = (stage.var_store().variables().into_keys())
                        .filter_map(|n| stage.shard_of(&n).map(|s| (n, s)))
                        .collect();
                    Outcome {
                        output,
                        input_grad,
                        grads: grads(&stage),
                        slices,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// Compares every member with the whole stage on its micro-batch; returns the worst
/// difference.
fn compare(references: &[Outcome], members: &[Outcome], tp: usize) -> f64 {
    let mut worst: f64 = 0.0;
    for (i, member) in members.iter().enumerate() {
        let reference = &references[i / tp];
        let last = member.slices.contains_key("lm_head.weight") || reference.input_grad.is_none();
        // A sharded last stage's logits are its vocabulary rows of the whole.
        let whole_output = match (tp > 1 && last, member.slices.get("lm_head.weight")) {
            (true, Some((_, r))) => reference.output.narrow(2, r.start, r.end - r.start),
            _ => reference.output.shallow_clone(),
        };
        worst = worst.max(max_diff(&member.output, &whole_output));
        if let (Some(a), Some(b)) = (&member.input_grad, &reference.input_grad) {
            worst = worst.max(max_diff(a, b));
        }
        for (name, grad) in &member.grads {
            let expert = name.contains(".experts.");
            // An expert's gradient sums every member's tokens; the rest is the member's.
            let whole = match expert {
                true => (references.iter())
                    .map(|r| r.grads[name].shallow_clone())
                    .reduce(|a, b| a + b)
                    .unwrap(),
                false => reference.grads[name].shallow_clone(),
            };
            let whole = match member.slices.get(name) {
                Some((dim, r)) => whole.narrow(*dim as i64, r.start, r.end - r.start),
                None => whole,
            };
            let d = max_diff(grad, &whole);
            assert!(d < 1e-5, "member {i}: {name} differs by {d}");
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
fn experts_across_members_equal_the_whole_stage() {
    let c = config();
    // Megatron's experts with biases (unless --disable-bias-linear), the attention's too.
    let biased = LlamaConfig {
        attention_bias: true,
        mlp_bias: true,
        ..config()
    };
    let even = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
    let uneven = vec![vec![0, 1, 2, 3, 4, 5], vec![6, 7]];
    let three = vec![vec![2, 5], vec![0, 1, 3, 7], vec![4, 6]];
    for (what, placement, mode, c) in [
        ("EP 2 even", &even, (1, false, false), &c),
        ("EP 2 [6, 2]", &uneven, (1, false, false), &c),
        (
            "EP 3 [2, 4, 2] interleaved, recompute",
            &three,
            (1, false, true),
            &c,
        ),
        ("EP 2 [6, 2] x TP 2 + SP", &uneven, (2, true, false), &c),
        ("EP 2 even x TP 2, recompute", &even, (2, false, true), &c),
        ("biases, EP 2 [6, 2]", &uneven, (1, false, false), &biased),
        (
            "biases, EP 2 [6, 2] x TP 2 + SP",
            &uneven,
            (2, true, false),
            &biased,
        ),
    ] {
        for (layers, first) in [(0..3, true), (1..2, false)] {
            let xs: Vec<Inputs> = (0..placement.len() as i64)
                .map(|m| inputs(c, first, m))
                .collect();
            let references: Vec<Outcome> = xs.iter().map(|x| whole(c, layers.clone(), x)).collect();
            let members = expert_parallel(c, layers.clone(), placement, mode, &xs);
            let worst = compare(&references, &members, mode.0);
            println!("{what}, layers {layers:?}: {worst:.2e}");
            assert!(worst < 1e-5, "{what} {layers:?}: {worst:e}");
        }
    }
}

/// A stage holding some experts refuses to run without its group, and a placement that
/// misses an expert or gives it twice is named.
#[test]
fn partial_experts_need_their_group_and_a_whole_placement() {
    let c = config();
    let layout = TpLayout::new(None, 1, c.num_kv_heads, c.intermediate_size, c.vocab_size)
        .unwrap()
        .with_expert_ffn(32)
        .unwrap();
    let mut shard = layout.shard(0).unwrap();
    shard.experts = Some(vec![0, 1, 2, 3]);
    let stage = Stage::new_sharded(&c, 0..2, shard, Device::Cpu).unwrap();
    let held = stage.var_store().variables();
    assert!(held.contains_key("model.layers.0.block_sparse_moe.experts.3.w1.weight"));
    assert!(!held.contains_key("model.layers.0.block_sparse_moe.experts.4.w1.weight"));
    let x = inputs(&c, true, 0);
    let Err(e) = stage.forward_train(&x.input, None, None) else {
        panic!("a stage without some experts ran alone");
    };
    assert!(matches!(e, StageError::ExpertsElsewhere { .. }), "{e}");
    let solo = synerfuse_model::cp::Solo;
    for placement in [
        vec![vec![0, 1, 2, 3], vec![4, 5, 6]],
        vec![vec![0, 1, 2, 3], vec![3, 4, 5, 6, 7]],
        vec![vec![4, 5, 6, 7], vec![0, 1, 2, 3]],
    ] {
        let ep = ExpertGroup {
            collectives: &solo,
            placement,
            exchange_kind: None,
        };
        let Err(e) = stage.forward_train_parallel(&x.input, None, None, &solo, None, Some(&ep))
        else {
            panic!("a bad placement ran");
        };
        assert!(e.to_string().contains("exactly one member"), "{e}");
    }
}
