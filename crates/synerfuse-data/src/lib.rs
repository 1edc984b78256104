#![doc = include_str!("../README.md")]

mod dtype;

pub use dtype::{DType, DTypeError};
