//! The grid form of a plan, as SynerFuse's and Megatron's flags (`PlanFlags`) and the
//! `[topology]` plan file give it. The crate's one plan model is [`crate::Plan`]: the
//! grid is only read and written through it (`Plan::from_flags`, `Plan::grid_flags`,
//! `Plan::from_toml`, in `plan/grid.rs`); nothing outside the crate sees it.

use crate::{
    BatchError, LayoutError, RankPlacement, ReplicaBatches, StageLayout, Topology, TopologyError,
};
use crate::{DEFAULT_ORDER, TP_PP_DP_ORDER};
use serde::{Deserialize, Serialize};

/// Sizes and rank order, as a plan stores them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TopologySpec {
    /// Ranks.
    pub world_size: usize,
    /// `--tensor-model-parallel-size`.
    pub tp: usize,
    /// `--pipeline-model-parallel-size`.
    pub pp: usize,
    /// `--context-parallel-size`.
    #[serde(default = "one")]
    pub cp: usize,
    /// `--expert-model-parallel-size`.
    #[serde(default = "one")]
    pub ep: usize,
    /// Rank order, fastest dimension first.
    #[serde(default = "default_order")]
    pub order: String,
}

fn one() -> usize {
    1
}

fn default_order() -> String {
    DEFAULT_ORDER.to_owned()
}

/// Flags or a grid plan file that are inconsistent or cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GridError {
    /// Bad sizes or order.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// Bad stage layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Bad batch layout.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// A stage layout whose stage count is not the pipeline-parallel size.
    #[error("the stage layout has {stages} stages but the pipeline-parallel size is {pp}")]
    StageCount {
        /// Stages in the layout.
        stages: usize,
        /// Pipeline-parallel size.
        pp: usize,
    },
    /// A batch layout whose replica count is not the data-parallel size.
    #[error("the batch layout has {replicas} replicas but the data-parallel size is {dp}")]
    ReplicaCount {
        /// Replicas in the batch layout.
        replicas: usize,
        /// Data-parallel size.
        dp: usize,
    },
    /// Placements that are not one per rank.
    #[error("{placements} rank placements for a world of {world_size}")]
    PlacementCount {
        /// Placements given.
        placements: usize,
        /// Ranks.
        world_size: usize,
    },
    /// An emulated speed that is not a positive number.
    #[error("rank {rank}: speed {speed} must be a positive number")]
    PlacementSpeed {
        /// The rank.
        rank: usize,
        /// Its speed.
        speed: f64,
    },
    /// A flag that is unknown, repeated, or lacks its value.
    #[error("{flag}: {problem}")]
    Flag {
        /// The flag.
        flag: String,
        /// What is wrong.
        problem: String,
    },
    /// TOML or JSON that does not parse (or print) as a plan.
    #[error("plan {format}: {message}")]
    Format {
        /// `TOML` or `JSON`.
        format: &'static str,
        /// The parser's message.
        message: String,
    },
}

/// A grid: every replica the same stages, ranks in one of Megatron's orders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct GridPlan {
    /// Sizes and rank order.
    pub topology: TopologySpec,
    /// Decoder layers per pipeline stage (and virtual chunk).
    pub stages: StageLayout,
    /// Micro-batch size and count per data-parallel replica.
    pub batches: ReplicaBatches,
    /// Device of each rank, by rank (empty: every rank on its default device).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPlacement>,
}

impl GridPlan {
    /// A plan whose parts are checked against each other.
    pub(crate) fn new(
        topology: TopologySpec,
        stages: StageLayout,
        batches: ReplicaBatches,
        ranks: Vec<RankPlacement>,
    ) -> Result<Self, GridError> {
        let plan = GridPlan {
            topology,
            stages,
            batches,
            ranks,
        };
        plan.validate()?;
        Ok(plan)
    }

    /// The rank topology.
    pub(crate) fn topology(&self) -> Result<Topology, GridError> {
        let t = &self.topology;
        Ok(Topology::new(
            t.world_size,
            t.tp,
            t.pp,
            t.cp,
            t.ep,
            &t.order,
        )?)
    }

