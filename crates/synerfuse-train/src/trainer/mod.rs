//! The training loop of one rank: its stage chunks, its replica's micro-batches, the
//! pipeline step, the gradient reductions, AdamW, metrics and checkpoints.
//!
//! Every plan is a general plan: each replica its own pipeline (a grid is the case where
//! they are all alike). Gradients are exact for the global batch whatever the plan: the
//! last stage divides each replica's summed token losses by the global number of loss
//! tokens of the step, so each gradient segment's reduction over its holders is a plain
//! sum (ARCHITECTURE.md, "How a training step runs").

use crate::checkpoint::{self, Checkpoint};
use crate::comm::{GroupCommunicator, MpiCommunicator, PipelineLinks, SetGroups};
use crate::emulation::Emulation;
use crate::grads::{MainGrads, EMBEDDING};
use crate::loader::{LoaderError, Prefetcher, ReplicaLoader, SplitDatasets};
use crate::memory::{HighWater, MemoryProbe, MemoryReport};
use crate::optim::{clip_factor, AdamW};
use crate::pipeline::{ContextRank, ExpertRank, PipelineEvent, PipelineRank, StepTimes};
use crate::replan::SpeedWatch;
use crate::zero::DistributedOptimizer;
use crate::{signals, TrainError};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;
use synerfuse_data::gpt::SampleOptions;
use synerfuse_model::tch::{Device, Kind, Tensor};
use synerfuse_model::{DeviceRequest, ResolveDevice, Stage};
use synerfuse_plan::timeline::{Span, SpanKind};
use synerfuse_plan::{ExpertGroupPlan, GradientReduction, Instruction, PlanError, ReplicaPipeline};

mod config;
mod eval;
mod evaluation;
mod exchange;
mod report;
mod save;
mod switch;

pub use config::{
    BatchConfig, CheckpointConfig, ComputeConfig, DataConfig, EvalConfig, LoggingConfig,
    OptimizerConfig, ParallelConfig, ReplanConfig, TrainConfig,
};
pub use evaluation::{EvalSplit, Evaluation};
use report::{StepLog, StepOutcome, StepResult};

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    /// Iteration reached.
    pub iteration: u64,
    /// Losses of the iterations this process ran.
    pub losses: Vec<f64>,
    /// The run stopped early on SIGTERM.
    pub stopped_by_signal: bool,
    /// Checkpoint directories written.
    pub saved: Vec<PathBuf>,
    /// Evaluations run, in order.
    pub evaluations: Vec<Evaluation>,
}

/// The device of this rank: the plan's placement, else the configured device;
/// `cuda`/`auto` without an index pick GPU `local_rank mod count`.
fn rank_device(config: &TrainConfig, rank: usize, local_rank: usize) -> Result<Device, TrainError> {
    let placement = config.parallel.plan.placement(rank);
    placement
        .and_then(|p| p.device)
        .unwrap_or(config.compute.device)
        .resolve_for_local_rank(local_rank)
        .map_err(|source| TrainError::Device { rank, source })
}

/// Rank `r`'s emulated speed: the configured list, else the plan's placement.
fn emulated_speed(config: &TrainConfig, rank: usize) -> Option<f64> {
    match &config.compute.emulate_speed {
        Some(speeds) => speeds.get(rank).copied(),
        None => config.parallel.plan.placement(rank).and_then(|p| p.speed),
    }
}

/// Warns when the CPU ranks' emulated speeds add up to more cores than this machine has:
/// emulation charges CPU time, so it stays faithful only while every emulated device can
/// get its share of a core.
fn warn_if_emulation_oversubscribes(config: &TrainConfig, world_size: usize) {
    let (_, local_size) = crate::comm::launcher_local_rank();
    if local_size != world_size {
        return; // several nodes: each node's share is not known here
    }
    let on_cpu = |r: usize| {
        let placed = config.parallel.plan.placement(r).and_then(|p| p.device);
        placed.unwrap_or(config.compute.device) == DeviceRequest::Cpu
    };
    let cpu_speed: f64 = (0..world_size)
        .filter(|&r| on_cpu(r))
        .filter_map(|r| emulated_speed(config, r))
        .sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    if cpu_speed > cores {
        tracing::warn!(
            "device emulation: the CPU ranks' speeds add up to {cpu_speed:.2} cores but this machine has {cores}; emulated devices will run slower than stated"
        );
    }
}

/// Test hook: `SYNERFUSE_FAULT_INJECT=exit:RANK:ITERATION` makes that rank exit in the
/// middle of that iteration (after its pipeline work, before the reductions), the way a
/// crashed process would; used by the fault tests.
fn injected_fault(rank: usize, iteration: u64) -> bool {
    let Ok(spec) = std::env::var("SYNERFUSE_FAULT_INJECT") else {
        return false;
    };
    let parts: Vec<&str> = spec.split(':').collect();
    matches!(parts.as_slice(), ["exit", r, i] if r.parse() == Ok(rank) && i.parse() == Ok(iteration))
}

/// Checks the plan against the job and the model before anything is built; returns
/// `rank`'s (replica, stage).
fn check_plan(
    config: &TrainConfig,
    world_size: usize,
    rank: usize,
) -> Result<(usize, usize), TrainError> {
    let plan = &config.parallel.plan;
    if plan.world_size() != world_size {
        return Err(TrainError::WorldSize {
            plan: plan.world_size(),
            job: world_size,
        });
    }
    let shape = crate::profiler::model_shape(&config.model, config.batch.sequence_length);
    plan.check(&shape, config.parallel.sequence_parallel)?;
    if let Some(c) = (config.compute.speed_changes.iter()).find(|c| c.rank >= world_size) {
        return Err(TrainError::SpeedChangeRank {
            iteration: c.iteration,
            rank: c.rank,
            speed: c.speed,
            last: world_size - 1,
        });
    }
    if let Some(speeds) = &config.compute.emulate_speed {
        if speeds.len() != world_size {
            return Err(TrainError::EmulatedSpeedCount {
                given: speeds.len(),
                ranks: world_size,
            });
        }
    }
    Ok(plan
        .position(rank)
        .expect("a plan of the job's size places every rank"))
}

