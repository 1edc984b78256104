//! Megatron's distributed optimizer (`--use-distributed-optimizer`, ZeRO-1): each
//! gradient reduction's holders split its elements into shards, in proportion to their
//! device memory ([`synerfuse_plan::Plan::memory_shares`]; equal by default).
//! The gradients are reduce-scattered (each holder gets the sum of its shard), a rank
//! keeps the fp32 master weights and Adam moments of its shard only and updates them,
//! and the holders all-gather the updated values into every copy of the parameters. The
//! update is AdamW's, element for element, so the parameters equal those of the
//! replicated optimizer.
//!
//! Reductions over one rank, and reductions of whole tensors (holders of different
//! tensor-parallel splits), keep the replicated optimizer.

use crate::comm::{CommError, SetGroups};
use crate::grads::ReductionLayout;
use crate::optim::{scaled, AdamWConfig};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use synerfuse_model::tch::{self, Kind, Tensor};

/// The distributed optimizer's state on one rank: its shard of every sharded reduction.
pub struct DistributedOptimizer {
    config: AdamWConfig,
    reductions: Vec<ShardedReduction>,
    step: u64,
}

/// A parameter's elements of this rank's shard: `elements` of its local flattening,
/// with their fp32 master, `exp_avg` and `exp_avg_sq` (views into the shard).
pub struct HeldPiece {
    /// Global name.
    pub name: String,
    /// The parameter's shape on this rank (its tensor-parallel slice).
    pub local_shape: Vec<i64>,
    /// Which of its flat elements.
    pub elements: Range<i64>,
    /// Master, `exp_avg`, `exp_avg_sq`.
    pub state: [Tensor; 3],
}

/// One reduction's shard on this rank.
struct ShardedReduction {
    members: Vec<usize>,
    /// Every member's elements of the reduction, in member order.
    shards: Vec<Range<i64>>,
    /// This rank's index among the members.
    me: usize,
    /// The reduction's parameters in buffer order: (name, parameter, offset, elements).
    params: Vec<(String, Tensor, i64, i64)>,
    /// The reduced gradients of the whole reduction.
    grads: Tensor,
    /// fp32 master weights of this rank's shard.
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl ShardedReduction {
    fn own(&self) -> Range<i64> {
        self.shards[self.me].clone()
    }

    /// The pieces of parameters within this rank's shard: (parameter index, range in
    /// the shard, range in the parameter's flattened elements).
    fn segments(&self) -> Vec<(usize, Range<i64>, Range<i64>)> {
        let own = self.own();
        self.params
            .iter()
            .enumerate()
            .filter_map(|(i, (_, _, offset, numel))| {
                let (start, end) = (own.start.max(*offset), own.end.min(offset + numel));
                (start < end).then(|| {
                    let in_shard = start - own.start..end - own.start;
                    (i, in_shard, start - offset..end - offset)
                })
            })
            .collect()
    }

    /// The whole reduction's flat fp32 `values` (one tensor per parameter, by name)
    /// narrowed to this rank's shard.
    fn shard_of(&self, values: &dyn Fn(&str) -> Option<Tensor>) -> Option<Tensor> {
        let flat: Option<Vec<Tensor>> = (self.params.iter())
            .map(|(name, ..)| values(name).map(|t| t.to_kind(Kind::Float).reshape([-1])))
            .collect();
        let own = self.own();
        let device = self.grads.device();
        Some(
            Tensor::cat(&flat?, 0)
                .narrow(0, own.start, own.end - own.start)
                .to_device(device),
        )
    }
}

impl DistributedOptimizer {
    /// The shards of every reduction of `layouts` that [`crate::grads::MainGrads::sharded`]
    /// split, for this `rank`; the masters start from `fp32_values` (by name).
    pub fn new(
        config: AdamWConfig,
        layouts: Vec<ReductionLayout>,
        rank: usize,
        fp32_values: &BTreeMap<String, Tensor>,
    ) -> Self {
        let reductions = layouts
            .into_iter()
            .filter_map(|l| {
                let shards = l.shards?;
                let me = l.members.iter().position(|&m| m == rank)?;
                let mut r = ShardedReduction {
                    members: l.members,
                    shards,
                    me,
                    params: l.params,
                    grads: l.grads,
                    master: Tensor::new(),
                    exp_avg: Tensor::new(),
                    exp_avg_sq: Tensor::new(),
                };
                let master = r
                    .shard_of(&|name| fp32_values.get(name).map(Tensor::shallow_clone))
                    .expect("every parameter has its fp32 value");
                r.exp_avg = master.zeros_like();
                r.exp_avg_sq = master.zeros_like();
                r.master = master;
                Some(r)
            })
            .collect();
        DistributedOptimizer {
            config,
            reductions,
            step: 0,
        }
    }

    /// Σ g² over this rank's shards of the reduced gradients, of the parameters `counted`
    /// says to count (a tensor every rank of a tensor-parallel group holds whole counts
    /// on its rank 0 only): the shards of one reduction partition it, so summed over the
    /// world every element counts once.
    pub fn grad_norm_squared(&self, counted: impl Fn(&str) -> bool) -> f64 {
        let mut sum = 0.0;
        for r in &self.reductions {
            let own = r.own();
            for (i, in_shard, _) in r.segments() {
                if counted(&r.params[i].0) {
                    let g = r.grads.narrow(
                        0,
                        own.start + in_shard.start,
                        in_shard.end - in_shard.start,
                    );
                    let g = g.to_kind(Kind::Double);
                    sum += (&g * &g).sum(Kind::Double).double_value(&[]);
                }
            }
        }
        sum
    }

