//! A whole parallel plan: topology, layers per stage, batch per replica, and what runs on
//! each rank. Serialises to TOML and JSON (`plan.toml`), and converts to and from the
//! flags SynerFuse takes, so plans and hand-typed command lines are interchangeable.

use crate::{BatchError, LayoutError, ReplicaBatches, StageLayout, Topology, TopologyError};
use crate::{DEFAULT_ORDER, TP_PP_DP_ORDER};
use serde::{Deserialize, Serialize};

/// The device a rank computes on at run time (`cpu`, `cuda`, `cuda:N`, `auto`), before
/// checking the machine has it; as opposed to the cluster's name for its kind
/// ([`RankPlacement::kind`]). `synerfuse_model` resolves it to a libtorch device.
///
/// `auto` picks a GPU when libtorch sees one and the CPU otherwise, which is what a
/// mixed CPU/GPU job wants from a single flag shared by every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceRequest {
    /// The host CPU.
    Cpu,
    /// A GPU: the given index, or the local rank's share of the visible GPUs.
    Cuda(Option<usize>),
    /// A GPU when one is visible, else the CPU.
    Auto,
}

/// A device name that is none of `cpu`, `cuda`, `cuda:N`, `auto`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a device: expected cpu, cuda, cuda:N or auto")]
pub struct UnknownDevice(pub String);

impl std::str::FromStr for DeviceRequest {
    type Err = UnknownDevice;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::Cuda(None)),
            "auto" => Ok(DeviceRequest::Auto),
            other => other
                .strip_prefix("cuda:")
                .and_then(|index| index.parse().ok())
                .map(|index| DeviceRequest::Cuda(Some(index)))
                .ok_or_else(|| UnknownDevice(s.to_owned())),
        }
    }
}

impl std::fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(None) => f.write_str("cuda"),
            DeviceRequest::Cuda(Some(index)) => write!(f, "cuda:{index}"),
            DeviceRequest::Auto => f.write_str("auto"),
        }
    }
}

impl TryFrom<String> for DeviceRequest {
    type Error = UnknownDevice;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        name.parse()
    }
}

impl From<DeviceRequest> for String {
    fn from(device: DeviceRequest) -> String {
        device.to_string()
    }
}

/// What a rank computes on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankPlacement {
    /// The runtime device; `None` (a plan file that names memory or speeds but no
    /// devices) leaves it to the job's `--device`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceRequest>,
    /// Emulated speed relative to the device's own (1.0 = as is; 0.5 = half as fast). A
    /// test and benchmark device for clusters without heterogeneity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed: Option<f64>,
    /// The cluster file's device kind (`a100-80g`, `cpu`, ...), for people and tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The device's memory in GB: the distributed optimizer gives each rank a share of
    /// the state in proportion to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_gb: Option<f64>,
}

/// Sizes and rank order, as a plan stores them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologySpec {
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

