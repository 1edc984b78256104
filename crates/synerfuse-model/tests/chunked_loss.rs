//! A last stage whose forward ends with its normed hidden states and whose loss runs the
//! output layer chunk by chunk ([`StageHead::WithLoss`]) is the stage computing the
//! whole logits: the loss sum bit for bit, the parameter and input gradients to
//! rounding, with tied and untied embeddings, a loss mask, ignored labels, a ragged last
//! chunk, in one graph and cut at its pieces.

use std::collections::BTreeMap;
use std::sync::Mutex;
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::{BackwardFrom, LlamaConfig, OpenGate, Stage, StageHead};

/// libtorch's global generator: one user at a time.
static INIT: Mutex<()> = Mutex::new(());

/// A vocabulary 16 times the hidden size: the loss runs in chunks of
/// ceil(tokens / 4) tokens (50 tokens: 13, 13, 13, 11).
fn config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 512,
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
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

const SCALE: f64 = 1.0 / 11.0;

struct Outcome {
    loss: Tensor,
    count: Tensor,
    input_grad: Option<Tensor>,
    grads: BTreeMap<String, Tensor>,
}

#[derive(Clone, Copy)]
enum Way {
    /// The whole logits, the loss computed in the backward.
    Whole,
    /// The loss with the output layer, in chunks, kept in the forward; `cut`: the graph
    /// cut at the stage's pieces.
    Chunked { cut: bool },
}

fn run(c: &LlamaConfig, layers: std::ops::Range<usize>, way: Way) -> Outcome {
    let _one_at_a_time = INIT.lock().unwrap();
    let mut stage = Stage::new(c, layers, Device::Cpu).unwrap();
    stage.init_by_name(3);
    tch::manual_seed(9);
    let (b, s) = (2, 25);
    let input = match stage.is_first() {
        true => Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu)),
        false => Tensor::randn([b, s, c.hidden_size as i64], (Kind::Float, Device::Cpu)),
    };
    let labels = Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu));
    // A few ignored labels, and a loss mask with zeros elsewhere.
    let labels = labels.index_fill(1, &Tensor::from_slice(&[3i64, 17]), -100);
    let mask = Tensor::randint(2, [b, s], (Kind::Float, Device::Cpu));
    let (loss, count, input_grad) = match way {
        Way::Whole => {
            let pass = stage.forward_train(&input, None, None).unwrap();
            let (loss, count) = Stage::loss(&pass.output, &labels, Some(&mask));
            let loss_of = |logits: &Tensor| Stage::loss(logits, &labels, Some(&mask)).0 * SCALE;
            let input_grad = stage.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap();
            (loss, count, input_grad)
        }
        Way::Chunked { cut } => {
            let gated = stage.gated(&OpenGate).ending_with(StageHead::WithLoss);
            let mut pass = match cut {
                true => gated.forward_train_cut(&input, None, None).unwrap(),
                false => gated.forward_train(&input, None, None).unwrap(),
            };
            assert_eq!(pass.output.size(), [b, s, c.hidden_size as i64]);
            let (loss, count) = stage.attach_loss(&mut pass, &labels, Some(&mask));
            let attached = pass.take_attached_loss().expect("a kept loss");
            let loss_of = |_: &Tensor| &attached * SCALE;
            let input_grad = stage.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap();
            (loss, count, input_grad)
        }
    };
    let grads = (stage.var_store().variables().into_iter())
        .map(|(n, p)| (n, p.grad().copy()))
        .collect();
    Outcome {
        loss,
        count,
        input_grad,
        grads,
    }
}

fn assert_same(whole: &Outcome, chunked: &Outcome, case: &str) {
    assert_eq!(
        whole.loss.double_value(&[]).to_bits(),
        chunked.loss.double_value(&[]).to_bits(),
        "{case}: loss sum"
    );
    assert_eq!(
        whole.count.double_value(&[]),
        chunked.count.double_value(&[]),
        "{case}: counted tokens"
    );
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        let diff = (a - b).abs().max().double_value(&[]);
        let scale = a.abs().max().double_value(&[]).max(1e-3);
        assert!(
            diff <= 1e-6 * scale,
            "{case}: {what} differs by {diff} (max {scale})"
        );
    };
    for (name, g) in &whole.grads {
        close(g, &chunked.grads[name], name);
    }
    match (&whole.input_grad, &chunked.input_grad) {
        (Some(a), Some(b)) => close(a, b, "input gradient"),
        (None, None) => {}
        _ => panic!("{case}: one run has an input gradient, the other none"),
    }
}

#[test]
fn the_chunked_loss_is_the_whole_logits_loss() {
    for tied in [false, true] {
        let c = config(tied);
        let whole = run(&c, 0..2, Way::Whole);
        assert!(whole.loss.double_value(&[]) > 0.0);
        for cut in [false, true] {
            let chunked = run(&c, 0..2, Way::Chunked { cut });
            assert_same(&whole, &chunked, &format!("tied {tied}, cut {cut}"));
        }
    }
}

#[test]
fn a_last_stage_after_others_passes_the_same_input_gradient() {
    let c = config(false);
    let whole = run(&c, 1..2, Way::Whole);
    for cut in [false, true] {
        let chunked = run(&c, 1..2, Way::Chunked { cut });
        assert!(chunked.input_grad.is_some());
        assert_same(&whole, &chunked, &format!("stage 1..2, cut {cut}"));
    }
}

#[test]
fn a_stage_before_the_last_ends_with_its_hidden_states_either_way() {
    let c = config(false);
    let _one_at_a_time = INIT.lock().unwrap();
    let stage = Stage::new(&c, 0..1, Device::Cpu).unwrap();
    let input = Tensor::zeros([1, 4], (Kind::Int64, Device::Cpu));
    let gated = stage.gated(&OpenGate).ending_with(StageHead::WithLoss);
    let pass = gated.forward_train(&input, None, None).unwrap();
    assert_eq!(pass.output.size(), [1, 4, c.hidden_size as i64]);
}
