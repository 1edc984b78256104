//! A tensor-parallel stage (one thread per rank, the collectives over shared memory) is
//! the whole stage: the same logits slices, loss, input gradient and parameter gradients
//! (each shard's slice of the whole gradient), for even and uneven shares, GQA, tied and
//! untied embeddings, with and without sequence parallelism and recomputation, and with
//! Mixtral's experts (each rank its FFN columns of every expert, the router whole).

mod biases;
mod threads;
use threads::thread_groups;

use std::collections::BTreeMap;
use std::sync::Mutex;
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::tp::TpBackwardFrom;
use synerfuse_model::{BackwardFrom, LlamaConfig, MoeConfig, Stage};
use synerfuse_plan::TpLayout;

/// libtorch's global generator (inputs, `init_by_name`): one user at a time, also across
/// the tests of this process.
static INIT: Mutex<()> = Mutex::new(());

fn config(tied: bool) -> LlamaConfig {
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
        tie_word_embeddings: tied,
        attention_bias: false,
        mlp_bias: false,
        init_std: 0.1,
        moe: None,
    }
}

/// What one run leaves: the output, the loss sum, the input gradient, parameter gradients.
struct Outcome {
    output: Tensor,
    loss: f64,
    input_grad: Option<Tensor>,
    grads: BTreeMap<String, Tensor>,
    slices: BTreeMap<String, (usize, std::ops::Range<i64>)>,
    /// Every parameter's whole value (gathered from the shards on a sharded rank).
    params: BTreeMap<String, Tensor>,
    /// Each MoE layer's load-balancing loss and tokens per expert.
    balance: Vec<(f64, Vec<f64>)>,
}

fn balance(pass: &synerfuse_model::ForwardPass) -> Vec<(f64, Vec<f64>)> {
    (pass.load_balance().iter())
        .map(|b| {
            let tokens = Vec::<f64>::try_from(&b.tokens_per_expert).unwrap();
            (b.loss.double_value(&[]), tokens)
        })
        .collect()
}

struct Inputs {
    input: Tensor,
    labels: Tensor,
    mask: Tensor,
    output_grad: Tensor,
}

fn inputs(c: &LlamaConfig, first: bool) -> Inputs {
    let _one_at_a_time = INIT.lock().unwrap();
    tch::manual_seed(5);
    let (b, s, h) = (2, 6, c.hidden_size as i64);
    let input = if first {
        Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu))
    } else {
        Tensor::randn([b, s, h], (Kind::Float, Device::Cpu))
    };
    Inputs {
        input,
        labels: Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu)),
        mask: Tensor::randint(2, [b, s], (Kind::Float, Device::Cpu)),
        output_grad: Tensor::randn([b, s, h], (Kind::Float, Device::Cpu)),
    }
}

const SCALE: f64 = 1.0 / 7.0;

fn grads(stage: &Stage) -> BTreeMap<String, Tensor> {
    stage
        .var_store()
        .variables()
        .into_iter()
        .map(|(n, p)| (n, p.grad().copy()))
        .collect()
}

fn whole(c: &LlamaConfig, layers: std::ops::Range<usize>, x: &Inputs) -> Outcome {
    let stage = {
        let _one_at_a_time = INIT.lock().unwrap();
        let mut stage = Stage::new(c, layers, Device::Cpu).unwrap();
        stage.init_by_name(3);
        biases::randomize_biases(&stage);
        stage
    };
    let mut pass = stage.forward_train(&x.input, None, None).unwrap();
    let balance = balance(&pass);
    let output = pass.output.shallow_clone();
    let mut loss = 0.0;
    let input_grad = if stage.is_last() {
        // The loss computed once in the forward, with its graph, and the backward started
        // from it (as the trainer's 1F1B does).
        let (sum, _) = stage.attach_loss(&mut pass, &x.labels, Some(&x.mask));
        loss = sum.double_value(&[]);
        let attached = pass
            .take_attached_loss()
            .expect("a graph to keep the loss of");
        let loss_of = |_: &Tensor| &attached * SCALE;
        stage.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap()
    } else {
        stage
            .backward(pass, BackwardFrom::OutputGrad(&x.output_grad))
            .unwrap()
    };
    Outcome {
        output,
        loss,
        input_grad,
        grads: grads(&stage),
        slices: BTreeMap::new(),
        params: stage.var_store().variables().into_iter().collect(),
        balance,
    }
}

