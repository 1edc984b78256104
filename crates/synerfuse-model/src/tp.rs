//! Tensor-parallel execution of a sharded [`Stage`]: Megatron's column- and row-parallel
//! layers and vocabulary-parallel embedding and cross-entropy, without custom autograd.
//!
//! tch cannot put a collective inside the autograd graph, so a tensor-parallel forward is
//! cut into *regions* at every collective, each starting from a leaf input: the
//! embedding lookup of this rank's vocabulary rows, each attention and each MLP block
//! (whose row-parallel output is a partial sum), and the output layer. Between regions the
//! forward all-reduces the partial outputs (Megatron's `g`); the backward runs the regions
//! in reverse, feeding each partial output the full output gradient (the backward of an
//! all-reduce is the identity) and all-reducing the gradient of each region's replicated
//! input (Megatron's `f`). The full logits are never gathered: the loss is computed from
//! each rank's vocabulary slice with three small collectives per micro-batch.

use crate::collectives::{collective, OpenGate, PieceGate};
use crate::cp::ContextGroup;
use crate::decoder::DecoderLayer;
use crate::error::StageError;
use crate::llama::Stage;
use crate::moe::{ExpertGroup, LayerBalance};
use crate::norm::rms_norm;
use crate::pass::{Block, FinalGrads, ForwardPass, Region, SavedInputs, VocabParallelLoss};
use tch::{Kind, Tensor};

// The collectives keep their `tp::` paths, which the runtime's crates name.
pub use crate::collectives::{
    all_to_all_by_gather, reduce_flat_in_place, CollectiveError, TpCollectives,
};

/// How a region's partial outputs are combined and its input gradients restored: whole
/// sequences (all-reduce), or sequence rows (sequence parallelism: reduce-scatter
/// forward, all-gather backward).
#[derive(Clone, Copy)]
struct Sequence<'a> {
    tp: &'a dyn TpCollectives,
    parallel: bool,
}

impl Sequence<'_> {
    /// The sum of every member's `partial` `[b, s, h]` (a region's output, or the
    /// gradient of its replicated input): whole, or this member's rows.
    fn combine(&self, partial: &Tensor) -> Result<Tensor, StageError> {
        if !self.parallel {
            return collective("all-reduce", self.tp.all_reduce_sum(partial));
        }
        self.rows_per_member(partial.size()[1])?;
        let by_position = partial.transpose(0, 1).contiguous();
        let mine = collective("reduce-scatter", self.tp.reduce_scatter_sum(&by_position))?;
        Ok(mine.transpose(0, 1))
    }

    /// This member's rows of a whole-sequence `x` `[b, s, ...]` (all of it without
    /// sequence parallelism).
    fn rows(&self, x: &Tensor) -> Result<Tensor, StageError> {
        if !self.parallel {
            return Ok(x.shallow_clone());
        }
        let n = self.rows_per_member(x.size()[1])?;
        Ok(x.narrow(1, self.tp.rank() as i64 * n, n))
    }

    /// Each member's rows of a sequence of `sequence` positions (an even split, as
    /// Megatron's).
    fn rows_per_member(&self, sequence: i64) -> Result<i64, StageError> {
        let size = self.tp.size();
        match sequence % size as i64 {
            0 => Ok(sequence / size as i64),
            _ => Err(StageError::SequenceNotDivisible { sequence, size }),
        }
    }

    /// The whole sequence from every member's rows `[b, s / size, ...]` (itself without
    /// sequence parallelism).
    fn whole(&self, rows: &Tensor) -> Result<Tensor, StageError> {
        if !self.parallel {
            return Ok(rows.shallow_clone());
        }
        let gathered = collective("all-gather", self.tp.all_gather(&rows.contiguous()))?;
        let mut shape = rows.size();
        shape[1] *= self.tp.size() as i64;
        Ok(gathered.transpose(0, 1).reshape(shape.as_slice()))
    }

    /// `x` plus the sum over the group of a block's `partial` output: how a block's
    /// output joins the residual stream (this member's rows under sequence parallelism).
    fn add_combined(&self, x: &Tensor, partial: &Tensor) -> Result<Tensor, StageError> {
        Ok(x + self.combine(&partial.detach())?)
    }
}

