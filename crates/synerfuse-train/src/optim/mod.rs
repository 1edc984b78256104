//! Megatron's optimiser: AdamW with decoupled weight decay (none on norms and biases),
//! its learning-rate schedule, and clipping by the global gradient norm.
//!
//! The schedule counts *samples* as Megatron's `OptimizerParamScheduler` does (warm-up and
//! decay lengths are iterations × global batch), and an iteration trains with the rate of
//! the samples consumed before it, so the first warm-up step runs at lr 0, as in Megatron.

use std::collections::BTreeMap;
use tch::{Kind, Tensor};

mod config;
mod fused;
pub use config::AdamWConfig;
pub use fused::FusedAdamError;
pub(crate) use fused::{adamw_step, AdamTensor};

/// How the rate falls after warm-up (`--lr-decay-style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecayStyle {
    /// `constant`.
    Constant,
    /// `linear` down to `--min-lr`.
    Linear,
    /// `cosine` down to `--min-lr`.
    Cosine,
}

impl std::str::FromStr for DecayStyle {
    type Err = LrScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "constant" => Ok(DecayStyle::Constant),
            "linear" => Ok(DecayStyle::Linear),
            "cosine" => Ok(DecayStyle::Cosine),
            other => Err(LrScheduleError::UnknownDecayStyle(other.to_owned())),
        }
    }
}

/// A learning-rate schedule Megatron would reject.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LrScheduleError {
    /// A decay style that is none of `constant`, `linear`, `cosine`.
    #[error("`{0}` is not a decay style: expected constant, linear or cosine")]
    UnknownDecayStyle(String),
    /// A minimum rate below 0 or above the maximum.
    #[error("the minimum rate {min_lr} must be between 0 and the maximum rate {max_lr}")]
    MinLr {
        /// The minimum rate.
        min_lr: f64,
        /// The maximum rate.
        max_lr: f64,
    },
    /// A warm-up fraction outside [0, 1].
    #[error("the warm-up fraction {0} must be in [0, 1]")]
    WarmupFraction(f64),
    /// A warm-up longer than the decay it precedes.
    #[error(
        "the warm-up ({warmup_samples} samples) is longer than the decay ({decay_samples} samples)"
    )]
    WarmupLongerThanDecay {
        /// Warm-up length.
        warmup_samples: u64,
        /// Decay length.
        decay_samples: u64,
    },
    /// Iterations × global batch beyond 64 bits.
    #[error("{iterations} iterations of {global_batch_size} samples overflow")]
    Overflow {
        /// Iterations.
        iterations: u64,
        /// Samples per iteration.
        global_batch_size: u64,
    },
}

/// Megatron's learning-rate schedule, in samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// `--lr`.
    pub max_lr: f64,
    /// `--min-lr`.
    pub min_lr: f64,
    /// Warm-up length in samples (`--lr-warmup-iters` or `--lr-warmup-fraction` of the
    /// decay, times the global batch).
    pub warmup_samples: u64,
    /// Decay length in samples (`--lr-decay-iters`, default `--train-iters`, × batch).
    pub decay_samples: u64,
    /// `--lr-decay-style`.
    pub style: DecayStyle,
}

impl LrSchedule {
    /// The schedule from Megatron's iteration-based flags. `warmup_fraction` wins over
    /// `warmup_iters` when given, as in Megatron.
    pub fn from_iterations(
        max_lr: f64,
        min_lr: f64,
        style: DecayStyle,
        decay_iters: u64,
        warmup_iters: u64,
        warmup_fraction: Option<f64>,
        global_batch_size: u64,
    ) -> Result<Self, LrScheduleError> {
        if !(min_lr >= 0.0 && max_lr >= min_lr) {
            return Err(LrScheduleError::MinLr { min_lr, max_lr });
        }
        let samples = |iterations: u64| {
            iterations
                .checked_mul(global_batch_size)
                .ok_or(LrScheduleError::Overflow {
                    iterations,
                    global_batch_size,
                })
        };
        let decay_samples = samples(decay_iters)?;
        let warmup_samples = match warmup_fraction {
            Some(f) if (0.0..=1.0).contains(&f) => (f * decay_samples as f64) as u64,
            Some(f) => return Err(LrScheduleError::WarmupFraction(f)),
            None => samples(warmup_iters)?,
        };
        if warmup_samples > decay_samples && style != DecayStyle::Constant {
            return Err(LrScheduleError::WarmupLongerThanDecay {
                warmup_samples,
                decay_samples,
            });
        }
        Ok(LrSchedule {
            max_lr,
            min_lr,
            warmup_samples,
            decay_samples,
            style,
        })
    }