/// This rank's emulated device, if any, announced in the log.
fn rank_emulation(
    config: &TrainConfig,
    rank: usize,
    device: Device,
) -> Result<Option<Emulation>, TrainError> {
    let Some(speed) = emulated_speed(config, rank) else {
        return Ok(None);
    };
    if !(speed > 0.0 && speed <= 1.0) {
        return Err(TrainError::EmulatedSpeed { rank, speed });
    }
    let clock = if device == Device::Cpu {
        "CPU time of one core"
    } else {
        "its synchronised compute time"
    };
    tracing::info!(
        "device emulation: this rank runs at {speed:.3}x of {clock} on {device:?}; each forward and backward lasts its cost / {speed:.3} (a test and benchmark device, not real hardware)"
    );
    Ok(Some(Emulation { speed, device }))
}

/// This rank's stage chunks, initialised by parameter name (as one model would be), or
/// from `--finetune-from-hf`.
fn build_chunks(
    config: &TrainConfig,
    (replica, stage_index): (usize, usize),
    (tp_rank, experts): (usize, Option<Vec<usize>>),
    device: Device,
) -> Result<Vec<Stage>, TrainError> {
    let plan = &config.parallel.plan;
    let stages = &plan.replicas()[replica].stages;
    let shape = crate::profiler::model_shape(&config.model, config.batch.sequence_length);
    let mut shard = (plan.tp_layout(&shape, replica, stage_index)?)
        .shard(tp_rank)
        .expect("a rank's tensor-parallel index is within its group");
    shard.experts = experts;
    let mut chunks = Vec::with_capacity(stages.num_chunks());
    for chunk in 0..stages.num_chunks() {
        let layers = stages
            .chunk_range(stage_index, chunk)
            .expect("stage and chunk within the layout (Plan::check)");
        let mut stage = Stage::new_sharded(&config.model, layers, shard.clone(), device)?;
        stage.init_by_name(config.batch.seed);
        // The run's --recompute-activations, or the plan's for this stage.
        let replica_plan = &config.parallel.plan.replicas()[replica];
        stage.set_recompute(config.compute.recompute || replica_plan.recomputes(stage_index));
        stage.set_sequence_parallel(config.parallel.sequence_parallel);
        let (input, output) = neighbours_of_equal_tp(config, (replica, stage_index), chunk);
        stage.set_sequence_rows_io(input, output);
        if let Some(dir) = &config.checkpoint.finetune_from_hf {
            synerfuse_model::hf::load_weights(&mut stage, dir)?;
        }
        chunks.push(stage);
    }
    Ok(chunks)
}

/// Whether the stage chunk that feeds `chunk` of `replica`'s `stage`, and the one it
/// feeds, run on tensor-parallel groups of the stage's own size and split sequences alike:
/// under sequence parallelism what the stage sends them then stays each rank's sequence
/// rows (as in Megatron); otherwise it is gathered whole and cut into each receiver's rows.
fn neighbours_of_equal_tp(
    config: &TrainConfig,
    (replica, stage): (usize, usize),
    chunk: usize,
) -> (bool, bool) {
    let r = &config.parallel.plan.replicas()[replica];
    let equal = |s: Option<usize>| {
        s.is_some_and(|s| r.tp_size(s) == r.tp_size(stage) && r.same_context_layout(s, stage))
    };
    let (previous, next) = neighbour_stages(r, stage, chunk);
    (equal(previous), equal(next))
}

/// The stages of the chunks that feed `chunk` of `r`'s `stage` and that it feeds.
fn neighbour_stages(
    r: &ReplicaPipeline,
    stage: usize,
    chunk: usize,
) -> (Option<usize>, Option<usize>) {
    let (stages, chunks) = (r.stages.num_stages(), r.stages.num_chunks());
    let previous = match (stage, chunk) {
        (0, 0) => None,
        (0, _) => Some(stages - 1),
        _ => Some(stage - 1),
    };
    let next = match (stage + 1 == stages, chunk + 1 == chunks) {
        (true, true) => None,
        (true, false) => Some(0),
        (false, _) => Some(stage + 1),
    };
    (previous, next)
}

/// A context-parallel stage's group (this rank's tensor-parallel index in every member's
/// group), every member's sequence indices, and per chunk whether its input and its
/// output cross to a stage that splits sequences otherwise (they then travel whole).
struct ContextLayout {
    group: Vec<usize>,
    positions: Vec<Vec<i64>>,
    whole_input: Vec<bool>,
    whole_output: Vec<bool>,
}

/// The context-parallel layout of `replica`'s `stage` for its tensor-parallel rank
/// `tp_rank` (`None` without context parallelism).
fn context_layout(
    config: &TrainConfig,
    (replica, stage): (usize, usize),
    tp_rank: usize,
) -> Result<Option<ContextLayout>, TrainError> {
    let r = &config.parallel.plan.replicas()[replica];
    if r.cp_size(stage) == 1 {
        return Ok(None);
    }
    let split = (r.context_split(stage, config.batch.sequence_length)).map_err(|source| {
        PlanError::ContextSplit {
            replica,
            stage,
            source,
        }
    })?;
    let positions = (0..split.ranks())
        .map(|m| {
            split
                .position_list(m)
                .into_iter()
                .map(|p| p as i64)
                .collect()
        })
        .collect();
    let other = |s: Option<usize>| s.is_some_and(|s| !r.same_context_layout(s, stage));
    let (whole_input, whole_output) = (0..r.stages.num_chunks())
        .map(|chunk| {
            let (previous, next) = neighbour_stages(r, stage, chunk);
            (other(previous), other(next))
        })
        .unzip();
    Ok(Some(ContextLayout {
        group: r.cp_group(stage, tp_rank),
        positions,
        whole_input,
        whole_output,
    }))
}

