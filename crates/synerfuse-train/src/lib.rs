#![doc = include_str!("../README.md")]

pub mod checkpoint;
pub mod comm;
pub mod emulation;
pub mod grads;
pub mod loader;
pub mod metrics;
pub mod optim;
pub mod pipeline;
pub mod signals;
pub mod trainer;

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
    /// The plan is inconsistent.
    #[error(transparent)]
    Plan(#[from] synerfuse_parallel::PlanError),
    /// The topology is inconsistent.
    #[error(transparent)]
    Topology(#[from] synerfuse_parallel::TopologyError),
    /// A checkpoint that cannot be written or is refused.
    #[error("checkpoint {path}: {problem}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A log file that cannot be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Settings that do not fit together.
    #[error("{0}")]
    Config(String),
    /// The pipeline program broke its own order (a bug, reported rather than hung).
    #[error("pipeline: {0}")]
    Pipeline(#[from] pipeline::PipelineFault),
}
