//! Re-planning while training: when the watch reports a sustained change of a rank's
//! pace, rank 0 plans again with every rank's measured pace, prices the gain over the
//! remaining iterations against the cost of switching and, under `--replan auto`, every
//! rank switches at this step boundary: the state of each new stage gathered from its
//! current holders by global name (as checkpoints store it), the communicators and the
//! optimizer rebuilt, the iteration and data position kept. No restart, no disk.

use super::broadcast::broadcast_bytes;
use super::exchange::{exchange, Recorder};
use super::replanning::{LookAfter, Settling};
use super::report::StepLog;
use super::state::Trainer;
use crate::comm::devices::RankDevice;
use crate::replan::{
    RecentSteps, ReplanCause, ReplanDecision, ReplanMode, ReplanVerdict, SpeedWatch, SwitchOutcome,
    LEAST_IMPROVEMENT,
};
use crate::TrainError;
use std::path::PathBuf;
use std::time::Instant;
use synerfuse_model::tch::Tensor;
use synerfuse_plan::{Plan, RunRecord};
use synerfuse_planner::cost::CostModel;
use synerfuse_planner::planner::{self, RunningJob};

impl<'w> Trainer<'w> {
    /// Records a step's time; once a switch has settled (a step after it, then a
    /// window), logs the step it measured against the one before and the prediction.
    pub(super) fn note_step(&mut self, log: &mut StepLog, step_s: f64) -> Result<(), TrainError> {
        self.replanning.recent.push(step_s);
        let Some(settling) = &mut self.replanning.settling else {
            return Ok(());
        };
        settling.seen += 1;
        if settling.seen == 1 {
            return Ok(()); // its first step allocates what the new stage needs
        }
        settling.after.push(step_s);
        if !settling.after.full() {
            return Ok(());
        }
        let mut outcome = settling.outcome.clone();
        outcome.iteration = self.iteration;
        outcome.after_step_s = settling.after.median().unwrap_or_default();
        outcome.after_spread = settling.after.spread();
        outcome.lost = outcome.measures_slower();
        outcome.missed = outcome.misses_prediction();
        let previous_plan = settling.previous_plan.clone();
        self.replanning.settling = None;
        self.replanning.look_after = Some(LookAfter {
            outcome: outcome.clone(),
            previous_plan,
        });
        log.record_switch_outcome(self.world.rank(), &outcome)
    }

    /// Why to re-plan after this step, if at all (never when the run cannot go on: its
    /// last step, or one it stops after): a sustained change the watch reported; a
    /// switch measured, once the watch has the paces since it; a decision deferred, once
    /// it has measured them again; or, once a run and on more than one rank, the first
    /// paces after warm-up.
    pub(super) fn replan_cause(&mut self, shifted: bool, goes_on: bool) -> Option<ReplanCause> {
        if !goes_on {
            return None;
        }
        let measured = self.watch.paces_s().is_some();
        let first = !self.replanning.warm_up_judged && measured;
        self.replanning.warm_up_judged |= first;
        let replanning = &mut self.replanning;
        if shifted {
            // A rank's pace changed: what lost before may not lose now, and the decision
            // on it supersedes any left pending.
            replanning.lost_plans.clear();
            replanning.deferred = None;
            replanning.look_after = None;
            return Some(ReplanCause::SpeedChange);
        }
        if measured && replanning.look_after.is_some() {
            return Some(ReplanCause::AfterSwitch);
        }
        if measured && replanning.deferred.is_some() {
            return replanning.deferred.take();
        }
        (first && self.world.size() > 1).then_some(ReplanCause::WarmUp)
    }

