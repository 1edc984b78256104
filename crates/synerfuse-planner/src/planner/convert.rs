//! Candidates as the plans `synerfuse train` runs.

use super::{
    error::PlanningError,
    outcome::{Arrangement, Candidate, PooledCandidate},
    tensor::TpGroup,
};
use crate::cluster::Device;
use crate::cost::CostModel;
use crate::expert_placement::{place_experts, slowest_time, ExpertMember};
use synerfuse_plan::{
    Coordinates, DeviceRequest, RankPlacement, ReplicaBatch, StageLayout, Topology, TopologyError,
    DEFAULT_ORDER, TP_PP_DP_ORDER,
};
use synerfuse_plan::{ExpertHolding, Plan, PlanError, Precision, ReplicaPipeline};

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
    /// activations and, under expert parallelism, each replica's experts of each stage
    /// placed by its pace and memory ([`Candidate::expert_placement`]).
    pub fn to_plan(&self, cost: &CostModel) -> Result<Plan, PlanningError> {
        let experts = self.expert_placement(cost)?;
        self.plan_holding(cost, experts)
    }

    /// [`Candidate::to_plan`] with the experts in Megatron's even parts (what
    /// `--expert-model-parallel-size` gives): the plan its flags describe.
    pub fn to_even_plan(&self, cost: &CostModel) -> Result<Plan, PlanningError> {
        let e = cost.model.experts.map_or(0, |e| e.num_experts);
        let sizes = self.expert_parallel_sizes();
        let experts = sizes.iter().any(|&ep| ep > 1).then(|| {
            (sizes.iter())
                .map(|&ep| {
                    let parts = even_parts(e, ep);
                    (0..self.micro_batches.len())
                        .map(|r| parts[r % parts.len().max(1)].clone())
                        .collect()
                })
                .collect()
        });
        self.plan_holding(cost, experts)
    }

    /// Under expert parallelism (groups of `ep` consecutive replicas), per stage the
    /// experts each replica holds: placed by [`place_experts`] on the tokens each expert
    /// took in the stage's MoE layers (measured: [`CostModel::expert_load`]; else
    /// equal), each member's pace (its device's layer time) and memory (its room beside
    /// the stage's largest need, over one expert's state: a lower bound); Megatron's
    /// even parts (the layout priced and found to fit) where they are as fast or no
    /// other placement fits that bound. `None` without expert parallelism.
    pub fn expert_placement(
        &self,
        cost: &CostModel,
    ) -> Result<Option<Vec<Vec<Vec<usize>>>>, PlanningError> {
        let Some(shape) = cost.model.experts else {
            return Ok(None);
        };
        if self.expert_parallel_sizes().iter().all(|&ep| ep <= 1) {
            return Ok(None);
        }
        let devices = cost.cluster.devices();
        let e = shape.num_experts;
        let mut stages = Vec::with_capacity(self.layers.len());
        let mut start = 0;
        for (i, &layers) in self.layers.iter().enumerate() {
            let ep = self.expert_parallel_of(i);
            let load = stage_load(cost, start, start + layers);
            let t = self.tensor_parallel_size() as f64;
            // One expert's state in this stage, and what the prediction counted for the
            // even parts (its mean layers; under the distributed optimizer, no more than
            // the unsharded part).
            let per_expert = (cost.model.moe_layers_in(start, start + layers)
                * 3
                * cost.model.hidden_size
                * shape.ffn_hidden_size) as f64
                * cost.state_bytes_per_param
                / t;
            let counted_per_param = match cost.distributed_optimizer {
                true => cost.state_bytes_per_param - cost.optimizer_bytes_per_param(),
                false => cost.state_bytes_per_param,
            };
            let counted = layers as f64 * cost.model.expert_layer_params() / ep as f64
                * counted_per_param
                / t;
            let mut row = Vec::with_capacity(self.micro_batches.len());
            for group in self.devices[i].chunks(ep) {
                let members = (group.iter())
                    .map(|&unit| {
                        let device = &devices[self.unit_devices(unit)[0]];
                        let speed = 1.0 / cost.stage_costs(device, 1)?.layer_s.max(1e-30);
                        let room = cost
                            .usable_memory(device)
                            .map(|usable| usable - self.prediction.stage_memory_bytes[i] + counted);
                        let capacity = match (room, per_expert > 0.0) {
                            (Some(room), true) => {
                                ((room / per_expert).floor().max(0.0) as usize).min(e)
                            }
                            _ => e,
                        };
                        Ok(ExpertMember { speed, capacity })
                    })
                    .collect::<Result<Vec<_>, PlanningError>>()?;
                row.extend(placed_or_even(&load, &members, e));
            }
            stages.push(row);
            start += layers;
        }
        Ok(Some(stages))
    }

    /// The plan with `experts` (per stage, per replica) held.
    fn plan_holding(
        &self,
        cost: &CostModel,
        experts: Option<Vec<Vec<Vec<usize>>>>,
    ) -> Result<Plan, PlanningError> {
        let devices = cost.cluster.devices();
        let placing = Placing::of(cost, &devices);
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
                    .map(|i| placement(&devices[i], cost, placing))
                    .collect(),
                experts: match &experts {
                    Some(stages) => (stages.iter())
                        .map(|row| Some(ExpertHolding::Listed(row[r].clone())))
                        .collect(),
                    None => Vec::new(),
                },
            });
            one_precision_per_stage(replicas.last_mut());
        }
        Ok(with_links(Plan::new(replicas)?, cost)?)
    }
}

