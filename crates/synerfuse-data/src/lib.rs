//! Megatron-LM compatible data for synerfuse.
//!
//! Users bring corpora already tokenized by Megatron-LM or SynerFuse (`PREFIX.bin` +
//! `PREFIX.idx`) and the sample-index caches built from them; this crate reads and
//! writes those formats bit for bit (see `shared/spec/megatron-data.md`).
//!
//! What is here today: [`DType`], the element types an indexed dataset can hold, with
//! their on-disk codes and Megatron's rule for choosing one from a vocabulary size.
//!
//! ```
//! use synerfuse_data::DType;
//!
//! // GPT-2's 50257 tokens fit uint16; Llama-3's 128256 do not.
//! assert_eq!(DType::optimal_for_vocab(50257), DType::U16);
//! assert_eq!(DType::optimal_for_vocab(128256), DType::I32);
//! assert_eq!(DType::from_code(8), Ok(DType::U16));
//! ```

mod dtype;

pub use dtype::{DType, DTypeError};
