//! A context-parallel stage (one thread per member, the collectives over shared memory)
//! is the whole stage: each member's logits or outputs are the whole run's at its
//! positions, the loss sums to the whole loss, the input gradients are the whole input
//! gradient at its positions, and the parameter gradients summed over the members are
//! the whole gradients: even (Megatron's layout) and in shares, GQA, tied embeddings,
//! with recomputation, and with each member's stage split over tensor-parallel ranks.

mod threads;
use threads::{thread_groups, ThreadGroup};

use std::collections::BTreeMap;
use std::sync::Mutex;
use synerfuse_model::cp::{ContextGroup, Solo};
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::tp::{TpBackwardFrom, TpCollectives};
use synerfuse_model::{BackwardFrom, LlamaConfig, Stage};
use synerfuse_plan::cp::ContextSplit;
use synerfuse_plan::TpLayout;

/// libtorch's global generator: one user at a time.
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
        tie_word_embeddings: true,
        attention_bias: false,
        mlp_bias: false,
        init_std: 0.1,
        moe: None,
    }
}

const SCALE: f64 = 1.0 / 7.0;
const SEQUENCE: i64 = 8;

struct Inputs {
    input: Tensor,
    labels: Tensor,
    mask: Tensor,
    output_grad: Tensor,
}

fn inputs(c: &LlamaConfig, first: bool) -> Inputs {
    let _one_at_a_time = INIT.lock().unwrap();
    tch::manual_seed(5);
    let (b, s, h) = (2, SEQUENCE, c.hidden_size as i64);
    let input = match first {
        true => Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu)),
        false => Tensor::randn([b, s, h], (Kind::Float, Device::Cpu)),
    };
    Inputs {
        input,
        labels: Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu)),
        mask: Tensor::randint(2, [b, s], (Kind::Float, Device::Cpu)),
        output_grad: Tensor::randn([b, s, h], (Kind::Float, Device::Cpu)),
    }
}

/// Output, loss sum, input gradient, parameter gradients (of a tensor-parallel shard:
/// its slices, `slices` says which).
struct Outcome {
    output: Tensor,
    loss: f64,
    input_grad: Option<Tensor>,
    grads: BTreeMap<String, Tensor>,
    slices: BTreeMap<String, (usize, std::ops::Range<i64>)>,
    /// The tensor-parallel rank (0 without).
    tp_rank: usize,
}

fn whole_stage(c: &LlamaConfig, layers: std::ops::Range<usize>) -> Stage {
    let _one_at_a_time = INIT.lock().unwrap();
    let mut stage = Stage::new(c, layers, Device::Cpu).unwrap();
    stage.init_by_name(3);
    stage
}

fn grads(stage: &Stage) -> BTreeMap<String, Tensor> {
    (stage.var_store().variables().into_iter())
        .map(|(n, p)| (n, p.grad().copy()))
        .collect()
}

fn whole(c: &LlamaConfig, layers: std::ops::Range<usize>, x: &Inputs) -> Outcome {
    let stage = whole_stage(c, layers);
    let pass = stage.forward_train(&x.input, None, None).unwrap();
    let output = pass.output.shallow_clone();
    let (loss, input_grad) = match stage.is_last() {
        true => {
            let loss = Stage::loss(&output, &x.labels, Some(&x.mask)).0;
            let loss_of = |l: &Tensor| Stage::loss(l, &x.labels, Some(&x.mask)).0 * SCALE;
            let grad = stage.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap();
            (loss.double_value(&[]), grad)
        }
        false => {
            let from = BackwardFrom::OutputGrad(&x.output_grad);
            (0.0, stage.backward(pass, from).unwrap())
        }
    };
    Outcome {
        output,
        loss,
        input_grad,
        grads: grads(&stage),
        slices: BTreeMap::new(),
        tp_rank: 0,
    }
}

