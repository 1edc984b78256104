#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod config;
pub mod cp;
pub mod cuda;
mod device;
mod generate;
pub mod hf;
mod llama;
mod moe;
mod norm;
mod pass;
pub mod tp;

pub use config::{
    padded_vocab_size, ConfigError, LlamaConfig, LoadBalancing, MegatronModelArgs, MoeConfig,
};
pub use device::{set_deterministic, DeviceRequest, ModelError, ResolveDevice};
pub use generate::{generate, GenerateOptions};
pub use llama::{BackwardFrom, KvCache, Stage, StageError};
pub use moe::{load_balancing_loss, ExpertGroup, LayerBalance};
pub use pass::ForwardPass;
pub use tch;
