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

use crate::cp::ContextGroup;
use crate::moe::{ExpertGroup, LayerBalance};
use crate::norm::rms_norm;
use crate::pass::{ForwardPass, Region, SavedInputs};
use crate::{Stage, StageError};
use tch::{Kind, Tensor};

/// A collective's failure, as the communicator reports it.
pub type CollectiveError = Box<dyn std::error::Error + Send + Sync>;

/// The collectives a tensor-parallel stage needs, over its tensor-parallel group
/// (implemented over MPI/NCCL by synerfuse-train, and over threads in tests). Members are
/// numbered in the collectives' order, which sequence parallelism follows (the group's
/// member order need not be its tensor-parallel order).
pub trait TpCollectives {
    /// This member's index in the collectives' order.
    fn rank(&self) -> usize;
    /// Members.
    fn size(&self) -> usize;
    /// The element-wise sum over the group, as a new tensor.
    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError>;
    /// Every member's tensor stacked along a new first dimension, in member order.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError>;
    /// The element-wise sum over the group, cut into `size` equal parts along the first
    /// dimension: this member's part.
    fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError>;
    /// `parts[m]` to member `m` (any number of rows along the first dimension, the rest
    /// of the shape and the dtype alike on every member): what each member sent this one,
    /// in member order (expert parallelism's token exchange).
    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError>;
}

/// [`TpCollectives::all_to_all`] built from the group's all-gather (every part padded to
/// the longest and gathered whole): size times the traffic of a real all-to-all, for
/// groups without one (tests over threads).
pub fn all_to_all_by_gather(
    group: &dyn TpCollectives,
    parts: &[Tensor],
) -> Result<Vec<Tensor>, CollectiveError> {
    let rows: Vec<i64> = parts.iter().map(|p| p.size()[0]).collect();
    let counts = group.all_gather(&Tensor::from_slice(&rows))?;
    let counts: Vec<Vec<i64>> = (0..group.size())
        .map(|src| Vec::try_from(counts.get(src as i64)).unwrap_or_default())
        .collect();
    let longest = counts.iter().flatten().copied().max().unwrap_or(0);
    let padded: Vec<Tensor> = (parts.iter())
        .map(|p| {
            let mut shape = p.size();
            shape[0] = longest - shape[0];
            Tensor::cat(
                &[
                    p.shallow_clone(),
                    p.new_zeros(shape.as_slice(), (p.kind(), p.device())),
                ],
                0,
            )
        })
        .collect();
    let all = group.all_gather(&Tensor::stack(&padded, 0))?;
    let me = group.rank();
    Ok((0..group.size())
        .map(|src| {
            all.get(src as i64)
                .get(me as i64)
                .narrow(0, 0, counts[src][me])
        })
        .collect())
}

fn collective<T>(op: &'static str, result: Result<T, CollectiveError>) -> Result<T, StageError> {
    result.map_err(|source| StageError::Collective { op, source })
}

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

/// Per-token cross-entropy over a vocabulary split across the group, and its gradient.
struct VocabParallelLoss {
    /// `[n]` per-token loss (0 where the label is -100).
    per_token: Tensor,
    /// `[n, local vocab]` d loss_token / d logits (softmax − one-hot), 0 for ignored labels.
    grad: Tensor,
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
        let saved = SavedInputs {
            input: match self.is_first() {
                true => input.shallow_clone(),
                false => input.detach(),
            },
            position_ids: position_ids.map(Tensor::shallow_clone),
            attention_mask: attention_mask.map(Tensor::shallow_clone),
        };
        let run = || self.tp_regions(input, position_ids, attention_mask, tp, (cp, ep));
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

