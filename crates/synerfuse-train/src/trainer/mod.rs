//! The training loop of one rank: its stage chunks, its replica's micro-batches, the
//! pipeline step, the gradient reductions, AdamW, metrics and checkpoints.
//!
//! Every plan is a general plan: each replica its own pipeline (a grid is the case where
//! they are all alike). Gradients are exact for the global batch whatever the plan: the
//! last stage divides each replica's summed token losses by the global number of loss
//! tokens of the step, so each gradient segment's reduction over its holders is a plain
//! sum (ARCHITECTURE.md, "How a training step runs").
//!
//! The [`Trainer`] struct and its constructor (`state`, built in `setup`'s steps, holding
//! `replanning`'s and `save_record`'s types) sit beneath what gives it behaviour: the loop
//! here, and the `impl` blocks of `save`, `switch` and `eval` depend on them, never the
//! other way round.

use crate::comm::{GroupCommunicator, SetGroups};
use crate::emulation::Emulation;
use crate::grads::EMBEDDING;
use crate::loader::LoaderError;
use crate::memory::HighWater;
use crate::optim::clip_factor;
use crate::pipeline::{PipelineEvent, PipelineRank, StepTimes};
use crate::zero::DistributedOptimizer;
use crate::{signals, TrainError};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use synerfuse_model::tch::{Device, Kind, Tensor};
use synerfuse_plan::timeline::{Span, SpanKind};

mod broadcast;
mod config;
mod eval;
mod evaluation;
mod exchange;
mod replanning;
mod report;
mod save;
mod save_record;
mod setup;
mod state;
mod switch;

pub use config::{
    BatchConfig, CheckpointConfig, ComputeConfig, DataConfig, EvalConfig, LoggingConfig,
    OptimizerConfig, ParallelConfig, ReplanConfig, TrainConfig,
};
pub use evaluation::{EvalSplit, Evaluation};
use report::{StepLog, StepOutcome, StepResult};
use setup::{context_rank, expert_rank};
pub use state::Trainer;

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    /// Iteration reached.
    pub iteration: u64,
    /// Losses of the iterations this process ran.
    pub losses: Vec<f64>,
    /// The run stopped early on SIGTERM.
    pub stopped_by_signal: bool,
    /// Checkpoint directories written.
    pub saved: Vec<PathBuf>,
    /// Evaluations run, in order.
    pub evaluations: Vec<Evaluation>,
}

/// Test hook: `SYNERFUSE_FAULT_INJECT=exit:RANK:ITERATION` makes that rank exit in the
/// middle of that iteration (after its pipeline work, before the reductions), the way a
/// crashed process would; used by the fault tests.
fn injected_fault(rank: usize, iteration: u64) -> bool {
    let Ok(spec) = std::env::var("SYNERFUSE_FAULT_INJECT") else {
        return false;
    };
    let parts: Vec<&str> = spec.split(':').collect();
    matches!(parts.as_slice(), ["exit", r, i] if r.parse() == Ok(rank) && i.parse() == Ok(iteration))
}

