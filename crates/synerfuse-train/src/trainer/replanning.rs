//! What re-planning remembers between steps (the recent step times, the last switch's
//! cost, a switch being measured): a field of the trainer, apart from the switching
//! itself ([`super::switch`]) so the trainer's definition does not depend on it.

use crate::replan::{RecentSteps, ReplanCause, SwitchOutcome};
use synerfuse_plan::Plan;

/// What re-planning keeps from step to step, and across a switch.
#[derive(Debug, Clone)]
pub(super) struct Replanning {
    /// The last window of step times.
    pub(super) recent: RecentSteps,
    /// How long the last switch took (the slowest rank), s.
    pub(super) last_switch_s: Option<f64>,
    /// A switch whose effect is being measured.
    pub(super) settling: Option<Settling>,
    /// Whether the paces after warm-up have been judged (once a run: a switch's own
    /// warm-up is not judged again, only later changes).
    pub(super) warm_up_judged: bool,
    /// A switch measured, to be judged on the paces since it.
    pub(super) look_after: Option<LookAfter>,
    /// A decision put off for want of evidence, retaken on the next window's paces.
    pub(super) deferred: Option<ReplanCause>,
    /// Plans that measured slower than the plan they replaced, since no rank's pace has
    /// changed: not switched to again.
    pub(super) lost_plans: Vec<Plan>,
}

/// A switch whose steps have been measured: the outcome and the plan it replaced.
#[derive(Debug, Clone)]
pub(super) struct LookAfter {
    pub(super) outcome: SwitchOutcome,
    pub(super) previous_plan: Plan,
}

impl LookAfter {
    /// Whether the switch failed: measured slower than the plan before it, or than its
    /// prediction.
    pub(super) fn failed(&self) -> bool {
        self.outcome.lost || self.outcome.missed
    }
}

/// A switch being measured: the steps after its first.
#[derive(Debug, Clone)]
pub(super) struct Settling {
    pub(super) outcome: SwitchOutcome,
    /// The plan switched from.
    pub(super) previous_plan: Plan,
    /// Steps after the switch seen.
    pub(super) seen: usize,
    pub(super) after: RecentSteps,
}

impl Replanning {
    pub(super) fn new(window: usize) -> Self {
        Replanning {
            recent: RecentSteps::new(window),
            last_switch_s: None,
            settling: None,
            warm_up_judged: false,
            look_after: None,
            deferred: None,
            lost_plans: Vec::new(),
        }
    }
}
