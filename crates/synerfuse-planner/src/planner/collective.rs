//! What a gradient reduction costs, as data: the pricing context keeps each holders'
//! reduction once priced ([`super::reduction::holders_collective`] prices it).

/// A collective's price, linear in the elements each member moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct CollectivePrice {
    /// Seconds of one collective of no bytes: its latency, paid once per bucket.
    pub(super) fixed_s: f64,
    /// Seconds per element.
    pub(super) per_element_s: f64,
}

impl CollectivePrice {
    /// Seconds of one collective of `elements`.
    pub(super) fn seconds(&self, elements: f64) -> f64 {
        self.fixed_s + self.per_element_s * elements
    }

    /// Half of it: a ring reduce-scatter or all-gather, half of a ring all-reduce's steps.
    fn half(self, bytes_ratio: f64) -> Self {
        CollectivePrice {
            fixed_s: self.fixed_s / 2.0,
            per_element_s: self.per_element_s / 2.0 * bytes_ratio,
        }
    }
}

/// How a gradient reduction over units runs, per element each member sums, so that it
/// can be cut into buckets: the fp32 all-reduce over the units' reducing members (units
/// split alike reduce share by share, side by side, priced over each unit's first
/// member; otherwise whole tensors over every member of every unit). Under the
/// distributed optimizer a reduction of units split alike over more than one rank is
/// sharded, as the runtime's: the gradients reduce-scattered (fp32) and, after the
/// step, the updated parameters all-gathered in their own dtype (whole-tensor
/// reductions keep the replicated optimizer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Collective {
    /// The fp32 all-reduce, per fp32 element.
    pub(super) all_reduce: CollectivePrice,
    /// Elements a member sums per parameter: its share where the units split alike.
    pub(super) share: f64,
    /// Ranks taking part, which the runtime's default bucket size scales with.
    pub(super) members: usize,
    /// Whether it sums whole tensors (units split otherwise), which the runtime sends in
    /// one bucket.
    pub(super) whole: bool,
    /// Whether the distributed optimizer shards it: a reduce-scatter, then a gather.
    pub(super) sharded: bool,
    /// Bytes of a parameter in the dtype the gather moves.
    pub(super) param_bytes: f64,
}

impl Collective {
    /// The gradient reduction: the all-reduce, or under the distributed optimizer its
    /// reduce-scatter half.
    pub(super) fn reduction(&self) -> CollectivePrice {
        match self.sharded {
            true => self.all_reduce.half(1.0),
            false => self.all_reduce,
        }
    }

    /// The distributed optimizer's all-gather of the updated parameters (their dtype),
    /// per element; `None` where the reduction is not sharded.
    pub(super) fn gather(&self) -> Option<CollectivePrice> {
        (self.sharded).then(|| self.all_reduce.half(self.param_bytes / 4.0))
    }
}
