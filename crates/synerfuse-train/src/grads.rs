//! Megatron's main gradients: one persistent fp32 buffer per stage chunk, reused every
//! step, each parameter's gradient a view into it, laid out so each of the rank's
//! gradient reductions (the plan's segments it holds, and the tied embedding) is one
//! contiguous slice.
//!
//! Under `--bf16` the micro-batch gradients libtorch produces in bf16 are added into the
//! fp32 buffer after every backward, so a step's sum over many micro-batches is not
//! rounded to bf16 at each addition; in fp32 they accumulate in the parameters and are
//! moved into the buffer once. Each reduction goes in buckets (Megatron's
//! `--ddp-bucket-size`): its parameters laid out from the last model piece to the first,
//! the order in which the backward finishes them, and cut into buckets of about the
//! bucket size, the same on every member since they follow from the plan alone. A bucket
//! starts as soon as its chunk's last backward of the step has made its gradients final
//! (inside that backward, which reports piece by piece) and every bucket before it in
//! the plan's global order has started (non-blocking MPI, or NCCL on its own stream); it
//! overlaps the rest of the backward and of the pipeline, and the optimizer waits for the
//! reduced buffer.

use crate::comm::{CommError, GroupCommunicator, PendingReduction, SetGroups};
use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Instant;
use synerfuse_model::tch::{self, Kind, Tensor};
use synerfuse_model::Stage;
use synerfuse_plan::timeline::{Span, SpanKind};
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
    /// The model piece of each of `params` ([`parameter_piece`]).
    pieces: Vec<usize>,
    /// Which of `params` have their step's gradient in `buffer` (during the chunk's last
    /// backward, piece by piece).
    moved: Vec<bool>,
    /// Indices into `params` of the gradients each tensor-parallel rank holds partially
    /// (the norms), summed over the group once final, with whether they have been this
    /// step.
    group_summed: Vec<(usize, bool)>,
    backwards_left: usize,
    /// The first piece whose gradients are final this step (`usize::MAX`: none yet).
    final_from: usize,
    /// What each gradient is multiplied by on its way into the fp32 buffer: 1 / the
    /// loss scale where this rank's replica scales its loss (unscaled before any
    /// reduction, so replicas that scale and replicas that do not sum alike), else 1.
    unscale: f64,
}

/// Part of a reduction that starts on its own: a contiguous range of the chunk's buffer
/// holding whole parameters.
struct Bucket {
    elements: Range<i64>,
    /// The lowest model piece among its parameters: it is ready when that one is final.
    min_piece: usize,
    pending: Option<PendingReduction>,
    /// This step: when it started, and when this rank first saw it complete.
    in_flight: (Option<Instant>, Option<Instant>),
}

