//! The running job's measured paces as a cost model: one device per rank, each at the
//! speed at which its current work takes its measured pace.

use super::job::{ReplanError, RunningJob};
use super::predict::stage_group;
use crate::cluster::{ClusterSpec, DeviceGroup};
use crate::cost::{CostModel, Recompute};
use crate::profile::Profile;
use std::collections::BTreeMap;
use synerfuse_plan::{MeasuredCosts, ModelShape};

/// The kind of every rank of a fitted cluster: its numbers are the fitted profile's.
const FITTED_KIND: &str = "cpu";

/// The rate a FLOP is priced at before a rank's speed: one TFLOP/s.
const UNIT_RATE: f64 = 1e12;

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
/// speed its measured pace shows (see the `running` module's documentation).
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
        let pace_s = job.paces_s[rank];
        if !(pace_s > 0.0 && pace_s.is_finite()) {
            return Err(ReplanError::Pace { rank, pace_s });
        }
        groups.push(DeviceGroup {
            kind: FITTED_KIND.to_owned(),
            count: 1,
            node: Some(crate::calibrate::run_node(job.plan, job.hosts, rank)),
            tflops_bf16: None,
            tflops_fp16: None,
            bf16: None,
            // The memory the plan placed the rank with, so a plan that would not fit
            // (or fits only recomputing) is priced so.
            memory_gb: job.plan.placement(rank).and_then(|p| p.memory_gb),
            mem_bw_gbs: None,
            efficiency: None,
            site: job.plan.placement(rank).and_then(|p| p.site.clone()),
            speed: Some(unit_work_s(job, &unit, rank)? / pace_s),
        });
    }
    let measured = job.network.filter(|n| n.p2p_bytes_per_s > 0.0);
    let cluster = ClusterSpec {
        memory_headroom: 0.1,
        group: groups,
        network: crate::calibrate::run_network(
            job.plan,
            measured.map_or(100.0, |n| n.p2p_bytes_per_s / 1e9),
            measured.map_or(10.0, |n| n.latency_s * 1e6),
        ),
    };
    let profile = Profile {
        model: job.model.clone(),
        devices: BTreeMap::from([(FITTED_KIND.to_owned(), BTreeMap::from([(1, unit)]))]),
        network: measured,
        calibration: None,
    };
    let mut cost = CostModel::new(job.model.clone(), cluster, Some(profile));
    cost.compute_bytes = job.compute_bytes;
    cost.overlap_grad_reduce = job.overlap_grad_reduce;
    cost.ddp_bucket_size = job.ddp_bucket_size;
    cost.overlap_param_gather = job.overlap_param_gather;
    cost.hierarchical_reduction = job.hierarchical_reduction;
    cost.recompute = match job.recompute {
        true => Recompute::Always,
        false => Recompute::Never,
    };
    Ok(cost)
}
