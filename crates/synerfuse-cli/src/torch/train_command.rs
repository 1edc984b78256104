//! `synerfuse train`: Megatron's / SynerFuse's training flags (or `--plan`) → a
//! `synerfuse_train::Trainer` on every rank.

use crate::data_commands::TokenizerFlags;
use crate::index_command::{data_flag_error, gpt_data_config};
use crate::model_flags::{ModelFlags, PrecisionFlags};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;
use synerfuse_data::gpt::{
    build_mock_split_datasets, build_split_datasets, DataSources, MockDocuments, SampleBudget,
    SampleOptions,
};
use synerfuse_data::tokenizer::Tokenizer;
use synerfuse_model::{DeviceRequest, LlamaConfig};
use synerfuse_plan::{
    BatchError, GridError, LayoutError, MeshFlags, Plan, PlanError, PlanFlags, Precision,
    ProcessMeshes, ScheduleKind, TpLayout,
};
use synerfuse_train::comm::{
    launcher_local_rank, launcher_rank, relaunch_under_mpirun, watchdog, MpiCommunicator,
    MpiRuntime,
};
use synerfuse_train::loader::{build_splits, LoaderError};
use synerfuse_train::loss_scale::{DynamicLossScale, LossScaling};
use synerfuse_train::optim::{AdamWConfig, DecayStyle, LrSchedule, LrScheduleError};
use synerfuse_train::replan::{ReplanMode, SpeedChange, WatchConfig};
use synerfuse_train::trainer::{
    BatchConfig, CheckpointConfig, ComputeConfig, DataConfig, EvalConfig, LoggingConfig,
    OptimizerConfig, ParallelConfig, ReplanConfig,
};
use synerfuse_train::{signals, TrainConfig, TrainError, Trainer};