    /// The rate after `samples` consumed samples (Megatron's `get_lr` with
    /// `num_steps = samples` and an initial rate of 0).
    pub fn lr(&self, samples: u64) -> f64 {
        if self.warmup_samples > 0 && samples <= self.warmup_samples {
            return self.max_lr * samples as f64 / self.warmup_samples as f64;
        }
        if self.style == DecayStyle::Constant {
            return self.max_lr;
        }
        if samples > self.decay_samples {
            return self.min_lr;
        }
        let ratio = (samples - self.warmup_samples) as f64
            / (self.decay_samples - self.warmup_samples).max(1) as f64;
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - ratio,
            _ => 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0),
        };
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

struct ParamState {
    param: Tensor,
    /// fp32 master copy when the model computes in another dtype (`--bf16`).
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    decay: bool,
}

impl ParamState {
    /// The fp32 value the optimiser updates.
    fn value(&self) -> &Tensor {
        self.master.as_ref().unwrap_or(&self.param)
    }
}

/// AdamW over named parameters, with fp32 moments, and fp32 master weights for
/// parameters held in a lower precision. Norm weights and biases (1-D parameters) get no
/// weight decay, as in Megatron.
pub struct AdamW {
    config: AdamWConfig,
    params: BTreeMap<String, ParamState>,
    step: u64,
}

/// A checkpointed optimiser state that does not fit this optimiser.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimStateError {
    /// A parameter the model does not have.
    #[error("optimizer state for {0}: the model has no such parameter")]
    UnknownParameter(String),
    /// A value or moment of another shape.
    #[error("optimizer state for {name}: shape {found:?}, the model expects {expected:?}")]
    Shape {
        /// The parameter.
        name: String,
        /// The state's shape.
        found: Vec<i64>,
        /// The parameter's.
        expected: Vec<i64>,
    },
}

impl AdamW {
    /// An optimiser for `params` (name → parameter tensor).
    pub fn new(config: AdamWConfig, params: impl IntoIterator<Item = (String, Tensor)>) -> Self {
        let params = params
            .into_iter()
            .map(|(name, param)| {
                let master = (param.kind() != Kind::Float)
                    .then(|| param.detach().to_kind(Kind::Float).copy());
                let state = ParamState {
                    exp_avg: param.zeros_like().to_kind(Kind::Float),
                    exp_avg_sq: param.zeros_like().to_kind(Kind::Float),
                    decay: param.dim() > 1,
                    master,
                    param,
                };
                (name, state)
            })
            .collect();
        AdamW {
            config,
            params,
            step: 0,
        }
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Σ‖g‖² over this optimiser's parameters that have a gradient (the caller sums it
    /// over ranks, counting each parameter once, then takes the square root).
    pub fn grad_norm_squared(&self) -> f64 {
        self.params
            .values()
            .map(|s| s.param.grad())
            .filter(|g| g.defined())
            .map(|g| {
                let g = g.to_kind(Kind::Float);
                (&g * &g).sum(Kind::Float).double_value(&[])
            })
            .sum()
    }

    /// Scales every gradient by `factor` (clipping).
    pub fn scale_grads(&mut self, factor: f64) {
        tch::no_grad(|| {
            for s in self.params.values() {
                let mut g = s.param.grad();
                if g.defined() {
                    let _ = g.g_mul_scalar_(factor);
                }
            }
        });
    }

    /// Clips by the global norm: with `global_norm` (√ of the all-ranks sum of
    /// [`AdamW::grad_norm_squared`]) above `max_norm`, scales gradients by
    /// `max_norm / (global_norm + 1e-6)` as Megatron does. Returns the factor applied.
    pub fn clip(&mut self, global_norm: f64, max_norm: f64) -> f64 {
        let factor = clip_factor(global_norm, max_norm);
        if factor < 1.0 {
            self.scale_grads(factor);
        }
        factor
    }

    /// One AdamW step at learning rate `lr` with the parameters' own gradients (torch's
    /// AdamW update: decoupled decay, then the bias-corrected Adam step). Parameters
    /// without a gradient are left alone.
    pub fn step(&mut self, lr: f64) -> Result<(), FusedAdamError> {
        let grads: BTreeMap<String, Tensor> = self
            .params
            .iter()
            .map(|(n, s)| (n.clone(), s.param.grad()))
            .filter(|(_, g)| g.defined())
            .collect();
        self.step_with_grads(lr, &grads, 1.0)
    }

    /// One AdamW step with gradients given by parameter name (fp32 buffers the runtime
    /// reduced across ranks), each multiplied by `grad_scale` (the clipping factor).
    /// Parameters missing from `grads` are left alone. The update is computed in fp32 on
    /// the master weights and copied into lower-precision parameters.
    pub fn step_with_grads(
        &mut self,
        lr: f64,
        grads: &BTreeMap<String, Tensor>,
        grad_scale: f64,
    ) -> Result<(), FusedAdamError> {
        self.step += 1;
        tch::no_grad(|| {
            let updates: Vec<(&ParamState, Tensor)> = (self.params.iter())
                .filter_map(|(name, s)| Some((s, grads.get(name)?)))
                .map(|(s, g)| (s, scaled(&g.to_kind(Kind::Float), grad_scale)))
                .collect();
            let tensors: Vec<AdamTensor<'_>> = (updates.iter())
                .map(|(s, grad)| AdamTensor {
                    value: s.value(),
                    grad,
                    exp_avg: &s.exp_avg,
                    exp_avg_sq: &s.exp_avg_sq,
                    decay: s.decay,
                })
                .collect();
            fused::adamw_step(&self.config, &tensors, self.step, lr)?;
            for (s, _) in &updates {
                if let Some(master) = &s.master {
                    s.param.shallow_clone().copy_(master);
                }
            }
            Ok(())
        })
    }

    /// Sets every gradient to zero (keeps the buffers).
    pub fn zero_grad(&mut self) {
        for s in self.params.values_mut() {
            s.param.zero_grad();
        }
    }

    /// Bytes of its state: the fp32 moments, and fp32 masters where parameters are held
    /// in a lower precision.
    pub fn state_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        (self.params.values())
            .map(|s| bytes(&s.exp_avg) + bytes(&s.exp_avg_sq) + s.master.as_ref().map_or(0, bytes))
            .sum()
    }