/// A context-parallel member's part of a forward: its group, its tokens' indices in the
/// sequence `[s]`, and their positions for RoPE `[b, s]` (by default the indices).
struct Context<'r> {
    group: &'r ContextGroup<'r>,
    indices: Tensor,
    positions: Tensor,
}

impl<'r> Context<'r> {
    /// This member's context in `group` for `input` `[b, s, ...]` at `position_ids`.
    fn of(group: &'r ContextGroup<'r>, input: &Tensor, position_ids: Option<&Tensor>) -> Self {
        let indices = group.local_positions(input.device());
        let b = input.size()[0];
        let positions = position_ids.map_or_else(
            || indices.unsqueeze(0).expand([b, indices.size()[0]], false),
            Tensor::shallow_clone,
        );
        Context {
            group,
            indices,
            positions,
        }
    }
}

/// What every region of a tensor-parallel forward runs with.
struct RegionRun<'r> {
    seq: Sequence<'r>,
    context: Option<Context<'r>>,
    /// The rotary tables (`cos`, `sin`).
    rope: (Tensor, Tensor),
    attention_mask: Option<&'r Tensor>,
    ep: Option<&'r ExpertGroup<'r>>,
    /// Sequences in the micro-batch.
    sequences: i64,
}

/// What every region of a tensor-parallel backward runs with.
struct BackwardRun<'r> {
    seq: Sequence<'r>,
    from: TpBackwardFrom<'r>,
    cp: Option<&'r ContextGroup<'r>>,
    ep: Option<&'r ExpertGroup<'r>>,
    /// The factor of the MoE blocks' router losses ([`ForwardPass::router_loss_weight`]).
    router_weight: f64,
}

/// The gradients a tensor-parallel backward carries from region to region.
struct Grads {
    /// The residual stream's (this rank's rows under sequence parallelism).
    residual: Option<Tensor>,
    /// A sequence-parallel norm's output's, for the norm region below.
    normed: Option<Tensor>,
}

impl Grads {
    /// The backward of a sequence-parallel norm region: its output's gradient through
    /// the norm, added to the residual stream's.
    fn norm_backward(&mut self, input: &Tensor, normed: &Tensor) {
        let g = self.normed.take().expect("a norm's output gradient");
        backward_from(normed, &g);
        self.residual = Some(match self.residual.take() {
            Some(r) => r + input.grad(),
            None => input.grad(),
        });
    }
}

/// The positions of the whole sequence of which `rows` `[b, s / size, h]` are one
/// member's rows: `position_ids` when given (they cover the whole sequence), else
/// `0..s` for each sample.
fn whole_positions(rows: &Tensor, position_ids: Option<&Tensor>, size: usize) -> Tensor {
    match position_ids {
        Some(p) => p.shallow_clone(),
        None => {
            let (b, s) = (rows.size()[0], rows.size()[1] * size as i64);
            Tensor::arange(s, (Kind::Int64, rows.device()))
                .unsqueeze(0)
                .expand([b, s], false)
        }
    }
}

/// Where a tensor-parallel backward starts.
pub enum TpBackwardFrom<'a> {
    /// The gradient of the stage output (hidden states), from the next stage.
    OutputGrad(&'a Tensor),
    /// The last stage's loss: `scale` × Σ per-token cross-entropy where `loss_mask` is 1.
    Loss {
        /// Target ids `[b, s]`.
        labels: &'a Tensor,
        /// 1 where a token counts (all when `None`).
        loss_mask: Option<&'a Tensor>,
        /// The factor of the summed loss (1 / the step's global loss tokens).
        scale: f64,
    },
}

impl Stage {
    /// A training forward of a tensor-parallel shard: the output (hidden states, or this
    /// rank's vocabulary slice of the logits `[b, s, local vocab]` on the last stage) and
    /// the regions its backward runs. Collective over the group: every rank calls it with
    /// the same input (or, under sequence parallelism, its own sequence rows of it; see
    /// [`Stage::set_sequence_rows_io`]). With recomputation only the inputs are kept, and the backward runs the forward
    /// (and its collectives) again.
    pub fn forward_train_tp(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
    ) -> Result<ForwardPass, StageError> {
        self.forward_train_parallel(input, position_ids, attention_mask, tp, None, None)
    }

