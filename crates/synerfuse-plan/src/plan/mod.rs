//! The general plan: each data-parallel replica its own pipeline (its own stages, layer
//! split, micro-batch size and count, and devices), with Megatron's grid as the special
//! case, and the gradient segments such a plan reduces.
//!
//! Ranks are numbered replica by replica, stage by stage, unless the plan brings its own
//! rank order: a grid's (`from_grid` keeps it, so a converted grid runs on the same
//! ranks), or the `ranks` of a plan file.

use crate::cp::{ContextSplit, ContextSplitError};
use crate::{
    pipeline_schedule, GridError, Instruction, LayoutError, ReplicaBatch, ReplicaBatches,
    ScheduleError, ScheduleKind, StageLayout,
};

mod check;
mod experts;
mod file;
mod grid;
mod meshes;
mod placement;
mod reduce;

pub use experts::{coupled_replicas, ExpertGroupPlan};
pub use grid::GridFlags;
pub use meshes::{MeshError, MeshFlags, ProcessMesh, ProcessMeshes};
pub use placement::{DeviceRequest, RankPlacement, UnknownDevice};
pub use reduce::{
    expert_of, layer_of, parameter_piece, reduction_of, GradientReduction, GradientSegment,
    ReducedParameters, EMBEDDING,
};

/// One replica: a pipeline of stages with its own batch and ranks; a stage runs on one
/// rank or on a tensor-parallel group of its own size and shares, or on a context-parallel
/// group of such groups, each holding its own token positions of every sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaPipeline {
    /// Layers per stage (and virtual chunk).
    pub stages: StageLayout,
    /// Its micro-batches' sizes (one size and a count, or ragged).
    pub batch: ReplicaBatch,
    /// Each stage's global ranks, in stage order: one rank, or the stage's tensor-parallel
    /// group in tensor-parallel order, or under context parallelism each context-parallel
    /// member's tensor-parallel group in turn (tensor-parallel rank fastest, as in
    /// Megatron's rank order).
    pub ranks: Vec<Vec<usize>>,
    /// Each stage's tensor-parallel shares (empty, or one entry per stage; `None`: even).
    pub tp_shares: Vec<Option<Vec<u32>>>,
    /// Each stage's context-parallel size (empty, or one entry per stage; 1: none).
    pub cp: Vec<usize>,
    /// Each stage's context-parallel shares (empty, or one entry per stage; `None`:
    /// even, Megatron's load-balanced layout).
    pub cp_shares: Vec<Option<Vec<u32>>>,
    /// Which stages recompute their activations in the backward (empty: none, unless
    /// the run asks all to).
    pub recompute: Vec<bool>,
    /// Where each rank computes, in the order of `ranks` flattened (empty: the run's
    /// default device).
    pub placements: Vec<RankPlacement>,
    /// Each stage's experts of every MoE layer that this replica holds (empty, or one
    /// entry per stage; `None`: all of them): under expert parallelism the replicas of
    /// an expert-parallel group ([`Plan::expert_groups`]) hold them between them.
    pub experts: Vec<Option<ExpertHolding>>,
}

/// Which experts of every MoE layer a replica's stage holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertHolding {
    /// These (a plan file's `experts`).
    Listed(Vec<usize>),
    /// Member `member`'s even part of `members` (Megatron's
    /// `--expert-model-parallel-size`: experts `[member·E/members, (member+1)·E/members)`).
    EvenShare {
        /// Its index in the expert-parallel group.
        member: usize,
        /// Members of the group.
        members: usize,
    },
}

impl ExpertHolding {
    /// The experts held of a model with `num_experts` per MoE layer.
    pub fn experts(&self, num_experts: usize) -> Vec<usize> {
        match self {
            ExpertHolding::Listed(experts) => experts.clone(),
            ExpertHolding::EvenShare { member, members } => {
                let per = num_experts / members.max(&1);
                (member * per..(member + 1) * per).collect()
            }
        }
    }
}

impl ReplicaPipeline {
    /// A replica whose stages each run on one rank: `ranks[stage]`.
    pub fn single_ranks(
        stages: StageLayout,
        batch: ReplicaBatch,
        ranks: Vec<usize>,
        placements: Vec<RankPlacement>,
    ) -> Self {
        ReplicaPipeline {
            stages,
            batch,
            ranks: ranks.into_iter().map(|r| vec![r]).collect(),
            tp_shares: Vec::new(),
            cp: Vec::new(),
            cp_shares: Vec::new(),
            recompute: Vec::new(),
            placements,
            experts: Vec::new(),
        }
    }

    /// The replica's ranks, stage by stage.
    pub fn all_ranks(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranks.iter().flatten().copied()
    }

    /// The experts of every MoE layer of `stage` this replica holds, of a model with
    /// `num_experts` per MoE layer (`None`: all).
    pub fn experts(&self, stage: usize, num_experts: usize) -> Option<Vec<usize>> {
        let holding = self.experts.get(stage)?.as_ref()?;
        Some(holding.experts(num_experts))
    }

    /// Whether some stage holds only some experts (the replica is in an
    /// expert-parallel group).
    pub fn splits_experts(&self) -> bool {
        self.experts.iter().any(Option::is_some)
    }

    /// Whether `stage` recomputes its activations by the plan.
    pub fn recomputes(&self, stage: usize) -> bool {
        self.recompute.get(stage).copied().unwrap_or(false)
    }

    /// The tensor-parallel size of `stage`.
    pub fn tp_size(&self, stage: usize) -> usize {
        self.ranks[stage].len() / self.cp_size(stage)
    }

    /// The context-parallel size of `stage` (1 without context parallelism).
    pub fn cp_size(&self, stage: usize) -> usize {
        self.cp.get(stage).copied().unwrap_or(1).max(1)
    }

    /// The tensor-parallel group of context-parallel member `member` of `stage` (the
    /// stage's ranks without context parallelism).
    pub fn tp_group(&self, stage: usize, member: usize) -> &[usize] {
        let size = self.tp_size(stage);
        &self.ranks[stage][member * size..(member + 1) * size]
    }

    /// Every tensor-parallel group of `stage`, in context-parallel order.
    pub fn tp_groups(&self, stage: usize) -> impl Iterator<Item = &[usize]> + '_ {
        self.ranks[stage].chunks(self.tp_size(stage))
    }

    /// The context-parallel group of `stage`'s tensor-parallel index `tp`: the ranks of
    /// that index in every member's group, in context-parallel order.
    pub fn cp_group(&self, stage: usize, tp: usize) -> Vec<usize> {
        self.tp_groups(stage).map(|group| group[tp]).collect()
    }

    /// The tensor-parallel shares of `stage` in lowest terms (all 1 when even).
    pub fn shares(&self, stage: usize) -> Vec<u32> {
        match self.tp_shares.get(stage).and_then(Option::as_ref) {
            Some(shares) => lowest_terms(shares),
            None => vec![1; self.tp_size(stage)],
        }
    }

    /// The context-parallel shares of `stage` in lowest terms, `None` when even.
    pub fn context_shares(&self, stage: usize) -> Option<Vec<u32>> {
        let shares = self.cp_shares.get(stage).and_then(Option::as_ref)?;
        Some(lowest_terms(shares))
    }

    /// How `stage` splits a sequence of `sequence` tokens over its context-parallel
    /// members: Megatron's load-balanced layout when even, else in its shares.
    pub fn context_split(
        &self,
        stage: usize,
        sequence: usize,
    ) -> Result<ContextSplit, ContextSplitError> {
        match self.context_shares(stage) {
            Some(shares) => ContextSplit::in_shares(sequence, &shares),
            None => ContextSplit::even(sequence, self.cp_size(stage)),
        }
    }

    /// Whether stages `a` and `b` split sequences alike (the same context-parallel size
    /// and shares, even shares given or not): an activation then passes between members
    /// of the same index.
    pub fn same_context_layout(&self, a: usize, b: usize) -> bool {
        let shares =
            |s: usize| (self.context_shares(s)).unwrap_or_else(|| vec![1; self.cp_size(s)]);
        self.cp_size(a) == self.cp_size(b) && shares(a) == shares(b)
    }
}