    /// The tensor-parallel forward: its output, the regions its backward runs, and its
    /// MoE layers' load balance.
    fn tp_regions(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
        (cp, ep): (Option<&ContextGroup<'_>>, Option<&ExpertGroup<'_>>),
    ) -> Result<(Tensor, Vec<Region>, Vec<LayerBalance>), StageError> {
        if ep.is_none() {
            self.check_experts_held()?;
        }
        let sequences = input.size()[0];
        let mut balances = Vec::new();
        let seq = Sequence {
            tp,
            parallel: self.sequence_parallel(),
        };
        // Under context parallelism: this member's sequence indices, and its positions.
        let context = match cp {
            Some(cp) => {
                let indices = cp.local_positions(input.device());
                let b = input.size()[0];
                let positions = position_ids.map_or_else(
                    || indices.unsqueeze(0).expand([b, indices.size()[0]], false),
                    Tensor::shallow_clone,
                );
                Some((cp, indices, positions))
            }
            None => None,
        };
        let position_ids = context.as_ref().map(|(_, _, p)| p).or(position_ids);
        let mut regions = Vec::new();
        let leaf = (!self.is_first()).then(|| input.detach().set_requires_grad(true));
        let (mut x, (cos, sin)) = match &leaf {
            Some(leaf) if self.takes_sequence_rows() => {
                self.check_hidden(leaf)?;
                let positions = whole_positions(leaf, position_ids, tp.size());
                (leaf.detach(), self.rotary(leaf, Some(&positions)))
            }
            Some(leaf) => {
                self.check_hidden(leaf)?;
                (seq.rows(&leaf.detach())?, self.rotary(leaf, position_ids))
            }
            None => {
                let partial = self.embed_local(input)?;
                let x = seq.combine(&partial.detach())?;
                let tables = self.rotary(&partial, position_ids);
                regions.push(Region::Embedding { partial });
                (x, tables)
            }
        };
        let c = self.config();
        for layer in self.decoder_layers() {
            for attention in [true, false] {
                let input = self.region_input(&x, &seq, &mut regions, |x| {
                    layer.block_norm(attention, x, c)
                })?;
                let partial = match (attention, seq.parallel, &context) {
                    (true, parallel, Some((cp, indices, _))) => {
                        // Under sequence parallelism the input is already the gathered
                        // normed rows (this member's tokens).
                        let normed = |x: &Tensor| match parallel {
                            true => x.shallow_clone(),
                            false => layer.block_norm(true, x, c),
                        };
                        let (k, v) = layer.keys_values(&normed(&input), c, &cos, &sin);
                        let kv = cp.gather(k, v)?;
                        let [k, v] = &kv.whole;
                        let partial = layer.attention_over(
                            &normed(&input),
                            c,
                            (&cos, &sin),
                            (k, v),
                            indices,
                            attention_mask,
                        );
                        x = &x + seq.combine(&partial.detach())?;
                        regions.push(Region::Block {
                            input,
                            partial,
                            kv: Some(kv),
                            balance: None,
                            exchange: None,
                        });
                        continue;
                    }
                    (true, true, _) => (
                        layer.attention_core(&input, c, &cos, &sin, attention_mask, None),
                        None,
                        None,
                    ),
                    (true, false, _) => (
                        layer.attention_out(&input, c, &cos, &sin, attention_mask, None),
                        None,
                        None,
                    ),
                    (false, parallel, _) => {
                        // Under sequence parallelism the input is already normed.
                        let h = match parallel {
                            true => input.shallow_clone(),
                            false => layer.block_norm(false, &input, c),
                        };
                        match ep {
                            Some(ep) => layer.mlp_across(&h, ep)?,
                            None => {
                                let (partial, routing) = layer.mlp_core(&h);
                                (partial, routing, None)
                            }
                        }
                    }
                };
                let (partial, routing, exchange) = partial;
                let balance = match routing {
                    Some(routing) => {
                        let cp = context.as_ref().map(|(cp, _, _)| *cp);
                        let mut balance = self.balances(&[routing], sequences, cp)?;
                        let objective = self.summed_objectives(&balance);
                        balances.append(&mut balance);
                        objective
                    }
                    None => None,
                };
                x = &x + seq.combine(&partial.detach())?;
                regions.push(Region::Block {
                    input,
                    partial,
                    kv: None,
                    balance,
                    exchange,
                });
            }
        }
        let output = match self.norm_and_head() {
            Some((norm, head)) => {
                let input = self.region_input(&x, &seq, &mut regions, |x| {
                    rms_norm(x, norm, c.rms_norm_eps)
                })?;
                let normed = match seq.parallel {
                    true => input.shallow_clone(),
                    false => rms_norm(&input, norm, c.rms_norm_eps),
                };
                let logits = normed.linear::<Tensor>(head, None);
                let output = logits.detach();
                regions.push(Region::Head { input, logits });
                output
            }
            None if self.gives_sequence_rows() => x,
            None => seq.whole(&x)?,
        };
        Ok((output, regions, balances))
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
        let seq = Sequence {
            tp,
            parallel: self.sequence_parallel(),
        };
        let weight = pass.router_loss_weight(self.config(), tp.size());
        let (mut regions, saved) = pass.into_regions();
        if regions.is_empty() {
            // A recomputed pass: its forward again, with the graph this time.
            let (positions, mask) = (saved.position_ids.as_ref(), saved.attention_mask.as_ref());
            regions = self
                .tp_regions(&saved.input, positions, mask, tp, (cp, ep))?
                .1;
        }
        // The gradient of the residual stream (this rank's rows under sequence
        // parallelism), and that of a sequence-parallel norm's output.
        let (mut grad, mut normed_grad) = match (&from, regions.last()) {
            (TpBackwardFrom::OutputGrad(g), _) if self.takes_output_grad_rows() => {
                (Some(g.shallow_clone()), None)
            }
            (TpBackwardFrom::OutputGrad(g), _) => (Some(seq.rows(g)?), None),
            (TpBackwardFrom::Loss { .. }, Some(Region::Head { .. })) => (None, None),
            _ => return Err(StageError::NotLastStage),
        };
        while let Some(region) = regions.pop() {
            match region {
                Region::Head { input, logits } => {
                    let TpBackwardFrom::Loss {
                        labels,
                        loss_mask,
                        scale,
                    } = &from
                    else {
                        return Err(StageError::NotLastStage);
                    };
                    let loss = self.vocab_parallel_loss(&logits.detach(), labels, tp)?;
                    let weight = token_weights(&loss.per_token, *loss_mask, *scale);
                    let g = (loss.grad * weight.unsqueeze(-1)).view(logits.size().as_slice());
                    backward_from(&logits, &g);
                    let through = seq.combine(&input.grad())?;
                    match seq.parallel {
                        true => normed_grad = Some(through),
                        false => grad = Some(through),
                    }
                }
                Region::Norm { input, normed } => {
                    let g = normed_grad.take().expect("a norm's output gradient");
                    backward_from(&normed, &g);
                    let residual = grad.take();
                    grad = Some(match residual {
                        Some(r) => r + input.grad(),
                        None => input.grad(),
                    });
                }
                Region::Block {
                    input,
                    partial,
                    kv,
                    balance,
                    exchange,
                } => {
                    let g = grad.as_ref().expect("a block's output gradient");
                    let through_output =
                        (&partial * seq.whole(g)?.to_kind(partial.kind())).sum(Kind::Float);
                    match balance.filter(|_| weight != 0.0) {
                        Some(balance) => (through_output + balance * weight).backward(),
                        None => through_output.backward(),
                    }
                    match (exchange, ep) {
                        (Some(exchange), Some(ep)) => exchange.backward(ep)?,
                        (Some(_), None) => {
                            return Err(StageError::ExpertsElsewhere {
                                held: self.shard().experts.clone().unwrap_or_default(),
                            })
                        }
                        (None, _) => {}
                    }
                    if let (Some(kv), Some(cp)) = (kv, cp) {
                        cp.backward(kv)?;
                    }
                    let through = seq.combine(&input.grad())?;
                    match seq.parallel {
                        true => normed_grad = Some(through),
                        false => grad = Some(through + g),
                    }
                }
                Region::Embedding { partial } => {
                    let g = grad.take().expect("the embedding's output gradient");
                    backward_from(&partial, &seq.whole(&g)?);
                    return Ok(None);
                }
            }
        }
        match self.gives_input_grad_rows() {
            true => Ok(grad),
            false => grad.map(|g| seq.whole(&g)).transpose(),
        }
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

/// Flattens `tensors` into one buffer, lets `reduce` combine it in place (one collective
/// for them all), and copies the result back into each tensor.
pub fn reduce_flat_in_place<E>(
    tensors: &mut [Tensor],
    reduce: impl FnOnce(&mut Tensor) -> Result<(), E>,
) -> Result<(), E> {
    if tensors.is_empty() {
        return Ok(());
    }
    let mut flat = Tensor::cat(
        &tensors.iter().map(|g| g.reshape([-1])).collect::<Vec<_>>(),
        0,
    );
    reduce(&mut flat)?;
    let mut offset = 0;
    tch::no_grad(|| {
        for tensor in tensors.iter_mut() {
            let n = tensor.numel() as i64;
            tensor.copy_(&flat.narrow(0, offset, n).view(tensor.size().as_slice()));
            offset += n;
        }
    });
    Ok(())
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
        let weight = token_weights(&loss.per_token, loss_mask, 1.0);
        let sum = (&loss.per_token * &weight)
            .sum(Kind::Double)
            .double_value(&[]);
        let count = match loss_mask {
            Some(m) => m.to_kind(Kind::Double).sum(Kind::Double).double_value(&[]),
            None => loss.per_token.numel() as f64,
        };
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
