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

use crate::comm::{CommError, GroupCommunicator, SetGroups};
use crate::grads::ReductionLayout;
use crate::optim::{adamw_step, scaled, AdamTensor, AdamWConfig, FusedAdamError};
use crate::param_gather::{BucketGather, ParamGathers};
use crate::TrainError;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::{Duration, Instant};
use synerfuse_model::tch::{self, Device, Kind, Tensor};

/// The distributed optimizer's state on one rank: its shard of every sharded reduction.
pub struct DistributedOptimizer {
    config: AdamWConfig,
    reductions: Vec<ShardedReduction>,
    step: u64,
    /// Under `--overlap-param-gather`, the gathers the last step started.
    gathers: ParamGathers,
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
    /// The stage chunk holding it, and its buckets as the gradients' (elements, lowest
    /// model piece), in the order they start.
    chunk: usize,
    buckets: Vec<(Range<i64>, usize)>,
    /// The reduced gradients of the whole reduction.
    grads: Tensor,
    /// fp32 master weights of this rank's shard.
    master: Tensor,
    /// fp32 where the members compute in different precisions: the gather then carries
    /// the masters themselves, and each member casts them to its parameters' dtype.
    gather_kind: Option<Kind>,
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

    /// The AdamW step of this rank's shard (step `step`, already counted): each
    /// parameter's piece a tensor of the fused kernel's lists, so that matrices decay and
    /// norms and biases do not, as in the replicated optimizer.
    fn adamw_step(
        &self,
        config: &AdamWConfig,
        step: u64,
        lr: f64,
        grad_scale: f64,
    ) -> Result<(), FusedAdamError> {
        let own = self.own();
        let grad = scaled(
            &self.grads.narrow(0, own.start, own.end - own.start),
            grad_scale,
        );
        let pieces: Vec<(usize, [Tensor; 4])> = (self.segments().into_iter())
            .map(|(i, in_shard, _)| {
                let cut = |t: &Tensor| t.narrow(0, in_shard.start, in_shard.end - in_shard.start);
                (
                    i,
                    [&self.master, &grad, &self.exp_avg, &self.exp_avg_sq].map(cut),
                )
            })
            .collect();
        let tensors: Vec<AdamTensor<'_>> = (pieces.iter())
            .map(|(i, [value, grad, exp_avg, exp_avg_sq])| AdamTensor {
                value,
                grad,
                exp_avg,
                exp_avg_sq,
                decay: self.params[*i].1.dim() > 1,
            })
            .collect();
        adamw_step(config, &tensors, step, lr)
    }

