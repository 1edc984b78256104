//! What to plan for: the request and the options a plan may use.

use crate::cost::{CostModel, Recompute};
use std::collections::BTreeSet;

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// `--global-batch-size`.
    pub global_batch_size: usize,
    /// Micro-batch sizes to try.
    pub micro_batch_sizes: Vec<usize>,
    /// Plans to keep.
    pub top_k: usize,
    /// Tensor-parallel sizes to try for per-replica pipelines (within a node; empty: 1).
    pub tensor_parallel_sizes: Vec<usize>,
    /// Context-parallel sizes to try for grid plans beside 1 (within a node), each in the
    /// token shares that suit its devices: only where memory rules out plans without
    /// (splitting sequences saves activation memory at the price of exchanging keys and
    /// values, as recomputation saves it at the price of time).
    pub context_parallel_sizes: Vec<usize>,
    /// Whether plans recompute activations (auto: the stages that need it).
    pub recompute: Choice,
    /// Whether plans shard the optimizer over each stage's (or segment's) holders, priced
    /// alike for grid plans and per-replica pipelines (the latter searched without it:
    /// it only lowers their memory).
    pub distributed_optimizer: Choice,
    /// Expert-parallel sizes to try for a mixture of experts (those dividing the experts
    /// and the replicas; empty: 1): each MoE layer's experts divided over that many
    /// consecutive replicas (of grid plans; of one pool of alike devices in per-replica
    /// pipelines), placed by their pace and memory.
    pub expert_parallel_sizes: Vec<usize>,
}

/// Whether a plan uses an option: never, always, or where it makes the plan fit or
/// faster (ties go to off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Choice {
    /// Never.
    Off,
    /// Always.
    On,
    /// Both tried.
    #[default]
    Auto,
}

/// A choice other than `auto`, `on` or `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected auto, on or off")]
pub struct ChoiceError(pub String);

impl std::str::FromStr for Choice {
    type Err = ChoiceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(Choice::Auto),
            "on" => Ok(Choice::On),
            "off" => Ok(Choice::Off),
            _ => Err(ChoiceError(text.to_owned())),
        }
    }
}

impl Choice {
    pub(super) fn values(self) -> &'static [bool] {
        match self {
            Choice::Off => &[false],
            Choice::On => &[true],
            Choice::Auto => &[false, true],
        }
    }

    /// As a choice of which stages recompute: off none, on all, auto none and then
    /// those that need it.
    pub(super) fn recompute(self) -> &'static [Recompute] {
        match self {
            Choice::Off => &[Recompute::Never],
            Choice::On => &[Recompute::Always],
            Choice::Auto => &[Recompute::Never, Recompute::WhereNeeded],
        }
    }
}

/// How a plan trains beside its layout: what its memory and time were priced with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TrainOptions {
    /// Which stages may recompute their activations (the plan file says which do).
    pub recompute: Recompute,
    /// `--use-distributed-optimizer`.
    pub distributed_optimizer: bool,
    /// Replicas each MoE layer's experts are divided over (1: every replica holds all;
    /// the plan file lists each one's).
    pub expert_parallel: usize,
    /// Gradient buckets started inside the last backward (the runtime's default; off:
    /// `--no-overlap-grad-reduce`).
    pub overlap_grad_reduce: bool,
    /// `--ddp-bucket-size` (elements; `None`: the runtime's default).
    pub ddp_bucket_size: Option<usize>,
    /// `--overlap-param-gather` (with the distributed optimizer and the overlapped
    /// reduction only, as the runtime's).
    pub overlap_param_gather: bool,
    /// Reductions across nodes island by island (off: `--no-hierarchical-reduction`).
    pub hierarchical_reduction: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            recompute: Recompute::Never,
            distributed_optimizer: false,
            expert_parallel: 1,
            overlap_grad_reduce: true,
            ddp_bucket_size: None,
            overlap_param_gather: false,
            hierarchical_reduction: true,
        }
    }
}

impl TrainOptions {
    /// The options `cost` prices with.
    pub fn of(cost: &CostModel) -> Self {
        TrainOptions {
            recompute: cost.recompute,
            distributed_optimizer: cost.distributed_optimizer,
            expert_parallel: cost.expert_parallel,
            overlap_grad_reduce: cost.overlap_grad_reduce,
            ddp_bucket_size: cost.ddp_bucket_size,
            overlap_param_gather: cost.overlap_param_gather,
            hierarchical_reduction: cost.hierarchical_reduction,
        }
    }

