//! Megatron's main gradients: one persistent fp32 buffer per stage chunk, reused every
//! step, each parameter's gradient a view into it, laid out so each of the rank's
//! gradient reductions (the plan's segments it holds, and the tied embedding) is one
//! contiguous slice.
//!
//! Under `--bf16` the micro-batch gradients libtorch produces in bf16 are added into the
//! fp32 buffer after every backward, so a step's sum over many micro-batches is not
//! rounded to bf16 at each addition; in fp32 they accumulate in the parameters and are
//! moved into the buffer once. A reduction starts as soon as its chunk has run its last
//! backward of the step and every reduction before it in the plan's global order has
//! started (non-blocking MPI, or NCCL on its own stream), and overlaps the rest of the
//! pipeline; the optimizer reads the reduced buffer.

use crate::comm::{CommError, GroupCommunicator, PendingReduction, SetGroups};
use std::collections::BTreeMap;
use std::ops::Range;
use synerfuse_model::tch::{self, Kind, Tensor};
use synerfuse_model::Stage;
use synerfuse_plan::{GradientReduction, Instruction, Pass};

pub use crate::error::UnreducedParameter;
pub use synerfuse_plan::{parameter_piece, reduction_of, EMBEDDING};

/// One chunk's buffer and the parameters viewing into it.
struct ChunkGrads {
    buffer: Tensor,
    /// (global name, parameter, fp32 view into `buffer`), grouped by reduction.
    params: Vec<(String, Tensor, Tensor)>,
    /// Where each of `params` starts in `buffer`.
    offsets: Vec<i64>,
    /// Indices into `params` of the gradients each tensor-parallel rank holds partially
    /// (the norms), summed over the group once the chunk's step is complete.
    group_summed: Vec<usize>,
    backwards_left: usize,
}

/// One reduction of this rank: a contiguous range of one chunk's buffer.
struct Reduction {
    members: Vec<usize>,
    chunk: usize,
    elements: Range<i64>,
    /// Whether it sums whole tensors (see `GradientReduction::whole`).
    whole: bool,
    /// Under the distributed optimizer, each member's elements (a reduce-scatter leaves
    /// each member the sum of its own only).
    shards: Option<Vec<Range<i64>>>,
    /// For a reduction of whole tensors: where this rank's slices go.
    staging: Option<WholeStaging>,
    pending: Option<PendingReduction>,
}

/// A reduction of whole tensors, whose holders split them differently: this rank adds
/// its slices into zeroed whole tensors laid out alike on every member (by name, see
/// [`Stage::whole_parameters`]), the sum is reduced, and each slice is taken back.
struct WholeStaging {
    buffer: Tensor,
    /// (main gradient view, its slot in `buffer`, whether this rank adds it: a tensor
    /// every rank of a tensor-parallel group holds whole is added by its rank 0 only).
    parts: Vec<(Tensor, Tensor, bool)>,
}

impl WholeStaging {
    /// The layout of `names` (whole shapes, in name order) on `stage`'s device, with the
    /// slots of the gradients this rank holds among `params`.
    fn new(
        stage: &Stage,
        names: &BTreeMap<String, Vec<i64>>,
        params: &[(String, Tensor, Tensor)],
    ) -> Self {
        let numel: i64 = names.values().map(|s| s.iter().product::<i64>()).sum();
        let buffer = Tensor::zeros([numel], (Kind::Float, stage.device()));
        let held: BTreeMap<&str, &Tensor> =
            params.iter().map(|(n, _, v)| (n.as_str(), v)).collect();
        let mut parts = Vec::new();
        let mut offset = 0;
        for (name, shape) in names {
            let n: i64 = shape.iter().product();
            let whole = buffer.narrow(0, offset, n).view(shape.as_slice());
            offset += n;
            let Some(view) = held.get(name.as_str()) else {
                continue;
            };
            let slot = match stage.shard_of(name) {
                Some((dim, r)) => whole.narrow(dim as i64, r.start, r.end - r.start),
                None => whole,
            };
            parts.push((view.shallow_clone(), slot, stage.holds_unique(name)));
        }
        WholeStaging { buffer, parts }
    }