    /// Parameter names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.params.keys().map(String::as_str)
    }

    /// `(name, fp32 value, exp_avg, exp_avg_sq)` of every parameter (for checkpoints): the
    /// master weight where there is one.
    pub fn state(&self) -> impl Iterator<Item = (&str, &Tensor, &Tensor, &Tensor)> {
        self.params
            .iter()
            .map(|(n, s)| (n.as_str(), s.value(), &s.exp_avg, &s.exp_avg_sq))
    }

    /// Restores one parameter from a checkpoint: its fp32 value and moments. Shapes must
    /// match the model's.
    pub fn load_param(
        &mut self,
        name: &str,
        value: &Tensor,
        exp_avg: Option<&Tensor>,
        exp_avg_sq: Option<&Tensor>,
    ) -> Result<(), OptimStateError> {
        let s = self
            .params
            .get_mut(name)
            .ok_or_else(|| OptimStateError::UnknownParameter(name.to_owned()))?;
        for t in [Some(value), exp_avg, exp_avg_sq].into_iter().flatten() {
            if t.size() != s.param.size() {
                return Err(OptimStateError::Shape {
                    name: name.to_owned(),
                    found: t.size(),
                    expected: s.param.size(),
                });
            }
        }
        tch::no_grad(|| {
            let device = s.param.device();
            if let Some(master) = &mut s.master {
                master.copy_(&value.to_kind(Kind::Float).to_device(device));
            }
            s.param
                .copy_(&value.to_kind(s.param.kind()).to_device(device));
            if let Some(m) = exp_avg {
                s.exp_avg.copy_(&m.to_kind(Kind::Float).to_device(device));
            }
            if let Some(v) = exp_avg_sq {
                s.exp_avg_sq
                    .copy_(&v.to_kind(Kind::Float).to_device(device));
            }
        });
        Ok(())
    }

    /// Sets the step count (bias correction) when resuming.
    pub fn set_steps(&mut self, steps: u64) {
        self.step = steps;
    }
}

/// `grad` times the clipping factor `scale` (itself when 1).
pub(crate) fn scaled(grad: &Tensor, scale: f64) -> Tensor {
    match scale == 1.0 {
        true => grad.shallow_clone(),
        false => grad * scale,
    }
}

