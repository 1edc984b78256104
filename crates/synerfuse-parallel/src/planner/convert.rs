//! Candidates as the plans `synerfuse train` runs.

use super::{
    error::PlanningError,
    outcome::{Arrangement, Candidate, PooledCandidate},
    tensor::TpGroup,
};
use crate::cluster::Device;
use crate::cost::CostModel;
use crate::plan::{Plan, PlanError, ReplicaPipeline};
use crate::{
    Coordinates, DeviceRequest, RankPlacement, ReplicaBatch, StageLayout, Topology, TopologyError,
    DEFAULT_ORDER, TP_PP_DP_ORDER,
};

impl Candidate {
    /// The grid's ranks: Megatron's order for its arrangement (tp-pp-dp when replicas
    /// take neighbouring devices, the default when stages do).
    fn topology(&self) -> Result<Topology, TopologyError> {
        let (p, d, t, c) = (
            self.layers.len(),
            self.micro_batches.len(),
            self.tensor_parallel_size(),
            self.context_parallel_size(),
        );
        // Replicas on neighbouring devices: each replica's units together (tp-cp-pp-dp).
        let order = match self.arrangement {
            Arrangement::ByReplica if c > 1 => "tp-cp-pp-dp",
            Arrangement::ByReplica => TP_PP_DP_ORDER,
            Arrangement::ByStage => DEFAULT_ORDER,
        };
        Topology::new(p * d * t * c, t, p, c, 1, order)
    }

    /// The device index of each rank of [`Candidate::to_plan`]'s plan, in rank order.
    pub fn rank_devices(&self) -> Result<Vec<usize>, TopologyError> {
        let topology = self.topology()?;
        (0..topology.world_size())
            .map(|rank| {
                let c = topology.coordinates(rank)?;
                let t = self.tensor_parallel_size();
                Ok(self.unit_devices(self.devices[c.pp][c.dp])[c.cp * t + c.tp])
            })
            .collect()
    }

    /// The plan `synerfuse train --plan` runs and `synerfuse plan` writes: the grid on
    /// its ranks ([`Candidate::rank_devices`]), with the stages that recompute their
    /// activations.
    pub fn to_plan(&self, cost: &CostModel) -> Result<Plan, PlanningError> {
        let devices = cost.cluster.devices();
        let topology = self.topology()?;
        let recomputes = self.recompute.iter().flatten().any(|&x| x);
        let mut replicas = Vec::with_capacity(self.micro_batches.len());
        for (r, (&micro_batch_size, &num_micro_batches)) in
            (self.micro_batch_sizes.iter().zip(&self.micro_batches)).enumerate()
        {
            let stages = StageLayout::new(self.layers.clone(), cost.model.num_layers)
                .map_err(|source| PlanError::Layout { replica: r, source })?;
            let (t, c) = (self.tensor_parallel_size(), self.context_parallel_size());
            let ranks = (0..self.layers.len())
                .map(|pp| {
                    (0..c)
                        .flat_map(|cp| (0..t).map(move |tp| (cp, tp)))
                        .map(|(cp, tp)| {
                            let at = Coordinates {
                                tp,
                                cp,
                                ep: 0,
                                dp: r,
                                pp,
                            };
                            topology.rank(&at).expect("coordinates within the grid")
                        })
                        .collect()
                })
                .collect();
            // Each stage's context-parallel shares (its unit's), when uneven.
            let cp_shares: Vec<Option<Vec<u32>>> = (self.devices.iter())
                .map(|stage| self.groups.get(stage[r]).map(|g| g.shares.clone()))
                .map(|shares| shares.filter(|s| s.iter().any(|&x| x != s[0])))
                .collect();
            replicas.push(ReplicaPipeline {
                stages,
                batch: ReplicaBatch::uniform(micro_batch_size, num_micro_batches),
                ranks,
                tp_shares: Vec::new(),
                cp: match c {
                    1 => Vec::new(),
                    c => vec![c; self.layers.len()],
                },
                cp_shares: match c > 1 && cp_shares.iter().any(Option::is_some) {
                    true => cp_shares,
                    false => Vec::new(),
                },
                recompute: match recomputes {
                    true => self.recompute.iter().map(|row| row[r]).collect(),
                    false => Vec::new(),
                },
                placements: (self.devices.iter())
                    .flat_map(|stage| self.unit_devices(stage[r]))
                    .map(|i| placement(&devices[i]))
                    .collect(),
                experts: Vec::new(),
            });
        }
        Ok(Plan::new(replicas)?)
    }
}

/// Where a rank on `dev` computes: CUDA for an accelerator, else the CPU; its emulated
/// speed, kind and memory.
pub(super) fn placement(dev: &Device) -> RankPlacement {
    let accelerator = dev.spec.is_some_and(|s| s.accelerator);
    RankPlacement {
        device: Some(match accelerator {
            true => DeviceRequest::Cuda(None),
            false => DeviceRequest::Cpu,
        }),
        speed: dev.emulated.then_some(dev.speed),
        kind: Some(dev.kind.clone()),
        memory_gb: dev.spec.map(|s| s.memory_gb),
    }
}

impl PooledCandidate {
    /// The plan `synerfuse train --plan` runs: the pools' replicas in order, ranks
    /// replica by replica, stage by stage, a unit's members together (a
    /// context-parallel member's tensor-parallel group together).
    pub fn to_plan(&self, cost: &CostModel) -> Result<Plan, PlanError> {
        let candidate = self;
        let devices = cost.cluster.devices();
        let mut next_rank = 0;
        let mut replicas = Vec::new();
        for (k, r) in candidate.replicas() {
            let pool = &candidate.pools[k];
            let stages =
                StageLayout::new(pool.layers.clone(), cost.model.num_layers).map_err(|source| {
                    PlanError::Layout {
                        replica: replicas.len(),
                        source,
                    }
                })?;
            let groups: Vec<&TpGroup> = (pool.devices.iter())
                .map(|row| &candidate.groups[row[r]])
                .collect();
            let mut ranks = Vec::with_capacity(groups.len());
            for group in &groups {
                ranks.push((next_rank..next_rank + group.size()).collect());
                next_rank += group.size();
            }
            // A unit's uneven shares: its context-parallel members' tokens where it has
            // them (its tensor-parallel groups then split evenly), else its tensor
            // parallel shares.
            let uneven = |g: &&TpGroup, context: bool| {
                let even = g.shares.iter().all(|&s| s == g.shares[0]);
                (!even && (g.cp > 1) == context).then(|| g.shares.clone())
            };
            let per_stage = |context: bool| -> Vec<Option<Vec<u32>>> {
                let shares: Vec<_> = groups.iter().map(|g| uneven(g, context)).collect();
                match shares.iter().any(Option::is_some) {
                    true => shares,
                    false => Vec::new(),
                }
            };
            replicas.push(ReplicaPipeline {
                stages,
                batch: pool.batch(r),
                ranks,
                cp: match groups.iter().any(|g| g.cp > 1) {
                    true => groups.iter().map(|g| g.cp).collect(),
                    false => Vec::new(),
                },
                cp_shares: per_stage(true),
                recompute: match candidate.recompute.get(replicas.len()) {
                    Some(flags) if flags.iter().any(|&x| x) => flags.clone(),
                    _ => Vec::new(),
                },
                tp_shares: per_stage(false),
                placements: (groups.iter())
                    .flat_map(|g| g.members.iter().map(|&i| placement(&devices[i])))
                    .collect(),
                experts: Vec::new(),
            });
        }
        Plan::new(replicas)
    }
}
