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
    /// How it reduces its gradients over the replicas.
    #[serde(flatten)]
    pub reduction: RunReduction,
}

/// How a run reduces its gradients over the replicas (`--overlap-grad-reduce`,
/// `--ddp-bucket-size`) and gathers the distributed optimizer's parameters
/// (`--overlap-param-gather`). A record from before runs said (2026-11-29) reduced each
/// chunk's gradients after its last backward, whole: not overlapped, and gathered after
/// the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunReduction {
    /// Buckets started inside the last backward (off: `--no-overlap-grad-reduce`).
    #[serde(default)]
    pub overlap_grad_reduce: bool,
    /// `--ddp-bucket-size`.
    #[serde(default)]
    pub ddp_bucket_size: Option<usize>,
    /// The distributed optimizer's parameter gathers waited for by the next forward
    /// (off: after the optimizer).
    #[serde(default)]
    pub overlap_param_gather: bool,
    /// MPI reductions whose members span hosts went island by island (off:
    /// `--no-hierarchical-reduction`, flat).
    #[serde(default = "hierarchical_by_default")]
    pub hierarchical: bool,
}

fn hierarchical_by_default() -> bool {
    true
}

impl Default for RunReduction {
    /// The runtime's default: overlapped, Megatron's bucket size.
    fn default() -> Self {
        RunReduction {
            overlap_grad_reduce: true,
            ddp_bucket_size: None,
            overlap_param_gather: false,
            hierarchical: true,
        }
    }
}
