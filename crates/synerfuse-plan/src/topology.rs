//! Ranks and their coordinates along the parallel dimensions, and the communication groups
//! built from them, exactly as Megatron core 0.8.0's `RankGenerator` builds them.
//!
//! An order string lists the dimensions fastest-varying first: with `tp-cp-ep-dp-pp`
//! (Megatron's default) consecutive ranks share a tensor-parallel group; with `tp-pp-dp`
//! (SynerFuse's `--use-tp-pp-dp-mapping`) each data-parallel replica is a contiguous block
//! of `tp · pp` ranks, so one replica can live on one device type.

use std::fmt;
use std::str::FromStr;

/// A parallel dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    /// Tensor parallel.
    Tp,
    /// Context parallel.
    Cp,
    /// Expert parallel (a split of the data-parallel dimension).
    Ep,
    /// Data parallel.
    Dp,
    /// Pipeline parallel.
    Pp,
}

impl Dim {
    /// Every dimension, in Megatron's `name_to_size` order (tp, pp, dp, ep, cp).
    const MEGATRON_ORDER: [Dim; 5] = [Dim::Tp, Dim::Pp, Dim::Dp, Dim::Ep, Dim::Cp];

    /// The order-string token.
    pub fn name(self) -> &'static str {
        match self {
            Dim::Tp => "tp",
            Dim::Cp => "cp",
            Dim::Ep => "ep",
            Dim::Dp => "dp",
            Dim::Pp => "pp",
        }
    }

    fn parse(token: &str) -> Option<Dim> {
        Some(match token {
            "tp" => Dim::Tp,
            "cp" => Dim::Cp,
            "ep" => Dim::Ep,
            "dp" => Dim::Dp,
            "pp" => Dim::Pp,
            _ => return None,
        })
    }
}

/// A kind of communication group: the ranks that agree on every coordinate outside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Tensor parallel.
    Tp,
    /// Pipeline parallel.
    Pp,
    /// Data parallel (all of it, experts included).
    Dp,
    /// Context parallel.
    Cp,
    /// Expert parallel.
    Ep,
    /// Data × context parallel (gradient reduction with context parallelism).
    DpCp,
    /// Model parallel: tensor × pipeline.
    TpPp,
    /// Tensor × data parallel.
    TpDp,
    /// Tensor × context parallel.
    TpCp,
    /// Tensor × data × context parallel.
    TpDpCp,
    /// Tensor × expert parallel.
    TpEp,
    /// Tensor × expert × pipeline parallel.
    TpEpPp,
    /// Data parallel among ranks holding the same experts (`dp` modulo `ep`).
    DpModuloEp,
    /// Data × context parallel modulo `ep`.
    DpCpModuloEp,
    /// First and last pipeline stage of each pipeline (tied embeddings).
    Embedding,
    /// First pipeline stage of each pipeline.
    PositionEmbedding,
}

impl GroupKind {
    /// Every kind.
    pub const ALL: [GroupKind; 16] = [
        GroupKind::Tp,
        GroupKind::Pp,
        GroupKind::Dp,
        GroupKind::Cp,
        GroupKind::Ep,
        GroupKind::DpCp,
        GroupKind::TpPp,
        GroupKind::TpDp,
        GroupKind::TpCp,
        GroupKind::TpDpCp,
        GroupKind::TpEp,
        GroupKind::TpEpPp,
        GroupKind::DpModuloEp,
        GroupKind::DpCpModuloEp,
        GroupKind::Embedding,
        GroupKind::PositionEmbedding,
    ];