    /// The parameters whose state it holds (the replicated optimizer holds the rest).
    pub fn names(&self) -> BTreeSet<String> {
        (self.reductions.iter())
            .flat_map(|r| r.params.iter().map(|(name, ..)| name.clone()))
            .collect()
    }

    /// Bytes of this rank's state: fp32 masters and two moments of its shards.
    pub fn state_bytes(&self) -> u64 {
        (self.reductions.iter())
            .map(|r| 3 * 4 * (r.own().end - r.own().start) as u64)
            .sum()
    }

    /// Sets the step count (bias correction) when resuming.
    pub fn set_steps(&mut self, steps: u64) {
        self.step = steps;
    }

    /// One AdamW step of every shard at `lr` with its reduced gradients times
    /// `grad_scale` (torch's update, as [`crate::optim::AdamW`]: decoupled decay on
    /// matrices, then the bias-corrected Adam step), then the members all-gather the
    /// updated values into their parameters. Collective over every reduction's members,
    /// in the global order.
    pub fn step(&mut self, lr: f64, grad_scale: f64, groups: &SetGroups) -> Result<(), CommError> {
        self.step += 1;
        let c = self.config;
        let biases = c.bias_corrections(self.step);
        for r in &mut self.reductions {
            let own = r.own();
            tch::no_grad(|| {
                let grad = r.grads.narrow(0, own.start, own.end - own.start);
                let grad = scaled(&grad, grad_scale);
                if c.weight_decay != 0.0 {
                    for (i, in_shard, _) in r.segments() {
                        if r.params[i].1.dim() > 1 {
                            let length = in_shard.end - in_shard.start;
                            let mut piece = r.master.narrow(0, in_shard.start, length);
                            let _ = piece.g_mul_scalar_(1.0 - lr * c.weight_decay);
                        }
                    }
                }
                let moments = (&mut r.exp_avg, &mut r.exp_avg_sq);
                c.adam_update(&mut r.master, moments, &grad, lr, biases);
            });
            let values = gather(r, &r.master, groups)?;
            tch::no_grad(|| {
                for (_, param, offset, numel) in &r.params {
                    let value = values
                        .narrow(0, *offset, *numel)
                        .view(param.size().as_slice());
                    let mut param = param.shallow_clone();
                    param.copy_(&value.to_kind(param.kind()));
                }
            });
        }
        Ok(())
    }

    /// This rank's own elements of every parameter it holds state for: what it writes
    /// to a checkpoint, without gathering anything.
    pub fn held_pieces(&self) -> Vec<HeldPiece> {
        let mut out = Vec::new();
        for r in &self.reductions {
            for (i, in_shard, in_param) in r.segments() {
                let (name, param, ..) = &r.params[i];
                let length = in_shard.end - in_shard.start;
                let state = [&r.master, &r.exp_avg, &r.exp_avg_sq]
                    .map(|t| t.narrow(0, in_shard.start, length));
                out.push(HeldPiece {
                    name: name.clone(),
                    local_shape: param.size(),
                    elements: in_param,
                    state,
                });
            }
        }
        out
    }

    /// Restores this rank's shards piece by piece: `read(name, local shape, elements)`
    /// gives the fp32 master, `exp_avg` and `exp_avg_sq` of those elements of the
    /// parameter's local (tensor-parallel) flattening.
    pub fn load_pieces<E>(
        &mut self,
        mut read: impl FnMut(&str, &[i64], Range<i64>) -> Result<[Tensor; 3], E>,
    ) -> Result<(), E> {
        for r in &mut self.reductions {
            for (i, in_shard, in_param) in r.segments() {
                let (name, param, ..) = &r.params[i];
                let values = read(name, &param.size(), in_param)?;
                let length = in_shard.end - in_shard.start;
                for (mut to, from) in [&r.master, &r.exp_avg, &r.exp_avg_sq]
                    .map(|t| t.narrow(0, in_shard.start, length))
                    .into_iter()
                    .zip(values)
                {
                    tch::no_grad(|| to.copy_(&from.reshape([-1]).to_device(to.device())));
                }
            }
        }
        Ok(())
    }
}

/// Every member's shard of `r` (this rank's is `local`) joined into the reduction's
/// whole flat fp32 tensor: shards padded to the longest for one all-gather, then cut.
fn gather(r: &ShardedReduction, local: &Tensor, groups: &SetGroups) -> Result<Tensor, CommError> {
    let group = groups
        .get(&r.members)
        .expect("every reduction of two or more ranks has its communicator");
    let longest = r.shards.iter().map(|s| s.end - s.start).max().unwrap_or(0);
    let padded = Tensor::zeros([longest], (Kind::Float, local.device()));
    let mut head = padded.narrow(0, 0, local.numel() as i64);
    tch::no_grad(|| head.copy_(local));
    let gathered = group.all_gather(&padded)?;
    let pieces: Vec<Tensor> = (r.shards.iter().enumerate())
        .map(|(i, s)| gathered.get(i as i64).narrow(0, 0, s.end - s.start))
        .collect();
    Ok(Tensor::cat(&pieces, 0))
}
