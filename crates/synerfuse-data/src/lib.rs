#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod dtype;
mod error;
pub mod gpt;
pub mod indexed;
#[cfg(feature = "tokenizers")]
pub mod preprocess;
#[cfg(feature = "tokenizers")]
pub mod tokenizer;

pub use dtype::{DType, DTypeError};
pub use error::DataError;
pub use indexed::{IndexedDataset, IndexedDatasetBuilder};