    /// After the watch's verdict (`cause`): plans again with every rank's measured pace,
    /// logs the decision and, when it pays under `--replan auto`, switches. Collective.
    pub(super) fn replan(
        &mut self,
        log: &mut StepLog,
        cause: ReplanCause,
    ) -> Result<(), TrainError> {
        self.settle_parameters()?;
        let Some(paces_s) = self.watch.paces_s() else {
            return Ok(());
        };
        let run = self.run_record()?;
        let network = match self.world.size() > 1 {
            true => Some(crate::profiler::measure_network(self.world).map_err(|e| {
                TrainError::Replan {
                    iteration: self.iteration,
                    reason: e.to_string(),
                }
            })?),
            false => None,
        };
        let (switch_cost_s, cost_basis) = self.switch_cost()?;
        let look_after = match cause {
            ReplanCause::AfterSwitch => self.replanning.look_after.take(),
            _ => None,
        };
        // Rank 0 decides and tells the others: the planner's ties must not fall apart
        // between processes.
        let (mut message, mut failure) = (Vec::new(), None);
        if self.world.rank() == 0 {
            let job = RunningJob::of_run(&run, &paces_s, network);
            let basis = (switch_cost_s, cost_basis, cause);
            match self.decide(&job, basis, look_after.as_ref()) {
                Ok(decision) => message = serde_json::to_vec(&decision).unwrap_or_default(),
                Err(reason) => failure = Some(reason),
            }
        }
        let message = broadcast_bytes(self.world, &message, 0)?;
        if let Some(reason) = failure {
            tracing::warn!(
                "re-planning after iteration {}: {reason}; the plan is kept",
                self.iteration
            );
        }
        if message.is_empty() {
            return Ok(());
        }
        let decision: ReplanDecision =
            serde_json::from_slice(&message).map_err(|e| TrainError::Replan {
                iteration: self.iteration,
                reason: format!("the decision did not reach every rank intact: {e}"),
            })?;
        // Rank 0's log may fail; the others switch all the same, so it switches too and
        // reports the failure after.
        let logged = match self.world.rank() {
            0 => log.record_replan(&decision),
            _ => Ok(()),
        };
        self.act_on(log, decision, look_after)?;
        logged
    }

    /// Every rank's part of a decision: measuring the paces again for a deferred one
    /// (a look after a switch kept for the retaken decision), switching for one that
    /// switches, remembering the plan left as lost when its switch failed (measured
    /// slower than the plan before it, or than its prediction). Collective.
    fn act_on(
        &mut self,
        log: &mut StepLog,
        decision: ReplanDecision,
        look_after: Option<LookAfter>,
    ) -> Result<(), TrainError> {
        let failed = (look_after.as_ref()).is_some_and(LookAfter::failed);
        if decision.verdict == ReplanVerdict::Defer {
            self.watch.remeasure();
            match look_after {
                Some(look) => self.replanning.look_after = Some(look),
                None => self.replanning.deferred = Some(decision.cause),
            }
        }
        if decision.switched && failed {
            let lost = self.config.parallel.plan.clone();
            self.replanning.lost_plans.push(lost);
        }
        if decision.switched {
            self.switch_plan(decision)?;
            self.record_run(log)?;
        }
        Ok(())
    }

    /// Under `--log-json`, writes what runs (the model, the plan, the options) as the
    /// log's `run` record, which `synerfuse profile --calibrate` prices the steps after
    /// it by. Collective (the hosts are gathered).
    pub(super) fn record_run(&self, log: &mut StepLog) -> Result<(), TrainError> {
        if self.config.logging.log_json.is_none() {
            return Ok(());
        }
        let run = self.run_record()?;
        match self.world.rank() {
            0 => log.record_run(&run),
            _ => Ok(()),
        }
    }

    /// What runs: the model, the plan, every rank's host and the options. Collective
    /// (the hosts are gathered).
    fn run_record(&self) -> Result<RunRecord, TrainError> {
        Ok(RunRecord {
            model: crate::profiler::model_shape(
                &self.config.model,
                self.config.batch.sequence_length,
            ),
            plan: self.config.parallel.plan.clone(),
            hosts: self.hosts()?,
            recompute: self.config.compute.recompute,
            distributed_optimizer: self.config.optimizer.distributed,
            compute_bytes: self.compute_bytes(),
            reduction: synerfuse_plan::RunReduction {
                overlap_grad_reduce: self.config.parallel.overlap_grad_reduce,
                ddp_bucket_size: self.config.parallel.ddp_bucket_size,
                overlap_param_gather: self.config.parallel.overlap_param_gather,
                hierarchical: self.config.parallel.hierarchical_reduction,
            },
        })
    }

    /// Every rank's host, in rank order. Collective.
    fn hosts(&self) -> Result<Vec<String>, TrainError> {
        Ok(RankDevice::gather(self.world, self.device)?
            .iter()
            .map(|d| format!("host{:x}", d.host))
            .collect())
    }

    /// Under `--save`, keeps what a plan for the survivors of a lost rank is made from
    /// (the paces follow each step). Collective.
    pub(super) fn remember_for_survivors(&self) -> Result<(), TrainError> {
        let Some(save) = self.config.checkpoint.save.clone() else {
            return Ok(());
        };
        crate::lost::remember(crate::lost::JobSnapshot {
            save,
            paces_s: vec![1.0; self.config.parallel.plan.world_size()],
            run: self.run_record()?,
        });
        Ok(())
    }

    /// Bytes per activation element on the wire.
    fn compute_bytes(&self) -> f64 {
        self.config.compute.precision.bytes() as f64
    }

