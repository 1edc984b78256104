//! The cost model (ARCHITECTURE.md, "planning"): compute per layer and micro-batch size (a
//! measured profile, or FLOPs over a calibrated peak), memory per rank with an explicit
//! verdict, and communication (p2p, ring and hierarchical all-reduce).

use crate::cluster::{ClusterSpec, Device};
use crate::profile::Profile;
use std::collections::BTreeMap;
use synerfuse_plan::{ModelShape, Precision};

/// What a stage costs on one device at one micro-batch size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageCosts {
    /// One layer, forward + backward, per micro-batch, s.
    pub layer_s: f64,
    /// Share of `layer_s` that is the forward.
    pub forward_fraction: f64,
    /// Embedding per micro-batch (first stage), s.
    pub embedding_s: f64,
    /// Head per micro-batch (last stage), s.
    pub head_s: f64,
    /// Activation bytes per layer and micro-batch in flight.
    pub activation_bytes: f64,
}

impl StageCosts {
    /// The costs of a stage that recomputes: its forward runs twice, once without its
    /// graph and again in its backward.
    pub fn recomputed(&self) -> StageCosts {
        let again = 1.0 + self.forward_fraction;
        StageCosts {
            layer_s: self.layer_s * again,
            embedding_s: self.embedding_s * again,
            head_s: self.head_s * again,
            forward_fraction: self.forward_fraction / again,
            ..*self
        }
    }
}

/// Why a device cannot be costed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CostError {
    /// A kind with neither catalogue numbers nor a profile.
    #[error("device kind {0}: no catalogue numbers: give a profile (synerfuse profile) or custom numbers")]
    NoNumbers(String),
    /// A bf16 job kept in bf16 on a device without it.
    #[error("device kind {0} has no bf16 (the catalogue; or its group's bf16 = false): let the plan give it fp16 (drop --no-fp16-fallback) or leave it out of the cluster")]
    NoBf16(String),
}

/// Bytes of model and optimizer state per parameter, as the trainer allocates them
/// (measured and compared in the tests): fp32, parameter 4 + gradient 4 + fp32 main
/// gradient 4 + two moments 8; bf16, parameter 2 + gradient 2 + main gradient 4 + fp32
/// master 4 + moments 8.
pub const STATE_BYTES_PER_PARAM: f64 = 20.0;

/// Device-to-host copy bandwidth of a host-staged send (PCIe 4.0 x16: 32 GB/s per
/// direction, ~0.8 of it achieved).
pub const HOST_COPY_BYTES_PER_S: f64 = 25e9;

/// Bytes of memory traffic of one AdamW step per parameter: the fp32 value, gradient
/// and two moments read, the value and moments written, the training copy written
/// (bf16).
pub const OPTIMIZER_BYTES_PER_PARAM: f64 = 30.0;

/// Compute, memory and communication costs of a model on a cluster.
#[derive(Debug, Clone)]
pub struct CostModel {
    /// The model.
    pub model: ModelShape,
    /// The cluster.
    pub cluster: ClusterSpec,
    /// Measured costs, when profiled (they override the catalogue).
    pub profile: Option<Profile>,
    /// Bytes per activation and parameter element on the wire (2 for bf16, 4 for fp32).
    pub compute_bytes: f64,
    /// The job's precision (`--bf16`, the planner's default, or `--fp16`).
    pub precision: Precision,
    /// Whether a bf16 job computes in fp16 on devices without bf16 (priced at their fp16
    /// peak, and written so into the plan); off: `--no-fp16-fallback` refuses them.
    pub fp16_fallback: bool,
    /// Bytes of model and optimizer state per parameter (20 in synerfuse: parameter,
    /// gradient, fp32 gradient buffer, two fp32 moments; bf16 adds the master and halves
    /// parameter and gradient).
    pub state_bytes_per_param: f64,
    /// Which stages recompute their activations: a recomputing stage's forward runs
    /// again in its backward, and a micro-batch in flight keeps only its input.
    pub recompute: Recompute,
    /// `--use-distributed-optimizer`: the optimizer's state and step sharded over the
    /// replicas of a stage, in proportion to their memory.
    pub distributed_optimizer: bool,
    /// `--expert-model-parallel-size`: each MoE layer's experts divided over this many
    /// replicas (1: each holds all), tokens exchanged by all-to-all.
    pub expert_parallel: usize,
    /// Tokens each expert took per MoE layer, in layer order (measured in a run:
    /// `--log-json`'s `moe.tokens_per_expert`); `None`: equal.
    pub expert_load: Option<Vec<Vec<f64>>>,
    /// Each gradient reduction's buckets start inside the last backward (the runtime's
    /// default; off: `--no-overlap-grad-reduce`, every reduction after the pipeline).
    pub overlap_grad_reduce: bool,
    /// `--ddp-bucket-size` (elements); `None`: the runtime's default ([`bucket_size`]).
    pub ddp_bucket_size: Option<usize>,
    /// `--overlap-param-gather`: under the distributed optimizer each bucket's gather of
    /// the updated parameters is waited for by the next forward, just before the first
    /// piece that reads it (off: after the optimizer, exposed).
    pub overlap_param_gather: bool,
    /// Reductions whose members span nodes go island by island (the runtime's default;
    /// off: `--no-hierarchical-reduction`, one flat ring).
    pub hierarchical_reduction: bool,
    /// Whether a last stage alone on its device (no tensor, context or expert
    /// parallelism) runs its loss with the output layer in chunks, as the runtime's 1F1B
    /// does ([`StageHolding::loss_in_chunks`]); off: priced with the whole logits, as
    /// Megatron's loss and a GPipe schedule hold them.
    pub loss_in_chunks: bool,
}