    /// The name used in `synerfuse topology --json` and Megatron's `get_ranks` token.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tp => "tp",
            GroupKind::Pp => "pp",
            GroupKind::Dp => "dp",
            GroupKind::Cp => "cp",
            GroupKind::Ep => "ep",
            GroupKind::DpCp => "dp-cp",
            GroupKind::TpPp => "tp-pp",
            GroupKind::TpDp => "tp-dp",
            GroupKind::TpCp => "tp-cp",
            GroupKind::TpDpCp => "tp-dp-cp",
            GroupKind::TpEp => "tp-ep",
            GroupKind::TpEpPp => "tp-ep-pp",
            GroupKind::DpModuloEp => "dp-modulo-ep",
            GroupKind::DpCpModuloEp => "dp-cp-modulo-ep",
            GroupKind::Embedding => "embedding",
            GroupKind::PositionEmbedding => "position-embedding",
        }
    }

    /// The dimensions a group spans, and whether expert parallelism is split out of dp.
    fn dims(self) -> Option<(&'static [Dim], bool)> {
        Some(match self {
            GroupKind::Tp => (&[Dim::Tp], false),
            GroupKind::Pp => (&[Dim::Pp], false),
            GroupKind::Dp => (&[Dim::Dp], false),
            GroupKind::Cp => (&[Dim::Cp], false),
            GroupKind::Ep => (&[Dim::Ep], true),
            GroupKind::DpCp => (&[Dim::Dp, Dim::Cp], false),
            GroupKind::TpPp => (&[Dim::Tp, Dim::Pp], false),
            GroupKind::TpDp => (&[Dim::Tp, Dim::Dp], false),
            GroupKind::TpCp => (&[Dim::Tp, Dim::Cp], false),
            GroupKind::TpDpCp => (&[Dim::Tp, Dim::Dp, Dim::Cp], false),
            GroupKind::TpEp => (&[Dim::Tp, Dim::Ep], true),
            GroupKind::TpEpPp => (&[Dim::Tp, Dim::Ep, Dim::Pp], true),
            GroupKind::DpModuloEp => (&[Dim::Dp], true),
            GroupKind::DpCpModuloEp => (&[Dim::Dp, Dim::Cp], true),
            GroupKind::Embedding | GroupKind::PositionEmbedding => return None,
        })
    }
}

impl FromStr for GroupKind {
    type Err = TopologyError;
    fn from_str(s: &str) -> Result<Self, TopologyError> {
        GroupKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| TopologyError::UnknownGroup(s.to_owned()))
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Sizes and order that do not make a topology.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// A dimension of size 0.
    #[error("--{flag} is 0; every parallel size must be at least 1")]
    ZeroSize {
        /// The flag.
        flag: &'static str,
    },
    /// The world does not split into whole model replicas.
    #[error("world size {world_size} is not divisible by tensor ({tp}) × pipeline ({pp}) × context ({cp}) parallel size = {product}")]
    WorldNotDivisible {
        /// Ranks.
        world_size: usize,
        /// Tensor parallel size.
        tp: usize,
        /// Pipeline parallel size.
        pp: usize,
        /// Context parallel size.
        cp: usize,
        /// Their product.
        product: usize,
    },
    /// Experts must split the data-parallel replicas evenly.
    #[error("data-parallel size {dp} is not divisible by the expert-parallel size {ep}")]
    EpNotDividingDp {
        /// Data-parallel size.
        dp: usize,
        /// Expert-parallel size.
        ep: usize,
    },
    /// A token of the order string is not a dimension, or is repeated.
    #[error("order {order:?}: {problem}")]
    BadOrder {
        /// The order as given.
        order: String,
        /// What is wrong.
        problem: OrderProblem,
    },
    /// A group kind that does not exist.
    #[error("unknown group kind {0:?}")]
    UnknownGroup(String),
    /// A rank outside the world.
    #[error("rank {rank} is outside a world of {world_size}")]
    NoSuchRank {
        /// The rank.
        rank: usize,
        /// World size.
        world_size: usize,
    },
}

/// What is wrong with a rank-order string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OrderProblem {
    /// A token that is not a dimension.
    #[error("{0:?} is not one of tp, cp, ep, dp, pp")]
    UnknownDim(String),
    /// A dimension named twice.
    #[error("{0} appears twice")]
    Repeated(String),
    /// Expert parallelism apart from data parallelism.
    #[error("ep and dp must be adjacent")]
    EpApartFromDp,
    /// A dimension of size above 1 left out.
    #[error("{dim} has size {size} but is not in the order")]
    Missing {
        /// The dimension.
        dim: &'static str,
        /// Its size.
        size: usize,
    },
}

