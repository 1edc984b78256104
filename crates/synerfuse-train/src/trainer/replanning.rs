//! What re-planning remembers between steps (the recent step times, the last switch's
//! cost, a switch being measured): a field of the trainer, apart from the switching
//! itself ([`super::switch`]) so the trainer's definition does not depend on it.

use crate::replan::{RecentSteps, SwitchOutcome};

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
}

/// A switch being measured: the steps after its first.
#[derive(Debug, Clone)]
pub(super) struct Settling {
    pub(super) outcome: SwitchOutcome,
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
        }
    }
}
