//! Candidates as the plans `synerfuse train` runs.

use super::{
    error::PlanningError,
    outcome::{Arrangement, Candidate},
    pooled::PooledCandidate,
    tensor::TpGroup,
};
use crate::cluster::Device;
use crate::cost::CostModel;
use crate::general::{GeneralPlan, GeneralPlanError, ReplicaPipeline};
use crate::{
    DeviceRequest, ParallelPlan, RankPlacement, ReplicaBatch, ReplicaBatches, StageLayout,
    TopologySpec, DEFAULT_ORDER, TP_PP_DP_ORDER,
};

/// The device index of each rank of the candidate's grid plan, in rank order.
pub fn grid_rank_devices(candidate: &Candidate) -> Result<Vec<usize>, crate::PlanError> {
    let (p, d) = (candidate.layers.len(), candidate.micro_batches.len());
    let order = match candidate.arrangement {
        Arrangement::ByReplica => TP_PP_DP_ORDER,
        Arrangement::ByStage => DEFAULT_ORDER,
    };
    let topology = crate::Topology::new(p * d, 1, p, 1, 1, order)?;
    (0..p * d)
        .map(|rank| -> Result<usize, crate::PlanError> {
            let c = topology.coordinates(rank)?;
            Ok(candidate.devices[c.pp][c.dp])
        })
        .collect()
}

/// The candidate as a plan `synerfuse train --plan` runs.
pub fn to_parallel_plan(
    cost: &CostModel,
    candidate: &Candidate,
) -> Result<ParallelPlan, crate::PlanError> {
    let devices = cost.cluster.devices();
    let p = candidate.layers.len();
    let d = candidate.micro_batches.len();
    let order = match candidate.arrangement {
        Arrangement::ByReplica => TP_PP_DP_ORDER,
        Arrangement::ByStage => DEFAULT_ORDER,
    };
    let spec = TopologySpec {
        world_size: p * d,
        tp: 1,
        pp: p,
        cp: 1,
        ep: 1,
        order: order.into(),
    };
    let ranks = (grid_rank_devices(candidate)?.into_iter())
        .map(|device| placement(&devices[device]))
        .collect();
    let batches = ReplicaBatches::new(
        candidate
            .micro_batch_sizes
            .iter()
            .zip(&candidate.micro_batches)
            .map(|(&b, &m)| ReplicaBatch {
                micro_batch_size: b,
                num_micro_batches: m,
            })
            .collect(),
    )?;
    ParallelPlan::new(
        spec,
        StageLayout::new(candidate.layers.clone(), cost.model.num_layers)?,
        batches,
        ranks,
    )
}

/// The candidate as the file `synerfuse plan` writes: its grid plan in the general
/// form (the grid's rank order kept), with the stages that recompute their activations.
pub fn to_general_grid_plan(
    cost: &CostModel,
    candidate: &Candidate,
) -> Result<crate::GeneralPlan, PlanningError> {
    let general = crate::GeneralPlan::from_grid(&to_parallel_plan(cost, candidate)?)?;
    if !candidate.recompute.iter().flatten().any(|&x| x) {
        return Ok(general);
    }
    let replicas = (general.replicas().iter().enumerate())
        .map(|(r, replica)| crate::general::ReplicaPipeline {
            recompute: candidate.recompute.iter().map(|row| row[r]).collect(),
            ..replica.clone()
        })
        .collect();
    Ok(crate::GeneralPlan::new(replicas)?)
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

/// The plan `synerfuse train --plan` runs: the pools' replicas in order, ranks replica
/// by replica, stage by stage, a tensor-parallel group's members together.
pub fn to_general_plan(
    cost: &CostModel,
    candidate: &PooledCandidate,
) -> Result<GeneralPlan, GeneralPlanError> {
    let devices = cost.cluster.devices();
    let mut next_rank = 0;
    let mut replicas = Vec::new();
    for (k, r) in candidate.replicas() {
        let pool = &candidate.pools[k];
        let stages =
            StageLayout::new(pool.layers.clone(), cost.model.num_layers).map_err(|source| {
                GeneralPlanError::Layout {
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
        let even = |g: &TpGroup| g.shares.iter().all(|&s| s == g.shares[0]);
        replicas.push(ReplicaPipeline {
            stages,
            batch: ReplicaBatch {
                micro_batch_size: pool.micro_batch_size,
                num_micro_batches: pool.micro_batches[r],
            },
            ranks,
            recompute: match candidate.recompute.get(replicas.len()) {
                Some(flags) if flags.iter().any(|&x| x) => flags.clone(),
                _ => Vec::new(),
            },
            tp_shares: match groups.iter().all(|g| even(g)) {
                true => Vec::new(),
                false => (groups.iter())
                    .map(|g| (!even(g)).then(|| g.shares.clone()))
                    .collect(),
            },
            placements: (groups.iter())
                .flat_map(|g| g.members.iter().map(|&i| placement(&devices[i])))
                .collect(),
        });
    }
    GeneralPlan::new(replicas)
}