    /// What a switch costs, s, and where that figure comes from: the last switch's
    /// measured time, else this job's measured set-up (building the model, the
    /// communicators and the optimizer, as a switch does) twice over, for moving the
    /// state too. The slowest rank's. Collective.
    fn switch_cost(&self) -> Result<(f64, &'static str), TrainError> {
        if let Some(s) = self.replanning.last_switch_s {
            return Ok((s, "the last switch, measured"));
        }
        let slowest = self.world_max(self.setup_s)?;
        Ok((
            2.0 * slowest,
            "twice this job's measured set-up (the model, communicators and optimizer built, and the state moved)",
        ))
    }

    /// The largest `value` over the world. Collective.
    pub(super) fn world_max(&self, value: f64) -> Result<f64, TrainError> {
        let all = self.world.all_gather(&Tensor::from_slice(&[value]))?;
        let all = Vec::<f64>::try_from(all.flatten(0, -1)).unwrap_or_default();
        Ok(all.into_iter().fold(value, f64::max))
    }

    /// Rank 0's decision: the best plan at the measured paces, priced against the plan
    /// running (both by the fitted model). After a switch (`look_after`) the plan it left
    /// is a candidate too, preferred when the model prices it alike; and a switch that
    /// lost or missed its prediction is priced by its measured step, against the plans of
    /// the kinds of parallelism the job ran before ([`planner::confined_request`]), not
    /// itself again.
    fn decide(
        &self,
        job: &RunningJob<'_>,
        (switch_cost_s, cost_basis, cause): (f64, &str, ReplanCause),
        look_after: Option<&LookAfter>,
    ) -> Result<ReplanDecision, planner::ReplanError> {
        let cost = planner::fitted_cost(job)?;
        let fitted: Vec<f64> = cost
            .cluster
            .group
            .iter()
            .map(|g| g.speed.unwrap_or(1.0))
            .collect();
        let fastest = fitted.iter().copied().fold(f64::MIN_POSITIVE, f64::max);
        let failed = look_after.filter(|l| l.failed());
        let current_step_s = match failed {
            Some(l) => l.outcome.after_step_s,
            None => planner::predict_step_s(&cost, job.plan)?,
        };
        let (plan, proposed_step_s) = self.proposal(&cost, job, look_after)?;
        let remaining_iterations = self.config.batch.train_iters - self.iteration;
        let mut decision = ReplanDecision {
            iteration: self.iteration,
            cause,
            paces_s: job.paces_s.to_vec(),
            pace_spreads: self.watch.spreads().unwrap_or_default(),
            speeds: fitted.iter().map(|s| s / fastest).collect(),
            measured_step_s: self.replanning.recent.median().unwrap_or_default(),
            current_step_s,
            current_measured: failed.is_some(),
            proposed_step_s,
            proposed_layers: plan.replicas().iter().map(|r| r.stages.layers()).collect(),
            proposed_batches: (plan.replicas().iter()).map(|r| r.batch.clone()).collect(),
            proposed_plan: plan,
            remaining_iterations,
            gain_s: (current_step_s - proposed_step_s) * remaining_iterations as f64,
            switch_cost_s,
            cost_basis: cost_basis.to_owned(),
            switched: false,
            verdict: ReplanVerdict::Keep,
        };
        let previous = look_after.map(|l| &l.previous_plan);
        decision.verdict = self.verdict(&decision, job.plan, previous);
        decision.switched = matches!(
            decision.verdict,
            ReplanVerdict::Switch | ReplanVerdict::SwitchBack
        );
        Ok(decision)
    }

    /// The plan to propose and its predicted step: see [`Self::decide`].
    fn proposal(
        &self,
        cost: &CostModel,
        job: &RunningJob<'_>,
        look_after: Option<&LookAfter>,
    ) -> Result<(Plan, f64), planner::ReplanError> {
        let failed = look_after.filter(|l| l.failed());
        let mut request = planner::running_job_request(
            job.plan.global_batch_size(),
            self.config.compute.recompute,
            self.config.optimizer.distributed,
        );
        if let Some(l) = failed {
            request = planner::confined_request(request, &l.previous_plan);
        }
        let placements: Vec<_> = (0..job.plan.world_size())
            .map(|r| job.plan.placement(r).cloned())
            .collect();
        let mut best = planner::best_plan_for(cost, &request, &placements)?;
        let Some(l) = look_after else {
            return Ok(best);
        };
        let previous = &l.previous_plan;
        if failed.is_some() && best.0 == *job.plan {
            best = (previous.clone(), planner::predict_step_s(cost, previous)?);
        }
        prefer_measured(cost, best, previous)
    }