/// Elements per bucket of a gradient reduction over `members` ranks, as the runtime
/// cuts them (`ParallelConfig::bucket_size`): `--ddp-bucket-size`, else Megatron's
/// max(40M, 1M × members); one bucket (`usize::MAX`) without overlap.
pub fn bucket_size(overlap: bool, ddp_bucket_size: Option<usize>, members: usize) -> usize {
    match (overlap, ddp_bucket_size) {
        (false, _) => usize::MAX,
        (true, Some(size)) => size,
        (true, None) => 40_000_000usize.max(1_000_000usize.saturating_mul(members)),
    }
}

/// The element-wise sum of `rows`, each `width` long (tokens per expert over layers).
pub(crate) fn summed_rows<'a>(
    rows: impl IntoIterator<Item = &'a Vec<f64>>,
    width: usize,
) -> Vec<f64> {
    let mut sum = vec![0.0; width];
    for row in rows {
        for (s, x) in sum.iter_mut().zip(row) {
            *s += x;
        }
    }
    sum
}

/// Which stages of a plan recompute their activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Recompute {
    /// None.
    #[default]
    Never,
    /// Those that would not fit otherwise.
    WhereNeeded,
    /// Every stage (`--recompute-activations`).
    Always,
}

/// What a rank holds of its stage, for [`CostModel::memory_bytes`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageHolding {
    /// Decoder layers.
    pub layers: usize,
    /// Whether it holds the embedding.
    pub first: bool,
    /// Whether it holds the final norm and output layer.
    pub last: bool,
    /// Micro-batches whose activations it keeps at once (1F1B: min(p − i, m)).
    pub in_flight: usize,
    /// Their size.
    pub micro_batch_size: usize,
    /// Its share of the stage's optimizer state under the distributed optimizer (1:
    /// all of it).
    pub optimizer_share: f64,
    /// Whether it recomputes its activations.
    pub recompute: bool,
    /// Whether a last stage runs its output layer with the loss, chunk by chunk, in the
    /// forward (a lone device, no tensor, context or expert parallelism, not
    /// recomputing, 1F1B): it never holds the whole logits.
    pub loss_in_chunks: bool,
}

impl CostModel {
    /// A model for bf16 training with synerfuse's optimizer state.
    pub fn new(model: ModelShape, cluster: ClusterSpec, profile: Option<Profile>) -> Self {
        CostModel {
            model,
            cluster,
            profile,
            compute_bytes: 2.0,
            precision: Precision::Bf16,
            fp16_fallback: true,
            state_bytes_per_param: STATE_BYTES_PER_PARAM,
            recompute: Recompute::Never,
            distributed_optimizer: false,
            expert_parallel: 1,
            expert_load: None,
            overlap_grad_reduce: true,
            ddp_bucket_size: None,
            overlap_param_gather: false,
            hierarchical_reduction: true,
            loss_in_chunks: true,
        }
    }