    /// Zeroes the whole tensors and adds this rank's slices.
    fn fill(&mut self) {
        let _ = self.buffer.zero_();
        for (view, slot, adds) in &mut self.parts {
            if *adds {
                slot.copy_(view);
            }
        }
    }

    /// Takes this rank's slices of the reduced whole tensors back.
    fn take_back(&mut self) {
        for (view, slot, _) in &mut self.parts {
            view.copy_(slot);
        }
    }
}

/// The fp32 main gradients of a rank's stage chunks, and their reductions.
pub struct MainGrads {
    chunks: Vec<ChunkGrads>,
    /// This rank's reductions, in the plan's global order.
    reductions: Vec<Reduction>,
    /// Reductions started this step (a prefix of `reductions`).
    started: usize,
    every_micro_batch: bool,
    /// The tensor-parallel group's members, in tensor-parallel order (empty without
    /// tensor parallelism).
    tp_group: Vec<usize>,
}

/// One of a rank's gradient reductions as the distributed optimizer sees it.
pub struct ReductionLayout {
    /// The ranks that reduce it, ascending.
    pub members: Vec<usize>,
    /// Each member's shard of its elements, when the distributed optimizer shards it
    /// ([`MainGrads::sharded`]); only this rank's shard of `grads` is then summed.
    pub shards: Option<Vec<Range<i64>>>,
    /// Its fp32 main gradients, contiguous (summed once the step's reductions finish).
    pub grads: Tensor,
    /// Its parameters in buffer order: (global name, parameter, offset in `grads`,
    /// elements).
    pub params: Vec<(String, Tensor, i64, i64)>,
}

impl MainGrads {
    /// Buffers for `chunks` (one per virtual chunk, holding `chunk_pieces`) on their
    /// device, each laid out so every one of `reductions` (this rank's, in the plan's
    /// global order) is one contiguous range. With `every_micro_batch` (bf16 training)
    /// gradients move into fp32 after each backward.
    pub fn new(
        chunks: &[Stage],
        chunk_pieces: &[Range<usize>],
        num_layers: usize,
        reductions: &[GradientReduction],
        every_micro_batch: bool,
    ) -> Result<Self, UnreducedParameter> {
        let mut spans: Vec<Option<(usize, Range<i64>)>> = vec![None; reductions.len()];
        let mut grads = Vec::with_capacity(chunks.len());
        for (chunk, (stage, pieces)) in chunks.iter().zip(chunk_pieces).enumerate() {
            let mut named = Vec::new();
            for (name, param) in stage.var_store().variables() {
                let index =
                    reduction_of(&name, pieces, num_layers, reductions).ok_or_else(|| {
                        UnreducedParameter {
                            name: name.clone(),
                            chunk,
                        }
                    })?;
                named.push((index, name, param));
            }
            grads.push(ChunkGrads::laid_out(
                chunk,
                stage.device(),
                named,
                &mut spans,
            ));
        }
        let reductions = (reductions.iter().enumerate().zip(spans))
            .filter_map(|((index, r), span)| {
                let (chunk, elements) = span?;
                let staging = r.whole.then(|| {
                    let (stage, pieces) = (&chunks[chunk], &chunk_pieces[chunk]);
                    let mut names = stage.whole_parameters();
                    names.retain(|name, _| {
                        reduction_of(name, pieces, num_layers, reductions) == Some(index)
                    });
                    WholeStaging::new(stage, &names, &grads[chunk].params)
                });
                Some(Reduction {
                    members: r.members.clone(),
                    chunk,
                    elements,
                    whole: r.whole,
                    shards: None,
                    staging,
                    pending: None,
                })
            })
            .collect();
        Ok(MainGrads {
            chunks: grads,
            reductions,
            started: 0,
            every_micro_batch,
            tp_group: Vec::new(),
        })
    }

    /// Sums, over the tensor-parallel group `members`, the gradients the `chunks`' shards
    /// hold partially ([`Stage::grad_summed_over_group`]) as each chunk completes its
    /// step, before its reductions over the replicas start.
    pub fn summing_over(mut self, members: Vec<usize>, chunks: &[Stage]) -> Self {
        if members.len() < 2 {
            return self;
        }
        for (grads, stage) in self.chunks.iter_mut().zip(chunks) {
            grads.group_summed = (grads.params.iter().enumerate())
                .filter(|(_, (name, _, _))| stage.grad_summed_over_group(name))
                .map(|(i, _)| i)
                .collect();
        }
        self.tp_group = members;
        self
    }

