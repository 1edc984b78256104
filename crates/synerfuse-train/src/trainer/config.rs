//! What a run is configured with, grouped by concern. The CLI fills it from Megatron's
//! flags; a library user builds it directly.

use crate::loss_scale::LossScaling;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::replan::{ReplanMode, SpeedChange, WatchConfig};
use std::path::PathBuf;
use synerfuse_model::{DeviceRequest, LlamaConfig};
use synerfuse_plan::{Plan, Precision, ScheduleKind};

/// Everything a run is configured with.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The model.
    pub model: LlamaConfig,
    /// Where work goes and how the pipelines run.
    pub parallel: ParallelConfig,
    /// Sequence length and run length.
    pub batch: BatchConfig,
    /// Learning rate, AdamW, clipping.
    pub optimizer: OptimizerConfig,
    /// Precision, recomputation, devices.
    pub compute: ComputeConfig,
    /// How the data loader reads ahead.
    pub data: DataConfig,
    /// Saving, loading and initial weights.
    pub checkpoint: CheckpointConfig,
    /// Log lines, JSON log and TensorBoard.
    pub logging: LoggingConfig,
    /// Evaluation on the validation and test splits.
    pub eval: EvalConfig,
    /// Watching the ranks' speeds.
    pub replan: ReplanConfig,
}

/// Watching the ranks' speeds while training, and re-planning when one changes for good.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ReplanConfig {
    /// When a change of a rank's pace counts as sustained.
    pub watch: WatchConfig,
    /// `--replan auto|off`: switch to a better plan when it pays, or only say whether it
    /// would have.
    pub mode: ReplanMode,
}

/// Evaluation on the validation and test splits, as Megatron runs it: every
/// `interval` iterations `iters` global batches of the validation split (continuing
/// where the last evaluation stopped), and at the end of training the validation split
/// once more and the test split from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalConfig {
    /// Global batches per evaluation (`--eval-iters`; 0 = no evaluation).
    pub iters: u64,
    /// Evaluate the validation split after every this many iterations
    /// (`--eval-interval`).
    pub interval: u64,
    /// Evaluate only, at the loaded iteration (`--skip-train`).
    pub skip_train: bool,
}

impl Default for EvalConfig {
    /// Megatron's defaults: 100 global batches every 1000 iterations.
    fn default() -> Self {
        EvalConfig {
            iters: 100,
            interval: 1000,
            skip_train: false,
        }
    }
}

impl EvalConfig {
    /// Whether the validation split is evaluated after `iteration`.
    pub fn due(&self, iteration: u64) -> bool {
        self.iters > 0 && every(Some(self.interval), iteration)
    }

    /// Validation samples that evaluations up to `iteration` consumed (Megatron's
    /// `consumed_valid_samples` on resume).
    pub fn consumed_valid_samples(&self, iteration: u64, global_batch: u64) -> u64 {
        match self.interval {
            0 => 0,
            n => (iteration / n)
                .saturating_mul(self.iters)
                .saturating_mul(global_batch),
        }
    }
}

/// The plan and its schedule.
#[derive(Debug, Clone)]
pub struct ParallelConfig {
    /// Each replica's pipeline: layers per stage, micro-batches, devices per rank (a
    /// grid plan converts with `Plan::from_grid`).
    pub plan: Plan,
    /// Pipeline schedule of every replica (replicas without virtual chunks run 1F1B
    /// where this is interleaved).
    pub schedule: ScheduleKind,
    /// Start each bucket of a gradient reduction inside its chunk's last backward, as
    /// soon as its gradients are final (Megatron's `--overlap-grad-reduce`; off with
    /// `--no-overlap-grad-reduce`: every reduction after the whole pipeline, whole).
    pub overlap_grad_reduce: bool,
    /// Elements per bucket when overlapping (Megatron's `--ddp-bucket-size`; default
    /// max(40M, 1M × the reduction's members), as Megatron's).
    pub ddp_bucket_size: Option<usize>,
    /// Leave the distributed optimizer's all-gather of the updated parameters in flight
    /// after the step, bucket by bucket, each waited for just before the next forward
    /// first reads it (Megatron's `--overlap-param-gather`; needs the distributed
    /// optimizer and `overlap_grad_reduce`, as Megatron's).
    pub overlap_param_gather: bool,
    /// Megatron's `--sequence-parallel` on every tensor-parallel stage (no effect on
    /// stages of one rank).
    pub sequence_parallel: bool,
    /// Reduce over MPI groups that span (emulated) hosts hierarchically, island by
    /// island (`--no-hierarchical-reduction`: flat, every member in one collective).
    pub hierarchical_reduction: bool,
}

