//! Ranks whose speed changes while training: the watch that notices a sustained change,
//! the decision to re-plan (`--replan`) as it is logged, and the emulated changes that
//! tests and benchmarks make happen (`--emulate-speed-change`).
//!
//! A rank's pace is its forward and backward seconds per step outside their tensor-,
//! context- and expert-parallel collectives, which waiting for other ranks (in the
//! pipeline or in a group) does not inflate. What the plan assumed of a rank is the median of its steps
//! `window` + 1 to 2 × `window` (the plan's pace as this run realises it: an emulated
//! speed or a profile predicts it only up to the machine's noise; the first `window`
//! steps are warm-up, while allocators and caches fill); a change is sustained when every
//! one of the last `window` steps is off that pace by more than the threshold in the
//! same direction. The rank is then assumed at its new pace, so a change is reported
//! once. The first assumed paces are a verdict too ([`ReplanCause::WarmUp`]): a plan
//! wrong from the start (an even plan on unequal devices, a rank slow from its first
//! step or slowed within the first window) shows there, not as a later change. Every rank runs the watch on the same gathered times, so every rank reaches the
//! same verdicts, which a collective switch of plans will need.

use std::collections::VecDeque;
use std::str::FromStr;

/// When the watch calls a change sustained.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WatchConfig {
    /// Relative deviation from the assumed pace (`--replan-threshold`, 0.2 = 20 %).
    pub threshold: f64,
    /// Steps every one of which must deviate; also the steps that set the assumed pace
    /// (`--replan-window`).
    pub window: usize,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            threshold: 0.2,
            window: 10,
        }
    }
}

/// A rank's sustained change of pace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedShift {
    /// The world rank.
    pub rank: usize,
    /// Forward and backward seconds per step it was assumed at.
    pub assumed_s: f64,
    /// Its median over the last window steps, now assumed.
    pub measured_s: f64,
}

impl SpeedShift {
    /// Its speed relative to what was assumed (0.25: four times slower).
    pub fn relative_speed(&self) -> f64 {
        self.assumed_s / self.measured_s
    }
}

/// One rank's assumed pace and recent steps.
#[derive(Debug, Clone, Default)]
struct RankPace {
    /// Warm-up steps seen.
    warmed: usize,
    assumed_s: Option<f64>,
    /// The spread of the window the assumed pace is the median of ([`spread`]).
    spread: f64,
    recent: VecDeque<f64>,
}

/// Watches every rank's pace; see the module documentation.
#[derive(Debug, Clone)]
pub struct SpeedWatch {
    config: WatchConfig,
    /// Steps not measured at first.
    warm_up: usize,
    ranks: Vec<RankPace>,
}

impl SpeedWatch {
    /// A watch over `ranks` ranks (a window of 0 counts as 1).
    pub fn new(ranks: usize, config: WatchConfig) -> Self {
        let window = config.window.max(1);
        Self::with_warm_up(ranks, config, window)
    }

    /// A watch over a plan just switched to: only the first step, which allocates what
    /// the new stages need, is warm-up (the process, its allocator and caches are warm),
    /// so the switch's first paces are measured as soon as its outcome is.
    pub fn after_switch(ranks: usize, config: WatchConfig) -> Self {
        Self::with_warm_up(ranks, config, 1)
    }

    fn with_warm_up(ranks: usize, config: WatchConfig, warm_up: usize) -> Self {
        let config = WatchConfig {
            window: config.window.max(1),
            ..config
        };
        SpeedWatch {
            config,
            warm_up,
            ranks: vec![RankPace::default(); ranks],
        }
    }

    /// Forgets the assumed paces: the next window of steps sets them again (a decision
    /// deferred for want of evidence is taken again on them).
    pub fn remeasure(&mut self) {
        for rank in &mut self.ranks {
            rank.assumed_s = None;
            rank.recent.clear();
        }
    }