impl<'w> Trainer<'w> {
    /// Iterations completed so far.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// The communicator of this rank's tensor-parallel group, if its stage has one (its
    /// members in tensor-parallel order, which sequence parallelism's rows follow).
    fn tp_communicator<'g>(
        groups: &'g SetGroups,
        tp_group: &[usize],
    ) -> Option<&'g GroupCommunicator> {
        groups.get(tp_group)
    }
    /// The dtype of activations between stages.
    fn activation_kind(&self) -> Kind {
        setup::compute_kind(setup::rank_precision(&self.config, self.world.rank()))
    }

    /// Whether this rank is its context-parallel group's first member (or in none): the
    /// one whose copy of the stage's parameters counts once.
    fn context_first(&self) -> bool {
        (self.context.as_ref()).is_none_or(|c| c.group[0] == self.world.rank())
    }

    /// Whether this rank's copy of parameter `name` is the one the gradient norm and
    /// checkpoints count (tensor-parallel holders aside, see `Stage::holds_unique`):
    /// replica 0's, or of an expert the lowest replica holding it; on the first
    /// context-parallel member.
    fn counts_once(&self, name: &str) -> bool {
        let expert = synerfuse_plan::expert_of(name).zip(self.experts.as_ref());
        let lowest = match (expert, self.config.model.moe) {
            (Some((e, _)), Some(moe)) => {
                let layer = synerfuse_plan::layer_of(name).unwrap_or(0);
                let holders = (self.config.parallel.plan).expert_holders(layer, e, moe.num_experts);
                holders.first() == Some(&self.replica)
            }
            _ => self.replica == 0,
        };
        lowest && self.context_first()
    }

    /// Whether this rank holds the last stage's tied copy of the embedding (which the
    /// norm and checkpoints skip: the first stage's copy is the parameter).
    fn holds_tied_copy(&self) -> bool {
        self.config.model.tie_word_embeddings
            && self.num_stages > 1
            && self.stage_index + 1 == self.num_stages
    }

    /// Trains until `--train-iters`, an `--exit-interval` or a stop signal, evaluating
    /// as configured (only evaluating under `--skip-train`).
    pub fn train(&mut self) -> Result<TrainSummary, TrainError> {
        let rank = self.world.rank();
        let mut log = StepLog::open(&self.config, rank, self.world.size())?;
        let global_batch = self.config.parallel.plan.global_batch_size() as u64;
        let (train_iters, eval) = (self.config.batch.train_iters, self.config.eval);
        let mut summary = TrainSummary {
            iteration: self.iteration,
            losses: Vec::new(),
            stopped_by_signal: false,
            saved: Vec::new(),
            evaluations: Vec::new(),
        };
        if eval.skip_train {
            if rank == 0 {
                tracing::info!("skipping training (--skip-train is on)");
            }
            summary.evaluations = self.evaluate_at_end(0, &mut log)?;
            return Ok(summary);
        }
        self.record_run(&mut log)?;
        let mut consumed_valid = eval.consumed_valid_samples(self.iteration, global_batch);
        let mut ended_early = false;
        while self.iteration < train_iters {
            self.change_emulated_speed();
            self.note_step_start();
            let started = Instant::now();
            let crossed_before = self.crossed_bytes();
            let step = self.step(started)?;
            let crossed = (self.crossed_bytes())
                .zip(crossed_before)
                .map(|(a, b)| a - b);
            let stop = signals::stop_requested();
            let elapsed = started.elapsed();
            // Every rank's spans on the steps whose JSON record carries them.
            let with_spans = log.keeps_spans(self.iteration + 1);
            let replica_tokens = self.replica_tokens();
            let outcome = StepOutcome::gather(
                self.world,
                step,
                (elapsed, crossed),
                stop,
                replica_tokens,
                with_spans,
            )?;
            self.count_step(outcome.skipped, global_batch);
            summary.iteration = self.iteration;
            summary.losses.push(outcome.loss);
            log.record(rank, self.iteration, self.consumed_samples, &outcome)?;
            crate::lost::remember_paces(&outcome.pace_s());
            let shifts = self.watch.observe(&outcome.pace_s());
            log.record_speed_shifts(rank, self.iteration, &shifts)?;
            self.note_step(&mut log, outcome.step_ms / 1e3)?;
            let ending = outcome.any_stop || self.config.checkpoint.exit_due(self.iteration);
            let goes_on = self.iteration < train_iters && !ending;
            if let Some(cause) = self.replan_cause(!shifts.is_empty(), goes_on) {
                self.replan(&mut log, cause)?;
            }
            if eval.due(self.iteration) {
                let split = EvalSplit::Validation;
                if let Some(e) = self.evaluate_and_log(split, consumed_valid, false, &mut log)? {
                    consumed_valid += e.samples;
                    summary.evaluations.push(e);
                }
            }
            let checkpointing = &self.config.checkpoint;
            if checkpointing.save_due(self.iteration, train_iters, outcome.any_stop) {
                summary.saved.push(self.save()?);
                self.log_saves(&mut log)?;
            }
            if self.config.checkpoint.exit_due(self.iteration) && self.iteration != train_iters {
                if rank == 0 {
                    tracing::info!(
                        "exiting after iteration {} (--exit-interval)",
                        self.iteration
                    );
                }
                ended_early = true;
                break;
            }
            if outcome.any_stop {
                self.log_stop();
                summary.stopped_by_signal = true;
                ended_early = true;
                break;
            }
        }
        self.settle_parameters()?;
        if !ended_early {
            let at_end = self.evaluate_at_end(consumed_valid, &mut log)?;
            summary.evaluations.extend(at_end);
        }
        // A background save in flight is finished, a stop signal's included.
        self.finish_saves()?;
        self.log_saves(&mut log)?;
        if let Some(peak) = crate::memory::peak_resident_bytes() {
            tracing::info!("peak resident memory {peak} B");
        }
        Ok(summary)
    }

    /// Counts the step that ended: the iteration, its samples, and whether the
    /// learning-rate schedule stood still over it (skipped for an overflow).
    fn count_step(&mut self, skipped: bool, global_batch: u64) {
        self.iteration += 1;
        self.consumed_samples += global_batch;
        if skipped {
            self.skipped_samples += global_batch;
        }
    }

    /// Waits for the parameter gathers the last step left in flight
    /// (`--overlap-param-gather`): before anything but the next step's forward reads the
    /// parameters (evaluation, a checkpoint, a re-plan, the end of training).
    fn settle_parameters(&self) -> Result<(), TrainError> {
        match &self.zero {
            Some(zero) => Ok(zero.gathers().wait_all()?),
            None => Ok(()),
        }
    }

    /// Records the saves finished since the last call in the JSON log.
    fn log_saves(&mut self, log: &mut StepLog) -> Result<(), TrainError> {
        for record in std::mem::take(&mut self.finished_saves) {
            log.record_save(self.world.rank(), &record)?;
        }
        Ok(())
    }

    /// [`Self::evaluate`], then its log lines, JSON record and TensorBoard scalars.
    fn evaluate_and_log(
        &mut self,
        split: EvalSplit,
        consumed: u64,
        at_end: bool,
        log: &mut StepLog,
    ) -> Result<Option<Evaluation>, TrainError> {
        let evaluation = self.evaluate(split, consumed, at_end)?;
        if let Some(e) = &evaluation {
            let tensorboard = !self.config.eval.skip_train;
            log.record_evaluation(self.world.rank(), e, self.consumed_samples, tensorboard)?;
        }
        Ok(evaluation)
    }

    /// Megatron's end of training: the validation split from `consumed_valid`, then the
    /// test split from its start, each logged as it ends.
    fn evaluate_at_end(
        &mut self,
        consumed_valid: u64,
        log: &mut StepLog,
    ) -> Result<Vec<Evaluation>, TrainError> {
        let valid = self.evaluate_and_log(EvalSplit::Validation, consumed_valid, true, log)?;
        let test = self.evaluate_and_log(EvalSplit::Test, 0, true, log)?;
        Ok(valid.into_iter().chain(test).collect())
    }

    /// This rank's replica's tokens per step (every stage of a replica sees the same).
    /// Bytes this rank has sent over emulated links, where the plan's are emulated.
    fn crossed_bytes(&self) -> Option<crate::comm::CrossedBytes> {
        self.groups.link_emulation().map(|e| e.crossed())
    }

    fn replica_tokens(&self) -> usize {
        let replica = &self.config.parallel.plan.replicas()[self.replica];
        replica.batch.samples() * self.config.batch.sequence_length
    }

    /// Applies this rank's `--emulate-speed-change` for the coming iteration (the latest
    /// change at or before it, so a resumed run is at the speed it would have had).
    fn change_emulated_speed(&mut self) {
        let (rank, next) = (self.world.rank(), self.iteration + 1);
        let Some(change) = (self.config.compute.speed_changes.iter())
            .filter(|c| c.rank == rank && c.iteration <= next)
            .max_by_key(|c| c.iteration)
        else {
            return;
        };
        if self.emulation.map(|e| e.speed) == Some(change.speed) {
            return;
        }
        tracing::info!(
            "device emulation: from iteration {next} this rank runs at {:.3}x (--emulate-speed-change)",
            change.speed
        );
        self.emulation = Some(Emulation {
            speed: change.speed,
            device: self.device,
        });
    }

    /// Rank 0 says which signal stopped the run and whether it was saved.
    fn log_stop(&self) {
        if self.world.rank() != 0 {
            return;
        }
        tracing::warn!(
            "{} received: stopped after iteration {}{}",
            if signals::stop_requested() {
                signals::stop_signal_name()
            } else {
                "a stop signal (on another rank)"
            },
            self.iteration,
            if self.config.checkpoint.save.is_some() {
                " and saved a checkpoint"
            } else {
                " (no --save, nothing saved)"
            }
        );
    }

    /// The global batch's loss tokens and sequences: each replica's (counted on its
    /// first stage), summed over the world.
    fn global_loss_tokens(
        &self,
        micro_batches: &[crate::loader::MicroBatch],
    ) -> Result<(f64, f64), TrainError> {
        // Once per replica: its first stage's tensor- and context-parallel rank 0.
        let counts =
            self.stage_index == 0 && self.chunks[0].shard().rank == 0 && self.context_first();
        let local: [f64; 2] = match counts {
            true => [
                micro_batches.iter().map(|m| m.loss_tokens()).sum(),
                micro_batches.iter().map(|m| m.len() as f64).sum(),
            ],
            false => [0.0; 2],
        };
        let mut totals = Tensor::from_slice(&local);
        if self.world.size() > 1 {
            self.world.all_reduce_sum(&mut totals)?;
        }
        let global = totals.double_value(&[0]);
        if global <= 0.0 {
            return Err(TrainError::NoLossTokens {
                consumed_samples: self.consumed_samples,
            });
        }
        Ok((global, totals.double_value(&[1])))
    }

    /// One iteration (begun at `step_start`): the pipeline, the gradient reductions, the
    /// optimizer step.
    fn step(&mut self, step_start: Instant) -> Result<StepResult, TrainError> {
        let micro_batches = match &mut self.loader {
            Some(loader) => loader.step(self.consumed_samples)?,
            None => return Err(LoaderError::NoTrainData.into()),
        };
        let since_start = || step_start.elapsed().as_secs_f64();
        let span = |kind, start_s| Span {
            kind,
            start_s,
            end_s: since_start(),
            micro_batch: None,
        };
        let mut times = StepTimes::default();
        let started = Instant::now();
        let mut spans = vec![];
        let (loss_tokens, sequences) = self.global_loss_tokens(&micro_batches)?;
        // Counting the global batch's loss tokens waits for every rank.
        spans.push(span(SpanKind::Wait, 0.0));
        times.communication += started.elapsed();
        self.optimizer.zero_grad();
        self.grads.begin_step(&self.program);
        // Waits before this step (an evaluation's, a save's) are not this step's.
        if let Some(zero) = &self.zero {
            zero.gathers().take_waited();
        }
        let mut high_water = self.memory_probe.as_ref().and_then(HighWater::start);
        // The loss and the MoE layers' losses times the loss scale where this replica
        // scales its loss, its gradients unscaled on their way into the fp32 buffer.
        let scale = match setup::replica_scales_loss(&self.config, self.replica) {
            true => f64::from(self.scaler.scale()),
            false => 1.0,
        };
        self.grads.set_unscale(1.0 / scale);
        let normalisers = (loss_tokens / scale, sequences / scale);
        let (loss, pipeline_times, pipeline_spans) =
            self.run_pipeline(&micro_batches, normalisers, high_water.as_mut(), step_start)?;
        spans.extend(pipeline_spans);
        // This process's first step also allocates the gradients: its peak is not the
        // activations'.
        self.steps_run += 1;
        if let Some(peak) = high_water.filter(|_| self.steps_run > 1) {
            let before = self.memory.activations_peak;
            let peak = before.unwrap_or(0).max(peak.above_base());
            self.memory.activations_peak = Some(peak);
            if before.is_none() {
                tracing::info!("activation high-water mark: {peak} B above the state");
            }
        }
        if let Some(gathers) = self.zero.as_ref().map(DistributedOptimizer::gathers) {
            // Every chunk's forward has waited for its own; none is left in flight.
            gathers.wait_all()?;
            times.param_gather_wait = gathers.take_waited();
        }
        times.compute += pipeline_times.compute;
        times.communication += pipeline_times.communication;
        times.waiting += pipeline_times.waiting;
        times.passes += pipeline_times.passes;
        if injected_fault(self.world.rank(), self.iteration + 1) {
            eprintln!(
                "rank {}: SYNERFUSE_FAULT_INJECT: exiting in the middle of iteration {}",
                self.world.rank(),
                self.iteration + 1
            );
            std::process::exit(3);
        }
        let (started, start_s) = (Instant::now(), since_start());
        self.grads.finish(&self.groups)?;
        times.reduce_wait = started.elapsed();
        spans.extend(self.grads.bucket_spans(step_start));
        let (grads, grad_norm) = self.reduced_gradients()?;
        times.communication += started.elapsed();
        spans.push(span(SpanKind::Reduce, start_s));
        // Any rank's inf or NaN makes the global norm one: the same decision everywhere.
        let overflow = self.scaler.scales() && !grad_norm.is_finite();
        self.scaler.update(overflow);
        let lr = (self.config.optimizer.lr).lr(self.consumed_samples - self.skipped_samples);
        if !overflow {
            let factor = clip_factor(grad_norm, self.config.optimizer.clip_grad);
            let step_s = since_start();
            spans.extend(self.optimizer_step((lr, factor), &grads, &mut times, step_s)?);
        }
        Ok(StepResult {
            skipped: overflow,
            // After this step's update, as Megatron logs it.
            loss_scale: f64::from(self.scaler.scale()),
            loss_sum: loss.loss_sum,
            loss_tokens,
            experts: loss.experts.row(&self.config.model),
            sequences,
            lr,
            grad_norm,
            times,
            memory: self.memory,
            spans,
        })
    }

    /// The optimizer's update at `lr` with the gradients scaled by `factor` (and, under
    /// the distributed optimizer, the gathers of the updated parameters, or their start),
    /// from `start_s` into the step: its spans. Blocking, the gathers (one per reduction,
    /// between the updates) are drawn after the updates, as long as all of them, as the
    /// planner's timeline shows them.
    fn optimizer_step(
        &mut self,
        (lr, factor): (f64, f64),
        grads: &BTreeMap<String, Tensor>,
        times: &mut StepTimes,
        start_s: f64,
    ) -> Result<Vec<Span>, TrainError> {
        let started = Instant::now();
        self.optimizer.step_with_grads(lr, grads, factor)?;
        let overlap = self.config.parallel.overlap_param_gather;
        let mut gathering = Duration::ZERO;
        if let Some(zero) = &mut self.zero {
            gathering = zero.step(lr, factor, &self.groups, overlap)?;
            if !overlap {
                times.param_gather_wait += gathering;
            }
        }
        times.compute += started.elapsed() - gathering;
        times.communication += gathering;
        let end_s = start_s + started.elapsed().as_secs_f64();
        let gather_s = match overlap {
            true => 0.0,
            false => gathering.as_secs_f64(),
        };
        let updated_s = end_s - gather_s;
        let span = |kind, start_s, end_s| Span {
            kind,
            start_s,
            end_s,
            micro_batch: None,
        };
        let mut spans = vec![span(SpanKind::Optimizer, start_s, updated_s)];
        if gather_s > 0.0 {
            spans.push(span(SpanKind::Gather, updated_s, end_s));
        }
        Ok(spans)
    }

    /// Runs this rank's program; each chunk's main gradients accumulate (and, when
    /// overlapping, start their reduction) as its backwards end.
    fn run_pipeline(
        &mut self,
        micro_batches: &[crate::loader::MicroBatch],
        normalisers: (f64, f64),
        mut high_water: Option<&mut HighWater>,
        step_start: Instant,
    ) -> Result<(crate::pipeline::StepLoss, StepTimes, Vec<Span>), TrainError> {
        let pipeline = PipelineRank {
            chunks: &self.chunks,
            stage_index: self.stage_index,
            num_stages: self.num_stages,
            world: self.world,
            links: &self.links,
            tp: Self::tp_communicator(&self.groups, &self.tp_group),
            context: context_rank(&self.groups, self.context.as_ref()),
            experts: expert_rank(&self.groups, self.experts.as_ref(), &self.config),
            peer_rows: &self.peer_rows,
            activation_kind: self.activation_kind(),
            rank_kinds: &self.rank_kinds,
            emulation: self.emulation,
            step_start,
            report_final_grads: self.config.parallel.overlap_grad_reduce,
            param_gathers: (self.zero.as_ref().map(DistributedOptimizer::gathers))
                .filter(|gathers| !gathers.is_empty()),
        };
        if let (Some(gathers), 1) = (pipeline.param_gathers, self.steps_run) {
            let buckets = gathers.buckets();
            tracing::info!("{buckets} parameter gather buckets in flight as the forward starts");
        }
        let groups = &self.groups;
        let overlap = self.config.parallel.overlap_grad_reduce;
        let param_gathers = pipeline.param_gathers;
        let main_grads = &mut self.grads;
        let mut on_event = |event: PipelineEvent| -> Result<(), TrainError> {
            if let Some(high_water) = high_water.as_deref_mut() {
                high_water.sample();
            }
            match event {
                PipelineEvent::BackwardDone { chunk } => {
                    main_grads.after_backward(chunk, groups, overlap)?
                }
                PipelineEvent::GradsFinal { chunk, grads } => {
                    main_grads.grads_final(chunk, grads.from_piece, groups, overlap)?
                }
                PipelineEvent::Between => {
                    main_grads.progress();
                    if let Some(gathers) = param_gathers {
                        gathers.progress();
                    }
                }
            }
            Ok(())
        };
        pipeline.run(
            &self.program,
            micro_batches,
            self.config.batch.sequence_length,
            normalisers,
            &mut on_event,
        )
    }

    /// The fp32 main gradients, each segment reduced over its holders (the tied
    /// embedding over every copy), with their global norm: every parameter once (the
    /// tied copy on the last stage skipped), from replica 0's ranks (an expert's from the
    /// lowest replica holding it; the distributed
    /// optimizer's from each holder's own shard) and summed over the world, so every
    /// replica clips by the very same factor (replicas of different pipelines would sum
    /// their squares in different orders).
    fn reduced_gradients(&mut self) -> Result<(BTreeMap<String, Tensor>, f64), TrainError> {
        let grads = self.grads.grads();
        let skip_tied = self.holds_tied_copy();
        let stage = &self.chunks[0];
        // The distributed optimizer's parameters: each holder's own shard.
        let (sharded, from_shards) = match &self.zero {
            Some(zero) => (
                zero.names(),
                zero.grad_norm_squared(|n| stage.holds_unique(n)),
            ),
            None => Default::default(),
        };
        // Each tensor's squares summed in fp64 on its device, all of them read back in
        // one transfer: one synchronisation per step, not one per parameter.
        let squares: Vec<Tensor> = match self.context_first() {
            true => grads
                .iter()
                .filter(|(n, _)| self.counts_once(n))
                .filter(|(n, _)| !(skip_tied && n.as_str() == EMBEDDING))
                .filter(|(n, _)| !sharded.contains(n.as_str()))
                .filter(|(n, _)| stage.holds_unique(n))
                .map(|(_, g)| g.square().sum(Kind::Double))
                .collect(),
            false => Vec::new(),
        };
        let replicated = match squares.is_empty() {
            true => 0.0,
            false => Vec::<f64>::try_from(Tensor::stack(&squares, 0).to_device(Device::Cpu))
                .map_or(f64::NAN, |v| v.iter().sum()),
        };
        let local = from_shards + replicated;
        let mut norm_sq = Tensor::from_slice(&[local]);
        if self.world.size() > 1 {
            self.world.all_reduce_sum(&mut norm_sq)?;
        }
        Ok((grads, norm_sq.double_value(&[0]).sqrt()))
    }
}