    /// [`Self::forward_train_tp`] for a member of a context-parallel group `cp` too:
    /// `input` holds this member's tokens (`cp`'s positions of it, in its order), and
    /// `position_ids`, when given, their positions for RoPE (by default their sequence
    /// indices); and of an expert-parallel group `ep`, over which the MoE layers'
    /// experts are spread. Collective over the groups.
    pub fn forward_train_parallel(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
        cp: Option<&ContextGroup<'_>>,
        ep: Option<&ExpertGroup<'_>>,
    ) -> Result<ForwardPass, StageError> {
        let mask = attention_mask;
        self.forward_train_parallel_gated(input, position_ids, mask, tp, (cp, ep), &OpenGate)
    }

    /// [`Stage::forward_train_parallel`], each piece waiting on `gate` first.
    pub(crate) fn forward_train_parallel_gated(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
        (cp, ep): (Option<&ContextGroup<'_>>, Option<&ExpertGroup<'_>>),
        gate: &dyn PieceGate,
    ) -> Result<ForwardPass, StageError> {
        let saved = SavedInputs {
            input: match self.is_first() {
                true => input.shallow_clone(),
                false => input.detach(),
            },
            position_ids: position_ids.map(Tensor::shallow_clone),
            attention_mask: attention_mask.map(Tensor::shallow_clone),
        };
        let run = || self.tp_regions(input, position_ids, attention_mask, tp, (cp, ep), gate);
        let (output, regions, balance) = match self.recomputes() {
            true => {
                let (output, _, balance) = tch::no_grad(run)?;
                (output, Vec::new(), balance)
            }
            false => run()?,
        };
        let mut pass = ForwardPass::new(output, saved, input.size()[0]);
        pass.regions = regions;
        pass.balance = balance.into_iter().map(LayerBalance::detached).collect();
        Ok(pass)
    }

    /// The tensor-parallel forward (each piece waiting on `gate` first): its output, the
    /// regions its backward runs, and its MoE layers' load balance.
    fn tp_regions(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
        (cp, ep): (Option<&ContextGroup<'_>>, Option<&ExpertGroup<'_>>),
        gate: &dyn PieceGate,
    ) -> Result<(Tensor, Vec<Region>, Vec<LayerBalance>), StageError> {
        if ep.is_none() {
            self.check_experts_held()?;
        }
        let seq = Sequence {
            tp,
            parallel: self.sequence_parallel(),
        };
        let context = cp.map(|cp| Context::of(cp, input, position_ids));
        let position_ids = context.as_ref().map(|c| &c.positions).or(position_ids);
        let mut regions = Vec::new();
        if self.is_first() {
            self.await_piece(gate, 0)?;
        }
        let (mut x, rope) = self.parallel_input(input, position_ids, &seq, &mut regions)?;
        let run = RegionRun {
            seq,
            context,
            rope,
            attention_mask,
            ep,
            sequences: input.size()[0],
        };
        let mut balances = Vec::new();
        for (layer, index) in self.decoder_layers().iter().zip(self.layers()) {
            self.await_piece(gate, index + 1)?;
            x = self.attention_region(layer, &x, &run, &mut regions)?;
            x = self.mlp_region(layer, &x, &run, &mut regions, &mut balances)?;
        }
        if self.norm_and_head().is_some() {
            self.await_piece(gate, self.head_piece())?;
        }
        let output = self.parallel_output(x, &run.seq, &mut regions)?;
        Ok((output, regions, balances))
    }

    /// The residual stream entering the first layer (this rank's rows under sequence
    /// parallelism) and the rotary tables: on the first stage the embedding of this
    /// rank's vocabulary rows summed over the group (its region kept), else the input
    /// hidden states.
    fn parallel_input(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        seq: &Sequence<'_>,
        regions: &mut Vec<Region>,
    ) -> Result<(Tensor, (Tensor, Tensor)), StageError> {
        if self.is_first() {
            let partial = self.embed_local(input)?;
            let x = seq.combine(&partial.detach())?;
            let tables = self.rotary(&partial, position_ids);
            regions.push(Region::Embedding { partial });
            return Ok((x, tables));
        }
        let leaf = input.detach().set_requires_grad(true);
        self.check_hidden(&leaf)?;
        Ok(match self.takes_sequence_rows() {
            true => {
                let positions = whole_positions(&leaf, position_ids, seq.tp.size());
                (leaf.detach(), self.rotary(&leaf, Some(&positions)))
            }
            false => (seq.rows(&leaf.detach())?, self.rotary(&leaf, position_ids)),
        })
    }

