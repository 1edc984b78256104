//! One rank's trainer: what it holds, and how it is built. The struct sits beneath the
//! files that give it its behaviour (the loop in [`super`], saving, switching plans,
//! evaluating): they depend on it, it on none of them.

use super::config::TrainConfig;
use super::replanning::Replanning;
use super::save_record::{PendingSave, SaveRecord};
use super::setup::{
    build_chunks, build_loaders, build_optimizers, check_plan, compute_kind, fp32_copies,
    held_experts, log_precision, main_grads, memory_report, rank_context, rank_device,
    rank_emulation, rank_experts, rank_groups, rank_precision, rank_programs, sequence_rows,
    warn_if_emulation_oversubscribes, ContextLayout, ExpertMembers,
};
use crate::checkpoint::{self, Checkpoint};
use crate::comm::{MpiCommunicator, PipelineLinks, SetGroups};
use crate::emulation::Emulation;
use crate::grads::MainGrads;
use crate::loader::{Prefetcher, ReplicaLoader, SplitDatasets};
use crate::loss_scale::GradScaler;
use crate::memory::{MemoryProbe, MemoryReport};
use crate::optim::AdamW;
use crate::replan::SpeedWatch;
use crate::zero::DistributedOptimizer;
use crate::TrainError;
use std::collections::BTreeMap;
use std::time::Instant;
use synerfuse_data::gpt::SampleOptions;
use synerfuse_model::tch::{Device, Kind};
use synerfuse_model::Stage;
use synerfuse_plan::Instruction;

/// One rank of a training job.
pub struct Trainer<'w> {
    pub(super) config: TrainConfig,
    pub(super) world: &'w MpiCommunicator,
    /// This rank's communicators for its gradient reductions.
    pub(super) groups: SetGroups,
    /// How activations reach the neighbouring stages.
    pub(super) links: PipelineLinks,
    pub(super) chunks: Vec<Stage>,
    pub(super) optimizer: AdamW,
    /// The distributed optimizer's shards (`--use-distributed-optimizer`).
    pub(super) zero: Option<DistributedOptimizer>,
    /// This rank's memory, measured.
    pub(super) memory: MemoryReport,
    /// Steps this process has run.
    pub(super) steps_run: u64,
    /// Where this rank's memory in use is read.
    pub(super) memory_probe: Option<MemoryProbe>,
    /// fp32 main gradients, one buffer per chunk, and their reductions.
    pub(super) grads: MainGrads,
    pub(super) program: Vec<Instruction>,
    /// The forward-only program evaluations run.
    pub(super) eval_program: Vec<Instruction>,
    /// The train split's loader (none when only evaluating without train data).
    pub(super) loader: Option<Prefetcher>,
    /// The validation and test splits' loaders, when evaluating.
    pub(super) valid: Option<ReplicaLoader>,
    pub(super) test: Option<ReplicaLoader>,
    pub(super) stage_index: usize,
    pub(super) num_stages: usize,
    pub(super) replica: usize,
    /// The world ranks of this rank's stage: its tensor-parallel group (one rank
    /// without tensor parallelism).
    pub(super) tp_group: Vec<usize>,
    /// The stage's context-parallel group and its members' positions, when it has one.
    pub(super) context: Option<ContextLayout>,
    /// The stage's expert-parallel group (its ranks) and each member's experts, when it
    /// holds only some.
    pub(super) experts: Option<ExpertMembers>,
    /// Under sequence parallelism, each rank's sequence rows (see [`sequence_rows`]).
    pub(super) peer_rows: BTreeMap<usize, (usize, usize)>,
    pub(super) emulation: Option<Emulation>,
    /// This rank's device (an emulated speed change needs it).
    pub(super) device: Device,
    /// Every rank's pace, watched for sustained changes.
    pub(super) watch: SpeedWatch,
    /// Step times and switches, for re-planning.
    pub(super) replanning: Replanning,
    /// Seconds this rank took to build the trainer (what a switch does again).
    pub(super) setup_s: f64,
    /// What a switch builds the new plan's loaders from.
    pub(super) datasets: SplitDatasets,
    pub(super) sample_options: SampleOptions,
    pub(super) local_rank: usize,
    pub(super) iteration: u64,
    pub(super) consumed_samples: u64,
    /// Every world rank's dtype (pipeline messages arrive in their sender's).
    pub(super) rank_kinds: Vec<Kind>,
    /// The job's loss scale (one for every rank).
    pub(super) scaler: GradScaler,
    /// Samples of the iterations skipped for an overflow: the learning-rate schedule
    /// does not advance over them (Megatron steps its scheduler only after an update).
    pub(super) skipped_samples: u64,
    /// A checkpoint a background thread is writing (`--async-save`).
    pub(super) pending_save: Option<PendingSave>,
    /// Saves finished and not yet logged.
    pub(super) finished_saves: Vec<SaveRecord>,
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
        let mut trainer = Self::build(world, config, datasets, sample_options, local_rank)?;
        trainer.load_latest()?;
        trainer.remember_for_survivors()?;
        trainer.setup_s = started.elapsed().as_secs_f64();
        Ok(trainer)
    }

    /// This rank's parts as the configuration and the plan make them (its place, its
    /// communicators, chunks, programs, loaders, main gradients and optimizers), at
    /// iteration 0: [`Self::new`] then resumes from `--load`. Collective over `world`.
    fn build(
        world: &'w MpiCommunicator,
        config: TrainConfig,
        datasets: SplitDatasets,
        sample_options: SampleOptions,
        local_rank: usize,
    ) -> Result<Self, TrainError> {
        let rank = world.rank();
        let (replica, stage_index) = check_plan(&config, world.size(), rank)?;
        let device = rank_device(&config, rank, local_rank)?;
        log_precision(&config, rank);
        crate::precision::check_device_runs(rank_precision(&config, rank), device, rank)?;
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
        let context = rank_context(&config, (replica, stage_index), (tp_rank, cp_rank))?;
        let experts = rank_experts(&config, rank)?;
        let held = held_experts(experts.as_ref(), rank);
        let mut chunks = build_chunks(&config, (replica, stage_index), (tp_rank, held), device)?;
        let fp32_values = fp32_copies(&chunks);
        let (links, program, eval_program) = rank_programs(world, &groups, &config)?;
        let kept = datasets.clone();
        let (loader, valid, test) = build_loaders(&config, datasets, replica, sample_options)?;
        let grads = main_grads(&config, &chunks, reductions, rank, &tp_group)?;
        let (optimizer, zero) = build_optimizers(&config, &mut chunks, &grads, rank, fp32_values)?;
        let memory = memory_report(&chunks, &grads, &optimizer, zero.as_ref());
        let num_stages = plan.replicas()[replica].stages.num_stages();
        Ok(Trainer {
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
            replanning: Replanning::new(config.replan.watch.window),
            setup_s: 0.0,
            datasets: kept,
            sample_options,
            local_rank,
            iteration: 0,
            consumed_samples: 0,
            rank_kinds: (0..world.size())
                .map(|r| compute_kind(rank_precision(&config, r)))
                .collect(),
            scaler: GradScaler::new(config.compute.loss_scaling),
            skipped_samples: 0,
            pending_save: None,
            finished_saves: Vec::new(),
            config,
        })
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
}