/// Megatron's default rank order.
pub const DEFAULT_ORDER: &str = "tp-cp-ep-dp-pp";
/// SynerFuse's `--use-tp-pp-dp-mapping` order.
pub const TP_PP_DP_ORDER: &str = "tp-pp-dp";

/// Parallel sizes and the rank order: which rank holds which coordinates.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Topology {
    tp: usize,
    cp: usize,
    ep: usize,
    dp: usize,
    pp: usize,
    order: String,
    /// The full order (missing size-1 dimensions appended), fastest first.
    full_order: Vec<Dim>,
}

impl Topology {
    /// A topology of `world_size` ranks: the data-parallel size is what remains after
    /// tensor, pipeline and context parallelism, as in Megatron.
    pub fn new(
        world_size: usize,
        tp: usize,
        pp: usize,
        cp: usize,
        ep: usize,
        order: &str,
    ) -> Result<Self, TopologyError> {
        for (flag, size) in [
            ("tensor-model-parallel-size", tp),
            ("pipeline-model-parallel-size", pp),
            ("context-parallel-size", cp),
            ("expert-model-parallel-size", ep),
        ] {
            if size == 0 {
                return Err(TopologyError::ZeroSize { flag });
            }
        }
        if world_size == 0 {
            return Err(TopologyError::ZeroSize { flag: "world-size" });
        }
        let product = tp * pp * cp;
        if world_size % product != 0 {
            return Err(TopologyError::WorldNotDivisible {
                world_size,
                tp,
                pp,
                cp,
                product,
            });
        }
        let dp = world_size / product;
        if dp % ep != 0 {
            return Err(TopologyError::EpNotDividingDp { dp, ep });
        }
        let topology = Topology {
            tp,
            cp,
            ep,
            dp,
            pp,
            order: order.to_owned(),
            full_order: Vec::new(),
        };
        let full_order = topology
            .full_order(order)
            .map_err(|problem| TopologyError::BadOrder {
                order: order.to_owned(),
                problem,
            })?;
        Ok(Topology {
            full_order,
            ..topology
        })
    }

    /// Every dimension in rank order: those of `order` (any case, `-`-separated), then
    /// Megatron's order for the dimensions of size 1 it leaves out.
    fn full_order(&self, order: &str) -> Result<Vec<Dim>, OrderProblem> {
        let mut full_order = Vec::new();
        for token in order.to_lowercase().split('-') {
            let dim = Dim::parse(token).ok_or_else(|| OrderProblem::UnknownDim(token.into()))?;
            if full_order.contains(&dim) {
                return Err(OrderProblem::Repeated(token.into()));
            }
            full_order.push(dim);
        }
        if let Some(at) = full_order.iter().position(|&d| d == Dim::Ep) {
            let adjacent = |i: Option<usize>| i.and_then(|i| full_order.get(i)) == Some(&Dim::Dp);
            if !adjacent(at.checked_sub(1)) && !adjacent(Some(at + 1)) {
                return Err(OrderProblem::EpApartFromDp);
            }
        }
        for dim in Dim::MEGATRON_ORDER {
            if !full_order.contains(&dim) {
                let size = self.size(dim);
                if size != 1 {
                    return Err(OrderProblem::Missing {
                        dim: dim.name(),
                        size,
                    });
                }
                full_order.push(dim);
            }
        }
        Ok(full_order)
    }

