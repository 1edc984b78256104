//! The shapes a search chooses: of a unit (tensor- and context-parallel size), of a
//! grid, and of each pool of a per-replica plan. A folded cluster's copy chooses them,
//! the whole cluster lays out only those.

use super::outcome::{Arrangement, PooledCandidate};
use crate::cost::Recompute;

/// A grid's units: (tensor-parallel size, context-parallel size).
pub(super) type UnitShape = (usize, usize);

/// A grid the search on a folded cluster chose: laid out again on the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GridShape {
    pub(super) recompute: Recompute,
    pub(super) tensor_parallel_size: usize,
    pub(super) stages: usize,
    pub(super) arrangement: Arrangement,
}

/// What a per-replica plan chose: its recomputation and each pool's shape.
pub(super) struct PooledShape {
    pub(super) recompute: Recompute,
    pub(super) expert_parallel: usize,
    pub(super) pools: Vec<PoolShape>,
}

/// What a per-replica plan chose for one pool (pools fastest first): a folded cluster's
/// search chooses it, the whole cluster lays out only it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PoolShape {
    pub(super) tensor_parallel_size: usize,
    pub(super) context_parallel_size: usize,
    pub(super) stages: usize,
    pub(super) micro_batch_size: usize,
}

impl PoolShape {
    /// Each pool's shape in `c`.
    pub(super) fn of(c: &PooledCandidate) -> Vec<PoolShape> {
        (c.pools.iter())
            .map(|pool| PoolShape {
                tensor_parallel_size: c.groups[pool.devices[0][0]].tp_size(),
                context_parallel_size: c.groups[pool.devices[0][0]].cp,
                stages: pool.layers.len(),
                micro_batch_size: pool.micro_batch_size,
            })
            .collect()
    }

    /// The shape of its units: (tensor-, context-parallel size).
    pub(super) fn unit(&self) -> UnitShape {
        (self.tensor_parallel_size, self.context_parallel_size)
    }

    /// Whether `only` (none: anything) lets pool `k` take units of `shape`.
    pub(super) fn allows(only: Option<&[PoolShape]>, k: usize, shape: UnitShape) -> bool {
        only.is_none_or(|s| s.get(k).is_some_and(|s| s.unit() == shape))
    }
}
