use tch::{Device, Kind};

/// Why a transfer between ranks could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// `MpiRuntime::init` was called twice in one process.
    #[error("MPI could not be initialized: it already was in this process")]
    AlreadyInitialized,
    /// The operation cannot carry (or sum) this dtype.
    #[error("rank {rank}: {op} does not support tensors of dtype {kind:?}")]
    UnsupportedDtype {
        /// The rank that saw the error.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The tensor's dtype.
        kind: Kind,
    },
    /// Piece counts (of a reduce-scatter or all-gather of uneven pieces) that are not one
    /// per rank adding up to the tensor.
    #[error("rank {rank}: {op}: counts {counts:?} for {size} ranks do not cover a tensor of {elements} elements")]
    ScatterCounts {
        /// The rank that saw the error.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The counts given.
        counts: Vec<usize>,
        /// Ranks of the communicator.
        size: usize,
        /// The tensor's elements.
        elements: usize,
    },
    /// A source, destination or root that is not a rank of the communicator.
    #[error("rank {rank}: peer rank {peer} is outside this communicator of {size} ranks")]
    InvalidPeer {
        /// The rank that saw the error.
        rank: usize,
        /// The other rank.
        peer: usize,
        /// Ranks in the communicator.
        size: usize,
    },
    /// A message whose size differs from the receive tensor; it is left unreceived.
    #[error("rank {rank}: the message from rank {source_rank} (tag {tag}) has {got} elements but the receive tensor has {expected}")]
    SizeMismatch {
        /// The rank that saw the error.
        rank: usize,
        /// The sender.
        source_rank: usize,
        /// The message tag.
        tag: i32,
        /// Elements the receive tensor holds.
        expected: usize,
        /// Elements the message holds.
        got: usize,
    },
    /// A tensor on another device than the NCCL communicator's GPU.
    #[error(
        "rank {rank}: the tensor is on {device:?} but this NCCL communicator is on cuda:{ordinal}"
    )]
    WrongDevice {
        /// The rank that saw the error.
        rank: usize,
        /// The tensor's device.
        device: Device,
        /// The GPU index.
        ordinal: usize,
    },
    /// A tensor whose shape the collective cannot split.
    #[error("rank {rank}: {op}: {problem}")]
    Shape {
        /// The rank that saw the error.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What does not split.
        problem: String,
    },
    /// More elements than one MPI call carries (a C `int` count).
    #[error("rank {rank}: {op} of {elements} elements exceeds one MPI call; split the tensor")]
    TooLarge {
        /// The rank that saw the error.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Elements in the tensor.
        elements: usize,
    },
    /// Two ranks of one NCCL group on the same GPU of one host.
    #[error("ranks {first} and {second} both compute on cuda:{ordinal} of one host, in one NCCL group; give each rank its own GPU (CUDA_VISIBLE_DEVICES or the plan's devices)")]
    SharedGpu {
        /// One rank.
        first: usize,
        /// The other rank.
        second: usize,
        /// The GPU index.
        ordinal: usize,
    },
    /// A pipeline transfer asked NCCL for a link that travels over MPI (a bug).
    #[error("rank {rank}: the pipeline link to rank {peer} has no NCCL communicator")]
    NoNcclLink {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
    },
    /// NCCL or the CUDA driver cannot be loaded (CPU-only machine).
    #[error("NCCL is not available: libnccl.so.2 or the CUDA driver library could not be loaded")]
    NcclUnavailable,
    /// NCCL reported an error, from a call or, while the host waited, through
    /// `ncclCommGetAsyncError`; the communicator has been aborted (a failed communicator
    /// is never destroyed: `ncclCommDestroy` could wait forever for its work).
    #[error("rank {rank}: {op} over {group} failed in NCCL: {code} ({reason}){}; the communicator was aborted", detail_suffix(.detail))]
    Nccl {
        /// The rank that saw the error.
        rank: usize,
        /// The group's name.
        group: String,
        /// The NCCL call or the operation waited for.
        op: &'static str,
        /// NCCL's result code (`ncclRemoteError`, ...).
        code: String,
        /// NCCL's words for the code (`ncclGetErrorString`).
        reason: String,
        /// NCCL's last error message (`ncclGetLastError`), often the cause; may be empty.
        detail: String,
    },
    /// An operation on an NCCL communicator that was aborted after an error (or already
    /// torn down).
    #[error("rank {rank}: {op} over {group}: the NCCL communicator is {life} (after an earlier error or teardown)")]
    NcclGone {
        /// The rank that saw the error.
        rank: usize,
        /// The group's name.
        group: String,
        /// The operation refused.
        op: &'static str,
        /// Where the communicator is: aborted, finalized or destroyed.
        life: String,
    },
    /// A CUDA driver or NCCL call failed.
    #[error("rank {rank}: {context}: {message}")]
    Cuda {
        /// The rank that saw the error.
        rank: usize,
        /// The call.
        context: &'static str,
        /// The library's message.
        message: String,
    },
}

impl CommError {
    /// `Ok(rows)` when `tensor`'s leading dimension splits evenly over `size` ranks (what
    /// reduce-scatter needs).
    pub(crate) fn check_scatter_rows(
        rank: usize,
        size: usize,
        tensor: &tch::Tensor,
    ) -> Result<i64, CommError> {
        let rows = tensor.size().first().copied().unwrap_or(0);
        if tensor.dim() == 0 || rows % size as i64 != 0 {
            return Err(CommError::Shape {
                rank,
                op: "reduce_scatter_sum",
                problem: format!(
                    "leading dimension {rows} is not divisible by the group size {size}"
                ),
            });
        }
        Ok(rows)
    }

    /// `Ok` when `peer` is a rank of a communicator of `size` ranks.
    pub(crate) fn check_peer(rank: usize, size: usize, peer: usize) -> Result<(), CommError> {
        if peer < size {
            Ok(())
        } else {
            Err(CommError::InvalidPeer { rank, peer, size })
        }
    }
}

/// "; NCCL says: `detail`", or nothing when NCCL left no message.
fn detail_suffix(detail: &str) -> String {
    match detail.trim() {
        "" => String::new(),
        detail => format!("; NCCL says: {detail}"),
    }
}