    /// Layer `layer`'s attention block as a region, under context parallelism over the
    /// keys and values exchanged with the group: the residual stream `x` after it.
    fn attention_region(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        run: &RegionRun<'_>,
        regions: &mut Vec<Region>,
    ) -> Result<Tensor, StageError> {
        let (c, seq, mask) = (self.config(), &run.seq, run.attention_mask);
        let (cos, sin) = (&run.rope.0, &run.rope.1);
        let input = self.region_input(x, seq, regions, |x| layer.block_norm(true, x, c))?;
        let (partial, kv) = match &run.context {
            Some(context) => {
                // Under sequence parallelism the input is already the gathered normed
                // rows (this member's tokens).
                let normed = |x: &Tensor| match seq.parallel {
                    true => x.shallow_clone(),
                    false => layer.block_norm(true, x, c),
                };
                let (k, v) = layer.keys_values(&normed(&input), c, cos, sin);
                let kv = context.group.gather(k, v)?;
                let [k, v] = &kv.whole;
                let partial = layer.attention_over(
                    &normed(&input),
                    c,
                    (cos, sin),
                    (k, v),
                    &context.indices,
                    mask,
                );
                (partial, Some(kv))
            }
            None if seq.parallel => (layer.attention_core(&input, c, cos, sin, mask, None), None),
            None => (layer.attention_out(&input, c, cos, sin, mask, None), None),
        };
        let x = seq.add_combined(x, &partial)?;
        regions.push(Region::Block(Block {
            input,
            partial,
            kv,
            balance: None,
            exchange: None,
        }));
        Ok(x)
    }

    /// Layer `layer`'s MLP block as a region, an MoE layer's tokens exchanged with the
    /// expert-parallel group if any (its load balance appended to `balances`): the
    /// residual stream `x` after it.
    fn mlp_region(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        run: &RegionRun<'_>,
        regions: &mut Vec<Region>,
        balances: &mut Vec<LayerBalance>,
    ) -> Result<Tensor, StageError> {
        let (c, seq) = (self.config(), &run.seq);
        let input = self.region_input(x, seq, regions, |x| layer.block_norm(false, x, c))?;
        // Under sequence parallelism the input is already normed.
        let h = match seq.parallel {
            true => input.shallow_clone(),
            false => layer.block_norm(false, &input, c),
        };
        let (partial, routing, exchange) = match run.ep {
            Some(ep) => layer.mlp_across(&h, ep)?,
            None => {
                let (partial, routing) = layer.mlp_core(&h);
                (partial, routing, None)
            }
        };
        let balance = match routing {
            Some(routing) => {
                let cp = run.context.as_ref().map(|context| context.group);
                let mut balance = self.balances(&[routing], run.sequences, cp)?;
                let objective = self.summed_objectives(&balance);
                balances.append(&mut balance);
                objective
            }
            None => None,
        };
        let x = seq.add_combined(x, &partial)?;
        regions.push(Region::Block(Block {
            input,
            partial,
            kv: None,
            balance,
            exchange,
        }));
        Ok(x)
    }

    /// The stage output from the residual stream `x`: on the last stage this rank's
    /// vocabulary slice of the logits (the final norm and head a region), else the hidden
    /// states (whole, or this rank's rows when they leave as rows).
    fn parallel_output(
        &self,
        x: Tensor,
        seq: &Sequence<'_>,
        regions: &mut Vec<Region>,
    ) -> Result<Tensor, StageError> {
        let Some((norm, head)) = self.norm_and_head() else {
            return match self.gives_sequence_rows() {
                true => Ok(x),
                false => seq.whole(&x),
            };
        };
        let eps = self.config().rms_norm_eps;
        let input = self.region_input(&x, seq, regions, |x| rms_norm(x, norm, eps))?;
        let normed = match seq.parallel {
            true => input.shallow_clone(),
            false => rms_norm(&input, norm, eps),
        };
        let logits = normed.linear::<Tensor>(head, None);
        let output = logits.detach();
        regions.push(Region::Head {
            input,
            logits,
            loss: None,
        });
        Ok(output)
    }

