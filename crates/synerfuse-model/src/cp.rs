//! Context parallelism: the members of a group each hold some token positions of every
//! sequence (any positions: an even load-balanced layout or one in shares), run every
//! per-token layer on their own tokens only, and exchange keys and values for attention.
//!
//! The attention block is cut at the exchange, as tensor parallelism cuts at its
//! collectives: each member computes its keys and values in a graph of their own, the
//! group all-gathers them into the whole sequence (in sequence order), and the queries
//! attend over that, causally by sequence index. In the backward the gradients of the
//! whole keys and values are reduce-scattered back to the members whose tokens they
//! came from, and each member runs the backward of its own keys and values. RoPE uses
//! each token's true position, so the result is the single-rank attention exactly.

use crate::collectives::{collective, CollectiveError, TpCollectives};
use crate::error::StageError;
use tch::{Kind, Tensor};

/// A stage's context-parallel group: its collectives, and every member's token indices
/// in the sequence (its local order), in member order.
pub struct ContextGroup<'a> {
    /// The group's collectives (member order).
    pub collectives: &'a dyn TpCollectives,
    /// Each member's tokens' indices in the sequence.
    pub positions: Vec<Vec<i64>>,
}

/// A member of no group: the collectives of one (a stage without tensor parallelism
/// runs the parallel forward with it).
pub struct Solo;

impl TpCollectives for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        Ok(tensor.shallow_clone())
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        Ok(tensor.unsqueeze(0))
    }

    fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        Ok(tensor.shallow_clone())
    }

    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError> {
        Ok(parts.iter().map(Tensor::shallow_clone).collect())
    }
}

/// One attention block's exchanged keys and values, kept for the backward.
pub(crate) struct KvExchange {
    /// This member's keys and values (graph to the block's input).
    pub(crate) local: [Tensor; 2],
    /// The whole sequence's, leaves whose gradients the attention's backward fills.
    pub(crate) whole: [Tensor; 2],
}

impl ContextGroup<'_> {
    /// This member's token indices `[s]` on `device`.
    pub(crate) fn local_positions(&self, device: tch::Device) -> Tensor {
        let mine = &self.positions[self.collectives.rank()];
        Tensor::from_slice(mine).to_device(device)
    }

    fn longest(&self) -> i64 {
        self.positions
            .iter()
            .map(|p| p.len() as i64)
            .max()
            .unwrap_or(0)
    }

    /// Every member's indices laid end to end in member order (what a gather yields).
    fn member_order(&self, device: tch::Device) -> Tensor {
        let all: Vec<i64> = self.positions.iter().flatten().copied().collect();
        Tensor::from_slice(&all).to_device(device)
    }

    /// For each sequence index, where it sits in the member-order concatenation.
    fn sequence_order(&self, device: tch::Device) -> Tensor {
        let mut order = vec![0i64; self.positions.iter().map(Vec::len).sum()];
        for (at, &p) in self.positions.iter().flatten().enumerate() {
            order[p as usize] = at as i64;
        }
        Tensor::from_slice(&order).to_device(device)
    }

    /// The whole sequence along `dim` (in sequence order) from every member's `t`, which
    /// holds its own tokens along `dim` in its order; no graph. Collective over the group.
    pub fn gather_sequence(&self, t: &Tensor, dim: i64) -> Result<Tensor, StageError> {
        let padded = pad(&t.detach(), dim, self.longest());
        let all = collective(
            "all-gather",
            self.collectives.all_gather(&padded.contiguous()),
        )?;
        let parts: Vec<Tensor> = (self.positions.iter().enumerate())
            .map(|(r, p)| all.get(r as i64).narrow(dim, 0, p.len() as i64))
            .collect();
        Ok(Tensor::cat(&parts, dim).index_select(dim, &self.sequence_order(t.device())))
    }

    /// This member's tokens of `whole` (the whole sequence along `dim`), in its order.
    pub fn own_tokens(&self, whole: &Tensor, dim: i64) -> Tensor {
        whole.index_select(dim, &self.local_positions(whole.device()))
    }

    /// The whole sequence's keys and values from every member's `k`, `v` `[b, kv, s, d]`.
    pub(crate) fn gather(&self, k: Tensor, v: Tensor) -> Result<KvExchange, StageError> {
        let whole = self.gather_sequence(&Tensor::stack(&[k.detach(), v.detach()], 0), 3)?;
        let leaf = |i: i64| whole.get(i).detach().set_requires_grad(true);
        Ok(KvExchange {
            local: [k, v],
            whole: [leaf(0), leaf(1)],
        })
    }

    /// Backpropagates an exchange: the whole keys' and values' gradients summed over the
    /// group and cut back to each member's tokens, then through this member's own.
    pub(crate) fn backward(&self, kv: KvExchange) -> Result<(), StageError> {
        let [k, v] = &kv.whole;
        let grad = |t: &Tensor| match t.grad().defined() {
            true => t.grad(),
            false => t.zeros_like(),
        };
        let whole = Tensor::stack(&[grad(k), grad(v)], 0);
        let by_member = whole.index_select(3, &self.member_order(k.device()));
        let longest = self.longest();
        let mut at = 0;
        let padded: Vec<Tensor> = (self.positions.iter())
            .map(|p| {
                let part = by_member.narrow(3, at, p.len() as i64);
                at += p.len() as i64;
                pad(&part, 3, longest)
            })
            .collect();
        let stacked = Tensor::stack(&padded, 0).contiguous();
        let summed = collective(
            "reduce-scatter",
            self.collectives.reduce_scatter_sum(&stacked),
        )?;
        let mine = self.positions[self.collectives.rank()].len() as i64;
        let summed = summed.get(0).narrow(3, 0, mine);
        let [local_k, local_v] = &kv.local;
        let loss = (local_k * summed.get(0).to_kind(local_k.kind())).sum(Kind::Float)
            + (local_v * summed.get(1).to_kind(local_v.kind())).sum(Kind::Float);
        loss.backward();
        Ok(())
    }
}

/// `t` zero-padded along `dim` to `length`.
fn pad(t: &Tensor, dim: i64, length: i64) -> Tensor {
    let have = t.size()[dim as usize];
    if have == length {
        return t.shallow_clone();
    }
    let mut shape = t.size();
    shape[dim as usize] = length - have;
    Tensor::cat(
        &[t, &Tensor::zeros(shape.as_slice(), (t.kind(), t.device()))],
        dim,
    )
}
