//! Calibrating a profile from measured runs (`synerfuse profile --calibrate LOG.jsonl`).
//!
//! A `--log-json` file starts with a [`RunRecord`] (what ran: the model, the plan, the
//! options), and its step records carry every rank's spans on the logged iterations.
//! Each run is priced again by the planner's own simulation ([`predict_timeline`]) and
//! compared with what it measured, term by term: each device kind's forward and backward
//! (the profile's costs of that kind scaled by measured ÷ simulated, per micro-batch size
//! seen and by the kind's whole ratio for sizes not seen), a send's fixed cost (the
//! profile's p2p latency), the reduction (its all-reduce bandwidth) and the optimizer
//! step (its seconds per parameter). What is still left, the measured step less the
//! simulated one with those terms fitted (the data, the loss, the bookkeeping between
//! passes), is the step overhead, the median over the runs. The fitted terms are written
//! in the profile ([`Calibration`]), so every plan priced with it carries them.

use crate::cluster::{ClusterSpec, DeviceGroup, Network};
use crate::cost::{CostModel, Recompute};
use crate::planner::{predict_timeline, ReplanError};
use crate::profile::{Calibration, ComputeScale, Profile};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use synerfuse_plan::timeline::{RankTimeline, Span, SpanKind};
use synerfuse_plan::{ModelShape, RunRecord};

/// Steps of a run (after its start or a switch) left out as its warm-up.
pub const WARM_UP_STEPS: usize = 5;

/// Where `rank` of a run of `plan` sat for pricing: the node its placement names (an
/// emulated one), else the host it ran on (`hosts`, by rank).
pub(crate) fn run_node(plan: &synerfuse_plan::Plan, hosts: &[String], rank: usize) -> String {
    let named = plan.placement(rank).and_then(|p| p.node.clone());
    (named.or_else(|| hosts.get(rank).cloned())).unwrap_or_else(|| "host".into())
}

/// The links a run of `plan` is priced with: the network it emulated, else one of
/// `intra_gbs` within a host (and `latency_us`) and 12.5 GB/s between hosts.
pub(crate) fn run_network(plan: &synerfuse_plan::Plan, intra_gbs: f64, latency_us: f64) -> Network {
    plan.network().cloned().unwrap_or(Network {
        intra_node_gbs: intra_gbs,
        inter_node_gbs: 12.5,
        latency_us,
        inter_site_gbs: None,
        inter_site_latency_us: None,
        link: Vec::new(),
    })
}

/// The cost model that prices this run with `profile`: one device per rank (its
/// placement's kind, `cpu` where it names none, at its emulated speed), the run's
/// options (its gradient reduction as its record says).
pub fn run_cost_model(run: &RunRecord, profile: &Profile) -> CostModel {
    let ranks = run.plan.world_size();
    let group = (0..ranks)
        .map(|rank| {
            let placement = run.plan.placement(rank);
            DeviceGroup {
                kind: (placement.and_then(|p| p.kind.clone())).unwrap_or_else(|| "cpu".into()),
                count: 1,
                node: Some(run_node(&run.plan, &run.hosts, rank)),
                tflops_bf16: None,
                tflops_fp16: None,
                bf16: None,
                memory_gb: placement.and_then(|p| p.memory_gb),
                mem_bw_gbs: None,
                efficiency: None,
                site: placement.and_then(|p| p.site.clone()),
                speed: placement.and_then(|p| p.speed),
            }
        })
        .collect();
    let cluster = ClusterSpec {
        memory_headroom: 0.1,
        group,
        network: run_network(&run.plan, 100.0, 10.0),
    };
    let mut cost = CostModel::new(run.model.clone(), cluster, Some(profile.clone()));
    cost.compute_bytes = run.compute_bytes;
    cost.distributed_optimizer = run.distributed_optimizer;
    cost.overlap_grad_reduce = run.reduction.overlap_grad_reduce;
    cost.ddp_bucket_size = run.reduction.ddp_bucket_size;
    cost.overlap_param_gather = run.reduction.overlap_param_gather;
    cost.hierarchical_reduction = run.reduction.hierarchical;
    cost.recompute = match run.recompute {
        true => Recompute::Always,
        false => Recompute::Never,
    };
    cost
}

/// One rank's share of a step record.
#[derive(Debug, Clone, PartialEq, Deserialize)]
struct RankStep {
    #[serde(default)]
    spans: Option<Vec<Span>>,
}

/// One step record of a `--log-json` file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
struct StepRecord {
    elapsed_ms: f64,
    #[serde(default)]
    ranks: Vec<RankStep>,
}

/// A run as its log gives it: what ran, and its steps after the warm-up.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredRun {
    /// Where it was read from (its file, and the segment after a switch).
    pub name: String,
    /// What ran.
    pub run: RunRecord,
    /// Each step's seconds.
    pub steps_s: Vec<f64>,
    /// Per logged step, every rank's spans.
    spans: Vec<Vec<Vec<Span>>>,
}