    /// Records one step's pace per rank (seconds, in rank order); returns the ranks
    /// whose change became sustained with this step.
    pub fn observe(&mut self, pace_s: &[f64]) -> Vec<SpeedShift> {
        let WatchConfig { threshold, window } = self.config;
        let mut shifts = Vec::new();
        for (rank, (watch, &seconds)) in self.ranks.iter_mut().zip(pace_s).enumerate() {
            if watch.warmed < self.warm_up {
                watch.warmed += 1;
                continue;
            }
            watch.recent.push_back(seconds);
            if watch.recent.len() > window {
                watch.recent.pop_front();
            }
            if watch.recent.len() < window {
                continue;
            }
            let Some(assumed_s) = watch.assumed_s else {
                watch.assumed_s = Some(median(&watch.recent));
                watch.spread = spread(&watch.recent);
                watch.recent.clear();
                continue;
            };
            let slower = watch
                .recent
                .iter()
                .all(|&s| s > assumed_s * (1.0 + threshold));
            let faster = watch
                .recent
                .iter()
                .all(|&s| s < assumed_s * (1.0 - threshold));
            if slower || faster {
                let measured_s = median(&watch.recent);
                shifts.push(SpeedShift {
                    rank,
                    assumed_s,
                    measured_s,
                });
                watch.assumed_s = Some(measured_s);
                watch.spread = spread(&watch.recent);
                watch.recent.clear();
            }
        }
        shifts
    }
}

impl SpeedWatch {
    /// Every rank's assumed pace, once every rank has one (seconds, in rank order).
    pub fn paces_s(&self) -> Option<Vec<f64>> {
        self.ranks.iter().map(|r| r.assumed_s).collect()
    }

    /// Each rank's spread (quartile deviation over median) of the window its assumed pace
    /// comes from, once
    /// every rank has one.
    pub fn spreads(&self) -> Option<Vec<f64>> {
        (self.ranks.iter())
            .map(|r| r.assumed_s.map(|_| r.spread))
            .collect()
    }
}

/// The median (upper for an even count) of a non-empty window.
fn median(values: &VecDeque<f64>) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().collect();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// How far a window's values scatter, relative to their median: the quartile deviation
/// (half the range from the ⌊n/4⌋-th to the ⌊3n/4⌋-th smallest) over the median. A busy
/// moment that slows a few steps of the window widens it at once, while it moves the
/// median little; and it bounds what the median itself may be off by (about 0.6 of it
/// for a window of 10 normal steps), so a gain wider than it is not the window's noise.
fn spread(values: &VecDeque<f64>) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let (low, high) = (sorted[n / 4], sorted[(3 * n / 4).min(n - 1)]);
    (high - low) / 2.0 / sorted[n / 2].max(f64::MIN_POSITIVE)
}

/// `--replan`: whether a run switches to a better plan when a rank's speed changes for
/// good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplanMode {
    /// Keep the plan; the log says whether a switch would have paid.
    #[default]
    Off,
    /// Switch at the next step boundary when the predicted gain over the remaining
    /// iterations exceeds the cost of switching.
    Auto,
}

/// A `--replan` value other than `auto` or `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected auto or off")]
pub struct ReplanModeError(pub String);

impl FromStr for ReplanMode {
    type Err = ReplanModeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(ReplanMode::Auto),
            "off" => Ok(ReplanMode::Off),
            _ => Err(ReplanModeError(text.to_owned())),
        }
    }
}

/// The least predicted improvement of the step a switch is made for: below it, the
/// fitted model's error could turn the switch into a loss.
pub const LEAST_IMPROVEMENT: f64 = 0.05;

/// How far the fitted model's prediction of a plan may be off before a switch is said to
/// have missed it: `cargo xtask bench hetero` has measured its layouts from 12 % below to
/// 26 % above their predictions, so a quarter is its usual error, not a mispriced plan.
pub const MODEL_ERROR: f64 = 0.25;

/// What a re-planning decision answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplanCause {
    /// The first paces measured after warm-up: whether the plan fits the ranks at all.
    WarmUp,
    /// A rank's sustained change of pace.
    #[default]
    SpeedChange,
    /// The steps measured since the last switch: whether to keep it.
    AfterSwitch,
}

impl std::fmt::Display for ReplanCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReplanCause::WarmUp => "the ranks' paces measured after warm-up",
            ReplanCause::SpeedChange => "a sustained change of a rank's pace",
            ReplanCause::AfterSwitch => "the steps measured since the last switch",
        })
    }
}

