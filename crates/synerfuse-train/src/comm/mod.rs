//! Collectives and point-to-point transfers of tch tensors between ranks.
//!
//! [`MpiCommunicator`] carries CPU tensors directly and stages any other tensor through
//! host memory (copy to CPU, transfer, copy back in place). [`NcclCommunicator`]
//! carries CUDA tensors when every member of a group is a CUDA rank; its library is
//! loaded at run time, so CPU-only machines build and run without CUDA installed.

pub(crate) mod devices;
pub mod emulated_links;
mod error;
mod exchange;
pub(crate) mod groups;
mod hierarchical;
mod host;
pub mod islands;
mod launcher;
mod links;
mod nccl;
mod nccl_handle;
mod nccl_lane;
pub mod one_gpu;
mod pieces;
mod progress;
pub mod watchdog;

pub use emulated_links::{CrossedBytes, LinkEmulation, PlannedHosts, Traffic};
pub use error::CommError;
pub use groups::{GroupCommunicator, PendingReduction, ProcessGroups, SetGroups};
pub use hierarchical::PendingHierarchical;
pub use host::{MpiCommunicator, MpiRuntime, PendingAllReduce, PendingSend};
pub use launcher::{
    launch_under_mpirun, mark_rank_done, mpirun_command, mpirun_options, ranks_done,
    relaunch_under_mpirun, run_forwarding_signals, without_flag, Survival, DONE_DIR_ENV,
};
pub use links::{LinkPath, PipelineLinks};
pub use nccl::{NcclCommunicator, PendingNccl};
pub use synerfuse_plan::launcher::{launcher_local_rank, launcher_rank};