fn lowest_terms(shares: &[u32]) -> Vec<u32> {
    let g = shares.iter().fold(0, |a, &b| gcd(a, b)).max(1);
    shares.iter().map(|s| s / g).collect()
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A general plan that cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// No replica.
    #[error("a plan needs at least one replica")]
    NoReplicas,
    /// A replica's stages that do not hold the model's layers.
    #[error("replica {replica}: {source}")]
    Layout {
        /// The replica.
        replica: usize,
        /// Why its layout is refused.
        source: LayoutError,
    },
    /// A replica whose stages hold another number of layers than replica 0's.
    #[error("replica {replica} holds {layers} layers but replica 0 holds {first}; every replica holds the whole model")]
    ReplicaLayers {
        /// The replica.
        replica: usize,
        /// Its layers.
        layers: usize,
        /// Replica 0's layers.
        first: usize,
    },
    /// Stages that hold another number of layers than the model has.
    #[error("the plan's stages hold {plan} layers but the model has {model}")]
    LayerCount {
        /// Layers over the plan's stages.
        plan: usize,
        /// The model's layers.
        model: usize,
    },
    /// A stage chunk with no layers.
    #[error("replica {replica}: pipeline stage {stage} chunk {chunk} has no layers")]
    EmptyChunk {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// The chunk.
        chunk: usize,
    },
    /// A tensor-parallel stage whose shares cannot divide the model.
    #[error("replica {replica} stage {stage}: {source}")]
    TensorParallelSplit {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// Which constraint the split breaks.
        source: crate::TpSplitError,
    },
    /// Sequence parallelism on a stage whose group cannot split the sequence evenly.
    #[error("replica {replica} stage {stage}: sequence parallelism splits the sequence over the stage's {size} tensor-parallel ranks, but the sequence length {sequence} does not divide by {size} (under context parallelism: a member's tokens)")]
    SequenceParallel {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// Its tensor-parallel size.
        size: usize,
        /// The sequence length.
        sequence: usize,
    },
    /// Virtual chunks on a replica of one stage.
    #[error("replica {replica}: virtual pipeline chunks need at least two pipeline stages")]
    ChunksWithoutPipeline {
        /// The replica.
        replica: usize,
    },
    /// A replica without samples, or with an empty micro-batch.
    #[error("replica {replica}: micro-batches of {sizes:?} samples; it needs at least one micro-batch, each of at least one sample")]
    EmptyBatch {
        /// The replica.
        replica: usize,
        /// Its micro-batch sizes.
        sizes: Vec<usize>,
    },
    /// A replica whose batch fields contradict each other.
    #[error("replica {replica}: {source}")]
    BatchForm {
        /// The replica.
        replica: usize,
        /// Which fields.
        source: crate::BatchFormError,
    },
    /// A replica whose rank or placement list is not one per stage.
    #[error("replica {replica}: {given} {what} for {stages} stages")]
    PerStage {
        /// The replica.
        replica: usize,
        /// `ranks`, `devices` or `speeds`.
        what: &'static str,
        /// Entries given.
        given: usize,
        /// Its stages.
        stages: usize,
    },
    /// A placement list that is not one per rank of the replica.
    #[error("replica {replica}: {given} {what} for its {ranks} ranks")]
    PerRank {
        /// The replica.
        replica: usize,
        /// `devices`, `speeds`, `kinds` or `placements`.
        what: &'static str,
        /// Entries given.
        given: usize,
        /// The replica's ranks.
        ranks: usize,
    },
    /// A stage without ranks, or tensor-parallel shares that are not one positive share
    /// per rank of the stage.
    #[error("replica {replica} stage {stage}: tensor-parallel shares {shares:?} for {size} ranks (one positive share per rank, at least one rank)")]
    TpShares {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// The shares given.
        shares: Vec<u32>,
        /// The stage's ranks.
        size: usize,
    },
    /// A context-parallel size that does not divide the stage's ranks, or shares that
    /// are not one positive share per member.
    #[error("replica {replica} stage {stage}: context-parallel size {cp} with shares {shares:?} for the stage's {ranks} ranks (the size divides the ranks; one positive share per member)")]
    CpGroup {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// The context-parallel size given.
        cp: usize,
        /// The shares given (empty: even).
        shares: Vec<u32>,
        /// The stage's ranks.
        ranks: usize,
    },
    /// A context-parallel split that the sequence length does not allow.
    #[error("replica {replica} stage {stage}: {source}")]
    ContextSplit {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// Why.
        source: ContextSplitError,
    },
    /// Ranks of one stage given different precisions.
    #[error("replica {replica}, stage {stage}: its ranks compute in {} and {} (one precision per stage: its tensor- and context-parallel groups exchange activations in it)", precisions[0], precisions[1])]
    StagePrecision {
        /// The replica.
        replica: usize,
        /// The stage.
        stage: usize,
        /// Two of the precisions given (`the job's`: none, the job's flag).
        precisions: [&'static str; 2],
    },
    /// A device memory that is not a positive number of GB.
    #[error("replica {replica}: memory_gb {memory} is not a positive number of GB")]
    Memory {
        /// The replica.
        replica: usize,
        /// The value given.
        memory: f64,
    },
    /// Ranks that are not each of 0..world size exactly once.
    #[error("the stages' ranks are not 0..{world_size} each once (rank {rank} is {problem})")]
    Ranks {
        /// Stages over all replicas.
        world_size: usize,
        /// The offending rank.
        rank: usize,
        /// `repeated` or `out of range`.
        problem: &'static str,
    },
    /// A global batch size that differs from the replicas' sum.
    #[error("the replicas take {actual} samples per step but the global batch size is {expected}")]
    GlobalBatch {
        /// The global batch size asked for.
        expected: usize,
        /// Σ of the replicas' samples.
        actual: usize,
    },
    /// Replicas that cannot form an expert-parallel group.
    #[error("expert-parallel group of replicas {replicas:?}: {problem}")]
    ExpertGroup {
        /// The replicas.
        replicas: Vec<usize>,
        /// What is wrong.
        problem: String,
    },
    /// The grid it came from is inconsistent.
    #[error(transparent)]
    Grid(#[from] GridError),
    /// Replica batches that do not make a step (samples past what a count holds).
    #[error(transparent)]
    Batch(#[from] crate::BatchError),
    /// TOML (or JSON) that does not parse as a plan.
    #[error("plan file: {0}")]
    Toml(String),
    /// A device name that is not one.
    #[error("replica {replica}: {source}")]
    Device {
        /// The replica.
        replica: usize,
        /// Why.
        source: crate::UnknownDevice,
    },
    /// An emulated speed outside (0, 1].
    #[error(
        "replica {replica}: speed {speed} must be in (0, 1] (a fraction of the device's own speed)"
    )]
    Speed {
        /// The replica.
        replica: usize,
        /// The speed.
        speed: f64,
    },
    /// `ranks` given for some replicas of a file but not all.
    #[error("replica {replica} has no `ranks` but other replicas do: give them for every replica or none")]
    PartialRanks {
        /// The first replica without them.
        replica: usize,
    },
    /// A `[network]` with a bad number.
    #[error("plan file: {0}")]
    Network(#[from] crate::NetworkError),
    /// A replica whose pipeline cannot run the schedule.
    #[error("replica {replica}: {source}")]
    Schedule {
        /// The replica.
        replica: usize,
        /// Why.
        source: ScheduleError,
    },
}

/// Each data-parallel replica its own pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    replicas: Vec<ReplicaPipeline>,
    /// The links between the placements' nodes and sites, which a run emulates.
    network: Option<crate::Network>,
}

impl Plan {
    /// A plan of `replicas`, checked: at least one, every replica with stages that hold
    /// the same number of layers, samples, one rank (and placement, if any) per stage,
    /// and the ranks 0..N each once.
    pub fn new(replicas: Vec<ReplicaPipeline>) -> Result<Self, PlanError> {
        let first = replicas.first().ok_or(PlanError::NoReplicas)?;
        let num_layers = first.stages.num_layers();
        for (r, replica) in replicas.iter().enumerate() {
            check_replica(r, replica, num_layers)?;
        }
        // The samples of a step add up (what `batches` relies on).
        ReplicaBatches::new(replicas.iter().map(|r| r.batch.clone()).collect())?;
        let plan = Plan {
            replicas,
            network: None,
        };
        plan.check_ranks()?;
        plan.check_sites()?;
        Ok(plan)
    }

    /// The plan with `network` between its nodes and sites: a run emulates its links,
    /// delaying each transfer between two nodes by its bytes over the link's bandwidth
    /// plus its latency (on one machine; see `synerfuse-train`'s link emulation).
    pub fn with_network(mut self, network: crate::Network) -> Result<Self, PlanError> {
        network.check()?;
        self.network = Some(network);
        Ok(self)
    }

    /// The links a run emulates, if the plan carries them.
    pub fn network(&self) -> Option<&crate::Network> {
        self.network.as_ref()
    }

    /// Where each world rank sits: its placement's node and site (`""`: unnamed).
    pub fn hosts(&self) -> Vec<crate::Host<'_>> {
        let unnamed = crate::Host { node: "", site: "" };
        let mut out = vec![unnamed; self.world_size()];
        // In one pass (a plan of many thousand ranks): placements follow `all_ranks`.
        for replica in &self.replicas {
            for (rank, p) in replica.all_ranks().zip(&replica.placements) {
                out[rank] = crate::Host {
                    node: p.node.as_deref().unwrap_or(""),
                    site: p.site.as_deref().unwrap_or(""),
                };
            }
        }
        out
    }

    /// A node sits in one site.
    fn check_sites(&self) -> Result<(), PlanError> {
        let placements = self.replicas.iter().flat_map(|r| &r.placements);
        let hosts =
            placements.filter_map(|p| Some((p.node.as_deref()?, p.site.as_deref().unwrap_or(""))));
        crate::network::sites_of_nodes(hosts)?;
        Ok(())
    }

    fn check_ranks(&self) -> Result<(), PlanError> {
        let world_size = self.world_size();
        let mut seen = vec![false; world_size];
        for rank in self.replicas.iter().flat_map(ReplicaPipeline::all_ranks) {
            let problem = match seen.get_mut(rank) {
                None => "out of range",
                Some(true) => "repeated",
                Some(slot) => {
                    *slot = true;
                    continue;
                }
            };
            return Err(PlanError::Ranks {
                world_size,
                rank,
                problem,
            });
        }
        Ok(())
    }

    /// The replicas, in replica (and sample) order.
    pub fn replicas(&self) -> &[ReplicaPipeline] {
        &self.replicas
    }

    /// Ranks over all replicas.
    pub fn world_size(&self) -> usize {
        self.replicas.iter().map(|r| r.all_ranks().count()).sum()
    }

    /// Whether some stage runs on a tensor-parallel group.
    pub fn has_tensor_parallelism(&self) -> bool {
        (self.replicas.iter()).any(|r| (0..r.stages.num_stages()).any(|s| r.tp_size(s) > 1))
    }

    /// Decoder layers of the model.
    pub fn num_layers(&self) -> usize {
        self.replicas[0].stages.num_layers()
    }

    /// Samples per step: the replicas' samples, summed.
    pub fn global_batch_size(&self) -> usize {
        (self.replicas.iter()).map(|r| r.batch.samples()).sum()
    }

    /// Micro-batch size and count per replica (which samples each takes).
    pub fn batches(&self) -> ReplicaBatches {
        ReplicaBatches::new(self.replicas.iter().map(|r| r.batch.clone()).collect())
            .expect("replica batches checked in Plan::new")
    }

    /// What `rank` computes in, when the plan says (else the job's flag decides).
    pub fn precision_of(&self, rank: usize) -> Option<crate::Precision> {
        self.placement(rank)?.precision
    }

    /// Where `rank` computes, when the plan says.
    pub fn placement(&self, rank: usize) -> Option<&RankPlacement> {
        let (replica, _) = self.position(rank)?;
        let replica = &self.replicas[replica];
        let index = replica.all_ranks().position(|r| r == rank)?;
        replica.placements.get(index)
    }

    /// The distributed optimizer's shares of `ranks`: each rank's device memory (in
    /// tenths of a GB) when the plan gives every one of them, else equal.
    pub fn memory_shares(&self, ranks: &[usize]) -> Vec<u32> {
        let memory: Option<Vec<f64>> = ranks
            .iter()
            .map(|&r| self.placement(r).and_then(|p| p.memory_gb))
            .collect();
        match memory {
            Some(gb) => gb.iter().map(|&g| memory_share_weight(g)).collect(),
            None => vec![1; ranks.len()],
        }
    }

    /// Each replica's ranks, stage by stage (its pipeline).
    pub fn pipelines(&self) -> Vec<Vec<usize>> {
        self.replicas
            .iter()
            .map(|r| r.all_ranks().collect())
            .collect()
    }

    /// Every rank's program for one step (indexed by rank; peers are global ranks): each
    /// replica runs `kind` over its own stages and micro-batches; a replica without
    /// virtual chunks runs 1F1B where `kind` is interleaved, as Megatron does.
    pub fn schedule(&self, kind: ScheduleKind) -> Result<Vec<Vec<Instruction>>, PlanError> {
        let mut programs = vec![Vec::new(); self.world_size()];
        for (r, replica) in self.replicas.iter().enumerate() {
            for (rank, program) in self.replica_programs(kind, r, &replica.ranks)? {
                programs[rank] = program;
            }
        }
        Ok(programs)
    }

    /// [`Plan::schedule`] of `replicas` only, their ranks numbered in order from 0 (a
    /// program's peers so numbered); with, per such rank, its rank in the plan.
    pub fn schedule_of(
        &self,
        kind: ScheduleKind,
        replicas: &[usize],
    ) -> Result<(Vec<Vec<Instruction>>, Vec<usize>), PlanError> {
        let mut programs = Vec::new();
        let mut ranks_in_plan = Vec::new();
        for &r in replicas {
            let ranks = &self.replicas[r].ranks;
            let mut next = programs.len();
            let renumbered: Vec<Vec<usize>> = (ranks.iter())
                .map(|stage| {
                    let first = next;
                    next += stage.len();
                    (first..next).collect()
                })
                .collect();
            programs.resize(next, Vec::new());
            for (rank, program) in self.replica_programs(kind, r, &renumbered)? {
                programs[rank] = program;
            }
            ranks_in_plan.extend(ranks.iter().flatten().copied());
        }
        Ok((programs, ranks_in_plan))
    }

    /// Replica `r`'s programs, each with its rank in `ranks` (the replica's ranks per
    /// stage, as the programs' peers name them): `kind` over its stages and micro-batches,
    /// 1F1B where `kind` is interleaved and it has no virtual chunks.
    fn replica_programs(
        &self,
        kind: ScheduleKind,
        r: usize,
        ranks: &[Vec<usize>],
    ) -> Result<Vec<(usize, Vec<Instruction>)>, PlanError> {
        let replica = &self.replicas[r];
        let (stages, chunks) = (replica.stages.num_stages(), replica.stages.num_chunks());
        let kind = match kind {
            ScheduleKind::Interleaved if chunks == 1 => ScheduleKind::OneFOneB,
            other => other,
        };
        let per_stage = pipeline_schedule(kind, stages, chunks, replica.batch.num_micro_batches())
            .map_err(|source| PlanError::Schedule { replica: r, source })?;
        let shapes: Vec<StageRanks> = (ranks.iter().enumerate())
            .map(|(stage, ranks)| StageRanks {
                ranks: ranks.clone(),
                tp: replica.tp_size(stage),
            })
            .collect();
        let mut out = Vec::with_capacity(ranks.iter().map(Vec::len).sum());
        for (stage, program) in per_stage.into_iter().enumerate() {
            for (index, &rank) in ranks[stage].iter().enumerate() {
                out.push((rank, tp_program(&program, &shapes, stage, index)));
            }
        }
        Ok(out)
    }

    /// Whether any replica has virtual chunks (an interleaved schedule's default).
    pub fn has_chunks(&self) -> bool {
        self.replicas.iter().any(|r| r.stages.num_chunks() > 1)
    }

    /// (replica, stage) of `rank`.
    pub fn position(&self, rank: usize) -> Option<(usize, usize)> {
        self.replicas.iter().enumerate().find_map(|(r, replica)| {
            let stage = replica.ranks.iter().position(|s| s.contains(&rank))?;
            Some((r, stage))
        })
    }

    /// (replica, stage) of every rank, in rank order: [`Plan::position`] of each, in one
    /// pass (a plan of many thousand ranks).
    pub fn positions(&self) -> Vec<(usize, usize)> {
        let mut out = vec![(0, 0); self.world_size()];
        for (r, replica) in self.replicas.iter().enumerate() {
            for (stage, ranks) in replica.ranks.iter().enumerate() {
                for &rank in ranks {
                    out[rank] = (r, stage);
                }
            }
        }
        out
    }

    /// `rank`'s index in its stage's tensor-parallel group (0 without one).
    pub fn tp_rank(&self, rank: usize) -> Option<usize> {
        let (replica, stage) = self.position(rank)?;
        let r = &self.replicas[replica];
        let index = r.ranks[stage].iter().position(|&x| x == rank)?;
        Some(index % r.tp_size(stage))
    }

    /// `rank`'s index in its stage's context-parallel group (0 without one).
    pub fn cp_rank(&self, rank: usize) -> Option<usize> {
        let (replica, stage) = self.position(rank)?;
        let r = &self.replicas[replica];
        let index = r.ranks[stage].iter().position(|&x| x == rank)?;
        Some(index / r.tp_size(stage))
    }

    /// Whether some stage runs on a context-parallel group.
    pub fn has_context_parallelism(&self) -> bool {
        (self.replicas.iter()).any(|r| (0..r.stages.num_stages()).any(|s| r.cp_size(s) > 1))
    }
}