    /// `cost` priced with these options.
    pub fn cost(&self, cost: &CostModel) -> CostModel {
        CostModel {
            recompute: self.recompute,
            distributed_optimizer: self.distributed_optimizer,
            expert_parallel: self.expert_parallel,
            overlap_grad_reduce: self.overlap_grad_reduce,
            ddp_bucket_size: self.ddp_bucket_size,
            overlap_param_gather: self.overlap_param_gather,
            hierarchical_reduction: self.hierarchical_reduction,
            ..cost.clone()
        }
    }

    /// Elements per bucket of a gradient reduction over `members` ranks, as the runtime
    /// cuts them ([`crate::cost::bucket_size`]).
    pub fn bucket_size(&self, members: usize) -> usize {
        crate::cost::bucket_size(self.overlap_grad_reduce, self.ddp_bucket_size, members)
    }

    /// The `synerfuse train` flags that ask for them beside `--plan` (which stages
    /// recompute is in the plan file; the reduction's only where not the default), so
    /// training runs what was priced.
    pub fn train_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        if self.distributed_optimizer {
            flags.push("--use-distributed-optimizer".to_owned());
        }
        if !self.overlap_grad_reduce {
            // Without overlap the bucket size changes nothing (one bucket).
            flags.push("--no-overlap-grad-reduce".to_owned());
        } else if let Some(size) = self.ddp_bucket_size {
            flags.extend(["--ddp-bucket-size".to_owned(), size.to_string()]);
        }
        if self.overlaps_param_gather() {
            flags.push("--overlap-param-gather".to_owned());
        }
        if !self.hierarchical_reduction {
            flags.push("--no-hierarchical-reduction".to_owned());
        }
        flags
    }

    /// Whether the parameter gathers overlap the next forward: asked for, and possible
    /// (the runtime's needs: the distributed optimizer and the overlapped reduction; a
    /// plan searched without the distributed optimizer gathers nothing).
    pub fn overlaps_param_gather(&self) -> bool {
        self.overlap_param_gather && self.distributed_optimizer && self.overlap_grad_reduce
    }
}

impl PlanRequest {
    /// The options grid plans are searched with, off before on, expert-parallel sizes
    /// ascending (those dividing `experts` per MoE layer; a dense model's: 1), each
    /// reducing gradients as `base` does (not searched: how training will run).
    pub(super) fn grid_options(
        &self,
        experts: Option<usize>,
        base: TrainOptions,
    ) -> Vec<TrainOptions> {
        let sizes: BTreeSet<usize> = match experts {
            Some(e) if !self.expert_parallel_sizes.is_empty() => {
                let divides = |&&x: &&usize| x > 0 && e % x == 0;
                self.expert_parallel_sizes
                    .iter()
                    .filter(divides)
                    .copied()
                    .collect()
            }
            _ => BTreeSet::from([1]),
        };
        let mut options = Vec::new();
        for expert_parallel in sizes {
            for &distributed_optimizer in self.distributed_optimizer.values() {
                for &recompute in self.recompute.recompute() {
                    options.push(TrainOptions {
                        recompute,
                        distributed_optimizer,
                        expert_parallel,
                        ..base
                    });
                }
            }
        }
        options
    }

    /// The distinct context-parallel sizes above 1, ascending.
    pub(super) fn cp_sizes(&self) -> Vec<usize> {
        let sizes: BTreeSet<usize> = (self.context_parallel_sizes.iter())
            .copied()
            .filter(|&c| c > 1)
            .collect();
        sizes.into_iter().collect()
    }

    /// The distinct positive tensor-parallel sizes, ascending (1 when none).
    pub(super) fn tp_sizes(&self) -> Vec<usize> {
        let sizes: BTreeSet<usize> = (self.tensor_parallel_sizes.iter())
            .copied()
            .filter(|&t| t > 0)
            .collect();
        match sizes.is_empty() {
            true => vec![1],
            false => sizes.into_iter().collect(),
        }
    }
}

/// The request's distinct positive micro-batch sizes, ascending (1 when none).
pub(super) fn micro_batch_sizes(request: &PlanRequest) -> Vec<usize> {
    let sizes: BTreeSet<usize> = request
        .micro_batch_sizes
        .iter()
        .copied()
        .filter(|&b| b > 0)
        .collect();
    if sizes.is_empty() {
        vec![1]
    } else {
        sizes.into_iter().collect()
    }
}