    /// The members' communicator (none for a reduction over this rank alone).
    fn group<'g>(&self, groups: &'g SetGroups) -> Result<Option<&'g GroupCommunicator>, CommError> {
        match groups.get(&self.members) {
            Some(group) => Ok(Some(group)),
            None if self.members.len() < 2 => Ok(None),
            None => Err(CommError::Shape {
                rank: self.members[self.me],
                op: "DistributedOptimizer::step",
                problem: format!("no communicator for the group of ranks {:?}", self.members),
            }),
        }
    }

    /// Writes this rank's updated masters into its elements of each parameter, cast to
    /// its dtype: each parameter's flat elements, and whether they share its storage
    /// (a contiguous parameter, as the model's are; otherwise a copy to write back).
    /// Casting before gathering gives the bits that casting the gathered masters would.
    /// Under a `gather_kind` other than a parameter's dtype, a buffer of that kind (to be
    /// written back, cast).
    fn write_own(&self) -> Vec<(Tensor, bool)> {
        let segments = self.segments();
        (self.params.iter().enumerate())
            .map(|(i, (_, param, ..))| {
                let (flat, shared) = match self.gather_kind {
                    Some(kind) if kind != param.kind() => (
                        Tensor::zeros([param.numel() as i64], (kind, param.device())),
                        false,
                    ),
                    _ => flat_elements(param),
                };
                for (_, in_shard, in_param) in segments.iter().filter(|(p, ..)| *p == i) {
                    let length = in_shard.end - in_shard.start;
                    let master = self.master.narrow(0, in_shard.start, length);
                    flat.narrow(0, in_param.start, length).copy_(&master);
                }
                (flat, shared)
            })
            .collect()
    }

    /// Writes this rank's updated masters into its elements of the parameters, then
    /// gathers every member's elements into every copy, parameter by parameter, in place:
    /// what travels is the parameters' dtype (2 bytes an element under bf16, as Megatron
    /// gathers, not the 4 of the masters), and no rank makes a copy of the whole
    /// reduction (but members of different precisions: fp32, a parameter at a time). Collective over the members (every one has the same parameters in the
    /// same order, so they issue the same gathers).
    fn update_parameters(&self, groups: &SetGroups) -> Result<(), CommError> {
        let group = self.group(groups)?;
        for ((_, param, offset, numel), (mut flat, shared)) in
            self.params.iter().zip(self.write_own())
        {
            if *numel == 0 {
                continue;
            }
            if let Some(group) = group {
                group.all_gather_in_place(&mut flat, &self.counts_of(*offset..offset + numel))?;
            }
            if !shared {
                param
                    .shallow_clone()
                    .copy_(&flat.view(param.size().as_slice()));
            }
        }
        Ok(())
    }

    /// [`Self::update_parameters`] with the gathers left in flight in `gathers`, bucket
    /// by bucket from the reduction's first model piece (the order the forward reads
    /// them), for the next forward to wait on.
    fn start_gathers(&self, groups: &SetGroups, gathers: &ParamGathers) -> Result<(), CommError> {
        let Some(group) = self.group(groups)? else {
            return self.update_parameters(groups);
        };
        let flats = self.write_own();
        for (elements, min_piece) in self.buckets.iter().rev() {
            let mut bucket = BucketGather {
                chunk: self.chunk,
                min_piece: *min_piece,
                gathers: Vec::new(),
                write_back: Vec::new(),
            };
            let within = (self.params.iter().zip(&flats))
                .filter(|((_, _, offset, numel), _)| *numel > 0 && elements.contains(offset));
            for ((_, param, offset, numel), (flat, shared)) in within {
                let counts = self.counts_of(*offset..offset + numel);
                bucket
                    .gathers
                    .push(group.start_all_gather_in_place(flat, &counts)?);
                if !shared {
                    bucket
                        .write_back
                        .push((flat.shallow_clone(), param.shallow_clone()));
                }
            }
            gathers.push(bucket);
        }
        Ok(())
    }

    /// Each member's elements of the reduction's `elements`, in member order: the shards
    /// partition the reduction in member order, so these are consecutive pieces.
    fn counts_of(&self, elements: Range<i64>) -> Vec<usize> {
        (self.shards.iter())
            .map(|s| (s.end.min(elements.end) - s.start.max(elements.start)).max(0) as usize)
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
    /// `mixes_precisions` says whether a reduction's members compute in different
    /// precisions (its gather then carries fp32).
    pub fn new(
        config: AdamWConfig,
        layouts: Vec<ReductionLayout>,
        rank: usize,
        fp32_values: &BTreeMap<String, Tensor>,
        mixes_precisions: &dyn Fn(&[usize]) -> bool,
    ) -> Self {
        let reductions = layouts
            .into_iter()
            .filter_map(|l| {
                let shards = l.shards?;
                let me = l.members.iter().position(|&m| m == rank)?;
                let gather_kind = mixes_precisions(&l.members).then_some(Kind::Float);
                let mut r = ShardedReduction {
                    gather_kind,
                    members: l.members,
                    shards,
                    me,
                    params: l.params,
                    chunk: l.chunk,
                    buckets: l.buckets,
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
            gathers: ParamGathers::default(),
        }
    }

    /// Σ g² over this rank's shards of the reduced gradients, of the parameters `counted`
    /// says to count (a tensor every rank of a tensor-parallel group holds whole counts
    /// on its rank 0 only): the shards of one reduction partition it, so summed over the
    /// world every element counts once.
    pub fn grad_norm_squared(&self, counted: impl Fn(&str) -> bool) -> f64 {
        let mut squares = Vec::new();
        for r in &self.reductions {
            let own = r.own();
            for (i, in_shard, _) in r.segments() {
                if counted(&r.params[i].0) {
                    let length = in_shard.end - in_shard.start;
                    let g = r.grads.narrow(0, own.start + in_shard.start, length);
                    squares.push(g.to_kind(Kind::Double).square().sum(Kind::Double));
                }
            }
        }
        // Read back in one transfer (one synchronisation, not one a piece), summed in
        // the order the pieces come.
        match squares.is_empty() {
            true => 0.0,
            false => Vec::<f64>::try_from(Tensor::stack(&squares, 0).to_device(Device::Cpu))
                .map_or(f64::NAN, |v| v.iter().sum()),
        }
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
    /// updated values into their parameters, in the parameters' dtype
    /// (`ShardedReduction::update_parameters`): before this returns, or with
    /// `overlap_param_gather` left in flight ([`Self::gathers`]) for the next forward to
    /// wait on. Collective over every reduction's members, in the global order. Returns
    /// the time spent gathering.
    pub fn step(
        &mut self,
        lr: f64,
        grad_scale: f64,
        groups: &SetGroups,
        overlap_param_gather: bool,
    ) -> Result<Duration, TrainError> {
        // The last step's gathers end before this one's masters are written.
        self.gathers.wait_all()?;
        let mut gathering = Duration::ZERO;
        self.step += 1;
        for r in &mut self.reductions {
            tch::no_grad(|| r.adamw_step(&self.config, self.step, lr, grad_scale))?;
            let started = Instant::now();
            match overlap_param_gather {
                true => tch::no_grad(|| r.start_gathers(groups, &self.gathers))?,
                false => tch::no_grad(|| r.update_parameters(groups))?,
            }
            gathering += started.elapsed();
        }
        Ok(gathering)
    }

    /// The parameter gathers the last step left in flight (`--overlap-param-gather`).
    pub fn gathers(&self) -> &ParamGathers {
        &self.gathers
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

/// `param`'s elements as a flat tensor, and whether it shares `param`'s storage (a
/// contiguous parameter, as the model's are); otherwise a flat copy, to be written back.
fn flat_elements(param: &Tensor) -> (Tensor, bool) {
    match param.is_contiguous() {
        true => (param.view([-1]), true),
        false => (param.reshape([-1]).copy(), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use synerfuse_model::tch::Device;

    /// A reduction of `members` over a bf16 matrix `w` (4 × 3) and an fp32 vector `b`
    /// (5), its fp32 values, gradients of ones, and the shards given.
    fn optimizer(
        members: Vec<usize>,
        shards: Vec<Range<i64>>,
    ) -> (DistributedOptimizer, [Tensor; 2]) {
        optimizer_mixing(members, shards, false)
    }

    /// [`optimizer`], its members computing in different precisions where `mixed`.
    fn optimizer_mixing(
        members: Vec<usize>,
        shards: Vec<Range<i64>>,
        mixed: bool,
    ) -> (DistributedOptimizer, [Tensor; 2]) {
        let opts = (Kind::Float, Device::Cpu);
        let values = [
            Tensor::arange(12, opts).view([4, 3]) / 7.0,
            Tensor::arange(5, opts) / 3.0,
        ];
        let params = [values[0].to_kind(Kind::BFloat16), values[1].copy()];
        let layout = ReductionLayout {
            members,
            shards: Some(shards),
            grads: Tensor::ones([17], opts),
            params: vec![
                ("w".into(), params[0].shallow_clone(), 0, 12),
                ("b".into(), params[1].shallow_clone(), 12, 5),
            ],
            chunk: 0,
            buckets: vec![(0..12, 1), (12..17, 0)],
        };
        let fp32 = BTreeMap::from([
            ("w".to_owned(), values[0].shallow_clone()),
            ("b".to_owned(), values[1].shallow_clone()),
        ]);
        let config = AdamWConfig::default();
        (
            DistributedOptimizer::new(config, vec![layout], 0, &fp32, &|_| mixed),
            params,
        )
    }

    #[test]
    fn a_step_writes_the_updated_masters_in_each_parameters_dtype() {
        let (mut zero, [w, b]) = optimizer(vec![0], std::iter::once(0..17).collect());
        zero.step(1e-2, 1.0, &SetGroups::none(), false).unwrap();
        let master = &zero.reductions[0].master;
        assert_eq!(w.kind(), Kind::BFloat16);
        assert_eq!(
            w,
            master.narrow(0, 0, 12).to_kind(Kind::BFloat16).view([4, 3])
        );
        assert_eq!(b, master.narrow(0, 12, 5));
        assert_ne!(b, Tensor::arange(5, (Kind::Float, Device::Cpu)) / 3.0);
    }

    /// Members of different precisions gather the fp32 masters, each casting them to
    /// its parameters' dtype: the same bits as a member of one precision writes.
    #[test]
    fn mixed_precisions_gather_fp32_and_cast_alike() {
        let (mut one, [w1, b1]) = optimizer(vec![0], std::iter::once(0..17).collect());
        let (mut mixed, [w2, b2]) =
            optimizer_mixing(vec![0], std::iter::once(0..17).collect(), true);
        assert_eq!(mixed.reductions[0].gather_kind, Some(Kind::Float));
        for zero in [&mut one, &mut mixed] {
            zero.step(1e-2, 1.0, &SetGroups::none(), false).unwrap();
        }
        assert_eq!(w2.kind(), Kind::BFloat16);
        assert_eq!((w1, b1), (w2, b2));
    }

    #[test]
    fn each_member_gathers_its_shards_elements_of_each_parameter() {
        let (zero, _) = optimizer(vec![0, 1, 2], vec![0..5, 5..5, 5..17]);
        let r = &zero.reductions[0];
        assert_eq!(r.counts_of(0..12), [5, 0, 7]);
        assert_eq!(r.counts_of(12..17), [0, 0, 5]);
    }

    #[test]
    fn a_missing_communicator_is_an_error() {
        let (mut zero, _) = optimizer(vec![0, 1], vec![0..9, 9..17]);
        let err = zero.step(1e-2, 1.0, &SetGroups::none(), true).unwrap_err();
        assert!(
            matches!(err, TrainError::Comm(CommError::Shape { rank: 0, .. })),
            "{err}"
        );
    }
}