/// One re-planning decision, as the log, the JSON log and TensorBoard show it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReplanDecision {
    /// The iteration after which it was made.
    pub iteration: u64,
    /// What it answers.
    #[serde(default)]
    pub cause: ReplanCause,
    /// Each rank's forward and backward seconds per step, as measured.
    pub paces_s: Vec<f64>,
    /// Each rank's spread of the steps its pace is the median of (quartile deviation
    /// over median): the evidence the decision stands on.
    #[serde(default)]
    pub pace_spreads: Vec<f64>,
    /// Each rank's speed as the paces show it (its work per second), relative to the
    /// fastest rank's.
    pub speeds: Vec<f64>,
    /// The step, measured (median of the last window of steps).
    pub measured_step_s: f64,
    /// The plan running, predicted at the measured paces (measured, when the switch to
    /// it missed its prediction: `current_measured`).
    pub current_step_s: f64,
    /// Whether `current_step_s` is the measured step rather than a prediction.
    #[serde(default)]
    pub current_measured: bool,
    /// The best plan found, predicted at the measured paces.
    pub proposed_step_s: f64,
    /// Layers per stage of each replica of the best plan.
    pub proposed_layers: Vec<Vec<usize>>,
    /// Micro-batch sizes of each replica of the best plan.
    pub proposed_batches: Vec<synerfuse_plan::ReplicaBatch>,
    /// The best plan, on the job's ranks (the `[[replica]]` form of a plan file).
    pub proposed_plan: synerfuse_plan::Plan,
    /// Iterations left to train.
    pub remaining_iterations: u64,
    /// (current − proposed) × remaining iterations, s.
    pub gain_s: f64,
    /// What switching costs, s.
    pub switch_cost_s: f64,
    /// Where the cost comes from.
    pub cost_basis: String,
    /// Whether the run switched.
    pub switched: bool,
    /// What the run does, and why.
    #[serde(default)]
    pub verdict: ReplanVerdict,
}

/// What a re-planning decision does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplanVerdict {
    /// Switches to the best plan at the measured paces.
    Switch,
    /// Switches back to the plan the last switch left: at the paces measured since, the
    /// model prices it best (or alike with the best, and it has been measured).
    SwitchBack,
    /// A switch would pay, but a rank's pace spread is wider than the gain expected:
    /// the next window of steps measures the paces again and the decision is retaken.
    Defer,
    /// A switch would pay; `--replan off` keeps the plan.
    WouldHavePaid,
    /// The best plan is one that lost or missed its prediction after a switch to it
    /// earlier (and no rank's pace has changed since): kept off it.
    LostBefore,
    /// A switch would not pay.
    #[default]
    Keep,
}

impl std::fmt::Display for ReplanVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReplanVerdict::Switch => "switching now",
            ReplanVerdict::SwitchBack => "switching back to the plan the last switch left",
            ReplanVerdict::Defer => "a switch would pay, but a rank's pace spread is wider than the gain expected: measuring another window before deciding",
            ReplanVerdict::WouldHavePaid => "a switch would have paid (--replan off keeps the plan)",
            ReplanVerdict::LostBefore => "the best plan is one that measured slower than the plan before it or than its prediction after a switch to it, at paces that have not changed since: the plan is kept",
            ReplanVerdict::Keep => "a switch would not pay; the plan is kept",
        })
    }
}

impl ReplanDecision {
    /// Whether switching pays: the gain exceeds the cost and the step improves by at
    /// least [`LEAST_IMPROVEMENT`].
    pub fn pays(&self) -> bool {
        self.gain_s > self.switch_cost_s
            && self.proposed_step_s < self.current_step_s * (1.0 - LEAST_IMPROVEMENT)
    }

    /// The relative gain of the step it expects: 1 − proposed / current.
    pub fn expected_gain(&self) -> f64 {
        1.0 - self.proposed_step_s / self.current_step_s.max(f64::MIN_POSITIVE)
    }

    /// Whether the paces are steady enough to act on: no rank's spread is wider than
    /// the gain expected.
    pub fn evidence_suffices(&self) -> bool {
        let widest = self.pace_spreads.iter().copied().fold(0.0, f64::max);
        widest <= self.expected_gain()
    }
}