/// Why a log cannot calibrate a profile.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// A line that is not JSON, or a record not of its kind's form.
    #[error("{name}, line {line}: {source}")]
    Record {
        /// The log.
        name: String,
        /// Its line, from 1.
        line: usize,
        /// What the parser said.
        source: serde_json::Error,
    },
    /// Steps before any `run` record (a log of a run older than the record).
    #[error("{name}: step records before a `run` record: the log was written by a synerfuse without run records; rerun with --log-json")]
    NoRunRecord {
        /// The log.
        name: String,
    },
    /// No run with steps after its warm-up and logged spans.
    #[error("{name}: no run with steps after its warm-up and logged spans (a --log-interval that logs a step after the warm-up)")]
    TooShort {
        /// The log(s).
        name: String,
    },
    /// A run the simulation cannot price.
    #[error("{name}: {source}")]
    Price {
        /// The log.
        name: String,
        /// Why.
        source: ReplanError,
    },
    /// A run of another model than the profile's.
    #[error("{name}: the run's model {run:?} is not the profile's {profile:?}")]
    OtherModel {
        /// The log.
        name: String,
        /// The run's model.
        run: Box<ModelShape>,
        /// The profile's.
        profile: Box<ModelShape>,
    },
    /// A rank's device kind the profile has no costs for.
    #[error("{name}: rank {rank} is a {kind}, which the profile has no costs for")]
    UnknownKind {
        /// The log.
        name: String,
        /// The rank.
        rank: usize,
        /// Its kind.
        kind: String,
    },
}

impl MeasuredRun {
    /// The runs of one `--log-json` file's `text` (`name` for errors): each `run` record
    /// starts one (a switch of plans writes another), and its iteration records after
    /// the first `warm_up` ([`WARM_UP_STEPS`] by default) are its steps. Evaluations and
    /// other records are skipped; runs without steps left are dropped.
    pub fn parse(
        name: &str,
        text: &str,
        warm_up: usize,
    ) -> Result<Vec<MeasuredRun>, CalibrateError> {
        let mut runs: Vec<(MeasuredRun, usize)> = Vec::new();
        for (k, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let bad = |source| CalibrateError::Record {
                name: name.to_owned(),
                line: k + 1,
                source,
            };
            let value: serde_json::Value = serde_json::from_str(line).map_err(bad)?;
            if let Some(run) = value.get("run") {
                let run = RunRecord::deserialize(run).map_err(bad)?;
                let name = match runs.len() {
                    0 => name.to_owned(),
                    n => format!("{name} (plan {})", n + 1),
                };
                let measured = MeasuredRun {
                    name,
                    run,
                    steps_s: Vec::new(),
                    spans: Vec::new(),
                };
                runs.push((measured, 0));
                continue;
            }
            let is_step = value.get("elapsed_ms").is_some() && value.get("evaluation").is_none();
            if !is_step {
                continue;
            }
            let Some((current, seen)) = runs.last_mut() else {
                return Err(CalibrateError::NoRunRecord {
                    name: name.to_owned(),
                });
            };
            *seen += 1;
            if *seen <= warm_up {
                continue;
            }
            let step = StepRecord::deserialize(&value).map_err(bad)?;
            current.steps_s.push(step.elapsed_ms / 1e3);
            let spans: Option<Vec<Vec<Span>>> = step.ranks.into_iter().map(|r| r.spans).collect();
            if let Some(spans) = spans.filter(|s| s.len() == current.run.plan.world_size()) {
                current.spans.push(spans);
            }
        }
        Ok(runs
            .into_iter()
            .map(|(run, _)| run)
            .filter(|r| !r.steps_s.is_empty())
            .collect())
    }

    /// The median step, s.
    pub fn step_s(&self) -> f64 {
        median(&self.steps_s)
    }

    /// [`run_cost_model`] of its record.
    pub fn cost_model(&self, profile: &Profile) -> CostModel {
        run_cost_model(&self.run, profile)
    }

    /// The run's simulated step and every rank's spans, priced with `profile`.
    fn simulate(&self, profile: &Profile) -> Result<(f64, Vec<RankTimeline>), CalibrateError> {
        if profile.model != self.run.model {
            return Err(CalibrateError::OtherModel {
                name: self.name.clone(),
                run: Box::new(self.run.model.clone()),
                profile: Box::new(profile.model.clone()),
            });
        }
        let cost = self.cost_model(profile);
        for (rank, device) in cost.cluster.devices().iter().enumerate() {
            if !profile.devices.contains_key(&device.kind) {
                return Err(CalibrateError::UnknownKind {
                    name: self.name.clone(),
                    rank,
                    kind: device.kind.clone(),
                });
            }
        }
        predict_timeline(&cost, &self.run.plan).map_err(|source| CalibrateError::Price {
            name: self.name.clone(),
            source,
        })
    }

