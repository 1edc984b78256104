#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
pub mod device_info;
pub mod emulation;
pub mod expert_load;
pub mod grads;
pub mod loader;
pub mod lost;
pub mod memory;
pub mod metrics;
pub mod optim;
pub mod pipeline;
pub mod profiler;
pub mod replan;
pub mod signals;
pub mod trainer;
pub mod zero;

pub use trainer::{TrainConfig, TrainSummary, Trainer};

use std::path::PathBuf;

/// Why training stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A transfer between ranks failed.
    #[error(transparent)]
    Comm(#[from] comm::CommError),
    /// The step's data could not be served.
    #[error(transparent)]
    Loader(#[from] loader::LoaderError),
    /// A stage rejected its input.
    #[error(transparent)]
    Stage(#[from] synerfuse_model::StageError),
    /// This rank's device cannot be had.
    #[error("rank {rank}: {source}")]
    Device {
        /// The rank.
        rank: usize,
        /// Why.
        source: synerfuse_model::ModelError,
    },
    /// Weights could not be read or written.
    #[error(transparent)]
    Weights(#[from] synerfuse_model::hf::HfError),
    /// The topology is inconsistent.
    #[error(transparent)]
    Topology(#[from] synerfuse_plan::TopologyError),
    /// A checkpoint that cannot be written or is refused.
    #[error("checkpoint {path}: {problem}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        problem: checkpoint::CheckpointProblem,
    },
    /// A log file that cannot be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A plan for another number of ranks than the job has.
    #[error("the plan is for {plan} ranks but the job has {job}; launch with -np {plan}")]
    WorldSize {
        /// Ranks in the plan.
        plan: usize,
        /// Ranks in the job.
        job: usize,
    },
    /// A plan that cannot run (a replica's schedule).
    #[error(transparent)]
    Plan(#[from] synerfuse_plan::PlanError),
    /// A parameter the plan's gradient reductions miss (a bug, reported).
    #[error(transparent)]
    UnreducedParameter(#[from] grads::UnreducedParameter),
    /// Emulated speeds that are not one per rank.
    #[error("{given} emulated device speeds for a job of {ranks} ranks")]
    EmulatedSpeedCount {
        /// Speeds given.
        given: usize,
        /// Ranks in the job.
        ranks: usize,
    },
    /// Re-planning could not go on (the run stops rather than train on a broken plan).
    #[error("re-planning after iteration {iteration}: {reason}")]
    Replan {
        /// The iteration after which it was tried.
        iteration: u64,
        /// What went wrong.
        reason: String,
    },
    /// An `--emulate-speed-change` for a rank the job does not have.
    #[error("--emulate-speed-change {iteration}:{rank}:{speed}: the job has ranks 0 to {last}")]
    SpeedChangeRank {
        /// The change's iteration.
        iteration: u64,
        /// Its rank.
        rank: usize,
        /// Its speed.
        speed: f64,
        /// The job's last rank.
        last: usize,
    },
    /// An emulated speed outside (0, 1].
    #[error("rank {rank}: emulated device speed {speed} must be in (0, 1]")]
    EmulatedSpeed {
        /// The rank.
        rank: usize,
        /// Its speed.
        speed: f64,
    },
    /// A global batch whose samples have no token to learn from.
    #[error("the global batch after {consumed_samples} samples has no loss tokens")]
    NoLossTokens {
        /// Samples consumed before the batch.
        consumed_samples: u64,
    },
    /// A save asked of a run without a checkpoint directory.
    #[error("saving needs a checkpoint directory")]
    NoSaveDir,
    /// Optimizer state that does not fit the model.
    #[error(transparent)]
    OptimState(#[from] optim::OptimStateError),
    /// The pipeline program broke its own order (a bug, reported rather than hung).
    #[error("pipeline: {0}")]
    Pipeline(#[from] pipeline::PipelineFault),
}