    /// Size of a dimension (`dp` is the whole data-parallel size, experts included).
    pub fn size(&self, dim: Dim) -> usize {
        match dim {
            Dim::Tp => self.tp,
            Dim::Cp => self.cp,
            Dim::Ep => self.ep,
            Dim::Dp => self.dp,
            Dim::Pp => self.pp,
        }
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// The order as given.
    pub fn order(&self) -> &str {
        &self.order
    }

    /// The dimensions and sizes rank numbers are built from, fastest first; with
    /// `split_ep`, dp is split into `ep` and `dp / ep`.
    fn shape(&self, split_ep: bool) -> Vec<(Dim, usize)> {
        self.full_order
            .iter()
            .filter_map(|&d| match d {
                Dim::Ep if !split_ep => None,
                Dim::Ep => Some((Dim::Ep, self.ep)),
                Dim::Dp if split_ep => Some((Dim::Dp, self.dp / self.ep)),
                d => Some((d, self.size(d))),
            })
            .collect()
    }

    /// Coordinates of `rank` along tp, cp, dp and pp (and its expert rank within dp).
    pub fn coordinates(&self, rank: usize) -> Result<Coordinates, TopologyError> {
        if rank >= self.world_size() {
            return Err(TopologyError::NoSuchRank {
                rank,
                world_size: self.world_size(),
            });
        }
        let mut c = Coordinates::default();
        let mut rest = rank;
        for (dim, size) in self.shape(false) {
            let value = rest % size;
            rest /= size;
            match dim {
                Dim::Tp => c.tp = value,
                Dim::Cp => c.cp = value,
                Dim::Dp => c.dp = value,
                Dim::Pp => c.pp = value,
                Dim::Ep => {}
            }
        }
        let mut rest = rank;
        for (dim, size) in self.shape(true) {
            if dim == Dim::Ep {
                c.ep = rest % size;
            }
            rest /= size;
        }
        Ok(c)
    }

    /// The rank at coordinates `c` (its `ep` field is ignored: it follows from `dp`).
    pub fn rank(&self, c: &Coordinates) -> Option<usize> {
        let mut rank = 0;
        let mut stride = 1;
        for (dim, size) in self.shape(false) {
            let value = match dim {
                Dim::Tp => c.tp,
                Dim::Cp => c.cp,
                Dim::Dp => c.dp,
                Dim::Pp => c.pp,
                Dim::Ep => 0,
            };
            if value >= size {
                return None;
            }
            rank += value * stride;
            stride *= size;
        }
        Some(rank)
    }

    /// Every group of a kind, each in Megatron's member order.
    pub fn groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        match kind.dims() {
            Some((dims, split_ep)) => self.masked_groups(dims, split_ep),
            None => self
                .masked_groups(&[Dim::Pp], false)
                .into_iter()
                .map(|pipeline| match (kind, pipeline.len()) {
                    (_, 1) => pipeline,
                    (GroupKind::Embedding, _) => vec![pipeline[0], pipeline[pipeline.len() - 1]],
                    _ => vec![pipeline[0]],
                })
                .collect(),
        }
    }

    /// The group of `kind` that holds `rank`.
    pub fn group_of(&self, kind: GroupKind, rank: usize) -> Option<Vec<usize>> {
        self.groups(kind).into_iter().find(|g| g.contains(&rank))
    }

    /// Megatron's `generate_masked_orthogonal_rank_groups`: ranks that agree on every
    /// coordinate outside `dims`, enumerated with the masked coordinates fastest-first.
    fn masked_groups(&self, dims: &[Dim], split_ep: bool) -> Vec<Vec<usize>> {
        let shape = self.shape(split_ep);
        let mut stride = 1;
        let mut masked = Vec::new();
        let mut unmasked = Vec::new();
        for &(dim, size) in &shape {
            if dims.contains(&dim) {
                masked.push((size, stride));
            } else {
                unmasked.push((size, stride));
            }
            stride *= size;
        }
        let group_size: usize = masked.iter().map(|(s, _)| s).product();
        let groups = self.world_size() / group_size;
        let compose = |mut index: usize, dims: &[(usize, usize)]| -> usize {
            let mut offset = 0;
            for &(size, stride) in dims {
                offset += (index % size) * stride;
                index /= size;
            }
            offset
        };
        (0..groups)
            .map(|g| {
                let base = compose(g, &unmasked);
                (0..group_size)
                    .map(|r| base + compose(r, &masked))
                    .collect()
            })
            .collect()
    }

