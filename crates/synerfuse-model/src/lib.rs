//! LLaMA-family models in [tch] (libtorch) for synerfuse.
//!
//! A pipeline stage holds a contiguous range of decoder layers, plus the token
//! embedding on the first stage and the final norm and LM head on the last. This
//! crate is the only one of the data → plan → model → runtime chain that computes;
//! the runtime (`synerfuse-train`) moves its tensors between ranks.
//!
//! What is here today: [`DeviceRequest`], the `--device cpu|cuda|cuda:N|auto` choice
//! every rank makes before it builds its stage.
//!
//! ```
//! use synerfuse_model::DeviceRequest;
//!
//! let request: DeviceRequest = "cpu".parse().unwrap();
//! let device = request.resolve().unwrap();
//! let x = tch::Tensor::ones([2, 3], (tch::Kind::Float, device));
//! assert_eq!(x.sum(tch::Kind::Float).double_value(&[]), 6.0);
//! ```

mod device;

pub use device::{DeviceRequest, ModelError};
pub use tch;