    /// What `device` computes in: the job's precision, but fp16 for a bf16 job on a
    /// device without bf16 (with the fallback; without it [`Self::check_precisions`]
    /// refuses the cluster).
    pub fn precision_of(&self, device: &Device) -> Precision {
        (device.spec)
            .and_then(|s| s.runs(self.precision, self.fp16_fallback))
            .unwrap_or(self.precision)
    }

    /// Whether `devices` (the cluster's, as [`ClusterSpec::devices`] lists them) compute
    /// in more than one precision (a plan then names each rank's).
    pub fn mixes_precisions(&self, devices: &[Device]) -> bool {
        devices
            .iter()
            .any(|d| self.precision_of(d) != self.precision)
    }

    /// Every device can compute in the job's precision, or the fallback's.
    pub fn check_precisions(&self) -> Result<(), CostError> {
        let runs = |s: crate::cluster::DeviceSpec| s.runs(self.precision, self.fp16_fallback);
        let devices = self.cluster.devices();
        let cannot = devices
            .iter()
            .find(|d| d.spec.is_some_and(|s| runs(s).is_none()));
        cannot.map_or(Ok(()), |d| Err(CostError::NoBf16(d.kind.clone())))
    }

    /// Whether the distributed optimizer's parameter gathers overlap the next forward:
    /// asked for, with the overlapped reduction the runtime needs for it.
    pub fn overlaps_param_gather(&self) -> bool {
        self.overlap_param_gather && self.overlap_grad_reduce
    }

    /// Elements per bucket of a gradient reduction over `members` ranks ([`bucket_size`]).
    pub fn bucket_size(&self, members: usize) -> usize {
        bucket_size(self.overlap_grad_reduce, self.ddp_bucket_size, members)
    }

    /// A mean layer's expert parameters each member of an expert-parallel group holds
    /// (its part; 0 without expert parallelism, where the experts reduce with the rest).
    pub fn expert_part_params(&self) -> f64 {
        match self.expert_parallel {
            0 | 1 => 0.0,
            ep => self.model.expert_layer_params() / ep as f64,
        }
    }

    /// Parameters a rank of a stage of `layers` layers holds (its expert-parallel part
    /// of the experts), with the embedding when `first`, the head when `last`.
    pub fn stage_params(&self, layers: usize, first: bool, last: bool) -> f64 {
        let part = 1.0 - 1.0 / self.expert_parallel.max(1) as f64;
        (self.model).stage_params(layers, first, last)
            - layers as f64 * self.model.expert_layer_params() * part
    }

    /// Under expert parallelism, the most loaded member's expert tokens over the
    /// members' mean (1: even), the experts placed by [`crate::expert_placement::place_experts`]
    /// on alike members over the tokens of every MoE layer of [`CostModel::expert_load`]
    /// summed (a plan holds one placement per stage for all its MoE layers; a layer
    /// whose own load is less even than the sum is priced at the sum's).
    pub fn expert_imbalance(&self) -> f64 {
        let (Some(loads), Some(e)) = (&self.expert_load, self.model.experts) else {
            return 1.0;
        };
        let ep = self.expert_parallel;
        if ep <= 1 {
            return 1.0;
        }
        let summed = summed_rows(loads, e.num_experts);
        let members = vec![
            crate::expert_placement::ExpertMember {
                speed: 1.0,
                capacity: e.num_experts,
            };
            ep
        ];
        let total: f64 = summed.iter().sum();
        let Ok(placed) = crate::expert_placement::place_experts(&summed, &members) else {
            return 1.0;
        };
        let most = (placed.iter())
            .map(|m| m.iter().map(|&x| summed[x]).sum::<f64>())
            .fold(0.0, f64::max);
        match total > 0.0 {
            true => most * ep as f64 / total,
            false => 1.0,
        }
    }

