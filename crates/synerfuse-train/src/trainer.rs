//! The training loop of one rank: its stage chunks, its replica's micro-batches, the
//! pipeline step, the gradient reductions, AdamW, metrics and checkpoints.
//!
//! Gradients are exact for the global batch whatever the plan: the last stage divides
//! each replica's summed token losses by the global number of loss tokens of the step,
//! so the data-parallel reduction is a plain sum (DESIGN.md §3).

use crate::checkpoint::{self, Checkpoint, CheckpointState};
use crate::comm::{GroupCommunicator, MpiCommunicator, PipelineLinks, ProcessGroups};
use crate::emulation::Emulation;
use crate::grads::MainGrads;
use crate::loader::{Prefetcher, ReplicaLoader};
use crate::metrics::{IterationRecord, JsonLog, RankTimes, TensorBoardWriter};
use crate::optim::{clip_factor, AdamW, AdamWConfig, LrSchedule};
use crate::pipeline::{PipelineEvent, PipelineRank, StepTimes};
use crate::{signals, TrainError};
use std::path::PathBuf;
use std::time::Instant;
use synerfuse_data::gpt::{SampleOptions, SplitDataset};
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::{DeviceRequest, LlamaConfig, Stage};
use synerfuse_parallel::{GroupKind, Instruction, ParallelPlan, ScheduleKind};

/// The embedding's parameter name (tied copies are reduced over the embedding group).
const EMBEDDING: &str = "model.embed_tokens.weight";

/// Everything a run is configured with (the CLI's flags, resolved).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The model.
    pub model: LlamaConfig,
    /// Where work goes.
    pub plan: ParallelPlan,
    /// Pipeline schedule.
    pub schedule: ScheduleKind,
    /// `--seq-length`.
    pub sequence_length: usize,
    /// `--train-iters`.
    pub train_iters: u64,
    /// Learning rate over consumed samples.
    pub lr: LrSchedule,
    /// AdamW hyper-parameters.
    pub adam: AdamWConfig,
    /// `--clip-grad` (0 = off).
    pub clip_grad: f64,
    /// `--bf16`: compute in bf16 with fp32 master weights and fp32 gradient reduction.
    pub bf16: bool,
    /// `--seed`.
    pub seed: u64,
    /// `--recompute-activations` (full recomputation of each stage chunk).
    pub recompute: bool,
    /// `--device` for ranks the plan does not place.
    pub device: DeviceRequest,
    /// `--emulate-device-speed`: one factor per rank, overriding the plan's.
    pub emulate_speed: Option<Vec<f64>>,
    /// `--save`.
    pub save: Option<PathBuf>,
    /// `--save-interval`.
    pub save_interval: Option<u64>,
    /// `--load`.
    pub load: Option<PathBuf>,
    /// `--exit-interval`: stop (saving first, with `--save`) after an iteration that is a
    /// multiple of this.
    pub exit_interval: Option<u64>,
    /// `--finetune-from-hf`: initial weights from a Hugging Face LLaMA directory.
    pub finetune_from_hf: Option<PathBuf>,
    /// `--log-interval`.
    pub log_interval: u64,
    /// `--log-json`.
    pub log_json: Option<PathBuf>,
    /// `--tensorboard-dir`.
    pub tensorboard_dir: Option<PathBuf>,
    /// Start each chunk's data-parallel reduction as soon as its last backward ends
    /// (off with `--no-overlap-grad-reduce`).
    pub overlap_grad_reduce: bool,
    /// Read the next step's micro-batches on a background thread (`--num-workers` > 0).
    pub prefetch: bool,
}

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
}

/// The device of this rank: the plan's placement, else `--device`; `cuda`/`auto`
/// without an index pick GPU `local_rank mod count`.
fn rank_device(request: &str, rank: usize, local_rank: usize) -> Result<Device, TrainError> {
    request
        .parse::<DeviceRequest>()
        .and_then(|r| r.resolve_for_local_rank(local_rank))
        .map_err(|source| TrainError::Device { rank, source })
}

