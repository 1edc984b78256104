//! Evaluation as Megatron runs it: `--eval-iters` global batches of the validation split
//! through a forward-only program every `--eval-interval` iterations (each evaluation
//! continuing where the last stopped), and at the end of training the validation split
//! again and the test split from its start. The loss is the sum over every loss token
//! of those batches divided by their number, so it does not depend on the plan.

use super::evaluation::{EvalSplit, Evaluation};
use super::setup::{context_rank, expert_rank};
use super::state::Trainer;
use crate::pipeline::PipelineRank;
use crate::TrainError;
use synerfuse_model::tch::{Kind, Tensor};

impl Trainer<'_> {
    /// Evaluates `split` from its sample `consumed` on (collective over the world);
    /// `None` when the run has no such split or evaluates nothing. The training loop
    /// logs it.
    pub(super) fn evaluate(
        &mut self,
        split: EvalSplit,
        consumed: u64,
        at_end: bool,
    ) -> Result<Option<Evaluation>, TrainError> {
        self.settle_parameters()?;
        let loader = match split {
            EvalSplit::Validation => self.valid.as_ref(),
            EvalSplit::Test => self.test.as_ref(),
        };
        let Some(loader) = loader else {
            return Ok(None);
        };
        let global_batch = loader.batches().global_batch_size() as u64;
        let iters = self.config.eval.iters;
        if at_end && self.world.rank() == 0 {
            tracing::info!("evaluating on {} samples", iters * global_batch);
        }
        let (mut loss_sum, mut loss_tokens) = (0.0, 0.0);
        for i in 0..iters {
            let micro_batches = loader.step(consumed + i * global_batch)?;
            let (loss, _) = self.forward_only(&micro_batches)?;
            loss_sum += loss.loss_sum;
            loss_tokens += loss.loss_tokens;
        }
        let mut totals = Tensor::from_slice(&[loss_sum, loss_tokens]).to_kind(Kind::Double);
        if self.world.size() > 1 {
            self.world.all_reduce_sum(&mut totals)?;
        }
        let (loss_sum, loss_tokens) = (totals.double_value(&[0]), totals.double_value(&[1]));
        if loss_tokens <= 0.0 {
            return Err(TrainError::NoLossTokens {
                consumed_samples: consumed,
            });
        }
        Ok(Some(Evaluation {
            split,
            iteration: self.iteration,
            at_end,
            loss: loss_sum / loss_tokens,
            samples: iters * global_batch,
        }))
    }

    /// This rank's forward-only program over `micro_batches`: its loss sum and tokens (on
    /// a last stage's tensor-parallel rank 0; zero elsewhere).
    fn forward_only(
        &self,
        micro_batches: &[crate::loader::MicroBatch],
    ) -> Result<(crate::pipeline::StepLoss, crate::pipeline::StepTimes), TrainError> {
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
            step_start: std::time::Instant::now(),
            report_final_grads: false,
            param_gathers: None,
        };
        let sequence_length = self.config.batch.sequence_length;
        pipeline.evaluate(&self.eval_program, micro_batches, sequence_length)
    }
}
