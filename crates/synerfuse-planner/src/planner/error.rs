//! Why planning failed, and how far the closest candidate was from fitting.

/// Why planning found nothing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanningError {
    /// A model without layers or a batch without samples.
    #[error("the model needs layers and the global batch samples (got {layers} layers, global batch {global_batch_size})")]
    EmptyRequest {
        /// Decoder layers.
        layers: usize,
        /// Samples per step.
        global_batch_size: usize,
    },
    /// A device the cost model cannot price.
    #[error(transparent)]
    Cost(#[from] crate::cost::CostError),
    /// A candidate that does not form a plan (a planner bug, reported).
    #[error(transparent)]
    Plan(#[from] synerfuse_plan::PlanError),
    /// A grid candidate whose ranks do not form a topology (a planner bug, reported).
    #[error(transparent)]
    Topology(#[from] synerfuse_plan::TopologyError),
    /// A candidate whose pipelines cannot run their schedule (a planner bug, reported).
    #[error(transparent)]
    Schedule(#[from] synerfuse_plan::ScheduleError),
    /// No expert-parallel size asked for divides the experts (and plans holding every
    /// expert were not asked for).
    #[error("--expert-model-parallel-sizes {sizes:?}: none divides the {experts} experts (--num-experts)")]
    ExpertParallelSizes {
        /// The sizes asked for.
        sizes: Vec<usize>,
        /// Experts per MoE layer.
        experts: usize,
    },
    /// Every candidate breaks a constraint; the closest one's binding constraint.
    #[error("no feasible plan: {0}")]
    Infeasible(Infeasibility),
}

/// The constraint that rules out the candidate closest to feasible.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Infeasibility {
    /// The global batch is smaller than the replica count of every factorization.
    #[error("global batch {global_batch_size} cannot give each of the replicas of any factorization of {devices} devices a micro-batch")]
    BatchTooSmall {
        /// Samples per step.
        global_batch_size: usize,
        /// Devices in the cluster.
        devices: usize,
    },
    /// A stage needs more memory than its device has.
    #[error("out of memory: {0}")]
    OutOfMemory(MemoryShortfall),
    /// No split of the layers fits a factorization in memory.
    #[error("no layer split of {layers} layers over {stages} stages fits in memory")]
    NoLayerSplit {
        /// Decoder layers.
        layers: usize,
        /// Pipeline stages.
        stages: usize,
    },
}

/// A stage whose device lacks the memory it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryShortfall {
    /// Pipeline stage.
    pub stage: usize,
    /// Its decoder layers.
    pub layers: usize,
    /// Pipeline stages and replicas of the candidate.
    pub pp: usize,
    /// Replicas of the candidate.
    pub dp: usize,
    /// The device's kind.
    pub kind: String,
    /// The device's index in the cluster.
    pub device: usize,
    /// Bytes needed.
    pub need_bytes: f64,
    /// Bytes usable.
    pub usable_bytes: f64,
    /// Micro-batch size.
    pub micro_batch_size: usize,
    /// Micro-batches whose activations are held at once.
    pub in_flight: usize,
}

impl std::fmt::Display for MemoryShortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let extra = match (self.stage == 0, self.stage + 1 == self.pp) {
            (true, true) => ", embedding and head",
            (true, false) => " and the embedding",
            (false, true) => " and the head",
            _ => "",
        };
        write!(
            f,
            "pipeline stage {} ({} layers{extra}) on {} (device {}) needs {:.2} GB at micro-batch size {} with {} micro-batches in flight, {:.2} GB usable (pp {}, dp {})",
            self.stage,
            self.layers,
            self.kind,
            self.device,
            self.need_bytes / 1e9,
            self.micro_batch_size,
            self.in_flight,
            self.usable_bytes / 1e9,
            self.pp,
            self.dp
        )
    }
}

/// A constraint a candidate breaks, with how far (need / have) it is from feasible.
#[derive(Debug, Clone)]
pub(super) struct Violation {
    pub(super) ratio: f64,
    pub(super) reason: Infeasibility,
}