    /// Per-layer costs of `device` at micro-batch size `b`.
    pub fn stage_costs(&self, device: &Device, b: usize) -> Result<StageCosts, CostError> {
        let measured = self.profile.as_ref().and_then(|p| p.costs(&device.kind, b));
        let costs = match (measured, device.spec) {
            (Some(m), _) => StageCosts {
                layer_s: m.layer_fwd_s + m.layer_bwd_s,
                forward_fraction: m.layer_fwd_s / (m.layer_fwd_s + m.layer_bwd_s).max(1e-30),
                embedding_s: m.embedding_s,
                head_s: m.head_s,
                activation_bytes: m.layer_activation_bytes,
            },
            (None, Some(spec)) => {
                // Small micro-batches reach less of the peak.
                let eta = device.efficiency * (b as f64 / (b as f64 + 0.5));
                let rate = spec.peak(self.precision_of(device)) * 1e12 * eta;
                let layer = 3.0 * self.model.layer_forward_flops(b) / rate;
                StageCosts {
                    layer_s: layer,
                    forward_fraction: 1.0 / 3.0,
                    embedding_s: (b * self.model.seq_length * self.model.hidden_size) as f64
                        * self.compute_bytes
                        * 3.0
                        / (spec.mem_bw_gbs * 1e9),
                    head_s: 3.0 * self.model.head_forward_flops(b) / rate,
                    activation_bytes: self.model.layer_activation_bytes(
                        b,
                        self.compute_bytes,
                        spec.accelerator,
                    ),
                }
            }
            (None, None) => return Err(CostError::NoNumbers(device.kind.clone())),
        };
        let slow = 1.0 / device.speed;
        Ok(StageCosts {
            layer_s: costs.layer_s * slow,
            embedding_s: costs.embedding_s * slow,
            head_s: costs.head_s * slow,
            ..costs
        })
    }

    /// Seconds a step takes beyond what is simulated: the profile's calibrated overhead.
    pub fn step_overhead_s(&self) -> f64 {
        self.profile.as_ref().map_or(0.0, Profile::step_overhead_s)
    }

    /// Seconds of the optimizer step over `params` parameters on `device`: measured per
    /// parameter where profiled, else an accelerator's memory traffic over its
    /// bandwidth; `None` where neither is known (a CPU kind not profiled for it).
    pub fn optimizer_seconds(&self, device: &Device, params: f64) -> Option<f64> {
        let measured = (self.profile.as_ref())
            .and_then(|p| p.costs(&device.kind, 1))
            .and_then(|c| c.optimizer_s_per_param);
        let per_param = match (measured, device.spec) {
            (Some(s), _) => s,
            (None, Some(spec)) if spec.accelerator => {
                OPTIMIZER_BYTES_PER_PARAM / (spec.mem_bw_gbs * 1e9)
            }
            _ => return None,
        };
        Some(params * per_param / device.speed)
    }

    /// Usable memory of `device` in bytes (after headroom and runtime context), or
    /// `None` when nothing is known (no limit).
    pub fn usable_memory(&self, device: &Device) -> Option<f64> {
        let spec = device.spec?;
        let context = if spec.accelerator { 1e9 } else { 0.0 };
        Some(spec.memory_gb * 1e9 * (1.0 - self.cluster.memory_headroom) - context)
    }

    /// Bytes a rank needs holding its stage ([`StageHolding`]): the stage's state (the
    /// optimizer's part only its share under the distributed optimizer), the activations
    /// of its micro-batches in flight (only their inputs when recomputed, plus one
    /// micro-batch's graph rebuilt for its backward), and the logits on the last stage.
    pub fn memory_bytes(&self, costs: &StageCosts, stage: &StageHolding) -> f64 {
        let m = &self.model;
        let (layers, b) = (stage.layers, stage.micro_batch_size);
        let mut bytes = self.state_bytes(stage);
        bytes += match stage.recompute {
            true => {
                stage.in_flight as f64 * m.activation_message_bytes(b, self.compute_bytes)
                    + layers as f64 * costs.activation_bytes
            }
            false => (stage.in_flight * layers) as f64 * costs.activation_bytes,
        };
        if stage.last {
            bytes += self.loss_bytes(b, stage.loss_in_chunks && !stage.recompute);
        }
        bytes
    }

    /// The last stage's loss buffers for one micro-batch of `b` samples.
    fn loss_bytes(&self, b: usize, in_chunks: bool) -> f64 {
        let m = &self.model;
        let c = self.compute_bytes;
        let tokens = (b * m.seq_length) as f64;
        let (hidden, vocab) = (m.hidden_size as f64, m.vocab_size as f64);
        match in_chunks {
            // A chunk's logits (4 x the micro-batch's hidden states, see the model's
            // `loss` module): in the compute dtype, their fp32 log-probabilities and
            // gradient; the head's fp32 gradient sum and its copy in the compute dtype,
            // and the hidden states' gradient, kept for the backward.
            true => {
                let chunk_logits = (4.0 * tokens * hidden).min(tokens * vocab);
                chunk_logits * (c + 8.0) + vocab * hidden * (4.0 + c) + tokens * hidden * c
            }
            // At the loss's backward: the logits, the fp32 log-softmax kept by the
            // cross-entropy, the gradient of it and the one it produces (fp32 each).
            false => tokens * vocab * (c + 12.0),
        }
    }