    /// Seconds of `kind` spans of `rank`, averaged over the logged steps.
    fn measured(&self, rank: usize, kinds: &[SpanKind]) -> f64 {
        let total: f64 = (self.spans.iter())
            .map(|step| seconds(&step[rank], kinds))
            .sum();
        total / self.spans.len().max(1) as f64
    }
}

/// Seconds of the spans of `kinds` among `spans`.
fn seconds(spans: &[Span], kinds: &[SpanKind]) -> f64 {
    (spans.iter())
        .filter(|s| kinds.contains(&s.kind))
        .map(|s| s.end_s - s.start_s)
        .sum()
}

/// Durations of the spans of `kind` among `spans`.
fn durations(spans: &[Span], kind: SpanKind) -> impl Iterator<Item = f64> + '_ {
    (spans.iter())
        .filter(move |s| s.kind == kind)
        .map(|s| s.end_s - s.start_s)
}

/// The median of `values` (the upper one of an even count; NaN when empty).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One run priced before and after a calibration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunCheck {
    /// The run.
    pub name: String,
    /// Its measured median step, s.
    pub measured_s: f64,
    /// Predicted with the profile given, s.
    pub before_s: f64,
    /// Predicted with the calibrated profile, s.
    pub after_s: f64,
}

/// Sums of measured and simulated seconds of one term.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    measured: f64,
    simulated: f64,
}

impl Sums {
    fn add(&mut self, measured: f64, simulated: f64) {
        self.measured += measured;
        self.simulated += simulated;
    }

    /// Measured ÷ simulated, where both are positive.
    fn ratio(&self) -> Option<f64> {
        (self.measured > 0.0 && self.simulated > 0.0).then(|| self.measured / self.simulated)
    }
}

/// What the runs measured against their simulation, term by term.
#[derive(Default)]
struct Terms {
    /// Per kind and micro-batch size: forward, backward.
    passes: BTreeMap<String, BTreeMap<usize, (Sums, Sums)>>,
    /// Per send: measured, simulated.
    sends: (Vec<f64>, Vec<f64>),
    reduce: Sums,
    optimizer: BTreeMap<String, Sums>,
    steps: usize,
}

impl Terms {
    /// Adds `run`'s measured spans against its simulated `rows`.
    fn add(&mut self, run: &MeasuredRun, cost: &CostModel, rows: &[RankTimeline]) {
        let devices = cost.cluster.devices();
        self.steps += run.spans.len();
        self.add_reduce(run, rows);
        for (rank, row) in rows.iter().enumerate() {
            let kind = devices[rank].kind.clone();
            let (replica, _) = run.run.plan.position(rank).unwrap_or_default();
            let size = run.run.plan.replicas()[replica].batch.micro_batch_size();
            let (forward, backward) = (self.passes.entry(kind.clone()).or_default())
                .entry(size)
                .or_default();
            forward.add(
                run.measured(rank, &[SpanKind::Forward]),
                seconds(&row.spans, &[SpanKind::Forward]),
            );
            backward.add(
                run.measured(rank, &[SpanKind::Backward]),
                seconds(&row.spans, &[SpanKind::Backward]),
            );
            for step in &run.spans {
                self.sends.0.extend(durations(&step[rank], SpanKind::Send));
            }
            self.sends.1.extend(durations(&row.spans, SpanKind::Send));
            (self.optimizer.entry(kind).or_default()).add(
                run.measured(rank, &[SpanKind::Optimizer]),
                seconds(&row.spans, &[SpanKind::Optimizer]),
            );
        }
    }

    /// The reduction of `run` against its simulation: the rank whose reduction is
    /// shortest, the last to arrive, which does not wait inside the collective for the
    /// others (a measured reduction span includes that wait; a simulated one does not).
    /// Overlapped, both spans are what a rank waits for after its pipeline, the buckets
    /// still in flight: a ratio of the exposed parts, which scale with the bandwidth
    /// only roughly where most of the reduction hides.
    fn add_reduce(&mut self, run: &MeasuredRun, rows: &[RankTimeline]) {
        let simulated: Vec<(usize, f64)> = (rows.iter().enumerate())
            .map(|(rank, row)| (rank, seconds(&row.spans, &[SpanKind::Reduce])))
            .filter(|&(_, s)| s > 0.0)
            .collect();
        let Some(shortest) = simulated.iter().map(|&(_, s)| s).reduce(f64::min) else {
            return;
        };
        let measured = (run.spans.iter())
            .map(|step| {
                (simulated.iter())
                    .map(|&(rank, _)| seconds(&step[rank], &[SpanKind::Reduce]))
                    .fold(f64::INFINITY, f64::min)
            })
            .sum::<f64>()
            / run.spans.len().max(1) as f64;
        self.reduce.add(measured, shortest);
    }

