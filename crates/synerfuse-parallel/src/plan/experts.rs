//! Expert parallelism in a plan: replicas that each hold some experts of every MoE layer
//! form expert-parallel groups, whose members exchange each MoE layer's tokens. A group
//! is consecutive replicas (Megatron's: consecutive data-parallel ranks) that between
//! them hold every expert once at every stage; its members run alike (the same layers
//! per stage and chunk, tensor- and context-parallel sizes, micro-batch count), so that
//! they reach each exchange at the same pass.

use super::{ExpertHolding, Plan, PlanError};

/// One expert-parallel group: its replicas, and what each member's stage holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertGroupPlan {
    /// The member replicas, in member order.
    pub replicas: Vec<usize>,
    /// Per stage, each member's experts (member order).
    pub placement: Vec<Vec<Vec<usize>>>,
}

impl Plan {
    /// The expert-parallel groups for a model of `num_experts` experts per MoE layer
    /// (none when every replica holds every expert), checked: each group's members hold
    /// every expert exactly once at every stage, at least one each, and run alike.
    pub fn expert_groups(&self, num_experts: usize) -> Result<Vec<ExpertGroupPlan>, PlanError> {
        let holdings = self
            .replicas()
            .iter()
            .enumerate()
            .flat_map(|(r, replica)| replica.experts.iter().flatten().map(move |h| (r, h)));
        for (r, holding) in holdings {
            if let ExpertHolding::EvenShare { members, .. } = holding {
                if num_experts % members != 0 {
                    return Err(PlanError::ExpertGroup {
                        replicas: vec![r],
                        problem: format!(
                            "--expert-model-parallel-size {members} does not divide the {num_experts} experts (--num-experts)"
                        ),
                    });
                }
            }
        }
        let mut groups = Vec::new();
        let mut open: Vec<usize> = Vec::new();
        for (r, replica) in self.replicas().iter().enumerate() {
            if !replica.splits_experts() {
                if !open.is_empty() {
                    return Err(self.incomplete(open, num_experts));
                }
                continue;
            }
            open.push(r);
            let held: usize = (open.iter())
                .map(|&m| {
                    self.replicas()[m]
                        .experts(0, num_experts)
                        .map_or(0, |e| e.len())
                })
                .sum();
            if held >= num_experts {
                groups.push(self.expert_group(std::mem::take(&mut open), num_experts)?);
            }
        }
        match open.is_empty() {
            true => Ok(groups),
            false => Err(self.incomplete(open, num_experts)),
        }
    }

    fn incomplete(&self, replicas: Vec<usize>, num_experts: usize) -> PlanError {
        PlanError::ExpertGroup {
            replicas,
            problem: format!(
                "they hold fewer than the model's {num_experts} experts between them; the replicas of an expert-parallel group follow each other and together hold every expert once"
            ),
        }
    }

    /// The group of `replicas`, checked.
    fn expert_group(
        &self,
        replicas: Vec<usize>,
        num_experts: usize,
    ) -> Result<ExpertGroupPlan, PlanError> {
        let error = |problem: String| PlanError::ExpertGroup {
            replicas: replicas.clone(),
            problem,
        };
        let first = &self.replicas()[replicas[0]];
        let stages = first.stages.num_stages();
        for &m in &replicas[1..] {
            let r = &self.replicas()[m];
            let alike = r.stages == first.stages
                && r.batch.sizes().len() == first.batch.sizes().len()
                && (0..stages).all(|s| r.tp_size(s) == first.tp_size(s))
                && (0..stages).all(|s| r.cp_size(s) == first.cp_size(s))
                && (0..stages).all(|s| r.recomputes(s) == first.recomputes(s));
            if !alike {
                return Err(error(format!(
                    "replica {m} runs otherwise than replica {}: the members of an expert-parallel group need the same layers per stage, tensor- and context-parallel sizes, recomputation and number of micro-batches (their micro-batch sizes may differ)",
                    replicas[0]
                )));
            }
        }
        let mut placement = Vec::with_capacity(stages);
        for stage in 0..stages {
            let members: Vec<Vec<usize>> = (replicas.iter())
                .map(|&m| {
                    (self.replicas()[m].experts(stage, num_experts))
                        .unwrap_or_else(|| (0..num_experts).collect())
                })
                .collect();
            let mut seen = vec![0usize; num_experts];
            for &e in members.iter().flatten() {
                match seen.get_mut(e) {
                    Some(n) => *n += 1,
                    None => {
                        return Err(error(format!(
                            "stage {stage}: expert {e} of a model of {num_experts} experts"
                        )))
                    }
                }
            }
            if seen.iter().any(|&n| n != 1) || members.iter().any(Vec::is_empty) {
                return Err(error(format!(
                    "stage {stage}: the members hold {members:?}; each needs at least one expert and every one of the {num_experts} experts must be held once"
                )));
            }
            placement.push(members);
        }
        Ok(ExpertGroupPlan {
            replicas,
            placement,
        })
    }