    /// Checks that the parts fit: stages = pp, replicas = dp, one placement per rank.
    pub(crate) fn validate(&self) -> Result<(), GridError> {
        let topology = self.topology()?;
        if self.stages.num_stages() != self.topology.pp {
            return Err(GridError::StageCount {
                stages: self.stages.num_stages(),
                pp: self.topology.pp,
            });
        }
        let dp = topology.size(crate::Dim::Dp);
        if self.batches.dp_size() != dp {
            return Err(GridError::ReplicaCount {
                replicas: self.batches.dp_size(),
                dp,
            });
        }
        if !self.ranks.is_empty() && self.ranks.len() != self.topology.world_size {
            return Err(GridError::PlacementCount {
                placements: self.ranks.len(),
                world_size: self.topology.world_size,
            });
        }
        if let Some((rank, p)) = self
            .ranks
            .iter()
            .enumerate()
            .find(|(_, p)| p.speed.is_some_and(|s| !(s.is_finite() && s > 0.0)))
        {
            return Err(GridError::PlacementSpeed {
                rank,
                speed: p.speed.unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// The plan as TOML.
    #[cfg(test)]
    pub(crate) fn to_toml(&self) -> Result<String, GridError> {
        toml::to_string_pretty(self).map_err(|e| GridError::Format {
            format: "TOML",
            message: e.to_string(),
        })
    }

    /// A plan from TOML, validated.
    pub(crate) fn from_toml(text: &str) -> Result<Self, GridError> {
        let plan: GridPlan = toml::from_str(text).map_err(|e| GridError::Format {
            format: "TOML",
            message: e.to_string(),
        })?;
        plan.validate()?;
        Ok(plan)
    }

    /// The plan as JSON.
    #[cfg(test)]
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans serialise")
    }

    /// A plan from JSON, validated.
    pub(crate) fn from_json(text: &str) -> Result<Self, GridError> {
        let plan: GridPlan = serde_json::from_str(text).map_err(|e| GridError::Format {
            format: "JSON",
            message: e.to_string(),
        })?;
        plan.validate()?;
        Ok(plan)
    }

    /// The SynerFuse/Megatron flags that describe this plan (device placements are not
    /// flags; SynerFuse takes them from the launcher).
    pub(crate) fn to_synerfuse_args(&self) -> Vec<String> {
        let t = &self.topology;
        let mut args: Vec<String> = vec![
            "--tensor-model-parallel-size".into(),
            t.tp.to_string(),
            "--pipeline-model-parallel-size".into(),
            t.pp.to_string(),
        ];
        if t.cp != 1 {
            args.extend(["--context-parallel-size".into(), t.cp.to_string()]);
        }
        if t.ep != 1 {
            args.extend(["--expert-model-parallel-size".into(), t.ep.to_string()]);
        }
        if t.order == TP_PP_DP_ORDER {
            args.push("--use-tp-pp-dp-mapping".into());
        }
        args.extend(["--num-layers".into(), self.stages.num_layers().to_string()]);
        if self.stages.num_chunks() > 1 {
            // Megatron's interleaving flag; only uniform chunks can be expressed with it.
            args.extend([
                "--num-layers-per-virtual-pipeline-stage".into(),
                (self.stages.num_layers() / (self.stages.num_stages() * self.stages.num_chunks()))
                    .to_string(),
            ]);
        } else if self.stages.layers().windows(2).any(|w| w[0] != w[1]) {
            args.push("--hetero-pipeline-stages".into());
            args.extend(
                self.stages
                    .to_hetero_pipeline_stages()
                    .iter()
                    .map(usize::to_string),
            );
        }
        args.extend([
            "--global-batch-size".into(),
            self.batches.global_batch_size().to_string(),
        ]);
        let first = &self.batches.replicas()[0];
        if self.batches.replicas().iter().all(|r| r == first) && first.is_uniform() {
            args.extend([
                "--micro-batch-size".into(),
                first.micro_batch_size().to_string(),
            ]);
        } else if let Some((mbs, counts)) = self.batches.to_flags() {
            args.push("--micro-batch-size-per-dp".into());
            args.extend(mbs.iter().map(usize::to_string));
            args.push("--num-micro-batches-per-dp".into());
            args.extend(counts.iter().map(usize::to_string));
        }
        args
    }

    /// A plan from the typed values of SynerFuse's and Megatron's parallel flags, for a
    /// world of `world_size` ranks.
    pub(crate) fn from_flags(flags: &PlanFlags, world_size: usize) -> Result<Self, GridError> {
        let (tp, pp, cp, ep) = (
            flags.tensor_model_parallel_size,
            flags.pipeline_model_parallel_size,
            flags.context_parallel_size,
            flags.expert_model_parallel_size,
        );
        let order = if flags.use_tp_pp_dp_mapping {
            if cp != 1 || ep != 1 {
                return Err(GridError::Flag {
                    flag: "--use-tp-pp-dp-mapping".into(),
                    problem: "cannot be combined with context or expert parallelism".into(),
                });
            }
            TP_PP_DP_ORDER
        } else {
            DEFAULT_ORDER
        };
        let spec = TopologySpec {
            world_size,
            tp,
            pp,
            cp,
            ep,
            order: order.to_owned(),
        };
        let topology = Topology::new(world_size, tp, pp, cp, ep, order)?;
        let stages = flags.stage_layout()?;
        let batches = ReplicaBatches::from_flags(
            topology.size(crate::Dim::Dp),
            flags.global_batch_size,
            flags.micro_batch_size,
            flags.micro_batch_size_per_dp.as_deref(),
            flags.num_micro_batches_per_dp.as_deref(),
        )?;
        Self::new(spec, stages, batches, Vec::new())
    }
}

/// The typed values of the parallel flags of a SynerFuse (or Megatron) command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanFlags {
    /// `--tensor-model-parallel-size` (default 1).
    pub tensor_model_parallel_size: usize,
    /// `--pipeline-model-parallel-size` (default 1).
    pub pipeline_model_parallel_size: usize,
    /// `--context-parallel-size` (default 1).
    pub context_parallel_size: usize,
    /// `--expert-model-parallel-size` (default 1).
    pub expert_model_parallel_size: usize,
    /// `--use-tp-pp-dp-mapping`: each replica a contiguous block of ranks.
    pub use_tp_pp_dp_mapping: bool,
    /// `--num-layers` (required).
    pub num_layers: Option<usize>,
    /// SynerFuse's `--hetero-pipeline-stages n0 l.. n1 l..`.
    pub hetero_pipeline_stages: Option<Vec<usize>>,
    /// `--num-layers-per-virtual-pipeline-stage`.
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// `--global-batch-size`.
    pub global_batch_size: Option<usize>,
    /// `--micro-batch-size`.
    pub micro_batch_size: Option<usize>,
    /// SynerFuse's `--micro-batch-size-per-dp n0 mbs0 ...`.
    pub micro_batch_size_per_dp: Option<Vec<usize>>,
    /// SynerFuse's `--num-micro-batches-per-dp n0 k0 ...`.
    pub num_micro_batches_per_dp: Option<Vec<usize>>,
}

impl Default for PlanFlags {
    fn default() -> Self {
        PlanFlags {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            context_parallel_size: 1,
            expert_model_parallel_size: 1,
            use_tp_pp_dp_mapping: false,
            num_layers: None,
            hetero_pipeline_stages: None,
            num_layers_per_virtual_pipeline_stage: None,
            global_batch_size: None,
            micro_batch_size: None,
            micro_batch_size_per_dp: None,
            num_micro_batches_per_dp: None,
        }
    }
}

impl PlanFlags {
    /// Layers per stage: SynerFuse's groups, Megatron's virtual chunks, or an even split.
    fn stage_layout(&self) -> Result<StageLayout, GridError> {
        let pp = self.pipeline_model_parallel_size;
        let num_layers = self.num_layers.ok_or_else(|| GridError::Flag {
            flag: "--num-layers".into(),
            problem: "is required".into(),
        })?;
        let layout = match (
            &self.hetero_pipeline_stages,
            self.num_layers_per_virtual_pipeline_stage,
        ) {
            (Some(_), Some(_)) => {
                return Err(GridError::Flag {
                    flag: "--hetero-pipeline-stages".into(),
                    problem: "cannot be combined with --num-layers-per-virtual-pipeline-stage"
                        .into(),
                })
            }
            (Some(values), None) => {
                StageLayout::from_hetero_pipeline_stages(values, pp, num_layers)?
            }
            (None, Some(per_chunk)) => {
                if per_chunk == 0 || num_layers % (per_chunk * pp) != 0 {
                    return Err(GridError::Flag {
                        flag: "--num-layers-per-virtual-pipeline-stage".into(),
                        problem: format!(
                            "{per_chunk} does not divide --num-layers {num_layers} over {pp} stages"
                        ),
                    });
                }
                StageLayout::uniform_interleaved(num_layers, pp, num_layers / (per_chunk * pp))?
            }
            (None, None) => StageLayout::uniform(num_layers, pp)?,
        };
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceRequest, Plan, ReplicaBatch};

    /// SynerFuse's README example: tp 2, two stages of 6 and 2 layers, two replicas.
    fn hetero_flags() -> PlanFlags {
        PlanFlags {
            tensor_model_parallel_size: 2,
            pipeline_model_parallel_size: 2,
            use_tp_pp_dp_mapping: true,
            num_layers: Some(8),
            hetero_pipeline_stages: Some(vec![1, 6, 1, 2]),
            global_batch_size: Some(32),
            micro_batch_size_per_dp: Some(vec![1, 6, 1, 2]),
            num_micro_batches_per_dp: Some(vec![1, 4, 1, 4]),
            ..PlanFlags::default()
        }
    }

    fn hetero_plan() -> GridPlan {
        GridPlan::from_flags(&hetero_flags(), 8).unwrap()
    }

    #[test]
    fn hetero_pp_dp_and_tp_together() {
        let plan = hetero_plan();
        assert_eq!(plan.stages.layers(), [6, 2]);
        assert_eq!(plan.batches.replicas()[0], ReplicaBatch::uniform(6, 4));
        assert_eq!(plan.topology().unwrap().coordinates(5).unwrap().dp, 1);
        let args = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
            --use-tp-pp-dp-mapping --num-layers 8 --hetero-pipeline-stages 1 6 1 2 \
            --global-batch-size 32 --micro-batch-size-per-dp 1 6 1 2 \
            --num-micro-batches-per-dp 1 4 1 4";
        assert_eq!(
            plan.to_synerfuse_args(),
            args.split_whitespace().collect::<Vec<_>>()
        );
        let general = Plan::from_flags(&hetero_flags(), 8).unwrap();
        let flags = general.grid_flags().unwrap();
        assert_eq!(flags.args, plan.to_synerfuse_args());
        assert_eq!(flags.rank_order, TP_PP_DP_ORDER);
    }

    #[test]
    fn toml_and_json_round_trip() {
        let mut plan = hetero_plan();
        plan.ranks = (0..8)
            .map(|r| RankPlacement {
                device: Some(if r < 4 {
                    DeviceRequest::Cuda(None)
                } else {
                    DeviceRequest::Cpu
                }),
                speed: (r >= 4).then_some(0.5),
                kind: (r < 4).then(|| "a100-80g".into()),
                memory_gb: (r < 4).then_some(80.0),
                node: Some(format!("node {}", r / 4)),
                site: (r >= 4).then(|| "far".into()),
                precision: (r >= 4).then_some(crate::Precision::Fp16),
            })
            .collect();
        let toml = plan.to_toml().unwrap();
        assert!(toml.contains("[topology]"), "{toml}");
        assert_eq!(GridPlan::from_toml(&toml).unwrap(), plan);
        assert_eq!(GridPlan::from_json(&plan.to_json()).unwrap(), plan);
        let broken = toml.replace("pp = 2", "pp = 4");
        assert!(GridPlan::from_toml(&broken).is_err());
    }

    #[test]
    fn flag_errors_name_the_flag() {
        let flags = PlanFlags {
            num_layers: None,
            ..hetero_flags()
        };
        let e = GridPlan::from_flags(&flags, 8).unwrap_err();
        assert!(e.to_string().contains("--num-layers"), "{e}");
        let flags = PlanFlags {
            hetero_pipeline_stages: Some(vec![1, 6, 1]),
            ..hetero_flags()
        };
        let e = GridPlan::from_flags(&flags, 8).unwrap_err();
        assert!(e.to_string().contains("group 1"), "{e}");
        let flags = PlanFlags {
            num_layers_per_virtual_pipeline_stage: Some(2),
            ..hetero_flags()
        };
        let e = GridPlan::from_flags(&flags, 8).unwrap_err();
        assert!(e.to_string().contains("--hetero-pipeline-stages"), "{e}");
    }
}