fn check_replica(
    replica: usize,
    pipeline: &ReplicaPipeline,
    num_layers: usize,
) -> Result<(), PlanError> {
    if pipeline.stages.num_layers() != num_layers {
        return Err(PlanError::ReplicaLayers {
            replica,
            layers: pipeline.stages.num_layers(),
            first: num_layers,
        });
    }
    if pipeline.stages.num_chunks() > 1 && pipeline.stages.num_stages() == 1 {
        return Err(PlanError::ChunksWithoutPipeline { replica });
    }
    let sizes = pipeline.batch.sizes();
    if sizes.is_empty() || sizes.contains(&0) {
        return Err(PlanError::EmptyBatch {
            replica,
            sizes: sizes.to_vec(),
        });
    }
    let stages = pipeline.stages.num_stages();
    if pipeline.ranks.len() != stages {
        return Err(PlanError::PerStage {
            replica,
            what: "ranks",
            given: pipeline.ranks.len(),
            stages,
        });
    }
    let per_stage = [
        ("tp_shares", pipeline.tp_shares.len()),
        ("cp", pipeline.cp.len()),
        ("cp_shares", pipeline.cp_shares.len()),
    ];
    check_per_stage(replica, stages, &per_stage)?;
    for (stage, ranks) in pipeline.ranks.iter().enumerate() {
        check_cp_group(replica, pipeline, stage)?;
        let shares = pipeline.tp_shares.get(stage).and_then(Option::as_ref);
        let size = ranks.len() / pipeline.cp_size(stage);
        let bad_shares = shares.is_some_and(|s| s.len() != size || s.contains(&0));
        if ranks.is_empty() || bad_shares {
            return Err(PlanError::TpShares {
                replica,
                stage,
                shares: shares.cloned().unwrap_or_default(),
                size,
            });
        }
    }
    let ranks = pipeline.all_ranks().count();
    check_per_rank(replica, ranks, &[("placements", pipeline.placements.len())])?;
    check_stage_precisions(replica, pipeline)
}

