//! Re-planning a running job (`synerfuse train --replan`): its measured paces as a cost
//! model, any plan of its ranks priced on that model, and the planner's best plan placed
//! on the job's own ranks.
//!
//! The fitted model prices a layer by its FLOPs at one TFLOP/s and gives each rank the
//! speed at which its current work (the forward and backward of its stage's layers, its
//! share under tensor parallelism, the embedding and head where it holds them) takes
//! its measured pace: it then predicts every rank's current pace, and other plans by
//! moving work at those rates. The plan running and the candidates are priced by one
//! simulation (every replica's schedule, the reduction, the optimizer), so that their
//! difference is not the difference of two models. A plan of expert parallelism (one
//! group size throughout) is priced with its members' parts of the experts, the
//! all-to-alls of every MoE layer, and each group's members in lockstep.

mod fitted;
mod job;
mod predict;
mod replan;

pub use fitted::{fitted_cost, fitted_cost_of};
pub use job::{ReplanError, RunningJob};
pub use predict::{predict_step_s, predict_timeline};
pub use replan::{best_plan_for, confined_request, running_job_request};

#[cfg(test)]
mod expert_tests;
#[cfg(test)]
mod tests;
