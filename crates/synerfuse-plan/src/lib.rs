#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod batch;
pub mod cp;
mod flags;
pub mod launcher;
mod measured;
pub mod network;
mod plan;
mod precision;
mod run_record;
mod schedule;
mod shape;
mod stage;
pub mod timeline;
mod topology;
pub mod tp;

pub use batch::{
    BatchError, BatchForm, BatchFormError, ReplicaBatch, ReplicaBatches, MOST_MICRO_BATCHES,
};
pub(crate) use flags::GridPlan;
pub use flags::{GridError, PlanFlags};
pub use measured::{MeasuredCosts, MeasuredNetwork};
pub use network::{Host, LinkSpeed, Network, NetworkError, NodeLink, Reach};
pub use plan::{
    coupled_replicas, expert_of, layer_of, memory_share_weight, parameter_piece, reduction_of,
    DeviceRequest, ExpertGroupPlan, ExpertHolding, GradientReduction, GradientSegment, GridFlags,
    MeshError, MeshFlags, Plan, PlanError, ProcessMesh, ProcessMeshes, RankPlacement,
    ReducedParameters, ReplicaPipeline, UnknownDevice, EMBEDDING,
};
pub use precision::{Precision, UnknownPrecision};
pub use run_record::{RunRecord, RunReduction};
pub use schedule::{
    check_forward_only, check_schedule, forward_only, interpret, link_in_order, pipeline_schedule,
    Instruction, Message, Observer, Pass, Payload, Piece, ScheduleError, ScheduleKind,
    ScheduleReport, UnknownScheduleKind, Waiting,
};
pub use shape::{ExpertShape, ModelShape};
pub use stage::{LayoutError, StageLayout};
pub use topology::{
    Coordinates, Dim, GroupKind, OrderProblem, Topology, TopologyError, DEFAULT_ORDER,
    TP_PP_DP_ORDER,
};
pub use tp::{TpLayout, TpShard, TpSplitError};