/// The pipeline's view of `context`: its communicator among `groups`.
fn context_rank<'g>(
    groups: &'g SetGroups,
    context: Option<&'g ContextLayout>,
) -> Option<ContextRank<'g>> {
    let context = context?;
    Some(ContextRank {
        group: groups.get(&context.group)?,
        positions: &context.positions,
        whole_input: &context.whole_input,
        whole_output: &context.whole_output,
    })
}

/// The pipeline's view of `experts`: its communicator among `groups`.
fn expert_rank<'g>(
    groups: &'g SetGroups,
    experts: Option<&'g (Vec<usize>, Vec<Vec<usize>>)>,
) -> Option<ExpertRank<'g>> {
    let (ranks, placement) = experts?;
    Some(ExpertRank {
        group: groups.get(ranks)?,
        placement,
    })
}

/// Under sequence parallelism, each rank's sequence rows as (its index in its stage's
/// tensor-parallel group, the group's size): what a neighbour sends it (empty without
/// sequence parallelism: everything travels whole).
fn sequence_rows(config: &TrainConfig) -> BTreeMap<usize, (usize, usize)> {
    if !config.parallel.sequence_parallel {
        return BTreeMap::new();
    }
    let replicas = config.parallel.plan.replicas();
    let groups =
        (replicas.iter()).flat_map(|r| (0..r.stages.num_stages()).flat_map(|s| r.tp_groups(s)));
    groups
        .flat_map(|group| {
            group
                .iter()
                .enumerate()
                .map(|(i, &rank)| (rank, (i, group.len())))
        })
        .collect()
}

/// AdamW over `chunks`' parameters outside `sharded` (the distributed optimizer's).
/// Under bf16 the chunks are cast after their fp32 values were taken (`fp32_values`),
/// so those become the optimizer's master weights exactly.
fn build_optimizer(
    config: &TrainConfig,
    chunks: &mut [Stage],
    fp32_values: &BTreeMap<String, Tensor>,
    sharded: &BTreeSet<String>,
) -> Result<AdamW, TrainError> {
    if config.compute.bf16 {
        for stage in chunks.iter_mut() {
            stage.set_kind(Kind::BFloat16);
        }
    }
    let mut optimizer = AdamW::new(
        config.optimizer.adam,
        (chunks.iter().flat_map(|s| s.var_store().variables()))
            .filter(|(name, _)| !sharded.contains(name)),
    );
    if config.compute.bf16 {
        for (name, value) in fp32_values.iter().filter(|(n, _)| !sharded.contains(*n)) {
            optimizer.load_param(name, value, None, None)?;
        }
    }
    Ok(optimizer)
}

/// The plan's expert-parallel groups (none for a dense model, or without expert
/// parallelism).
fn expert_groups(config: &TrainConfig) -> Result<Vec<ExpertGroupPlan>, TrainError> {
    match config.model.moe {
        Some(moe) => Ok(config.parallel.plan.expert_groups(moe.num_experts)?),
        None => Ok(Vec::new()),
    }
}

/// This rank's communicators: every gradient reduction's, every tensor-parallel,
/// context-parallel and expert-parallel group's (collective over `world`), with the
/// plan's gradient reductions.
fn rank_groups(
    world: &MpiCommunicator,
    device: Device,
    config: &TrainConfig,
) -> Result<(SetGroups, Vec<GradientReduction>), TrainError> {
    let plan = &config.parallel.plan;
    let shape = crate::profiler::model_shape(&config.model, config.batch.sequence_length);
    let tied = config.model.tie_word_embeddings;
    let reductions = plan.gradient_reductions_with_experts(tied, shape.experts.as_ref());
    let expert_sets: BTreeSet<Vec<usize>> = (expert_groups(config)?.into_iter())
        .flat_map(|group| {
            (0..plan.world_size())
                .filter_map(move |rank| plan.expert_ranks(std::slice::from_ref(&group), rank))
                .map(|(ranks, _)| ranks)
                .collect::<Vec<_>>()
        })
        .collect();
    let stages =
        (plan.replicas().iter()).flat_map(|r| (0..r.stages.num_stages()).map(move |s| (r, s)));
    let tp_groups = (stages.clone())
        .flat_map(|(r, s)| r.tp_groups(s).map(<[usize]>::to_vec))
        .filter(|g| g.len() > 1);
    let cp_groups = (stages.filter(|&(r, s)| r.cp_size(s) > 1))
        .flat_map(|(r, s)| (0..r.tp_size(s)).map(move |t| r.cp_group(s, t)));
    let others: BTreeSet<Vec<usize>> = (reductions.iter())
        .map(|r| r.members.clone())
        .chain(tp_groups)
        .chain(cp_groups)
        .collect();
    let apart = expert_sets.difference(&others).cloned().collect();
    let sets = others.into_iter().chain(expert_sets);
    let groups = SetGroups::new(world, device, sets, &apart)?;
    Ok((groups, reductions))
}

/// The train split's prefetching loader, then the validation and test splits' loaders.
type Loaders = (
    Option<Prefetcher>,
    Option<ReplicaLoader>,
    Option<ReplicaLoader>,
);