/// Warns when the CPU ranks' emulated speeds add up to more cores than this machine has:
/// emulation charges CPU time, so it stays faithful only while every emulated device can
/// get its share of a core.
fn warn_if_emulation_oversubscribes(config: &TrainConfig, world_size: usize) {
    let (_, local_size) = crate::comm::launcher_local_rank();
    if local_size != world_size {
        return; // several nodes: each node's share is not known here
    }
    let cpu_speed: f64 = (0..world_size)
        .filter_map(|r| {
            let placement = config.plan.ranks.get(r);
            let on_cpu = placement.map_or(config.device == DeviceRequest::Cpu, |p| {
                p.device.starts_with("cpu")
            });
            let speed = match &config.emulate_speed {
                Some(speeds) => speeds.get(r).copied(),
                None => placement.and_then(|p| p.speed),
            };
            speed.filter(|_| on_cpu)
        })
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

/// One rank of a training job.
pub struct Trainer<'w> {
    config: TrainConfig,
    world: &'w MpiCommunicator,
    groups: ProcessGroups,
    /// How activations reach the neighbouring stages.
    links: PipelineLinks,
    chunks: Vec<Stage>,
    optimizer: AdamW,
    /// fp32 main gradients, one buffer per chunk.
    grads: MainGrads,
    program: Vec<Instruction>,
    loader: Prefetcher,
    stage_index: usize,
    num_stages: usize,
    replica: usize,
    emulation: Option<Emulation>,
    iteration: u64,
    consumed_samples: u64,
}