    /// The leaf input of the next parallel region: the residual stream `x` itself, or
    /// under sequence parallelism `norm` of this rank's rows (a [`Region::Norm`] of its
    /// own) gathered into the whole sequence.
    fn region_input(
        &self,
        x: &Tensor,
        seq: &Sequence<'_>,
        regions: &mut Vec<Region>,
        norm: impl FnOnce(&Tensor) -> Tensor,
    ) -> Result<Tensor, StageError> {
        if !seq.parallel {
            return Ok(x.detach().set_requires_grad(true));
        }
        let input = x.detach().set_requires_grad(true);
        let normed = norm(&input);
        let gathered = seq.whole(&normed.detach())?;
        regions.push(Region::Norm { input, normed });
        Ok(gathered.set_requires_grad(true))
    }

    /// Backpropagates a tensor-parallel `pass` region by region; accumulates this shard's
    /// parameter gradients and returns the gradient of the stage input (the whole
    /// sequence, replicated on every rank of the group, or this rank's rows when
    /// [`Stage::gives_input_grad_rows`]; none on the first stage). Under sequence
    /// parallelism `from`'s output gradient is this rank's rows. Collective over the group.
    pub fn backward_tp(
        &self,
        pass: ForwardPass,
        from: TpBackwardFrom<'_>,
        tp: &dyn TpCollectives,
    ) -> Result<Option<Tensor>, StageError> {
        self.backward_parallel(pass, from, tp, None, None)
    }

    /// [`Self::backward_tp`] of a pass of [`Self::forward_train_parallel`], with the
    /// same context-parallel group (the input gradient is this member's tokens') and
    /// expert-parallel group.
    pub fn backward_parallel(
        &self,
        pass: ForwardPass,
        from: TpBackwardFrom<'_>,
        tp: &dyn TpCollectives,
        cp: Option<&ContextGroup<'_>>,
        ep: Option<&ExpertGroup<'_>>,
    ) -> Result<Option<Tensor>, StageError> {
        self.backward_parallel_reporting(pass, from, tp, (cp, ep), &mut |_| {})
    }

    /// [`Self::backward_parallel`], telling `report` as each decoder layer's parameters
    /// (and first the head's) have their gradients of this pass, and last of every piece
    /// (`from_piece` 0). Every rank of the group reports at the same points of its
    /// backward, between the same collectives.
    pub fn backward_parallel_reporting(
        &self,
        pass: ForwardPass,
        from: TpBackwardFrom<'_>,
        tp: &dyn TpCollectives,
        (cp, ep): (Option<&ContextGroup<'_>>, Option<&ExpertGroup<'_>>),
        report: &mut dyn FnMut(FinalGrads),
    ) -> Result<Option<Tensor>, StageError> {
        let seq = Sequence {
            tp,
            parallel: self.sequence_parallel(),
        };
        let router_weight = pass.router_loss_weight(self.config(), tp.size());
        let (mut regions, saved) = pass.into_regions();
        if regions.is_empty() {
            // A recomputed pass: its forward again, with the graph this time.
            let (positions, mask) = (saved.position_ids.as_ref(), saved.attention_mask.as_ref());
            regions = self
                .tp_regions(&saved.input, positions, mask, tp, (cp, ep), &OpenGate)?
                .1;
        }
        let mut grads = self.output_grads(&from, regions.last(), &seq)?;
        let run = BackwardRun {
            seq,
            from,
            cp,
            ep,
            router_weight,
        };
        // Each decoder layer is two blocks (attention, then MLP), each perhaps after a
        // norm region: a layer's gradients are final when the MLP block of the layer
        // before it (or the embedding) is reached.
        let mut blocks_done = 0;
        while let Some(region) = regions.pop() {
            let layers_done = blocks_done / 2;
            if matches!(region, Region::Embedding { .. })
                || (matches!(region, Region::Block(_)) && blocks_done % 2 == 0)
            {
                report(FinalGrads {
                    from_piece: self.layers().end + 1 - layers_done,
                });
            }
            match region {
                Region::Head {
                    input,
                    logits,
                    loss,
                } => self.head_backward(&input, (&logits, loss), &run, &mut grads)?,
                Region::Norm { input, normed } => grads.norm_backward(&input, &normed),
                Region::Block(block) => {
                    blocks_done += 1;
                    self.block_backward(block, &run, &mut grads)?
                }
                Region::Embedding { partial } => {
                    let g = (grads.residual.take()).expect("the embedding's output gradient");
                    backward_from(&partial, &run.seq.whole(&g)?);
                    report(FinalGrads { from_piece: 0 });
                    return Ok(None);
                }
            }
        }
        report(FinalGrads { from_piece: 0 });
        match self.gives_input_grad_rows() {
            true => Ok(grads.residual),
            false => grads.residual.map(|g| run.seq.whole(&g)).transpose(),
        }
    }

