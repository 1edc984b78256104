//! The general plan's file form, `[[replica]]` tables, which `synerfuse plan` writes and
//! `train --plan` reads; also its serde form (checkpoints store it as JSON, and read the
//! grid plans older checkpoints stored).

use super::{GeneralPlan, GeneralPlanError, ReplicaPipeline};
use crate::{DeviceRequest, ParallelPlan, RankPlacement, ReplicaBatch, StageLayout};
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
    micro_batch_size: usize,
    num_micro_batches: usize,
    /// The global rank of each stage (default: replica by replica, stage by stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ranks: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    devices: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    speeds: Vec<f64>,
    /// The cluster file's device kind of each stage, for people and tools.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    kinds: Vec<String>,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    replica: Vec<ReplicaFile>,
}

/// What a stored plan may be: the general form, or a grid plan (older checkpoints).
#[derive(Deserialize)]
#[serde(untagged)]
enum StoredPlan {
    General(PlanFile),
    Grid(ParallelPlan),
}

impl TryFrom<StoredPlan> for GeneralPlan {
    type Error = GeneralPlanError;

    fn try_from(stored: StoredPlan) -> Result<Self, GeneralPlanError> {
        match stored {
            StoredPlan::General(file) => GeneralPlan::from_file(file),
            StoredPlan::Grid(grid) => GeneralPlan::from_grid(&grid),
        }
    }
}

impl<'de> Deserialize<'de> for GeneralPlan {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let stored = StoredPlan::deserialize(deserializer)?;
        GeneralPlan::try_from(stored).map_err(serde::de::Error::custom)
    }
}

impl Serialize for GeneralPlan {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_file().serialize(serializer)
    }
}

impl GeneralPlan {
    /// A plan from its file form (`[[replica]]` tables); ranks are numbered replica by
    /// replica, stage by stage, unless every replica lists its `ranks`;
    /// `global_batch_size`, when given, must be the replicas' sum.
    pub fn from_toml(
        text: &str,
        global_batch_size: Option<usize>,
    ) -> Result<Self, GeneralPlanError> {
        let file: PlanFile =
            toml::from_str(text).map_err(|e| GeneralPlanError::Toml(e.to_string()))?;
        let plan = Self::from_file(file)?;
        let actual = plan.batches().global_batch_size();
        match global_batch_size {
            Some(expected) if expected != actual => {
                Err(GeneralPlanError::GlobalBatch { expected, actual })
            }
            _ => Ok(plan),
        }
    }

    /// The file form: one `[[replica]]` table per replica; `ranks` only where they are
    /// not numbered replica by replica.
    pub fn to_toml(&self) -> Result<String, GeneralPlanError> {
        toml::to_string(&self.to_file()).map_err(|e| GeneralPlanError::Toml(e.to_string()))
    }

    fn from_file(file: PlanFile) -> Result<Self, GeneralPlanError> {
        let num_layers = file.replica.first().map_or(0, |r| match &r.layers {
            LayersFile::PerStage(l) => l.iter().sum(),
            LayersFile::PerChunk(c) => c.iter().flatten().sum(),
        });
        let given_ranks = file.replica.iter().filter(|r| r.ranks.is_some()).count();
        if given_ranks != 0 && given_ranks != file.replica.len() {
            let replica = file.replica.iter().position(|r| r.ranks.is_none());
            return Err(GeneralPlanError::PartialRanks {
                replica: replica.unwrap_or(0),
            });
        }
        let mut next_rank = 0;
        let mut replicas = Vec::with_capacity(file.replica.len());
        for (r, replica) in file.replica.into_iter().enumerate() {
            let stages = layout(replica.layers, num_layers)
                .map_err(|source| GeneralPlanError::Layout { replica: r, source })?;
            let n = stages.num_stages();
            let placements = placements(r, n, &replica.devices, &replica.speeds, &replica.kinds)?;
            replicas.push(ReplicaPipeline {
                stages,
                batch: ReplicaBatch {
                    micro_batch_size: replica.micro_batch_size,
                    num_micro_batches: replica.num_micro_batches,
                },
                ranks: replica
                    .ranks
                    .unwrap_or_else(|| (next_rank..next_rank + n).collect()),
                placements,
            });
            next_rank += n;
        }
        Self::new(replicas)
    }

