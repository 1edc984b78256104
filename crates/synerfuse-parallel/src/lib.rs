#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod batch;
pub mod calibrate;
pub mod cluster;
pub mod cost;
pub mod cp;
mod flags;
pub mod launcher;
mod plan;
pub mod planner;
mod schedule;
pub mod sim;
mod stage;
pub mod timeline;
mod topology;
pub mod tp;

pub use batch::{
    BatchError, BatchForm, BatchFormError, ReplicaBatch, ReplicaBatches, MOST_MICRO_BATCHES,
};
pub(crate) use flags::GridPlan;
pub use flags::{GridError, PlanFlags};
pub use plan::{
    expert_of, layer_of, parameter_piece, reduction_of, DeviceRequest, ExpertGroupPlan,
    ExpertHolding, GradientReduction, GradientSegment, GridFlags, MeshError, MeshFlags, Plan,
    PlanError, ProcessMesh, ProcessMeshes, RankPlacement, ReducedParameters, ReplicaPipeline,
    UnknownDevice, EMBEDDING,
};
pub use schedule::{
    check_forward_only, check_schedule, forward_only, link_in_order, pipeline_schedule,
    Instruction, Message, Pass, Payload, Piece, ScheduleError, ScheduleKind, ScheduleReport,
    UnknownScheduleKind, Waiting,
};
pub use stage::{LayoutError, StageLayout};
pub use topology::{
    Coordinates, Dim, GroupKind, OrderProblem, Topology, TopologyError, DEFAULT_ORDER,
    TP_PP_DP_ORDER,
};
pub use tp::{TpLayout, TpShard, TpSplitError};
