//! Expert parallelism in a plan: replicas that each hold some experts of a stage's MoE
//! layers form that stage's expert-parallel groups, whose members exchange the layers'
//! tokens. A group is consecutive replicas (Megatron's: consecutive data-parallel ranks)
//! that between them hold every expert once at that stage; its members run alike (the
//! same layers per stage and chunk, micro-batch count, and at the stage the same tensor-
//! and context-parallel sizes and recomputation), so that they reach each exchange at the
//! same pass. Each stage groups on its own (FlagScale's meshes give each run of stages
//! its own expert-parallel size); a stage that holds every expert is in no group.

use super::{ExpertHolding, Plan, PlanError};

/// One stage's expert-parallel group: its replicas, and what each member holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertGroupPlan {
    /// The pipeline stage whose MoE layers the group exchanges.
    pub stage: usize,
    /// The member replicas, in member order.
    pub replicas: Vec<usize>,
    /// Each member's experts (member order).
    pub placement: Vec<Vec<usize>>,
}

impl Plan {
    /// The expert-parallel groups for a model of `num_experts` experts per MoE layer,
    /// stage by stage (none where every replica holds every expert), checked: each
    /// group's members hold every expert exactly once, at least one each, and run alike.
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
        let stages = (self.replicas().iter())
            .map(|r| r.stages.num_stages())
            .max()
            .unwrap_or(0);
        let mut groups = Vec::new();
        for stage in 0..stages {
            groups.extend(self.stage_expert_groups(stage, num_experts)?);
        }
        Ok(groups)
    }

    /// Stage `stage`'s groups: runs of consecutive replicas that hold part of its experts,
    /// each closed once its members hold as many experts as the model has.
    fn stage_expert_groups(
        &self,
        stage: usize,
        num_experts: usize,
    ) -> Result<Vec<ExpertGroupPlan>, PlanError> {
        let part = |r: usize| {
            (self.replicas()[r].experts(stage, num_experts)).filter(|e| e.len() < num_experts)
        };
        let mut groups = Vec::new();
        let mut open: Vec<usize> = Vec::new();
        let mut held = 0;
        for r in 0..self.replicas().len() {
            let Some(experts) = part(r) else {
                if !open.is_empty() {
                    return Err(self.incomplete(open, stage, num_experts));
                }
                continue;
            };
            open.push(r);
            held += experts.len();
            if held >= num_experts {
                let members = std::mem::take(&mut open);
                groups.push(self.expert_group(stage, members, num_experts)?);
                held = 0;
            }
        }
        match open.is_empty() {
            true => Ok(groups),
            false => Err(self.incomplete(open, stage, num_experts)),
        }
    }

    fn incomplete(&self, replicas: Vec<usize>, stage: usize, num_experts: usize) -> PlanError {
        PlanError::ExpertGroup {
            replicas,
            problem: format!(
                "at stage {stage} they hold fewer than the model's {num_experts} experts between them; the replicas of an expert-parallel group follow each other and together hold every expert once"
            ),
        }
    }

    /// Stage `stage`'s group of `replicas`, checked.
    fn expert_group(
        &self,
        stage: usize,
        replicas: Vec<usize>,
        num_experts: usize,
    ) -> Result<ExpertGroupPlan, PlanError> {
        let error = |problem: String| PlanError::ExpertGroup {
            replicas: replicas.clone(),
            problem,
        };
        let first = &self.replicas()[replicas[0]];
        for &m in &replicas[1..] {
            let r = &self.replicas()[m];
            let alike = r.stages == first.stages
                && r.batch.sizes().len() == first.batch.sizes().len()
                && r.tp_size(stage) == first.tp_size(stage)
                && r.cp_size(stage) == first.cp_size(stage)
                && r.recomputes(stage) == first.recomputes(stage);
            if !alike {
                return Err(error(format!(
                    "replica {m} runs otherwise than replica {}: the members of an expert-parallel group need the same layers per stage and number of micro-batches, and at stage {stage} the same tensor- and context-parallel sizes and recomputation (their micro-batch sizes may differ)",
                    replicas[0]
                )));
            }
        }
        let placement: Vec<Vec<usize>> = (replicas.iter())
            .map(|&m| (self.replicas()[m].experts(stage, num_experts)).unwrap_or_default())
            .collect();
        let mut seen = vec![0usize; num_experts];
        for &e in placement.iter().flatten() {
            match seen.get_mut(e) {
                Some(n) => *n += 1,
                None => {
                    return Err(error(format!(
                        "stage {stage}: expert {e} of a model of {num_experts} experts"
                    )))
                }
            }
        }
        if seen.iter().any(|&n| n != 1) || placement.iter().any(Vec::is_empty) {
            return Err(error(format!(
                "stage {stage}: the members hold {placement:?}; each needs at least one expert and every one of the {num_experts} experts must be held once"
            )));
        }
        Ok(ExpertGroupPlan {
            stage,
            replicas,
            placement,
        })
    }

    /// This plan with consecutive groups of `size` replicas each holding an even part
    /// of every stage's experts (Megatron's `--expert-model-parallel-size`).
    pub fn with_even_experts(self, size: usize) -> Result<Self, PlanError> {
        self.with_even_experts_by_stage(|_| size)
    }

    /// This plan with, at each stage `s`, consecutive groups of `size_at(s)` replicas each
    /// holding an even part of the stage's experts (FlagScale's per-mesh EP; 1: every
    /// replica holds every expert there).
    pub fn with_even_experts_by_stage(
        mut self,
        size_at: impl Fn(usize) -> usize,
    ) -> Result<Self, PlanError> {
        let replicas = self.replicas.len();
        let stages = (self.replicas.iter())
            .map(|r| r.stages.num_stages())
            .max()
            .unwrap_or(0);
        if let Some(size) = (0..stages)
            .map(&size_at)
            .find(|&n| n == 0 || replicas % n != 0)
        {
            return Err(PlanError::ExpertGroup {
                replicas: (0..replicas).collect(),
                problem: format!(
                    "--expert-model-parallel-size {size} does not divide the {replicas} data-parallel replicas"
                ),
            });
        }
        for (r, replica) in self.replicas.iter_mut().enumerate() {
            replica.experts = (0..replica.stages.num_stages())
                .map(|s| match size_at(s) {
                    1 => None,
                    size => Some(ExpertHolding::EvenShare {
                        member: r % size,
                        members: size,
                    }),
                })
                .collect();
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
        let group = (groups.iter()).find(|g| g.stage == stage && g.replicas.contains(&replica))?;
        let at = (self.replicas()[replica].ranks[stage].iter()).position(|&r| r == rank)?;
        let ranks = (group.replicas.iter())
            .map(|&m| self.replicas()[m].ranks[stage][at])
            .collect();
        Some((ranks, group.placement.clone()))
    }
}

