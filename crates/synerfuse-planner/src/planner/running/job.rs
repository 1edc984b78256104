//! What a running job tells the re-planner, and why it may not be re-planned.

use crate::planner::error::PlanningError;
use synerfuse_plan::{MeasuredNetwork, ModelShape, Plan, PlanError, RunRecord};

/// What a running job tells the re-planner.
#[derive(Debug, Clone)]
pub struct RunningJob<'a> {
    /// The plan it runs.
    pub plan: &'a Plan,
    /// The model, at the run's sequence length.
    pub model: ModelShape,
    /// Each rank's forward and backward seconds per step under `plan`, in rank order.
    pub paces_s: &'a [f64],
    /// Each rank's host, in rank order (ranks of one host share its links).
    pub hosts: &'a [String],
    /// The network as measured between the job's ranks, if it was.
    pub network: Option<MeasuredNetwork>,
    /// Whether every stage recomputes its activations (`--recompute-activations`).
    pub recompute: bool,
    /// Bytes per activation element on the wire (4 in fp32, 2 in bf16).
    pub compute_bytes: f64,
    /// Gradient buckets started inside the last backward (off:
    /// `--no-overlap-grad-reduce`).
    pub overlap_grad_reduce: bool,
    /// `--ddp-bucket-size`.
    pub ddp_bucket_size: Option<usize>,
    /// `--overlap-param-gather` (priced where a plan shards its optimizer).
    pub overlap_param_gather: bool,
    /// Reductions across hosts island by island (off: flat).
    pub hierarchical_reduction: bool,
}

impl<'a> RunningJob<'a> {
    /// The running job this run is to the re-planner, at `paces_s` (each rank's forward
    /// and backward seconds per step) on the `network` measured between its ranks,
    /// reducing its gradients as its record says.
    pub fn of_run(
        run: &'a RunRecord,
        paces_s: &'a [f64],
        network: Option<MeasuredNetwork>,
    ) -> RunningJob<'a> {
        RunningJob {
            plan: &run.plan,
            model: run.model.clone(),
            paces_s,
            hosts: &run.hosts,
            network,
            recompute: run.recompute,
            compute_bytes: run.compute_bytes,
            overlap_grad_reduce: run.reduction.overlap_grad_reduce,
            ddp_bucket_size: run.reduction.ddp_bucket_size,
            overlap_param_gather: run.reduction.overlap_param_gather,
            hierarchical_reduction: run.reduction.hierarchical,
        }
    }
}

/// Why a running job cannot be re-planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReplanError {
    /// Not one pace (or host) per rank.
    #[error("re-planning needs one {what} per rank: got {got} for {ranks} ranks")]
    PerRank {
        /// `pace` or `host`.
        what: &'static str,
        /// How many were given.
        got: usize,
        /// Ranks of the plan.
        ranks: usize,
    },
    /// A pace that is not a positive time.
    #[error("rank {rank}'s measured pace ({pace_s} s) is not a positive time")]
    Pace {
        /// The rank.
        rank: usize,
        /// Its pace.
        pace_s: f64,
    },
    /// A plan with virtual pipeline chunks (not priced by the simulation here).
    #[error("re-planning a plan with virtual pipeline chunks (an interleaved schedule) is not supported")]
    Interleaved,
    /// Context-parallel shares that do not split the sequence.
    #[error("replica {replica}, stage {stage}: context-parallel shares {shares:?} do not split the sequence")]
    ContextShares {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// The shares.
        shares: Vec<u32>,
    },
    /// Tensor-parallel shares that do not split the model.
    #[error("replica {replica}, stage {stage}: tensor-parallel shares {shares:?} do not split the model")]
    Shares {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// The shares.
        shares: Vec<u32>,
    },
    /// The planner found nothing.
    #[error(transparent)]
    Planning(#[from] PlanningError),
    /// A plan that does not form (a planner bug, reported).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A grid plan whose ranks do not form a topology (a planner bug, reported).
    #[error(transparent)]
    Topology(#[from] synerfuse_plan::TopologyError),
}
