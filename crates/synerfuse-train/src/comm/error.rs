use tch::{Device, Kind};

/// Why a transfer between ranks could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("MPI could not be initialized: it already was in this process")]
    AlreadyInitialized,
    #[error("rank {rank}: {op} does not support tensors of dtype {kind:?}")]
    UnsupportedDtype {
        rank: usize,
        op: &'static str,
        kind: Kind,
    },
    #[error("rank {rank}: peer rank {peer} is outside this communicator of {size} ranks")]
    InvalidPeer {
        rank: usize,
        peer: usize,
        size: usize,
    },
    #[error("rank {rank}: the message from rank {source_rank} (tag {tag}) has {got} elements but the receive tensor has {expected}")]
    SizeMismatch {
        rank: usize,
        source_rank: usize,
        tag: i32,
        expected: usize,
        got: usize,
    },
    #[error(
        "rank {rank}: the tensor is on {device:?} but this NCCL communicator is on cuda:{ordinal}"
    )]
    WrongDevice {
        rank: usize,
        device: Device,
        ordinal: usize,
    },
    #[error("NCCL is not available: libnccl.so.2 or the CUDA driver library could not be loaded")]
    NcclUnavailable,
    #[error("rank {rank}: {context}: {message}")]
    Cuda {
        rank: usize,
        context: &'static str,
        message: String,
    },
}

impl CommError {
    /// `Ok` when `peer` is a rank of a communicator of `size` ranks.
    pub(crate) fn check_peer(rank: usize, size: usize, peer: usize) -> Result<(), CommError> {
        if peer < size {
            Ok(())
        } else {
            Err(CommError::InvalidPeer { rank, peer, size })
        }
    }
}