/// How the shards run.
#[derive(Debug, Clone, Copy, Default)]
struct Mode {
    sequence_parallel: bool,
    recompute: bool,
    /// A middle stage's output and input gradient as each rank's sequence rows (its
    /// input and output gradient come as rows under any sequence parallelism).
    rows_io: bool,
}

fn sharded(
    c: &LlamaConfig,
    layers: std::ops::Range<usize>,
    shares: &[u32],
    mode: Mode,
    x: &Inputs,
) -> Vec<Outcome> {
    let layout = TpLayout::new(
        Some(shares),
        shares.len(),
        c.num_kv_heads,
        c.intermediate_size,
        c.vocab_size,
    )
    .unwrap();
    let layout = match c.moe {
        Some(moe) => layout.with_expert_ffn(moe.ffn_hidden_size).unwrap(),
        None => layout,
    };
    let threads: Vec<_> = (thread_groups(shares.len()).into_iter().enumerate())
        .map(|(rank, group)| {
            let (c, layers, shard) = (c.clone(), layers.clone(), layout.shard(rank).unwrap());
            // Under sequence parallelism each rank of a stage after the first gets its rows
            // of the input and output gradient (the tests' middle stages are not last).
            let rows = |t: &Tensor| match mode.sequence_parallel && layers.start > 0 {
                true => t.chunk(shares.len() as i64, 1)[rank].copy(),
                false => t.copy(),
            };
            let (input, labels, mask, output_grad) = (
                rows(&x.input),
                x.labels.copy(),
                x.mask.copy(),
                rows(&x.output_grad),
            );
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                // init_by_name draws from libtorch's global generator: one thread at a time.
                let stage = {
                    let _one_at_a_time = INIT.lock().unwrap();
                    let mut stage = Stage::new_sharded(&c, layers, shard, Device::Cpu).unwrap();
                    stage.init_by_name(3);
                    biases::randomize_biases(&stage);
                    stage.set_sequence_parallel(mode.sequence_parallel);
                    stage.set_recompute(mode.recompute);
                    stage.set_sequence_rows_io(mode.rows_io, mode.rows_io);
                    stage
                };
                let mut pass = stage.forward_train_tp(&input, None, None, &group).unwrap();
                let balance = balance(&pass);
                let output = pass.output.shallow_clone();
                let (loss, from) = if stage.is_last() {
                    // Computed once, kept for the backward (as the trainer's 1F1B
                    // does; a recomputing stage keeps nothing and computes it again).
                    let (sum, _) = stage
                        .attach_parallel_loss(&mut pass, &labels, Some(&mask), &group)
                        .unwrap();
                    let sum = sum.double_value(&[]);
                    let from = TpBackwardFrom::Loss {
                        labels: &labels,
                        loss_mask: Some(&mask),
                        scale: SCALE,
                    };
                    (sum, from)
                } else {
                    (0.0, TpBackwardFrom::OutputGrad(&output_grad))
                };
                let input_grad = stage.backward_tp(pass, from, &group).unwrap();
                stage.all_reduce_norm_grads(&group).unwrap();
                let slices = stage
                    .var_store()
                    .variables()
                    .into_keys()
                    .filter_map(|n| stage.shard_of(&n).map(|s| (n, s)))
                    .collect();
                // By name, so every rank gathers in the same order.
                let named: BTreeMap<String, Tensor> =
                    stage.var_store().variables().into_iter().collect();
                let params = named
                    .iter()
                    .map(|(n, p)| (n.clone(), stage.gather_whole(n, p, &group).unwrap()))
                    .collect();
                Outcome {
                    output,
                    loss,
                    input_grad,
                    grads: grads(&stage),
                    slices,
                    params,
                    balance,
                }
            })
        })
        .collect();
    let mut ranks: Vec<Outcome> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    if mode.rows_io {
        // The ranks' rows, joined, are the whole output and input gradient.
        let join = |t: Vec<&Tensor>| Tensor::cat(&t, 1);
        let output = join(ranks.iter().map(|r| &r.output).collect());
        let input_grad = join(
            ranks
                .iter()
                .map(|r| r.input_grad.as_ref().unwrap())
                .collect(),
        );
        for r in &mut ranks {
            assert!(r.output.size()[1] < output.size()[1], "rows expected");
            r.output = output.shallow_clone();
            r.input_grad = Some(input_grad.shallow_clone());
        }
    }
    ranks
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// Checks every rank against the whole stage; returns the largest difference seen.
fn compare(whole: &Outcome, ranks: &[Outcome], last: bool) -> f64 {
    let mut worst: f64 = 0.0;
    let vocab_dim = 2;
    let mut offset = 0;
    for rank in ranks {
        assert_eq!(rank.balance.len(), whole.balance.len());
        for ((loss, tokens), (whole_loss, whole_tokens)) in rank.balance.iter().zip(&whole.balance)
        {
            worst = worst.max((loss - whole_loss).abs());
            assert_eq!(tokens, whole_tokens);
        }
        if last {
            // Each rank's logits are its vocabulary slice of the whole logits.
            let n = rank.output.size()[2];
            worst = worst.max(max_diff(
                &rank.output,
                &whole.output.narrow(vocab_dim, offset, n),
            ));
            offset += n;
            assert!(
                (rank.loss - whole.loss).abs() < 1e-5 * whole.loss.abs(),
                "{} vs {}",
                rank.loss,
                whole.loss
            );
        } else {
            worst = worst.max(max_diff(&rank.output, &whole.output));
        }
        match (&rank.input_grad, &whole.input_grad) {
            (Some(a), Some(b)) => worst = worst.max(max_diff(a, b)),
            (None, None) => {}
            _ => panic!("input gradients differ in presence"),
        }
        for (name, grad) in &rank.grads {
            let reference = &whole.grads[name];
            let reference = match rank.slices.get(name) {
                Some((dim, r)) => reference.narrow(*dim as i64, r.start, r.end - r.start),
                None => reference.shallow_clone(),
            };
            let d = max_diff(grad, &reference);
            assert!(d < 1e-5, "{name}: gradient differs by {d}");
            worst = worst.max(d);
            // The shards gathered by name are the whole stage's tensor, bit for bit.
            let gathered = max_diff(&rank.params[name], &whole.params[name]);
            assert!(
                gathered == 0.0,
                "{name}: gathered shards differ by {gathered}"
            );
        }
    }
    worst
}

