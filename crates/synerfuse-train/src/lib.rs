#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
pub mod device_info;
pub mod emulation;
mod error;
pub mod expert_load;
pub mod grads;
pub mod loader;
pub mod loss_scale;
pub mod lost;
pub mod memory;
pub mod metrics;
pub mod optim;
pub mod param_gather;
pub mod pipeline;
mod precision;
pub mod profiler;
pub mod replan;
pub mod signals;
pub mod trainer;
pub mod zero;

pub use error::TrainError;
pub use trainer::{TrainConfig, TrainSummary, Trainer};