/// `e` experts placed over `members` by [`place_experts`] on `load`, or Megatron's even
/// parts where no placement is faster.
fn placed_or_even(load: &[f64], members: &[ExpertMember], e: usize) -> Vec<Vec<usize>> {
    let even = even_parts(e, members.len());
    match place_experts(load, members) {
        Ok(placed)
            if slowest_time(load, members, &placed)
                < slowest_time(load, members, &even) / (1.0 + 1e-9) =>
        {
            placed
        }
        _ => even,
    }
}

/// Experts `0..e` in `members` consecutive even parts (Megatron's).
fn even_parts(e: usize, members: usize) -> Vec<Vec<usize>> {
    let per = e / members.max(1);
    (0..members)
        .map(|m| (m * per..(m + 1) * per).collect())
        .collect()
}

/// Tokens per expert in the MoE layers among `from..to` (measured, summed; equal where
/// nothing was measured or the stage has no MoE layer).
fn stage_load(cost: &CostModel, from: usize, to: usize) -> Vec<f64> {
    let e = cost.model.experts.map_or(0, |e| e.num_experts);
    let equal = vec![1.0; e];
    let Some(loads) = &cost.expert_load else {
        return equal;
    };
    // The measured rows are the MoE layers in order.
    let before = cost.model.moe_layers_in(0, from);
    let rows = cost.model.moe_layers_in(from, to);
    let load = crate::cost::summed_rows(loads.iter().skip(before).take(rows), e);
    match load.iter().sum::<f64>() > 0.0 {
        true => load,
        false => equal,
    }
}

/// `plan` with the cluster's network where its placements name emulated nodes
/// ([`placement`]): the run then emulates the links between them.
fn with_links(plan: Plan, cost: &CostModel) -> Result<Plan, PlanError> {
    let hosts = plan.hosts();
    match hosts.iter().any(|h| !h.node.is_empty()) {
        true => plan.with_network(cost.cluster.network.clone()),
        false => Ok(plan),
    }
}

/// One precision per stage, whose tensor- and context-parallel ranks exchange
/// activations in it: fp16 for all of a stage where one of its devices has no bf16.
fn one_precision_per_stage(replica: Option<&mut ReplicaPipeline>) {
    let Some(replica) = replica else {
        return;
    };
    let mut at = 0;
    for stage in &replica.ranks {
        let end = (at + stage.len()).min(replica.placements.len());
        let placements = &mut replica.placements[at..end];
        if placements
            .iter()
            .any(|p| p.precision == Some(Precision::Fp16))
        {
            placements
                .iter_mut()
                .for_each(|p| p.precision = Some(Precision::Fp16));
        }
        at = end;
    }
}