#[test]
fn a_sharded_whole_model_equals_the_whole_stage() {
    for (tied, shares, sp, recompute) in [
        (true, vec![1, 1], false, false),
        (false, vec![1, 1], false, false),
        (true, vec![3, 1], false, false),
        (false, vec![2, 1, 1], false, false),
        (true, vec![1, 1], true, false),
        (false, vec![3, 1], true, false),
        (true, vec![2, 1, 1], true, false),
        (true, vec![3, 1], false, true),
        (false, vec![1, 1], true, true),
    ] {
        let c = config(tied);
        let x = inputs(&c, true);
        let reference = whole(&c, 0..3, &x);
        let mode = Mode {
            sequence_parallel: sp,
            recompute,
            rows_io: false,
        };
        let ranks = sharded(&c, 0..3, &shares, mode, &x);
        let worst = compare(&reference, &ranks, true);
        let what = format!(
            "tied {tied}, shares {shares:?}, sequence parallel {sp}, recompute {recompute}"
        );
        eprintln!("{what}: max difference {worst:.2e}");
        assert!(worst < 1e-5, "{what}: {worst}");
    }
}

/// Mixtral's experts under tensor parallelism: every rank routes alike and computes its
/// FFN columns of each expert; the router's partial gradients are summed over the group,
/// and each rank's load-balancing loss (the whole of it) counts once over the group.
/// Experts narrower than the dense FFN, dense layers between MoE ones, both kinds of
/// load-balancing loss, recomputation, biases.
#[test]
fn sharded_experts_equal_the_whole_stage() {
    use synerfuse_model::LoadBalancing::{AuxLoss, SeqAuxLoss};
    for (shares, sp, recompute, e, k, (ffn, freq, balancing), bias) in [
        (vec![1, 1], false, false, 4, 2, (48, 1, AuxLoss), false),
        (vec![3, 1], true, false, 4, 2, (40, 2, SeqAuxLoss), false),
        (vec![2, 1, 1], false, true, 3, 1, (24, 1, AuxLoss), false),
        (vec![1, 1], true, true, 4, 2, (32, 2, AuxLoss), false),
        // Megatron's experts with biases (the output's on shard 0 only).
        (vec![3, 1], true, false, 4, 2, (40, 2, SeqAuxLoss), true),
        (vec![2, 1, 1], false, true, 3, 1, (24, 1, AuxLoss), true),
    ] {
        let c = LlamaConfig {
            attention_bias: bias,
            mlp_bias: bias,
            moe: Some(MoeConfig {
                layer_freq: freq,
                aux_loss_coeff: 0.5,
                load_balancing: balancing,
                ..MoeConfig::every_layer(e, k, ffn)
            }),
            ..config(false)
        };
        let x = inputs(&c, true);
        let reference = whole(&c, 0..3, &x);
        let mode = Mode {
            sequence_parallel: sp,
            recompute,
            rows_io: false,
        };
        let ranks = sharded(&c, 0..3, &shares, mode, &x);
        let worst = compare(&reference, &ranks, true);
        let what = format!(
            "{e} experts of {ffn}, top {k}, every {freq} layers, {balancing:?}, shares {shares:?}, \
             sequence parallel {sp}, recompute {recompute}, biases {bias}"
        );
        eprintln!("{what}: max difference {worst:.2e}");
        assert!(worst < 1e-5, "{what}: {worst}");
    }
}