    /// `profile` with these terms fitted in; the calibration without its step overhead.
    fn apply(&self, profile: &Profile) -> (Profile, Calibration) {
        let mut fitted = profile.clone();
        let mut calibration = Calibration {
            steps: self.steps,
            ..Calibration::default()
        };
        for (kind, sizes) in &self.passes {
            let Some(table) = fitted.devices.get_mut(kind) else {
                continue;
            };
            let mut whole = (Sums::default(), Sums::default());
            let mut scales = BTreeMap::new();
            for (&size, (f, b)) in sizes {
                whole.0.add(f.measured, f.simulated);
                whole.1.add(b.measured, b.simulated);
                if let (Some(forward), Some(backward)) = (f.ratio(), b.ratio()) {
                    scales.insert(size, ComputeScale { forward, backward });
                }
            }
            let (Some(forward), Some(backward)) = (whole.0.ratio(), whole.1.ratio()) else {
                continue;
            };
            // A size the runs used but the profile did not measure enters the table at
            // its interpolated costs times the scale its passes fitted.
            for size in scales.keys() {
                if let (false, Some(costs)) = (table.contains_key(size), profile.costs(kind, *size))
                {
                    table.insert(*size, costs);
                }
            }
            for (size, costs) in table.iter_mut() {
                let s = scales
                    .get(size)
                    .copied()
                    .unwrap_or(ComputeScale { forward, backward });
                // The embedding and head run forward and backward: the passes' mean.
                let both = (s.forward * costs.layer_fwd_s + s.backward * costs.layer_bwd_s)
                    / (costs.layer_fwd_s + costs.layer_bwd_s).max(1e-30);
                costs.layer_fwd_s *= s.forward;
                costs.layer_bwd_s *= s.backward;
                costs.embedding_s *= both;
                costs.head_s *= both;
                scales.entry(*size).or_insert(s);
            }
            calibration.compute_scale.insert(kind.clone(), scales);
        }
        if let Some(network) = &mut fitted.network {
            let (measured, simulated) = (median(&self.sends.0), median(&self.sends.1));
            if measured.is_finite() && simulated.is_finite() {
                network.latency_s = (network.latency_s + measured - simulated).max(0.0);
                calibration.send_s = Some(network.latency_s);
            }
            if let Some(scale) = self.reduce.ratio() {
                network.allreduce_bytes_per_s /= scale;
                calibration.reduce_scale = Some(scale);
            }
        }
        for (kind, sums) in &self.optimizer {
            let (Some(scale), Some(table)) = (sums.ratio(), fitted.devices.get_mut(kind)) else {
                continue;
            };
            for costs in table.values_mut() {
                costs.optimizer_s_per_param = costs.optimizer_s_per_param.map(|s| s * scale);
            }
            calibration.optimizer_scale.insert(kind.clone(), scale);
        }
        (fitted, calibration)
    }
}

/// `profile` calibrated by `runs` (see the module documentation), and each run priced
/// before and after.
pub fn calibrate(
    profile: &Profile,
    runs: &[MeasuredRun],
) -> Result<(Profile, Vec<RunCheck>), CalibrateError> {
    let with_spans: Vec<&MeasuredRun> = runs.iter().filter(|r| !r.spans.is_empty()).collect();
    if with_spans.is_empty() {
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        return Err(CalibrateError::TooShort {
            name: names.join(", "),
        });
    }
    let mut terms = Terms::default();
    let mut before = Vec::with_capacity(runs.len());
    for run in runs {
        let (step_s, rows) = run.simulate(profile)?;
        if !run.spans.is_empty() {
            terms.add(run, &run.cost_model(profile), &rows);
        }
        before.push(step_s);
    }
    // Fitted from the profile as it stands, less an earlier calibration's overhead.
    let mut base = profile.clone();
    base.calibration = None;
    let (mut fitted, mut calibration) = terms.apply(&base);
    let mut simulated = Vec::with_capacity(runs.len());
    for run in runs {
        simulated.push(run.simulate(&fitted)?.0);
    }
    let left: Vec<f64> = (runs.iter().zip(&simulated))
        .map(|(run, s)| run.step_s() - s)
        .collect();
    calibration.runs = runs.len();
    calibration.step_overhead_s = median(&left);
    fitted.calibration = Some(calibration);
    let checks = (runs.iter().zip(before).zip(simulated))
        .map(|((run, before_s), s)| RunCheck {
            name: run.name.clone(),
            measured_s: run.step_s(),
            before_s,
            after_s: s + fitted.step_overhead_s(),
        })
        .collect();
    Ok((fitted, checks))
}

#[cfg(test)]
#[path = "calibrate_tests.rs"]
mod tests;