    /// The next rank in `rank`'s pipeline (wrapping around, as Megatron's
    /// `get_pipeline_model_parallel_next_rank`).
    pub fn next_pipeline_rank(&self, rank: usize) -> Result<usize, TopologyError> {
        let c = self.coordinates(rank)?;
        let next = Coordinates {
            pp: (c.pp + 1) % self.pp,
            ..c
        };
        Ok(self.rank(&next).expect("in range"))
    }

    /// The previous rank in `rank`'s pipeline (wrapping around).
    pub fn previous_pipeline_rank(&self, rank: usize) -> Result<usize, TopologyError> {
        let c = self.coordinates(rank)?;
        let previous = Coordinates {
            pp: (c.pp + self.pp - 1) % self.pp,
            ..c
        };
        Ok(self.rank(&previous).expect("in range"))
    }

    /// Whether `rank` runs the first pipeline stage.
    pub fn is_first_stage(&self, rank: usize) -> Result<bool, TopologyError> {
        Ok(self.coordinates(rank)?.pp == 0)
    }

    /// Whether `rank` runs the last pipeline stage.
    pub fn is_last_stage(&self, rank: usize) -> Result<bool, TopologyError> {
        Ok(self.coordinates(rank)?.pp == self.pp - 1)
    }
}

/// A rank's position along each dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Coordinates {
    /// Tensor-parallel rank.
    pub tp: usize,
    /// Context-parallel rank.
    pub cp: usize,
    /// Expert-parallel rank.
    pub ep: usize,
    /// Data-parallel rank (replica).
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// SynerFuse's rank table: world 8, TP 2, PP 2, DP 2, both orders.
    #[test]
    fn spec_table() {
        let default = Topology::new(8, 2, 2, 1, 1, DEFAULT_ORDER).unwrap();
        let mapped = Topology::new(8, 2, 2, 1, 1, TP_PP_DP_ORDER).unwrap();
        let g = |t: &Topology, k| t.groups(k);
        assert_eq!(g(&default, GroupKind::Tp), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(g(&mapped, GroupKind::Tp), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(g(&default, GroupKind::Pp), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(g(&mapped, GroupKind::Pp), [[0, 2], [1, 3], [4, 6], [5, 7]]);
        assert_eq!(g(&default, GroupKind::Dp), [[0, 2], [1, 3], [4, 6], [5, 7]]);
        assert_eq!(g(&mapped, GroupKind::Dp), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(g(&default, GroupKind::TpPp), [[0, 1, 4, 5], [2, 3, 6, 7]]);
        assert_eq!(g(&mapped, GroupKind::TpPp), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_eq!(
            g(&default, GroupKind::Embedding),
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        );
        assert_eq!(
            g(&mapped, GroupKind::Embedding),
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        );
        assert_eq!(
            g(&mapped, GroupKind::PositionEmbedding),
            [[0], [1], [4], [5]]
        );
        // Replica of rank r in tp-pp-dp order: r / (tp·pp).
        for r in 0..8 {
            assert_eq!(mapped.coordinates(r).unwrap().dp, r / 4);
        }
        assert_eq!(mapped.next_pipeline_rank(0).unwrap(), 2);
        assert_eq!(mapped.next_pipeline_rank(2).unwrap(), 0);
        assert!(mapped.is_last_stage(3).unwrap() && mapped.is_first_stage(5).unwrap());
    }

    #[test]
    fn loud_errors() {
        let e = Topology::new(12, 2, 4, 1, 1, DEFAULT_ORDER).unwrap_err();
        assert!(
            e.to_string().contains("12") && e.to_string().contains("8"),
            "{e}"
        );
        let e = Topology::new(8, 1, 1, 1, 3, DEFAULT_ORDER).unwrap_err();
        assert_eq!(e, TopologyError::EpNotDividingDp { dp: 8, ep: 3 });
        let e = Topology::new(8, 1, 1, 1, 2, "tp-ep-cp-dp-pp").unwrap_err();
        assert!(e.to_string().contains("adjacent"), "{e}");
        let e = Topology::new(8, 2, 2, 2, 1, TP_PP_DP_ORDER).unwrap_err();
        assert!(e.to_string().contains("cp has size 2"), "{e}");
        assert!(Topology::new(8, 2, 2, 1, 1, "tp-pp-xx").is_err());
        assert!(Topology::new(8, 0, 2, 1, 1, DEFAULT_ORDER).is_err());
    }

    fn topology() -> impl Strategy<Value = Topology> {
        (
            1usize..4,
            1usize..4,
            1usize..3,
            1usize..3,
            1usize..4,
            any::<bool>(),
        )
            .prop_filter_map("valid", |(tp, pp, cp, ep, dp_per_ep, mapped)| {
                let dp = ep * dp_per_ep;
                let order = if mapped && cp == 1 && ep == 1 {
                    TP_PP_DP_ORDER
                } else {
                    DEFAULT_ORDER
                };
                Topology::new(tp * pp * cp * dp, tp, pp, cp, ep, order).ok()
            })
    }

    proptest! {
        #[test]
        fn groups_partition_the_world(t in topology()) {
            for kind in GroupKind::ALL {
                let groups = t.groups(kind);
                let mut seen = vec![0; t.world_size()];
                for g in &groups {
                    for &r in g {
                        seen[r] += 1;
                    }
                }
                match kind {
                    GroupKind::Embedding | GroupKind::PositionEmbedding => {
                        prop_assert!(seen.iter().all(|&c| c <= 1));
                    }
                    _ => {
                        prop_assert!(seen.iter().all(|&c| c == 1), "{kind}");
                        let expected: usize = match kind {
                            GroupKind::Tp => t.size(Dim::Tp),
                            GroupKind::Pp => t.size(Dim::Pp),
                            GroupKind::Dp => t.size(Dim::Dp),
                            GroupKind::Cp => t.size(Dim::Cp),
                            GroupKind::Ep => t.size(Dim::Ep),
                            GroupKind::DpCp => t.size(Dim::Dp) * t.size(Dim::Cp),
                            GroupKind::TpPp => t.size(Dim::Tp) * t.size(Dim::Pp),
                            GroupKind::TpDp => t.size(Dim::Tp) * t.size(Dim::Dp),
                            GroupKind::TpCp => t.size(Dim::Tp) * t.size(Dim::Cp),
                            GroupKind::TpDpCp => t.size(Dim::Tp) * t.size(Dim::Dp) * t.size(Dim::Cp),
                            GroupKind::TpEp => t.size(Dim::Tp) * t.size(Dim::Ep),
                            GroupKind::TpEpPp => t.size(Dim::Tp) * t.size(Dim::Ep) * t.size(Dim::Pp),
                            GroupKind::DpModuloEp => t.size(Dim::Dp) / t.size(Dim::Ep),
                            GroupKind::DpCpModuloEp => t.size(Dim::Dp) / t.size(Dim::Ep) * t.size(Dim::Cp),
                            _ => unreachable!(),
                        };
                        prop_assert!(groups.iter().all(|g| g.len() == expected), "{kind}");
                    }
                }
            }
        }

        #[test]
        fn coordinates_round_trip(t in topology()) {
            for r in 0..t.world_size() {
                let c = t.coordinates(r).unwrap();
                prop_assert_eq!(t.rank(&c), Some(r));
                // A rank's groups hold exactly the ranks agreeing with it outside the group.
                let tp_group = t.group_of(GroupKind::Tp, r).unwrap();
                for &other in &tp_group {
                    let o = t.coordinates(other).unwrap();
                    prop_assert_eq!((o.cp, o.dp, o.pp), (c.cp, c.dp, c.pp));
                }
                let next = t.next_pipeline_rank(r).unwrap();
                prop_assert_eq!(t.previous_pipeline_rank(next).unwrap(), r);
            }
            prop_assert!(t.coordinates(t.world_size()).is_err());
        }
    }
}