/// The train split's prefetching loader and the evaluation splits' loaders of
/// `replica` (an error when there is no train data and training is asked for).
fn build_loaders(
    config: &TrainConfig,
    datasets: SplitDatasets,
    replica: usize,
    sample_options: SampleOptions,
) -> Result<Loaders, TrainError> {
    let plan = &config.parallel.plan;
    let loader_of = |split: Option<_>| {
        let new = |d| ReplicaLoader::new(d, plan.batches(), replica, sample_options);
        split.map(new).transpose()
    };
    let loader = match (loader_of(datasets.train)?, config.eval.skip_train) {
        (Some(train), _) => Some(Prefetcher::new(train, config.data.prefetch)),
        (None, true) => None,
        (None, false) => return Err(LoaderError::NoTrainData.into()),
    };
    let evaluating = config.eval.iters > 0;
    let valid = loader_of(datasets.valid.filter(|_| evaluating))?;
    let test = loader_of(datasets.test.filter(|_| evaluating))?;
    Ok((loader, valid, test))
}

/// The optimizer of the parameters this rank updates, and the distributed optimizer's
/// shards when `--use-distributed-optimizer` (built from the fp32 initial values, which
/// are dropped after).
fn build_optimizers(
    config: &TrainConfig,
    chunks: &mut [Stage],
    grads: &MainGrads,
    rank: usize,
    fp32_values: BTreeMap<String, Tensor>,
) -> Result<(AdamW, Option<DistributedOptimizer>), TrainError> {
    let zero = config.optimizer.distributed.then(|| {
        let adam = config.optimizer.adam;
        DistributedOptimizer::new(adam, grads.layouts(), rank, &fp32_values)
    });
    let sharded = zero
        .as_ref()
        .map(DistributedOptimizer::names)
        .unwrap_or_default();
    let optimizer = build_optimizer(config, chunks, &fp32_values, &sharded)?;
    Ok((optimizer, zero))
}

/// This rank's state in bytes, measured, and logged.
fn memory_report(
    chunks: &[Stage],
    grads: &MainGrads,
    optimizer: &AdamW,
    zero: Option<&DistributedOptimizer>,
) -> MemoryReport {
    let optimizer_bytes =
        optimizer.state_bytes() + zero.map_or(0, DistributedOptimizer::state_bytes);
    tracing::info!(
        "optimizer state: {optimizer_bytes} bytes{}",
        match zero {
            Some(z) => format!(
                " ({} of them this rank's shards of the distributed optimizer)",
                z.state_bytes()
            ),
            None => String::new(),
        }
    );
    let tensors: Vec<Tensor> = (chunks.iter())
        .flat_map(|c| c.var_store().variables().into_values())
        .collect();
    let parameters = crate::memory::tensor_bytes(&tensors);
    let memory = MemoryReport {
        parameters,
        gradients: parameters,
        main_gradients: grads.bytes(),
        optimizer: optimizer_bytes,
        activations_peak: None,
    };
    tracing::info!(
        "memory: parameters {} B, their gradients {} B, fp32 main gradients {} B, optimizer state {} B: {} B of state",
        memory.parameters,
        memory.gradients,
        memory.main_gradients,
        memory.optimizer,
        memory.state()
    );
    memory
}

/// One rank of a training job.
pub struct Trainer<'w> {
    config: TrainConfig,
    world: &'w MpiCommunicator,
    /// This rank's communicators for its gradient reductions.
    groups: SetGroups,
    /// How activations reach the neighbouring stages.
    links: PipelineLinks,
    chunks: Vec<Stage>,
    optimizer: AdamW,
    /// The distributed optimizer's shards (`--use-distributed-optimizer`).
    zero: Option<DistributedOptimizer>,
    /// This rank's memory, measured.
    memory: MemoryReport,
    /// Steps this process has run.
    steps_run: u64,
    /// Where this rank's memory in use is read.
    memory_probe: Option<MemoryProbe>,
    /// fp32 main gradients, one buffer per chunk, and their reductions.
    grads: MainGrads,
    program: Vec<Instruction>,
    /// The forward-only program evaluations run.
    eval_program: Vec<Instruction>,
    /// The train split's loader (none when only evaluating without train data).
    loader: Option<Prefetcher>,
    /// The validation and test splits' loaders, when evaluating.
    valid: Option<ReplicaLoader>,
    test: Option<ReplicaLoader>,
    stage_index: usize,
    num_stages: usize,
    replica: usize,
    /// The world ranks of this rank's stage: its tensor-parallel group (one rank
    /// without tensor parallelism).
    tp_group: Vec<usize>,
    /// The stage's context-parallel group and its members' positions, when it has one.
    context: Option<ContextLayout>,
    /// The stage's expert-parallel group (its ranks) and each member's experts, when it
    /// holds only some.
    experts: Option<(Vec<usize>, Vec<Vec<usize>>)>,
    /// Under sequence parallelism, each rank's sequence rows (see [`sequence_rows`]).
    peer_rows: BTreeMap<usize, (usize, usize)>,
    emulation: Option<Emulation>,
    /// This rank's device (an emulated speed change needs it).
    device: Device,
    /// Every rank's pace, watched for sustained changes.
    watch: SpeedWatch,
    /// Step times and switches, for re-planning.
    replanning: switch::Replanning,
    /// Seconds this rank took to build the trainer (what a switch does again).
    setup_s: f64,
    /// What a switch builds the new plan's loaders from.
    datasets: SplitDatasets,
    sample_options: SampleOptions,
    local_rank: usize,
    iteration: u64,
    consumed_samples: u64,
    /// A checkpoint a background thread is writing (`--async-save`).
    pending_save: Option<save::PendingSave>,
    /// Saves finished and not yet logged.
    finished_saves: Vec<save::SaveRecord>,
}

