//! Bytes from one rank to every rank: how rank 0's re-planning decision reaches the
//! others, and how every rank's metadata travels when a switch moves the state.

use crate::comm::MpiCommunicator;
use crate::TrainError;
use synerfuse_model::tch::{Device, Kind, Tensor};

/// `bytes` of rank `root`, on every rank of `world`.
pub(super) fn broadcast_bytes(
    world: &MpiCommunicator,
    bytes: &[u8],
    root: usize,
) -> Result<Vec<u8>, TrainError> {
    let mut length = Tensor::from_slice(&[bytes.len() as i64]);
    world.broadcast(&mut length, root)?;
    let length = length.int64_value(&[0]) as usize;
    let mut data = match world.rank() == root {
        true => Tensor::from_slice(bytes),
        false => Tensor::zeros([length as i64], (Kind::Uint8, Device::Cpu)),
    };
    if length > 0 {
        world.broadcast(&mut data, root)?;
    }
    Ok(Vec::<u8>::try_from(&data).unwrap_or_default())
}