    /// This plan with consecutive groups of `size` replicas each holding an even part
    /// of every stage's experts (Megatron's `--expert-model-parallel-size`).
    pub fn with_even_experts(mut self, size: usize) -> Result<Self, PlanError> {
        let replicas = self.replicas.len();
        if size == 0 || replicas % size != 0 {
            return Err(PlanError::ExpertGroup {
                replicas: (0..replicas).collect(),
                problem: format!(
                    "--expert-model-parallel-size {size} does not divide the {replicas} data-parallel replicas"
                ),
            });
        }
        for (r, replica) in self.replicas.iter_mut().enumerate() {
            let holding = ExpertHolding::EvenShare {
                member: r % size,
                members: size,
            };
            replica.experts = vec![Some(holding); replica.stages.num_stages()];
        }
        Ok(self)
    }

    /// The replicas holding `expert` of MoE layer `layer` (in the stage that holds the
    /// layer), for a model of `num_experts` experts per MoE layer.
    pub fn expert_holders(&self, layer: usize, expert: usize, num_experts: usize) -> Vec<usize> {
        (self.replicas().iter().enumerate())
            .filter(|(_, r)| {
                let stages = &r.stages;
                let stage = (0..stages.num_stages()).find(|&s| {
                    (0..stages.num_chunks())
                        .any(|c| stages.chunk_range(s, c).is_some_and(|l| l.contains(&layer)))
                });
                stage.is_some_and(|s| {
                    (r.experts(s, num_experts)).is_none_or(|held| held.contains(&expert))
                })
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// The expert-parallel group of `rank` and its index in it: the ranks at its
    /// position (stage, tensor- and context-parallel rank) in every member replica, in
    /// member order, with its stage's placement. `None` outside any group.
    pub fn expert_ranks(
        &self,
        groups: &[ExpertGroupPlan],
        rank: usize,
    ) -> Option<(Vec<usize>, Vec<Vec<usize>>)> {
        let (replica, stage) = self.position(rank)?;
        let group = groups.iter().find(|g| g.replicas.contains(&replica))?;
        let at = (self.replicas()[replica].ranks[stage].iter()).position(|&r| r == rank)?;
        let ranks = (group.replicas.iter())
            .map(|&m| self.replicas()[m].ranks[stage][at])
            .collect();
        Some((ranks, group.placement[stage].clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ReplicaBatch, ReplicaPipeline, StageLayout};

    fn replica(
        layers: &[usize],
        count: usize,
        first: usize,
        experts: Option<Vec<Vec<usize>>>,
    ) -> ReplicaPipeline {
        let stages = StageLayout::new(layers.to_vec(), layers.iter().sum()).unwrap();
        let n = layers.len();
        let mut r = ReplicaPipeline::single_ranks(
            stages,
            ReplicaBatch::uniform(1, count),
            (first..first + n).collect(),
            Vec::new(),
        );
        r.experts = experts
            .map(|e| {
                e.into_iter()
                    .map(|x| Some(ExpertHolding::Listed(x)))
                    .collect()
            })
            .unwrap_or_default();
        r
    }

    #[test]
    fn consecutive_replicas_holding_every_expert_once_form_a_group() {
        let plan = Plan::new(vec![
            replica(
                &[1, 3],
                2,
                0,
                Some(vec![vec![0, 1, 2, 3, 4, 5], vec![0, 1]]),
            ),
            replica(
                &[1, 3],
                2,
                2,
                Some(vec![vec![6, 7], vec![2, 3, 4, 5, 6, 7]]),
            ),
            replica(&[4], 4, 4, None),
        ])
        .unwrap();
        let groups = plan.expert_groups(8).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].replicas, [0, 1]);
        assert_eq!(groups[0].placement[1], [vec![0, 1], vec![2, 3, 4, 5, 6, 7]]);
        assert_eq!(
            plan.expert_ranks(&groups, 3),
            Some((vec![1, 3], vec![vec![0, 1], vec![2, 3, 4, 5, 6, 7]]))
        );
        assert_eq!(plan.expert_ranks(&groups, 4), None);
        assert_eq!(plan.expert_holders(0, 6, 8), [1, 2]);
        assert_eq!(plan.expert_holders(2, 1, 8), [0, 2]);
        // A missing expert, a repeated one, members that run otherwise, a lone member.
        for (replicas, says) in [
            (
                vec![
                    replica(&[4], 2, 0, Some(vec![vec![0, 1, 2]])),
                    replica(&[4], 2, 1, Some(vec![vec![3, 4, 5, 6]])),
                ],
                "fewer than the model's 8 experts",
            ),
            (
                vec![
                    replica(&[4], 2, 0, Some(vec![vec![0, 1, 2, 3]])),
                    replica(&[4], 2, 1, Some(vec![vec![3, 4, 5, 6, 7]])),
                ],
                "held once",
            ),
            (
                vec![
                    replica(&[4], 2, 0, Some(vec![vec![0, 1, 2, 3]])),
                    replica(&[4], 3, 1, Some(vec![vec![4, 5, 6, 7]])),
                ],
                "runs otherwise",
            ),
            (
                vec![
                    replica(&[4], 2, 0, Some(vec![vec![0, 1, 2, 3]])),
                    replica(&[4], 2, 1, None),
                ],
                "fewer than",
            ),
            (
                vec![
                    replica(&[4], 2, 0, Some(vec![vec![0, 1, 2, 3]])),
                    ReplicaPipeline {
                        recompute: vec![true],
                        ..replica(&[4], 2, 1, Some(vec![vec![4, 5, 6, 7]]))
                    },
                ],
                "recomputation",
            ),
        ] {
            let e = Plan::new(replicas).unwrap().expert_groups(8).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
    }

    #[test]
    fn even_shares_split_consecutive_replicas() {
        let plan = Plan::new((0..4).map(|r| replica(&[2], 1, r, None)).collect())
            .unwrap()
            .with_even_experts(2)
            .unwrap();
        let groups = plan.expert_groups(8).unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[1].replicas, [2, 3]);
        assert_eq!(groups[1].placement[0], [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        let three = Plan::new((0..4).map(|r| replica(&[2], 1, r, None)).collect()).unwrap();
        assert!(three.with_even_experts(3).is_err());
    }

    #[test]
    fn megatrons_even_parts_read_back_as_its_flag_and_other_parts_as_no_grid() {
        let even = Plan::new((0..4).map(|r| replica(&[2], 1, r, None)).collect())
            .unwrap()
            .with_even_experts(2)
            .unwrap();
        let flags = even.grid_flags().unwrap().args.join(" ");
        assert!(flags.contains("--expert-model-parallel-size 2"), "{flags}");
        let listed = |parts: [&[usize]; 2]| {
            let replicas = (0..4).map(|r| replica(&[2], 1, r, Some(vec![parts[r % 2].to_vec()])));
            Plan::new(replicas.collect()).unwrap()
        };
        assert_eq!(
            listed([&[0, 1, 2, 3], &[4, 5, 6, 7]]).grid_flags(),
            even.grid_flags()
        );
        assert!(listed([&[0, 1, 2, 3, 4, 5], &[6, 7]])
            .grid_flags()
            .is_none());
        assert!(listed([&[0, 2, 4, 6], &[1, 3, 5, 7]])
            .grid_flags()
            .is_none());
    }
}
