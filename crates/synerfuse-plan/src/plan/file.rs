//! The general plan's file form, `[[replica]]` tables, which `synerfuse plan` writes and
//! `train --plan` reads; also its serde form (checkpoints store it as JSON, and read the
//! grid plans older checkpoints stored).

use super::{ExpertHolding, Plan, PlanError, ReplicaPipeline};
use crate::{BatchForm, GridPlan, RankPlacement, StageLayout};
use serde::{Deserialize, Serialize};

/// A replica's layers: one count per stage (`[4, 2]`), or per chunk and stage for an
/// interleaved replica (`[[1, 1], [1, 1]]`: chunk v's layers on each stage), as the
/// stage layout of a grid `plan.toml` spells it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum LayersFile {
    PerStage(Vec<usize>),
    PerChunk(Vec<Vec<usize>>),
}

/// One `[[replica]]` of the file form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicaFile {
    layers: LayersFile,
    /// Samples per micro-batch; with `samples`, the largest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    micro_batch_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    num_micro_batches: Option<usize>,
    /// Samples per step, in micro-batches of `micro_batch_size`, the last one short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    samples: Option<usize>,
    /// Each micro-batch's samples, when they differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    micro_batch_sizes: Option<Vec<usize>>,
    /// Each stage's tensor-parallel size (default: 1 each).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tp: Vec<usize>,
    /// Each stage's tensor-parallel shares (default: even).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tp_shares: Vec<Vec<u32>>,
    /// Each stage's context-parallel size (default: 1 each).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    cp: Vec<usize>,
    /// Each stage's context-parallel shares (default: even).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    cp_shares: Vec<Vec<u32>>,
    /// Whether each stage recomputes its activations in the backward (default: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    recompute: Vec<bool>,
    /// Each stage's experts of every MoE layer (default: all): the replica is a member of
    /// an expert-parallel group, the consecutive replicas that hold every expert once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    experts: Vec<Vec<usize>>,
    /// `[member, members]`: at every stage member `member`'s even part of the experts of
    /// a group of `members` (what `--expert-model-parallel-size` gives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expert_share: Option<[usize; 2]>,
    /// The global rank of each rank of the replica, stage by stage, a stage's
    /// tensor-parallel ranks together, its context-parallel members' groups in turn
    /// (default: numbered replica by replica).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ranks: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    devices: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    speeds: Vec<f64>,
    /// Which ranks' speeds emulate a device (default: all of them); written only when a
    /// replica mixes emulated and real devices, whose speed is then written as 1.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    emulated: Vec<bool>,
    /// The cluster file's device kind of each rank, for people and tools ("" for none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    kinds: Vec<String>,
    /// Each rank's device memory in GB (the distributed optimizer's shares).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    memory_gb: Vec<f64>,
    /// The cluster file's node of each rank ("" for its own host): the islands its
    /// reductions go through.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    nodes: Vec<String>,
    /// The cluster file's site (datacenter) of each rank ("" for the default site).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    sites: Vec<String>,
    /// What each rank computes in (`fp32`, `bf16`, `fp16`; one per stage's ranks alike).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    precision: Vec<crate::Precision>,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    /// The links between the ranks' nodes and sites, which the run emulates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    network: Option<crate::Network>,
    replica: Vec<ReplicaFile>,
}

/// What a stored plan may be: the general form, or a grid plan (older checkpoints).
#[derive(Deserialize)]
#[serde(untagged)]
enum StoredPlan {
    General(PlanFile),
    Grid(GridPlan),
}

impl TryFrom<StoredPlan> for Plan {
    type Error = PlanError;

    fn try_from(stored: StoredPlan) -> Result<Self, PlanError> {
        match stored {
            StoredPlan::General(file) => Plan::from_file(file),
            StoredPlan::Grid(grid) => Plan::from_grid(&grid),
        }
    }
}

impl<'de> Deserialize<'de> for Plan {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let stored = StoredPlan::deserialize(deserializer)?;
        Plan::try_from(stored).map_err(serde::de::Error::custom)
    }
}