    /// The gradients a backward `from` starts with: the output's (this rank's rows under
    /// sequence parallelism), or none from the loss, which needs the head as the `last`
    /// region.
    fn output_grads(
        &self,
        from: &TpBackwardFrom<'_>,
        last: Option<&Region>,
        seq: &Sequence<'_>,
    ) -> Result<Grads, StageError> {
        let residual = match (from, last) {
            (TpBackwardFrom::OutputGrad(g), _) if self.takes_output_grad_rows() => {
                Some(g.shallow_clone())
            }
            (TpBackwardFrom::OutputGrad(g), _) => Some(seq.rows(g)?),
            (TpBackwardFrom::Loss { .. }, Some(Region::Head { .. })) => None,
            _ => return Err(StageError::NotLastStage),
        };
        Ok(Grads {
            residual,
            normed: None,
        })
    }

    /// The backward of the head region from the vocabulary-parallel loss, then its
    /// input's gradient summed over the group.
    /// The loss the forward kept (`attach_parallel_loss`) is not computed again.
    fn head_backward(
        &self,
        input: &Tensor,
        (logits, kept): (&Tensor, Option<VocabParallelLoss>),
        run: &BackwardRun<'_>,
        grads: &mut Grads,
    ) -> Result<(), StageError> {
        let TpBackwardFrom::Loss {
            labels,
            loss_mask,
            scale,
        } = &run.from
        else {
            return Err(StageError::NotLastStage);
        };
        let loss = match kept {
            Some(loss) => loss,
            None => self.vocab_parallel_loss(&logits.detach(), labels, run.seq.tp)?,
        };
        let weight = token_weights(&loss.per_token, *loss_mask, *scale);
        let g = (loss.grad * weight.unsqueeze(-1)).view(logits.size().as_slice());
        backward_from(logits, &g);
        let through = run.seq.combine(&input.grad())?;
        match run.seq.parallel {
            true => grads.normed = Some(through),
            false => grads.residual = Some(through),
        }
        Ok(())
    }

    /// The backward of an attention or MLP block: through its partial output (and an
    /// MoE block's router losses), its expert and key/value exchanges, then its input's
    /// gradient summed over the group (plus the residual's, unless sequence-parallel).
    fn block_backward(
        &self,
        block: Block,
        run: &BackwardRun<'_>,
        grads: &mut Grads,
    ) -> Result<(), StageError> {
        let Block {
            input,
            partial,
            kv,
            balance,
            exchange,
        } = block;
        let (seq, weight) = (&run.seq, run.router_weight);
        let g = grads.residual.as_ref().expect("a block's output gradient");
        let through_output = (&partial * seq.whole(g)?.to_kind(partial.kind())).sum(Kind::Float);
        match balance.filter(|_| weight != 0.0) {
            Some(balance) => (through_output + balance * weight).backward(),
            None => through_output.backward(),
        }
        match (exchange, run.ep) {
            (Some(exchange), Some(ep)) => exchange.backward(ep)?,
            (Some(_), None) => {
                return Err(StageError::ExpertsElsewhere {
                    held: self.shard().experts.clone().unwrap_or_default(),
                })
            }
            (None, _) => {}
        }
        if let (Some(kv), Some(cp)) = (kv, run.cp) {
            cp.backward(kv)?;
        }
        let through = seq.combine(&input.grad())?;
        match seq.parallel {
            true => grads.normed = Some(through),
            false => grads.residual = Some(through + g),
        }
        Ok(())
    }

    /// Sums the norm weights' gradients over the group. A norm sits inside the region
    /// that follows it, so each rank's backward reaches it only through its own heads or
    /// columns and leaves a partial gradient; call this once per step, after the step's
    /// last backward, on every rank of the group (one collective for all norms).
    pub fn all_reduce_norm_grads(&self, tp: &dyn TpCollectives) -> Result<(), StageError> {
        // By name: every rank of the group lays the norms out in the same order.
        let named: std::collections::BTreeMap<String, Tensor> =
            self.var_store().variables().into_iter().collect();
        let mut norms: Vec<Tensor> = named
            .iter()
            .filter(|(name, _)| self.grad_summed_over_group(name))
            .map(|(_, p)| p.grad())
            .filter(Tensor::defined)
            .collect();
        all_reduce_in_place(&mut norms, tp)
    }

