//! Megatron's main gradients: one persistent fp32 buffer per stage chunk, reused every
//! step, each parameter's gradient a view into it.
//!
//! Under `--bf16` the micro-batch gradients libtorch produces in bf16 are added into the
//! fp32 buffer after every backward, so a step's sum over many micro-batches is not
//! rounded to bf16 at each addition; in fp32 they accumulate in the parameters and are
//! moved into the buffer once. The data-parallel reduction of a chunk starts as soon as
//! its last backward of the step has ended (non-blocking MPI, or NCCL on its own stream)
//! and overlaps the rest of the pipeline; the optimizer reads the reduced buffer.

use crate::comm::{CommError, GroupCommunicator, PendingReduction};
use std::collections::BTreeMap;
use synerfuse_model::tch::{self, Kind, Tensor};
use synerfuse_model::Stage;
use synerfuse_parallel::{Instruction, Pass};

/// One chunk's buffer and the parameters viewing into it.
struct ChunkGrads {
    buffer: Tensor,
    /// (global name, parameter, fp32 view into `buffer`), sorted by name.
    params: Vec<(String, Tensor, Tensor)>,
    backwards_left: usize,
    pending: Option<PendingReduction>,
}

/// The fp32 main gradients of a rank's stage chunks.
pub struct MainGrads {
    chunks: Vec<ChunkGrads>,
    every_micro_batch: bool,
}

impl MainGrads {
    /// Buffers for `chunks` (one per virtual chunk) on their device. With
    /// `every_micro_batch` (bf16 training) gradients move into fp32 after each backward.
    pub fn new(chunks: &[Stage], every_micro_batch: bool) -> Self {
        let chunks = chunks
            .iter()
            .map(|stage| {
                let named: BTreeMap<String, Tensor> =
                    stage.var_store().variables().into_iter().collect();
                let numel: i64 = named.values().map(|p| p.numel() as i64).sum();
                let buffer = Tensor::zeros([numel], (Kind::Float, stage.device()));
                let mut offset = 0;
                let params = named
                    .into_iter()
                    .map(|(name, param)| {
                        let n = param.numel() as i64;
                        let view = buffer.narrow(0, offset, n).view(param.size().as_slice());
                        offset += n;
                        (name, param, view)
                    })
                    .collect();
                ChunkGrads {
                    buffer,
                    params,
                    backwards_left: 0,
                    pending: None,
                }
            })
            .collect();
        MainGrads {
            chunks,
            every_micro_batch,
        }
    }

    /// Zeroes the buffers and counts each chunk's backwards in this step's `program`.
    pub fn begin_step(&mut self, program: &[Instruction]) {
        for (index, chunk) in self.chunks.iter_mut().enumerate() {
            let _ = chunk.buffer.zero_();
            chunk.backwards_left = program
                .iter()
                .filter(|i| {
                    matches!(i, Instruction::Compute { pass: Pass::Backward, piece } if piece.chunk == index)
                })
                .count();
        }
    }

    /// Called after each backward of `chunk`: moves gradients into the fp32 buffer when
    /// due, and after the chunk's last backward of the step starts its reduction over
    /// `dp` (when `overlap`; otherwise [`Self::finish`] does).
    pub fn after_backward(
        &mut self,
        chunk: usize,
        dp: Option<&GroupCommunicator>,
        overlap: bool,
    ) -> Result<(), CommError> {
        let every = self.every_micro_batch;
        let c = &mut self.chunks[chunk];
        c.backwards_left = c.backwards_left.saturating_sub(1);
        let last = c.backwards_left == 0;
        if every || last {
            c.accumulate();
        }
        if last && overlap {
            if let Some(dp) = dp {
                c.pending = Some(dp.start_all_reduce_sum(&c.buffer)?);
            }
        }
        Ok(())
    }

    /// Lets reductions in flight progress (MPI moves only inside MPI calls).
    pub fn progress(&mut self) {
        for chunk in &mut self.chunks {
            if let Some(pending) = &mut chunk.pending {
                pending.progress();
            }
        }
    }

