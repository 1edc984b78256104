#![doc = include_str!("../README.md")]

mod stage;

pub use stage::{LayoutError, StageLayout};