    /// The whole tensor of parameter `name` from every rank's `local` slice (its value,
    /// or an optimizer moment of it), on every rank of the group: slices of unequal
    /// shares are padded to the longest for the all-gather, then cut back. A tensor held
    /// whole is returned as is. Collective over the group (every rank, same name).
    pub fn gather_whole(
        &self,
        name: &str,
        local: &Tensor,
        tp: &dyn TpCollectives,
    ) -> Result<Tensor, StageError> {
        let Some((dim, _)) = self.shard_of(name) else {
            return Ok(local.shallow_clone());
        };
        let (dim, own) = (dim as i64, self.local_rows(name, local)?);
        // Each member's (start, length): the group's member order need not be its
        // tensor-parallel order, so the slices are placed by where they start.
        let span = Tensor::from_slice(&[own.start, own.end - own.start]).to_device(local.device());
        let spans: Vec<i64> = Vec::try_from(
            collective("all-gather", tp.all_gather(&span))?
                .reshape([-1])
                .to_device(tch::Device::Cpu),
        )
        .map_err(|e| StageError::Collective {
            op: "all-gather",
            source: Box::new(e),
        })?;
        let mut spans: Vec<(usize, i64, i64)> = spans
            .chunks(2)
            .enumerate()
            .map(|(member, s)| (member, s[0], s[1]))
            .collect();
        spans.sort_by_key(|&(_, start, _)| start);
        let longest = spans.iter().map(|s| s.2).max().unwrap_or(0);
        let mut padded_shape = local.size();
        padded_shape[dim as usize] = longest;
        let padded = Tensor::zeros(padded_shape.as_slice(), (local.kind(), local.device()));
        tch::no_grad(|| padded.narrow(dim, 0, own.end - own.start).copy_(local));
        let gathered = collective("all-gather", tp.all_gather(&padded))?;
        let pieces: Vec<Tensor> = spans
            .iter()
            .map(|&(member, _, n)| gathered.get(member as i64).narrow(dim, 0, n))
            .collect();
        Ok(Tensor::cat(&pieces, dim))
    }
}

impl Stage {
    /// The slice of the whole tensor `name` this shard holds, checked against `local`'s
    /// size along the sharded dimension.
    fn local_rows(&self, name: &str, local: &Tensor) -> Result<std::ops::Range<i64>, StageError> {
        match self.shard_of(name) {
            Some((dim, rows)) if local.size().get(dim) == Some(&(rows.end - rows.start)) => {
                Ok(rows)
            }
            _ => Err(StageError::BadShard {
                shard: self.shard().clone(),
            }),
        }
    }
}

/// Sums `tensors` over the group in one collective and writes the sums back in place.
fn all_reduce_in_place(tensors: &mut [Tensor], tp: &dyn TpCollectives) -> Result<(), StageError> {
    reduce_flat_in_place(tensors, |flat| {
        *flat = collective("all-reduce", tp.all_reduce_sum(flat))?;
        Ok(())
    })
}

impl Stage {
    /// The masked loss of this rank's logits slice `[b, s, local vocab]`: (Σ per-token
    /// loss where `loss_mask` is 1, the number of such tokens), the same on every rank of
    /// the group. Collective over the group.
    pub fn parallel_loss(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        loss_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
    ) -> Result<(f64, f64), StageError> {
        let loss = tch::no_grad(|| self.vocab_parallel_loss(logits, labels, tp))?;
        let (sum, count) = loss.values(loss_mask);
        Ok((sum.double_value(&[]), count.double_value(&[])))
    }

