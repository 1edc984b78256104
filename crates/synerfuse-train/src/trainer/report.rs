//! What a step reports: every rank's loss and times gathered in one all-gather, and rank
//! 0's log line, JSON record and TensorBoard scalars.

use super::evaluation::{EvalSplit, Evaluation};
use super::save_record::SaveRecord;
use super::TrainConfig;
use crate::comm::{CrossedBytes, MpiCommunicator};
use crate::expert_load::ExpertStep;
use crate::memory::MemoryReport;
use crate::metrics::{IterationRecord, JsonLog, RankTimes, TensorBoardWriter};
use crate::pipeline::StepTimes;
use crate::replan::{ReplanDecision, SpeedShift, SwitchOutcome};
use crate::TrainError;
use std::time::Duration;
use synerfuse_model::tch::Tensor;
use synerfuse_plan::timeline::{Span, SpanKind};

/// What one rank's step produced.
#[derive(Debug, Clone)]
pub(super) struct StepResult {
    /// Σ token loss on this rank (0 off the last stage).
    pub loss_sum: f64,
    /// Loss tokens of the whole global batch.
    pub loss_tokens: f64,
    /// This rank's MoE layers' load balance ([`crate::expert_load::ExpertLoad::row`]).
    pub experts: Vec<f64>,
    /// Sequences of the whole global batch.
    pub sequences: f64,
    /// The rate the step used.
    pub lr: f64,
    /// Global gradient norm before clipping (unscaled; not finite on an overflow).
    pub grad_norm: f64,
    /// The loss scale after the step's update (1 unless the loss is scaled).
    pub loss_scale: f64,
    /// Whether the step's gradients overflowed, so that it made no update.
    pub skipped: bool,
    /// Where this rank's time went.
    pub times: StepTimes,
    /// This rank's memory.
    pub memory: MemoryReport,
    /// What it did when, from the step's start.
    pub spans: Vec<Span>,
}

/// One rank's row of the step's all-gather.
#[derive(Debug, Clone, Copy)]
struct RankRow {
    loss_sum: f64,
    compute_ms: f64,
    communication_ms: f64,
    elapsed_ms: f64,
    stop: bool,
    replica_tokens: f64,
    state_bytes: f64,
    /// Negative when not measured.
    activation_peak_bytes: f64,
    /// Forward and backward time (what waiting does not inflate).
    pace_ms: f64,
    reduce_wait_ms: f64,
    param_gather_wait_ms: f64,
    /// Bytes it sent over emulated links (negative where none are emulated).
    crossed: CrossedBytes,
}

/// The fields of a [`RankRow`] before the rank's expert load.
const ROW_FIELDS: usize = 14;

/// The step as every rank saw it.
#[derive(Debug, Clone)]
pub(super) struct StepOutcome {
    /// Mean token loss over the global batch.
    pub loss: f64,
    /// The rate the step used.
    pub lr: f64,
    /// Global gradient norm.
    pub grad_norm: f64,
    /// The loss scale after the step's update.
    pub loss_scale: f64,
    /// Whether the step overflowed and made no update.
    pub skipped: bool,
    /// The slowest rank's step time, ms.
    pub step_ms: f64,
    /// Some rank received a stop signal.
    pub any_stop: bool,
    /// Every rank's expert load summed, and the step's sequences.
    experts: (Vec<f64>, f64),
    rows: Vec<RankRow>,
    /// Every rank's spans, when gathered.
    spans: Option<Vec<Vec<Span>>>,
}

