//! The crate's errors, below every other module: every part returns [`TrainError`],
//! which wraps the parts' own errors, so those live here with it (each re-exported where
//! it belongs: `checkpoint::CheckpointProblem`, `loader::LoaderError`,
//! `grads::UnreducedParameter`, `pipeline::PipelineFault`) and no part has to reach
//! up to the crate root for its error type.

use crate::checkpoint::layout::FORMAT;
use crate::comm::CommError;
use crate::optim::OptimStateError;
use std::ops::Range;
use std::path::PathBuf;
use synerfuse_data::gpt::GptDatasetError;
use synerfuse_data::DataError;
use synerfuse_plan::{BatchError, Message, Piece};

/// Why training stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A transfer between ranks failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The step's data could not be served.
    #[error(transparent)]
    Loader(#[from] LoaderError),
    /// A stage rejected its input.
    #[error(transparent)]
    Stage(#[from] synerfuse_model::StageError),
    /// This rank's device cannot be had.
    #[error("rank {rank}: {source}")]
    Device {
        /// The rank.
        rank: usize,
        /// Why.
        source: synerfuse_model::ModelError,
    },
    /// Weights could not be read or written.
    #[error(transparent)]
    Weights(#[from] synerfuse_model::hf::HfError),
    /// The topology is inconsistent.
    #[error(transparent)]
    Topology(#[from] synerfuse_plan::TopologyError),
    /// A checkpoint that cannot be written or is refused.
    #[error("checkpoint {path}: {problem}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        problem: CheckpointProblem,
    },
    /// A log file that cannot be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A plan for another number of ranks than the job has.
    #[error("the plan is for {plan} ranks but the job has {job}; launch with -np {plan}")]
    WorldSize {
        /// Ranks in the plan.
        plan: usize,
        /// Ranks in the job.
        job: usize,
    },
    /// `--overlap-param-gather` without what it needs.
    #[error("--overlap-param-gather needs {needs}, as in Megatron-LM")]
    ParamGatherNeeds {
        /// The flag it needs.
        needs: &'static str,
    },
    /// bf16 asked of a GPU that has none.
    #[error("rank {rank} computes in bf16 but its GPU, {gpu} (compute capability {}.{}), has no bf16 (Ampere, 8.0, or later has): give it fp16 (--fp16, or precision = [\"fp16\"] for its stage in the plan, which `synerfuse plan` writes for such devices)", capability.0, capability.1)]
    NoBf16 {
        /// The rank.
        rank: usize,
        /// Its GPU's name.
        gpu: String,
        /// The GPU's compute capability.
        capability: (i32, i32),
    },
    /// A plan that cannot run (a replica's schedule).
    #[error(transparent)]
    Plan(#[from] synerfuse_plan::PlanError),
    /// A parameter the plan's gradient reductions miss (a bug, reported).
    #[error(transparent)]
    UnreducedParameter(#[from] UnreducedParameter),
    /// Emulated speeds that are not one per rank.
    #[error("{given} emulated device speeds for a job of {ranks} ranks")]
    EmulatedSpeedCount {
        /// Speeds given.
        given: usize,
        /// Ranks in the job.
        ranks: usize,
    },
    /// Re-planning could not go on (the run stops rather than train on a broken plan).
    #[error("re-planning after iteration {iteration}: {reason}")]
    Replan {
        /// The iteration after which it was tried.
        iteration: u64,
        /// What went wrong.
        reason: String,
    },
    /// An `--emulate-speed-change` for a rank the job does not have.
    #[error("--emulate-speed-change {iteration}:{rank}:{speed}: the job has ranks 0 to {last}")]
    SpeedChangeRank {
        /// The change's iteration.
        iteration: u64,
        /// Its rank.
        rank: usize,
        /// Its speed.
        speed: f64,
        /// The job's last rank.
        last: usize,
    },
    /// An emulated speed outside (0, 1].
    #[error("rank {rank}: emulated device speed {speed} must be in (0, 1]")]
    EmulatedSpeed {
        /// The rank.
        rank: usize,
        /// Its speed.
        speed: f64,
    },
    /// A global batch whose samples have no token to learn from.
    #[error("the global batch after {consumed_samples} samples has no loss tokens")]
    NoLossTokens {
        /// Samples consumed before the batch.
        consumed_samples: u64,
    },
    /// A save asked of a run without a checkpoint directory.
    #[error("saving needs a checkpoint directory")]
    NoSaveDir,
    /// Optimizer state that does not fit the model.
    #[error(transparent)]
    OptimState(#[from] OptimStateError),
    /// libtorch's fused AdamW refused its tensors (a bug: the optimizer hands it fp32
    /// tensors of one device).
    #[error(transparent)]
    FusedAdam(#[from] crate::optim::FusedAdamError),
    /// The pipeline program broke its own order (a bug, reported rather than hung).
    #[error("pipeline: {0}")]
    Pipeline(#[from] PipelineFault),
}

/// What is wrong with a checkpoint file or directory.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointProblem {
    /// It cannot be read or written.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// `latest` holds no iteration number.
    #[error("expected an iteration number, found {0:?}")]
    BadLatest(String),
    /// A JSON file of another shape.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// Neither a `latest` file nor a manifest.
    #[error("no `latest` file and no manifest.json: not a synerfuse checkpoint")]
    NotACheckpoint,
    /// The model configuration stored with the checkpoint.
    #[error(transparent)]
    Config(#[from] synerfuse_model::ConfigError),
    /// Optimizer state that does not fit the model.
    #[error(transparent)]
    OptimState(#[from] OptimStateError),
    /// A tensor of another shape than the model's.
    #[error("tensor {name} has shape {found:?}, the model expects {expected:?}")]
    Shape {
        /// The parameter.
        name: String,
        /// Its shape in the checkpoint.
        found: Vec<i64>,
        /// The model's.
        expected: Vec<i64>,
    },
    /// A tensor no file of the kind holds.
    #[error("no {prefix}* file holds tensor {name:?}")]
    MissingTensor {
        /// `model-` or `optimizer-`.
        prefix: String,
        /// The tensor.
        name: String,
    },
    /// A file the manifest does not list.
    #[error("not listed in manifest.json")]
    Unlisted,
    /// A piece to write whose data has another length than its region.
    #[error("piece of {name} holds {found} elements, its region {expected}")]
    PieceLength {
        /// The tensor.
        name: String,
        /// Elements given.
        found: i64,
        /// Elements of the region.
        expected: i64,
    },
    /// Pieces that do not cover a tensor's elements exactly once.
    #[error("the pieces of {name} cover {covered} of the {wanted} elements wanted")]
    Coverage {
        /// The tensor.
        name: String,
        /// Elements the pieces hold.
        covered: i64,
        /// Elements wanted.
        wanted: i64,
    },
    /// A manifest piece outside its tensor or its file.
    #[error("manifest piece of {name} in {file} does not fit: {why}")]
    BadPiece {
        /// The tensor.
        name: String,
        /// The file it names.
        file: String,
        /// What does not fit.
        why: String,
    },
    /// A checkpoint whose model routes otherwise than the run's (the same tensors, so
    /// nothing else would tell).
    #[error("its model was trained {stored} --moe-router-pre-softmax; resume {stored} it")]
    OtherRouting {
        /// "with" or "without".
        stored: &'static str,
    },
    /// A rank whose files never arrived.
    #[error("rank {rank} wrote no manifest fragment: its files are missing or incomplete")]
    MissingFragment {
        /// The rank.
        rank: usize,
    },
    /// Another rank failed to write its part (its own log says why).
    #[error("rank {rank} could not write its part of the checkpoint (its log says why)")]
    RankFailed {
        /// The rank.
        rank: usize,
    },
    /// The background writer ended without an answer.
    #[error("the background checkpoint writer panicked")]
    WriterPanicked,
    /// A manifest of a format this version does not know.
    #[error("manifest format {0}; this version reads formats 1 and {FORMAT}")]
    UnknownFormat(u32),
    /// A safetensors header that cannot be read.
    #[error("safetensors header: {0}")]
    Header(String),
    /// A file whose size or hash differs from the manifest's.
    #[error("corrupt: {found_bytes} bytes with SHA-256 {found_sha256}, the manifest records {bytes} bytes with {sha256}")]
    Corrupt {
        /// Bytes found.
        found_bytes: u64,
        /// SHA-256 found.
        found_sha256: String,
        /// Bytes recorded.
        bytes: u64,
        /// SHA-256 recorded.
        sha256: String,
    },
}

/// Why a step's data cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    /// The layout has no such replica.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// The split has fewer samples than the step needs.
    #[error(
        "the step after {consumed_samples} consumed samples needs dataset samples {needed:?}, \
         but the split has {available}; build the indices for more samples (--train-samples)"
    )]
    Exhausted {
        /// Samples consumed before the step.
        consumed_samples: u64,
        /// Dataset indices the step needs.
        needed: Range<u64>,
        /// Samples in the split.
        available: u64,
    },
    /// A sample could not be read.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The split's indices could not be built or loaded.
    #[error("building the sample indices: {0}")]
    Dataset(#[from] GptDatasetError),
    /// The data configuration gives the train split no data.
    #[error("the split string gives the train split no data")]
    NoTrainData,
    /// The prefetch thread could not be started.
    #[error("could not start the data prefetch thread: {source}")]
    Thread {
        /// The cause.
        source: std::io::Error,
    },
}

/// A parameter no reduction of the plan covers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("parameter {name} (chunk {chunk}) is in none of this rank's gradient reductions")]
pub struct UnreducedParameter {
    /// The parameter.
    pub name: String,
    /// Its chunk.
    pub chunk: usize,
}

/// A program that broke its own order (a bug, reported rather than hung).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PipelineFault {
    /// A forward whose input activation has not been received.
    #[error("forward of {0} before its input arrived")]
    ForwardBeforeInput(Piece),
    /// A backward whose output gradient has not been received.
    #[error("backward of {0} before its output gradient arrived")]
    BackwardBeforeGradient(Piece),
    /// A backward without a forward.
    #[error("backward of {0} without its forward")]
    BackwardWithoutForward(Piece),
    /// A send of a result not computed.
    #[error("send of the {} of {} before computing it", .0.payload, .0.piece)]
    SendBeforeCompute(Message),
    /// A message for a chunk this rank does not hold.
    #[error("the {} of {} is for a chunk this rank does not hold", .0.payload, .0.piece)]
    NoChunkFor(Message),
    /// Forwards left without their backward at the step's end.
    #[error("{0} forward passes had no backward")]
    Unfinished(usize),
    /// A backward in a forward-only (evaluation) program.
    #[error("backward of {0} in a forward-only program")]
    BackwardInEvaluation(Piece),
}