    /// [`Self::parallel_loss`] computed once: (Σ per-token loss, loss tokens) on the device,
    /// not read here, and the loss's gradient kept in `pass` for its backward, which then
    /// does not compute it again (nor its collectives). A pass without its head's region
    /// (a recomputing stage's) keeps nothing. Collective over `tp`.
    pub fn attach_parallel_loss(
        &self,
        pass: &mut ForwardPass,
        labels: &Tensor,
        loss_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
    ) -> Result<(Tensor, Tensor), StageError> {
        let loss = tch::no_grad(|| self.vocab_parallel_loss(&pass.output, labels, tp))?;
        let (sum, count) = loss.values(loss_mask);
        let head = pass.regions.iter_mut().rev().find_map(|r| match r {
            Region::Head { loss, .. } => Some(loss),
            _ => None,
        });
        if let Some(kept) = head {
            *kept = Some(loss);
        }
        Ok((sum, count))
    }

    /// Megatron's vocabulary-parallel cross-entropy: the max, the sum of exponentials and
    /// the target logit are combined over the group; the gradient is softmax − one-hot on
    /// this rank's slice.
    fn vocab_parallel_loss(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        tp: &dyn TpCollectives,
    ) -> Result<VocabParallelLoss, StageError> {
        let rows = &self.shard().vocab_rows;
        let local = rows.len() as i64;
        let logits = logits.to_kind(Kind::Float).reshape([-1, local]);
        let labels = labels.reshape([-1]);
        let local_max = logits.amax([-1], false);
        let max = collective("all-gather", tp.all_gather(&local_max))?.amax([0], false);
        let shifted = logits - max.unsqueeze(-1);
        let exp = shifted.exp();
        let sum_exp = collective(
            "all-reduce",
            tp.all_reduce_sum(&exp.sum_dim_intlist(-1, false, Kind::Float)),
        )?;
        let start = rows.start as i64;
        let here = labels.ge(start).logical_and(&labels.lt(start + local));
        let index = (&labels - start).clamp(0, local - 1).unsqueeze(-1);
        let target_local =
            shifted.gather(-1, &index, false).squeeze_dim(-1) * here.to_kind(Kind::Float);
        let target = collective("all-reduce", tp.all_reduce_sum(&target_local))?;
        let counted = labels.ne(-100).to_kind(Kind::Float);
        let per_token = (sum_exp.log() - target) * &counted;
        let one_hot = Tensor::zeros_like(&shifted).scatter_value(-1, &index, 1.0)
            * here.to_kind(Kind::Float).unsqueeze(-1);
        let grad = (exp / sum_exp.unsqueeze(-1) - one_hot) * counted.unsqueeze(-1);
        Ok(VocabParallelLoss { per_token, grad })
    }

    /// This rank's embedding rows looked up; tokens of other ranks' rows give zeros.
    fn embed_local(&self, tokens: &Tensor) -> Result<Tensor, StageError> {
        let embedding = self.embedding_weight().ok_or(StageError::NotLastStage)?;
        self.check_tokens(tokens)?;
        let rows = &self.shard().vocab_rows;
        let (start, n) = (rows.start as i64, rows.len() as i64);
        let here = tokens.ge(start).logical_and(&tokens.lt(start + n));
        let local = (tokens - start).clamp(0, n - 1);
        let looked_up = Tensor::embedding(embedding, &local, -1, false, false);
        Ok(looked_up * here.unsqueeze(-1).to_kind(embedding.kind()))
    }
}

impl VocabParallelLoss {
    /// (Σ per-token loss over the tokens `loss_mask` counts, those tokens), in fp64 on
    /// the loss's device.
    fn values(&self, loss_mask: Option<&Tensor>) -> (Tensor, Tensor) {
        let weight = token_weights(&self.per_token, loss_mask, 1.0);
        let sum = (&self.per_token * &weight).sum(Kind::Double);
        let count = match loss_mask {
            Some(m) => m.to_kind(Kind::Double).sum(Kind::Double),
            None => Tensor::from(self.per_token.numel() as f64).to_device(sum.device()),
        };
        (sum, count)
    }
}

/// Backpropagates from `output` given its gradient (libtorch's `backward(gradient)`).
fn backward_from(output: &Tensor, grad: &Tensor) {
    (output * grad.to_kind(output.kind()))
        .sum(Kind::Float)
        .backward();
}

/// Each token's weight in the summed loss: `scale` where the mask is 1, shaped like
/// `per_token`.
fn token_weights(per_token: &Tensor, loss_mask: Option<&Tensor>, scale: f64) -> Tensor {
    match loss_mask {
        Some(m) => m.to_kind(Kind::Float).reshape([-1]) * scale,
        None => Tensor::ones_like(per_token) * scale,
    }
}
