//! What a rank builds before training, from the configuration and the plan: its place
//! and device, its communicators, its stage chunks, loaders and optimizers, and its
//! memory measured. Functions of the configuration, beneath the trainer that holds
//! what they build ([`super::state`]).

use super::config::TrainConfig;
use crate::comm::{MpiCommunicator, PipelineLinks, PlannedHosts, SetGroups};
use crate::emulation::Emulation;
use crate::grads::MainGrads;
use crate::loader::{LoaderError, Prefetcher, ReplicaLoader, SplitDatasets};
use crate::loss_scale::LossScaling;
use crate::memory::MemoryReport;
use crate::optim::AdamW;
use crate::pipeline::{ContextRank, ExpertRank};
pub(crate) use crate::precision::compute_kind;
use crate::zero::DistributedOptimizer;
use crate::TrainError;
use std::collections::{BTreeMap, BTreeSet};
use synerfuse_data::gpt::SampleOptions;
use synerfuse_model::tch::{Device, Kind, Tensor};
use synerfuse_model::{DeviceRequest, ResolveDevice, Stage};
use synerfuse_plan::{
    ExpertGroupPlan, GradientReduction, Instruction, PlanError, Precision, ReplicaPipeline,
};

/// The device of this rank: the plan's placement, else the configured device;
/// `cuda`/`auto` without an index pick GPU `local_rank mod count`.
pub(super) fn rank_device(
    config: &TrainConfig,
    rank: usize,
    local_rank: usize,
) -> Result<Device, TrainError> {
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
pub(super) fn warn_if_emulation_oversubscribes(config: &TrainConfig, world_size: usize) {
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

/// Checks the plan against the job and the model before anything is built; returns
/// `rank`'s (replica, stage).
pub(super) fn check_plan(
    config: &TrainConfig,
    world_size: usize,
    rank: usize,
) -> Result<(usize, usize), TrainError> {
    let plan = &config.parallel.plan;
    let parallel = &config.parallel;
    // Megatron's rule: the gather is the distributed optimizer's, and overlapping it
    // assumes the reduction overlaps too.
    let needs = match (config.optimizer.distributed, parallel.overlap_grad_reduce) {
        (false, _) => Some("--use-distributed-optimizer"),
        (true, false) => Some("--overlap-grad-reduce (drop --no-overlap-grad-reduce)"),
        (true, true) => None,
    };
    if let Some(needs) = needs.filter(|_| parallel.overlap_param_gather) {
        return Err(TrainError::ParamGatherNeeds { needs });
    }
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
pub(super) fn rank_emulation(
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
pub(super) fn build_chunks(
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
pub(super) struct ContextLayout {
    pub(super) group: Vec<usize>,
    pub(super) positions: Vec<Vec<i64>>,
    pub(super) whole_input: Vec<bool>,
    pub(super) whole_output: Vec<bool>,
}

/// The context-parallel layout of `replica`'s `stage` for its tensor-parallel rank
/// `tp_rank` (`None` without context parallelism).
pub(super) fn context_layout(
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

/// [`context_layout`] of this rank (`tp_rank`, `cp_rank` in its stage's groups),
/// announced in the log.
pub(super) fn rank_context(
    config: &TrainConfig,
    (replica, stage): (usize, usize),
    (tp_rank, cp_rank): (usize, usize),
) -> Result<Option<ContextLayout>, TrainError> {
    let context = context_layout(config, (replica, stage), tp_rank)?;
    if let Some(c) = &context {
        tracing::info!(
            "context-parallel group {:?}: this rank holds {} of every sequence's {} positions",
            c.group,
            c.positions[cp_rank].len(),
            config.batch.sequence_length
        );
    }
    Ok(context)
}

/// The pipeline's view of `context`: its communicator among `groups`.
pub(super) fn context_rank<'g>(
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

/// Whether `ranks` compute in different precisions.
pub(crate) fn mixes_precisions(config: &TrainConfig, ranks: &[usize]) -> bool {
    let mut precisions = ranks.iter().map(|&r| rank_precision(config, r));
    let first = precisions.next();
    precisions.any(|p| Some(p) != first)
}

/// The pipeline's view of `experts`: its communicator among `groups`, and fp32 for its
/// exchanges where its members compute in different precisions (`config`'s).
pub(super) fn expert_rank<'g>(
    groups: &'g SetGroups,
    experts: Option<&'g ExpertMembers>,
    config: &TrainConfig,
) -> Option<ExpertRank<'g>> {
    let (ranks, placement) = experts?;
    let mixed = mixes_precisions(config, ranks);
    Some(ExpertRank {
        group: groups.get(ranks)?,
        placement,
        exchange_kind: mixed.then_some(Kind::Float),
    })
}

/// Under sequence parallelism, each rank's sequence rows as (its index in its stage's
/// tensor-parallel group, the group's size): what a neighbour sends it (empty without
/// sequence parallelism: everything travels whole).
pub(super) fn sequence_rows(config: &TrainConfig) -> BTreeMap<usize, (usize, usize)> {
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

/// What `rank` computes in: the plan's precision for it, else the job's flag.
pub(crate) fn rank_precision(config: &TrainConfig, rank: usize) -> Precision {
    (config.parallel.plan.precision_of(rank)).unwrap_or(config.compute.precision)
}

/// Logs what this rank computes in, and why.
pub(super) fn log_precision(config: &TrainConfig, rank: usize) {
    let precision = rank_precision(config, rank);
    let why = match (
        config.parallel.plan.precision_of(rank),
        config.compute.precision,
    ) {
        (Some(_), _) => "the plan's precision for it",
        (None, Precision::Bf16) => "--bf16",
        (None, Precision::Fp16) => "--fp16",
        (None, Precision::Fp32) => "neither --bf16 nor --fp16",
    };
    tracing::info!(
        "computes in {precision} ({why}); master weights, main gradients and reductions in fp32"
    );
}

/// Whether `replica` scales its loss: one of its stages computes in fp16 (whose narrow
/// range needs it), or the job scales every low-precision replica by a constant
/// (`--loss-scale`). Its gradients are then unscaled into the fp32 buffer. Replicas
/// whose expert-parallel groups join them scale alike (any of them so needing it), as
/// an expert's gradient sums every member's tokens.
pub(crate) fn replica_scales_loss(config: &TrainConfig, replica: usize) -> bool {
    let plan = &config.parallel.plan;
    let groups = (config.model.moe)
        .and_then(|moe| plan.expert_groups(moe.num_experts).ok())
        .unwrap_or_default();
    let replicas = synerfuse_plan::coupled_replicas(&groups, replica);
    let ranks = replicas
        .iter()
        .flat_map(|&r| plan.replicas()[r].all_ranks());
    let precisions: Vec<Precision> = ranks.map(|r| rank_precision(config, r)).collect();
    match config.compute.loss_scaling {
        LossScaling::None => false,
        LossScaling::Dynamic(_) => precisions.contains(&Precision::Fp16),
        LossScaling::Constant(_) => precisions.iter().any(|&p| p != Precision::Fp32),
    }
}

/// AdamW over `chunks`' parameters outside `sharded` (the distributed optimizer's).
/// Under bf16 or fp16 the chunks are cast after their fp32 values were taken (`fp32_values`),
/// so those become the optimizer's master weights exactly.
fn build_optimizer(
    config: &TrainConfig,
    chunks: &mut [Stage],
    kind: Kind,
    fp32_values: &BTreeMap<String, Tensor>,
    sharded: &BTreeSet<String>,
) -> Result<AdamW, TrainError> {
    if kind != Kind::Float {
        for stage in chunks.iter_mut() {
            stage.set_kind(kind);
        }
    }
    let mut optimizer = AdamW::new(
        config.optimizer.adam,
        (chunks.iter().flat_map(|s| s.var_store().variables()))
            .filter(|(name, _)| !sharded.contains(name)),
    );
    if kind != Kind::Float {
        for (name, value) in fp32_values.iter().filter(|(n, _)| !sharded.contains(*n)) {
            optimizer.load_param(name, value, None, None)?;
        }
    }
    Ok(optimizer)
}

/// The plan's expert-parallel groups (none for a dense model, or without expert
/// parallelism).
pub(super) fn expert_groups(config: &TrainConfig) -> Result<Vec<ExpertGroupPlan>, TrainError> {
    match config.model.moe {
        Some(moe) => Ok(config.parallel.plan.expert_groups(moe.num_experts)?),
        None => Ok(Vec::new()),
    }
}

/// An expert-parallel group: its ranks, and each member's experts of every MoE layer.
pub(super) type ExpertMembers = (Vec<usize>, Vec<Vec<usize>>);

/// `rank`'s expert-parallel group (its ranks) and each member's experts, when its stage
/// holds only some of every MoE layer's experts; announced in the log.
pub(super) fn rank_experts(
    config: &TrainConfig,
    rank: usize,
) -> Result<Option<ExpertMembers>, TrainError> {
    let experts = (config.parallel.plan).expert_ranks(&expert_groups(config)?, rank);
    if let Some((ranks, placement)) = &experts {
        let me = ranks.iter().position(|&r| r == rank).unwrap_or(0);
        tracing::info!(
            "expert-parallel group {ranks:?}: this rank holds experts {:?} of every MoE layer of its stage (the members {placement:?})",
            placement[me]
        );
    }
    Ok(experts)
}

/// The experts `rank` holds of `experts` (its group and every member's experts).
pub(super) fn held_experts(experts: Option<&ExpertMembers>, rank: usize) -> Option<Vec<usize>> {
    experts.map(|(ranks, placement)| {
        let me = ranks.iter().position(|&r| r == rank).unwrap_or(0);
        placement[me].clone()
    })
}

/// This rank's communicators: every gradient reduction's, every tensor-parallel,
/// context-parallel and expert-parallel group's (collective over `world`), with the
/// plan's gradient reductions.
pub(super) fn rank_groups(
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
    let hosts = PlannedHosts {
        hierarchical: config.parallel.hierarchical_reduction,
        ..PlannedHosts::of(plan)
    };
    let groups = SetGroups::new(world, device, sets, &apart, &hosts)?;
    Ok((groups, reductions))
}

/// This rank's program of the plan's schedule, its forward-only form (what evaluations
/// run), and the links to its neighbouring stages (collective over `world`).
pub(super) fn rank_programs(
    world: &MpiCommunicator,
    groups: &SetGroups,
    config: &TrainConfig,
) -> Result<(PipelineLinks, Vec<Instruction>, Vec<Instruction>), TrainError> {
    let mut programs = config.parallel.plan.schedule(config.parallel.schedule)?;
    let links = PipelineLinks::new(world, groups, &programs)?;
    let program = programs.swap_remove(world.rank());
    let eval_program = synerfuse_plan::forward_only(&program);
    Ok((links, program, eval_program))
}

/// The train split's prefetching loader, then the validation and test splits' loaders.
pub(super) type Loaders = (
    Option<Prefetcher>,
    Option<ReplicaLoader>,
    Option<ReplicaLoader>,
);

/// The train split's prefetching loader and the evaluation splits' loaders of
/// `replica` (an error when there is no train data and training is asked for).
pub(super) fn build_loaders(
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

/// Copies of `chunks`' parameters as initialised, in fp32: the optimizers' masters,
/// taken before bf16 casts the chunks.
pub(super) fn fp32_copies(chunks: &[Stage]) -> BTreeMap<String, Tensor> {
    (chunks.iter())
        .flat_map(|s| s.var_store().variables())
        .map(|(n, t)| (n, t.detach().copy()))
        .collect()
}

/// The fp32 main gradients of `chunks` for the plan's `reductions` that `rank` is a
/// member of (the gradients its shards hold partially summed over its tensor-parallel
/// group `tp_group` first), sharded by memory under the distributed optimizer.
pub(super) fn main_grads(
    config: &TrainConfig,
    chunks: &[Stage],
    reductions: Vec<GradientReduction>,
    rank: usize,
    tp_group: &[usize],
) -> Result<MainGrads, TrainError> {
    let plan = &config.parallel.plan;
    let mine: Vec<GradientReduction> = reductions
        .into_iter()
        .filter(|r| r.members.contains(&rank))
        .collect();
    let grads = MainGrads::new(
        chunks,
        &plan.chunk_pieces(rank),
        plan.num_layers(),
        &mine,
        rank_precision(config, rank) != Precision::Fp32,
    )?
    .summing_over(tp_group.to_vec(), chunks)
    .bucketed(|members| config.parallel.bucket_size(members.len()));
    let buckets = grads.bucket_sizes();
    if config.parallel.overlap_grad_reduce && buckets.iter().any(|b| b.len() > 1) {
        let sizes: Vec<String> = (buckets.iter()).map(|b| format!("{b:?}")).collect();
        tracing::info!(
            "gradient reductions in buckets of elements, each started inside the last backward once final: {}",
            sizes.join(", ")
        );
    }
    Ok(match config.optimizer.distributed {
        true => grads.sharded(|members| plan.memory_shares(members)),
        false => grads,
    })
}

/// The optimizer of the parameters this rank updates, and the distributed optimizer's
/// shards when `--use-distributed-optimizer` (built from the fp32 initial values, which
/// are dropped after).
pub(super) fn build_optimizers(
    config: &TrainConfig,
    chunks: &mut [Stage],
    grads: &MainGrads,
    rank: usize,
    fp32_values: BTreeMap<String, Tensor>,
) -> Result<(AdamW, Option<DistributedOptimizer>), TrainError> {
    let zero = config.optimizer.distributed.then(|| {
        let adam = config.optimizer.adam;
        let mixed = |members: &[usize]| mixes_precisions(config, members);
        DistributedOptimizer::new(adam, grads.layouts(), rank, &fp32_values, &mixed)
    });
    let sharded = zero
        .as_ref()
        .map(DistributedOptimizer::names)
        .unwrap_or_default();
    let kind = compute_kind(rank_precision(config, rank));
    let optimizer = build_optimizer(config, chunks, kind, &fp32_values, &sharded)?;
    Ok((optimizer, zero))
}

/// This rank's state in bytes, measured, and logged.
pub(super) fn memory_report(
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