    fn to_file(&self) -> PlanFile {
        let sequential = self
            .replicas
            .iter()
            .flat_map(|r| &r.ranks)
            .enumerate()
            .all(|(i, &rank)| i == rank);
        let replica = self
            .replicas
            .iter()
            .map(|r| {
                let layers = match r.stages.num_chunks() {
                    1 => LayersFile::PerStage(r.stages.layers()),
                    chunks => LayersFile::PerChunk(
                        (0..chunks)
                            .map(|c| {
                                (0..r.stages.num_stages())
                                    .map(|s| r.stages.chunk_range(s, c).map_or(0, |l| l.len()))
                                    .collect()
                            })
                            .collect(),
                    ),
                };
                let p = &r.placements;
                let speeds: Vec<f64> = match p.iter().any(|p| p.speed.is_some()) {
                    true => p.iter().map(|p| p.speed.unwrap_or(1.0)).collect(),
                    false => Vec::new(),
                };
                let kinds: Vec<String> = match p.iter().all(|p| p.kind.is_some()) {
                    true => p.iter().filter_map(|p| p.kind.clone()).collect(),
                    false => Vec::new(),
                };
                ReplicaFile {
                    layers,
                    micro_batch_size: r.batch.micro_batch_size,
                    num_micro_batches: r.batch.num_micro_batches,
                    ranks: (!sequential).then(|| r.ranks.clone()),
                    devices: p.iter().map(|p| p.device.to_string()).collect(),
                    speeds,
                    kinds,
                }
            })
            .collect();
        PlanFile { replica }
    }
}

fn layout(layers: LayersFile, num_layers: usize) -> Result<StageLayout, crate::LayoutError> {
    match layers {
        LayersFile::PerStage(per_stage) => StageLayout::new(per_stage, num_layers),
        LayersFile::PerChunk(per_chunk) => {
            let stages = per_chunk.first().map_or(0, Vec::len);
            let chunks = per_chunk.len();
            let pieces: Vec<usize> = per_chunk.into_iter().flatten().collect();
            if pieces.len() != stages * chunks {
                return Err(crate::LayoutError::ChunkShape {
                    given: pieces.len(),
                    stages,
                    chunks,
                });
            }
            StageLayout::interleaved(pieces, stages, num_layers)
        }
    }
}

/// Placements of a replica's file form: devices, speeds and kinds, each empty or one
/// per stage.
fn placements(
    replica: usize,
    stages: usize,
    devices: &[String],
    speeds: &[f64],
    kinds: &[String],
) -> Result<Vec<RankPlacement>, GeneralPlanError> {
    for (what, given) in [
        ("devices", devices.len()),
        ("speeds", speeds.len()),
        ("kinds", kinds.len()),
    ] {
        if given != 0 && given != stages {
            return Err(GeneralPlanError::PerStage {
                replica,
                what,
                given,
                stages,
            });
        }
    }
    if devices.is_empty() && speeds.is_empty() && kinds.is_empty() {
        return Ok(Vec::new());
    }
    (0..stages)
        .map(|s| {
            let device = match devices.get(s) {
                Some(name) => name
                    .parse()
                    .map_err(|source| GeneralPlanError::Device { replica, source })?,
                None => DeviceRequest::Auto,
            };
            if let Some(&speed) = speeds.get(s) {
                if !(speed > 0.0 && speed.is_finite()) {
                    return Err(GeneralPlanError::Speed { replica, speed });
                }
            }
            Ok(RankPlacement {
                device,
                speed: speeds.get(s).copied(),
                kind: kinds.get(s).cloned(),
            })
        })
        .collect()
}