/// Each member's outcome on its positions of `x`, its stage split over `tp_shares`
/// tensor-parallel ranks (one: a whole stage): member `cp * tp + t` runs context rank
/// `cp`, tensor rank `t`.
fn context_parallel(
    c: &LlamaConfig,
    layers: std::ops::Range<usize>,
    split: &ContextSplit,
    tp_shares: &[u32],
    (recompute, sequence_parallel): (bool, bool),
    x: &Inputs,
) -> Vec<(Vec<i64>, Outcome)> {
    let (n, tp) = (split.ranks(), tp_shares.len());
    let positions: Vec<Vec<i64>> = (0..n)
        .map(|r| split.position_list(r).iter().map(|&p| p as i64).collect())
        .collect();
    let layout = TpLayout::new(
        Some(tp_shares),
        tp,
        c.num_kv_heads,
        c.intermediate_size,
        c.vocab_size,
    )
    .unwrap();
    let layout = match c.moe {
        Some(moe) => layout.with_expert_ffn(moe.ffn_hidden_size).unwrap(),
        None => layout,
    };
    let mut tp_groups: Vec<Vec<ThreadGroup>> = (0..n).map(|_| thread_groups(tp)).collect();
    let mut cp_groups: Vec<Vec<ThreadGroup>> = (0..tp).map(|_| thread_groups(n)).collect();
    let mut members = Vec::new();
    for rank in (0..n).rev() {
        for t in (0..tp).rev() {
            let (tp_group, cp_group) = (tp_groups[rank].pop(), cp_groups[t].pop());
            members.push((rank, t, tp_group.unwrap(), cp_group.unwrap()));
        }
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = (members.into_iter().rev())
            .map(|(rank, t, tp_group, cp_group)| {
                let (positions, layers) = (positions.clone(), layers.clone());
                let mine = positions[rank].clone();
                let index = Tensor::from_slice(&mine);
                let pick = |t: &Tensor| t.index_select(1, &index);
                // Under sequence parallelism a stage after the first takes its input and
                // output gradient as this tensor-parallel rank's rows of the member's tokens.
                let rows = |x: Tensor| match sequence_parallel && layers.start > 0 {
                    true => x.chunk(tp as i64, 1)[t].copy(),
                    false => x,
                };
                let (input, labels, mask, output_grad) = (
                    rows(pick(&x.input)),
                    pick(&x.labels),
                    pick(&x.mask),
                    rows(pick(&x.output_grad)),
                );
                let shard = layout.shard(t).unwrap();
                scope.spawn(move || {
                    let stage = {
                        let _one_at_a_time = INIT.lock().unwrap();
                        let mut stage = match tp {
                            1 => Stage::new(c, layers, Device::Cpu).unwrap(),
                            _ => Stage::new_sharded(c, layers, shard, Device::Cpu).unwrap(),
                        };
                        stage.init_by_name(3);
                        stage.set_recompute(recompute);
                        stage.set_sequence_parallel(sequence_parallel);
                        stage
                    };
                    let group: &dyn TpCollectives = match tp {
                        1 => &Solo,
                        _ => &tp_group,
                    };
                    let cp = ContextGroup {
                        collectives: &cp_group,
                        positions,
                    };
                    let pass =
                        (stage.forward_train_parallel(&input, None, None, group, Some(&cp), None))
                            .unwrap();
                    let output = pass.output.shallow_clone();
                    let (loss, from) = match stage.is_last() {
                        true => {
                            let (loss, _) = stage
                                .parallel_loss(&output, &labels, Some(&mask), group)
                                .unwrap();
                            let from = TpBackwardFrom::Loss {
                                labels: &labels,
                                loss_mask: Some(&mask),
                                scale: SCALE,
                            };
                            (loss, from)
                        }
                        false => (0.0, TpBackwardFrom::OutputGrad(&output_grad)),
                    };
                    let input_grad =
                        (stage.backward_parallel(pass, from, group, Some(&cp), None)).unwrap();
                    stage.all_reduce_norm_grads(group).unwrap();
                    let slices = (stage.var_store().variables().into_keys())
                        .filter_map(|n| stage.shard_of(&n).map(|s| (n, s)))
                        .collect();
                    let outcome = Outcome {
                        output,
                        // Every tensor-parallel rank has the group's loss: count it once.
                        loss: if t == 0 { loss } else { 0.0 },
                        input_grad,
                        grads: grads(&stage),
                        slices,
                        tp_rank: t,
                    };
                    (mine, outcome)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// The largest difference between the whole run and the members'.
fn compare(whole: &Outcome, members: &[(Vec<i64>, Outcome)]) -> f64 {
    let mut worst: f64 = 0.0;
    let embedding = "model.embed_tokens.weight";
    for (positions, m) in members {
        let index = Tensor::from_slice(positions);
        let mut reference = whole.output.index_select(1, &index);
        if let (Some((_, vocab)), true) = (m.slices.get(embedding), whole.input_grad.is_none()) {
            // A tensor-parallel last stage's logits: its vocabulary rows.
            reference = reference.narrow(2, vocab.start, vocab.end - vocab.start);
        }
        worst = worst.max(max_diff(&m.output, &reference));
        if let (Some(mine), Some(all)) = (&m.input_grad, &whole.input_grad) {
            worst = worst.max(max_diff(mine, &all.index_select(1, &index)));
        }
    }
    let loss: f64 = members.iter().map(|(_, m)| m.loss).sum();
    worst = worst.max((loss - whole.loss).abs());
    let tp = members.iter().map(|(_, m)| m.tp_rank).max().unwrap_or(0) + 1;
    for t in 0..tp {
        let shard: Vec<&Outcome> = (members.iter().map(|(_, m)| m))
            .filter(|m| m.tp_rank == t)
            .collect();
        for name in shard[0].grads.keys() {
            let summed = (shard.iter())
                .map(|m| m.grads[name].shallow_clone())
                .reduce(|a, b| a + b)
                .unwrap();
            let reference = match shard[0].slices.get(name) {
                Some((dim, r)) => whole.grads[name].narrow(*dim as i64, r.start, r.end - r.start),
                None => whole.grads[name].shallow_clone(),
            };
            worst = worst.max(max_diff(&summed, &reference));
        }
    }
    worst
}

#[test]
fn a_context_parallel_stage_equals_the_whole_stage() {
    let c = config();
    let sequence = SEQUENCE as usize;
    for (what, split, tp, sp) in [
        (
            "CP 2 even",
            ContextSplit::even(sequence, 2).unwrap(),
            vec![1],
            false,
        ),
        (
            "CP 2 [3, 1]",
            ContextSplit::in_shares(sequence, &[3, 1]).unwrap(),
            vec![1],
            false,
        ),
        (
            "CP 4 even",
            ContextSplit::even(sequence, 4).unwrap(),
            vec![1],
            false,
        ),
        (
            "CP 2 x TP 2",
            ContextSplit::even(sequence, 2).unwrap(),
            vec![1, 1],
            false,
        ),
        (
            "CP 2 x TP 2 + SP",
            ContextSplit::even(sequence, 2).unwrap(),
            vec![1, 1],
            true,
        ),
        (
            "CP [3, 1] x TP [2, 1]",
            ContextSplit::in_shares(sequence, &[3, 1]).unwrap(),
            vec![2, 1],
            false,
        ),
    ] {
        for recompute in [false, true] {
            for (layers, first) in [(0..3, true), (1..2, false)] {
                let x = inputs(&c, first);
                let reference = whole(&c, layers.clone(), &x);
                let mode = (recompute, sp);
                let members = context_parallel(&c, layers.clone(), &split, &tp, mode, &x);
                let diff = compare(&reference, &members);
                println!("{what}, layers {layers:?}, recompute {recompute}: {diff:.2e}");
                assert!(
                    diff < 1e-5,
                    "{what} {layers:?} recompute {recompute}: {diff:e}"
                );
            }
        }
    }
}

/// Mixtral's experts under context parallelism: each member routes its own tokens, the
/// load-balancing loss counts every member's picks of a sequence (summed over the group)
/// against its own probabilities, and the members' parts add up to the whole loss.
#[test]
fn experts_under_context_parallelism_equal_the_whole_stage() {
    use synerfuse_model::{LoadBalancing, MoeConfig};
    let sequence = SEQUENCE as usize;
    for (balancing, split, tp, sp) in [
        (
            LoadBalancing::AuxLoss,
            ContextSplit::in_shares(sequence, &[3, 1]).unwrap(),
            vec![1],
            false,
        ),
        (
            LoadBalancing::SeqAuxLoss,
            ContextSplit::even(sequence, 2).unwrap(),
            vec![1, 1],
            true,
        ),
    ] {
        let c = LlamaConfig {
            moe: Some(MoeConfig {
                aux_loss_coeff: 0.5,
                load_balancing: balancing,
                ..MoeConfig::every_layer(4, 2, 32)
            }),
            ..config()
        };
        for (layers, first) in [(0..3, true), (1..2, false)] {
            let x = inputs(&c, first);
            let reference = whole(&c, layers.clone(), &x);
            let members = context_parallel(&c, layers.clone(), &split, &tp, (false, sp), &x);
            let diff = compare(&reference, &members);
            println!("{balancing:?}, TP {tp:?}, layers {layers:?}: {diff:.2e}");
            assert!(diff < 1e-5, "{balancing:?} {layers:?}: {diff:e}");
        }
    }
}
