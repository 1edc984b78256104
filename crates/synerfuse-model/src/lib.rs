#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod config;
pub mod cp;
pub mod cuda;
mod device;
mod generate;
pub mod hf;
mod llama;
mod norm;
mod pass;
pub mod tp;

pub use config::{padded_vocab_size, ConfigError, LlamaConfig, MegatronModelArgs, MoeConfig};
pub use device::{set_deterministic, DeviceRequest, ModelError, ResolveDevice};
pub use generate::{generate, GenerateOptions};
pub use llama::{load_balancing_loss, BackwardFrom, KvCache, Stage, StageError};
pub use pass::ForwardPass;
pub use tch;