impl Serialize for Plan {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_file().serialize(serializer)
    }
}

impl Plan {
    /// A plan from a plan file: its own form (`[[replica]]` tables; ranks are numbered
    /// replica by replica, stage by stage, unless every replica lists its `ranks`), or a
    /// grid (`[topology]`, `[stages]`, `[batches]`: the grid's rank order kept), told
    /// apart by their tables; `global_batch_size`, when given, must be the replicas' sum.
    pub fn from_toml(text: &str, global_batch_size: Option<usize>) -> Result<Self, PlanError> {
        let table: toml::Table =
            toml::from_str(text).map_err(|e| PlanError::Toml(e.to_string()))?;
        let plan = match table.contains_key("replica") {
            true => {
                let file: PlanFile =
                    toml::from_str(text).map_err(|e| PlanError::Toml(e.to_string()))?;
                Self::from_file(file)?
            }
            false => Self::from_grid(&GridPlan::from_toml(text)?)?,
        };
        let actual = plan.global_batch_size();
        match global_batch_size {
            Some(expected) if expected != actual => {
                Err(PlanError::GlobalBatch { expected, actual })
            }
            _ => Ok(plan),
        }
    }

    /// A plan from the JSON of either file form (as checkpoints store it).
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| PlanError::Toml(e.to_string()))?;
        if value.get("replica").is_none() {
            return Self::from_grid(&GridPlan::from_json(text)?);
        }
        let file: PlanFile =
            serde_json::from_value(value).map_err(|e| PlanError::Toml(e.to_string()))?;
        Self::from_file(file)
    }

    /// The file form: one `[[replica]]` table per replica; `ranks` only where they are
    /// not numbered replica by replica.
    pub fn to_toml(&self) -> Result<String, PlanError> {
        self.check_expert_form()?;
        toml::to_string(&self.to_file()).map_err(|e| PlanError::Toml(e.to_string()))
    }

    /// Whether a file says each replica's experts: listed at every stage, or one even
    /// share at every stage (a replica holding every expert at some stages and part at
    /// others, or other shares per stage, as FlagScale's meshes give, has no file form).
    fn check_expert_form(&self) -> Result<(), PlanError> {
        for (r, replica) in self.replicas().iter().enumerate() {
            let holdings = &replica.experts;
            let listed = holdings
                .iter()
                .all(|h| matches!(h, Some(ExpertHolding::Listed(_))));
            let one_share = holdings.first().is_some_and(|first| {
                matches!(first, Some(ExpertHolding::EvenShare { .. }))
                    && holdings.iter().all(|h| h == first)
            });
            let written = holdings.len() == replica.stages.num_stages() && (listed || one_share);
            if !(holdings.iter().all(Option::is_none) || written) {
                return Err(PlanError::ExpertGroup {
                    replicas: vec![r],
                    problem: format!(
                        "its stages hold experts as {holdings:?}, which a plan file cannot say (it lists every stage's experts, or gives one expert_share for all)"
                    ),
                });
            }
        }
        Ok(())
    }

    fn from_file(file: PlanFile) -> Result<Self, PlanError> {
        let num_layers = file.replica.first().map_or(0, |r| match &r.layers {
            LayersFile::PerStage(l) => l.iter().fold(0usize, |a, &b| a.saturating_add(b)),
            LayersFile::PerChunk(c) => c.iter().flatten().fold(0usize, |a, &b| a.saturating_add(b)),
        });
        let given_ranks = file.replica.iter().filter(|r| r.ranks.is_some()).count();
        if given_ranks != 0 && given_ranks != file.replica.len() {
            let replica = file.replica.iter().position(|r| r.ranks.is_none());
            return Err(PlanError::PartialRanks {
                replica: replica.unwrap_or(0),
            });
        }
        let mut next_rank = 0;
        let mut replicas = Vec::with_capacity(file.replica.len());
        for (r, replica) in file.replica.into_iter().enumerate() {
            let pipeline = replica_pipeline(r, replica, num_layers, next_rank)?;
            next_rank += pipeline.all_ranks().count();
            replicas.push(pipeline);
        }
        let plan = Self::new(replicas)?;
        match file.network {
            Some(network) => plan.with_network(network),
            None => Ok(plan),
        }
    }

    fn to_file(&self) -> PlanFile {
        let sequential = self
            .replicas
            .iter()
            .flat_map(ReplicaPipeline::all_ranks)
            .enumerate()
            .all(|(i, rank)| i == rank);
        PlanFile {
            network: self.network().cloned(),
            replica: self
                .replicas
                .iter()
                .map(|r| replica_file(r, sequential))
                .collect(),
        }
    }
}