/// The step measured once a switch has settled, against the step before it and the
/// prediction.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SwitchOutcome {
    /// The iteration after which the run switched.
    pub switched_after: u64,
    /// The iteration this was measured at.
    pub iteration: u64,
    /// The measured step before the switch, s.
    pub before_step_s: f64,
    /// The predicted step of the new plan, s.
    pub predicted_step_s: f64,
    /// The measured step since (median of the window after it), s.
    pub after_step_s: f64,
    /// The spreads (quartile deviation over median) of the windows before and after.
    pub before_spread: f64,
    /// See `before_spread`.
    pub after_spread: f64,
    /// Whether the switch lost: the step after it slower than the step before by more
    /// than [`SwitchOutcome::noise`].
    pub lost: bool,
    /// Whether it missed its prediction: the step after it slower than predicted by
    /// more than [`SwitchOutcome::noise`] and [`MODEL_ERROR`] (the fitted model mispriced
    /// the new plan).
    pub missed: bool,
    /// How long the switch took (the slowest rank), s.
    pub switch_s: f64,
}

impl SwitchOutcome {
    /// The relative difference below which the steps before and after a switch are
    /// called alike: the wider of their windows' spreads, and at least the least
    /// improvement a switch is made for.
    pub fn noise(&self) -> f64 {
        self.before_spread
            .max(self.after_spread)
            .max(LEAST_IMPROVEMENT)
    }

    /// Whether the step after measures slower than the step before, beyond the noise.
    pub fn measures_slower(&self) -> bool {
        self.after_step_s > self.before_step_s * (1.0 + self.noise())
    }

    /// Whether the step after measures slower than predicted, beyond the noise and
    /// beyond [`MODEL_ERROR`].
    pub fn misses_prediction(&self) -> bool {
        let bar = self.noise().max(MODEL_ERROR);
        self.after_step_s > self.predicted_step_s * (1.0 + bar)
    }
}

/// The last `window` step times, for their median.
#[derive(Debug, Clone)]
pub struct RecentSteps {
    window: usize,
    times: VecDeque<f64>,
}

impl RecentSteps {
    /// Keeps the last `window` steps (at least one).
    pub fn new(window: usize) -> Self {
        RecentSteps {
            window: window.max(1),
            times: VecDeque::new(),
        }
    }

    /// Records a step's seconds.
    pub fn push(&mut self, seconds: f64) {
        self.times.push_back(seconds);
        if self.times.len() > self.window {
            self.times.pop_front();
        }
    }

    /// Whether a whole window has been seen.
    pub fn full(&self) -> bool {
        self.times.len() == self.window
    }

    /// The median of the steps kept (`None` before the first).
    pub fn median(&self) -> Option<f64> {
        (!self.times.is_empty()).then(|| median(&self.times))
    }

    /// The spread of the steps kept (quartile deviation over median; 0 before the first).
    pub fn spread(&self) -> f64 {
        match self.times.is_empty() {
            true => 0.0,
            false => spread(&self.times),
        }
    }
}

/// `--emulate-speed-change ITER:RANK:SPEED`: from iteration `iteration` (1-based, as the
/// log counts) on, `rank` is emulated at `speed`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedChange {
    /// The first iteration at the new speed.
    pub iteration: u64,
    /// The world rank.
    pub rank: usize,
    /// Its new emulated speed, in (0, 1].
    pub speed: f64,
}

/// Why an `ITER:RANK:SPEED` does not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpeedChangeError {
    /// Not three fields.
    #[error("`{0}`: expected ITER:RANK:SPEED, e.g. 20:1:0.25")]
    Form(String),
    /// A field that is not a number of its kind.
    #[error("`{text}`: {field} `{value}` is not {expected}")]
    Field {
        /// The whole value.
        text: String,
        /// Which field.
        field: &'static str,
        /// The field's text.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
    /// A speed outside (0, 1].
    #[error("`{text}`: speed {speed} is outside (0, 1]")]
    Speed {
        /// The whole value.
        text: String,
        /// The speed.
        speed: f64,
    },
}