impl ParallelConfig {
    /// The bucket size of a reduction over `members` ranks: Megatron's (its default
    /// scaled with the data-parallel size), and one bucket without overlap (nothing
    /// would start before the last).
    pub fn bucket_size(&self, members: usize) -> usize {
        match (self.overlap_grad_reduce, self.ddp_bucket_size) {
            (false, _) => usize::MAX,
            (true, Some(size)) => size,
            (true, None) => (40_000_000).max(1_000_000 * members),
        }
    }
}

/// Sequence length and how long the run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Tokens per sample (`--seq-length`).
    pub sequence_length: usize,
    /// Iterations to train (`--train-iters`).
    pub train_iters: u64,
    /// Initialisation and data seed (`--seed`).
    pub seed: u64,
}

/// Learning rate over consumed samples, AdamW and clipping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerConfig {
    /// Learning rate over consumed samples.
    pub lr: LrSchedule,
    /// AdamW hyper-parameters.
    pub adam: AdamWConfig,
    /// Clip by this global gradient norm (`--clip-grad`, 0 = off).
    pub clip_grad: f64,
    /// Shard the optimizer state over each gradient reduction's holders
    /// (`--use-distributed-optimizer`, see [`crate::zero`]).
    pub distributed: bool,
}

/// How each rank computes.
#[derive(Debug, Clone, PartialEq)]
pub struct ComputeConfig {
    /// What the ranks compute in (`--bf16`, `--fp16`, else fp32); master weights, main
    /// gradients and their reductions stay fp32.
    pub precision: Precision,
    /// How the loss is scaled (fp16's dynamic scaling, or `--loss-scale`).
    pub loss_scaling: LossScaling,
    /// Full recomputation of each stage chunk (`--recompute-activations`).
    pub recompute: bool,
    /// The device of ranks the plan does not place (`--device`).
    pub device: DeviceRequest,
    /// One emulated speed factor per rank, overriding the plan's
    /// (`--emulate-device-speed`).
    pub emulate_speed: Option<Vec<f64>>,
    /// Emulated speeds that change during the run (`--emulate-speed-change`), for tests
    /// and benchmarks of stragglers.
    pub speed_changes: Vec<SpeedChange>,
}

/// How micro-batches are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataConfig {
    /// Read the next step's micro-batches on a background thread (`--num-workers` > 0).
    pub prefetch: bool,
}

/// Saving, loading and initial weights.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// Where checkpoints go (`--save`).
    pub save: Option<PathBuf>,
    /// Save every this many iterations (`--save-interval`).
    pub save_interval: Option<u64>,
    /// Resume from the latest checkpoint here (`--load`).
    pub load: Option<PathBuf>,
    /// Stop (saving first) after an iteration that is a multiple of this
    /// (`--exit-interval`).
    pub exit_interval: Option<u64>,
    /// Initial weights from a Hugging Face LLaMA directory (`--finetune-from-hf`).
    pub finetune_from_hf: Option<PathBuf>,
    /// Write checkpoints on a background thread from a host copy taken at the step
    /// boundary, while training goes on (`--async-save`).
    pub async_save: bool,
}

impl CheckpointConfig {
    /// Whether a checkpoint is due after `iteration` of `train_iters`: at each save
    /// interval, at the end, on a stop signal and at an exit interval.
    pub fn save_due(&self, iteration: u64, train_iters: u64, stop: bool) -> bool {
        self.save.is_some()
            && (every(self.save_interval, iteration)
                || iteration == train_iters
                || stop
                || self.exit_due(iteration))
    }

    /// Whether `--exit-interval` ends the run after `iteration`.
    pub fn exit_due(&self, iteration: u64) -> bool {
        every(self.exit_interval, iteration)
    }
}

fn every(interval: Option<u64>, iteration: u64) -> bool {
    interval.is_some_and(|n| n > 0 && iteration % n == 0)
}

/// What is logged where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggingConfig {
    /// Print Megatron's log line every this many iterations (`--log-interval`).
    pub log_interval: u64,
    /// One JSON record per iteration (`--log-json`).
    pub log_json: Option<PathBuf>,
    /// TensorBoard event files (`--tensorboard-dir`).
    pub tensorboard_dir: Option<PathBuf>,
    /// Megatron's `--log-throughput`: TFLOP/s per GPU in the log line and TensorBoard
    /// (the JSON record always has it).
    pub log_throughput: bool,
    /// Megatron's `--moe-per-layer-logging`: each MoE layer's load-balancing loss and
    /// tokens per expert in TensorBoard, not only the mean over layers.
    pub moe_per_layer_logging: bool,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            log_interval: 1,
            log_json: None,
            tensorboard_dir: None,
            log_throughput: false,
            moe_per_layer_logging: false,
        }
    }
}
