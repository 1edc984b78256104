#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod calibrate;
pub mod catalogue;
pub mod cluster;
pub mod cost;
mod expert_placement;
pub mod planner;
pub mod profile;
pub mod sim;