    /// The state part of [`CostModel::memory_bytes`]: parameters, gradients and optimizer
    /// state (the optimizer's part only its share under the distributed optimizer).
    pub fn state_bytes(&self, stage: &StageHolding) -> f64 {
        let params = self.stage_params(stage.layers, stage.first, stage.last);
        let mut bytes = params * self.state_bytes_per_param;
        if self.distributed_optimizer {
            bytes -= params * self.optimizer_bytes_per_param() * (1.0 - stage.optimizer_share);
        }
        bytes
    }

    /// Bytes per parameter the distributed optimizer shards: the state less the
    /// parameter, its gradient (both in the compute dtype) and the fp32 main gradient
    /// (12 in bf16: master and moments; 8 in fp32: the moments).
    pub fn optimizer_bytes_per_param(&self) -> f64 {
        (self.state_bytes_per_param - 2.0 * self.compute_bytes - 4.0).max(0.0)
    }

    /// Seconds to send one activation of a `b`-sample micro-batch from `a` to `b_dev`.
    pub fn p2p_seconds(&self, a: &Device, b_dev: &Device, b: usize) -> f64 {
        let t = self.transfer(a, b_dev, b);
        t.sender_s + t.transit_s
    }

    /// One activation of a `b`-sample micro-batch from `a` to `b_dev`, split between
    /// its sender and the link: the sender pays the per-message latency and, when an
    /// accelerator sends to a CPU rank (a host-staged link), the copy to host memory
    /// ([`HOST_COPY_BYTES_PER_S`]); the bytes then cross the link while it goes on.
    pub fn transfer(&self, a: &Device, b_dev: &Device, b: usize) -> crate::sim::Transfer {
        let bytes = self.model.activation_message_bytes(b, self.compute_bytes);
        let (bw, lat) = match self.profile.as_ref().and_then(|p| p.network) {
            Some(n) if a.node == b_dev.node => (n.p2p_bytes_per_s, n.latency_s),
            _ => {
                let link = self.cluster.network.between(a.host(), b_dev.host());
                (link.bytes_per_s, link.latency_s)
            }
        };
        let accelerator = |d: &Device| d.spec.is_some_and(|s| s.accelerator);
        let staging = match accelerator(a) && !accelerator(b_dev) {
            true => bytes / HOST_COPY_BYTES_PER_S,
            false => 0.0,
        };
        crate::sim::Transfer {
            sender_s: lat + staging,
            transit_s: bytes / bw,
        }
    }

    /// Seconds of an all-to-all in which each of `devices` sends `bytes` spread evenly
    /// over the others: (d − 1)/d of them over the slowest link, half a ring all-reduce
    /// of the same bytes (a reduce-scatter and an all-gather, each moving as much).
    pub fn alltoall_seconds(&self, devices: &[&Device], bytes: f64) -> f64 {
        self.allreduce_seconds(devices, bytes) / 2.0
    }

    /// Seconds of the fp32 gradient all-reduce of `bytes` over `devices`, as the runtime
    /// runs it: a ring within one node; across nodes NCCL's where it carries the group
    /// (every member an NVIDIA-class accelerator), else MPI's flat ring over the slowest
    /// link or the runtime's island by island reduction
    /// (see `island_allreduce_seconds`).
    pub fn allreduce_seconds(&self, devices: &[&Device], bytes: f64) -> f64 {
        let d = devices.len();
        if d <= 1 {
            return 0.0;
        }
        let lat = self.cluster.latency();
        let nodes: std::collections::BTreeSet<&str> =
            devices.iter().map(|dev| dev.node.as_str()).collect();
        if nodes.len() == 1 {
            let d = d as f64;
            return 2.0 * (d - 1.0) * lat + 2.0 * (d - 1.0) / d * bytes / self.intra_allreduce();
        }
        let names: Vec<&str> = nodes.into_iter().collect();
        let slowest = self.cluster.slowest_inter_node(&names);
        if nccl_carries(devices) {
            return self.nccl_allreduce_seconds(devices, bytes, slowest);
        }
        let spans_sites = devices.iter().any(|dev| dev.site != devices[0].site);
        let far_lat = match spans_sites {
            true => (self.cluster.network.inter_site_latency_us).map_or(lat, |us| us * 1e-6),
            false => lat,
        };
        let flat =
            2.0 * (d as f64 - 1.0) * far_lat + 2.0 * (d as f64 - 1.0) / d as f64 * bytes / slowest;
        match self.hierarchical_reduction {
            true => self
                .island_allreduce_seconds(devices, bytes, (slowest, far_lat))
                .unwrap_or(flat),
            false => flat,
        }
    }