/// Replica `r` of a file whose ranks are numbered from `first_rank` unless it lists them.
fn replica_pipeline(
    r: usize,
    replica: ReplicaFile,
    num_layers: usize,
    first_rank: usize,
) -> Result<ReplicaPipeline, PlanError> {
    let stages = layout(replica.layers, num_layers).map_err(|source| match source {
        crate::LayoutError::LayerSumMismatch { actual, .. } => PlanError::ReplicaLayers {
            replica: r,
            layers: actual,
            first: num_layers,
        },
        source => PlanError::Layout { replica: r, source },
    })?;
    let batch = BatchForm {
        micro_batch_size: replica.micro_batch_size,
        num_micro_batches: replica.num_micro_batches,
        samples: replica.samples,
        micro_batch_sizes: replica.micro_batch_sizes,
    }
    .batch()
    .map_err(|source| PlanError::BatchForm { replica: r, source })?;
    let n = stages.num_stages();
    super::check_per_stage(
        r,
        n,
        &[
            ("tp", replica.tp.len()),
            ("tp_shares", replica.tp_shares.len()),
            ("cp", replica.cp.len()),
            ("cp_shares", replica.cp_shares.len()),
            ("recompute", replica.recompute.len()),
            ("experts", replica.experts.len()),
        ],
    )?;
    let experts = expert_holdings(r, replica.experts, replica.expert_share, n)?;
    let per_stage_or_one = |sizes: &[usize]| match sizes.is_empty() {
        true => vec![1; n],
        false => sizes.to_vec(),
    };
    let (tp, cp) = (per_stage_or_one(&replica.tp), per_stage_or_one(&replica.cp));
    let stage_ranks: Vec<usize> = (tp.iter().zip(&cp))
        .map(|(&t, &c)| t.saturating_mul(c))
        .collect();
    let total = stage_ranks.iter().fold(0usize, |a, &b| a.saturating_add(b));
    let flat = replica
        .ranks
        .unwrap_or_else(|| (first_rank..first_rank.saturating_add(total)).collect());
    super::check_per_rank(r, total, &[("ranks", flat.len())])?;
    let mut rest = flat.as_slice();
    let ranks = stage_ranks
        .iter()
        .map(|&size| {
            let (stage, tail) = rest.split_at(size.min(rest.len()));
            rest = tail;
            stage.to_vec()
        })
        .collect();
    let given = PlacementLists {
        devices: &replica.devices,
        speeds: &replica.speeds,
        emulated: &replica.emulated,
        kinds: &replica.kinds,
        memory_gb: &replica.memory_gb,
        nodes: &replica.nodes,
        sites: &replica.sites,
        precision: &replica.precision,
    };
    Ok(ReplicaPipeline {
        stages,
        batch,
        ranks,
        tp_shares: replica.tp_shares.into_iter().map(Some).collect(),
        cp: replica.cp,
        cp_shares: replica.cp_shares.into_iter().map(Some).collect(),
        recompute: replica.recompute,
        placements: placements(r, total, given)?,
        experts,
    })
}