#[test]
fn a_sharded_middle_stage_passes_the_same_activations_and_gradients() {
    let c = config(false);
    let x = inputs(&c, false);
    let reference = whole(&c, 1..2, &x);
    for (sequence_parallel, recompute, rows_io) in [
        (false, false, false),
        (true, false, false),
        (true, true, false),
        (true, false, true),
        (true, true, true),
    ] {
        let mode = Mode {
            sequence_parallel,
            recompute,
            rows_io,
        };
        let ranks = sharded(&c, 1..2, &[3, 1], mode, &x);
        let worst = compare(&reference, &ranks, false);
        assert!(worst < 1e-5, "{mode:?}: {worst}");
    }
    // A shard refuses the whole-stage path rather than returning partial sums.
    let layout = TpLayout::new(None, 2, 4, 48, 64).unwrap();
    let stage = Stage::new_sharded(&c, 1..2, layout.shard(0).unwrap(), Device::Cpu).unwrap();
    assert!(stage.forward(&x.input, None, None).is_err());
}

/// The weights that share a GEMM (q, k, v; gate, up) lie end to end in one buffer on
/// every shard, whole or sharded, and again after a cast, so no projection copies them.
#[test]
fn weights_sharing_a_gemm_lie_end_to_end_on_every_shard_and_after_a_cast() {
    let c = config(false);
    let layout = TpLayout::new(None, 2, 4, 48, 64).unwrap();
    let whole = Stage::new(&c, 0..2, Device::Cpu).unwrap();
    let shards =
        (0..2).map(|r| Stage::new_sharded(&c, 0..2, layout.shard(r).unwrap(), Device::Cpu));
    for mut stage in std::iter::once(whole).chain(shards.map(Result::unwrap)) {
        assert!(stage.weights_end_to_end());
        for kind in [Kind::BFloat16, Kind::Float] {
            stage.set_kind(kind);
            assert!(stage.weights_end_to_end(), "after a cast to {kind:?}");
        }
    }
}
