//! Re-planning a running job (`synerfuse train --replan`): its measured paces as a cost
//! model, any plan of its ranks priced on that model, and the planner's best plan placed
//! on the job's own ranks.
//!
//! The fitted model prices a layer by its FLOPs at one TFLOP/s and gives each rank the
//! speed at which its current work (the forward and backward of its stage's layers, its
//! share under tensor parallelism, the embedding and head where it holds them) takes
//! its measured pace: it then predicts every rank's current pace, and other plans by
//! moving work at those rates. The plan running and the candidates are priced by one
//! simulation (every replica's schedule, the reduction, the optimizer), so that their
//! difference is not the difference of two models. A plan of expert parallelism (one
//! group size throughout) is priced with its members' parts of the experts, the
//! all-to-alls of every MoE layer, and each group's members in lockstep.

use super::error::PlanningError;
use super::outcome::PoolLayout;
use super::plan;
use super::pricing::Ctx;
use super::request::{Choice, PlanRequest};
use super::simulate::simulate_pools;
use super::tensor::TpGroup;
use crate::cluster::{ClusterSpec, DeviceGroup, Network};
use crate::cost::{CostModel, Recompute};
use crate::profile::Profile;
use std::collections::BTreeMap;
use synerfuse_plan::timeline::RankTimeline;
use synerfuse_plan::RankPlacement;
use synerfuse_plan::{MeasuredCosts, MeasuredNetwork, ModelShape};
use synerfuse_plan::{Plan, PlanError, ReplicaPipeline, RunRecord};

/// The kind of every rank of a fitted cluster: its numbers are the fitted profile's.
const FITTED_KIND: &str = "cpu";
/// The rate a FLOP is priced at before a rank's speed: one TFLOP/s.
const UNIT_RATE: f64 = 1e12;

/// What a running job tells the re-planner.
#[derive(Debug, Clone)]
pub struct RunningJob<'a> {
    /// The plan it runs.
    pub plan: &'a Plan,
    /// The model, at the run's sequence length.
    pub model: ModelShape,
    /// Each rank's forward and backward seconds per step under `plan`, in rank order.
    pub paces_s: &'a [f64],
    /// Each rank's host, in rank order (ranks of one host share its links).
    pub hosts: &'a [String],
    /// The network as measured between the job's ranks, if it was.
    pub network: Option<MeasuredNetwork>,
    /// Whether every stage recomputes its activations (`--recompute-activations`).
    pub recompute: bool,
    /// Bytes per activation element on the wire (4 in fp32, 2 in bf16).
    pub compute_bytes: f64,
}

impl<'a> RunningJob<'a> {
    /// The running job this run is to the re-planner, at `paces_s` (each rank's forward
    /// and backward seconds per step) on the `network` measured between its ranks.
    pub fn of_run(
        run: &'a RunRecord,
        paces_s: &'a [f64],
        network: Option<MeasuredNetwork>,
    ) -> RunningJob<'a> {
        RunningJob {
            plan: &run.plan,
            model: run.model.clone(),
            paces_s,
            hosts: &run.hosts,
            network,
            recompute: run.recompute,
            compute_bytes: run.compute_bytes,
        }
    }
}

