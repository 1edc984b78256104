//! What a run was: the record a `--log-json` file starts with (and repeats after a
//! switch of plans), enough to price the run again. Written by the runtime, read by the
//! calibration and the re-planner.

use crate::{ModelShape, Plan};
use serde::{Deserialize, Serialize};

/// What a `--log-json` file's `run` record says of the run: enough to price it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The model, at the run's sequence length.
    pub model: ModelShape,
    /// The plan it runs (each rank's kind and emulated speed in its placements).
    pub plan: Plan,
    /// Each rank's host, in rank order (empty: one host).
    #[serde(default)]
    pub hosts: Vec<String>,
    /// `--recompute-activations`.
    pub recompute: bool,
    /// `--use-distributed-optimizer`.
    pub distributed_optimizer: bool,
    /// Bytes per activation element on the wire (4 in fp32, 2 in bf16).
    pub compute_bytes: f64,
}
