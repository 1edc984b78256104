//! A backward run piece by piece (the graph cut where each model piece ends, so that a
//! piece's gradients can leave for their reduction while the backward goes on) gives the
//! gradients and the input gradient of the backward in one call, and reports the pieces
//! from the last to the first: dense and MoE layers, first, middle and last stages,
//! with and without recomputation.

use std::collections::BTreeMap;
use std::sync::Mutex;
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::{BackwardFrom, FinalGrads, LlamaConfig, LoadBalancing, MoeConfig, Stage};

/// libtorch's global generator, which `run` seeds and draws from: one test at a time
/// (plain `cargo test` runs this file's tests on threads of one process).
static INIT: Mutex<()> = Mutex::new(());

fn config(moe: bool) -> LlamaConfig {
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
        moe: moe.then(|| MoeConfig {
            aux_loss_coeff: 0.3,
            load_balancing: LoadBalancing::AuxLoss,
            ..MoeConfig::every_layer(4, 2, 32)
        }),
    }
}

struct Outcome {
    input_grad: Option<Tensor>,
    grads: BTreeMap<String, Tensor>,
    reports: Vec<usize>,
}

/// One forward and backward of `layers` (cut at its pieces when `cut`), from the loss on
/// the last stage, else from a fixed output gradient.
fn run(c: &LlamaConfig, layers: std::ops::Range<usize>, cut: bool, recompute: bool) -> Outcome {
    let _one_at_a_time = INIT.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(5);
    let (b, s, h) = (2, 8, c.hidden_size as i64);
    let first = layers.start == 0;
    let last = layers.end == c.num_layers;
    let input = match first {
        true => Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu)),
        false => Tensor::randn([b, s, h], (Kind::Float, Device::Cpu)),
    };
    let labels = Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, Device::Cpu));
    let output_grad = Tensor::randn([b, s, h], (Kind::Float, Device::Cpu));
    let mut stage = Stage::new(c, layers, Device::Cpu).unwrap();
    stage.init_by_name(3);
    stage.set_recompute(recompute);
    let pass = match cut {
        true => stage.forward_train_cut(&input, None, None).unwrap(),
        false => stage.forward_train(&input, None, None).unwrap(),
    };
    let loss_of = |logits: &Tensor| Stage::loss(logits, &labels, None).0 / 16.0;
    let from = match last {
        true => BackwardFrom::Loss(&loss_of),
        false => BackwardFrom::OutputGrad(&output_grad),
    };
    let mut reports = Vec::new();
    let mut report = |f: FinalGrads| reports.push(f.from_piece);
    let input_grad = stage.backward_reporting(pass, from, &mut report).unwrap();
    let grads = (stage.var_store().variables().into_iter())
        .map(|(n, p)| (n, p.grad().copy()))
        .collect();
    Outcome {
        input_grad,
        grads,
        reports,
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn assert_same(whole: &Outcome, cut: &Outcome) {
    for (name, g) in &whole.grads {
        let d = max_diff(g, &cut.grads[name]);
        assert!(d < 1e-6, "{name}: gradients differ by {d}");
    }
    match (&whole.input_grad, &cut.input_grad) {
        (Some(a), Some(b)) => assert!(max_diff(a, b) < 1e-6, "input gradients differ"),
        (None, None) => {}
        _ => panic!("one backward gave an input gradient and the other not"),
    }
}

#[test]
fn a_backward_piece_by_piece_equals_one_backward() {
    for moe in [false, true] {
        let c = config(moe);
        for (layers, pieces) in [
            (0..3, vec![4, 3, 2, 1, 0, 0]),
            (1..2, vec![2, 0]),
            (2..3, vec![4, 3, 0]),
            (0..1, vec![1, 0, 0]),
        ] {
            for recompute in [false, true] {
                let whole = run(&c, layers.clone(), false, recompute);
                let cut = run(&c, layers.clone(), true, recompute);
                assert_same(&whole, &cut);
                assert_eq!(cut.reports, pieces, "moe {moe}, layers {layers:?}");
                // One backward reports once, at its end, every piece.
                if !recompute {
                    assert_eq!(whole.reports, vec![0]);
                }
            }
        }
    }
}

/// A gate that records the pieces it was asked about, in order.
#[derive(Default)]
struct Recording(std::cell::RefCell<Vec<usize>>);

impl synerfuse_model::PieceGate for Recording {
    fn before_piece(&self, piece: usize) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.0.borrow_mut().push(piece);
        Ok(())
    }
}

/// A gated forward (what `--overlap-param-gather` runs) asks its gate before each model
/// piece, once, in forward order, and computes what the ungated forward does, whole, cut
/// and tensor-parallel (over a group of one); a failing gate stops it, naming the piece.
#[test]
fn a_gated_forward_waits_before_each_piece_in_order() {
    // Building a stage draws its initial weights too.
    let _one_at_a_time = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let c = config(false);
    for layers in [0..3, 1..2, 1..3] {
        let mut stage = Stage::new(&c, layers.clone(), Device::Cpu).unwrap();
        stage.init_by_name(3);
        tch::manual_seed(5);
        let input = match layers.start {
            0 => Tensor::randint(c.vocab_size as i64, [2, 8], (Kind::Int64, Device::Cpu)),
            _ => Tensor::randn([2, 8, c.hidden_size as i64], (Kind::Float, Device::Cpu)),
        };
        let mut want: Vec<usize> = layers.clone().map(|l| l + 1).collect();
        if layers.start == 0 {
            want.insert(0, 0);
        }
        if layers.end == c.num_layers {
            want.push(c.num_layers + 1);
        }
        let plain = stage.forward_train(&input, None, None).unwrap().output;
        let solo = synerfuse_model::cp::Solo;
        for form in ["whole", "cut", "parallel"] {
            let gate = Recording::default();
            let gated = stage.gated(&gate);
            let pass = match form {
                "whole" => gated.forward_train(&input, None, None),
                "cut" => gated.forward_train_cut(&input, None, None),
                _ => gated.forward_train_parallel(&input, None, None, &solo, (None, None)),
            };
            let output = pass.unwrap().output;
            assert_eq!(*gate.0.borrow(), want, "{layers:?} {form}");
            let diff = (&output - &plain).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "{layers:?} {form}: {diff}");
        }
    }
    struct Failing;
    impl synerfuse_model::PieceGate for Failing {
        fn before_piece(
            &self,
            piece: usize,
        ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            match piece {
                2 => Err("the gather failed".into()),
                _ => Ok(()),
            }
        }
    }
    let stage = Stage::new(&c, 0..3, Device::Cpu).unwrap();
    let tokens = Tensor::zeros([1, 4], (Kind::Int64, Device::Cpu));
    let Err(err) = stage.gated(&Failing).forward_train(&tokens, None, None) else {
        panic!("a failing gate must stop the forward");
    };
    assert!(
        err.to_string().contains("model piece 2: the gather failed"),
        "{err}"
    );
}
