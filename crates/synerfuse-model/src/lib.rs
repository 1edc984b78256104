#![doc = include_str!("../README.md")]

mod device;

pub use device::{DeviceRequest, ModelError};
pub use tch;
