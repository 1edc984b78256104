//! Loss scaling for fp16 training, as Megatron does it: the loss is multiplied by a scale
//! before the backward so that small gradients survive fp16's narrow range; the fp32 main
//! gradients are divided by it again before the update; a step whose gradients overflow
//! (any inf or NaN on any rank) is skipped everywhere. `--loss-scale S` keeps S
//! (megatron-core's `ConstantGradScaler`); otherwise fp16 scales dynamically
//! (`DynamicGradScaler`, whose arithmetic this follows step for step, in fp32 as its
//! tensors are): an overflow resets the growth tracker and counts the hysteresis tracker
//! down, halving the scale (not below the minimum) once it reaches zero; `window` clean
//! steps in a row double it and restore the hysteresis tracker.

/// Megatron's dynamic loss-scaling flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicLossScale {
    /// `--initial-loss-scale` (2^32).
    pub initial: f32,
    /// `--min-loss-scale` (1).
    pub min: f32,
    /// `--loss-scale-window` (1000): clean steps in a row before the scale doubles.
    pub window: u64,
    /// `--hysteresis` (2): overflows before the scale halves.
    pub hysteresis: u64,
}

impl Default for DynamicLossScale {
    fn default() -> Self {
        DynamicLossScale {
            initial: 4_294_967_296.0,
            min: 1.0,
            window: 1000,
            hysteresis: 2,
        }
    }
}

/// How the loss is scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossScaling {
    /// Not at all (fp32 and bf16 without `--loss-scale`).
    None,
    /// By a constant (`--loss-scale`).
    Constant(f32),
    /// Dynamically (fp16 without `--loss-scale`).
    Dynamic(DynamicLossScale),
}

/// A loss-scaling flag out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{flag} {value}: {problem}")]
pub struct LossScaleError {
    /// The flag.
    pub flag: &'static str,
    /// Its value.
    pub value: f64,
    /// What is wrong with it.
    pub problem: &'static str,
}

impl LossScaling {
    /// Checks the flags as megatron-core's scalers assert them.
    pub fn check(&self) -> Result<(), LossScaleError> {
        let err = |flag, value: f64, problem| {
            Err(LossScaleError {
                flag,
                value,
                problem,
            })
        };
        match *self {
            LossScaling::None => Ok(()),
            LossScaling::Constant(s) if !(s > 0.0 && s.is_finite()) => {
                err("--loss-scale", s.into(), "must be a positive number")
            }
            LossScaling::Constant(_) => Ok(()),
            LossScaling::Dynamic(d) => {
                if !(d.initial > 0.0 && d.initial.is_finite()) {
                    return err(
                        "--initial-loss-scale",
                        d.initial.into(),
                        "must be a positive number",
                    );
                }
                if !(d.min > 0.0 && d.min <= d.initial) {
                    return err(
                        "--min-loss-scale",
                        d.min.into(),
                        "must be positive and at most --initial-loss-scale",
                    );
                }
                if d.window == 0 {
                    return err("--loss-scale-window", 0.0, "must be at least 1");
                }
                if d.hysteresis == 0 {
                    return err("--hysteresis", 0.0, "must be at least 1");
                }
                Ok(())
            }
        }
    }
}

/// The scaler's state, as checkpoints keep it (megatron-core's `state_dict`: `scale`,
/// `growth_tracker`, `hysteresis_tracker`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f32,
    /// Clean steps in a row since the last overflow or growth.
    pub growth_tracker: u64,
    /// Overflows left before the scale halves (megatron-core lets it go below zero).
    pub hysteresis_tracker: i64,
}

/// The job's loss scale: one for every rank, updated by the job-wide overflow decision.
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    scaling: LossScaling,
    state: ScalerState,
}

impl GradScaler {
    /// A scaler at its initial scale.
    pub fn new(scaling: LossScaling) -> Self {
        let (scale, hysteresis) = match scaling {
            LossScaling::None => (1.0, 0),
            LossScaling::Constant(s) => (s, 0),
            LossScaling::Dynamic(d) => (d.initial, d.hysteresis as i64),
        };
        GradScaler {
            scaling,
            state: ScalerState {
                scale,
                growth_tracker: 0,
                hysteresis_tracker: hysteresis,
            },
        }
    }

    /// What the loss is multiplied by (1 without scaling).
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// Whether the loss is scaled at all: then an overflow skips the step.
    pub fn scales(&self) -> bool {
        self.scaling != LossScaling::None
    }

    /// After a step whose gradients did (`found_inf`) or did not overflow.
    pub fn update(&mut self, found_inf: bool) {
        let LossScaling::Dynamic(d) = self.scaling else {
            return;
        };
        let s = &mut self.state;
        if found_inf {
            s.growth_tracker = 0;
            s.hysteresis_tracker -= 1;
            if s.hysteresis_tracker <= 0 {
                s.scale = (s.scale * 0.5).max(d.min);
            }
        } else {
            s.growth_tracker += 1;
            if s.growth_tracker == d.window {
                s.growth_tracker = 0;
                s.hysteresis_tracker = d.hysteresis as i64;
                s.scale *= 2.0;
            }
        }
    }

    /// Its state, for a checkpoint.
    pub fn state(&self) -> ScalerState {
        self.state
    }

    /// Resumes from a checkpoint's state (a constant scaler keeps its flag's scale, as
    /// megatron-core's does).
    pub fn restore(&mut self, state: ScalerState) {
        if let LossScaling::Dynamic(_) = self.scaling {
            self.state = state;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamic(initial: f32, min: f32, window: u64, hysteresis: u64) -> GradScaler {
        GradScaler::new(LossScaling::Dynamic(DynamicLossScale {
            initial,
            min,
            window,
            hysteresis,
        }))
    }

    #[test]
    fn overflows_halve_after_the_hysteresis_and_clean_windows_double() {
        let mut s = dynamic(1024.0, 256.0, 3, 2);
        let mut seen = vec![];
        for found_inf in [
            true, true, true, false, false, false, true, true, true, true,
        ] {
            s.update(found_inf);
            seen.push(s.scale());
        }
        // 2 overflows: halved at the second; the third halves again (the tracker stays
        // at or below 0); 3 clean: doubled, tracker back to 2; then 2 more to halve;
        // never below 256.
        assert_eq!(
            seen,
            [1024.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0, 256.0, 256.0, 256.0]
        );
        assert_eq!(s.state().hysteresis_tracker, -2);
    }

    #[test]
    fn constant_and_no_scaling_never_change() {
        for scaling in [LossScaling::Constant(128.0), LossScaling::None] {
            let mut s = GradScaler::new(scaling);
            let before = s.scale();
            s.update(true);
            s.update(false);
            assert_eq!(s.scale(), before);
        }
        assert!(!GradScaler::new(LossScaling::None).scales());
    }

    #[test]
    fn bad_flags_are_named() {
        let bad = LossScaling::Dynamic(DynamicLossScale {
            min: 8.0,
            initial: 4.0,
            ..Default::default()
        });
        let err = bad.check().unwrap_err();
        assert_eq!(err.flag, "--min-loss-scale");
        assert!(LossScaling::Constant(0.0).check().is_err());
        let zero_window = LossScaling::Dynamic(DynamicLossScale {
            window: 0,
            ..Default::default()
        });
        assert_eq!(zero_window.check().unwrap_err().flag, "--loss-scale-window");
        assert!(LossScaling::Dynamic(DynamicLossScale::default())
            .check()
            .is_ok());
    }
}
