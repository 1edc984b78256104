#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

// Layered bottom to top, each module using only those listed before it (no import
// circle): config, error, norm, loss, joined, mlp, collectives, cp, moe, decoder, pass, llama (the
// stage), then tp, hf and generate on the stage; cuda, then device, apart.
mod backward;
mod collectives;
mod config;
pub mod cp;
pub mod cuda;
mod decoder;
mod device;
mod error;
mod gate;
mod generate;
pub mod hf;
mod joined;
mod llama;
mod loss;
mod mlp;
mod moe;
mod norm;
mod pass;
mod shim;
#[cfg(test)]
mod test_values;
pub mod tp;

pub use collectives::{OpenGate, PieceGate};
pub use config::{
    padded_vocab_size, ConfigError, LlamaConfig, LoadBalancing, MegatronModelArgs, MoeConfig,
};
pub use decoder::KvCache;
pub use device::{set_deterministic, DeviceRequest, ModelError, ResolveDevice};
pub use error::StageError;
pub use gate::GatedStage;
pub use generate::{generate, GenerateOptions};
pub use llama::{BackwardFrom, Stage};
pub use loss::StageHead;
pub use moe::{load_balancing_loss, ExpertGroup, LayerBalance};
pub use pass::{FinalGrads, ForwardPass};
pub use tch;
