//! Megatron's indexed dataset: `PREFIX.bin` (tokens) + `PREFIX.idx` (where they are).
//!
//! Layout (all little-endian, no padding): the 9-byte magic `MMIDIDX\0\0`, u64 version 1,
//! u8 dtype code, u64 sequence count `S`, u64 document-boundary count `D`, then `i32[S]`
//! lengths, `i64[S]` byte pointers, `i64[D]` document boundaries, and `i8[S]` modes for
//! multimodal datasets only.

mod builder;
mod element;
mod merge;
mod reader;

pub use builder::IndexedDatasetBuilder;
pub use element::Element;
pub use merge::merge_datasets;
pub use reader::{IndexedDataset, LeArray, LeScalar};

use std::path::{Path, PathBuf};

pub(crate) const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
pub(crate) const VERSION: u64 = 1;
pub(crate) const HEADER_LEN: usize = 34;

/// `PREFIX.idx`.
pub fn idx_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".idx")
}

/// `PREFIX.bin`.
pub fn bin_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".bin")
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}