    /// What to do about `decision`, made while `current` runs (`previous`: the plan the
    /// last switch left, when the decision looks after it): switch when the proposal
    /// pays, is not a plan that lost or missed before and the paces are steady enough to
    /// trust the gain; else keep the plan, saying why.
    fn verdict(
        &self,
        decision: &ReplanDecision,
        current: &Plan,
        previous: Option<&Plan>,
    ) -> ReplanVerdict {
        if !(decision.pays() && decision.proposed_plan != *current) {
            return ReplanVerdict::Keep;
        }
        if self.config.replan.mode != ReplanMode::Auto {
            return ReplanVerdict::WouldHavePaid;
        }
        if self.replanning.lost_plans.contains(&decision.proposed_plan) {
            return ReplanVerdict::LostBefore;
        }
        if !decision.evidence_suffices() {
            return ReplanVerdict::Defer;
        }
        match previous == Some(&decision.proposed_plan) {
            true => ReplanVerdict::SwitchBack,
            false => ReplanVerdict::Switch,
        }
    }

    /// Switches this rank to the decision's plan at this step boundary. Collective.
    fn switch_plan(&mut self, decision: ReplanDecision) -> Result<(), TrainError> {
        let started = Instant::now();
        // A background save of the old plan's state completes first.
        self.finish_saves()?;
        let before_step_s = self.replanning.recent.median().unwrap_or_default();
        let before_spread = self.replanning.recent.spread();
        let previous_plan = self.config.parallel.plan.clone();
        let held = self.checkpoint_pieces();
        let state = self.checkpoint_state();
        let origin = PathBuf::from(format!(
            "(state moved between ranks after iteration {})",
            self.iteration
        ));
        let mut config = self.config.clone();
        config.parallel.plan = decision.proposed_plan;
        config.checkpoint.load = None;
        config.checkpoint.finetune_from_hf = None;
        let mut next = Trainer::new(
            self.world,
            config,
            self.datasets.clone(),
            self.sample_options,
            self.local_rank,
        )?;
        // What the new plan's restore reads, then exactly those ranges from their holders.
        let recorder = Recorder::new(state.clone(), origin.clone());
        next.restore(&recorder)?;
        let pieces: Vec<_> = held.model.into_iter().chain(held.optimizer).collect();
        let moved = exchange(self.world, &pieces, recorder.reads(), state, origin)?;
        drop(pieces);
        next.restore(&moved)?;
        drop(moved);
        next.setup_s = self.setup_s;
        // The emulated speed this rank has reached (an emulated change carries on).
        next.emulation = self.emulation;
        next.replanning = self.replanning.clone();
        next.finished_saves = std::mem::take(&mut self.finished_saves);
        let old = std::mem::replace(self, next);
        drop(old);
        let switch_s = self.world_max(started.elapsed().as_secs_f64())?;
        let window = self.config.replan.watch.window;
        self.replanning.recent = RecentSteps::new(window);
        self.replanning.last_switch_s = Some(switch_s);
        self.watch = SpeedWatch::after_switch(self.world.size(), self.config.replan.watch);
        let predicted_step_s = decision.proposed_step_s;
        self.replanning.settling = Some(Settling {
            outcome: SwitchOutcome {
                switched_after: self.iteration,
                iteration: self.iteration,
                before_step_s,
                predicted_step_s,
                after_step_s: 0.0,
                before_spread,
                after_spread: 0.0,
                lost: false,
                missed: false,
                switch_s,
            },
            previous_plan,
            seen: 0,
            after: RecentSteps::new(window),
        });
        if self.world.rank() == 0 {
            tracing::info!(
                "re-planned after iteration {}: switched in {switch_s:.3} s to layers per stage {:?} and micro-batches {:?} per replica",
                self.iteration,
                self.config.parallel.plan.replicas().iter().map(|r| r.stages.layers()).collect::<Vec<_>>(),
                self.config.parallel.plan.replicas().iter().map(|r| r.batch.to_string()).collect::<Vec<_>>(),
            );
        }
        Ok(())
    }
}

/// `best` (a plan and its predicted step), or `previous`, the plan the last switch left,
/// where the model prices it within [`LEAST_IMPROVEMENT`] of `best`: of two plans the
/// model cannot tell apart, the one this run has measured. (A rank given little work
/// looks slower per sample than it is, its fixed costs spread over fewer samples, so a
/// switch made on a misleading warm-up would otherwise end near, not at, the plan before.)
fn prefer_measured(
    cost: &CostModel,
    best: (Plan, f64),
    previous: &Plan,
) -> Result<(Plan, f64), planner::ReplanError> {
    let previous_s = planner::predict_step_s(cost, previous)?;
    Ok(match previous_s <= best.1 * (1.0 + LEAST_IMPROVEMENT) {
        true => (previous.clone(), previous_s),
        false => best,
    })
}