impl<'w> Trainer<'w> {
    /// Builds this rank's part of the model (layout-independent initialisation, or the
    /// checkpoint of `--load`, or `--finetune-from-hf`) and its optimizer and loader.
    /// Collective over `world`.
    pub fn new(
        world: &'w MpiCommunicator,
        config: TrainConfig,
        dataset: SplitDataset,
        sample_options: SampleOptions,
        local_rank: usize,
    ) -> Result<Self, TrainError> {
        let rank = world.rank();
        let plan = &config.plan;
        let topology = plan.topology()?;
        if topology.world_size() != world.size() {
            return Err(TrainError::Config(format!(
                "the plan is for {} ranks but the job has {}; launch with -np {}",
                topology.world_size(),
                world.size(),
                topology.world_size()
            )));
        }
        let t = &plan.topology;
        if t.tp != 1 || t.cp != 1 || t.ep != 1 {
            return Err(TrainError::Config(format!(
                "--tensor-model-parallel-size {} / --context-parallel-size {} / --expert-model-parallel-size {}: \
                 only 1 is supported for now (pipeline and data parallelism are)",
                t.tp, t.cp, t.ep
            )));
        }
        if plan.stages.num_layers() != config.model.num_layers {
            return Err(TrainError::Config(format!(
                "the plan's stages hold {} layers but --num-layers is {}",
                plan.stages.num_layers(),
                config.model.num_layers
            )));
        }
        let coords = topology.coordinates(rank)?;
        let placement = plan.ranks.get(rank);
        let device_name = placement.map_or_else(|| config.device.to_string(), |p| p.device.clone());
        let device = rank_device(&device_name, rank, local_rank)?;
        let speed = match &config.emulate_speed {
            Some(speeds) if speeds.len() != world.size() => {
                return Err(TrainError::Config(format!(
                    "--emulate-device-speed has {} factors but the job has {} ranks",
                    speeds.len(),
                    world.size()
                )))
            }
            Some(speeds) => Some(speeds[rank]),
            None => placement.and_then(|p| p.speed),
        };
        if let Some(s) = speed {
            if !(s > 0.0 && s <= 1.0) {
                return Err(TrainError::Config(format!(
                    "rank {rank}: emulated device speed {s} must be in (0, 1]"
                )));
            }
        }
        let emulation = speed.map(|speed| Emulation { speed, device });
        if let Some(e) = emulation {
            let clock = if device == Device::Cpu {
                "CPU time of one core"
            } else {
                "its synchronised compute time"
            };
            tracing::info!(
                "device emulation: this rank runs at {:.3}x of {clock} on {device:?}; each forward and backward lasts its cost / {:.3} (a test and benchmark device, not real hardware)",
                e.speed,
                e.speed
            );
        }
        if rank == 0 {
            warn_if_emulation_oversubscribes(&config, world.size());
        }
        let groups = ProcessGroups::with_devices(world, &topology, device)?;
        let num_stages = plan.stages.num_stages();
        let num_chunks = plan.stages.num_chunks();
        if num_chunks > 1 && num_stages == 1 {
            return Err(TrainError::Config(
                "virtual pipeline chunks need at least two pipeline stages".into(),
            ));
        }
        let mut chunks = Vec::with_capacity(num_chunks);
        for chunk in 0..num_chunks {
            let layers = plan
                .stages
                .chunk_range(coords.pp, chunk)
                .expect("stage and chunk within the layout");
            if layers.is_empty() {
                return Err(TrainError::Config(format!(
                    "pipeline stage {} chunk {chunk} has no layers",
                    coords.pp
                )));
            }
            let mut stage = Stage::new(&config.model, layers, device)?;
            stage.init_by_name(config.seed);
            stage.set_recompute(config.recompute);
            chunks.push(stage);
        }
        if let Some(dir) = &config.finetune_from_hf {
            for stage in &mut chunks {
                synerfuse_model::hf::load_weights(stage, dir)?;
            }
        }
        // fp32 values before a bf16 cast become the optimizer's master weights exactly.
        let fp32_values: Vec<(String, Tensor)> = chunks
            .iter()
            .flat_map(|s| s.var_store().variables())
            .map(|(n, t)| (n, t.detach().copy()))
            .collect();
        if config.bf16 {
            for stage in &mut chunks {
                stage.set_kind(Kind::BFloat16);
            }
        }
        let mut optimizer = AdamW::new(
            config.adam,
            chunks.iter().flat_map(|s| s.var_store().variables()),
        );
        if config.bf16 {
            for (name, value) in &fp32_values {
                optimizer
                    .load_param(name, value, None, None)
                    .map_err(|e| TrainError::Config(e.to_string()))?;
            }
        }
        let mut programs = synerfuse_parallel::plan_schedule(plan, config.schedule)?;
        let links = PipelineLinks::new(
            world,
            &groups,
            &topology.groups(GroupKind::Pp),
            num_chunks > 1,
            &programs,
        )?;
        let program = programs.swap_remove(rank);
        let loader = ReplicaLoader::new(dataset, plan.batches.clone(), coords.dp, sample_options)?;
        let loader = Prefetcher::new(loader, config.prefetch);
        let grads = MainGrads::new(&chunks, config.bf16);
        let mut trainer = Trainer {
            world,
            groups,
            links,
            chunks,
            optimizer,
            grads,
            program,
            loader,
            stage_index: coords.pp,
            num_stages,
            replica: coords.dp,
            emulation,
            iteration: 0,
            consumed_samples: 0,
            config,
        };
        if let Some(load) = trainer.config.load.clone() {
            match Checkpoint::open_latest(&load)? {
                Some(checkpoint) => trainer.restore(&checkpoint)?,
                None => tracing::warn!(
                    "--load {}: no checkpoint found (no `{}` file); training from scratch",
                    load.display(),
                    checkpoint::LATEST
                ),
            }
        }
        Ok(trainer)
    }