/// Why a running job cannot be re-planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReplanError {
    /// Not one pace (or host) per rank.
    #[error("re-planning needs one {what} per rank: got {got} for {ranks} ranks")]
    PerRank {
        /// `pace` or `host`.
        what: &'static str,
        /// How many were given.
        got: usize,
        /// Ranks of the plan.
        ranks: usize,
    },
    /// A pace that is not a positive time.
    #[error("rank {rank}'s measured pace ({pace_s} s) is not a positive time")]
    Pace {
        /// The rank.
        rank: usize,
        /// Its pace.
        pace_s: f64,
    },
    /// A plan with virtual pipeline chunks (not priced by the simulation here).
    #[error("re-planning a plan with virtual pipeline chunks (an interleaved schedule) is not supported")]
    Interleaved,
    /// Context-parallel shares that do not split the sequence.
    #[error("replica {replica}, stage {stage}: context-parallel shares {shares:?} do not split the sequence")]
    ContextShares {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// The shares.
        shares: Vec<u32>,
    },
    /// Tensor-parallel shares that do not split the model.
    #[error("replica {replica}, stage {stage}: tensor-parallel shares {shares:?} do not split the model")]
    Shares {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// The shares.
        shares: Vec<u32>,
    },
    /// The planner found nothing.
    #[error(transparent)]
    Planning(#[from] PlanningError),
    /// A plan that does not form (a planner bug, reported).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A grid plan whose ranks do not form a topology (a planner bug, reported).
    #[error(transparent)]
    Topology(#[from] synerfuse_plan::TopologyError),
}

/// The costs of one micro-batch of one sample at speed 1: FLOPs at [`UNIT_RATE`].
fn unit_costs(model: &ModelShape) -> MeasuredCosts {
    let layer = model.layer_forward_flops(1) / UNIT_RATE;
    MeasuredCosts {
        layer_fwd_s: layer,
        layer_bwd_s: 2.0 * layer,
        embedding_s: 3.0 * (model.seq_length * model.hidden_size) as f64 / UNIT_RATE,
        head_s: 3.0 * model.head_forward_flops(1) / UNIT_RATE,
        layer_activation_bytes: model.layer_activation_bytes(1, 4.0, false),
        optimizer_s_per_param: None,
    }
}

/// The unit of `replica`'s `stage`: a rank alone, a tensor-parallel group, or a
/// context-parallel group (of tensor-parallel groups).
fn stage_group(
    model: &ModelShape,
    plan: &Plan,
    replica: usize,
    stage: usize,
) -> Result<TpGroup, ReplanError> {
    let r = &plan.replicas()[replica];
    let ranks = r.ranks[stage].clone();
    if ranks.len() == 1 {
        return Ok(TpGroup::single(ranks[0]));
    }
    let shares = r.shares(stage);
    let c = r.cp_size(stage);
    if c > 1 {
        let cp_shares = (r.context_shares(stage)).unwrap_or_else(|| vec![1; c]);
        return TpGroup::context_of_tensor(model, ranks, cp_shares.clone(), shares.clone())
            .ok_or_else(
                || match TpGroup::context(model, (0..c).collect(), cp_shares.clone()) {
                    None => ReplanError::ContextShares {
                        replica,
                        stage,
                        shares: cp_shares,
                    },
                    Some(_) => ReplanError::Shares {
                        replica,
                        stage,
                        shares,
                    },
                },
            );
    }
    TpGroup::new(model, ranks, shares.clone()).ok_or(ReplanError::Shares {
        replica,
        stage,
        shares,
    })
}

/// `rank`'s forward and backward seconds per step under `job.plan` at speed 1.
fn unit_work_s(
    job: &RunningJob<'_>,
    unit: &MeasuredCosts,
    rank: usize,
) -> Result<f64, ReplanError> {
    let plan = job.plan;
    let (replica, stage) = plan.position(rank).expect("the plan places its ranks");
    let r = &plan.replicas()[replica];
    let group = stage_group(&job.model, plan, replica, stage)?;
    let member = group.members.iter().position(|&m| m == rank).unwrap_or(0);
    let layers = r.stages.layers()[stage] as f64;
    // A stage the plan alone recomputes is priced without: its rank's speed absorbs it,
    // as the simulation, which recomputes everywhere or nowhere, does not charge it.
    let recompute = job.recompute;
    let layer_s =
        unit.layer_fwd_s * f64::from(u8::from(recompute)) + unit.layer_fwd_s + unit.layer_bwd_s;
    let first = match stage {
        0 => unit.embedding_s,
        _ => 0.0,
    };
    let last = match stage + 1 == r.stages.num_stages() {
        true => unit.head_s * group.vocab[member],
        false => 0.0,
    };
    let per_sample = layers * layer_s * group.work[member] + first + last;
    Ok(per_sample * r.batch.samples() as f64)
}

/// The cost model of the running job: one device per rank (on its host), each at the
/// speed its measured pace shows (see the module documentation).
pub fn fitted_cost(job: &RunningJob<'_>) -> Result<CostModel, ReplanError> {
    let all: Vec<usize> = (0..job.plan.world_size()).collect();
    fitted_cost_of(job, &all)
}

/// [`fitted_cost`] over the ranks `kept` only (the survivors of a lost rank): device `i`
/// is rank `kept[i]`.
pub fn fitted_cost_of(job: &RunningJob<'_>, kept: &[usize]) -> Result<CostModel, ReplanError> {
    let ranks = job.plan.world_size();
    for (what, got) in [("pace", job.paces_s.len()), ("host", job.hosts.len())] {
        if got != ranks {
            return Err(ReplanError::PerRank { what, got, ranks });
        }
    }
    let unit = unit_costs(&job.model);
    let mut groups = Vec::with_capacity(kept.len());
    for &rank in kept {
        let (pace_s, host) = (job.paces_s[rank], &job.hosts[rank]);
        if !(pace_s > 0.0 && pace_s.is_finite()) {
            return Err(ReplanError::Pace { rank, pace_s });
        }
        groups.push(DeviceGroup {
            kind: FITTED_KIND.to_owned(),
            count: 1,
            node: Some(host.clone()),
            tflops_bf16: None,
            // The memory the plan placed the rank with, so a plan that would not fit
            // (or fits only recomputing) is priced so.
            memory_gb: job.plan.placement(rank).and_then(|p| p.memory_gb),
            mem_bw_gbs: None,
            efficiency: None,
            speed: Some(unit_work_s(job, &unit, rank)? / pace_s),
        });
    }
    let measured = job.network.filter(|n| n.p2p_bytes_per_s > 0.0);
    let cluster = ClusterSpec {
        memory_headroom: 0.1,
        group: groups,
        network: Network {
            intra_node_gbs: measured.map_or(100.0, |n| n.p2p_bytes_per_s / 1e9),
            inter_node_gbs: 12.5,
            latency_us: measured.map_or(10.0, |n| n.latency_s * 1e6),
            link: Vec::new(),
        },
    };
    let profile = Profile {
        model: job.model.clone(),
        devices: BTreeMap::from([(FITTED_KIND.to_owned(), BTreeMap::from([(1, unit)]))]),
        network: measured,
        calibration: None,
    };
    let mut cost = CostModel::new(job.model.clone(), cluster, Some(profile));
    cost.compute_bytes = job.compute_bytes;
    cost.recompute = match job.recompute {
        true => Recompute::Always,
        false => Recompute::Never,
    };
    Ok(cost)
}

/// The simulated step of `plan` on `cost`'s cluster, rank `r` on device `r`: each
/// replica a pipeline of its own, priced as the planner prices per-replica pipelines.
pub fn predict_step_s(cost: &CostModel, plan: &Plan) -> Result<f64, ReplanError> {
    Ok(simulate_plan(cost, plan, false)?.0)
}

/// [`predict_step_s`] with every rank's simulated spans, in `plan`'s rank order.
pub fn predict_timeline(
    cost: &CostModel,
    plan: &Plan,
) -> Result<(f64, Vec<RankTimeline>), ReplanError> {
    let (step_s, rows) = simulate_plan(cost, plan, true)?;
    // The simulation numbers ranks replica by replica, stage by stage; the plan may not.
    let order: Vec<usize> = plan.replicas().iter().flat_map(|r| r.all_ranks()).collect();
    let mut by_rank: Vec<Option<RankTimeline>> = vec![None; rows.len()];
    for (row, &rank) in rows.into_iter().zip(&order) {
        by_rank[rank] = Some(row);
    }
    let rows = by_rank.into_iter().map(Option::unwrap_or_default).collect();
    Ok((step_s, rows))
}

/// The simulated step of `plan` (see [`predict_step_s`]), with its spans when `record`.
fn simulate_plan(
    cost: &CostModel,
    plan: &Plan,
    record: bool,
) -> Result<(f64, Vec<RankTimeline>), ReplanError> {
    if plan.has_chunks() {
        return Err(ReplanError::Interleaved);
    }
    let (mut groups, mut pools) = (Vec::new(), Vec::new());
    let mut first_unit = Vec::with_capacity(plan.replicas().len());
    for (replica, r) in plan.replicas().iter().enumerate() {
        first_unit.push(groups.len());
        let mut devices = Vec::with_capacity(r.ranks.len());
        for stage in 0..r.ranks.len() {
            devices.push(vec![groups.len()]);
            groups.push(stage_group(&cost.model, plan, replica, stage)?);
        }
        // Priced as its samples in micro-batches of its largest, the last one short
        // (micro-batch sizes in another order or mix are priced so too).
        let (largest, samples) = (r.batch.micro_batch_size(), r.batch.samples());
        let count = samples.div_ceil(largest);
        pools.push(PoolLayout {
            devices,
            layers: r.stages.layers(),
            micro_batch_size: largest,
            micro_batches: vec![count],
            short: vec![count * largest - samples],
        });
    }
    let units = groups.len();
    let mut ctx = Ctx::with_groups(cost, cost.cluster.devices(), groups);
    // Under expert parallelism each member priced holding its part of the experts and
    // exchanging every MoE layer's tokens, its group meeting at each exchange; each
    // stage at its own group's size.
    let (sizes, lockstep) = expert_lockstep(cost, plan, &first_unit, units)?;
    ctx.set_expert_parallel(sizes);
    ctx.lockstep = lockstep;
    let (candidate, rows) = simulate_pools(&mut ctx, pools, record)?;
    Ok((candidate.step_time_s, rows))
}

/// Per unit of `plan` (replica `r`'s stage `s` is unit `first_unit[r] + s`, of
/// `units`), its expert-parallel group's size (1: it holds every expert), and each
/// group's units.
fn expert_lockstep(
    cost: &CostModel,
    plan: &Plan,
    first_unit: &[usize],
    units: usize,
) -> Result<(Vec<usize>, Vec<Vec<usize>>), ReplanError> {
    let mut sizes = vec![1; units];
    let Some(shape) = cost.model.experts else {
        return Ok((sizes, Vec::new()));
    };
    let lockstep: Vec<Vec<usize>> = (plan.expert_groups(shape.num_experts)?.iter())
        .map(|g| {
            g.replicas
                .iter()
                .map(|&r| first_unit[r] + g.stage)
                .collect()
        })
        .collect();
    for group in &lockstep {
        for &unit in group {
            sizes[unit] = group.len();
        }
    }
    Ok((sizes, lockstep))
}

/// What a running job is re-planned for (a switch, or the survivors of lost ranks): its
/// own global batch and the options `synerfuse plan` searches by default: micro-batch
/// sizes 1 to 8, tensor- and context-parallel sizes 1 to 8 (within a host; context
/// parallelism where memory binds without it), expert-parallel sizes 1 to 8 (of a
/// mixture of experts: those dividing its experts), recomputation where a
/// stage needs it (every stage when the job runs `--recompute-activations`: the run
/// recomputes whatever the plan says), and the distributed optimizer exactly when the
/// job runs it (a run flag, not the plan's).
pub fn running_job_request(
    global_batch_size: usize,
    recompute: bool,
    distributed_optimizer: bool,
) -> PlanRequest {
    PlanRequest {
        global_batch_size,
        micro_batch_sizes: vec![1, 2, 4, 8],
        top_k: 1,
        tensor_parallel_sizes: vec![1, 2, 4, 8],
        context_parallel_sizes: vec![1, 2, 4, 8],
        recompute: match recompute {
            true => Choice::On,
            false => Choice::Auto,
        },
        distributed_optimizer: match distributed_optimizer {
            true => Choice::On,
            false => Choice::Off,
        },
        // Expert-parallel sizes as `synerfuse plan` searches them (grid plans of one size;
        // a running plan of one size is priced with its exchange, members' parts and
        // lockstep): a run may switch into expert parallelism where it pays, or out of it.
        expert_parallel_sizes: vec![1, 2, 4, 8],
    }
}

/// The planner's best plan for `request` on `cost`'s cluster (the best grid plan or the
/// best per-replica-pipeline plan, whichever [`predict_step_s`] prices faster), with
/// rank `r` on device `r`, placed at `placements[r]` (where every rank has one); and
/// its predicted step.
pub fn best_plan_for(
    cost: &CostModel,
    request: &PlanRequest,
    placements: &[Option<RankPlacement>],
) -> Result<(Plan, f64), ReplanError> {
    let outcome = plan(cost, request)?;
    let mut found = Vec::new();
    if let Some(grid) = outcome.plans.first() {
        let general = grid.to_plan(cost)?;
        found.push(on_devices(&general, &grid.rank_devices()?, placements)?);
    }
    if let Some(pooled) = &outcome.pooled {
        let general = pooled.to_plan(cost)?;
        found.push(on_devices(&general, &pooled.rank_devices(), placements)?);
    }
    let mut best: Option<(Plan, f64)> = None;
    for plan in found {
        let step_s = predict_step_s(cost, &plan)?;
        if best.as_ref().is_none_or(|(_, s)| step_s < *s) {
            best = Some((plan, step_s));
        }
    }
    // `plan` returns an error when neither kind of plan fits.
    Ok(best.expect("the planner found a plan"))
}

/// `plan` with its rank `k` renamed `device_of[k]`, rank `r` placed at `placements[r]`.
fn on_devices(
    plan: &Plan,
    device_of: &[usize],
    placements: &[Option<RankPlacement>],
) -> Result<Plan, PlanError> {
    let replicas = (plan.replicas().iter())
        .map(|r| {
            let ranks: Vec<Vec<usize>> = (r.ranks.iter())
                .map(|stage| stage.iter().map(|&k| device_of[k]).collect())
                .collect();
            // Every rank its own placement (a default one where it has none), or none
            // at all when no rank has one.
            let placed = placements.iter().any(Option::is_some);
            let placements = (ranks.iter().flatten())
                .filter(|_| placed)
                .map(|&rank| placements.get(rank).cloned().flatten().unwrap_or_default())
                .collect();
            ReplicaPipeline {
                ranks,
                placements,
                ..r.clone()
            }
        })
        .collect();
    Plan::new(replicas)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::Choice;
    use synerfuse_plan::{ReplicaBatch, StageLayout};

    fn model() -> ModelShape {
        ModelShape {
            num_layers: 4,
            hidden_size: 64,
            num_heads: 4,
            num_kv_heads: 4,
            ffn_hidden_size: 128,
            vocab_size: 256,
            seq_length: 32,
            tied: false,
            experts: None,
        }
    }

    /// `ranks` data-parallel replicas of the whole model, 4 micro-batches of 1 each.
    fn data_parallel(ranks: usize) -> Plan {
        let replicas = (0..ranks)
            .map(|r| {
                ReplicaPipeline::single_ranks(
                    StageLayout::new(vec![4], 4).unwrap(),
                    ReplicaBatch::uniform(1, 4),
                    vec![r],
                    Vec::new(),
                )
            })
            .collect();
        Plan::new(replicas).unwrap()
    }

    fn job<'a>(plan: &'a Plan, paces_s: &'a [f64], hosts: &'a [String]) -> RunningJob<'a> {
        RunningJob {
            plan,
            model: model(),
            paces_s,
            hosts,
            network: None,
            recompute: false,
            compute_bytes: 4.0,
        }
    }

    fn request(global_batch_size: usize) -> PlanRequest {
        PlanRequest {
            global_batch_size,
            micro_batch_sizes: vec![1, 2],
            top_k: 1,
            tensor_parallel_sizes: vec![1],
            context_parallel_sizes: Vec::new(),
            recompute: Choice::Off,
            distributed_optimizer: Choice::Off,
            expert_parallel_sizes: Vec::new(),
        }
    }

    #[test]
    fn the_fitted_model_predicts_the_measured_paces() {
        let plan = data_parallel(4);
        let hosts = vec!["h".to_owned(); 4];
        let paces = [1.0, 4.0, 1.0, 1.0];
        let cost = fitted_cost(&job(&plan, &paces, &hosts)).unwrap();
        let step = predict_step_s(&cost, &plan).unwrap();
        // The slowest replica, plus a reduction of a small model's gradients.
        assert!((4.0..4.1).contains(&step), "{step}");
    }

    /// A running plan of a context-parallel pair is priced from its members' paces (each
    /// on its tokens), predicts the pace measured, and is switched from: with one member
    /// four times slower than measured, the best plan for the new paces is faster than
    /// the pair.
    #[test]
    fn a_context_parallel_plan_is_priced_and_switched_from() {
        let plan = Plan::from_toml(
            "[[replica]]\nlayers = [4]\ncp = [2]\nmicro_batch_size = 1\nnum_micro_batches = 4\n",
            None,
        )
        .unwrap();
        let hosts = vec!["h".to_owned(); 2];
        let cost = fitted_cost(&job(&plan, &[1.0, 1.0], &hosts)).unwrap();
        let step = predict_step_s(&cost, &plan).unwrap();
        assert!((1.0..1.1).contains(&step), "{step}");
        let slowed = fitted_cost(&job(&plan, &[1.0, 4.0], &hosts)).unwrap();
        let current = predict_step_s(&slowed, &plan).unwrap();
        assert!((3.9..4.2).contains(&current), "{current}");
        let placed = vec![None, None];
        let (best, _) = best_plan_for(&slowed, &request(4), &placed).unwrap();
        let best_s = predict_step_s(&slowed, &best).unwrap();
        assert!(best_s < current, "{best_s} vs {current}");
    }

    /// A hand-written ragged plan in any order of sizes is priced as its samples in
    /// micro-batches of its largest, the last one short; a shorter last micro-batch
    /// costs less than a full one.
    #[test]
    fn ragged_plans_in_any_order_are_priced() {
        let hosts = vec!["h".to_owned(); 2];
        let paces = [1.0, 1.0];
        let fitted = fitted_cost(&job(&data_parallel(2), &paces, &hosts)).unwrap();
        let with = |sizes: [Vec<usize>; 2]| {
            let replicas = (sizes.into_iter().enumerate())
                .map(|(r, sizes)| {
                    ReplicaPipeline::single_ranks(
                        StageLayout::new(vec![4], 4).unwrap(),
                        ReplicaBatch::ragged(sizes),
                        vec![r],
                        Vec::new(),
                    )
                })
                .collect();
            predict_step_s(&fitted, &Plan::new(replicas).unwrap()).unwrap()
        };
        let any_order = with([vec![1, 4, 1], vec![2, 2, 4]]);
        let filled = with([vec![4, 2], vec![4, 4]]);
        assert!(
            (any_order - filled).abs() < 1e-12,
            "{any_order} vs {filled}"
        );
        let short = with([vec![4, 1], vec![4, 1]]);
        let full = with([vec![4, 4], vec![4, 4]]);
        assert!(short < full, "{short} vs {full}");
    }

    #[test]
    fn a_slow_rank_gets_less_work_and_every_rank_a_place() {
        let plan = data_parallel(4);
        let hosts = vec!["h".to_owned(); 4];
        let paces = [1.0, 4.0, 1.0, 1.0];
        let cost = fitted_cost(&job(&plan, &paces, &hosts)).unwrap();
        let (best, step) = best_plan_for(&cost, &request(16), &[]).unwrap();
        assert_eq!(best.world_size(), 4);
        assert_eq!(best.global_batch_size(), 16);
        // Rank 1 computes a sample in 1 s, the others in 0.25 s: 5 samples each for
        // ranks 0, 2, 3 and 1 for rank 1 take 1.25 s, against 4 s now.
        assert!(step < 1.6, "{step}: {best:?}");
        let (replica, _) = best.position(1).unwrap();
        let samples = |r: &ReplicaPipeline| r.batch.samples();
        let slow = samples(&best.replicas()[replica]);
        assert!(
            best.replicas().iter().all(|r| samples(r) >= slow),
            "{best:?}"
        );
    }

    /// The re-planner prices each rank within the memory its placement names: a rank
    /// too small for the whole model's state (about 3.9 MB here) holds a whole replica
    /// no longer, though its pace alone would give it one (tensor parallelism, searched
    /// as `synerfuse plan` searches it, may share it out).
    #[test]
    fn a_rank_keeps_to_the_memory_it_was_placed_with() {
        let hosts = vec!["h".to_owned(); 2];
        let paces = [1.0, 1.0];
        let held_by_rank_1 = |memory_gb: f64| {
            let placements = [
                RankPlacement {
                    memory_gb: Some(1.0),
                    ..RankPlacement::default()
                },
                RankPlacement {
                    memory_gb: Some(memory_gb),
                    ..RankPlacement::default()
                },
            ];
            let replicas = (0..2)
                .map(|r| {
                    ReplicaPipeline::single_ranks(
                        StageLayout::new(vec![4], 4).unwrap(),
                        ReplicaBatch::uniform(1, 8),
                        vec![r],
                        vec![placements[r].clone()],
                    )
                })
                .collect();
            let plan = Plan::new(replicas).unwrap();
            let cost = fitted_cost(&job(&plan, &paces, &hosts)).unwrap();
            let request = running_job_request(16, false, false);
            let placed: Vec<_> = (0..2).map(|r| plan.placement(r).cloned()).collect();
            let (best, _) = best_plan_for(&cost, &request, &placed).unwrap();
            assert_eq!(best.placement(1).unwrap().memory_gb, Some(memory_gb));
            let (replica, stage) = best.position(1).unwrap();
            let r = &best.replicas()[replica];
            (r.stages.layers()[stage], r.ranks[stage].len())
        };
        assert_eq!(held_by_rank_1(1.0), (4, 1));
        // Fewer layers, or a tensor-parallel share of them.
        let small = held_by_rank_1(0.0035);
        assert!(small.0 < 4 || small.1 > 1, "{small:?}");
    }

    #[test]
    fn bad_paces_are_refused_by_rank() {
        let plan = data_parallel(2);
        let hosts = vec!["h".to_owned(); 2];
        let error = fitted_cost(&job(&plan, &[1.0, 0.0], &hosts)).unwrap_err();
        assert_eq!(
            error,
            ReplanError::Pace {
                rank: 1,
                pace_s: 0.0
            }
        );
        let error = fitted_cost(&job(&plan, &[1.0], &hosts)).unwrap_err();
        assert!(
            error.to_string().contains("one pace per rank: got 1 for 2"),
            "{error}"
        );
    }

    #[test]
    fn survivors_get_a_plan_of_their_own() {
        let plan = data_parallel(4);
        let hosts = vec!["h".to_owned(); 4];
        let paces = [1.0, 1.0, 1.0, 1.0];
        let kept = [0, 1, 3];
        let cost = fitted_cost_of(&job(&plan, &paces, &hosts), &kept).unwrap();
        let placements: Vec<_> = (kept.iter())
            .map(|&r| {
                Some(RankPlacement {
                    kind: Some(format!("rank {r}")),
                    ..RankPlacement::default()
                })
            })
            .collect();
        let (best, _) = best_plan_for(&cost, &request(16), &placements).unwrap();
        assert_eq!(best.world_size(), 3);
        assert_eq!(best.global_batch_size(), 16);
        // Survivor 2 was rank 3.
        assert_eq!(best.placement(2).unwrap().kind.as_deref(), Some("rank 3"));
    }

    /// A context-parallel pair of tensor-parallel pairs is priced from its ranks' paces
    /// and predicts the pace measured.
    #[test]
    fn a_plan_of_context_parallel_tensor_parallel_groups_is_priced() {
        let text = "[[replica]]\nlayers = [4]\ncp = [2]\ncp_shares = [[3, 1]]\n\
                    micro_batch_size = 1\nnum_micro_batches = 4\n";
        let plan = Plan::from_toml(text, None).unwrap();
        let replicas = vec![ReplicaPipeline {
            ranks: vec![vec![0, 1, 2, 3]],
            ..plan.replicas()[0].clone()
        }];
        let plan = Plan::new(replicas).unwrap();
        assert_eq!(
            (plan.replicas()[0].tp_size(0), plan.replicas()[0].cp_size(0)),
            (2, 2)
        );
        let hosts = vec!["h".to_owned(); 4];
        let cost = fitted_cost(&job(&plan, &[1.0; 4], &hosts)).unwrap();
        let step = predict_step_s(&cost, &plan).unwrap();
        assert!((1.0..1.1).contains(&step), "{step}");
    }

    /// A job on two ranks of 0.15 GB at sequence 1024 (one query group: no tensor
    /// parallelism) runs a two-stage pipeline; rank 1 runs at half speed. Neither rank
    /// holds the whole model's activations, so without context parallelism the pipeline
    /// stays the best plan; the re-planner switches into a context-parallel pair that
    /// splits every sequence 2 : 1, faster.
    #[test]
    fn a_job_is_switched_into_context_parallelism_where_memory_binds() {
        let plan = two_stage_pipeline(0.15, 4);
        let hosts = vec!["h".to_owned(); 2];
        let model = ModelShape {
            seq_length: 1024,
            num_kv_heads: 1,
            ..model()
        };
        let job = RunningJob {
            model,
            ..job(&plan, &[1.0, 2.0], &hosts)
        };
        let cost = fitted_cost(&job).unwrap();
        let placed: Vec<_> = (0..2).map(|r| plan.placement(r).cloned()).collect();
        let mut request = running_job_request(4, false, false);
        let (best, step) = best_plan_for(&cost, &request, &placed).unwrap();
        let replica = &best.replicas()[0];
        assert_eq!(
            (replica.cp_size(0), replica.context_shares(0)),
            (2, Some(vec![2, 1])),
            "{best:?}"
        );
        request.context_parallel_sizes = vec![1];
        let (without, without_s) = best_plan_for(&cost, &request, &placed).unwrap();
        assert!(!without.has_context_parallelism());
        assert!(step < 0.9 * without_s, "{step} vs {without_s}");
    }

    fn experts() -> ModelShape {
        ModelShape {
            experts: Some(synerfuse_plan::ExpertShape {
                num_experts: 4,
                top_k: 2,
                ffn_hidden_size: 128,
                layer_freq: 1,
            }),
            ..model()
        }
    }

    fn expert_job<'a>(plan: &'a Plan, paces: &'a [f64], hosts: &'a [String]) -> RunningJob<'a> {
        RunningJob {
            model: experts(),
            ..job(plan, paces, hosts)
        }
    }

    /// A running plan of expert parallelism is priced with its exchange, and its groups'
    /// members meet at every MoE layer: two replicas of two stages whose slow ranks sit
    /// at different stages run as if both stages of both were slow (as each stage waits
    /// for its group's slow member), and a plan of groups of different sizes is priced
    /// stage by stage.
    #[test]
    fn an_expert_parallel_plan_is_priced_with_its_exchange_in_lockstep() {
        let hosts = vec!["h".to_owned(); 4];
        let whole = data_parallel(2);
        let split = data_parallel(2).with_even_experts(2).unwrap();
        let cost = fitted_cost(&expert_job(&whole, &[1.0, 1.0], &hosts[..2])).unwrap();
        let (plain, exchanged) = (
            predict_step_s(&cost, &whole).unwrap(),
            predict_step_s(&cost, &split).unwrap(),
        );
        assert!(exchanged > plain, "{exchanged} vs {plain}");
        let pipelines = Plan::from_toml(
            &"[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 4\n\n"
                .repeat(2),
            None,
        )
        .unwrap()
        .with_even_experts(2)
        .unwrap();
        let predicted = |paces: &[f64]| {
            let cost = fitted_cost(&expert_job(&pipelines, paces, &hosts)).unwrap();
            predict_step_s(&cost, &pipelines).unwrap()
        };
        let apart = predicted(&[4.0, 1.0, 1.0, 4.0]);
        let together = predicted(&[4.0, 1.0, 4.0, 1.0]);
        assert!(apart > 1.1 * together, "{apart} vs {together}");
        let mixed = pipelines
            .clone()
            .with_even_experts_by_stage(|s| [2, 1][s])
            .unwrap();
        // Stages of their own sizes are priced each at its own: the second stage's
        // exchange gone (less than the plan dividing both), its experts reduced over the
        // replicas (more than the plan dividing neither, whose pipelines wait no peer).
        let paced = |plan: &Plan| {
            let cost = fitted_cost(&expert_job(plan, &[1.0; 4], &hosts)).unwrap();
            predict_step_s(&cost, plan).unwrap()
        };
        let whole = Plan::from_toml(
            &"[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 4\n\n"
                .repeat(2),
            None,
        )
        .unwrap();
        let (divided, part, none) = (paced(&pipelines), paced(&mixed), paced(&whole));
        assert!(none < part && part < divided, "{none} < {part} < {divided}");
    }

    /// A mixture of experts on two ranks of 45 MB each, running a pipeline of two stages:
    /// its experts (3.1 M parameters, 63 MB of state) fit no rank whole, so the
    /// re-planner's only other plans divide them; each replica holding half of every
    /// layer's experts (expert parallelism 2) runs without the pipeline's bubble, and the
    /// re-planner switches into it, its experts placed (a part per replica, all held).
    #[test]
    fn a_job_is_switched_into_expert_parallelism_where_memory_binds() {
        let (plan, cost) = fitted_memory_bound_pipeline(0.045, &[1.0, 1.0]);
        let running_s = predict_step_s(&cost, &plan).unwrap();
        let placed: Vec<_> = (0..2).map(|r| plan.placement(r).cloned()).collect();
        let request = running_job_request(8, false, false);
        let (best, step) = best_plan_for(&cost, &request, &placed).unwrap();
        let groups = best.expert_groups(8).unwrap();
        assert_eq!(best.replicas().len(), 2, "{best:?}");
        assert_eq!(groups.len(), 1, "{groups:?}");
        let mut held: Vec<usize> = groups[0].placement.concat();
        held.sort_unstable();
        assert_eq!(held, (0..8).collect::<Vec<_>>());
        assert!(step < 0.95 * running_s, "{step} vs {running_s}");
        let without = PlanRequest {
            expert_parallel_sizes: vec![1],
            ..request
        };
        // Without it, memory keeps the run a pipeline (every expert held by a stage).
        let (kept, _) = best_plan_for(&cost, &without, &placed).unwrap();
        assert!(kept.expert_groups(8).unwrap().is_empty(), "{kept:?}");
        assert!(kept.replicas()[0].stages.num_stages() > 1, "{kept:?}");
    }

    /// A pipeline of two stages (layers [2, 2]) on ranks 0 and 1 of `memory_gb` each,
    /// `micro_batches` micro-batches of 1.
    fn two_stage_pipeline(memory_gb: f64, micro_batches: usize) -> Plan {
        let placement = RankPlacement {
            memory_gb: Some(memory_gb),
            ..RankPlacement::default()
        };
        Plan::new(vec![ReplicaPipeline::single_ranks(
            StageLayout::new(vec![2, 2], 4).unwrap(),
            ReplicaBatch::uniform(1, micro_batches),
            vec![0, 1],
            vec![placement; 2],
        )])
        .unwrap()
    }

    /// [`two_stage_pipeline`] with 8 micro-batches, and a mixture of 8 experts (3.1 M
    /// parameters of experts, 63 MB of state).
    fn memory_bound_pipeline(memory_gb: f64) -> (Plan, ModelShape) {
        let plan = two_stage_pipeline(memory_gb, 8);
        let model = ModelShape {
            num_kv_heads: 1,
            experts: Some(synerfuse_plan::ExpertShape {
                num_experts: 8,
                top_k: 2,
                ffn_hidden_size: 512,
                layer_freq: 1,
            }),
            ..model()
        };
        (plan, model)
    }

    /// [`memory_bound_pipeline`] on one host, its ranks measured at `paces`, and the cost
    /// model fitted to them.
    fn fitted_memory_bound_pipeline(memory_gb: f64, paces: &[f64]) -> (Plan, CostModel) {
        let (plan, model) = memory_bound_pipeline(memory_gb);
        let hosts = vec!["h".to_owned(); 2];
        let job = RunningJob {
            model,
            ..job(&plan, paces, &hosts)
        };
        let cost = fitted_cost(&job).unwrap();
        (plan, cost)
    }

    /// Experts placed by measured pace: two ranks measured at speeds 1 and about 0.5
    /// (the pipeline above, unbounded memory), asked for EP 2: the faster rank's replica
    /// holds more of the experts (5 of 8).
    #[test]
    fn experts_are_placed_by_the_measured_paces() {
        let (_, cost) = fitted_memory_bound_pipeline(1.0, &[1.0, 2.0]);
        let request = PlanRequest {
            expert_parallel_sizes: vec![2],
            ..running_job_request(8, false, false)
        };
        let outcome = crate::planner::plan(&cost, &request).unwrap();
        let best = &outcome.plans[0];
        let placement = best
            .expert_placement(&cost)
            .unwrap()
            .expect("experts divided");
        // Replica r runs on device (rank) best.devices[0][r].
        let held = |rank: usize| {
            let r = best.devices[0].iter().position(|&u| u == rank).unwrap();
            placement[0][r].len()
        };
        assert!(held(0) > held(1), "{placement:?} {best:?}");
    }
}
