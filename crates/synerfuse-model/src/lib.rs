#![doc = include_str!("../README.md")]

mod config;
mod device;
pub mod hf;
mod llama;

pub use config::{padded_vocab_size, ConfigError, LlamaConfig, MegatronModelArgs};
pub use device::{DeviceRequest, ModelError};
pub use llama::{BackwardFrom, ForwardPass, KvCache, Stage, StageError};
pub use tch;