    /// Completes every chunk's reduction over `dp` (starting those not yet started, in
    /// chunk order, the same on every member) and waits for them all.
    pub fn finish(&mut self, dp: Option<&GroupCommunicator>) -> Result<(), CommError> {
        let mut first_error = None;
        for chunk in &mut self.chunks {
            if chunk.backwards_left > 0 {
                // A chunk without backwards this step (none in any valid program).
                chunk.backwards_left = 0;
                chunk.accumulate();
            }
            if let (None, Some(dp), None) = (&chunk.pending, dp, &first_error) {
                match dp.start_all_reduce_sum(&chunk.buffer) {
                    Ok(pending) => chunk.pending = Some(pending),
                    Err(e) => first_error = Some(e),
                }
            }
        }
        // Every started reduction is waited for, even after an error: they write into
        // the buffers.
        for chunk in &mut self.chunks {
            if let Some(pending) = chunk.pending.take() {
                if let Err(e) = pending.wait() {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Every parameter's fp32 gradient by global name.
    pub fn grads(&self) -> BTreeMap<String, Tensor> {
        self.chunks
            .iter()
            .flat_map(|c| c.params.iter())
            .map(|(name, _, view)| (name.clone(), view.shallow_clone()))
            .collect()
    }
}

impl ChunkGrads {
    /// Adds each parameter's gradient into its fp32 view and zeroes it.
    fn accumulate(&mut self) {
        tch::no_grad(|| {
            for (_, param, view) in &mut self.params {
                let mut grad = param.grad();
                if grad.defined() {
                    let _ = view.g_add_(&grad);
                    let _ = grad.zero_();
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use synerfuse_model::tch::Device;
    use synerfuse_model::{BackwardFrom, LlamaConfig};

    const MICRO_BATCHES: usize = 256;

    fn bf16_stage() -> Stage {
        let config = LlamaConfig {
            vocab_size: 64,
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 1,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            max_position_embeddings: 64,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            init_std: 0.02,
        };
        let mut stage = Stage::new(&config, 0..1, Device::Cpu).unwrap();
        stage.init_by_name(11);
        stage.set_kind(Kind::BFloat16);
        stage
    }

    /// One forward and backward of `tokens` with its loss divided by `divisor`.
    fn backward(stage: &Stage, tokens: &Tensor, divisor: f64) {
        let labels = tokens.roll([-1], [1]);
        let pass = stage.forward_train(tokens, None, None).unwrap();
        let loss = |logits: &Tensor| Stage::loss(logits, &labels, None).0 / divisor;
        stage.backward(pass, BackwardFrom::Loss(&loss)).unwrap();
    }

    /// ‖a − b‖ / ‖b‖ over every parameter.
    fn relative_error(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
        let (mut diff, mut norm) = (0.0, 0.0);
        for (name, reference) in b {
            let d = (&a[name].to_kind(Kind::Double) - reference.to_kind(Kind::Double)).square();
            diff += d.sum(Kind::Double).double_value(&[]);
            norm += reference
                .to_kind(Kind::Double)
                .square()
                .sum(Kind::Double)
                .double_value(&[]);
        }
        (diff / norm).sqrt()
    }

    /// The step gradient of `MICRO_BATCHES` micro-batches that each hold the same sample
    /// (loss / MICRO_BATCHES), against one micro-batch of that sample: the same gradient.
    fn accumulated_error(every_micro_batch: bool) -> f64 {
        let stage = bf16_stage();
        let tokens = Tensor::arange(16, (Kind::Int64, Device::Cpu))
            .remainder(13)
            .view([1, 16]);
        backward(&stage, &tokens, 1.0);
        let reference: BTreeMap<String, Tensor> = stage
            .var_store()
            .variables()
            .into_iter()
            .map(|(n, p)| (n, p.grad().to_kind(Kind::Float)))
            .collect();
        for (_, mut p) in stage.var_store().variables() {
            p.zero_grad();
        }
        let mut main = MainGrads::new(std::slice::from_ref(&stage), every_micro_batch);
        let program: Vec<Instruction> = (0..MICRO_BATCHES)
            .map(|micro_batch| {
                Instruction::backward(synerfuse_parallel::Piece::new(micro_batch, 0))
            })
            .collect();
        main.begin_step(&program);
        for _ in 0..MICRO_BATCHES {
            backward(&stage, &tokens, MICRO_BATCHES as f64);
            main.after_backward(0, None, true).unwrap();
        }
        main.finish(None).unwrap();
        relative_error(&main.grads(), &reference)
    }

    /// Many small micro-batch gradients: summed in bf16 they drift far from the one
    /// micro-batch gradient (bf16 keeps 8 significant bits); summed into fp32 main
    /// gradients they stay within bf16's own rounding of it.
    #[test]
    fn bf16_micro_batch_gradients_accumulate_in_fp32() {
        let fp32 = accumulated_error(true);
        let bf16 = accumulated_error(false);
        eprintln!("relative error: fp32 main gradients {fp32:.2e}, bf16 accumulation {bf16:.2e}");
        assert!(fp32 < 0.02, "fp32 main gradients: relative error {fp32}");
        assert!(
            bf16 > 0.05,
            "accumulating in bf16 should lose precision (relative error {bf16}); the test would not catch it"
        );
    }
}
