//! The grid codec: SynerFuse's and Megatron's flags to a [`Plan`], and a grid-shaped
//! `Plan` back to its flags. A grid keeps its rank order (Megatron's default or
//! SynerFuse's tp-pp-dp), so a plan from flags runs on the ranks the flags mean.

use super::{ExpertHolding, Plan, PlanError, ReplicaPipeline};
use crate::flags::{GridPlan, TopologySpec};
use crate::{PlanFlags, RankPlacement, DEFAULT_ORDER, TP_PP_DP_ORDER};

/// The flags of a grid-shaped plan, and its rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GridFlags {
    /// SynerFuse's (and Megatron's) flags for the plan (device placements are not flags;
    /// SynerFuse takes them from the launcher).
    pub args: Vec<String>,
    /// The grid's rank order, fastest dimension first (`tp-pp-dp` with
    /// `--use-tp-pp-dp-mapping`).
    pub rank_order: String,
}

impl Plan {
    /// The plan SynerFuse's and Megatron's parallel flags describe for a world of
    /// `world_size` ranks, on the grid's own rank order.
    pub fn from_flags(flags: &PlanFlags, world_size: usize) -> Result<Self, PlanError> {
        Self::from_grid(&GridPlan::from_flags(flags, world_size)?)
    }

    /// Whether Megatron's grid (one stage layout, one tensor-parallel size) expresses this
    /// plan, whatever its batches.
    pub fn is_grid(&self) -> bool {
        self.to_grid().is_some()
    }

    /// The flags that give this plan's layout, when it is a grid (every replica the same
    /// stages, even tensor parallelism, ranks in one of Megatron's orders, micro-batches
    /// of one size within each replica); `None` otherwise. Which stages recompute is not a layout: SynerFuse's
    /// `--recompute-activations` recomputes every stage or none.
    pub fn grid_flags(&self) -> Option<GridFlags> {
        let grid = self.to_grid().filter(|grid| grid.batches.is_uniform())?;
        Some(GridFlags {
            args: grid.to_synerfuse_args(),
            rank_order: grid.topology.order,
        })
    }

    /// The general form of a grid plan (tensor and context parallelism even on every
    /// stage, experts in even parts over consecutive replicas), on the grid's own ranks.
    pub(crate) fn from_grid(plan: &GridPlan) -> Result<Self, PlanError> {
        let t = &plan.topology;
        let topology = plan.topology()?;
        let rank_of = |dp: usize, pp: usize, cp: usize, tp: usize| {
            topology
                .rank(&crate::Coordinates {
                    tp,
                    cp,
                    ep: 0,
                    dp,
                    pp,
                })
                .expect("coordinates within the grid")
        };
        let replicas = plan
            .batches
            .replicas()
            .iter()
            .enumerate()
            .map(|(dp, batch)| {
                let stage_ranks = |pp| {
                    (0..t.cp)
                        .flat_map(|cp| (0..t.tp).map(move |tp| rank_of(dp, pp, cp, tp)))
                        .collect()
                };
                let ranks: Vec<Vec<usize>> = (0..t.pp).map(stage_ranks).collect();
                ReplicaPipeline {
                    stages: plan.stages.clone(),
                    batch: batch.clone(),
                    placements: ranks
                        .iter()
                        .flatten()
                        .filter_map(|&rank| plan.ranks.get(rank).cloned())
                        .collect(),
                    ranks,
                    tp_shares: Vec::new(),
                    cp: match t.cp {
                        1 => Vec::new(),
                        cp => vec![cp; t.pp],
                    },
                    cp_shares: Vec::new(),
                    recompute: Vec::new(),
                    experts: Vec::new(),
                }
            })
            .collect();
        // Megatron's expert-parallel groups: consecutive data-parallel ranks.
        match t.ep {
            1 => Self::new(replicas),
            ep => Self::new(replicas)?.with_even_experts(ep),
        }
    }