impl<'w> Trainer<'w> {
    /// Builds this rank's part of the model (layout-independent initialisation, or the
    /// checkpoint of `--load`, or `--finetune-from-hf`) and its optimizer and loader.
    /// Collective over `world`.
    pub fn new(
        world: &'w MpiCommunicator,
        config: TrainConfig,
        datasets: SplitDatasets,
        sample_options: SampleOptions,
        local_rank: usize,
    ) -> Result<Self, TrainError> {
        let started = Instant::now();
        let rank = world.rank();
        let (replica, stage_index) = check_plan(&config, world.size(), rank)?;
        let device = rank_device(&config, rank, local_rank)?;
        let emulation = rank_emulation(&config, rank, device)?;
        if rank == 0 {
            warn_if_emulation_oversubscribes(&config, world.size());
        }
        let plan = &config.parallel.plan;
        let (groups, reductions) = rank_groups(world, device, &config)?;
        let tp_rank = plan.tp_rank(rank).unwrap_or(0);
        let cp_rank = plan.cp_rank(rank).unwrap_or(0);
        let tp_group = plan.replicas()[replica]
            .tp_group(stage_index, cp_rank)
            .to_vec();
        let context = context_layout(&config, (replica, stage_index), tp_rank)?;
        if let Some(c) = &context {
            tracing::info!(
                "context-parallel group {:?}: this rank holds {} of every sequence's {} positions",
                c.group,
                c.positions[cp_rank].len(),
                config.batch.sequence_length
            );
        }
        let experts = plan.expert_ranks(&expert_groups(&config)?, rank);
        if let Some((ranks, placement)) = &experts {
            let me = ranks.iter().position(|&r| r == rank).unwrap_or(0);
            tracing::info!(
                "expert-parallel group {ranks:?}: this rank holds experts {:?} of every MoE layer of its stage (the members {placement:?})",
                placement[me]
            );
        }
        let held = experts.as_ref().map(|(ranks, placement)| {
            let me = ranks.iter().position(|&r| r == rank).unwrap_or(0);
            placement[me].clone()
        });
        let mut chunks = build_chunks(&config, (replica, stage_index), (tp_rank, held), device)?;
        let fp32_values: BTreeMap<String, Tensor> = (chunks.iter())
            .flat_map(|s| s.var_store().variables())
            .map(|(n, t)| (n, t.detach().copy()))
            .collect();
        let mut programs = plan.schedule(config.parallel.schedule)?;
        let links = PipelineLinks::new(world, &groups, &programs)?;
        let program = programs.swap_remove(rank);
        let eval_program = synerfuse_plan::forward_only(&program);
        let kept = datasets.clone();
        let (loader, valid, test) = build_loaders(&config, datasets, replica, sample_options)?;
        let mine: Vec<GradientReduction> = reductions
            .into_iter()
            .filter(|r| r.members.contains(&rank))
            .collect();
        let grads = MainGrads::new(
            &chunks,
            &plan.chunk_pieces(rank),
            plan.num_layers(),
            &mine,
            config.compute.bf16,
        )?
        .summing_over(tp_group.clone(), &chunks);
        let grads = match config.optimizer.distributed {
            true => grads.sharded(|members| plan.memory_shares(members)),
            false => grads,
        };
        let (optimizer, zero) = build_optimizers(&config, &mut chunks, &grads, rank, fp32_values)?;
        let memory = memory_report(&chunks, &grads, &optimizer, zero.as_ref());
        let num_stages = plan.replicas()[replica].stages.num_stages();
        let mut trainer = Trainer {
            world,
            groups,
            links,
            chunks,
            optimizer,
            zero,
            memory,
            steps_run: 0,
            memory_probe: MemoryProbe::for_device(device, memory.gradients),
            grads,
            program,
            eval_program,
            loader,
            valid,
            test,
            stage_index,
            num_stages,
            replica,
            tp_group,
            context,
            experts,
            peer_rows: sequence_rows(&config),
            emulation,
            device,
            watch: SpeedWatch::new(world.size(), config.replan.watch),
            replanning: switch::Replanning::new(config.replan.watch.window),
            setup_s: 0.0,
            datasets: kept,
            sample_options,
            local_rank,
            iteration: 0,
            consumed_samples: 0,
            pending_save: None,
            finished_saves: Vec::new(),
            config,
        };
        trainer.load_latest()?;
        trainer.remember_for_survivors()?;
        trainer.setup_s = started.elapsed().as_secs_f64();
        Ok(trainer)
    }

    /// Iterations completed so far.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Restores the latest checkpoint under `--load`, when there is one.
    fn load_latest(&mut self) -> Result<(), TrainError> {
        let Some(load) = self.config.checkpoint.load.clone() else {
            return Ok(());
        };
        match Checkpoint::open_latest(&load)? {
            Some(checkpoint) => {
                checkpoint.check_routing(&self.config.model)?;
                self.restore(&checkpoint)?;
                let state = &checkpoint.state;
                if self.world.rank() == 0 {
                    tracing::info!(
                        "loaded checkpoint {} (iteration {}, {} consumed samples, written under a plan of {} replicas with layers per stage {:?})",
                        checkpoint.dir.display(),
                        state.iteration,
                        state.consumed_samples,
                        state.plan.replicas().len(),
                        state
                            .plan
                            .replicas()
                            .iter()
                            .map(|r| r.stages.layers())
                            .collect::<Vec<_>>()
                    );
                }
                Ok(())
            }
            None => {
                tracing::warn!(
                    "--load {}: no checkpoint found (no `{}` file); training from scratch",
                    load.display(),
                    checkpoint::LATEST
                );
                Ok(())
            }
        }
    }