/// Every rank of a stage computes in one precision (its tensor- and context-parallel
/// collectives carry activations in it).
fn check_stage_precisions(replica: usize, pipeline: &ReplicaPipeline) -> Result<(), PlanError> {
    let mut placements = pipeline.placements.iter();
    for (stage, ranks) in pipeline.ranks.iter().enumerate() {
        let precisions: Vec<Option<crate::Precision>> = placements
            .by_ref()
            .take(ranks.len())
            .map(|p| p.precision)
            .collect();
        if let Some(other) = precisions.iter().find(|&&p| p != precisions[0]) {
            let name = |p: Option<crate::Precision>| p.map_or("the job's", |p| p.name());
            return Err(PlanError::StagePrecision {
                replica,
                stage,
                precisions: [name(precisions[0]), name(*other)],
            });
        }
    }
    Ok(())
}

/// `stage`'s context-parallel size divides its ranks, with one positive share per member.
fn check_cp_group(
    replica: usize,
    pipeline: &ReplicaPipeline,
    stage: usize,
) -> Result<(), PlanError> {
    let cp = pipeline.cp.get(stage).copied().unwrap_or(1);
    let ranks = pipeline.ranks[stage].len();
    let shares = pipeline.cp_shares.get(stage).and_then(Option::as_ref);
    let bad_shares = shares.is_some_and(|s| s.len() != cp || s.contains(&0));
    if cp == 0 || ranks % cp != 0 || bad_shares {
        return Err(PlanError::CpGroup {
            replica,
            stage,
            cp,
            shares: shares.cloned().unwrap_or_default(),
            ranks,
        });
    }
    Ok(())
}