/// A replica's expert holdings per stage: listed (`experts`), an even share of a group
/// (`expert_share`), or none; both given is an error.
fn expert_holdings(
    r: usize,
    experts: Vec<Vec<usize>>,
    share: Option<[usize; 2]>,
    n: usize,
) -> Result<Vec<Option<ExpertHolding>>, PlanError> {
    Ok(match (experts.is_empty(), share) {
        (false, Some(_)) => {
            return Err(PlanError::ExpertGroup {
                replicas: vec![r],
                problem: "give experts or expert_share, not both".into(),
            })
        }
        (false, None) => (experts.into_iter())
            .map(|e| Some(ExpertHolding::Listed(e)))
            .collect(),
        (true, Some([member, members])) if member < members => {
            vec![Some(ExpertHolding::EvenShare { member, members }); n]
        }
        (true, Some(share)) => {
            return Err(PlanError::ExpertGroup {
                replicas: vec![r],
                problem: format!(
                    "expert_share {share:?}: member {} of {}",
                    share[0], share[1]
                ),
            })
        }
        (true, None) => Vec::new(),
    })
}

/// The file form of `r`; its `ranks` only when the plan's are not `sequential`.
/// One placement field of every rank, its default where a rank has none; empty where
/// none has it.
fn per_rank<T: Default>(
    p: &[RankPlacement],
    field: impl Fn(&RankPlacement) -> Option<T>,
) -> Vec<T> {
    match p.iter().any(|p| field(p).is_some()) {
        true => p.iter().map(|p| field(p).unwrap_or_default()).collect(),
        false => Vec::new(),
    }
}

fn replica_file(r: &ReplicaPipeline, sequential: bool) -> ReplicaFile {
    let p = &r.placements;
    let (speeds, emulated): (Vec<f64>, Vec<bool>) =
        match p.iter().filter(|p| p.speed.is_some()).count() {
            0 => (Vec::new(), Vec::new()),
            n if n == p.len() => (p.iter().filter_map(|p| p.speed).collect(), Vec::new()),
            _ => (
                p.iter().map(|p| p.speed.unwrap_or(1.0)).collect(),
                p.iter().map(|p| p.speed.is_some()).collect(),
            ),
        };
    let kinds = per_rank(p, |p| p.kind.clone());
    let nodes = per_rank(p, |p| p.node.clone());
    let sites = per_rank(p, |p| p.site.clone());
    let precision = per_rank(p, |p| p.precision);
    let memory_gb: Vec<f64> = match p.iter().all(|p| p.memory_gb.is_some()) {
        true => p.iter().filter_map(|p| p.memory_gb).collect(),
        false => Vec::new(),
    };
    let stages = r.stages.num_stages();
    let tp: Vec<usize> = (0..stages).map(|s| r.tp_size(s)).collect();
    let batch = BatchForm::from(r.batch.clone());
    ReplicaFile {
        layers: layers_file(&r.stages),
        micro_batch_size: batch.micro_batch_size,
        num_micro_batches: batch.num_micro_batches,
        samples: batch.samples,
        micro_batch_sizes: batch.micro_batch_sizes,
        tp_shares: match r.tp_shares.iter().any(Option::is_some) {
            true => (0..stages).map(|s| r.shares(s)).collect(),
            false => Vec::new(),
        },
        tp: match tp.iter().any(|&t| t > 1) {
            true => tp,
            false => Vec::new(),
        },
        cp: match (0..stages).any(|s| r.cp_size(s) > 1) {
            true => (0..stages).map(|s| r.cp_size(s)).collect(),
            false => Vec::new(),
        },
        cp_shares: match (0..stages).any(|s| r.context_shares(s).is_some()) {
            true => (0..stages)
                .map(|s| (r.context_shares(s)).unwrap_or_else(|| vec![1; r.cp_size(s)]))
                .collect(),
            false => Vec::new(),
        },
        recompute: match r.recompute.iter().any(|&x| x) {
            true => (0..stages).map(|s| r.recomputes(s)).collect(),
            false => Vec::new(),
        },
        experts: match r
            .experts
            .iter()
            .all(|h| matches!(h, Some(ExpertHolding::Listed(_))))
        {
            true => (r.experts.iter().flatten()).map(|h| h.experts(0)).collect(),
            false => Vec::new(),
        },
        expert_share: r.experts.iter().flatten().find_map(|h| match h {
            ExpertHolding::EvenShare { member, members } => Some([*member, *members]),
            ExpertHolding::Listed(_) => None,
        }),
        ranks: (!sequential).then(|| r.all_ranks().collect()),
        devices: match p.iter().all(|p| p.device.is_some()) {
            true => (p.iter().flat_map(|p| p.device))
                .map(|d| d.to_string())
                .collect(),
            false => Vec::new(),
        },
        speeds,
        emulated,
        kinds,
        memory_gb,
        nodes,
        sites,
        precision,
    }
}