/// The replicas whose gradients flow into `replica`'s through expert-parallel `groups`
/// (members of one group, and of the groups those members share, transitively), itself
/// included, ascending: they must scale their losses alike (an expert's gradient sums
/// every member's tokens).
pub fn coupled_replicas(groups: &[ExpertGroupPlan], replica: usize) -> Vec<usize> {
    let mut coupled = std::collections::BTreeSet::from([replica]);
    loop {
        let before = coupled.len();
        for g in groups {
            if g.replicas.iter().any(|r| coupled.contains(r)) {
                coupled.extend(g.replicas.iter().copied());
            }
        }
        if coupled.len() == before {
            return coupled.into_iter().collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ReplicaBatch, ReplicaPipeline, StageLayout};

    #[test]
    fn coupling_follows_groups_transitively() {
        let group = |stage, replicas: Vec<usize>| ExpertGroupPlan {
            stage,
            placement: replicas.iter().map(|&r| vec![r]).collect(),
            replicas,
        };
        let groups = [
            group(0, vec![0, 1]),
            group(1, vec![1, 2]),
            group(0, vec![4, 5]),
        ];
        assert_eq!(coupled_replicas(&groups, 0), [0, 1, 2]);
        assert_eq!(coupled_replicas(&groups, 2), [0, 1, 2]);
        assert_eq!(coupled_replicas(&groups, 3), [3]);
        assert_eq!(coupled_replicas(&groups, 5), [4, 5]);
        assert_eq!(coupled_replicas(&[], 7), [7]);
    }

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
        assert_eq!(groups.len(), 2, "one per stage");
        assert!(groups.iter().all(|g| g.replicas == [0, 1]));
        assert_eq!(groups[1].stage, 1);
        assert_eq!(groups[1].placement, [vec![0, 1], vec![2, 3, 4, 5, 6, 7]]);
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
    fn each_stage_groups_on_its_own() {
        // Stage 0: one group of the four replicas; stage 1: two groups of two, where
        // replica 2 holds every expert (a group of its own: none).
        let holdings = [
            vec![vec![0, 1], vec![0, 1, 2, 3, 4]],
            vec![vec![2, 3], vec![5, 6, 7]],
            vec![vec![4, 5], (0..8).collect()],
            vec![vec![6, 7], vec![0, 1, 2, 3, 4, 5, 6, 7]],
        ];
        let replicas = (holdings.into_iter().enumerate())
            .map(|(r, h)| replica(&[2, 2], 1, 2 * r, Some(h)))
            .collect();
        let plan = Plan::new(replicas).unwrap();
        let groups = plan.expert_groups(8).unwrap();
        let at = |stage: usize| -> Vec<Vec<usize>> {
            (groups.iter().filter(|g| g.stage == stage))
                .map(|g| g.replicas.clone())
                .collect()
        };
        assert_eq!(at(0), [vec![0, 1, 2, 3]]);
        assert_eq!(at(1), [vec![0, 1]]);
        assert_eq!(plan.expert_ranks(&groups, 1).unwrap().0, [1, 3]);
        assert_eq!(plan.expert_ranks(&groups, 5), None);
        assert_eq!(plan.expert_holders(3, 6, 8), [1, 2, 3]);
        assert_eq!(plan.expert_holders(0, 6, 8), [3]);
        // A group open at one stage is named with it.
        let replicas = [
            vec![vec![0, 1, 2, 3], vec![0, 1, 2, 3]],
            vec![vec![4, 5, 6, 7]],
        ];
        let replicas = (replicas.into_iter().enumerate())
            .map(|(r, h)| replica(&[2, 2], 1, 2 * r, Some(h)))
            .collect();
        let e = Plan::new(replicas).unwrap().expert_groups(8).unwrap_err();
        assert!(e.to_string().contains("at stage 1 they hold fewer"), "{e}");
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
        assert_eq!(groups[1].placement, [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
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