    /// For the distributed optimizer: splits every reduction over two or more ranks (not
    /// of whole tensors) into its members' shards by `shares` (each member's, in member
    /// order); those reductions then reduce-scatter, each member getting the sum of its
    /// own shard only.
    pub fn sharded(mut self, shares: impl Fn(&[usize]) -> Vec<u32>) -> Self {
        for r in self.reductions.iter_mut() {
            if r.members.len() > 1 && !r.whole {
                let elements = (r.elements.end - r.elements.start) as usize;
                let shards = synerfuse_plan::tp::split_units(&shares(&r.members), elements);
                let shards = shards.into_iter().map(|s| s.start as i64..s.end as i64);
                r.shards = Some(shards.collect());
            }
        }
        self
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
        self.started = 0;
    }

    /// Called after each backward of `chunk`: moves gradients into the fp32 buffer when
    /// due, and when `overlap`, starts the reductions that are next in the global order
    /// and whose chunk has run its last backward of the step.
    pub fn after_backward(
        &mut self,
        chunk: usize,
        groups: &SetGroups,
        overlap: bool,
    ) -> Result<(), CommError> {
        let every = self.every_micro_batch;
        let c = &mut self.chunks[chunk];
        c.backwards_left = c.backwards_left.saturating_sub(1);
        if every || c.backwards_left == 0 {
            c.accumulate();
        }
        if c.backwards_left == 0 {
            c.sum_over_group(groups.get(&self.tp_group))?;
        }
        if overlap {
            self.start_ready(groups)?;
        }
        Ok(())
    }

    /// Starts reductions in the global order while their chunk is complete: each rank
    /// issues its reductions in the same relative order, so none waits on another.
    fn start_ready(&mut self, groups: &SetGroups) -> Result<(), CommError> {
        while let Some(reduction) = self.reductions.get_mut(self.started) {
            let chunk = &self.chunks[reduction.chunk];
            if chunk.backwards_left > 0 {
                break;
            }
            if let Some(group) = groups.get(&reduction.members) {
                let span = &reduction.elements;
                let slice = chunk.buffer.narrow(0, span.start, span.end - span.start);
                reduction.pending = Some(match (&mut reduction.staging, &reduction.shards) {
                    (Some(staging), _) => {
                        staging.fill();
                        group.start_all_reduce_sum(&staging.buffer)?
                    }
                    (None, Some(shards)) => {
                        let counts: Vec<usize> =
                            shards.iter().map(|s| (s.end - s.start) as usize).collect();
                        group.start_reduce_scatter_sum(&slice, &counts)?
                    }
                    (None, None) => group.start_all_reduce_sum(&slice)?,
                });
            }
            self.started += 1;
        }
        Ok(())
    }

    /// Lets reductions in flight progress (MPI moves only inside MPI calls).
    pub fn progress(&mut self) {
        for reduction in &mut self.reductions[..self.started] {
            if let Some(pending) = &mut reduction.pending {
                pending.progress();
            }
        }
    }