/// Layers per stage, or per chunk and stage when interleaved.
fn layers_file(stages: &StageLayout) -> LayersFile {
    match stages.num_chunks() {
        1 => LayersFile::PerStage(stages.layers()),
        chunks => LayersFile::PerChunk(
            (0..chunks)
                .map(|c| {
                    (0..stages.num_stages())
                        .map(|s| stages.chunk_range(s, c).map_or(0, |l| l.len()))
                        .collect()
                })
                .collect(),
        ),
    }
}

fn layout(layers: LayersFile, num_layers: usize) -> Result<StageLayout, crate::LayoutError> {
    match layers {
        LayersFile::PerStage(per_stage) => StageLayout::new(per_stage, num_layers),
        LayersFile::PerChunk(per_chunk) => StageLayout::from_per_chunk(per_chunk, num_layers),
    }
}

/// A replica's per-stage placement lists as the file gives them.
struct PlacementLists<'a> {
    devices: &'a [String],
    speeds: &'a [f64],
    emulated: &'a [bool],
    kinds: &'a [String],
    memory_gb: &'a [f64],
    nodes: &'a [String],
    sites: &'a [String],
    precision: &'a [crate::Precision],
}

/// Placements of a replica's file form: devices, speeds and kinds, each empty or one
/// per rank of the replica.
fn placements(
    replica: usize,
    ranks: usize,
    given: PlacementLists<'_>,
) -> Result<Vec<RankPlacement>, PlanError> {
    let PlacementLists {
        devices,
        speeds,
        emulated,
        kinds,
        memory_gb,
        nodes,
        sites,
        precision,
    } = given;
    super::check_per_rank(
        replica,
        ranks,
        &[
            ("devices", devices.len()),
            ("speeds", speeds.len()),
            ("emulated", emulated.len()),
            ("kinds", kinds.len()),
            ("memory_gb", memory_gb.len()),
            ("nodes", nodes.len()),
            ("sites", sites.len()),
            ("precision", precision.len()),
        ],
    )?;
    if let Some(&memory) = memory_gb.iter().find(|&&m| !(m > 0.0 && m.is_finite())) {
        return Err(PlanError::Memory { replica, memory });
    }
    let given = [
        devices.len(),
        speeds.len(),
        kinds.len(),
        memory_gb.len(),
        nodes.len(),
        sites.len(),
        precision.len(),
    ];
    if given.iter().all(|&n| n == 0) {
        return Ok(Vec::new());
    }
    (0..ranks)
        .map(|s| {
            let device = match devices.get(s) {
                Some(name) => Some(
                    name.parse()
                        .map_err(|source| PlanError::Device { replica, source })?,
                ),
                None => None,
            };
            let speed = speeds
                .get(s)
                .copied()
                .filter(|_| emulated.get(s).copied().unwrap_or(true));
            if let Some(speed) = speed.filter(|&v| !(v > 0.0 && v <= 1.0)) {
                return Err(PlanError::Speed { replica, speed });
            }
            Ok(RankPlacement {
                device,
                speed,
                kind: kinds.get(s).filter(|k| !k.is_empty()).cloned(),
                memory_gb: memory_gb.get(s).copied(),
                node: nodes.get(s).filter(|n| !n.is_empty()).cloned(),
                site: sites.get(s).filter(|n| !n.is_empty()).cloned(),
                precision: precision.get(s).copied(),
            })
        })
        .collect()
}
