//! FlagScale's heterogeneous process meshes, which SynerFuse's scripts use:
//! `--enable-hetero --hetero-process-meshes TP CP EP DP PP  TP CP EP DP PP ...
//! --hetero-device-types A B --hetero-pipeline-layer-split l0 l1 ...`. Each mesh is a
//! run of consecutive pipeline stages on one device type with its own tensor-, context-
//! and expert-parallel sizes; as a general plan, replica `d` takes the `d`-th
//! data-parallel slice of every mesh, and a mesh's stages group its replicas by its EP.
//!
//! Ranks follow FlagScale: mesh after mesh, and within a mesh Megatron's `tp-cp-ep-dp-pp`
//! order (tensor-parallel ranks consecutive, then replicas, then stages).

use super::{Plan, PlanError, ReplicaPipeline};
use crate::{BatchError, LayoutError, ReplicaBatches, StageLayout};

/// One process mesh: a run of pipeline stages on one device type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessMesh {
    /// Tensor-parallel size of its stages.
    pub tp: usize,
    /// Context-parallel size of its stages.
    pub cp: usize,
    /// Expert-parallel size: replicas per expert-parallel group of its stages, within
    /// the data-parallel size (as Megatron's EP divides its DP).
    pub ep: usize,
    /// Data-parallel size (every mesh the same).
    pub dp: usize,
    /// Its pipeline stages.
    pub pp: usize,
    /// Its `--hetero-device-types` entry.
    pub device_type: String,
}

impl ProcessMesh {
    /// Ranks in the mesh (expert parallelism splits its data-parallel replicas, adding
    /// none).
    pub fn world_size(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }
}

/// The hetero-mesh flags as typed values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MeshFlags {
    /// `--hetero-process-meshes`: five sizes (TP CP EP DP PP) per mesh.
    pub meshes: Vec<usize>,
    /// `--hetero-device-types`: one per mesh.
    pub device_types: Vec<String>,
    /// `--hetero-current-device-type`: this process's device type, if given.
    pub current_device_type: Option<String>,
    /// `--hetero-pipeline-layer-split`: layers per stage (default: even).
    pub layer_split: Option<Vec<usize>>,
    /// `--pipeline-model-parallel-size`, if given (must be Σ PP).
    pub pipeline_model_parallel_size: Option<usize>,
    /// `--num-layers`.
    pub num_layers: usize,
    /// `--micro-batch-size` (default 1).
    pub micro_batch_size: Option<usize>,
    /// `--global-batch-size` (default one micro-batch per replica).
    pub global_batch_size: Option<usize>,
}