/// A plan that is inconsistent or cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
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
    /// The plan's pipelines cannot run the schedule.
    #[error(transparent)]
    Schedule(#[from] crate::ScheduleError),
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

/// Everything a run needs to know about where work goes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParallelPlan {
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

impl ParallelPlan {
    /// A plan whose parts are checked against each other.
    pub fn new(
        topology: TopologySpec,
        stages: StageLayout,
        batches: ReplicaBatches,
        ranks: Vec<RankPlacement>,
    ) -> Result<Self, PlanError> {
        let plan = ParallelPlan {
            topology,
            stages,
            batches,
            ranks,
        };
        plan.validate()?;
        Ok(plan)
    }

    /// The rank topology.
    pub fn topology(&self) -> Result<Topology, PlanError> {
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
    pub fn validate(&self) -> Result<(), PlanError> {
        let topology = self.topology()?;
        if self.stages.num_stages() != self.topology.pp {
            return Err(PlanError::StageCount {
                stages: self.stages.num_stages(),
                pp: self.topology.pp,
            });
        }
        let dp = topology.size(crate::Dim::Dp);
        if self.batches.dp_size() != dp {
            return Err(PlanError::ReplicaCount {
                replicas: self.batches.dp_size(),
                dp,
            });
        }
        if !self.ranks.is_empty() && self.ranks.len() != self.topology.world_size {
            return Err(PlanError::PlacementCount {
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
            return Err(PlanError::PlacementSpeed {
                rank,
                speed: p.speed.unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// The plan as TOML.
    pub fn to_toml(&self) -> Result<String, PlanError> {
        toml::to_string_pretty(self).map_err(|e| PlanError::Format {
            format: "TOML",
            message: e.to_string(),
        })
    }

    /// A plan from TOML, validated.
    pub fn from_toml(text: &str) -> Result<Self, PlanError> {
        let plan: ParallelPlan = toml::from_str(text).map_err(|e| PlanError::Format {
            format: "TOML",
            message: e.to_string(),
        })?;
        plan.validate()?;
        Ok(plan)
    }

    /// The plan as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans serialise")
    }

    /// A plan from JSON, validated.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        let plan: ParallelPlan = serde_json::from_str(text).map_err(|e| PlanError::Format {
            format: "JSON",
            message: e.to_string(),
        })?;
        plan.validate()?;
        Ok(plan)
    }

    /// The SynerFuse/Megatron flags that describe this plan (device placements are not
    /// flags; SynerFuse takes them from the launcher).
    pub fn to_synerfuse_args(&self) -> Vec<String> {
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
        let first = self.batches.replicas()[0];
        if self.batches.replicas().iter().all(|&r| r == first) {
            args.extend([
                "--micro-batch-size".into(),
                first.micro_batch_size.to_string(),
            ]);
        } else {
            let (mbs, counts) = self.batches.to_flags();
            args.push("--micro-batch-size-per-dp".into());
            args.extend(mbs.iter().map(usize::to_string));
            args.push("--num-micro-batches-per-dp".into());
            args.extend(counts.iter().map(usize::to_string));
        }
        args
    }

    /// A plan from SynerFuse/Megatron flags for a world of `world_size` ranks. Unknown
    /// flags are an error (this parser sees only the parallel flags).
    pub fn from_synerfuse_args<S: AsRef<str>>(
        args: &[S],
        world_size: usize,
    ) -> Result<Self, PlanError> {
        Self::from_flags(&PlanFlags::parse_args(args)?, world_size)
    }

    /// A plan from the typed values of SynerFuse's and Megatron's parallel flags, for a
    /// world of `world_size` ranks.
    pub fn from_flags(flags: &PlanFlags, world_size: usize) -> Result<Self, PlanError> {
        let (tp, pp, cp, ep) = (
            flags.tensor_model_parallel_size,
            flags.pipeline_model_parallel_size,
            flags.context_parallel_size,
            flags.expert_model_parallel_size,
        );
        let order = if flags.use_tp_pp_dp_mapping {
            if cp != 1 || ep != 1 {
                return Err(PlanError::Flag {
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
    fn stage_layout(&self) -> Result<StageLayout, PlanError> {
        let pp = self.pipeline_model_parallel_size;
        let num_layers = self.num_layers.ok_or_else(|| PlanError::Flag {
            flag: "--num-layers".into(),
            problem: "is required".into(),
        })?;
        let layout = match (
            &self.hetero_pipeline_stages,
            self.num_layers_per_virtual_pipeline_stage,
        ) {
            (Some(_), Some(_)) => {
                return Err(PlanError::Flag {
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
                    return Err(PlanError::Flag {
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

    /// Parses the parallel flags of a command line (and nothing else).
    pub fn parse_args<S: AsRef<str>>(args: &[S]) -> Result<Self, PlanError> {
        let mut flags = PlanFlags::default();
        let mut seen = std::collections::HashSet::new();
        let mut i = 0;
        while i < args.len() {
            let flag = args[i].as_ref();
            let err = |problem: String| PlanError::Flag {
                flag: flag.to_owned(),
                problem,
            };
            if !seen.insert(flag.to_owned()) {
                return Err(err("given twice".into()));
            }
            let values: Vec<&str> = args[i + 1..]
                .iter()
                .map(|a| a.as_ref())
                .take_while(|a| !a.starts_with("--"))
                .collect();
            i += 1 + values.len();
            let number = |v: &str| -> Result<usize, PlanError> {
                v.parse()
                    .map_err(|_| err(format!("{v:?} is not a non-negative integer")))
            };
            let one = || -> Result<usize, PlanError> {
                match values.as_slice() {
                    [v] => number(v),
                    _ => Err(err(format!("takes one value, got {}", values.len()))),
                }
            };
            let many = || -> Result<Vec<usize>, PlanError> {
                if values.is_empty() {
                    return Err(err("needs values".into()));
                }
                values.iter().map(|v| number(v)).collect()
            };
            match flag {
                "--tensor-model-parallel-size" => flags.tensor_model_parallel_size = one()?,
                "--pipeline-model-parallel-size" => flags.pipeline_model_parallel_size = one()?,
                "--context-parallel-size" => flags.context_parallel_size = one()?,
                "--expert-model-parallel-size" => flags.expert_model_parallel_size = one()?,
                "--num-layers" => flags.num_layers = Some(one()?),
                "--global-batch-size" => flags.global_batch_size = Some(one()?),
                "--micro-batch-size" => flags.micro_batch_size = Some(one()?),
                "--num-layers-per-virtual-pipeline-stage" => {
                    flags.num_layers_per_virtual_pipeline_stage = Some(one()?)
                }
                "--hetero-pipeline-stages" => flags.hetero_pipeline_stages = Some(many()?),
                "--micro-batch-size-per-dp" => flags.micro_batch_size_per_dp = Some(many()?),
                "--num-micro-batches-per-dp" => flags.num_micro_batches_per_dp = Some(many()?),
                "--use-tp-pp-dp-mapping" => {
                    if !values.is_empty() {
                        return Err(err("takes no value".into()));
                    }
                    flags.use_tp_pp_dp_mapping = true;
                }
                other if other.starts_with("--") => {
                    return Err(err("not a parallel-plan flag".into()))
                }
                other => return Err(err(format!("unexpected value {other:?}"))),
            }
        }
        Ok(flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReplicaBatch;

    fn hetero_plan() -> ParallelPlan {
        ParallelPlan::from_synerfuse_args(
            &[
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--use-tp-pp-dp-mapping",
                "--num-layers",
                "8",
                "--hetero-pipeline-stages",
                "1",
                "6",
                "1",
                "2",
                "--global-batch-size",
                "32",
                "--micro-batch-size-per-dp",
                "1",
                "6",
                "1",
                "2",
                "--num-micro-batches-per-dp",
                "1",
                "4",
                "1",
                "4",
            ],
            8,
        )
        .unwrap()
    }

    #[test]
    fn hetero_pp_dp_and_tp_together() {
        let plan = hetero_plan();
        assert_eq!(plan.stages.layers(), [6, 2]);
        assert_eq!(
            plan.batches.replicas()[0],
            ReplicaBatch {
                micro_batch_size: 6,
                num_micro_batches: 4
            }
        );
        assert_eq!(plan.topology().unwrap().coordinates(5).unwrap().dp, 1);
        let args = plan.to_synerfuse_args();
        assert_eq!(ParallelPlan::from_synerfuse_args(&args, 8).unwrap(), plan);
    }

    #[test]
    fn device_requests_parse_every_form_and_round_trip() {
        for (text, request) in [
            ("cpu", DeviceRequest::Cpu),
            ("cuda", DeviceRequest::Cuda(None)),
            ("cuda:3", DeviceRequest::Cuda(Some(3))),
            ("auto", DeviceRequest::Auto),
        ] {
            assert_eq!(text.parse::<DeviceRequest>(), Ok(request));
            assert_eq!(request.to_string(), text);
        }
        for bad in ["", "tpu", "cuda:", "cuda:x", "cuda:-1"] {
            assert_eq!(
                bad.parse::<DeviceRequest>(),
                Err(UnknownDevice(bad.to_owned()))
            );
        }
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
            })
            .collect();
        let toml = plan.to_toml().unwrap();
        assert!(toml.contains("[topology]"), "{toml}");
        assert_eq!(ParallelPlan::from_toml(&toml).unwrap(), plan);
        assert_eq!(ParallelPlan::from_json(&plan.to_json()).unwrap(), plan);
        let broken = toml.replace("pp = 2", "pp = 4");
        assert!(ParallelPlan::from_toml(&broken).is_err());
    }

    #[test]
    fn flag_errors_name_the_flag() {
        let e = ParallelPlan::from_synerfuse_args(&["--num-layers", "8", "--bogus", "1"], 1)
            .unwrap_err();
        assert!(e.to_string().starts_with("--bogus"), "{e}");
        let e = ParallelPlan::from_synerfuse_args(&["--num-layers", "x"], 1).unwrap_err();
        assert!(e.to_string().contains("--num-layers"), "{e}");
        let e = ParallelPlan::from_synerfuse_args(
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "8",
                "--hetero-pipeline-stages",
                "1",
                "6",
                "1",
            ],
            2,
        )
        .unwrap_err();
        assert!(e.to_string().contains("group 1"), "{e}");
        let e = ParallelPlan::from_synerfuse_args(
            &[
                "--num-layers",
                "8",
                "--micro-batch-size",
                "2",
                "--micro-batch-size",
                "2",
            ],
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
    }
}
