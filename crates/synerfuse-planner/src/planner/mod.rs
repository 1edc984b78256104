//! The planner: for every (pp, dp) factorization, device arrangement and micro-batch
//! size (one for every replica, or one per replica), an exact layer split (dynamic
//! programme on the slowest stage, subject to memory) alternated with an exact split of
//! the batch over the replicas (greedy on monotone pipeline times; with sizes that
//! differ, a bisection over reachable sample totals), scored by the 1F1B formula, the
//! best re-timed by simulating the real schedule.
//!
//! The modules from the bottom up, each using only modules listed before it: the data
//! (`error`, `request`, `tensor`, `samples`, `measured_load`, `outcome`, `shapes`,
//! `convert`); the pricing context (`context`), a stage's memory (`memory_fit`), the
//! gradient reduction (`reduction`, and its buckets overlapping the last backward:
//! `buckets`), the closed forms (`pricing` of a grid, `segments` of per-replica
//! pipelines), a laid-out plan's context (`plan_context`); `split` and `simulate`; the searches (`grid`, `pooled`, then `expert`, `refine`,
//! `stage_experts`), `search` (each under the request's options), `fold`, `choose` (the
//! plan) and `running` (re-planning a running job).

mod buckets;
mod choose;
mod collective;
mod context;
mod convert;
mod error;
mod expert;
mod fold;
mod grid;
mod measured_load;
mod memory_fit;
mod outcome;
mod plan_context;
mod pooled;
mod pricing;
mod reduction;
mod refine;
mod request;
mod running;
mod samples;
mod search;
mod segments;
mod shapes;
mod simulate;
mod split;
mod stage_experts;
mod tensor;

pub use crate::expert_placement::{place_experts, slowest_time, ExpertMember, PlacementError};
pub use choose::plan;
pub use error::{Infeasibility, MemoryShortfall, PlanningError};
pub use fold::FOLD_ABOVE;
pub use measured_load::{measured_expert_load, MeasuredLoadError};
pub use outcome::{
    Arrangement, BehindBy, Candidate, CandidateOrigin, ExpertLayout, PlanOutcome, PoolLayout,
    PooledCandidate, Prediction, StepBreakdown, ThroughputBound,
};
pub use pooled::plan_pooled;
pub use request::{Choice, ChoiceError, PlanRequest, TrainOptions};
pub use running::{
    best_plan_for, confined_request, fitted_cost, fitted_cost_of, predict_step_s, predict_timeline,
    running_job_request, ReplanError, RunningJob,
};
pub use samples::{min_max_samples, ReplicaPace};
pub use simulate::{pooled_timeline, timeline};
pub use split::{min_max_layers, min_max_split};
pub use tensor::{best_context_group, best_group, TpGroup, MOST_SHARE};

#[cfg(test)]
mod buckets_tests;
#[cfg(test)]
mod expert_tests;
#[cfg(test)]
mod property_tests;
#[cfg(test)]
mod tests;