    /// The communicator of this rank's tensor-parallel group, if its stage has one (its
    /// members in tensor-parallel order, which sequence parallelism's rows follow).
    fn tp_communicator<'g>(
        groups: &'g SetGroups,
        tp_group: &[usize],
    ) -> Option<&'g GroupCommunicator> {
        groups.get(tp_group)
    }
    /// The dtype of activations between stages.
    fn activation_kind(&self) -> Kind {
        match self.config.compute.bf16 {
            true => Kind::BFloat16,
            false => Kind::Float,
        }
    }

    /// Whether this rank is its context-parallel group's first member (or in none): the
    /// one whose copy of the stage's parameters counts once.
    fn context_first(&self) -> bool {
        (self.context.as_ref()).is_none_or(|c| c.group[0] == self.world.rank())
    }

    /// Whether this rank's copy of parameter `name` is the one the gradient norm and
    /// checkpoints count (tensor-parallel holders aside, see `Stage::holds_unique`):
    /// replica 0's, or of an expert the lowest replica holding it; on the first
    /// context-parallel member.
    fn counts_once(&self, name: &str) -> bool {
        let expert = synerfuse_plan::expert_of(name).zip(self.experts.as_ref());
        let lowest = match (expert, self.config.model.moe) {
            (Some((e, _)), Some(moe)) => {
                let layer = synerfuse_plan::layer_of(name).unwrap_or(0);
                let holders = (self.config.parallel.plan).expert_holders(layer, e, moe.num_experts);
                holders.first() == Some(&self.replica)
            }
            _ => self.replica == 0,
        };
        lowest && self.context_first()
    }

    /// Whether this rank holds the last stage's tied copy of the embedding (which the
    /// norm and checkpoints skip: the first stage's copy is the parameter).
    fn holds_tied_copy(&self) -> bool {
        self.config.model.tie_word_embeddings
            && self.num_stages > 1
            && self.stage_index + 1 == self.num_stages
    }

    /// Trains until `--train-iters`, an `--exit-interval` or a stop signal, evaluating
    /// as configured (only evaluating under `--skip-train`).
    pub fn train(&mut self) -> Result<TrainSummary, TrainError> {
        let rank = self.world.rank();
        let mut log = StepLog::open(&self.config, rank, self.world.size())?;
        let global_batch = self.config.parallel.plan.global_batch_size() as u64;
        let (train_iters, eval) = (self.config.batch.train_iters, self.config.eval);
        let mut summary = TrainSummary {
            iteration: self.iteration,
            losses: Vec::new(),
            stopped_by_signal: false,
            saved: Vec::new(),
            evaluations: Vec::new(),
        };
        if eval.skip_train {
            if rank == 0 {
                tracing::info!("skipping training (--skip-train is on)");
            }
            summary.evaluations = self.evaluate_at_end(0, &mut log)?;
            return Ok(summary);
        }
        self.record_run(&mut log)?;
        let mut consumed_valid = eval.consumed_valid_samples(self.iteration, global_batch);
        let mut ended_early = false;
        while self.iteration < train_iters {
            self.change_emulated_speed();
            self.note_step_start();
            let started = Instant::now();
            let step = self.step(started)?;
            let stop = signals::stop_requested();
            let elapsed = started.elapsed();
            // Every rank's spans on the steps whose JSON record carries them.
            let with_spans = log.keeps_spans(self.iteration + 1);
            let replica_tokens = self.replica_tokens();
            let outcome =
                StepOutcome::gather(self.world, step, elapsed, stop, replica_tokens, with_spans)?;
            self.iteration += 1;
            self.consumed_samples += global_batch;
            summary.iteration = self.iteration;
            summary.losses.push(outcome.loss);
            log.record(rank, self.iteration, self.consumed_samples, &outcome)?;
            crate::lost::remember_paces(&outcome.pace_s());
            let shifts = self.watch.observe(&outcome.pace_s());
            log.record_speed_shifts(rank, self.iteration, &shifts)?;
            self.note_step(&mut log, outcome.step_ms / 1e3)?;
            let ending = outcome.any_stop || self.config.checkpoint.exit_due(self.iteration);
            let goes_on = self.iteration < train_iters && !ending;
            if let Some(cause) = self.replan_cause(!shifts.is_empty(), goes_on) {
                self.replan(&mut log, cause)?;
            }
            if eval.due(self.iteration) {
                let split = EvalSplit::Validation;
                if let Some(e) = self.evaluate_and_log(split, consumed_valid, false, &mut log)? {
                    consumed_valid += e.samples;
                    summary.evaluations.push(e);
                }
            }
            let checkpointing = &self.config.checkpoint;
            if checkpointing.save_due(self.iteration, train_iters, outcome.any_stop) {
                summary.saved.push(self.save()?);
                self.log_saves(&mut log)?;
            }
            if self.config.checkpoint.exit_due(self.iteration) && self.iteration != train_iters {
                if rank == 0 {
                    tracing::info!(
                        "exiting after iteration {} (--exit-interval)",
                        self.iteration
                    );
                }
                ended_early = true;
                break;
            }
            if outcome.any_stop {
                self.log_stop();
                summary.stopped_by_signal = true;
                ended_early = true;
                break;
            }
        }
        if !ended_early {
            let at_end = self.evaluate_at_end(consumed_valid, &mut log)?;
            summary.evaluations.extend(at_end);
        }
        // A background save in flight is finished, a stop signal's included.
        self.finish_saves()?;
        self.log_saves(&mut log)?;
        if let Some(peak) = crate::memory::peak_resident_bytes() {
            tracing::info!("peak resident memory {peak} B");
        }
        Ok(summary)
    }

    /// Records the saves finished since the last call in the JSON log.
    fn log_saves(&mut self, log: &mut StepLog) -> Result<(), TrainError> {
        for record in std::mem::take(&mut self.finished_saves) {
            log.record_save(self.world.rank(), &record)?;
        }
        Ok(())
    }

    /// [`Self::evaluate`], then its log lines, JSON record and TensorBoard scalars.
    fn evaluate_and_log(
        &mut self,
        split: EvalSplit,
        consumed: u64,
        at_end: bool,
        log: &mut StepLog,
    ) -> Result<Option<Evaluation>, TrainError> {
        let evaluation = self.evaluate(split, consumed, at_end)?;
        if let Some(e) = &evaluation {
            let tensorboard = !self.config.eval.skip_train;
            log.record_evaluation(self.world.rank(), e, self.consumed_samples, tensorboard)?;
        }
        Ok(evaluation)
    }

    /// Megatron's end of training: the validation split from `consumed_valid`, then the
    /// test split from its start, each logged as it ends.
    fn evaluate_at_end(
        &mut self,
        consumed_valid: u64,
        log: &mut StepLog,
    ) -> Result<Vec<Evaluation>, TrainError> {
        let valid = self.evaluate_and_log(EvalSplit::Validation, consumed_valid, true, log)?;
        let test = self.evaluate_and_log(EvalSplit::Test, 0, true, log)?;
        Ok(valid.into_iter().chain(test).collect())
    }

    /// This rank's replica's tokens per step (every stage of a replica sees the same).
    fn replica_tokens(&self) -> usize {
        let replica = &self.config.parallel.plan.replicas()[self.replica];
        replica.batch.samples() * self.config.batch.sequence_length
    }

    /// Applies this rank's `--emulate-speed-change` for the coming iteration (the latest
    /// change at or before it, so a resumed run is at the speed it would have had).
    fn change_emulated_speed(&mut self) {
        let (rank, next) = (self.world.rank(), self.iteration + 1);
        let Some(change) = (self.config.compute.speed_changes.iter())
            .filter(|c| c.rank == rank && c.iteration <= next)
            .max_by_key(|c| c.iteration)
        else {
            return;
        };
        if self.emulation.map(|e| e.speed) == Some(change.speed) {
            return;
        }
        tracing::info!(
            "device emulation: from iteration {next} this rank runs at {:.3}x (--emulate-speed-change)",
            change.speed
        );
        self.emulation = Some(Emulation {
            speed: change.speed,
            device: self.device,
        });
    }

    /// Rank 0 says which signal stopped the run and whether it was saved.
    fn log_stop(&self) {
        if self.world.rank() != 0 {
            return;
        }
        tracing::warn!(
            "{} received: stopped after iteration {}{}",
            if signals::stop_requested() {
                signals::stop_signal_name()
            } else {
                "a stop signal (on another rank)"
            },
            self.iteration,
            if self.config.checkpoint.save.is_some() {
                " and saved a checkpoint"
            } else {
                " (no --save, nothing saved)"
            }
        );
    }

    /// The global batch's loss tokens and sequences: each replica's (counted on its
    /// first stage), summed over the world.
    fn global_loss_tokens(
        &self,
        micro_batches: &[crate::loader::MicroBatch],
    ) -> Result<(f64, f64), TrainError> {
        // Once per replica: its first stage's tensor- and context-parallel rank 0.
        let counts =
            self.stage_index == 0 && self.chunks[0].shard().rank == 0 && self.context_first();
        let local: [f64; 2] = match counts {
            true => [
                micro_batches.iter().map(|m| m.loss_tokens()).sum(),
                micro_batches.iter().map(|m| m.len() as f64).sum(),
            ],
            false => [0.0; 2],
        };
        let mut totals = Tensor::from_slice(&local);
        if self.world.size() > 1 {
            self.world.all_reduce_sum(&mut totals)?;
        }
        let global = totals.double_value(&[0]);
        if global <= 0.0 {
            return Err(TrainError::NoLossTokens {
                consumed_samples: self.consumed_samples,
            });
        }
        Ok((global, totals.double_value(&[1])))
    }

    /// One iteration (begun at `step_start`): the pipeline, the gradient reductions, the
    /// optimizer step.
    fn step(&mut self, step_start: Instant) -> Result<StepResult, TrainError> {
        let micro_batches = match &mut self.loader {
            Some(loader) => loader.step(self.consumed_samples)?,
            None => return Err(LoaderError::NoTrainData.into()),
        };
        let since_start = || step_start.elapsed().as_secs_f64();
        let span = |kind, start_s| Span {
            kind,
            start_s,
            end_s: since_start(),
            micro_batch: None,
        };
        let mut times = StepTimes::default();
        let started = Instant::now();
        let mut spans = vec![];
        let (loss_tokens, sequences) = self.global_loss_tokens(&micro_batches)?;
        // Counting the global batch's loss tokens waits for every rank.
        spans.push(span(SpanKind::Wait, 0.0));
        times.communication += started.elapsed();
        self.optimizer.zero_grad();
        self.grads.begin_step(&self.program);
        let mut high_water = self.memory_probe.as_ref().and_then(HighWater::start);
        let normalisers = (loss_tokens, sequences);
        let (loss, pipeline_times, pipeline_spans) =
            self.run_pipeline(&micro_batches, normalisers, high_water.as_mut(), step_start)?;
        spans.extend(pipeline_spans);
        // This process's first step also allocates the gradients: its peak is not the
        // activations'.
        self.steps_run += 1;
        if let Some(peak) = high_water.filter(|_| self.steps_run > 1) {
            let before = self.memory.activations_peak;
            let peak = before.unwrap_or(0).max(peak.above_base());
            self.memory.activations_peak = Some(peak);
            if before.is_none() {
                tracing::info!("activation high-water mark: {peak} B above the state");
            }
        }
        times.compute += pipeline_times.compute;
        times.communication += pipeline_times.communication;
        times.waiting += pipeline_times.waiting;
        times.passes += pipeline_times.passes;
        if injected_fault(self.world.rank(), self.iteration + 1) {
            eprintln!(
                "rank {}: SYNERFUSE_FAULT_INJECT: exiting in the middle of iteration {}",
                self.world.rank(),
                self.iteration + 1
            );
            std::process::exit(3);
        }
        let (started, start_s) = (Instant::now(), since_start());
        let (grads, grad_norm) = self.reduced_gradients()?;
        times.communication += started.elapsed();
        spans.push(span(SpanKind::Reduce, start_s));
        let (started, start_s) = (Instant::now(), since_start());
        let lr = self.config.optimizer.lr.lr(self.consumed_samples);
        let factor = clip_factor(grad_norm, self.config.optimizer.clip_grad);
        self.optimizer.step_with_grads(lr, &grads, factor);
        if let Some(zero) = &mut self.zero {
            zero.step(lr, factor, &self.groups)?;
        }
        times.compute += started.elapsed();
        spans.push(span(SpanKind::Optimizer, start_s));
        Ok(StepResult {
            loss_sum: loss.loss_sum,
            loss_tokens,
            experts: loss.experts.row(&self.config.model),
            sequences,
            lr,
            grad_norm,
            times,
            memory: self.memory,
            spans,
        })
    }

    /// Runs this rank's program; each chunk's main gradients accumulate (and, when
    /// overlapping, start their reduction) as its backwards end.
    fn run_pipeline(
        &mut self,
        micro_batches: &[crate::loader::MicroBatch],
        normalisers: (f64, f64),
        mut high_water: Option<&mut HighWater>,
        step_start: Instant,
    ) -> Result<(crate::pipeline::StepLoss, StepTimes, Vec<Span>), TrainError> {
        let pipeline = PipelineRank {
            chunks: &self.chunks,
            stage_index: self.stage_index,
            num_stages: self.num_stages,
            world: self.world,
            links: &self.links,
            tp: Self::tp_communicator(&self.groups, &self.tp_group),
            context: context_rank(&self.groups, self.context.as_ref()),
            experts: expert_rank(&self.groups, self.experts.as_ref()),
            peer_rows: &self.peer_rows,
            activation_kind: self.activation_kind(),
            emulation: self.emulation,
            step_start,
        };
        let groups = &self.groups;
        let overlap = self.config.parallel.overlap_grad_reduce;
        let main_grads = &mut self.grads;
        let mut on_event = |event: PipelineEvent| -> Result<(), TrainError> {
            if let Some(high_water) = high_water.as_deref_mut() {
                high_water.sample();
            }
            match event {
                PipelineEvent::BackwardDone { chunk } => {
                    main_grads.after_backward(chunk, groups, overlap)?
                }
                PipelineEvent::Between => main_grads.progress(),
            }
            Ok(())
        };
        pipeline.run(
            &self.program,
            micro_batches,
            self.config.batch.sequence_length,
            normalisers,
            &mut on_event,
        )
    }

    /// The fp32 main gradients, each segment reduced over its holders (the tied
    /// embedding over every copy), with their global norm: every parameter once (the
    /// tied copy on the last stage skipped), from replica 0's ranks (an expert's from the
    /// lowest replica holding it; the distributed
    /// optimizer's from each holder's own shard) and summed over the world, so every
    /// replica clips by the very same factor (replicas of different pipelines would sum
    /// their squares in different orders).
    fn reduced_gradients(&mut self) -> Result<(BTreeMap<String, Tensor>, f64), TrainError> {
        self.grads.finish(&self.groups)?;
        let grads = self.grads.grads();
        let skip_tied = self.holds_tied_copy();
        let stage = &self.chunks[0];
        // The distributed optimizer's parameters: each holder's own shard.
        let (sharded, from_shards) = match &self.zero {
            Some(zero) => (
                zero.names(),
                zero.grad_norm_squared(|n| stage.holds_unique(n)),
            ),
            None => Default::default(),
        };
        // Each tensor's squares summed in fp64 on its device, all of them read back in
        // one transfer: one synchronisation per step, not one per parameter.
        let squares: Vec<Tensor> = match self.context_first() {
            true => grads
                .iter()
                .filter(|(n, _)| self.counts_once(n))
                .filter(|(n, _)| !(skip_tied && n.as_str() == EMBEDDING))
                .filter(|(n, _)| !sharded.contains(n.as_str()))
                .filter(|(n, _)| stage.holds_unique(n))
                .map(|(_, g)| g.square().sum(Kind::Double))
                .collect(),
            false => Vec::new(),
        };
        let replicated = match squares.is_empty() {
            true => 0.0,
            false => Vec::<f64>::try_from(Tensor::stack(&squares, 0).to_device(Device::Cpu))
                .map_or(f64::NAN, |v| v.iter().sum()),
        };
        let local = from_shards + replicated;
        let mut norm_sq = Tensor::from_slice(&[local]);
        if self.world.size() > 1 {
            self.world.all_reduce_sum(&mut norm_sq)?;
        }
        Ok((grads, norm_sq.double_value(&[0]).sqrt()))
    }
}
