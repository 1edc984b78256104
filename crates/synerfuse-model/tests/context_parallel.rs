//! A context-parallel stage (one thread per member, the collectives over shared memory)
//! is the whole stage: each member's logits or outputs are the whole run's at its
//! positions, the loss sums to the whole loss, the input gradients are the whole input
//! gradient at its positions, and the parameter gradients summed over the members are
//! the whole gradients: even (Megatron's layout) and in shares, GQA, tied embeddings,
//! with recomputation.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};
use synerfuse_model::cp::{ContextGroup, Solo};
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::tp::{CollectiveError, TpBackwardFrom, TpCollectives};
use synerfuse_model::{BackwardFrom, LlamaConfig, Stage};
use synerfuse_parallel::cp::ContextSplit;

/// libtorch's global generator: one user at a time.
static INIT: Mutex<()> = Mutex::new(());

/// Collectives between threads: every member puts its tensor in a slot, all read all.
struct ThreadGroup {
    rank: usize,
    slots: Arc<Mutex<Vec<Option<Tensor>>>>,
    barrier: Arc<Barrier>,
}

impl TpCollectives for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.slots.lock().unwrap().len()
    }

    fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        let sum = self.all_reduce_sum(tensor)?;
        let n = sum.size()[0] / self.size() as i64;
        Ok(sum.narrow(0, self.rank as i64 * n, n))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        self.slots.lock().unwrap()[self.rank] = Some(tensor.detach().copy());
        self.barrier.wait();
        let all = {
            let slots = self.slots.lock().unwrap();
            let tensors: Vec<&Tensor> = slots.iter().map(|s| s.as_ref().unwrap()).collect();
            Tensor::stack(&tensors, 0)
        };
        self.barrier.wait();
        Ok(all)
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        Ok(self
            .all_gather(tensor)?
            .sum_dim_intlist(0, false, tensor.kind()))
    }
}

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

/// Output, loss sum, input gradient, parameter gradients.
struct Outcome {
    output: Tensor,
    loss: f64,
    input_grad: Option<Tensor>,
    grads: BTreeMap<String, Tensor>,
}

fn stage(c: &LlamaConfig, layers: std::ops::Range<usize>, recompute: bool) -> Stage {
    let _one_at_a_time = INIT.lock().unwrap();
    let mut stage = Stage::new(c, layers, Device::Cpu).unwrap();
    stage.init_by_name(3);
    stage.set_recompute(recompute);
    stage
}

fn grads(stage: &Stage) -> BTreeMap<String, Tensor> {
    (stage.var_store().variables().into_iter())
        .map(|(n, p)| (n, p.grad().copy()))
        .collect()
}

fn whole(c: &LlamaConfig, layers: std::ops::Range<usize>, x: &Inputs) -> Outcome {
    let stage = stage(c, layers, false);
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
    }
}

/// Each member's outcome on its positions of `x`.
fn context_parallel(
    c: &LlamaConfig,
    layers: std::ops::Range<usize>,
    split: &ContextSplit,
    recompute: bool,
    x: &Inputs,
) -> Vec<(Vec<i64>, Outcome)> {
    let n = split.ranks();
    let positions: Vec<Vec<i64>> = (0..n)
        .map(|r| split.position_list(r).iter().map(|&p| p as i64).collect())
        .collect();
    let slots = Arc::new(Mutex::new((0..n).map(|_| None).collect()));
    let barrier = Arc::new(Barrier::new(n));
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let group = ThreadGroup {
                    rank,
                    slots: slots.clone(),
                    barrier: barrier.clone(),
                };
                let (positions, layers) = (positions.clone(), layers.clone());
                let mine = positions[rank].clone();
                let index = Tensor::from_slice(&mine);
                let pick = |t: &Tensor| t.index_select(1, &index);
                let (input, labels, mask, output_grad) = (
                    pick(&x.input),
                    pick(&x.labels),
                    pick(&x.mask),
                    pick(&x.output_grad),
                );
                scope.spawn(move || {
                    let stage = stage(c, layers, recompute);
                    let cp = ContextGroup {
                        collectives: &group,
                        positions,
                    };
                    let pass = (stage.forward_train_parallel(&input, None, None, &Solo, Some(&cp)))
                        .unwrap();
                    let output = pass.output.shallow_clone();
                    let (loss, from) = match stage.is_last() {
                        true => {
                            let loss = Stage::loss(&output, &labels, Some(&mask)).0;
                            let from = TpBackwardFrom::Loss {
                                labels: &labels,
                                loss_mask: Some(&mask),
                                scale: SCALE,
                            };
                            (loss.double_value(&[]), from)
                        }
                        false => (0.0, TpBackwardFrom::OutputGrad(&output_grad)),
                    };
                    let input_grad =
                        (stage.backward_parallel(pass, from, &Solo, Some(&cp))).unwrap();
                    let outcome = Outcome {
                        output,
                        loss,
                        input_grad,
                        grads: grads(&stage),
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
    for (positions, m) in members {
        let index = Tensor::from_slice(positions);
        worst = worst.max(max_diff(&m.output, &whole.output.index_select(1, &index)));
        if let (Some(mine), Some(all)) = (&m.input_grad, &whole.input_grad) {
            worst = worst.max(max_diff(mine, &all.index_select(1, &index)));
        }
    }
    let loss: f64 = members.iter().map(|(_, m)| m.loss).sum();
    worst = worst.max((loss - whole.loss).abs());
    for (name, g) in &whole.grads {
        let summed = (members.iter())
            .map(|(_, m)| m.grads[name].shallow_clone())
            .reduce(|a, b| a + b)
            .unwrap();
        worst = worst.max(max_diff(&summed, g));
    }
    worst
}

#[test]
fn a_context_parallel_stage_equals_the_whole_stage() {
    let c = config();
    for (what, split) in [
        ("even", ContextSplit::even(SEQUENCE as usize, 2).unwrap()),
        (
            "shares [3, 1]",
            ContextSplit::in_shares(SEQUENCE as usize, &[3, 1]).unwrap(),
        ),
        (
            "even over 4",
            ContextSplit::even(SEQUENCE as usize, 4).unwrap(),
        ),
    ] {
        for recompute in [false, true] {
            for (layers, first) in [(0..3, true), (1..2, false)] {
                let x = inputs(&c, first);
                let reference = whole(&c, layers.clone(), &x);
                let members = context_parallel(&c, layers.clone(), &split, recompute, &x);
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