/// One reduction of this rank: a contiguous range of one chunk's buffer.
struct Reduction {
    members: Vec<usize>,
    chunk: usize,
    elements: Range<i64>,
    /// Whether it sums whole tensors (see `GradientReduction::whole`).
    whole: bool,
    /// Under the distributed optimizer, each member's elements, from the reduction's
    /// start (a reduce-scatter leaves each member the sum of its own only).
    shards: Option<Vec<Range<i64>>>,
    /// For a reduction of whole tensors: where this rank's slices go.
    staging: Option<WholeStaging>,
    /// Its buckets, in the order they start (one for a reduction of whole tensors).
    buckets: Vec<Bucket>,
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
    /// Every bucket as (reduction, bucket), in the order they start: the reductions' in
    /// the plan's global order.
    order: Vec<(usize, usize)>,
    /// Buckets started this step (a prefix of `order`).
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
    /// The stage chunk that holds it.
    pub chunk: usize,
    /// Its buckets in the order they start (from its last model piece): each one's
    /// elements (offsets in `grads`) and the lowest model piece among its parameters.
    pub buckets: Vec<(Range<i64>, usize)>,
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
                let unreduced = || UnreducedParameter {
                    name: name.clone(),
                    chunk,
                };
                let index =
                    reduction_of(&name, pieces, num_layers, reductions).ok_or_else(unreduced)?;
                let piece = parameter_piece(&name, pieces, num_layers).ok_or_else(unreduced)?;
                named.push(LaidOut {
                    reduction: index,
                    piece,
                    name,
                    param,
                });
            }
            grads.push(ChunkGrads::laid_out(
                chunk,
                stage.device(),
                named,
                &mut spans,
            ));
        }
        let reductions: Vec<Reduction> = (reductions.iter().enumerate().zip(spans))
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
                let bucket = Bucket::of(&grads[chunk], elements.clone());
                Some(Reduction {
                    members: r.members.clone(),
                    chunk,
                    elements,
                    whole: r.whole,
                    shards: None,
                    staging,
                    buckets: Vec::from_iter(bucket),
                })
            })
            .collect();
        Ok(MainGrads {
            chunks: grads,
            order: bucket_order(&reductions),
            reductions,
            started: 0,
            every_micro_batch,
            tp_group: Vec::new(),
        })
    }

    /// Sums, over the tensor-parallel group `members`, the gradients the `chunks`' shards
    /// hold partially ([`Stage::grad_summed_over_group`]) as they become final, before
    /// their reductions over the replicas start.
    pub fn summing_over(mut self, members: Vec<usize>, chunks: &[Stage]) -> Self {
        if members.len() < 2 {
            return self;
        }
        for (grads, stage) in self.chunks.iter_mut().zip(chunks) {
            grads.group_summed = (grads.params.iter().enumerate())
                .filter(|(_, (name, _, _))| stage.grad_summed_over_group(name))
                .map(|(i, _)| (i, false))
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

    /// Cuts every reduction (but those of whole tensors, one bucket each) into buckets
    /// of `bucket_size(members)` elements or a little more (a parameter is never split),
    /// Megatron's way: a bucket closes at the first parameter that brings it to the size.
    pub fn bucketed(mut self, bucket_size: impl Fn(&[usize]) -> usize) -> Self {
        for r in self.reductions.iter_mut().filter(|r| r.staging.is_none()) {
            let size = bucket_size(&r.members).max(1) as i64;
            r.buckets = Bucket::cut(&self.chunks[r.chunk], r.elements.clone(), size);
        }
        self.order = bucket_order(&self.reductions);
        self
    }

    /// Each reduction's buckets, as element counts, in the global order (for the log).
    pub fn bucket_sizes(&self) -> Vec<Vec<i64>> {
        (self.reductions.iter())
            .map(|r| {
                r.buckets
                    .iter()
                    .map(|b| b.elements.end - b.elements.start)
                    .collect()
            })
            .collect()
    }

    /// Sets what this step's gradients are multiplied by on their way into the fp32
    /// buffer (1 / the loss scale where the loss was scaled; see `ChunkGrads::unscale`).
    pub fn set_unscale(&mut self, factor: f64) {
        for chunk in &mut self.chunks {
            chunk.unscale = factor;
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
            chunk.moved.fill(false);
            (chunk.group_summed.iter_mut()).for_each(|(_, summed)| *summed = false);
            chunk.final_from = usize::MAX;
        }
        for bucket in self.reductions.iter_mut().flat_map(|r| &mut r.buckets) {
            bucket.in_flight = (None, None);
        }
        self.started = 0;
    }

    /// Called inside `chunk`'s last backward of the step as the gradients of its pieces
    /// `from_piece..` become final: moves them into the buffer, sums the partial ones over
    /// the tensor-parallel group, and when `overlap`, starts the buckets now ready.
    pub fn grads_final(
        &mut self,
        chunk: usize,
        from_piece: usize,
        groups: &SetGroups,
        overlap: bool,
    ) -> Result<(), CommError> {
        let c = &mut self.chunks[chunk];
        if c.backwards_left != 1 {
            // Not the chunk's last backward: nothing is final yet.
            return Ok(());
        }
        c.finalise_from(from_piece, groups.get(&self.tp_group))?;
        if overlap {
            self.start_ready(groups)?;
        }
        Ok(())
    }

    /// Called after each backward of `chunk`: moves gradients into the fp32 buffer when
    /// due, and when `overlap`, starts the buckets that are next in the global order and
    /// whose gradients are final.
    pub fn after_backward(
        &mut self,
        chunk: usize,
        groups: &SetGroups,
        overlap: bool,
    ) -> Result<(), CommError> {
        let every = self.every_micro_batch;
        let c = &mut self.chunks[chunk];
        if c.backwards_left == 1 {
            c.finalise_from(0, groups.get(&self.tp_group))?;
        } else if every {
            c.accumulate();
        }
        c.backwards_left = c.backwards_left.saturating_sub(1);
        if overlap {
            self.start_ready(groups)?;
        }
        Ok(())
    }

    /// Starts buckets in the global order while their gradients are final: each rank
    /// issues its buckets in the same relative order, so none waits on another.
    fn start_ready(&mut self, groups: &SetGroups) -> Result<(), CommError> {
        while let Some(&(r, b)) = self.order.get(self.started) {
            let reduction = &mut self.reductions[r];
            let chunk = &self.chunks[reduction.chunk];
            if chunk.final_from > reduction.buckets[b].min_piece {
                break;
            }
            if let Some(group) = groups.get(&reduction.members) {
                reduction.start(b, &chunk.buffer, group)?;
            }
            self.started += 1;
        }
        Ok(())
    }

    /// Lets reductions in flight progress (MPI moves only inside MPI calls), noting
    /// when each is seen complete.
    pub fn progress(&mut self) {
        for &(r, b) in &self.order[..self.started] {
            let bucket = &mut self.reductions[r].buckets[b];
            if let Some(pending) = &mut bucket.pending {
                if bucket.in_flight.1.is_none() && pending.progress() {
                    bucket.in_flight.1 = Some(Instant::now());
                }
            }
        }
    }

    /// This step's buckets in flight, from `step_start` (for the timeline).
    pub fn bucket_spans(&self, step_start: Instant) -> Vec<Span> {
        let since = |t: Instant| t.saturating_duration_since(step_start).as_secs_f64();
        (self.reductions.iter().flat_map(|r| &r.buckets))
            .filter_map(|b| match b.in_flight {
                (Some(start), Some(end)) => Some(Span {
                    kind: SpanKind::Bucket,
                    start_s: since(start),
                    end_s: since(end),
                    micro_batch: None,
                }),
                _ => None,
            })
            .collect()
    }

    /// Completes every reduction (starting the buckets not yet started, in the global
    /// order) and waits for them all.
    pub fn finish(&mut self, groups: &SetGroups) -> Result<(), CommError> {
        for chunk in &mut self.chunks {
            if chunk.backwards_left > 0 {
                // A chunk without backwards this step (none in any valid program).
                chunk.backwards_left = 0;
                chunk.finalise_from(0, groups.get(&self.tp_group))?;
            }
        }
        let mut first_error = self.start_ready(groups).err();
        // Every started bucket is waited for, even after an error: they write into the
        // buffers.
        for reduction in &mut self.reductions {
            let mut complete = true;
            for bucket in &mut reduction.buckets {
                if let Some(Err(e)) = bucket.pending.take().map(PendingReduction::wait) {
                    first_error.get_or_insert(e);
                    complete = false;
                }
                bucket.in_flight.1.get_or_insert_with(Instant::now);
            }
            if let (true, Some(staging)) = (complete, &mut reduction.staging) {
                staging.take_back();
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
                let buckets = (r.buckets.iter())
                    .map(|b| {
                        let elements = b.elements.start - span.start..b.elements.end - span.start;
                        (elements, b.min_piece)
                    })
                    .collect();
                ReductionLayout {
                    members: r.members.clone(),
                    shards: r.shards.clone(),
                    grads: chunk.buffer.narrow(0, span.start, span.end - span.start),
                    params,
                    chunk: r.chunk,
                    buckets,
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

/// A parameter as the buffer lays it out.
struct LaidOut {
    reduction: usize,
    piece: usize,
    name: String,
    param: Tensor,
}

impl ChunkGrads {
    /// A buffer holding `named` sorted by reduction, then from the last model piece to
    /// the first (the order in which the backward finishes them), then by name; records
    /// each reduction's (chunk, element range) in `spans`.
    fn laid_out(
        chunk: usize,
        device: tch::Device,
        mut named: Vec<LaidOut>,
        spans: &mut [Option<(usize, Range<i64>)>],
    ) -> Self {
        named.sort_by(|a, b| {
            (a.reduction, std::cmp::Reverse(a.piece), &a.name).cmp(&(
                b.reduction,
                std::cmp::Reverse(b.piece),
                &b.name,
            ))
        });
        let numel: i64 = named.iter().map(|p| p.param.numel() as i64).sum();
        let buffer = Tensor::zeros([numel], (Kind::Float, device));
        let mut offset = 0;
        let (mut params, mut offsets, mut pieces) = (Vec::new(), Vec::new(), Vec::new());
        for LaidOut {
            reduction,
            piece,
            name,
            param,
        } in named
        {
            let n = param.numel() as i64;
            let span = spans[reduction].get_or_insert((chunk, offset..offset));
            // Segments are cut at every chunk boundary, so a reduction lies in one
            // chunk, contiguous after sorting.
            debug_assert!(span.0 == chunk && span.1.end == offset);
            span.1.end = offset + n;
            let view = buffer.narrow(0, offset, n).view(param.size().as_slice());
            params.push((name, param, view));
            offsets.push(offset);
            pieces.push(piece);
            offset += n;
        }
        ChunkGrads {
            buffer,
            moved: vec![false; params.len()],
            params,
            offsets,
            pieces,
            group_summed: Vec::new(),
            backwards_left: 0,
            final_from: usize::MAX,
            unscale: 1.0,
        }
    }

    /// During the chunk's last backward of the step: the gradients of pieces
    /// `from_piece..` are final; moves those not yet moved into the buffer and sums the
    /// partial ones over the tensor-parallel `group`.
    fn finalise_from(
        &mut self,
        from_piece: usize,
        group: Option<&GroupCommunicator>,
    ) -> Result<(), CommError> {
        let now: Vec<usize> = (0..self.params.len())
            .filter(|&i| !self.moved[i] && self.pieces[i] >= from_piece)
            .collect();
        self.accumulate_some(&now);
        for &i in &now {
            self.moved[i] = true;
        }
        self.final_from = self.final_from.min(from_piece);
        self.sum_over_group(group, from_piece)
    }

    /// Sums the partially held gradients of pieces `from_piece..` not yet summed over the
    /// tensor-parallel group (one blocking collective; every rank of the group reaches
    /// the same pieces at the same point of its backward).
    fn sum_over_group(
        &mut self,
        group: Option<&GroupCommunicator>,
        from_piece: usize,
    ) -> Result<(), CommError> {
        let Some(group) = group else {
            return Ok(());
        };
        let pieces = &self.pieces;
        let due: Vec<&mut (usize, bool)> = (self.group_summed.iter_mut())
            .filter(|(i, summed)| !*summed && pieces[*i] >= from_piece)
            .collect();
        if due.is_empty() {
            return Ok(());
        }
        let mut views: Vec<Tensor> = Vec::with_capacity(due.len());
        for entry in due {
            views.push(self.params[entry.0].2.shallow_clone());
            entry.1 = true;
        }
        synerfuse_model::tp::reduce_flat_in_place(&mut views, |flat| group.all_reduce_sum(flat))
    }

    /// Adds each parameter's gradient into its fp32 view and zeroes it.
    fn accumulate(&mut self) {
        let all: Vec<usize> = (0..self.params.len()).collect();
        self.accumulate_some(&all);
    }

    /// [`Self::accumulate`] for the parameters at `indices`.
    fn accumulate_some(&mut self, indices: &[usize]) {
        tch::no_grad(|| {
            for &i in indices {
                let (_, param, view) = &mut self.params[i];
                let mut grad = param.grad();
                if !grad.defined() {
                    continue;
                }
                let _ = match self.unscale == 1.0 {
                    true => view.g_add_(&grad),
                    // In fp32: an fp16 gradient divided in fp16 could underflow.
                    false => view.g_add_(&(grad.to_kind(Kind::Float) * self.unscale)),
                };
                let _ = grad.zero_();
            }
        });
    }
}

impl Bucket {
    /// One bucket of the whole reduction at `elements` of `chunk`'s buffer (none for a
    /// reduction without elements).
    fn of(chunk: &ChunkGrads, elements: Range<i64>) -> Option<Bucket> {
        let min_piece = chunk.pieces_within(&elements).min()?;
        Some(Bucket {
            elements,
            min_piece,
            pending: None,
            in_flight: (None, None),
        })
    }

    /// The reduction at `elements` of `chunk`'s buffer cut into buckets of at least
    /// `size` elements (the last may be smaller), parameters whole, in buffer order.
    fn cut(chunk: &ChunkGrads, elements: Range<i64>, size: i64) -> Vec<Bucket> {
        let mut buckets = Vec::new();
        let mut start = elements.start;
        for (&offset, view) in (chunk.offsets.iter()).zip(chunk.params.iter().map(|p| &p.2)) {
            let end = offset + view.numel() as i64;
            if !elements.contains(&offset) {
                continue;
            }
            if end - start >= size || end == elements.end {
                buckets.extend(Bucket::of(chunk, start..end));
                start = end;
            }
        }
        buckets
    }

    /// Each member's elements of this bucket, given the members' `shards` of the
    /// reduction starting at `reduction_start`.
    fn counts(&self, shards: &[Range<i64>], reduction_start: i64) -> Vec<usize> {
        let (start, end) = (
            self.elements.start - reduction_start,
            self.elements.end - reduction_start,
        );
        (shards.iter())
            .map(|s| (s.end.min(end) - s.start.max(start)).max(0) as usize)
            .collect()
    }
}

impl ChunkGrads {
    /// The pieces of the parameters starting within `elements`.
    fn pieces_within<'a>(&'a self, elements: &'a Range<i64>) -> impl Iterator<Item = usize> + 'a {
        (self.offsets.iter().zip(&self.pieces))
            .filter(|(offset, _)| elements.contains(offset))
            .map(|(_, &piece)| piece)
    }
}

impl Reduction {
    /// Starts bucket `b` of this reduction over `group`, from the chunk's `buffer`.
    fn start(
        &mut self,
        b: usize,
        buffer: &Tensor,
        group: &GroupCommunicator,
    ) -> Result<(), CommError> {
        let bucket = &self.buckets[b];
        let span = &bucket.elements;
        let slice = buffer.narrow(0, span.start, span.end - span.start);
        let pending = match (&mut self.staging, &self.shards) {
            (Some(staging), _) => {
                staging.fill();
                group.start_all_reduce_sum(&staging.buffer)?
            }
            (None, Some(shards)) => {
                let counts = bucket.counts(shards, self.elements.start);
                group.start_reduce_scatter_sum(&slice, &counts)?
            }
            (None, None) => group.start_all_reduce_sum(&slice)?,
        };
        self.buckets[b].pending = Some(pending);
        self.buckets[b].in_flight = (Some(Instant::now()), None);
        Ok(())
    }
}

/// Every bucket of `reductions` as (reduction, bucket), in the order they start.
fn bucket_order(reductions: &[Reduction]) -> Vec<(usize, usize)> {
    (reductions.iter().enumerate())
        .flat_map(|(r, reduction)| (0..reduction.buckets.len()).map(move |b| (r, b)))
        .collect()
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

    /// A two-layer stage's one reduction in buckets of at least 3000 elements: whole
    /// parameters, from the head back to the embedding, each bucket starting once the
    /// backward has reported its lowest piece final, in order.
    #[test]
    fn buckets_follow_the_backward_and_start_as_their_pieces_finish() {
        let mut config = bf16_stage().config().clone();
        config.num_layers = 2;
        let mut stage = Stage::new(&config, 0..2, Device::Cpu).unwrap();
        stage.init_by_name(3);
        let reduction = vec![GradientReduction {
            parameters: synerfuse_plan::ReducedParameters::Pieces(0..4),
            members: vec![0],
            whole: false,
        }];
        let main = MainGrads::new(
            std::slice::from_ref(&stage),
            std::slice::from_ref(&(0..4)),
            2,
            &reduction,
            false,
        );
        let mut main = main.unwrap().bucketed(|_| 3000);
        let total: i64 = (stage.var_store().variables().values())
            .map(|p| p.numel() as i64)
            .sum();
        let sizes = &main.bucket_sizes()[0];
        assert_eq!(sizes.iter().sum::<i64>(), total);
        assert!(sizes.len() > 3, "buckets {sizes:?}");
        assert!(sizes[..sizes.len() - 1].iter().all(|&n| n >= 3000));
        let lowest: Vec<usize> = main.reductions[0]
            .buckets
            .iter()
            .map(|b| b.min_piece)
            .collect();
        assert!(lowest.windows(2).all(|w| w[0] >= w[1]), "pieces {lowest:?}");
        // The head (2080 elements) shares its bucket with the last layer's first weights.
        assert_eq!((lowest[0], lowest[lowest.len() - 1]), (2, 0));
        let program = [Instruction::backward(synerfuse_plan::Piece::new(0, 0))];
        main.begin_step(&program);
        let alone = SetGroups::none();
        for piece in [3, 2, 1, 0] {
            main.grads_final(0, piece, &alone, true).unwrap();
            let ready = lowest.iter().filter(|&&p| p >= piece).count();
            assert_eq!(main.started, ready, "after piece {piece}");
        }
    }

    /// A bucket's elements of each member's shard.
    #[test]
    fn a_bucket_counts_each_members_part_of_it() {
        let bucket = Bucket {
            elements: 145..185,
            min_piece: 0,
            pending: None,
            in_flight: (None, None),
        };
        let shards = [0..30, 30..40, 40..90, 90..100];
        assert_eq!(bucket.counts(&shards, 100), vec![0, 0, 40, 0]);
        let bucket = Bucket {
            elements: 125..195,
            ..bucket
        };
        assert_eq!(bucket.counts(&shards, 100), vec![5, 10, 50, 5]);
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