    /// Iterations completed so far.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    fn restore(&mut self, checkpoint: &Checkpoint) -> Result<(), TrainError> {
        let names: Vec<String> = self.optimizer.names().map(str::to_owned).collect();
        let values = checkpoint.tensors("model-", &names)?;
        let moment_names: Vec<String> = names
            .iter()
            .flat_map(|n| [format!("{n}.exp_avg"), format!("{n}.exp_avg_sq")])
            .collect();
        let moments = checkpoint.tensors("optimizer-", &moment_names)?;
        for name in &names {
            self.optimizer
                .load_param(
                    name,
                    &values[name],
                    moments.get(&format!("{name}.exp_avg")),
                    moments.get(&format!("{name}.exp_avg_sq")),
                )
                .map_err(|e| TrainError::Checkpoint {
                    path: checkpoint.dir.clone(),
                    problem: e.to_string(),
                })?;
        }
        let state = &checkpoint.state;
        self.optimizer.set_steps(state.optimizer_steps);
        self.iteration = state.iteration;
        self.consumed_samples = state.consumed_samples;
        tch::manual_seed(state.rng_seed as i64);
        if self.world.rank() == 0 {
            tracing::info!(
                "loaded checkpoint {} (iteration {}, {} consumed samples, written under a plan of {} stages x {} replicas)",
                checkpoint.dir.display(),
                state.iteration,
                state.consumed_samples,
                state.plan.stages.num_stages(),
                state.plan.batches.dp_size()
            );
        }
        Ok(())
    }

    fn group(&self, kind: GroupKind) -> Option<&GroupCommunicator> {
        self.groups.get(kind).filter(|g| g.size() > 1)
    }

    /// Whether this rank holds the last stage's tied copy of the embedding (which the
    /// norm and checkpoints skip: the first stage's copy is the parameter).
    fn holds_tied_copy(&self) -> bool {
        self.config.model.tie_word_embeddings
            && self.num_stages > 1
            && self.stage_index + 1 == self.num_stages
    }

    /// Trains until `--train-iters` or SIGTERM.
    pub fn train(&mut self) -> Result<TrainSummary, TrainError> {
        let rank = self.world.rank();
        let mut json = match (&self.config.log_json, rank) {
            (Some(path), 0) => Some(JsonLog::open(path).map_err(|e| TrainError::Io {
                path: path.clone(),
                source: e,
            })?),
            _ => None,
        };
        let mut tensorboard = match (&self.config.tensorboard_dir, rank) {
            (Some(dir), 0) => Some(TensorBoardWriter::create(dir).map_err(|e| TrainError::Io {
                path: dir.clone(),
                source: e,
            })?),
            _ => None,
        };
        let global_batch = self.config.plan.batches.global_batch_size() as u64;
        let tokens_per_step = global_batch as f64 * self.config.sequence_length as f64;
        // This rank's replica's tokens per step (every stage of a replica sees the same).
        let replica_tokens = self.config.plan.batches.replicas()[self.replica].samples()
            * self.config.sequence_length;
        let flops_per_token = 6.0 * self.config.model.num_parameters() as f64
            + 12.0
                * (self.config.model.num_layers
                    * self.config.model.hidden_size
                    * self.config.sequence_length) as f64;
        let mut summary = TrainSummary {
            iteration: self.iteration,
            losses: Vec::new(),
            stopped_by_signal: false,
            saved: Vec::new(),
        };
        while self.iteration < self.config.train_iters {
            let started = Instant::now();
            let (loss_sum, loss_tokens, lr, grad_norm, times) = self.step()?;
            let elapsed = started.elapsed();
            // One small all-gather per step: losses, times and the stop flag of every rank.
            let stop = signals::stop_requested();
            let mine = Tensor::from_slice(&[
                loss_sum,
                times.compute.as_secs_f64() * 1e3,
                times.communication.as_secs_f64() * 1e3,
                times.waiting.as_secs_f64() * 1e3,
                elapsed.as_secs_f64() * 1e3,
                f64::from(u8::from(stop)),
                replica_tokens as f64,
            ]);
            let all = self.world.all_gather(&mine)?;
            let rows: Vec<Vec<f64>> = (0..self.world.size())
                .map(|r| Vec::<f64>::try_from(all.get(r as i64)).unwrap_or_default())
                .collect();
            let loss = rows.iter().map(|r| r[0]).sum::<f64>() / loss_tokens;
            let any_stop = rows.iter().any(|r| r[5] > 0.0);
            let step_ms = rows.iter().map(|r| r[4]).fold(0.0, f64::max);
            self.iteration += 1;
            self.consumed_samples += global_batch;
            summary.iteration = self.iteration;
            summary.losses.push(loss);
            if rank == 0 {
                let record = IterationRecord {
                    iteration: self.iteration,
                    train_iters: self.config.train_iters,
                    consumed_samples: self.consumed_samples,
                    lr,
                    loss,
                    grad_norm,
                    elapsed_ms: step_ms,
                    tokens_per_s: tokens_per_step / (step_ms / 1e3),
                    tflops_per_device: flops_per_token * tokens_per_step
                        / (step_ms / 1e3)
                        / self.world.size() as f64
                        / 1e12,
                    global_batch_size: global_batch as usize,
                    ranks: rows
                        .iter()
                        .map(|r| RankTimes {
                            compute_ms: r[1],
                            communication_ms: r[2],
                            idle_ms: (r[4] - r[1] - r[2]).max(0.0),
                            tokens_per_s: r[6] / (step_ms / 1e3),
                        })
                        .collect(),
                };
                if self.iteration % self.config.log_interval.max(1) == 0
                    || self.iteration == self.config.train_iters
                {
                    println!("{}", record.log_line());
                }
                if let Some(json) = &mut json {
                    json.write(&record).map_err(|e| TrainError::Io {
                        path: json.path().to_path_buf(),
                        source: e,
                    })?;
                }
                if let Some(tb) = &mut tensorboard {
                    tb.scalars(
                        self.iteration,
                        &[
                            ("lm-loss", loss),
                            ("learning-rate", lr),
                            ("grad-norm", grad_norm),
                            ("iteration-time", step_ms / 1e3),
                            ("tokens-per-second", record.tokens_per_s),
                        ],
                    )
                    .map_err(|e| TrainError::Io {
                        path: tb.path().to_path_buf(),
                        source: e,
                    })?;
                }
            }
            let last = self.iteration == self.config.train_iters;
            let interval = self
                .config
                .save_interval
                .is_some_and(|n| n > 0 && self.iteration % n == 0);
            let exit = self
                .config
                .exit_interval
                .is_some_and(|n| n > 0 && self.iteration % n == 0);
            if self.config.save.is_some() && (interval || last || any_stop || exit) {
                summary.saved.push(self.save()?);
            }
            if exit && !last {
                if rank == 0 {
                    tracing::info!(
                        "exiting after iteration {} (--exit-interval)",
                        self.iteration
                    );
                }
                break;
            }
            if any_stop {
                if rank == 0 {
                    tracing::warn!(
                        "{} received: stopped after iteration {}{}",
                        if signals::stop_requested() {
                            signals::stop_signal_name()
                        } else {
                            "a stop signal (on another rank)"
                        },
                        self.iteration,
                        if self.config.save.is_some() {
                            " and saved a checkpoint"
                        } else {
                            " (no --save, nothing saved)"
                        }
                    );
                }
                summary.stopped_by_signal = true;
                break;
            }
        }
        Ok(summary)
    }

    /// One iteration: returns (this rank's loss sum, global loss tokens, lr, grad norm,
    /// times).
    fn step(&mut self) -> Result<(f64, f64, f64, f64, StepTimes), TrainError> {
        let micro_batches = self.loader.step(self.consumed_samples)?;
        let mut times = StepTimes::default();
        // The global number of loss tokens: this replica's, summed over replicas.
        let local_tokens: f64 = micro_batches.iter().map(|m| m.loss_tokens()).sum();
        let mut tokens = Tensor::from_slice(&[local_tokens]);
        let started = Instant::now();
        if let Some(dp) = self.group(GroupKind::Dp) {
            dp.all_reduce_sum(&mut tokens)?;
        }
        times.communication += started.elapsed();
        let global_tokens = tokens.double_value(&[0]);
        if global_tokens <= 0.0 {
            return Err(TrainError::Config(format!(
                "the global batch after {} samples has no loss tokens",
                self.consumed_samples
            )));
        }
        self.optimizer.zero_grad();
        self.grads.begin_step(&self.program);
        let pipeline = PipelineRank {
            chunks: &self.chunks,
            stage_index: self.stage_index,
            num_stages: self.num_stages,
            world: self.world,
            links: &self.links,
            activation_kind: if self.config.bf16 {
                Kind::BFloat16
            } else {
                Kind::Float
            },
            emulation: self.emulation,
        };
        let dp = self.groups.get(GroupKind::Dp).filter(|g| g.size() > 1);
        let overlap = self.config.overlap_grad_reduce;
        let main_grads = &mut self.grads;
        let mut on_event = |event: PipelineEvent| -> Result<(), TrainError> {
            match event {
                PipelineEvent::BackwardDone { chunk } => {
                    main_grads.after_backward(chunk, dp, overlap)?
                }
                PipelineEvent::Between => main_grads.progress(),
            }
            Ok(())
        };
        let (loss, pipeline_times) = pipeline.run(
            &self.program,
            &micro_batches,
            self.config.sequence_length,
            global_tokens,
            &mut on_event,
        )?;
        times.compute += pipeline_times.compute;
        times.communication += pipeline_times.communication;
        times.waiting += pipeline_times.waiting;
        if injected_fault(self.world.rank(), self.iteration + 1) {
            eprintln!(
                "rank {}: SYNERFUSE_FAULT_INJECT: exiting in the middle of iteration {}",
                self.world.rank(),
                self.iteration + 1
            );
            std::process::exit(3);
        }
        // The fp32 main gradients, reduced over the replicas (started during the
        // pipeline when overlapping).
        let started = Instant::now();
        self.grads.finish(dp)?;
        let mut grads = self.grads.grads();
        if self.config.model.tie_word_embeddings {
            if let (Some(group), Some(g)) =
                (self.group(GroupKind::Embedding), grads.get_mut(EMBEDDING))
            {
                group.all_reduce_sum(g)?;
            }
        }
        // Global norm: every parameter once (the tied copy on the last stage skipped),
        // summed over the stages of this pipeline; replicas hold identical gradients now.
        let mut norm_sq = Tensor::from_slice(&[grads
            .iter()
            .filter(|(n, _)| !(self.holds_tied_copy() && n.as_str() == EMBEDDING))
            .map(|(_, g)| {
                let g = g.to_kind(Kind::Double);
                (&g * &g).sum(Kind::Double).double_value(&[])
            })
            .sum::<f64>()]);
        if let Some(pp) = self.group(GroupKind::Pp) {
            pp.all_reduce_sum(&mut norm_sq)?;
        }
        times.communication += started.elapsed();
        let grad_norm = norm_sq.double_value(&[0]).sqrt();
        let started = Instant::now();
        let lr = self.config.lr.lr(self.consumed_samples);
        let factor = clip_factor(grad_norm, self.config.clip_grad);
        self.optimizer.step_with_grads(lr, &grads, factor);
        times.compute += started.elapsed();
        Ok((loss.loss_sum, global_tokens, lr, grad_norm, times))
    }

    /// Writes a checkpoint of the current iteration (collective).
    pub fn save(&mut self) -> Result<PathBuf, TrainError> {
        let save = self
            .config
            .save
            .clone()
            .ok_or_else(|| TrainError::Config("saving needs --save".into()))?;
        let rank = self.world.rank();
        if rank == 0 {
            checkpoint::prepare(&save, self.iteration)?;
        }
        self.world.barrier();
        if self.replica == 0 {
            let skip_tied = self.holds_tied_copy();
            let mut params = Vec::new();
            let mut moments = Vec::new();
            for (name, value, m, v) in self.optimizer.state() {
                if skip_tied && name == EMBEDDING {
                    continue;
                }
                params.push((name.to_owned(), value.to_kind(Kind::Float)));
                moments.push((format!("{name}.exp_avg"), m.shallow_clone()));
                moments.push((format!("{name}.exp_avg_sq"), v.shallow_clone()));
            }
            checkpoint::write_shard(
                &checkpoint::staging_dir(&save, self.iteration),
                self.stage_index,
                self.num_stages,
                &params,
                &moments,
            )?;
        }
        self.world.barrier();
        let dir = save.join(checkpoint::iteration_dir(self.iteration));
        if rank == 0 {
            let state = CheckpointState {
                iteration: self.iteration,
                consumed_samples: self.consumed_samples,
                optimizer_steps: self.optimizer.steps(),
                seed: self.config.seed,
                rng_seed: self.config.seed.wrapping_add(self.iteration),
                model: serde_json::from_str(&self.config.model.to_hf_json())
                    .unwrap_or(serde_json::Value::Null),
                plan: self.config.plan.clone(),
                bf16: self.config.bf16,
            };
            checkpoint::commit(&save, &state)?;
            tracing::info!(
                "saved checkpoint {} (iteration {})",
                dir.display(),
                self.iteration
            );
        }
        self.world.barrier();
        Ok(dir)
    }
}
