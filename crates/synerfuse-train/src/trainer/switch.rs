//! Re-planning while training: when the watch reports a sustained change of a rank's
//! pace, rank 0 plans again with every rank's measured pace, prices the gain over the
//! remaining iterations against the cost of switching and, under `--replan auto`, every
//! rank switches at this step boundary: the state of each new stage gathered from its
//! current holders by global name (as checkpoints store it), the communicators and the
//! optimizer rebuilt, the iteration and data position kept. No restart, no disk.

use super::broadcast::broadcast_bytes;
use super::exchange::{exchange, Recorder};
use super::replanning::Settling;
use super::report::StepLog;
use super::state::Trainer;
use crate::comm::devices::RankDevice;
use crate::replan::{
    RecentSteps, ReplanCause, ReplanDecision, ReplanMode, SpeedWatch, SwitchOutcome,
};
use crate::TrainError;
use std::path::PathBuf;
use std::time::Instant;
use synerfuse_model::tch::Tensor;
use synerfuse_plan::RunRecord;
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
        self.replanning.settling = None;
        log.record_switch_outcome(self.world.rank(), &outcome)
    }

    /// Why to re-plan after this step, if at all (never when the run cannot go on: its
    /// last step, or one it stops after): a sustained change the watch reported, or,
    /// once a run and on more than one rank, the first paces after warm-up.
    pub(super) fn replan_cause(&mut self, shifted: bool, goes_on: bool) -> Option<ReplanCause> {
        if !goes_on {
            return None;
        }
        let first = !self.replanning.warm_up_judged && self.watch.paces_s().is_some();
        self.replanning.warm_up_judged |= first;
        match (shifted, first && self.world.size() > 1) {
            (true, _) => Some(ReplanCause::SpeedChange),
            (false, true) => Some(ReplanCause::WarmUp),
            (false, false) => None,
        }
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
        // Rank 0 decides and tells the others: the planner's ties must not fall apart
        // between processes.
        let (mut message, mut failure) = (Vec::new(), None);
        if self.world.rank() == 0 {
            let job = RunningJob::of_run(&run, &paces_s, network);
            match self.decide(&job, switch_cost_s, cost_basis, cause) {
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
        if decision.switched {
            self.switch_plan(decision)?;
            self.record_run(log)?;
        }
        logged
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
    /// running (both by the fitted model).
    fn decide(
        &self,
        job: &RunningJob<'_>,
        switch_cost_s: f64,
        cost_basis: &str,
        cause: ReplanCause,
    ) -> Result<ReplanDecision, planner::ReplanError> {
        let cost = planner::fitted_cost(job)?;
        let fitted: Vec<f64> = cost
            .cluster
            .group
            .iter()
            .map(|g| g.speed.unwrap_or(1.0))
            .collect();
        let fastest = fitted.iter().copied().fold(f64::MIN_POSITIVE, f64::max);
        let current_step_s = planner::predict_step_s(&cost, job.plan)?;
        let global = job.plan.global_batch_size();
        let request = planner::running_job_request(
            global,
            self.config.compute.recompute,
            self.config.optimizer.distributed,
        );
        let placements: Vec<_> = (0..job.plan.world_size())
            .map(|r| job.plan.placement(r).cloned())
            .collect();
        let (plan, proposed_step_s) = planner::best_plan_for(&cost, &request, &placements)?;
        let remaining_iterations = self.config.batch.train_iters - self.iteration;
        let mut decision = ReplanDecision {
            iteration: self.iteration,
            cause,
            paces_s: job.paces_s.to_vec(),
            speeds: fitted.iter().map(|s| s / fastest).collect(),
            measured_step_s: self.replanning.recent.median().unwrap_or_default(),
            current_step_s,
            proposed_step_s,
            proposed_layers: plan.replicas().iter().map(|r| r.stages.layers()).collect(),
            proposed_batches: (plan.replicas().iter()).map(|r| r.batch.clone()).collect(),
            proposed_plan: plan,
            remaining_iterations,
            gain_s: (current_step_s - proposed_step_s) * remaining_iterations as f64,
            switch_cost_s,
            cost_basis: cost_basis.to_owned(),
            switched: false,
        };
        decision.switched = self.config.replan.mode == ReplanMode::Auto
            && decision.pays()
            && decision.proposed_plan != *job.plan;
        Ok(decision)
    }

    /// Switches this rank to the decision's plan at this step boundary. Collective.
    fn switch_plan(&mut self, decision: ReplanDecision) -> Result<(), TrainError> {
        let started = Instant::now();
        // A background save of the old plan's state completes first.
        self.finish_saves()?;
        let before_step_s = self.replanning.recent.median().unwrap_or_default();
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
        self.watch = SpeedWatch::new(self.world.size(), self.config.replan.watch);
        let predicted_step_s = decision.proposed_step_s;
        self.replanning.settling = Some(Settling {
            outcome: SwitchOutcome {
                switched_after: self.iteration,
                iteration: self.iteration,
                before_step_s,
                predicted_step_s,
                after_step_s: 0.0,
                switch_s,
            },
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