/// What every rank's placement in a plan shares, decided once per plan (each is a pass
/// over the cluster: per rank, they made writing a 131,072-device plan quadratic).
#[derive(Clone, Copy)]
pub(super) struct Placing {
    /// The cluster's devices compute in more than one precision: each rank names its own.
    mixed: bool,
    /// Some group sets an emulated speed: named nodes and sites are emulated hosts (their
    /// islands and links); elsewhere islands follow the hosts training runs on.
    emulated: bool,
}

impl Placing {
    /// Of the cluster's `devices` under `cost`.
    pub(super) fn of(cost: &CostModel, devices: &[Device]) -> Placing {
        Placing {
            mixed: cost.mixes_precisions(devices),
            emulated: cost.cluster.group.iter().any(|g| g.speed.is_some()),
        }
    }
}

/// Where a rank on `dev` computes: CUDA for an accelerator, else the CPU; its emulated
/// speed, kind and memory; where the precisions are mixed, its precision too.
pub(super) fn placement(dev: &Device, cost: &CostModel, placing: Placing) -> RankPlacement {
    let accelerator = dev.spec.is_some_and(|s| s.accelerator);
    let emulated = placing.emulated && dev.named_node;
    RankPlacement {
        device: Some(match accelerator {
            true => DeviceRequest::Cuda(None),
            false => DeviceRequest::Cpu,
        }),
        speed: dev.emulated.then_some(dev.speed),
        kind: Some(dev.kind.clone()),
        memory_gb: dev.spec.map(|s| s.memory_gb),
        node: emulated.then(|| dev.node.clone()),
        site: (emulated && !dev.site.is_empty()).then(|| dev.site.clone()),
        precision: placing.mixed.then(|| cost.precision_of(dev)),
    }
}

impl PooledCandidate {
    /// The plan `synerfuse train --plan` runs: the pools' replicas in order, ranks
    /// replica by replica, stage by stage, a unit's members together (a
    /// context-parallel member's tensor-parallel group together); under expert
    /// parallelism each replica's experts (see `expert_parts`).
    pub fn to_plan(&self, cost: &CostModel) -> Result<Plan, PlanError> {
        let candidate = self;
        let devices = cost.cluster.devices();
        let placing = Placing::of(cost, &devices);
        let experts = self.expert_parts(cost);
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
                    .flat_map(|g| {
                        g.members
                            .iter()
                            .map(|&i| placement(&devices[i], cost, placing))
                    })
                    .collect(),
                experts: match &experts {
                    Some(parts) => (parts[k].iter())
                        .map(|stage| Some(ExpertHolding::Listed(stage[r].clone())))
                        .collect(),
                    None => Vec::new(),
                },
            });
            one_precision_per_stage(replicas.last_mut());
        }
        with_links(Plan::new(replicas)?, cost)
    }

    /// Under expert parallelism, per pool, stage and replica the experts it holds: each
    /// group of `expert_parallel` consecutive replicas of a pool (alike members, as the
    /// layout was priced) holding equal counts, the experts placed by
    /// [`place_experts`] on the tokens each took in the stage's MoE layers (measured:
    /// [`CostModel::expert_load`]), Megatron's even parts where that is as fast.
    fn expert_parts(&self, cost: &CostModel) -> Option<Vec<Vec<Vec<Vec<usize>>>>> {
        let shape = cost.model.experts?;
        if (0..self.pools.len()).all(|k| self.expert_parallel_of(k) <= 1) {
            return None;
        }
        let e = shape.num_experts;
        let parts = (self.pools.iter().enumerate()).map(|(k, pool)| {
            let ep = self.expert_parallel_of(k).max(1);
            let members = vec![
                ExpertMember {
                    speed: 1.0,
                    capacity: e / ep,
                };
                ep
            ];
            let mut start = 0;
            (pool.layers.iter())
                .map(|&layers| {
                    let load = stage_load(cost, start, start + layers);
                    start += layers;
                    let placed = placed_or_even(&load, &members, e);
                    (0..pool.micro_batches.len())
                        .map(|r| placed[r % ep].clone())
                        .collect()
                })
                .collect()
        });
        Some(parts.collect())
    }
}