/// `synerfuse train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    // ---- launch
    /// Start N ranks on this machine (re-launches itself under `mpirun -np N` unless already
    /// started by mpirun or srun)
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Launch")]
    nproc: Option<usize>,
    /// Device of every rank the plan does not place: cpu, cuda, cuda:N or auto
    #[arg(long, default_value = "auto", help_heading = "Launch")]
    device: DeviceRequest,
    /// Emulated speed per rank, e.g. 0.5,0.5,0.25,0.16: on a CPU rank each computation
    /// lasts its CPU time / speed (speed 1 = one core), on a GPU its time / speed (a test
    /// and benchmark device)
    #[arg(long, value_parser = crate::values::speed, value_delimiter = ',', help_heading = "Launch")]
    emulate_device_speed: Option<Vec<f64>>,
    /// ITER:RANK:SPEED: from iteration ITER on, emulate RANK at SPEED (repeatable; a test
    /// and benchmark of stragglers)
    #[arg(long, value_name = "ITER:RANK:SPEED", help_heading = "Launch")]
    emulate_speed_change: Vec<SpeedChange>,
    /// A rank's forward and backward time per step off what the plan assumed by more than
    /// this fraction (0.2 = 20 %) on every one of --replan-window steps is a sustained
    /// change of its speed, logged (and re-planned for under --replan auto)
    #[arg(long, value_parser = crate::values::positive, default_value_t = WatchConfig::default().threshold, help_heading = "Launch")]
    replan_threshold: f64,
    /// auto: when a rank's speed changes for good, plan again with every rank's measured
    /// speed and switch plans in the running job when the predicted gain over the
    /// remaining iterations exceeds the cost of switching; off: only log whether it would
    /// have paid
    #[arg(
        long,
        default_value = "off",
        value_name = "auto|off",
        help_heading = "Launch"
    )]
    replan: ReplanMode,
    /// Steps a change must last (and the first steps that set each rank's assumed pace)
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = WatchConfig::default().window, help_heading = "Launch")]
    replan_window: usize,
    /// Intra-op threads per rank [default: this machine's cores / ranks on it]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Launch")]
    threads: Option<usize>,
    /// Bound on every wait between ranks, in minutes (fractions allowed): a rank that
    /// waits longer ends the job, naming itself, the operation and the group or peer
    #[arg(long, value_parser = crate::values::positive_minutes, default_value_t = 10.0, help_heading = "Launch")]
    distributed_timeout_minutes: f64,

    // ---- parallelism
    /// A plan written by `synerfuse plan` (layers per stage, batches per replica, devices)
    #[arg(long, help_heading = "Parallelism")]
    plan: Option<PathBuf>,
    /// Ranks per tensor-parallel group (Megatron's column/row-parallel layers and
    /// vocabulary-parallel embedding and loss) [default: 1]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    tensor_model_parallel_size: Option<usize>,
    /// Ranks per context-parallel group: each holds part of every sequence (Megatron's
    /// load-balanced chunks) and they exchange keys and values [default: 1]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    context_parallel_size: Option<usize>,
    /// Data-parallel replicas per expert-parallel group: consecutive replicas each hold an
    /// even part of every MoE layer's experts and exchange tokens [default: 1]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    expert_model_parallel_size: Option<usize>,
    /// FlagScale/SynerFuse: lay the job out by --hetero-process-meshes
    #[arg(long, help_heading = "Parallelism")]
    enable_hetero: bool,
    /// `TP CP EP DP PP` per mesh: runs of consecutive pipeline stages, each mesh with its
    /// own tensor-, context- and expert-parallel sizes (every mesh the same DP)
    #[arg(long, value_parser = crate::values::positive_count, num_args = 1.., help_heading = "Parallelism")]
    hetero_process_meshes: Vec<usize>,
    /// One device type per mesh (names, e.g. A800 BI150)
    #[arg(long, num_args = 1.., help_heading = "Parallelism")]
    hetero_device_types: Vec<String>,
    /// The device type of this process's ranks: each rank checks it is its mesh's
    #[arg(long, help_heading = "Parallelism")]
    hetero_current_device_type: Option<String>,
    /// Layers per pipeline stage over all meshes' stages [default: even]
    #[arg(long, value_parser = crate::values::positive_count, num_args = 1.., help_heading = "Parallelism")]
    hetero_pipeline_layer_split: Vec<usize>,
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    pipeline_model_parallel_size: Option<usize>,
    /// SynerFuse: `n0 l.. n1 l..`, layers per pipeline stage by device group
    #[arg(long, value_parser = crate::values::positive_count, num_args = 1.., help_heading = "Parallelism")]
    hetero_pipeline_stages: Vec<usize>,
    /// Rank order tp-pp-dp (each replica a contiguous block of ranks)
    #[arg(long, help_heading = "Parallelism")]
    use_tp_pp_dp_mapping: bool,
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    num_layers_per_virtual_pipeline_stage: Option<usize>,
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    micro_batch_size: Option<usize>,
    /// SynerFuse: `n0 mbs0 n1 mbs1 ...` per group of replicas
    #[arg(long, value_parser = crate::values::positive_count, num_args = 1.., help_heading = "Parallelism")]
    micro_batch_size_per_dp: Vec<usize>,
    /// SynerFuse: `n0 k0 n1 k1 ...` micro-batches per step per group of replicas
    #[arg(long, value_parser = crate::values::positive_count, num_args = 1.., help_heading = "Parallelism")]
    num_micro_batches_per_dp: Vec<usize>,
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    global_batch_size: Option<usize>,
    /// 1f1b, gpipe or interleaved [default: interleaved with virtual stages, else 1f1b]
    #[arg(long, help_heading = "Parallelism")]
    pipeline_schedule: Option<ScheduleKind>,

    // ---- model (Megatron's flags, shared with plan and profile)
    #[command(flatten)]
    model: ModelFlags,
    /// Recompute each stage's activations in the backward (less memory)
    #[arg(long, help_heading = "Model")]
    recompute_activations: bool,
    /// Start from a Hugging Face LLaMA (config.json + safetensors); model flags optional
    #[arg(long, help_heading = "Model")]
    finetune_from_hf: Option<PathBuf>,

    // ---- flags of Megatron/SynerFuse run.sh files, accepted with their meaning here
    /// Sequence parallelism on tensor-parallel stages: norms and residuals on each
    /// rank's sequence rows (the sequence length must divide over the stage's
    /// tensor-parallel size); no effect on stages of one rank, as in Megatron
    #[arg(long)]
    sequence_parallel: bool,
    /// Start each bucket of the data-parallel gradient reduction inside the last
    /// backward, as soon as its gradients are final (the default here, where Megatron's
    /// is off)
    #[arg(long, help_heading = "Parallelism")]
    overlap_grad_reduce: bool,
    /// Parameters (elements) per gradient-reduction bucket when overlapping; default
    /// max(40M, 1M x the data-parallel size), as Megatron's
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Parallelism")]
    ddp_bucket_size: Option<usize>,
    /// Reduce gradients only after the whole pipeline has run (for comparisons)
    #[arg(
        long,
        conflicts_with = "overlap_grad_reduce",
        help_heading = "Parallelism"
    )]
    no_overlap_grad_reduce: bool,
    /// Leave the distributed optimizer's all-gather of the updated parameters in flight
    /// after the step, bucket by bucket, each waited for just before the next forward
    /// reads it (as Megatron's, needs --use-distributed-optimizer and the overlapped
    /// gradient reduction)
    #[arg(
        long,
        requires = "use_distributed_optimizer",
        conflicts_with = "no_overlap_grad_reduce",
        help_heading = "Parallelism"
    )]
    overlap_param_gather: bool,
    /// Reduce each gradient flat over its whole group even where its members sit on
    /// several hosts of the plan (for comparisons; by default such a reduction
    /// reduce-scatters inside each host, exchanges pieces across, gathers inside)
    #[arg(long, help_heading = "Parallelism")]
    no_hierarchical_reduction: bool,
    /// Data-loader workers: 0 reads each step's micro-batches inline, more reads the next
    /// step's on a background thread while this one computes
    #[arg(long, default_value_t = 2, help_heading = "Data")]
    num_workers: usize,
    /// Shard the AdamW state (fp32 masters and moments) over each gradient reduction's
    /// holders, in proportion to their memory (a plan's memory_gb; equal otherwise)
    #[arg(long, help_heading = "Optimisation")]
    use_distributed_optimizer: bool,
    /// nccl or gloo: synerfuse uses NCCL for groups of CUDA ranks and MPI otherwise
    #[arg(long, help_heading = "Megatron compatibility")]
    distributed_backend: Option<String>,
    /// Per-rank compute/communication/idle times are always in --log-json
    #[arg(long, help_heading = "Megatron compatibility")]
    timing_log_level: Option<u32>,

    // ---- optimisation
    #[arg(long, value_parser = crate::values::positive_u64, help_heading = "Optimisation")]
    train_iters: u64,
    #[arg(long, value_parser = crate::values::non_negative, help_heading = "Optimisation")]
    lr: f64,
    #[arg(long, value_parser = crate::values::non_negative, default_value_t = 0.0, help_heading = "Optimisation")]
    min_lr: f64,
    /// cosine, linear or constant
    #[arg(long, default_value = "linear", help_heading = "Optimisation")]
    lr_decay_style: DecayStyle,
    #[arg(long, default_value_t = 0, help_heading = "Optimisation")]
    lr_warmup_iters: u64,
    #[arg(long, value_parser = crate::values::fraction, help_heading = "Optimisation")]
    lr_warmup_fraction: Option<f64>,
    /// [default: --train-iters]
    #[arg(long, value_parser = crate::values::positive_u64, help_heading = "Optimisation")]
    lr_decay_iters: Option<u64>,
    #[arg(long, value_parser = crate::values::non_negative, default_value_t = 0.01, help_heading = "Optimisation")]
    weight_decay: f64,
    #[arg(long, value_parser = crate::values::adam_beta, default_value_t = 0.9, help_heading = "Optimisation")]
    adam_beta1: f64,
    #[arg(long, value_parser = crate::values::adam_beta, default_value_t = 0.999, help_heading = "Optimisation")]
    adam_beta2: f64,
    #[arg(long, value_parser = crate::values::positive, default_value_t = 1e-8, help_heading = "Optimisation")]
    adam_eps: f64,
    #[arg(long, value_parser = crate::values::non_negative, default_value_t = 1.0, help_heading = "Optimisation")]
    clip_grad: f64,
    #[command(flatten)]
    precision: PrecisionFlags,
    /// A constant loss scale (fp16 or bf16) instead of fp16's dynamic one
    #[arg(long, value_parser = crate::values::positive, help_heading = "Optimisation")]
    loss_scale: Option<f64>,
    /// fp16's first dynamic loss scale
    #[arg(long, value_parser = crate::values::positive, default_value_t = 4294967296.0, help_heading = "Optimisation")]
    initial_loss_scale: f64,
    /// The dynamic loss scale never goes below this
    #[arg(long, value_parser = crate::values::positive, default_value_t = 1.0, help_heading = "Optimisation")]
    min_loss_scale: f64,
    /// Steps without an overflow, in a row, before the dynamic loss scale doubles
    #[arg(long, value_parser = crate::values::positive_whole, default_value_t = 1000, help_heading = "Optimisation")]
    loss_scale_window: u64,
    /// Overflows before the dynamic loss scale halves
    #[arg(long, value_parser = crate::values::positive_u64, default_value_t = 2, help_heading = "Optimisation")]
    hysteresis: u64,
    #[arg(long, default_value_t = 1234, help_heading = "Optimisation")]
    seed: u32,

    // ---- evaluation
    /// Global batches per evaluation: of the validation split every --eval-interval
    /// iterations and at the end, of the test split at the end (0: none)
    #[arg(long, default_value_t = 100, help_heading = "Evaluation")]
    eval_iters: u64,
    /// Evaluate the validation split after every this many iterations
    #[arg(long, default_value_t = 1000, value_parser = crate::values::positive_u64, help_heading = "Evaluation")]
    eval_interval: u64,
    /// Only evaluate the validation and test splits, at the iteration --load restores
    #[arg(long, help_heading = "Evaluation")]
    skip_train: bool,
    /// Accepted: the validation perplexity always goes to TensorBoard
    #[arg(long, help_heading = "Megatron compatibility")]
    log_validation_ppl_to_tensorboard: bool,

    // ---- data
    #[arg(long, num_args = 1.., help_heading = "Data")]
    data_path: Vec<String>,
    /// Megatron's synthetic documents instead of --data-path (split 1,1,1, as Megatron)
    #[arg(long, conflicts_with_all = ["data_path", "split", "data_cache_path"], help_heading = "Data")]
    mock_data: bool,
    #[arg(long, help_heading = "Data")]
    split: Option<String>,
    #[arg(long, help_heading = "Data")]
    data_cache_path: Option<PathBuf>,
    #[command(flatten)]
    tokenizer: TokenizerFlags,
    #[arg(long, help_heading = "Data")]
    reset_position_ids: bool,
    #[arg(long, help_heading = "Data")]
    reset_attention_mask: bool,
    #[arg(long, help_heading = "Data")]
    eod_mask_loss: bool,
    #[arg(long, help_heading = "Data")]
    no_create_attention_mask_in_dataloader: bool,

    // ---- checkpoints and logs
    #[arg(long, help_heading = "Checkpoints and logs")]
    save: Option<PathBuf>,
    /// Save every N iterations (0: only at the end, as Megatron treats 0)
    #[arg(long, help_heading = "Checkpoints and logs")]
    save_interval: Option<u64>,
    #[arg(long, help_heading = "Checkpoints and logs")]
    load: Option<PathBuf>,
    /// Write checkpoints in the background: the state is copied to host memory at the step
    /// boundary and training goes on while it is written (the next save waits for it)
    #[arg(long, help_heading = "Checkpoints and logs")]
    async_save: bool,
    /// Accepted for Megatron compatibility: every rank always writes its own shard
    #[arg(long, help_heading = "Checkpoints and logs")]
    ckpt_fully_parallel_save: bool,
    /// Stop after an iteration that is a multiple of N (saving first with --save; 0: off)
    #[arg(long, help_heading = "Checkpoints and logs")]
    exit_interval: Option<u64>,
    #[arg(long, value_parser = crate::values::positive_u64, default_value_t = 100, help_heading = "Checkpoints and logs")]
    log_interval: u64,
    /// One JSON object per iteration
    #[arg(long, help_heading = "Checkpoints and logs")]
    log_json: Option<PathBuf>,
    #[arg(long, help_heading = "Checkpoints and logs")]
    tensorboard_dir: Option<PathBuf>,
    /// Megatron's throughput per GPU (TFLOP/s/GPU, by its FLOP count) in the log line and
    /// TensorBoard (--log-json always has it)
    #[arg(long, help_heading = "Checkpoints and logs")]
    log_throughput: bool,
}