    /// Completes every reduction (starting those not yet started, in the global order)
    /// and waits for them all.
    pub fn finish(&mut self, groups: &SetGroups) -> Result<(), CommError> {
        for chunk in &mut self.chunks {
            if chunk.backwards_left > 0 {
                // A chunk without backwards this step (none in any valid program).
                chunk.backwards_left = 0;
                chunk.accumulate();
                chunk.sum_over_group(groups.get(&self.tp_group))?;
            }
        }
        let mut first_error = self.start_ready(groups).err();
        // Every started reduction is waited for, even after an error: they write into
        // the buffers.
        for reduction in &mut self.reductions {
            if let Some(pending) = reduction.pending.take() {
                match (pending.wait(), &mut reduction.staging) {
                    (Err(e), _) => {
                        first_error.get_or_insert(e);
                    }
                    (Ok(()), Some(staging)) => staging.take_back(),
                    (Ok(()), None) => {}
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// This rank's reductions as the distributed optimizer shards them, in the global
    /// order.
    pub fn layouts(&self) -> Vec<ReductionLayout> {
        self.reductions
            .iter()
            .map(|r| {
                let chunk = &self.chunks[r.chunk];
                let span = &r.elements;
                let params = (chunk.params.iter().zip(&chunk.offsets))
                    .filter(|(_, start)| span.contains(start))
                    .map(|((name, param, view), start)| {
                        let numel = view.numel() as i64;
                        (
                            name.clone(),
                            param.shallow_clone(),
                            start - span.start,
                            numel,
                        )
                    })
                    .collect();
                ReductionLayout {
                    members: r.members.clone(),
                    shards: r.shards.clone(),
                    grads: chunk.buffer.narrow(0, span.start, span.end - span.start),
                    params,
                }
            })
            .collect()
    }

    /// Bytes of its fp32 buffers (and of the whole-tensor reductions' staging).
    pub fn bytes(&self) -> u64 {
        let buffers = self.chunks.iter().map(|c| &c.buffer);
        let staging = (self.reductions.iter())
            .filter_map(|r| r.staging.as_ref())
            .map(|s| &s.buffer);
        crate::memory::tensor_bytes(buffers.chain(staging))
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
    /// A buffer holding `named` (reduction index, name, parameter) sorted by reduction and
    /// name; records each reduction's (chunk, element range) in `spans`.
    fn laid_out(
        chunk: usize,
        device: tch::Device,
        mut named: Vec<(usize, String, Tensor)>,
        spans: &mut [Option<(usize, Range<i64>)>],
    ) -> Self {
        named.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let numel: i64 = named.iter().map(|(_, _, p)| p.numel() as i64).sum();
        let buffer = Tensor::zeros([numel], (Kind::Float, device));
        let mut offset = 0;
        let mut params = Vec::with_capacity(named.len());
        let mut offsets = Vec::with_capacity(named.len());
        for (index, name, param) in named {
            let n = param.numel() as i64;
            let span = spans[index].get_or_insert((chunk, offset..offset));
            // Segments are cut at every chunk boundary, so a reduction lies in one
            // chunk, contiguous after sorting.
            debug_assert!(span.0 == chunk && span.1.end == offset);
            span.1.end = offset + n;
            let view = buffer.narrow(0, offset, n).view(param.size().as_slice());
            params.push((name, param, view));
            offsets.push(offset);
            offset += n;
        }
        ChunkGrads {
            buffer,
            params,
            offsets,
            group_summed: Vec::new(),
            backwards_left: 0,
        }
    }

    /// Sums the partially held gradients over the tensor-parallel group (one blocking
    /// collective; every rank of the group completes its chunks in the same order).
    fn sum_over_group(&mut self, group: Option<&GroupCommunicator>) -> Result<(), CommError> {
        let Some(group) = group.filter(|_| !self.group_summed.is_empty()) else {
            return Ok(());
        };
        let mut views: Vec<Tensor> = (self.group_summed.iter())
            .map(|&i| self.params[i].2.shallow_clone())
            .collect();
        synerfuse_model::tp::reduce_flat_in_place(&mut views, |flat| group.all_reduce_sum(flat))
    }

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
            moe: None,
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
        let whole = vec![GradientReduction {
            parameters: synerfuse_plan::ReducedParameters::Pieces(0..3),
            members: vec![0],
            whole: false,
        }];
        let mut main = MainGrads::new(
            std::slice::from_ref(&stage),
            std::slice::from_ref(&(0..3)),
            1,
            &whole,
            every_micro_batch,
        )
        .unwrap();
        let alone = SetGroups::none();
        let program: Vec<Instruction> = (0..MICRO_BATCHES)
            .map(|micro_batch| Instruction::backward(synerfuse_plan::Piece::new(micro_batch, 0)))
            .collect();
        main.begin_step(&program);
        for _ in 0..MICRO_BATCHES {
            backward(&stage, &tokens, MICRO_BATCHES as f64);
            main.after_backward(0, &alone, true).unwrap();
        }
        main.finish(&alone).unwrap();
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
