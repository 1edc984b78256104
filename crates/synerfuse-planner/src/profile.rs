//! A device profile (`synerfuse profile`'s output, the cost model's measured input) and
//! the terms a calibration fitted into it: data the cost model reads and the calibration
//! writes, below both.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use synerfuse_plan::{MeasuredCosts, MeasuredNetwork, ModelShape};

/// `synerfuse profile`'s output: costs per device kind and micro-batch size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// The model profiled.
    pub model: ModelShape,
    /// Kind → micro-batch size → costs.
    pub devices: BTreeMap<String, BTreeMap<usize, MeasuredCosts>>,
    /// Network between the profiled ranks, if more than one.
    #[serde(default)]
    pub network: Option<MeasuredNetwork>,
    /// What measured runs fitted into it (`synerfuse profile --calibrate`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
}

impl Profile {
    /// Seconds a calibration found every step to take beyond its simulation (0 when
    /// not calibrated).
    pub fn step_overhead_s(&self) -> f64 {
        self.calibration.as_ref().map_or(0.0, |c| c.step_overhead_s)
    }

    /// Costs of `kind` at micro-batch size `b`: measured, else interpolated between the
    /// measured sizes around it (a per-micro-batch fixed cost plus a per-sample one,
    /// which proportional scaling would drop: on the CPU a layer at size 3 is 22 % off
    /// scaled from size 2, 0.2 % interpolated between 2 and 4), else extrapolated from
    /// the two nearest, bounded by the nearest's cost and its per-sample cost; one
    /// measured size is scaled in proportion.
    pub fn costs(&self, kind: &str, b: usize) -> Option<MeasuredCosts> {
        let table = self.devices.get(kind)?;
        if let Some(c) = table.get(&b) {
            return Some(*c);
        }
        let below = table.range(..b).next_back();
        let above = table.range(b + 1..).next();
        let pair = match (below, above) {
            (Some(lo), Some(hi)) => Some((lo, hi)),
            (Some(hi), None) => table.range(..*hi.0).next_back().map(|lo| (lo, hi)),
            (None, Some(lo)) => table.range(lo.0 + 1..).next().map(|hi| (lo, hi)),
            (None, None) => return None,
        };
        let Some(((&lo, c_lo), (&hi, c_hi))) = pair else {
            let (&n, c) = below.or(above)?;
            return Some(c.map(|x| x * b as f64 / n as f64));
        };
        let t = (b as f64 - lo as f64) / (hi as f64 - lo as f64);
        let field = |f: fn(&MeasuredCosts) -> f64| {
            let (y_lo, y_hi) = (f(c_lo), f(c_hi));
            let y = y_lo + (y_hi - y_lo) * t;
            // Beyond the measured sizes: no cheaper than the nearest measured micro-batch
            // and no dearer per sample.
            let (n, y_n) = match b < lo {
                true => (lo, y_lo),
                false => (hi, y_hi),
            };
            let scaled = y_n * b as f64 / n as f64;
            match (b < lo, b > hi) {
                (true, _) => y.max(scaled).min(y_n),
                (_, true) => y.max(y_n).min(scaled),
                _ => y,
            }
        };
        Some(MeasuredCosts {
            layer_fwd_s: field(|c| c.layer_fwd_s),
            layer_bwd_s: field(|c| c.layer_bwd_s),
            embedding_s: field(|c| c.embedding_s),
            head_s: field(|c| c.head_s),
            layer_activation_bytes: field(|c| c.layer_activation_bytes),
            optimizer_s_per_param: c_lo.optimizer_s_per_param.or(c_hi.optimizer_s_per_param),
        })
    }
}

/// Measured ÷ simulated seconds of a device kind's passes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComputeScale {
    /// Forward passes.
    pub forward: f64,
    /// Backward passes.
    pub backward: f64,
}

/// The terms a calibration fitted, as the profile keeps them: the costs they scaled are
/// already scaled; `step_overhead_s` is added to every priced step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Calibration {
    /// Runs it was fitted from.
    pub runs: usize,
    /// Steps with spans among them.
    pub steps: usize,
    /// Per device kind and micro-batch size, measured ÷ the profile's passes.
    pub compute_scale: BTreeMap<String, BTreeMap<usize, ComputeScale>>,
    /// A send's fixed cost, fitted as the p2p latency, s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_s: Option<f64>,
    /// Measured ÷ simulated reduction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_scale: Option<f64>,
    /// Per device kind, measured ÷ simulated optimizer step.
    #[serde(default)]
    pub optimizer_scale: BTreeMap<String, f64>,
    /// What a step takes beyond its simulation with the terms above, s (the median
    /// over the runs).
    pub step_overhead_s: f64,
}
