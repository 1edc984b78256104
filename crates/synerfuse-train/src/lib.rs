#![doc = include_str!("../README.md")]

pub mod comm;
pub mod loader;
pub mod optim;