/// Hetero-mesh flags that cannot make a plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MeshError {
    /// Not five sizes per mesh.
    #[error(
        "--hetero-process-meshes takes five sizes per mesh (TP CP EP DP PP); got {given} numbers"
    )]
    NotFiveSizes {
        /// Numbers given.
        given: usize,
    },
    /// A size of zero.
    #[error("--hetero-process-meshes: mesh {mesh} has a size of 0 (TP CP EP DP PP = {sizes:?})")]
    ZeroSize {
        /// The mesh.
        mesh: usize,
        /// Its sizes.
        sizes: Vec<usize>,
    },
    /// An expert-parallel size that does not divide the data-parallel size.
    #[error(
        "--hetero-process-meshes: mesh {mesh} has expert-parallel size {ep}, which does not divide its data-parallel size {dp} (an expert-parallel group is EP of its replicas)"
    )]
    Expert {
        /// The mesh.
        mesh: usize,
        /// Its EP.
        ep: usize,
        /// Its DP.
        dp: usize,
    },
    /// Meshes of different data-parallel sizes.
    #[error("--hetero-process-meshes: mesh {mesh} has data-parallel size {dp} but mesh 0 has {first}; every mesh needs the same data-parallel size")]
    DataParallel {
        /// The mesh.
        mesh: usize,
        /// Its DP.
        dp: usize,
        /// Mesh 0's DP.
        first: usize,
    },
    /// Not one device type per mesh.
    #[error("--hetero-device-types: {types} device types for {meshes} process meshes; give one per mesh")]
    DeviceTypeCount {
        /// Types given.
        types: usize,
        /// Meshes.
        meshes: usize,
    },
    /// A current device type that is none of the meshes'.
    #[error(
        "--hetero-current-device-type {current} is not one of --hetero-device-types {types:?}"
    )]
    CurrentDeviceType {
        /// The current type.
        current: String,
        /// The meshes' types.
        types: Vec<String>,
    },
    /// A pipeline size other than the meshes' stages.
    #[error("--pipeline-model-parallel-size {given} differs from the meshes' stages (the sum of their PP sizes, {stages})")]
    PipelineSize {
        /// The flag's value.
        given: usize,
        /// Σ PP.
        stages: usize,
    },
    /// A layer split of another length than the stages.
    #[error("--hetero-pipeline-layer-split gives {given} stages but the meshes have {stages} (the sum of their PP sizes)")]
    LayerSplitLength {
        /// Counts given.
        given: usize,
        /// Σ PP.
        stages: usize,
    },
    /// A layer split that does not hold the model.
    #[error("--hetero-pipeline-layer-split / --num-layers: {0}")]
    Layout(#[source] LayoutError),
    /// A batch the replicas cannot share.
    #[error("--global-batch-size / --micro-batch-size: {0}")]
    Batch(#[source] BatchError),
    /// The plan itself.
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// Parsed process meshes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessMeshes {
    meshes: Vec<ProcessMesh>,
}

impl ProcessMeshes {
    /// The meshes of `flags`, checked: five positive sizes each, one DP for all, each
    /// EP dividing it, one device type each, the current device type among them.
    pub fn parse(flags: &MeshFlags) -> Result<Self, MeshError> {
        let given = flags.meshes.len();
        if given == 0 || given % 5 != 0 {
            return Err(MeshError::NotFiveSizes { given });
        }
        let count = given / 5;
        if flags.device_types.len() != count {
            return Err(MeshError::DeviceTypeCount {
                types: flags.device_types.len(),
                meshes: count,
            });
        }
        if let Some(current) = &flags.current_device_type {
            if !flags.device_types.contains(current) {
                return Err(MeshError::CurrentDeviceType {
                    current: current.clone(),
                    types: flags.device_types.clone(),
                });
            }
        }
        let meshes: Vec<ProcessMesh> = (flags.meshes.chunks(5).zip(&flags.device_types))
            .map(|(s, device_type)| ProcessMesh {
                tp: s[0],
                cp: s[1],
                ep: s[2],
                dp: s[3],
                pp: s[4],
                device_type: device_type.clone(),
            })
            .collect();
        for (mesh, (m, sizes)) in meshes.iter().zip(flags.meshes.chunks(5)).enumerate() {
            if sizes.contains(&0) {
                let sizes = sizes.to_vec();
                return Err(MeshError::ZeroSize { mesh, sizes });
            }
            if m.dp != meshes[0].dp {
                let (dp, first) = (m.dp, meshes[0].dp);
                return Err(MeshError::DataParallel { mesh, dp, first });
            }
            if m.dp % m.ep != 0 {
                let (ep, dp) = (m.ep, m.dp);
                return Err(MeshError::Expert { mesh, ep, dp });
            }
        }
        Ok(ProcessMeshes { meshes })
    }

    /// The meshes, in order.
    pub fn meshes(&self) -> &[ProcessMesh] {
        &self.meshes
    }

    /// Ranks over all meshes.
    pub fn world_size(&self) -> usize {
        self.meshes.iter().map(ProcessMesh::world_size).sum()
    }

    /// The mesh `rank` belongs to.
    pub fn mesh_of(&self, rank: usize) -> Option<usize> {
        let mut end = 0;
        self.meshes.iter().position(|m| {
            end += m.world_size();
            rank < end
        })
    }

    /// The general plan of these meshes: one replica per data-parallel index, its stages
    /// the meshes' stages in order, each on its mesh's tensor- and context-parallel ranks.
    pub fn plan(&self, flags: &MeshFlags) -> Result<Plan, MeshError> {
        let stages: usize = self.meshes.iter().map(|m| m.pp).sum();
        if let Some(given) = flags.pipeline_model_parallel_size.filter(|&p| p != stages) {
            return Err(MeshError::PipelineSize { given, stages });
        }
        let layout = match &flags.layer_split {
            Some(split) if split.len() != stages => {
                let given = split.len();
                return Err(MeshError::LayerSplitLength { given, stages });
            }
            Some(split) => StageLayout::new(split.clone(), flags.num_layers),
            None => StageLayout::uniform(flags.num_layers, stages),
        }
        .map_err(MeshError::Layout)?;
        let dp = self.meshes[0].dp;
        let batches = ReplicaBatches::from_flags(
            dp,
            flags.global_batch_size,
            flags.micro_batch_size,
            None,
            None,
        )
        .map_err(MeshError::Batch)?;
        let replicas = (0..dp)
            .map(|d| ReplicaPipeline {
                stages: layout.clone(),
                batch: batches.replicas()[d].clone(),
                ranks: self.stage_ranks(d),
                tp_shares: Vec::new(),
                cp: (self.meshes.iter())
                    .flat_map(|m| std::iter::repeat_n(m.cp, m.pp))
                    .collect(),
                cp_shares: Vec::new(),
                recompute: Vec::new(),
                placements: Vec::new(),
                experts: Vec::new(),
            })
            .collect();
        let ep: Vec<usize> = (self.meshes.iter())
            .flat_map(|m| std::iter::repeat_n(m.ep, m.pp))
            .collect();
        let plan = Plan::new(replicas)?;
        Ok(match ep.iter().all(|&n| n == 1) {
            true => plan,
            false => plan.with_even_experts_by_stage(|s| ep[s])?,
        })
    }

    /// Replica `d`'s ranks, stage by stage: mesh after mesh, `tp-cp-ep-dp-pp` within one
    /// (a stage's context-parallel members' tensor-parallel groups in turn).
    fn stage_ranks(&self, d: usize) -> Vec<Vec<usize>> {
        let mut offset = 0;
        let mut ranks = Vec::new();
        for m in &self.meshes {
            for p in 0..m.pp {
                let rank = |c: usize, t: usize| offset + t + m.tp * (c + m.cp * (d + m.dp * p));
                ranks.push(
                    (0..m.cp)
                        .flat_map(|c| (0..m.tp).map(move |t| rank(c, t)))
                        .collect(),
                );
            }
            offset += m.world_size();
        }
        ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(meshes: &[usize], types: &[&str]) -> MeshFlags {
        MeshFlags {
            meshes: meshes.to_vec(),
            device_types: types.iter().map(|t| t.to_string()).collect(),
            num_layers: 6,
            micro_batch_size: Some(1),
            global_batch_size: Some(4),
            ..MeshFlags::default()
        }
    }

    #[test]
    fn meshes_number_ranks_mesh_by_mesh_in_megatron_order() {
        // Mesh 0: TP 2, DP 2, PP 1 on A; mesh 1: TP 1, DP 2, PP 2 on B.
        let mut f = flags(&[2, 1, 1, 2, 1, 1, 1, 1, 2, 2], &["A", "B"]);
        f.layer_split = Some(vec![2, 3, 1]);
        let meshes = ProcessMeshes::parse(&f).unwrap();
        assert_eq!(meshes.world_size(), 8);
        let plan = meshes.plan(&f).unwrap();
        assert_eq!(plan.replicas().len(), 2);
        assert_eq!(plan.replicas()[0].ranks, [vec![0, 1], vec![4], vec![6]]);
        assert_eq!(plan.replicas()[1].ranks, [vec![2, 3], vec![5], vec![7]]);
        assert_eq!(plan.replicas()[0].stages.layers(), [2, 3, 1]);
        assert_eq!(plan.replicas()[1].batch.num_micro_batches(), 2);
        assert_eq!(meshes.mesh_of(3), Some(0));
        assert_eq!(meshes.mesh_of(4), Some(1));
        assert_eq!(meshes.mesh_of(8), None);
        // Every rank runs a program, and the schedule holds.
        let programs = plan.schedule(crate::ScheduleKind::OneFOneB).unwrap();
        assert!(programs.iter().all(|p| !p.is_empty()));
    }

    #[test]
    fn a_mesh_context_parallel_size_groups_each_stage() {
        // Mesh 0: TP 2, CP 2, DP 1, PP 1 on A; mesh 1: TP 1, CP 1, DP 1, PP 1 on B.
        let mut f = flags(&[2, 2, 1, 1, 1, 1, 1, 1, 1, 1], &["A", "B"]);
        f.layer_split = Some(vec![4, 2]);
        let plan = ProcessMeshes::parse(&f).unwrap().plan(&f).unwrap();
        let r = &plan.replicas()[0];
        assert_eq!(r.ranks, [vec![0, 1, 2, 3], vec![4]]);
        assert_eq!((r.cp_size(0), r.tp_size(0), r.cp_size(1)), (2, 2, 1));
        assert_eq!(r.tp_group(0, 1), [2, 3]);
        assert_eq!(r.cp_group(0, 1), [1, 3]);
        assert_eq!(plan.cp_rank(3), Some(1));
        assert_eq!(plan.tp_rank(3), Some(1));
        // Every context-parallel member's tensor-parallel group reduces its gradients
        // (the dp-cp group of each tensor-parallel index).
        let reductions = plan.gradient_reductions(false);
        assert!(reductions.iter().any(|g| g.members == [0, 2]));
        assert!(reductions.iter().any(|g| g.members == [1, 3]));
    }

    #[test]
    fn each_mesh_groups_its_stages_by_its_own_expert_parallel_size() {
        // DP 4 everywhere; mesh 0 EP 2, mesh 1 EP 4, mesh 2 EP 1; one stage each.
        let mut f = flags(
            &[1, 1, 2, 4, 1, 1, 1, 4, 4, 1, 1, 1, 1, 4, 1],
            &["A", "B", "C"],
        );
        f.layer_split = Some(vec![2, 2, 2]);
        let plan = ProcessMeshes::parse(&f).unwrap().plan(&f).unwrap();
        let groups = plan.expert_groups(8).unwrap();
        let at = |stage: usize| -> Vec<Vec<usize>> {
            (groups.iter().filter(|g| g.stage == stage))
                .map(|g| g.replicas.clone())
                .collect()
        };
        assert_eq!(at(0), [vec![0, 1], vec![2, 3]]);
        assert_eq!(at(1), [vec![0, 1, 2, 3]]);
        assert!(at(2).is_empty());
        let quarters = vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]];
        assert_eq!(
            plan.expert_ranks(&groups, 5),
            Some((vec![4, 5, 6, 7], quarters))
        );
        assert_eq!(plan.expert_ranks(&groups, 9), None);
        assert_eq!(plan.expert_holders(0, 5, 8), [1, 3]);
        assert_eq!(plan.expert_holders(4, 5, 8), [0, 1, 2, 3]);
        // Shares per stage have no plan-file form: writing one is refused, not lossy.
        let e = plan.to_toml().unwrap_err().to_string();
        assert!(e.contains("which a plan file cannot say"), "{e}");
    }

    #[test]
    fn impossible_meshes_are_named() {
        let cases: [(MeshFlags, &str); 6] = [
            (flags(&[2, 1, 1, 1], &["A"]), "five sizes per mesh"),
            (
                flags(&[2, 1, 1, 1, 1], &["A", "B"]),
                "2 device types for 1 process meshes",
            ),
            (
                flags(&[1, 1, 1, 3, 1, 1, 1, 2, 3, 1], &["A", "B"]),
                "mesh 1 has expert-parallel size 2, which does not divide its data-parallel size 3",
            ),
            (
                flags(&[2, 1, 1, 2, 1, 1, 1, 1, 1, 1], &["A", "B"]),
                "mesh 1 has data-parallel size 1 but mesh 0 has 2",
            ),
            (flags(&[2, 1, 1, 1, 0], &["A"]), "mesh 0 has a size of 0"),
            (
                MeshFlags {
                    current_device_type: Some("C".into()),
                    ..flags(&[2, 1, 1, 1, 1], &["A"])
                },
                "--hetero-current-device-type C is not one of",
            ),
        ];
        for (f, expected) in cases {
            let e = ProcessMeshes::parse(&f).unwrap_err().to_string();
            assert!(e.contains(expected), "{e}");
        }
        let f = MeshFlags {
            layer_split: Some(vec![3, 3]),
            ..flags(&[2, 1, 1, 1, 1, 1, 1, 1, 1, 2], &["A", "B"])
        };
        let e = ProcessMeshes::parse(&f).unwrap().plan(&f).unwrap_err();
        assert!(
            e.to_string()
                .contains("gives 2 stages but the meshes have 3"),
            "{e}"
        );
        let f = MeshFlags {
            pipeline_model_parallel_size: Some(2),
            ..flags(&[2, 1, 1, 1, 3], &["A"])
        };
        let e = ProcessMeshes::parse(&f).unwrap().plan(&f).unwrap_err();
        assert!(
            e.to_string()
                .contains("--pipeline-model-parallel-size 2 differs"),
            "{e}"
        );
    }
}
