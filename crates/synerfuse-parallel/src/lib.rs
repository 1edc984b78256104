#![doc = include_str!("../README.md")]

mod batch;
mod stage;

pub use batch::{BatchError, ReplicaBatch, ReplicaBatches};
pub use stage::{LayoutError, StageLayout};