    /// The grid this plan is, when every replica has the same stages and the ranks follow
    /// one of Megatron's orders (tp-pp-dp: replica by replica, or the default: stage by
    /// stage), recomputation aside; `None` for a plan only the general form expresses.
    pub(crate) fn to_grid(&self) -> Option<GridPlan> {
        let stages = &self.replicas()[0].stages;
        let (tp, cp) = (self.replicas()[0].tp_size(0), self.replicas()[0].cp_size(0));
        let even = |r: &ReplicaPipeline| {
            (0..r.stages.num_stages()).all(|s| {
                r.tp_size(s) == tp
                    && r.shares(s) == vec![1; tp]
                    && r.cp_size(s) == cp
                    && r.context_shares(s).is_none()
            })
        };
        if self
            .replicas()
            .iter()
            .any(|r| &r.stages != stages || !even(r))
        {
            return None;
        }
        let ep = self.even_expert_parallel()?;
        let mut placements = vec![None; self.world_size()];
        for replica in self.replicas() {
            for (rank, placement) in replica.all_ranks().zip(&replica.placements) {
                placements[rank] = Some(placement.clone());
            }
        }
        let ranks: Vec<RankPlacement> = match placements.iter().all(Option::is_some) {
            true => placements.into_iter().flatten().collect(),
            false if placements.iter().all(Option::is_none) => Vec::new(),
            false => return None,
        };
        [TP_PP_DP_ORDER, DEFAULT_ORDER]
            .into_iter()
            .find_map(|order| {
                let spec = TopologySpec {
                    world_size: self.world_size(),
                    tp,
                    pp: stages.num_stages(),
                    cp,
                    ep,
                    order: order.to_owned(),
                };
                let grid =
                    GridPlan::new(spec, stages.clone(), self.batches(), ranks.clone()).ok()?;
                // Experts compared by what each replica holds (above).
                let same = |a: &ReplicaPipeline, b: &ReplicaPipeline| {
                    ReplicaPipeline {
                        recompute: b.recompute.clone(),
                        experts: b.experts.clone(),
                        ..a.clone()
                    } == *b
                };
                let general = Plan::from_grid(&grid).ok()?;
                (general.replicas().iter().zip(self.replicas()))
                    .all(|(a, b)| same(a, b))
                    .then_some(grid)
            })
    }

    /// The expert-parallel size whose even parts over consecutive replicas (Megatron's
    /// `--expert-model-parallel-size`) are what this plan's replicas hold (1: none
    /// divides its experts); `None` when they hold other parts.
    fn even_expert_parallel(&self) -> Option<usize> {
        let holdings: Vec<&ExpertHolding> = (self.replicas().iter())
            .flat_map(|r| r.experts.iter().flatten())
            .collect();
        let Some(first) = holdings.first() else {
            return Some(1);
        };
        // The experts a listed part names tell the model's count.
        let listed = (holdings.iter())
            .filter_map(|h| match h {
                ExpertHolding::Listed(list) => list.iter().max().map(|&x| x + 1),
                ExpertHolding::EvenShare { .. } => None,
            })
            .max()
            .unwrap_or(0);
        let ep = match first {
            ExpertHolding::EvenShare { members, .. } => *members,
            ExpertHolding::Listed(list) if !list.is_empty() && listed % list.len() == 0 => {
                listed / list.len()
            }
            ExpertHolding::Listed(_) => return None,
        };
        let e = listed.max(ep);
        if ep == 0 || e % ep != 0 || self.replicas().len() % ep != 0 {
            return None;
        }
        let holds_even = |(r, replica): (usize, &ReplicaPipeline)| {
            let part = ExpertHolding::EvenShare {
                member: r % ep,
                members: ep,
            }
            .experts(e);
            (0..replica.stages.num_stages())
                .all(|s| matches!(replica.experts.get(s), Some(Some(h)) if h.experts(e) == part))
        };
        (self.replicas().iter().enumerate())
            .all(holds_even)
            .then_some(ep)
    }
}