/// Each list of `given` (name, length) is empty or one per rank of the replica.
pub(super) fn check_per_rank(
    replica: usize,
    ranks: usize,
    given: &[(&'static str, usize)],
) -> Result<(), PlanError> {
    match given.iter().find(|&&(_, n)| n != 0 && n != ranks) {
        Some(&(what, given)) => Err(PlanError::PerRank {
            replica,
            what,
            given,
            ranks,
        }),
        None => Ok(()),
    }
}

/// Stage `stage`'s program (peers are stage indices) for its rank at `index` of
/// `shapes[stage]`'s ranks, peers mapped to global ranks. A rank takes what it receives
/// from the member of the same context-parallel index (modulo the sending stage's size)
/// and tensor-parallel index modulo the sending group's size: without sequence
/// parallelism every rank of a group holds the whole activation of its positions, and a
/// stage of another context-parallel layout receives them whole (gathered). So a sender
/// sends to every receiver it serves.
fn tp_program(
    program: &[Instruction],
    shapes: &[StageRanks],
    stage: usize,
    index: usize,
) -> Vec<Instruction> {
    let me = &shapes[stage];
    program
        .iter()
        .flat_map(|&instruction| -> Vec<Instruction> {
            match instruction {
                Instruction::Send(m) => (shapes[m.peer].ranks.iter().enumerate())
                    .filter(|&(j, _)| me.feeder(j, &shapes[m.peer]) == index)
                    .map(|(_, &peer)| Instruction::Send(crate::Message { peer, ..m }))
                    .collect(),
                Instruction::Recv(m) => {
                    let senders = &shapes[m.peer];
                    let peer = senders.ranks[senders.feeder(index, me)];
                    vec![Instruction::Recv(crate::Message { peer, ..m })]
                }
                compute => vec![compute],
            }
        })
        .collect()
}

/// A stage's ranks and the shape of its groups, for the pipeline's links.
#[derive(Debug, Clone)]
struct StageRanks {
    /// Its ranks, context-parallel member by member.
    ranks: Vec<usize>,
    /// Its tensor-parallel size.
    tp: usize,
}

impl StageRanks {
    /// The index among `self`'s ranks of the rank that feeds `receiver`'s rank at
    /// `index` (in both directions of the pipeline: a stage takes an activation, or a
    /// gradient, from the rank of its context-parallel and tensor-parallel index, each
    /// modulo this stage's sizes).
    fn feeder(&self, index: usize, receiver: &StageRanks) -> usize {
        let (cp, tp) = (index / receiver.tp, index % receiver.tp);
        let members = self.ranks.len() / self.tp;
        (cp % members) * self.tp + tp % self.tp
    }
}

/// Each list of `given` (name, length) is empty or one per stage.
pub(super) fn check_per_stage(
    replica: usize,
    stages: usize,
    given: &[(&'static str, usize)],
) -> Result<(), PlanError> {
    for &(what, given) in given {
        if given != 0 && given != stages {
            return Err(PlanError::PerStage {
                replica,
                what,
                given,
                stages,
            });
        }
    }
    Ok(())
}

/// A rank's weight in the distributed optimizer's shares: its device memory in tenths of
/// a GB (at least 1), as the plan file gives it; the planner prices by the same weight.
pub fn memory_share_weight(memory_gb: f64) -> u32 {
    ((memory_gb * 10.0).round() as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GridPlan, PlanFlags, ScheduleKind, TP_PP_DP_ORDER};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    const ASYMMETRIC: &str = r#"
[[replica]]
layers = [6]
micro_batch_size = 2
num_micro_batches = 1

[[replica]]
layers = [4, 2]
micro_batch_size = 1
num_micro_batches = 2
devices = ["cpu", "cpu"]
speeds = [1.0, 0.5]
"#;

    #[test]
    fn the_file_form_numbers_ranks_replica_by_replica() {
        let plan = Plan::from_toml(ASYMMETRIC, Some(4)).unwrap();
        assert_eq!(plan.world_size(), 3);
        assert_eq!(plan.position(0), Some((0, 0)));
        assert_eq!(plan.position(2), Some((1, 1)));
        assert_eq!(plan.global_batch_size(), 4);
        assert_eq!(plan.replicas()[1].placements[1].speed, Some(0.5));
        assert_eq!(
            Plan::from_toml(ASYMMETRIC, Some(5)),
            Err(PlanError::GlobalBatch {
                expected: 5,
                actual: 4
            })
        );
        // Segments: embedding + layers 0..4 on ranks (0, 1); layers 4..6 + head on (0, 2).
        let segments = plan.segments();
        assert_eq!(
            segments,
            [
                GradientSegment {
                    stages: vec![0, 0],
                    pieces: 0..5,
                    holders: vec![vec![0], vec![1]],
                    shares: vec![vec![1], vec![1]],
                },
                GradientSegment {
                    stages: vec![0, 1],
                    pieces: 5..8,
                    holders: vec![vec![0], vec![2]],
                    shares: vec![vec![1], vec![1]],
                },
            ]
        );
    }

    #[test]
    fn bad_files_name_the_replica() {
        let uneven = ASYMMETRIC.replace("layers = [4, 2]", "layers = [4, 3]");
        assert_eq!(
            Plan::from_toml(&uneven, None),
            Err(PlanError::ReplicaLayers {
                replica: 1,
                layers: 7,
                first: 6
            })
        );
        // Chunks on a single stage, and a speed above the device's own.
        let chunks = ASYMMETRIC.replace("layers = [6]", "layers = [[3], [3]]");
        assert_eq!(
            Plan::from_toml(&chunks, None),
            Err(PlanError::ChunksWithoutPipeline { replica: 0 })
        );
        let fast = ASYMMETRIC.replace("speeds = [1.0, 0.5]", "speeds = [1.5, 0.5]");
        assert_eq!(
            Plan::from_toml(&fast, None),
            Err(PlanError::Speed {
                replica: 1,
                speed: 1.5
            })
        );
        let empty = ASYMMETRIC.replace("num_micro_batches = 2", "num_micro_batches = 0");
        assert!(matches!(
            Plan::from_toml(&empty, None),
            Err(PlanError::BatchForm {
                replica: 1,
                source: crate::BatchFormError::Zero {
                    field: "num_micro_batches"
                }
            })
        ));
        let empty_micro_batch = ASYMMETRIC.replace(
            "micro_batch_size = 1\nnum_micro_batches = 2",
            "micro_batch_sizes = [1, 0]",
        );
        assert!(matches!(
            Plan::from_toml(&empty_micro_batch, None),
            Err(PlanError::EmptyBatch { replica: 1, .. })
        ));
        let devices = ASYMMETRIC.replace(r#"devices = ["cpu", "cpu"]"#, r#"devices = ["cpu"]"#);
        assert!(matches!(
            Plan::from_toml(&devices, None),
            Err(PlanError::PerRank {
                replica: 1,
                what: "devices",
                given: 1,
                ranks: 2
            })
        ));
        assert!(matches!(
            Plan::from_toml("replica = []", None),
            Err(PlanError::NoReplicas)
        ));
    }

    /// `--pipeline-model-parallel-size 2 --num-layers 4 --micro-batch-size 1`.
    fn two_stages() -> PlanFlags {
        PlanFlags {
            pipeline_model_parallel_size: 2,
            num_layers: Some(4),
            micro_batch_size: Some(1),
            ..PlanFlags::default()
        }
    }

    /// The grid of `flags` on `world` ranks in general form: every rank keeps its grid
    /// coordinates, and the plan converts back to the same grid.
    fn grid_round_trip(flags: &PlanFlags, world: usize) -> Plan {
        let grid = GridPlan::from_flags(flags, world).unwrap();
        let plan = Plan::from_grid(&grid).unwrap();
        let topology = grid.topology().unwrap();
        for rank in 0..world {
            let c = topology.coordinates(rank).unwrap();
            assert_eq!(plan.position(rank), Some((c.dp, c.pp)));
            assert_eq!(plan.tp_rank(rank), Some(c.tp));
            assert_eq!(plan.cp_rank(rank), Some(c.cp));
        }
        assert_eq!(plan.to_grid(), Some(grid));
        plan
    }

    /// SynerFuse's flags for three stages of 6, 3, 3 layers under tensor parallelism 2,
    /// three replicas with micro-batches of their own size and count: every rank runs,
    /// every pipeline in order, 1F1B holding at most its depth in flight.
    #[test]
    fn hetero_plan_with_different_counts_runs() {
        let flags = PlanFlags {
            tensor_model_parallel_size: 2,
            pipeline_model_parallel_size: 3,
            use_tp_pp_dp_mapping: true,
            num_layers: Some(12),
            hetero_pipeline_stages: Some(vec![1, 6, 2, 3, 3]),
            global_batch_size: Some(22),
            micro_batch_size_per_dp: Some(vec![1, 4, 1, 2, 1, 1]),
            num_micro_batches_per_dp: Some(vec![1, 3, 1, 4, 1, 2]),
            ..PlanFlags::default()
        };
        let plan = Plan::from_flags(&flags, 18).unwrap();
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            let programs = plan.schedule(kind).unwrap();
            let report = crate::check_schedule(&programs).unwrap();
            for replica in plan.replicas() {
                let m = replica.batch.num_micro_batches();
                for tp in 0..2 {
                    let pipeline: Vec<usize> = replica.ranks.iter().map(|s| s[tp]).collect();
                    report.check_pipeline_order(&pipeline, 1, m).unwrap();
                }
            }
            for (rank, peak) in report.peak_in_flight.iter().enumerate() {
                let (replica, stage) = plan.position(rank).unwrap();
                let m = plan.replicas()[replica].batch.num_micro_batches();
                let expected = match kind {
                    ScheduleKind::Gpipe => m,
                    _ => (3 - stage).min(m),
                };
                assert_eq!(*peak, expected, "rank {rank}");
            }
        }
    }

    /// Megatron's `--context-parallel-size`: each stage's ranks are its context-parallel
    /// members' tensor-parallel groups (tp fastest, then cp); activations pass between
    /// members of the same index; gradients reduce over data × context parallel ranks.
    #[test]
    fn a_context_parallel_grid_keeps_megatrons_ranks() {
        let flags = PlanFlags {
            tensor_model_parallel_size: 2,
            context_parallel_size: 2,
            ..two_stages()
        };
        let plan = grid_round_trip(&flags, 16);
        let r = &plan.replicas()[0];
        assert_eq!(r.ranks[0], [0, 1, 2, 3]);
        assert_eq!(
            (r.tp_group(0, 1), r.cp_group(0, 1)),
            (&[2, 3][..], vec![1, 3])
        );
        assert!(plan.has_context_parallelism());
        // Stage 0's member (cp 1, tp 0) = rank 2 sends to stage 1's (cp 1, tp 0).
        let programs = plan.schedule(ScheduleKind::OneFOneB).unwrap();
        let peers = |rank: usize| -> BTreeSet<usize> {
            (programs[rank].iter())
                .filter_map(|i| match i {
                    Instruction::Send(m) | Instruction::Recv(m) => Some(m.peer),
                    _ => None,
                })
                .collect()
        };
        let stage_1 = &r.ranks[1];
        assert_eq!(peers(2), BTreeSet::from([stage_1[2]]));
        assert_eq!(peers(stage_1[2]), BTreeSet::from([2]));
        // Each reduction over one tensor-parallel index of both replicas' both members.
        let reductions = plan.gradient_reductions(false);
        let members: BTreeSet<usize> = r.cp_group(0, 0).into_iter().collect();
        assert!(reductions.iter().all(|g| g.members.len() == 4));
        assert!(reductions
            .iter()
            .any(|g| members.iter().all(|m| g.members.contains(m))));
    }

    #[test]
    fn context_parallel_files_round_trip_and_bad_groups_are_named() {
        let text = "[[replica]]\nlayers = [3, 1]\ntp = [2, 1]\ncp = [2, 2]\ncp_shares = [[3, 1], [1, 1]]\nmicro_batch_size = 1\nnum_micro_batches = 2\n";
        let plan = Plan::from_toml(text, None).unwrap();
        assert_eq!(plan.world_size(), 6);
        let r = &plan.replicas()[0];
        assert_eq!((r.cp_size(0), r.tp_size(0), r.tp_size(1)), (2, 2, 1));
        assert_eq!(r.context_shares(0), Some(vec![3, 1]));
        assert_eq!(r.context_shares(1), Some(vec![1, 1]));
        assert!(!r.same_context_layout(0, 1));
        assert_eq!(
            Plan::from_toml(&plan.to_toml().unwrap(), None),
            Ok(plan.clone())
        );
        let model = crate::ModelShape {
            num_layers: 4,
            hidden_size: 32,
            num_heads: 4,
            num_kv_heads: 2,
            ffn_hidden_size: 64,
            vocab_size: 128,
            seq_length: 30,
            tied: true,
            experts: None,
        };
        // 30 tokens deal out 15 pairs 3 : 1 and 1 : 1, but do not cut into 4 even chunks.
        assert_eq!(plan.check(&model, false), Ok(()));
        let even = Plan::from_toml(&text.replace("cp_shares = [[3, 1], [1, 1]]\n", ""), None);
        assert!(matches!(
            even.unwrap().check(&model, false),
            Err(PlanError::ContextSplit {
                replica: 0,
                stage: 0,
                ..
            })
        ));
        let three = text.replace("cp = [2, 2]", "cp = [3, 2]");
        assert!(matches!(
            Plan::from_toml(&three, None),
            Err(PlanError::CpGroup {
                replica: 0,
                stage: 0,
                ..
            })
        ));
        let shares = text.replace("[[3, 1], [1, 1]]", "[[3, 1, 1], [1, 1]]");
        assert!(matches!(
            Plan::from_toml(&shares, None),
            Err(PlanError::CpGroup { stage: 0, .. })
        ));
    }

    #[test]
    fn a_grid_keeps_its_ranks() {
        let flags = two_stages();
        let plan = grid_round_trip(&flags, 4);
        // A grid's segments are its stages, held by the same stage of every replica.
        assert_eq!(plan.segments().len(), 2);
        // With tensor parallelism too.
        let tp = PlanFlags {
            tensor_model_parallel_size: 2,
            ..flags
        };
        let plan = grid_round_trip(&tp, 8);
        assert!(plan.has_tensor_parallelism());
    }

    #[test]
    fn a_file_of_equal_replicas_is_a_tp_pp_dp_grid() {
        let text =
            "[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 2\n".repeat(2);
        let grid = Plan::from_toml(&text, None).unwrap().to_grid().unwrap();
        assert_eq!(grid.topology.order, TP_PP_DP_ORDER);
        assert_eq!(grid.stages.layers(), [2, 2]);
        assert_eq!(grid.batches.global_batch_size(), 4);
        // Replicas of different shapes are no grid.
        assert_eq!(Plan::from_toml(ASYMMETRIC, None).unwrap().to_grid(), None);
    }

    #[test]
    fn the_file_form_round_trips_interleaving_ranks_and_kinds() {
        let text = r#"
[[replica]]
layers = [[1, 1], [1, 1]]
micro_batch_size = 1
num_micro_batches = 4
ranks = [2, 0]
devices = ["cpu", "cuda:1"]
kinds = ["cpu", "a100-80g"]

[[replica]]
layers = [4]
micro_batch_size = 2
num_micro_batches = 1
ranks = [1]
devices = ["cpu"]
kinds = ["cpu"]
"#;
        let plan = Plan::from_toml(text, Some(6)).unwrap();
        assert_eq!(plan.replicas()[0].stages.num_chunks(), 2);
        assert_eq!(plan.position(0), Some((0, 1)));
        assert_eq!(plan.placement(0).unwrap().kind.as_deref(), Some("a100-80g"));
        let written = plan.to_toml().unwrap();
        assert_eq!(Plan::from_toml(&written, None).unwrap(), plan);
        // JSON too (checkpoints), and the grid form older checkpoints stored.
        let json = serde_json::to_string(&plan).unwrap();
        assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
        let grid = GridPlan::from_flags(&two_stages(), 4).unwrap();
        let stored = serde_json::to_string(&grid).unwrap();
        let general: Plan = serde_json::from_str(&stored).unwrap();
        assert_eq!(general.to_grid(), Some(grid.clone()));
        // A grid plan file reads as the same plan, in TOML or JSON.
        assert_eq!(Plan::from_json(&stored).unwrap(), general);
        let (grid_toml, samples) = (grid.to_toml().unwrap(), general.global_batch_size());
        assert_eq!(Plan::from_toml(&grid_toml, Some(samples)).unwrap(), general);
        assert!(matches!(
            Plan::from_toml(&grid_toml, Some(samples + 1)),
            Err(PlanError::GlobalBatch { .. })
        ));
        // A replica mixing an emulated and a real device keeps both as they are.
        let mut mixed = plan.replicas().to_vec();
        mixed[0].placements[1].speed = Some(0.5);
        mixed[0].placements[0].kind = None;
        let mixed = Plan::new(mixed).unwrap();
        let written = mixed.to_toml().unwrap();
        assert!(written.contains("emulated = [false, true]"), "{written}");
        assert_eq!(Plan::from_toml(&written, None).unwrap(), mixed);
        // `ranks` on some replicas only is refused by name.
        let partial = text.replace("ranks = [1]\n", "");
        assert_eq!(
            Plan::from_toml(&partial, None),
            Err(PlanError::PartialRanks { replica: 1 })
        );
    }

    #[test]
    fn each_replica_runs_its_own_schedule_and_reductions_follow_the_holders() {
        let plan = Plan::from_toml(ASYMMETRIC, None).unwrap();
        let programs = plan.schedule(ScheduleKind::Interleaved).unwrap();
        assert_eq!(programs.len(), 3);
        crate::check_schedule(&programs).unwrap();
        // Replica 1's stages talk to each other only.
        assert!(programs[0]
            .iter()
            .all(|i| !matches!(i, Instruction::Send(_))));
        assert!(programs[1]
            .iter()
            .any(|i| matches!(i, Instruction::Send(m) if m.peer == 2)));
        let reductions = plan.gradient_reductions(true);
        assert_eq!(
            reductions,
            [
                GradientReduction {
                    parameters: ReducedParameters::Pieces(5..8),
                    members: vec![0, 2],
                    whole: false,
                },
                GradientReduction {
                    parameters: ReducedParameters::Pieces(0..5),
                    members: vec![0, 1],
                    whole: false,
                },
                GradientReduction {
                    parameters: ReducedParameters::TiedEmbedding,
                    members: vec![0, 1, 2],
                    whole: false,
                },
            ]
        );
        assert_eq!(plan.chunk_pieces(2), vec![(5..8)]);
        let described: Vec<String> = reductions.iter().map(|r| r.describe(6, true)).collect();
        assert_eq!(
            described,
            [
                "layers 4..6, final norm over ranks [0, 2]",
                "layers 0..4 over ranks [0, 1]",
                "the tied embedding and output layer over ranks [0, 1, 2]",
            ]
        );
        let untied = plan.gradient_reductions(false);
        assert_eq!(
            untied[1].describe(6, false),
            "embedding, layers 0..4 over ranks [0, 1]"
        );
        assert_eq!(
            untied[0].describe(6, false),
            "layers 4..6, final norm and output layer over ranks [0, 2]"
        );
        assert_eq!(plan.chunk_pieces(0), vec![(0..8)]);
    }

    #[test]
    fn each_stage_has_a_precision_of_its_own() {
        use crate::Precision::{Bf16, Fp16};
        let text = "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 2\nprecision = [\"bf16\"]\n\n\
                    [[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 2\nprecision = [\"fp16\", \"bf16\"]\n";
        let plan = Plan::from_toml(text, None).unwrap();
        let precisions: Vec<_> = (0..3).map(|r| plan.precision_of(r)).collect();
        assert_eq!(precisions, [Some(Bf16), Some(Fp16), Some(Bf16)]);
        assert_eq!(plan.placement(1).unwrap().device, None);
        let written = plan.to_toml().unwrap();
        assert!(
            written.contains("precision = [\"fp16\", \"bf16\"]"),
            "{written}"
        );
        assert_eq!(Plan::from_toml(&written, None).unwrap(), plan);
        // A stage's tensor-parallel ranks compute alike.
        let mixed = "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 1\ntp = [2]\nprecision = [\"fp16\", \"bf16\"]\n";
        let err = Plan::from_toml(mixed, None).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::StagePrecision {
                    replica: 0,
                    stage: 0,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("fp16 and bf16"), "{err}");
        // A precision that is none of the three is named.
        let unknown = text.replace("\"fp16\"", "\"fp8\"");
        let err = Plan::from_toml(&unknown, None).unwrap_err().to_string();
        assert!(err.contains("fp8") && err.contains("precision"), "{err}");
        // One per rank.
        let short = text.replace("[\"fp16\", \"bf16\"]", "[\"fp16\"]");
        let err = Plan::from_toml(&short, None).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::PerRank {
                    what: "precision",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn memory_sizes_the_distributed_optimizer_shares() {
        let text = "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 1\nmemory_gb = [80]\n\n\
                    [[replica]]\nlayers = [1, 3]\nmicro_batch_size = 1\nnum_micro_batches = 1\nmemory_gb = [16, 24.5]\n";
        let plan = Plan::from_toml(text, None).unwrap();
        assert_eq!(plan.memory_shares(&[0, 1, 2]), [800, 160, 245]);
        // Memory alone names no device: the job's --device stays in force.
        assert_eq!(plan.placement(1).unwrap().device, None);
        assert!(!plan.to_toml().unwrap().contains("devices"));
        assert_eq!(
            Plan::from_toml(&plan.to_toml().unwrap(), None).unwrap(),
            plan
        );
        let equal = Plan::from_toml(ASYMMETRIC, None).unwrap();
        assert_eq!(equal.memory_shares(&[0, 1]), [1, 1]);
        let bad = text.replace("memory_gb = [80]", "memory_gb = [0]");
        assert!(matches!(
            Plan::from_toml(&bad, None),
            Err(PlanError::Memory { replica: 0, .. })
        ));
    }

    const TENSOR_PARALLEL: &str = r#"
[[replica]]
layers = [2, 4]
tp = [2, 1]
tp_shares = [[3, 1], [1]]
micro_batch_size = 2
num_micro_batches = 2

[[replica]]
layers = [2, 4]
tp = [2, 1]
tp_shares = [[3, 1], [1]]
micro_batch_size = 1
num_micro_batches = 2
"#;

    #[test]
    fn stages_run_on_tensor_parallel_groups_of_their_own() {
        let plan = Plan::from_toml(TENSOR_PARALLEL, Some(6)).unwrap();
        assert_eq!(plan.world_size(), 6);
        assert!(plan.has_tensor_parallelism());
        assert_eq!(plan.replicas()[1].ranks, [vec![3, 4], vec![5]]);
        assert_eq!((plan.position(4), plan.tp_rank(4)), (Some((1, 0)), Some(1)));
        assert_eq!(plan.replicas()[0].shares(0), [3, 1]);
        assert_eq!(
            Plan::from_toml(&plan.to_toml().unwrap(), None).unwrap(),
            plan
        );
        // Stage 1 (one rank) takes its input from TP rank 0 of stage 0 and sends its
        // gradient to both; the schedule still runs to the end.
        let programs = plan.schedule(ScheduleKind::OneFOneB).unwrap();
        crate::check_schedule(&programs).unwrap();
        let forward: Vec<_> = programs.iter().map(|p| crate::forward_only(p)).collect();
        crate::check_forward_only(&forward).unwrap();
        let sends = |rank: usize| -> Vec<usize> {
            programs[rank]
                .iter()
                .filter_map(|i| match i {
                    Instruction::Send(m) => Some(m.peer),
                    _ => None,
                })
                .collect()
        };
        assert!(sends(0).iter().all(|&p| p == 2) && !sends(0).is_empty());
        assert!(sends(1).is_empty());
        assert!(sends(2).contains(&0) && sends(2).contains(&1));
        // Each shard index is reduced over the replicas' ranks of that index.
        let reductions = plan.gradient_reductions(false);
        let members = |reductions: &[GradientReduction]| -> Vec<(Vec<usize>, bool)> {
            reductions
                .iter()
                .map(|r| (r.members.clone(), r.whole))
                .collect()
        };
        assert_eq!(
            members(&reductions),
            [
                (vec![2, 5], false),
                (vec![0, 3], false),
                (vec![1, 4], false)
            ]
        );
        // A tied embedding split 3 : 1 on the first stage but whole on the last is
        // summed whole over every holder.
        let tied = plan.gradient_reductions(true);
        assert_eq!(members(&tied[3..]), [((0..6).collect(), true)]);
        assert!(tied[3]
            .describe(6, true)
            .ends_with("(whole tensors: the holders split them differently)"));
        // So are the shards of a segment split differently in two replicas.
        let mixed = TENSOR_PARALLEL.replacen("tp = [2, 1]\ntp_shares = [[3, 1], [1]]\n", "", 1);
        let mixed = Plan::from_toml(&mixed, None).unwrap();
        assert_eq!(
            members(&mixed.gradient_reductions(false)),
            [(vec![1, 4], false), (vec![0, 2, 3], true)]
        );
        // Shares that are not one positive share per rank are refused.
        let bad = TENSOR_PARALLEL.replacen("[[3, 1], [1]]", "[[3, 0], [1]]", 1);
        assert!(matches!(
            Plan::from_toml(&bad, None),
            Err(PlanError::TpShares {
                replica: 0,
                stage: 0,
                ..
            })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Random asymmetric plans: the segments partition the model, each is held by
        /// exactly one rank per replica, and that rank's stage holds the whole segment.
        #[test]
        fn segments_partition_the_model_and_are_held_once_per_replica(
            layers in 1usize..12,
            cuts in prop::collection::vec(prop::collection::vec(any::<prop::sample::Index>(), 0..4), 1..4),
        ) {
            let replicas: Vec<ReplicaPipeline> = {
                let mut next = 0;
                cuts.iter().map(|c| {
                    let mut points: Vec<usize> = c.iter().map(|i| 1 + i.index(layers)).filter(|&p| p < layers).collect();
                    points.sort_unstable();
                    points.dedup();
                    let bounds: Vec<usize> = std::iter::once(0).chain(points).chain(std::iter::once(layers)).collect();
                    let per_stage: Vec<usize> = bounds.windows(2).map(|w| w[1] - w[0]).collect();
                    let stages = per_stage.len();
                    let replica = ReplicaPipeline::single_ranks(
                        StageLayout::new(per_stage, layers).unwrap(),
                        ReplicaBatch::uniform(1, 1),
                        (next..next + stages).collect(),
                        Vec::new(),
                    );
                    next += stages;
                    replica
                }).collect()
            };
            let plan = Plan::new(replicas).unwrap();
            let segments = plan.segments();
            prop_assert_eq!(segments.first().map(|s| s.pieces.start), Some(0));
            prop_assert_eq!(segments.last().map(|s| s.pieces.end), Some(layers + 2));
            for w in segments.windows(2) {
                prop_assert_eq!(w[0].pieces.end, w[1].pieces.start);
            }
            for segment in &segments {
                prop_assert_eq!(segment.holders.len(), plan.replicas().len());
                for (r, holders) in segment.holders.iter().enumerate() {
                    prop_assert_eq!(holders.len(), 1);
                    let rank = holders[0];
                    let (replica, stage) = plan.position(rank).unwrap();
                    prop_assert_eq!(replica, r);
                    let held = reduce::chunk_pieces(&plan.replicas()[r].stages)
                        .into_iter()
                        .any(|(s, range)| s == stage && range.start <= segment.pieces.start && segment.pieces.end <= range.end);
                    prop_assert!(held, "segment {:?} not within rank {}'s stage", segment.pieces, rank);
                }
            }
        }
    }
}