/// Re-runs this very command under `mpirun -np N` (without `--nproc`) and returns its
/// exit status. Shared by `train` and `profile`.
pub(crate) fn relaunch(nproc: usize) -> Result<std::process::ExitStatus> {
    relaunch_under_mpirun(nproc)
        .context("could not start mpirun (install OpenMPI: `cargo xtask setup`)")
}

impl TrainArgs {
    /// `--num-layers`, or the layer count of `--finetune-from-hf`'s config.
    fn num_layers(&self) -> Result<Option<usize>> {
        match (self.model.num_layers, &self.finetune_from_hf) {
            (Some(n), _) => Ok(Some(n)),
            (None, Some(dir)) => Ok(Some(
                LlamaConfig::from_hf_file(&dir.join("config.json"))
                    .with_context(|| format!("--finetune-from-hf {}", dir.display()))?
                    .num_layers,
            )),
            (None, None) => Ok(None),
        }
    }

    /// The parallel flags as typed values.
    fn plan_flags(&self) -> Result<PlanFlags> {
        let list = |values: &[usize]| (!values.is_empty()).then(|| values.to_vec());
        Ok(PlanFlags {
            tensor_model_parallel_size: self.tensor_model_parallel_size.unwrap_or(1),
            context_parallel_size: self.context_parallel_size.unwrap_or(1),
            expert_model_parallel_size: self.expert_model_parallel_size.unwrap_or(1),
            pipeline_model_parallel_size: self.pipeline_model_parallel_size.unwrap_or(1),
            use_tp_pp_dp_mapping: self.use_tp_pp_dp_mapping,
            num_layers: self.num_layers()?,
            hetero_pipeline_stages: list(&self.hetero_pipeline_stages),
            num_layers_per_virtual_pipeline_stage: self.num_layers_per_virtual_pipeline_stage,
            global_batch_size: self.global_batch_size,
            micro_batch_size: self.micro_batch_size,
            micro_batch_size_per_dp: list(&self.micro_batch_size_per_dp),
            num_micro_batches_per_dp: list(&self.num_micro_batches_per_dp),
        })
    }