/// Megatron's clipping factor: `max_norm / (norm + 1e-6)` when that is below 1, else 1
/// (and 1 when clipping is off, `max_norm <= 0`).
pub fn clip_factor(global_norm: f64, max_norm: f64) -> f64 {
    let factor = max_norm / (global_norm + 1e-6);
    if max_norm > 0.0 && factor < 1.0 {
        factor
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_schedule() {
        // lr 1e-3, min 1e-4, warm-up 10 iterations, decay 100, batch 4 (in samples).
        let s =
            LrSchedule::from_iterations(1e-3, 1e-4, DecayStyle::Cosine, 100, 10, None, 4).unwrap();
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(20) - 5e-4).abs() < 1e-15);
        assert_eq!(s.lr(40), 1e-3);
        let mid = s.lr(40 + 180); // halfway through the decay
        assert!((mid - (1e-4 + 0.5 * 9e-4)).abs() < 1e-12, "{mid}");
        assert_eq!(s.lr(400), 1e-4);
        assert_eq!(s.lr(10_000), 1e-4);
        let linear = LrSchedule {
            style: DecayStyle::Linear,
            ..s
        };
        assert!((linear.lr(40 + 90) - (1e-4 + 0.75 * 9e-4)).abs() < 1e-12);
        let constant = LrSchedule {
            style: DecayStyle::Constant,
            ..s
        };
        assert_eq!(constant.lr(10_000), 1e-3);
        let fraction =
            LrSchedule::from_iterations(1e-3, 0.0, DecayStyle::Cosine, 100, 99, Some(0.01), 8)
                .unwrap();
        assert_eq!(fraction.warmup_samples, 8);
        assert!(
            LrSchedule::from_iterations(1e-3, 2e-3, DecayStyle::Cosine, 100, 0, None, 1).is_err()
        );
        assert!("exponential".parse::<DecayStyle>().is_err());
    }

    /// Two steps checked against the AdamW formulas by hand; no decay on 1-D parameters.
    #[test]
    fn adamw_matches_the_formulas() {
        let w = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0])
            .view([2, 2])
            .set_requires_grad(true);
        let b = Tensor::from_slice(&[0.5f32, 0.5]).set_requires_grad(true);
        let config = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(
            config,
            [
                ("w".to_string(), w.shallow_clone()),
                ("b".to_string(), b.shallow_clone()),
            ],
        );
        let grads = [[0.1f64, -0.2, 0.3, 0.4], [0.05, -0.1, 0.2, -0.3]];
        let (mut p, mut m, mut v) = ([1.0f64, -2.0, 0.5, 3.0], [0.0; 4], [0.0; 4]);
        let mut bias = [0.5f64, 0.5];
        for (t, g) in grads.iter().enumerate() {
            opt.zero_grad();
            let loss = (&w * Tensor::from_slice(&g.map(|x| x as f32)).view([2, 2]))
                .sum(Kind::Float)
                + (&b * 2.0).sum(Kind::Float);
            loss.backward();
            opt.step(0.01).unwrap();
            let t = t as i32 + 1;
            for i in 0..4 {
                p[i] *= 1.0 - 0.01 * 0.1;
                m[i] = 0.9 * m[i] + 0.1 * g[i];
                v[i] = 0.95 * v[i] + 0.05 * g[i] * g[i];
                let denom = v[i].sqrt() / (1.0 - 0.95f64.powi(t)).sqrt() + 1e-8;
                p[i] -= 0.01 / (1.0 - 0.9f64.powi(t)) * m[i] / denom;
            }
            // Bias: gradient 2, no weight decay: each Adam step moves it by lr (= lr·sign(g)).
            for x in &mut bias {
                *x -= 0.01;
            }
        }
        let got: Vec<f32> = Vec::try_from(w.view([-1])).unwrap();
        for (g, want) in got.iter().zip(p) {
            assert!((f64::from(*g) - want).abs() < 1e-6, "{got:?} vs {p:?}");
        }
        let got_b: Vec<f32> = Vec::try_from(&b).unwrap();
        for (g, want) in got_b.iter().zip(bias) {
            assert!((f64::from(*g) - want).abs() < 1e-6, "{got_b:?}");
        }
        assert_eq!(opt.steps(), 2);
    }

    /// At a learning rate of 0 (warm-up's first step) nothing moves, a zero gradient
    /// included (the step's factor 1/lr must not turn 0 · ∞ into NaN).
    #[test]
    fn a_zero_learning_rate_moves_nothing() {
        let w = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
        let mut opt = AdamW::new(
            AdamWConfig::default(),
            [("w".to_string(), w.shallow_clone())],
        );
        (&w * Tensor::from_slice(&[0.0f32, 0.5]))
            .sum(Kind::Float)
            .backward();
        opt.step(0.0).unwrap();
        assert_eq!(Vec::<f32>::try_from(&w).unwrap(), [1.0, -2.0]);
        opt.step(1e-3).unwrap();
        let moved: Vec<f32> = Vec::try_from(&w).unwrap();
        assert!(
            moved.iter().all(|x| x.is_finite()) && moved[1] < -2.0 + 1e-2,
            "{moved:?}"
        );
    }

    #[test]
    fn clipping_by_global_norm() {
        let w = Tensor::from_slice(&[3.0f32, 4.0]).set_requires_grad(true);
        let mut opt = AdamW::new(
            AdamWConfig::default(),
            [("w".to_string(), w.shallow_clone())],
        );
        (&w * &w).sum(Kind::Float).backward(); // grad = 2w = [6, 8], norm 10
        assert!((opt.grad_norm_squared() - 100.0).abs() < 1e-9);
        let factor = opt.clip(10.0, 1.0);
        assert!((factor - 1.0 / (10.0 + 1e-6)).abs() < 1e-12);
        assert!((opt.grad_norm_squared().sqrt() - 1.0).abs() < 1e-5);
        assert_eq!(opt.clip(1.0, 5.0), 1.0);
    }
}