impl StepOutcome {
    /// All-gathers each rank's loss, times, bytes over emulated links and stop flag
    /// (one small collective per step), and with `with_spans` every rank's spans (two
    /// more).
    pub fn gather(
        world: &MpiCommunicator,
        step: StepResult,
        (elapsed, crossed): (Duration, Option<CrossedBytes>),
        stop: bool,
        replica_tokens: usize,
        with_spans: bool,
    ) -> Result<Self, TrainError> {
        let spans = match with_spans {
            true => Some(gather_spans(world, &step.spans)?),
            false => None,
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let pace_s = step.times.passes.as_secs_f64();
        let mut mine = vec![
            step.loss_sum,
            ms(step.times.compute),
            ms(step.times.communication),
            ms(step.times.waiting),
            ms(elapsed),
            f64::from(u8::from(stop)),
            replica_tokens as f64,
            step.memory.state() as f64,
            step.memory.activations_peak.map_or(-1.0, |b| b as f64),
            pace_s * 1e3,
            ms(step.times.reduce_wait),
            ms(step.times.param_gather_wait),
            crossed.map_or(-1.0, |c| c.across_nodes),
            crossed.map_or(-1.0, |c| c.across_sites),
        ];
        mine.extend(&step.experts);
        let all = world.all_gather(&Tensor::from_slice(&mine))?;
        let all: Vec<Vec<f64>> = (0..world.size())
            .map(|r| Vec::<f64>::try_from(all.get(r as i64)).unwrap_or_default())
            .collect();
        let mut experts = vec![0.0; step.experts.len()];
        for v in &all {
            for (sum, x) in experts.iter_mut().zip(v.iter().skip(ROW_FIELDS)) {
                *sum += x;
            }
        }
        let rows: Vec<RankRow> = (all.iter())
            .map(|v| {
                let at = |i: usize| v.get(i).copied().unwrap_or_default();
                RankRow {
                    loss_sum: at(0),
                    compute_ms: at(1),
                    communication_ms: at(2),
                    elapsed_ms: at(4),
                    stop: at(5) > 0.0,
                    replica_tokens: at(6),
                    state_bytes: at(7),
                    activation_peak_bytes: at(8),
                    pace_ms: at(9),
                    reduce_wait_ms: at(10),
                    param_gather_wait_ms: at(11),
                    crossed: CrossedBytes {
                        across_nodes: at(12),
                        across_sites: at(13),
                    },
                }
            })
            .collect();
        Ok(StepOutcome {
            loss: rows.iter().map(|r| r.loss_sum).sum::<f64>() / step.loss_tokens,
            lr: step.lr,
            grad_norm: step.grad_norm,
            loss_scale: step.loss_scale,
            skipped: step.skipped,
            step_ms: rows.iter().map(|r| r.elapsed_ms).fold(0.0, f64::max),
            any_stop: rows.iter().any(|r| r.stop),
            experts: (experts, step.sequences),
            rows,
            spans,
        })
    }
}

impl StepOutcome {
    /// Every rank's forward and backward seconds, in rank order.
    pub fn pace_s(&self) -> Vec<f64> {
        self.rows.iter().map(|r| r.pace_ms / 1e3).collect()
    }
}

/// Every rank's spans, on every rank: the counts, then the spans padded to the
/// longest, four numbers each (kind, micro-batch or −1, start, end).
fn gather_spans(world: &MpiCommunicator, spans: &[Span]) -> Result<Vec<Vec<Span>>, TrainError> {
    let counts = world.all_gather(&Tensor::from_slice(&[spans.len() as f64]))?;
    let counts = Vec::<f64>::try_from(counts.flatten(0, -1)).unwrap_or_default();
    let longest = counts.iter().fold(0.0f64, |a, &b| a.max(b)) as usize;
    let mut mine = vec![0.0f64; longest.max(1) * 4];
    for (k, span) in spans.iter().enumerate() {
        let kind = SpanKind::ALL.iter().position(|&x| x == span.kind);
        mine[4 * k..4 * k + 4].copy_from_slice(&[
            kind.unwrap_or_default() as f64,
            span.micro_batch.map_or(-1.0, |m| m as f64),
            span.start_s,
            span.end_s,
        ]);
    }
    let all = world.all_gather(&Tensor::from_slice(&mine))?;
    let all = Vec::<f64>::try_from(all.flatten(0, -1)).unwrap_or_default();
    let per_rank = longest.max(1) * 4;
    Ok((counts.iter().enumerate())
        .map(|(r, &n)| {
            (0..n as usize)
                .filter_map(|k| {
                    let at = r * per_rank + 4 * k;
                    let v = all.get(at..at + 4)?;
                    Some(Span {
                        kind: *SpanKind::ALL.get(v[0] as usize)?,
                        micro_batch: (v[1] >= 0.0).then_some(v[1] as usize),
                        start_s: v[2],
                        end_s: v[3],
                    })
                })
                .collect()
        })
        .collect())
}

/// Rank 0's outputs for each step: the log line, the JSON log, TensorBoard.
pub(super) struct StepLog {
    json: Option<JsonLog>,
    /// `--log-json` was given (rank 0 writes it).
    log_json: bool,
    tensorboard: Option<TensorBoardWriter>,
    log_interval: u64,
    train_iters: u64,
    global_batch: usize,
    tokens_per_step: f64,
    /// Megatron's FLOPs of one training iteration (its `num_floating_point_operations`).
    flops_per_step: f64,
    log_throughput: bool,
    world_size: usize,
    /// The model (its MoE layers name the expert load's rows).
    model: synerfuse_model::LlamaConfig,
    moe_per_layer_logging: bool,
    /// Iterations skipped for an overflow, and with a loss that is not finite, since the
    /// last log line.
    skipped_in_interval: u64,
    nan_in_interval: u64,
}

fn io_error(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl StepLog {
    /// Opens rank 0's log files (other ranks write nothing).
    pub fn open(config: &TrainConfig, rank: usize, world_size: usize) -> Result<Self, TrainError> {
        let logging = &config.logging;
        let json = match (&logging.log_json, rank) {
            (Some(path), 0) => Some(JsonLog::open(path).map_err(io_error(path))?),
            _ => None,
        };
        let tensorboard = match (&logging.tensorboard_dir, rank) {
            (Some(dir), 0) => Some(TensorBoardWriter::create(dir).map_err(io_error(dir))?),
            _ => None,
        };
        let global_batch = config.parallel.plan.global_batch_size();
        let sequence_length = config.batch.sequence_length;
        let model = &config.model;
        Ok(StepLog {
            json,
            log_json: logging.log_json.is_some(),
            tensorboard,
            log_interval: logging.log_interval.max(1),
            train_iters: config.batch.train_iters,
            global_batch,
            tokens_per_step: (global_batch * sequence_length) as f64,
            flops_per_step: crate::profiler::model_shape(model, sequence_length)
                .megatron_flops_per_sample(model.head_dim)
                * global_batch as f64,
            log_throughput: logging.log_throughput,
            world_size,
            model: model.clone(),
            moe_per_layer_logging: logging.moe_per_layer_logging,
            skipped_in_interval: 0,
            nan_in_interval: 0,
        })
    }

    /// Whether the JSON record of `iteration` carries every rank's spans (`synerfuse
    /// timeline` draws them): with `--log-json`, on the iterations the log line is
    /// printed. The same answer on every rank (the spans are gathered collectively).
    pub fn keeps_spans(&self, iteration: u64) -> bool {
        self.log_json && (iteration % self.log_interval == 0 || iteration == self.train_iters)
    }

    /// Logs the step that ended at `iteration` (on rank 0; a no-op elsewhere).
    pub fn record(
        &mut self,
        rank: usize,
        iteration: u64,
        consumed_samples: u64,
        outcome: &StepOutcome,
    ) -> Result<(), TrainError> {
        if rank != 0 {
            return Ok(());
        }
        let seconds = outcome.step_ms / 1e3;
        let mut record = IterationRecord {
            iteration,
            train_iters: self.train_iters,
            consumed_samples,
            lr: outcome.lr,
            loss: outcome.loss,
            grad_norm: outcome.grad_norm,
            loss_scale: outcome.loss_scale,
            skipped: outcome.skipped,
            skipped_iterations: 0,
            nan_iterations: 0,
            elapsed_ms: outcome.step_ms,
            tokens_per_s: self.tokens_per_step / seconds,
            tflops_per_device: self.flops_per_step / seconds / self.world_size as f64 / 1e12,
            global_batch_size: self.global_batch,
            moe: ExpertStep::from_sums(&self.model, &outcome.experts.0, outcome.experts.1),
            ranks: outcome
                .rows
                .iter()
                .map(|r| RankTimes {
                    compute_ms: r.compute_ms,
                    communication_ms: r.communication_ms,
                    reduce_wait_ms: r.reduce_wait_ms,
                    param_gather_wait_ms: r.param_gather_wait_ms,
                    idle_ms: (r.elapsed_ms - r.compute_ms - r.communication_ms).max(0.0),
                    tokens_per_s: r.replica_tokens / seconds,
                    state_bytes: r.state_bytes as u64,
                    activation_peak_bytes: (r.activation_peak_bytes >= 0.0)
                        .then_some(r.activation_peak_bytes as u64),
                    spans: None,
                    bytes_across_nodes: (r.crossed.across_nodes >= 0.0)
                        .then_some(r.crossed.across_nodes as u64),
                    bytes_across_sites: (r.crossed.across_sites >= 0.0)
                        .then_some(r.crossed.across_sites as u64),
                })
                .collect(),
        };
        if let Some(spans) = &outcome.spans {
            for (row, spans) in record.ranks.iter_mut().zip(spans) {
                row.spans = Some(spans.clone());
            }
        }
        // Megatron's counts over the iterations since the last log line.
        self.skipped_in_interval += u64::from(outcome.skipped);
        self.nan_in_interval += u64::from(!outcome.loss.is_finite());
        record.skipped_iterations = self.skipped_in_interval;
        record.nan_iterations = self.nan_in_interval;
        if iteration % self.log_interval == 0 || iteration == self.train_iters {
            println!("{}", record.log_line(self.log_throughput));
            (self.skipped_in_interval, self.nan_in_interval) = (0, 0);
        }
        if let Some(json) = &mut self.json {
            json.write(&record).map_err(io_error(json.path()))?;
        }
        if let Some(tb) = &mut self.tensorboard {
            let mut scalars = vec![
                ("lm-loss", outcome.loss),
                ("learning-rate", outcome.lr),
                ("loss-scale", outcome.loss_scale),
                ("iteration-time", seconds),
                ("tokens-per-second", record.tokens_per_s),
            ];
            if !outcome.skipped {
                scalars.push(("grad-norm", outcome.grad_norm));
            }
            if self.log_throughput {
                scalars.push(("throughput", record.tflops_per_device));
            }
            tb.scalars(iteration, &scalars)
                .map_err(io_error(tb.path()))?;
            if let Some(moe) = &record.moe {
                let scalars = moe.scalars(self.moe_per_layer_logging);
                let named: Vec<(&str, f64)> =
                    scalars.iter().map(|(n, v)| (n.as_str(), *v)).collect();
                tb.scalars(iteration, &named).map_err(io_error(tb.path()))?;
            }
        }
        Ok(())
    }

    /// Logs an evaluation (on rank 0; a no-op elsewhere): Megatron's lines, a JSON
    /// record, and with `tensorboard` its scalars (`lm loss validation` and its `ppl`,
    /// by iteration and `vs samples`; `lm loss test` for the test split).
    pub fn record_evaluation(
        &mut self,
        rank: usize,
        evaluation: &Evaluation,
        consumed_samples: u64,
        tensorboard: bool,
    ) -> Result<(), TrainError> {
        if rank != 0 {
            return Ok(());
        }
        println!("{}", evaluation.log_lines());
        if let Some(json) = &mut self.json {
            let record = EvaluationRecord {
                evaluation: evaluation.split,
                iteration: evaluation.iteration,
                at_end: evaluation.at_end,
                consumed_samples,
                samples: evaluation.samples,
                lm_loss: evaluation.loss,
                lm_loss_ppl: evaluation.ppl(),
            };
            json.write(&record).map_err(io_error(json.path()))?;
        }
        if let Some(tb) = self.tensorboard.as_mut().filter(|_| tensorboard) {
            let tag = match evaluation.split {
                EvalSplit::Validation => "lm loss validation",
                EvalSplit::Test => "lm loss test",
            };
            let (loss, ppl) = (evaluation.loss, evaluation.ppl());
            let (ppl_tag, vs, ppl_vs) = (
                format!("{tag} ppl"),
                format!("{tag} vs samples"),
                format!("{tag} ppl vs samples"),
            );
            let by_iteration = [(tag, loss), (ppl_tag.as_str(), ppl)];
            tb.scalars(evaluation.iteration, &by_iteration)
                .map_err(io_error(tb.path()))?;
            let by_samples = [(vs.as_str(), loss), (ppl_vs.as_str(), ppl)];
            tb.scalars(consumed_samples, &by_samples)
                .map_err(io_error(tb.path()))?;
        }
        Ok(())
    }
}

impl StepLog {
    /// Logs each rank whose pace changed for good (on rank 0; a no-op elsewhere): a
    /// warning, a JSON record, a TensorBoard scalar per rank (`relative speed rank R`).
    pub fn record_speed_shifts(
        &mut self,
        rank: usize,
        iteration: u64,
        shifts: &[SpeedShift],
    ) -> Result<(), TrainError> {
        if rank != 0 {
            return Ok(());
        }
        for shift in shifts {
            tracing::warn!(
                "rank {}: {:.4} s of forward and backward per step over the last steps against the {:.4} s assumed: {:.2}x the speed the plan assumed (iteration {iteration})",
                shift.rank,
                shift.measured_s,
                shift.assumed_s,
                shift.relative_speed()
            );
            if let Some(json) = &mut self.json {
                let record = SpeedShiftRecord {
                    speed_shift: SpeedShiftFields {
                        iteration,
                        rank: shift.rank,
                        assumed_s: shift.assumed_s,
                        measured_s: shift.measured_s,
                        relative_speed: shift.relative_speed(),
                    },
                };
                json.write(&record).map_err(io_error(json.path()))?;
            }
            if let Some(tb) = &mut self.tensorboard {
                let tag = format!("relative speed rank {}", shift.rank);
                tb.scalars(iteration, &[(tag.as_str(), shift.relative_speed())])
                    .map_err(io_error(tb.path()))?;
            }
        }
        Ok(())
    }
}

impl StepLog {
    /// Writes what runs as the JSON log's `run` record (rank 0 calls it): the first
    /// record of a run, and again after a switch of plans.
    pub fn record_run(&mut self, run: &synerfuse_plan::RunRecord) -> Result<(), TrainError> {
        if let Some(json) = &mut self.json {
            let record = serde_json::json!({ "run": run });
            json.write(&record).map_err(io_error(json.path()))?;
        }
        Ok(())
    }

    /// Logs a finished checkpoint save (rank 0 writes a `save` record; a no-op
    /// elsewhere).
    pub fn record_save(&mut self, rank: usize, save: &SaveRecord) -> Result<(), TrainError> {
        if let (0, Some(json)) = (rank, &mut self.json) {
            let record = serde_json::json!({ "save": save });
            json.write(&record).map_err(io_error(json.path()))?;
        }
        Ok(())
    }

    /// Logs a re-planning decision (rank 0 calls it): a line, a JSON record
    /// (`replan`), TensorBoard scalars (`replan predicted step s`, `replan gain s`,
    /// `replan switch cost s`, `replan switched`).
    pub fn record_replan(&mut self, decision: &ReplanDecision) -> Result<(), TrainError> {
        let verdict = decision.verdict;
        tracing::info!(
            "re-planning after iteration {} ({}): ranks' forward and backward {:?} s per step (spreads {:?}), speeds {:?} of the fastest; the plan running {} at {:.4} s per step (measured {:.4} s), the best plan at {:.4} s (layers per stage {:?}, micro-batches per replica {:?}); gain over the {} remaining iterations {:.2} s against a switch cost of {:.2} s ({}): {verdict}",
            decision.iteration,
            decision.cause,
            decision.paces_s.iter().map(|p| (p * 1e4).round() / 1e4).collect::<Vec<_>>(),
            decision.pace_spreads.iter().map(|p| (p * 1e3).round() / 1e3).collect::<Vec<_>>(),
            decision.speeds.iter().map(|s| (s * 100.0).round() / 100.0).collect::<Vec<_>>(),
            match decision.current_measured {
                true => "priced by its measured step (its prediction missed)",
                false => "predicted",
            },
            decision.current_step_s,
            decision.measured_step_s,
            decision.proposed_step_s,
            decision.proposed_layers,
            decision.proposed_batches.iter().map(ToString::to_string).collect::<Vec<_>>(),
            decision.remaining_iterations,
            decision.gain_s,
            decision.switch_cost_s,
            decision.cost_basis,
        );
        if let Some(json) = &mut self.json {
            let record = ReplanRecord { replan: decision };
            json.write(&record).map_err(io_error(json.path()))?;
        }
        if let Some(tb) = &mut self.tensorboard {
            let scalars = [
                ("replan predicted step s", decision.proposed_step_s),
                ("replan gain s", decision.gain_s),
                ("replan switch cost s", decision.switch_cost_s),
                ("replan switched", f64::from(u8::from(decision.switched))),
            ];
            tb.scalars(decision.iteration, &scalars)
                .map_err(io_error(tb.path()))?;
        }
        Ok(())
    }

    /// Logs the step measured once a switch settled (on rank 0): a line, a JSON record
    /// (`replan_outcome`), TensorBoard scalars (`replan measured step s`, `replan switch s`).
    pub fn record_switch_outcome(
        &mut self,
        rank: usize,
        outcome: &SwitchOutcome,
    ) -> Result<(), TrainError> {
        if rank != 0 {
            return Ok(());
        }
        tracing::info!(
            "re-planning after iteration {}: measured {:.4} s per step since the switch against {:.4} s before it ({:.2}x; spreads {:.3} and {:.3}) and {:.4} s predicted; the switch took {:.3} s{}",
            outcome.switched_after,
            outcome.after_step_s,
            outcome.before_step_s,
            outcome.before_step_s / outcome.after_step_s.max(1e-12),
            outcome.before_spread,
            outcome.after_spread,
            outcome.predicted_step_s,
            outcome.switch_s,
            match (outcome.lost, outcome.missed) {
                (true, _) => "; it lost (slower than before, beyond the noise): the plan running is priced by its measured step next",
                (false, true) => "; it missed its prediction (beyond the noise and the model's usual error): the plan running is priced by its measured step next",
                (false, false) => "",
            },
        );
        if let Some(json) = &mut self.json {
            let record = SwitchOutcomeRecord {
                replan_outcome: outcome,
            };
            json.write(&record).map_err(io_error(json.path()))?;
        }
        if let Some(tb) = &mut self.tensorboard {
            let scalars = [
                ("replan measured step s", outcome.after_step_s),
                ("replan switch s", outcome.switch_s),
            ];
            tb.scalars(outcome.iteration, &scalars)
                .map_err(io_error(tb.path()))?;
        }
        Ok(())
    }
}

/// A re-planning decision in the JSON log (nested, as below).
#[derive(serde::Serialize)]
struct ReplanRecord<'a> {
    replan: &'a ReplanDecision,
}

/// What a switch measured, in the JSON log.
#[derive(serde::Serialize)]
struct SwitchOutcomeRecord<'a> {
    replan_outcome: &'a SwitchOutcome,
}

/// A sustained change of a rank's pace in the JSON log (nested, so readers of iteration
/// records pass over it).
#[derive(serde::Serialize)]
struct SpeedShiftRecord {
    speed_shift: SpeedShiftFields,
}

#[derive(serde::Serialize)]
struct SpeedShiftFields {
    /// The iteration that made the change sustained.
    iteration: u64,
    rank: usize,
    /// Forward and backward seconds per step assumed before.
    assumed_s: f64,
    /// The median over the last window of steps.
    measured_s: f64,
    /// assumed ÷ measured.
    relative_speed: f64,
}

/// An evaluation's line in the JSON log.
#[derive(serde::Serialize)]
struct EvaluationRecord {
    /// `validation` or `test`.
    evaluation: EvalSplit,
    iteration: u64,
    at_end: bool,
    /// Training samples consumed.
    consumed_samples: u64,
    /// Samples evaluated.
    samples: u64,
    lm_loss: f64,
    lm_loss_ppl: f64,
}