    /// The layout flags given, which a `--plan` file sets instead.
    fn flags_set_by_a_plan(&self) -> Vec<&'static str> {
        [
            (
                "--tensor-model-parallel-size",
                self.tensor_model_parallel_size.is_some(),
            ),
            (
                "--context-parallel-size",
                self.context_parallel_size.is_some(),
            ),
            (
                "--expert-model-parallel-size",
                self.expert_model_parallel_size.is_some(),
            ),
            (
                "--hetero-process-meshes",
                !self.hetero_process_meshes.is_empty(),
            ),
            (
                "--hetero-pipeline-layer-split",
                !self.hetero_pipeline_layer_split.is_empty(),
            ),
            (
                "--pipeline-model-parallel-size",
                self.pipeline_model_parallel_size.is_some(),
            ),
            (
                "--hetero-pipeline-stages",
                !self.hetero_pipeline_stages.is_empty(),
            ),
            ("--micro-batch-size", self.micro_batch_size.is_some()),
            (
                "--micro-batch-size-per-dp",
                !self.micro_batch_size_per_dp.is_empty(),
            ),
            (
                "--num-micro-batches-per-dp",
                !self.num_micro_batches_per_dp.is_empty(),
            ),
            (
                "--num-layers-per-virtual-pipeline-stage",
                self.num_layers_per_virtual_pipeline_stage.is_some(),
            ),
            ("--use-tp-pp-dp-mapping", self.use_tp_pp_dp_mapping),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// The plan: from `--plan` (parallel flags then conflict), or from the flags.
    fn plan(&self, world_size: usize) -> Result<Plan> {
        if self.enable_hetero || !self.hetero_process_meshes.is_empty() {
            return self.mesh_plan(world_size).map(|(plan, _)| plan);
        }
        if !self.hetero_pipeline_layer_split.is_empty() {
            bail!(
                "--hetero-pipeline-layer-split needs --enable-hetero and --hetero-process-meshes"
            );
        }
        let Some(path) = &self.plan else {
            return Plan::from_flags(&self.plan_flags()?, world_size).map_err(plan_flag_error);
        };
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let plan = read_plan(path, &text)?;
        let conflicting = self.flags_set_by_a_plan();
        if !conflicting.is_empty() {
            bail!(
                "{} cannot be combined with --plan {} (the plan sets the layout)",
                conflicting.join(", "),
                path.display()
            );
        }
        let global_batch = plan.global_batch_size();
        if let Some(gbs) = self.global_batch_size.filter(|&gbs| gbs != global_batch) {
            bail!(
                "--global-batch-size {gbs} differs from the plan's {global_batch} (the sum of its replicas' micro-batch size x count; {})",
                path.display()
            );
        }
        if let Some(layers) = self.model.num_layers.filter(|&l| l != plan.num_layers()) {
            bail!(
                "--num-layers {layers} differs from the plan's {} ({})",
                plan.num_layers(),
                path.display()
            );
        }
        if plan.world_size() != world_size {
            bail!(
                "the plan {} is for {} ranks but the job has {world_size}",
                path.display(),
                plan.world_size()
            );
        }
        Ok(plan)
    }

    /// The plan of `--enable-hetero --hetero-process-meshes ...` and its meshes.
    fn mesh_plan(&self, world_size: usize) -> Result<(Plan, ProcessMeshes)> {
        match (self.enable_hetero, self.hetero_process_meshes.is_empty()) {
            (false, _) => bail!("--hetero-process-meshes needs --enable-hetero"),
            (true, true) => {
                bail!("--enable-hetero needs --hetero-process-meshes TP CP EP DP PP ...")
            }
            _ => {}
        }
        let mut conflicting = self.flags_set_by_a_plan();
        conflicting.retain(|f| {
            !matches!(
                *f,
                "--hetero-process-meshes"
                    | "--hetero-pipeline-layer-split"
                    | "--micro-batch-size"
                    | "--pipeline-model-parallel-size"
                    | "--tensor-model-parallel-size"
                    | "--context-parallel-size"
                    | "--expert-model-parallel-size"
            )
        });
        if self.plan.is_some() {
            conflicting.push("--plan");
        }
        if !conflicting.is_empty() {
            bail!(
                "{} cannot be combined with --hetero-process-meshes (the meshes set the layout)",
                conflicting.join(", ")
            );
        }
        let flags = MeshFlags {
            meshes: self.hetero_process_meshes.clone(),
            device_types: self.hetero_device_types.clone(),
            current_device_type: self.hetero_current_device_type.clone(),
            layer_split: (!self.hetero_pipeline_layer_split.is_empty())
                .then(|| self.hetero_pipeline_layer_split.clone()),
            pipeline_model_parallel_size: self.pipeline_model_parallel_size,
            num_layers: self.num_layers()?.context("--num-layers is required")?,
            micro_batch_size: self.micro_batch_size,
            global_batch_size: self.global_batch_size,
        };
        let meshes = ProcessMeshes::parse(&flags)?;
        if let Some(tp) = self.tensor_model_parallel_size {
            if let Some(m) = meshes.meshes().iter().position(|m| m.tp != tp) {
                bail!(
                    "--tensor-model-parallel-size {tp} differs from mesh {m}'s tensor-parallel size {} (each mesh sets its own; leave the flag out)",
                    meshes.meshes()[m].tp
                );
            }
        }
        if let Some(cp) = self.context_parallel_size {
            if let Some(m) = meshes.meshes().iter().position(|m| m.cp != cp) {
                bail!(
                    "--context-parallel-size {cp} differs from mesh {m}'s context-parallel size {} (each mesh sets its own; leave the flag out)",
                    meshes.meshes()[m].cp
                );
            }
        }
        if let Some(ep) = self.expert_model_parallel_size {
            if let Some(m) = meshes.meshes().iter().position(|m| m.ep != ep) {
                bail!(
                    "--expert-model-parallel-size {ep} differs from mesh {m}'s expert-parallel size {} (each mesh sets its own; leave the flag out)",
                    meshes.meshes()[m].ep
                );
            }
        }
        if meshes.world_size() != world_size {
            bail!(
                "--hetero-process-meshes hold {} ranks (the sum of TP x CP x DP x PP) but the job has {world_size}",
                meshes.world_size()
            );
        }
        Ok((meshes.plan(&flags)?, meshes))
    }

    /// With `--hetero-current-device-type`, checks that `rank` belongs to a mesh of that
    /// device type (each launch of a multi-type job passes its own type).
    fn check_current_device_type(&self, rank: usize, world_size: usize) -> Result<()> {
        let Some(current) = &self.hetero_current_device_type else {
            return Ok(());
        };
        if !self.enable_hetero {
            bail!("--hetero-current-device-type needs --enable-hetero and --hetero-process-meshes");
        }
        let (_, meshes) = self.mesh_plan(world_size)?;
        if let Some(m) = meshes.mesh_of(rank) {
            let mesh = &meshes.meshes()[m];
            if &mesh.device_type != current {
                bail!(
                    "rank {rank} belongs to mesh {m} (device type {}) but its --hetero-current-device-type is {current}",
                    mesh.device_type
                );
            }
        }
        Ok(())
    }

    /// Where the layout came from, for errors about it: the plan file or the flags.
    fn layout_source(&self) -> String {
        match &self.plan {
            Some(path) => format!("plan {}", path.display()),
            None => "--pipeline-schedule / --num-micro-batches-per-dp / --num-layers-per-virtual-pipeline-stage".to_owned(),
        }
    }

    /// The data flags as typed values.
    fn sources(&self) -> DataSources {
        DataSources {
            blend: self.data_path.clone(),
            per_split: Default::default(),
            split: self.split.clone(),
            cache_dir: self.data_cache_path.clone(),
        }
    }

    /// How samples are cut and masked (Megatron's GPT dataset flags).
    fn sample_options(&self, tokenizer: &dyn Tokenizer) -> Result<SampleOptions> {
        let eod = tokenizer
            .eod()
            .context("the tokenizer has no end-of-document id")?;
        let options = SampleOptions {
            sequence_length: self.model.seq_length()?,
            add_extra_token: true,
            eod: i64::from(eod),
            pad: tokenizer.pad().map_or(-1, i64::from),
            reset_position_ids: self.reset_position_ids,
            reset_attention_mask: self.reset_attention_mask,
            eod_mask_loss: self.eod_mask_loss,
            // The loader materialises masks only under --reset-attention-mask.
            create_attention_mask: !self.no_create_attention_mask_in_dataloader,
        };
        tracing::info!(
            "attention: {}",
            if options.reset_attention_mask {
                "masks from the data loader (--reset-attention-mask: no attention across EOD)"
            } else {
                "causal, no mask materialised (scaled_dot_product_attention with is_causal)"
            }
        );
        Ok(options)
    }

    /// The learning-rate schedule of Megatron's flags, in samples.
    fn lr_schedule(&self, global_batch_size: u64) -> Result<LrSchedule> {
        LrSchedule::from_iterations(
            self.lr,
            self.min_lr,
            self.lr_decay_style,
            self.lr_decay_iters.unwrap_or(self.train_iters),
            self.lr_warmup_iters,
            self.lr_warmup_fraction,
            global_batch_size,
        )
        .map_err(|e| {
            let flags = match e {
                LrScheduleError::MinLr { .. } => "--min-lr / --lr",
                LrScheduleError::WarmupFraction(_) => "--lr-warmup-fraction",
                LrScheduleError::UnknownDecayStyle(_) => "--lr-decay-style",
                LrScheduleError::WarmupLongerThanDecay { .. }
                | LrScheduleError::Overflow { .. } => "--lr-warmup-iters / --lr-decay-iters",
            };
            anyhow::Error::new(e).context(flags)
        })
    }

    /// `--pipeline-schedule`, else interleaved when a replica has virtual chunks, else
    /// 1F1B.
    fn schedule_kind(&self, plan: &Plan) -> ScheduleKind {
        self.pipeline_schedule.unwrap_or(if plan.has_chunks() {
            ScheduleKind::Interleaved
        } else {
            ScheduleKind::OneFOneB
        })
    }

    /// Samples of each split, as Megatron sizes them: `--train-iters` global batches;
    /// for evaluation `(train_iters / eval_interval + 1) · eval_iters` validation and
    /// `eval_iters` test batches (none without evaluation).
    fn split_samples(&self, global_batch: u64) -> Result<[Option<u64>; 3]> {
        let budget = SampleBudget {
            train_iters: Some(self.train_iters),
            global_batch_size: Some(global_batch),
            eval_interval: self.eval_interval,
            eval_iters: self.eval_iters,
            ..Default::default()
        };
        let [train, valid, test] = budget.split_sizes().map_err(|e| {
            anyhow::Error::new(e).context("--train-iters / --eval-iters / --global-batch-size")
        })?;
        let evaluating = self.eval_iters > 0;
        Ok([
            train,
            valid.filter(|_| evaluating),
            test.filter(|_| evaluating),
        ])
    }

    /// What the ranks compute in (`--bf16`, `--fp16`, else fp32).
    fn precision(&self) -> Precision {
        self.precision.asked().unwrap_or(Precision::Fp32)
    }

    /// Megatron's loss scaling: `--loss-scale` where any rank computes in fp16 or bf16,
    /// else dynamic where any computes in fp16 (`--fp16`, or the plan's precision for it).
    fn loss_scaling(&self, plan: &Plan) -> Result<LossScaling> {
        let precisions: Vec<Precision> = (0..plan.world_size())
            .map(|r| plan.precision_of(r).unwrap_or(self.precision()))
            .collect();
        let low = precisions.iter().any(|&p| p != Precision::Fp32);
        let scaling = match self.loss_scale {
            Some(_) if !low => {
                tracing::warn!("--loss-scale is ignored without --fp16 or --bf16 (as Megatron's fp32 optimizer does)");
                LossScaling::None
            }
            Some(scale) => LossScaling::Constant(scale as f32),
            None if precisions.contains(&Precision::Fp16) => {
                LossScaling::Dynamic(DynamicLossScale {
                    initial: self.initial_loss_scale as f32,
                    min: self.min_loss_scale as f32,
                    window: self.loss_scale_window,
                    hysteresis: self.hysteresis,
                })
            }
            None => LossScaling::None,
        };
        scaling.check()?;
        Ok(scaling)
    }

    /// The run's configuration, grouped as the trainer takes it.
    fn train_config(&self, model: LlamaConfig, plan: Plan) -> Result<TrainConfig> {
        let loss_scaling = self.loss_scaling(&plan)?;
        let schedule = self.schedule_kind(&plan);
        let lr = self.lr_schedule(plan.global_batch_size() as u64)?;
        Ok(TrainConfig {
            model,
            parallel: ParallelConfig {
                plan,
                schedule,
                overlap_grad_reduce: !self.no_overlap_grad_reduce,
                ddp_bucket_size: self.ddp_bucket_size,
                overlap_param_gather: self.overlap_param_gather,
                sequence_parallel: self.sequence_parallel,
                hierarchical_reduction: !self.no_hierarchical_reduction,
            },
            batch: BatchConfig {
                sequence_length: self.model.seq_length()?,
                train_iters: self.train_iters,
                seed: u64::from(self.seed),
            },
            optimizer: OptimizerConfig {
                lr,
                adam: AdamWConfig {
                    beta1: self.adam_beta1,
                    beta2: self.adam_beta2,
                    eps: self.adam_eps,
                    weight_decay: self.weight_decay,
                },
                clip_grad: self.clip_grad,
                distributed: self.use_distributed_optimizer,
            },
            compute: ComputeConfig {
                precision: self.precision(),
                loss_scaling,
                recompute: self.recompute_activations,
                device: self.device,
                emulate_speed: self.emulate_device_speed.clone(),
                speed_changes: self.emulate_speed_change.clone(),
            },
            data: DataConfig {
                prefetch: self.num_workers > 0,
            },
            checkpoint: CheckpointConfig {
                save: self.save.clone(),
                save_interval: self.save_interval,
                load: self.load.clone(),
                exit_interval: self.exit_interval,
                finetune_from_hf: self.finetune_from_hf.clone(),
                async_save: self.async_save,
            },
            logging: LoggingConfig {
                log_interval: self.log_interval,
                log_json: self.log_json.clone(),
                tensorboard_dir: self.tensorboard_dir.clone(),
                log_throughput: self.log_throughput,
                moe_per_layer_logging: self.model.experts.moe_per_layer_logging,
            },
            eval: EvalConfig {
                iters: self.eval_iters,
                interval: self.eval_interval,
                skip_train: self.skip_train,
            },
            replan: ReplanConfig {
                watch: WatchConfig {
                    threshold: self.replan_threshold,
                    window: self.replan_window,
                },
                mode: self.replan,
            },
        })
    }

    /// Checks the run.sh compatibility flags and says what each accepted one means here.
    fn check_compatibility_flags(&self) -> Result<()> {
        if let Some(backend) = &self.distributed_backend {
            if backend != "nccl" && backend != "gloo" {
                bail!("--distributed-backend {backend}: use nccl or gloo");
            }
        }
        // Said once, by rank 0 (or before the launch); the model flags are checked as
        // the model is built.
        if launcher_rank().is_none_or(|(rank, _)| rank == 0) {
            self.model.warn_ignored();
        }
        Ok(())
    }

    /// The model: `--finetune-from-hf`'s (its experts' training settings from the flags)
    /// or the model flags', with `num_layers` layers (the plan's).
    fn model(&self, tokenizer_vocab: usize, num_layers: usize) -> Result<LlamaConfig> {
        self.check_compatibility_flags()?;
        let Some(dir) = &self.finetune_from_hf else {
            return self
                .model
                .config(num_layers, tokenizer_vocab, "--finetune-from-hf");
        };
        let config = LlamaConfig::from_hf_file(&dir.join("config.json"))
            .with_context(|| format!("--finetune-from-hf {}", dir.display()))?;
        if config.num_layers != num_layers {
            bail!(
                "--finetune-from-hf {}: the checkpoint has {} layers but the plan {}",
                dir.display(),
                config.num_layers,
                num_layers
            );
        }
        (self.model).with_hf_model(config, &format!("--finetune-from-hf {}", dir.display()))
    }
}

/// The shape of the model `synerfuse train` builds from `args` (its arguments, without
/// the subcommand) with `num_layers` layers: what `plan --try` checks against the model
/// it priced.
pub(crate) fn trained_model_shape(
    args: &[String],
    num_layers: usize,
) -> Result<synerfuse_plan::ModelShape> {
    #[derive(clap::Parser)]
    struct Train {
        #[command(flatten)]
        args: TrainArgs,
    }
    // --train-iters is required but says nothing of the model.
    let argv = ["train", "--train-iters", "1"].map(String::from);
    let argv = argv.into_iter().chain(args.iter().cloned());
    let train = <Train as clap::Parser>::try_parse_from(argv)?;
    let tokenizer = (train.args.tokenizer.build()?).context("--tokenizer-type is required")?;
    let model = train.args.model(tokenizer.vocab_size(), num_layers)?;
    Ok(synerfuse_train::profiler::model_shape(
        &model,
        train.args.model.seq_length()?,
    ))
}

pub fn run_train(args: TrainArgs) -> Result<()> {
    args.model.seq_length()?;
    if args.reset_attention_mask && args.no_create_attention_mask_in_dataloader {
        bail!(
            "--reset-attention-mask needs the attention mask that \
             --no-create-attention-mask-in-dataloader turns off"
        );
    }
    // Every wait of a rank is bounded by it, and the --nproc launcher's wait for ranks
    // that outlive the others' clean end.
    watchdog::set_timeout(Duration::from_secs_f64(
        args.distributed_timeout_minutes * 60.0,
    ));
    if let (Some(n), None) = (args.nproc, launcher_rank()) {
        // Refuse a layout that cannot work here, once, before starting n ranks.
        let plan = args.plan(n)?;
        plan.schedule(args.schedule_kind(&plan))
            .map_err(|e| anyhow::Error::new(e).context(args.layout_source()))?;
        return crate::restart::run_restarting(n, args.save.as_deref());
    }
    signals::install_sigterm_handler();
    let runtime = MpiRuntime::init()?;
    let world = runtime.world();
    let result = train_rank(&args, &world);
    if result.is_ok() {
        // The --nproc launcher counts these marks: `mpirun` that keeps survivors of a
        // lost rank alive exits 0 whatever the ranks did.
        synerfuse_train::comm::mark_rank_done(world.rank())
            .context("marking this rank's end for the --nproc launcher")?;
    }
    if let Err(error) = &result {
        if world.size() > 1 {
            // The other ranks may be waiting for this one: end the whole job now.
            eprintln!(
                "error: rank {} of {}: {}",
                world.rank(),
                world.size(),
                crate::entry::error_line(error)
            );
            world.abort(1);
        }
    }
    result
}

fn train_rank(args: &TrainArgs, world: &MpiCommunicator) -> Result<()> {
    let (local_rank, local_size) = launcher_local_rank();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = args.threads.unwrap_or((cores / local_size).max(1));
    synerfuse_model::tch::set_num_threads(threads as i32);
    let plan = args.plan(world.size())?;
    args.check_current_device_type(world.rank(), world.size())?;
    let tokenizer = args
        .tokenizer
        .build()?
        .context("--tokenizer-type is required")?;
    let model = args.model(tokenizer.vocab_size(), plan.num_layers())?;
    if model.vocab_size < tokenizer.vocab_size() {
        bail!(
            "the model's vocabulary ({}) is smaller than the tokenizer's ({})",
            model.vocab_size,
            tokenizer.vocab_size()
        );
    }
    let gbs = plan.global_batch_size() as u64;
    let sample_options = args.sample_options(tokenizer.as_ref())?;
    let mock_max = (args.mock_data).then(|| MockDocuments::new(sample_options.eod).max_token());
    if let Some(mock_max) = mock_max.filter(|&m| model.vocab_size as i64 <= m) {
        bail!(
            "--mock-data: Megatron's mock documents hold token ids up to {mock_max}, beyond the model's vocabulary of {} (a tokenizer with a larger vocabulary, e.g. NullTokenizer --vocab-size 4096)",
            model.vocab_size
        );
    }
    let sizes = args.split_samples(gbs)?;
    let datasets = match args.mock_data {
        true => {
            let (seed, length, eod) = (args.seed, args.model.seq_length()?, sample_options.eod);
            build_splits(world, || {
                build_mock_split_datasets(seed, length, eod, sizes)
            })
        }
        false => {
            let data = gpt_data_config(
                &args.sources(),
                args.seed,
                args.model.seq_length()?,
                &args.tokenizer,
            )?;
            build_splits(world, || build_split_datasets(&data, sizes))
        }
    }
    .map_err(|e| match e {
        LoaderError::Dataset(e) => data_flag_error(e).context("building the sample indices"),
        e => e.into(),
    })?;
    if datasets.train.is_none() && !args.skip_train {
        return Err(anyhow::Error::new(LoaderError::NoTrainData).context("--split"));
    }
    let config = args.train_config(model, plan)?;
    if world.rank() == 0 {
        log_run(&config, world.size(), threads);
    }
    // Test only: every rank on cuda:0 under SYNERFUSE_TEST_ONE_GPU_RANKS.
    let local_rank = synerfuse_train::comm::one_gpu::cuda_local_rank(local_rank);
    let mut trainer = Trainer::new(world, config, datasets, sample_options, local_rank)
        .map_err(train_flag_error)?;
    let summary = trainer.train().map_err(train_flag_error)?;
    if world.rank() == 0 {
        if let (Some(first), Some(last)) = (summary.losses.first(), summary.losses.last()) {
            tracing::info!(
                "done at iteration {}: loss {first:.4} -> {last:.4} over {} iterations{}",
                summary.iteration,
                summary.losses.len(),
                if summary.stopped_by_signal {
                    " (stopped by SIGTERM)"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

/// Rank 0's account of the run it starts.
fn log_run(config: &TrainConfig, world_size: usize, threads: usize) {
    let plan = &config.parallel.plan;
    tracing::info!(
        "training {} parameters on {world_size} ranks: {} replicas, layers per stage {:?}, micro-batches per replica {:?}, {threads} threads per rank",
        config.model.num_parameters(),
        plan.replicas().len(),
        plan.replicas()
            .iter()
            .map(|r| r.stages.layers())
            .collect::<Vec<_>>(),
        plan.replicas()
            .iter()
            .map(|r| r.batch.to_string())
            .collect::<Vec<_>>()
    );
    let recomputing =
        (plan.replicas().iter()).any(|r| (0..r.stages.num_stages()).any(|s| r.recomputes(s)));
    match plan.grid_flags() {
        // SynerFuse's flags recompute every stage or none.
        Some(_) if recomputing => tracing::info!(
            "no equivalent flags: the plan recomputes some stages (SynerFuse's --recompute-activations recomputes every stage)"
        ),
        Some(grid) => tracing::info!("equivalent flags: {}", grid.args.join(" ")),
        None => tracing::info!(
            "no equivalent flags: the replicas differ in stages, or their ranks or devices follow no grid order"
        ),
    }
    for (replica, r) in plan.replicas().iter().enumerate() {
        for stage in (0..r.stages.num_stages()).filter(|&s| r.tp_size(s) > 1) {
            let m = &config.model;
            let shares = r.shares(stage);
            if let Ok(layout) = TpLayout::new(
                Some(&shares),
                shares.len(),
                m.num_kv_heads,
                m.intermediate_size,
                m.vocab_size,
            ) {
                tracing::info!(
                    "replica {replica} stage {stage}: tensor-parallel ranks {:?}, {}{}",
                    r.tp_groups(stage).collect::<Vec<_>>(),
                    layout.describe(),
                    match config.parallel.sequence_parallel {
                        true =>
                            ", sequence parallel (norms and residuals on each rank's sequence rows)",
                        false => "",
                    }
                );
            }
        }
    }
    log_context_groups(plan, config.batch.sequence_length);
    let tied = config.model.tie_word_embeddings;
    let shape = synerfuse_train::profiler::model_shape(&config.model, config.batch.sequence_length);
    for reduction in plan.gradient_reductions_with_experts(tied, shape.experts.as_ref()) {
        tracing::info!(
            "gradient reduction: {}",
            reduction.describe(plan.num_layers(), tied)
        );
    }
}

/// A plan file: the `[[replica]]` form (each replica its own pipeline) or a grid, in
/// TOML, or in JSON (`.json`, as checkpoints store it).
fn read_plan(path: &std::path::Path, text: &str) -> Result<Plan> {
    let plan = match path.extension().is_some_and(|e| e == "json") {
        true => Plan::from_json(text),
        false => Plan::from_toml(text, None),
    };
    plan.with_context(|| format!("plan {}", path.display()))
}

/// Each context-parallel stage's groups and how they split a sequence of `sequence` tokens.
fn log_context_groups(plan: &Plan, sequence: usize) {
    for (replica, r) in plan.replicas().iter().enumerate() {
        for stage in (0..r.stages.num_stages()).filter(|&s| r.cp_size(s) > 1) {
            let Ok(split) = r.context_split(stage, sequence) else {
                continue;
            };
            let groups: Vec<Vec<usize>> = (0..r.tp_size(stage))
                .map(|t| r.cp_group(stage, t))
                .collect();
            let tokens: Vec<usize> = (0..split.ranks()).map(|m| split.tokens(m)).collect();
            tracing::info!(
                "replica {replica} stage {stage}: context-parallel ranks {groups:?}, {}: {tokens:?} of each sequence's {sequence} tokens",
                match r.context_shares(stage) {
                    Some(shares) => format!("shares {shares:?}"),
                    None => "even (Megatron's 2 x CP chunks, member i holding chunks i and 2 x CP - 1 - i)".to_owned(),
                }
            );
        }
    }
}

/// A plan error with the flags behind it (errors of the flag syntax name their flag).
fn plan_flag_error(error: PlanError) -> anyhow::Error {
    let flags = match &error {
        PlanError::Grid(GridError::Layout(LayoutError::LayerSumMismatch { expected, .. })) => {
            format!("--num-layers {expected}")
        }
        PlanError::Grid(GridError::Layout(LayoutError::NotDivisible { num_layers, .. })) => {
            format!("--num-layers {num_layers}")
        }
        PlanError::Grid(GridError::Batch(BatchError::GlobalBatchMismatch {
            global_batch_size,
            ..
        })) => format!("--global-batch-size {global_batch_size}"),
        PlanError::Grid(GridError::Topology(_)) => {
            "--tensor-model-parallel-size / --pipeline-model-parallel-size / --nproc".to_owned()
        }
        _ => return anyhow::Error::new(error).context("parallel flags"),
    };
    anyhow::Error::new(error).context(flags)
}

/// A training error with the flags behind it, where the library names only values.
fn train_flag_error(error: TrainError) -> anyhow::Error {
    let flags = match &error {
        TrainError::Plan(PlanError::LayerCount { model, .. }) => format!("--num-layers {model}"),
        TrainError::EmulatedSpeedCount { .. } | TrainError::EmulatedSpeed { .. } => {
            "--emulate-device-speed".to_owned()
        }
        TrainError::WorldSize { .. } => "--nproc / mpirun -np".to_owned(),
        TrainError::Plan(PlanError::SequenceParallel { .. }) => {
            "--sequence-parallel / --seq-length".to_owned()
        }
        TrainError::Plan(PlanError::ContextSplit { .. }) => {
            "--seq-length / --context-parallel-size".to_owned()
        }
        _ => return error.into(),
    };
    anyhow::Error::new(error).context(flags)
}