impl FromStr for SpeedChange {
    type Err = SpeedChangeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let [iteration, rank, speed] = text.split(':').collect::<Vec<_>>()[..] else {
            return Err(SpeedChangeError::Form(text.to_owned()));
        };
        let field = |field, value: &str, expected| SpeedChangeError::Field {
            text: text.to_owned(),
            field,
            value: value.to_owned(),
            expected,
        };
        let iteration: u64 = (iteration.parse().ok())
            .filter(|&i| i > 0)
            .ok_or_else(|| field("ITER", iteration, "an iteration (1 or more)"))?;
        let rank: usize = (rank.parse()).map_err(|_| field("RANK", rank, "a rank (0 or more)"))?;
        let speed: f64 = (speed.parse()).map_err(|_| field("SPEED", speed, "a number"))?;
        if !(speed > 0.0 && speed <= 1.0) {
            return Err(SpeedChangeError::Speed {
                text: text.to_owned(),
                speed,
            });
        }
        Ok(SpeedChange {
            iteration,
            rank,
            speed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: usize = 4;

    fn watch() -> SpeedWatch {
        SpeedWatch::new(
            2,
            WatchConfig {
                threshold: 0.2,
                window: WINDOW,
            },
        )
    }

    /// Rank 1's pace per step: 1 s with a little noise, then `slow` s over `steps`.
    fn shifts(slow: f64, from: usize, steps: usize, total: usize) -> Vec<(usize, SpeedShift)> {
        let mut watch = watch();
        let mut out = Vec::new();
        for step in 0..total {
            let noise = 1.0 + 0.05 * ((step * 7 % 5) as f64 - 2.0) / 2.0;
            let rank1 = if (from..from + steps).contains(&step) {
                slow * noise
            } else {
                noise
            };
            for shift in watch.observe(&[noise, rank1]) {
                out.push((step, shift));
            }
        }
        out
    }

    #[test]
    fn a_sustained_slowdown_is_reported_once_after_a_window() {
        let got = shifts(4.0, 10, 30, 40);
        assert_eq!(got.len(), 1, "{got:?}");
        let (step, shift) = got[0];
        assert_eq!((step, shift.rank), (10 + WINDOW - 1, 1));
        // A slow warm-up is not what the plan assumed.
        assert!(shifts(4.0, 0, WINDOW, 40).is_empty());
        assert!((shift.relative_speed() - 0.25).abs() < 0.03, "{shift:?}");
    }

    #[test]
    fn a_slowdown_shorter_than_the_window_is_not() {
        assert!(shifts(4.0, 10, WINDOW - 1, 40).is_empty());
        // Noise within the threshold never is.
        assert!(shifts(1.1, 10, 30, 40).is_empty());
    }

    #[test]
    fn a_recovery_is_a_change_too() {
        let got = shifts(4.0, 10, 12, 40);
        let speeds: Vec<f64> = got.iter().map(|(_, s)| s.relative_speed()).collect();
        assert_eq!(speeds.len(), 2, "{got:?}");
        assert!(speeds[0] < 0.3 && speeds[1] > 3.0, "{speeds:?}");
    }

    #[test]
    fn the_spread_is_the_quartile_deviation_over_the_median() {
        let steady: VecDeque<f64> = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.0, 1.03].into();
        assert!(spread(&steady) < 0.05, "{}", spread(&steady));
        // A busy moment that slows three steps of ten widens it, and moves the median
        // by at most one place.
        let mut busy: VecDeque<f64> = vec![1.0; 7].into();
        busy.extend([3.0, 3.0, 3.0]);
        assert!((spread(&busy) - 1.0).abs() < 1e-12, "{}", spread(&busy));
        assert_eq!(median(&busy), 1.0);
        assert_eq!(spread(&[2.0].into()), 0.0);
    }

    #[test]
    fn after_a_switch_only_one_step_is_warm_up_and_paces_can_be_measured_again() {
        let config = WatchConfig {
            threshold: 0.2,
            window: WINDOW,
        };
        let mut watch = SpeedWatch::after_switch(2, config);
        for _ in 0..WINDOW {
            watch.observe(&[1.0, 2.0]);
            assert_eq!(watch.paces_s(), None);
        }
        watch.observe(&[1.0, 2.0]);
        assert_eq!(watch.paces_s(), Some(vec![1.0, 2.0]));
        assert_eq!(watch.spreads(), Some(vec![0.0, 0.0]));
        watch.remeasure();
        assert_eq!(watch.paces_s(), None);
        for step in 0..WINDOW {
            watch.observe(&[1.0, 1.0 + step as f64]);
        }
        let spreads = watch.spreads().unwrap();
        assert_eq!(watch.paces_s(), Some(vec![1.0, 3.0]));
        // Paces 1 to 4: quartiles 2 and 4 about a median of 3.
        assert!(
            spreads[0] == 0.0 && (spreads[1] - 1.0 / 3.0).abs() < 1e-12,
            "{spreads:?}"
        );
    }

    fn outcome(before_s: f64, after_s: f64, spreads: (f64, f64)) -> SwitchOutcome {
        SwitchOutcome {
            switched_after: 20,
            iteration: 31,
            before_step_s: before_s,
            predicted_step_s: 0.5,
            after_step_s: after_s,
            before_spread: spreads.0,
            after_spread: spreads.1,
            lost: false,
            missed: false,
            switch_s: 0.1,
        }
    }

    #[test]
    fn a_switch_loses_only_beyond_the_noise() {
        assert!(outcome(1.0, 1.3, (0.1, 0.05)).measures_slower());
        // Within the wider spread, or under the least improvement, it is alike.
        assert!(!outcome(1.0, 1.3, (0.1, 0.35)).measures_slower());
        assert!(!outcome(1.0, 1.04, (0.0, 0.0)).measures_slower());
        assert!(!outcome(1.0, 0.5, (0.0, 0.0)).measures_slower());
        // Predicted 0.5 s: 0.9 s misses it; 0.6 s is within the model's usual error.
        assert!(outcome(1.0, 0.9, (0.1, 0.1)).misses_prediction());
        assert!(!outcome(1.0, 0.6, (0.0, 0.0)).misses_prediction());
        assert!(!outcome(1.0, 0.9, (0.1, 0.9)).misses_prediction());
    }

    #[test]
    fn a_decision_acts_only_on_paces_steadier_than_its_gain() {
        let decision = |spreads: Vec<f64>| ReplanDecision {
            iteration: 20,
            cause: ReplanCause::WarmUp,
            paces_s: vec![1.0, 1.0],
            pace_spreads: spreads,
            speeds: vec![1.0, 1.0],
            measured_step_s: 1.0,
            current_step_s: 1.0,
            current_measured: false,
            proposed_step_s: 0.8,
            proposed_layers: vec![],
            proposed_batches: vec![],
            proposed_plan: synerfuse_plan::Plan::from_toml(
                "[[replica]]\nlayers = [2]\nmicro_batch_size = 1\nnum_micro_batches = 2\n",
                None,
            )
            .unwrap(),
            remaining_iterations: 100,
            gain_s: 20.0,
            switch_cost_s: 1.0,
            cost_basis: String::new(),
            switched: false,
            verdict: ReplanVerdict::Keep,
        };
        assert!((decision(vec![]).expected_gain() - 0.2).abs() < 1e-12);
        assert!(decision(vec![0.05, 0.19]).evidence_suffices());
        assert!(!decision(vec![0.05, 0.25]).evidence_suffices());
    }

    #[test]
    fn speed_changes_parse_or_say_why() {
        let change: SpeedChange = "20:1:0.25".parse().unwrap();
        assert_eq!(
            change,
            SpeedChange {
                iteration: 20,
                rank: 1,
                speed: 0.25
            }
        );
        for (text, says) in [
            ("20:1", "expected ITER:RANK:SPEED"),
            ("0:1:0.5", "ITER `0`"),
            ("20:x:0.5", "RANK `x`"),
            ("20:1:fast", "SPEED `fast`"),
            ("20:1:1.5", "outside (0, 1]"),
        ] {
            let error = text.parse::<SpeedChange>().unwrap_err().to_string();
            assert!(error.contains(says), "{text}: {error}");
        }
    }
}