    /// NCCL's all-reduce across nodes (its own hierarchy: a ring within each node, the
    /// nodes' rings over the slowest link between them, each carrying 1/g of the bytes
    /// for nodes of g devices).
    fn nccl_allreduce_seconds(&self, devices: &[&Device], bytes: f64, inter: f64) -> f64 {
        let mut nodes: BTreeMap<&str, usize> = BTreeMap::new();
        for dev in devices {
            *nodes.entry(dev.node.as_str()).or_default() += 1;
        }
        let g = *nodes.values().max().unwrap_or(&1) as f64;
        let n = nodes.len() as f64;
        2.0 * (devices.len() as f64 - 1.0) * self.cluster.latency()
            + 2.0 * (g - 1.0) / g * bytes / self.intra_allreduce()
            + 2.0 * (n - 1.0) / n * (bytes / g) / inter
    }

    /// Bytes/s of an all-reduce within one node: measured, or the cluster's link.
    fn intra_allreduce(&self) -> f64 {
        let profiled = self.profile.as_ref().and_then(|p| p.network);
        profiled.map_or(self.cluster.network.intra_node_gbs * 1e9, |n| {
            n.allreduce_bytes_per_s
        })
    }

    /// The runtime's hierarchical all-reduce over `devices`' islands (each site's
    /// devices when they span sites, else each node's): a reduce-scatter and an
    /// all-gather inside the largest island, and each member's piece sent to the holders
    /// of the same elements in every other island, one after another over the `far`
    /// link (bytes/s, latency) — the smallest island's pieces, the largest, set the pace.
    /// `None` where there is no hierarchy (one island, or islands of one device).
    fn island_allreduce_seconds(
        &self,
        devices: &[&Device],
        bytes: f64,
        far: (f64, f64),
    ) -> Option<f64> {
        let by_site = devices.iter().any(|dev| dev.site != devices[0].site);
        let mut islands: BTreeMap<&str, Vec<&Device>> = BTreeMap::new();
        for &dev in devices {
            let key = if by_site {
                dev.site.as_str()
            } else {
                dev.node.as_str()
            };
            islands.entry(key).or_default().push(dev);
        }
        let sizes = islands.values().map(Vec::len);
        let (smallest, largest) = sizes.fold((usize::MAX, 0), |(lo, hi), g| (lo.min(g), hi.max(g)));
        if islands.len() < 2 || largest < 2 {
            return None;
        }
        let lat = self.cluster.latency();
        let inside_bw = (islands.values())
            .map(|island| {
                let nodes: std::collections::BTreeSet<&str> =
                    island.iter().map(|dev| dev.node.as_str()).collect();
                match nodes.len() {
                    1 => self.intra_allreduce(),
                    _ => self
                        .cluster
                        .slowest_inter_node(&nodes.into_iter().collect::<Vec<_>>()),
                }
            })
            .fold(f64::INFINITY, f64::min);
        let g = largest as f64;
        let inside = 2.0 * (g - 1.0) * lat + 2.0 * (g - 1.0) / g * bytes / inside_bw;
        let others = (islands.len() - 1) as f64;
        let across = others * (far.1 + bytes / smallest as f64 / far.0);
        Some(inside + across)
    }
}

/// Whether NCCL carries a reduction over `devices`: every one an accelerator that
/// loads it (not a CPU, nor another vendor's: AMD, Huawei, Intel Gaudi), as the runtime
/// takes NCCL only where every member computes on CUDA.
fn nccl_carries(devices: &[&Device]) -> bool {
    const OTHER_VENDORS: [&str; 3] = ["mi", "ascend", "gaudi"];
    devices.iter().all(|dev| {
        dev.spec.is_some_and(|s| s.accelerator)
            && !OTHER_VENDORS.iter().any(|v| dev.kind.starts_with(v))
    })
}

#[cfg(test)]
#[path = "cost_tests.rs"]
mod tests;
