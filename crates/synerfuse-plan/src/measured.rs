//! What a device and a network were measured doing (the profiler's output, the cost
//! model's input): plain records, so the runtime that measures them needs no planner.

use serde::{Deserialize, Serialize};

/// Measured times of one device kind at one micro-batch size, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MeasuredCosts {
    /// One decoder layer, forward.
    pub layer_fwd_s: f64,
    /// One decoder layer, backward.
    pub layer_bwd_s: f64,
    /// Embedding, forward + backward.
    pub embedding_s: f64,
    /// Final norm, head and loss, forward + backward.
    pub head_s: f64,
    /// Activation bytes one layer keeps per micro-batch (measured or estimated).
    pub layer_activation_bytes: f64,
    /// The optimizer step per parameter, s (absent from profiles older than it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_s_per_param: Option<f64>,
}

/// Measured network figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MeasuredNetwork {
    /// Point-to-point bandwidth, bytes/s (one direction).
    pub p2p_bytes_per_s: f64,
    /// All-reduce bus bandwidth, bytes/s.
    pub allreduce_bytes_per_s: f64,
    /// Latency of a small message, s.
    pub latency_s: f64,
    /// Ranks the all-reduce was measured on.
    pub ranks: usize,
}

impl MeasuredCosts {
    /// Every time and byte count through `f` (the optimizer's rate per parameter kept).
    pub fn map(&self, f: impl Fn(f64) -> f64) -> MeasuredCosts {
        MeasuredCosts {
            layer_fwd_s: f(self.layer_fwd_s),
            layer_bwd_s: f(self.layer_bwd_s),
            embedding_s: f(self.embedding_s),
            head_s: f(self.head_s),
            layer_activation_bytes: f(self.layer_activation_bytes),
            optimizer_s_per_param: self.optimizer_s_per_param,
        }
    }
}
