//! The errors of running a stage, shared by the whole stage, its parallel forms and
//! the collectives they call: at the bottom, so that every module can return them.

use synerfuse_plan::TpShard;
use tch::Kind;

/// A stage layout that does not fit the model.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The layer range is empty or past the last layer.
    #[error("layers {start}..{end} do not fit a model of {num_layers} layers")]
    BadRange {
        /// First layer.
        start: usize,
        /// One past the last layer.
        end: usize,
        /// Layers in the model.
        num_layers: usize,
    },
    /// Token ids of the wrong rank or dtype for the first stage.
    #[error("the first stage takes token ids [batch, seq] (int64), got {shape:?} {kind:?}")]
    NotTokenIds {
        /// The input's shape.
        shape: Vec<i64>,
        /// Its dtype.
        kind: Kind,
    },
    /// Hidden states of the wrong shape for a later stage.
    #[error("stage {layers:?} takes hidden states [batch, seq, {hidden_size}], got {shape:?}")]
    NotHiddenStates {
        /// The stage's layers.
        layers: std::ops::Range<usize>,
        /// The model's hidden size.
        hidden_size: usize,
        /// The input's shape.
        shape: Vec<i64>,
    },
    /// A shard that does not fit the model (its ranges past the model's sizes).
    #[error("tensor-parallel shard {shard:?} does not fit the model")]
    BadShard {
        /// The shard.
        shard: TpShard,
    },
    /// A tensor-parallel shard run without its group's collectives, or a whole stage's
    /// pass given to the tensor-parallel backward (or the reverse).
    #[error("a tensor-parallel shard runs with its group's collectives (forward_train_tp / backward_tp), a whole stage without")]
    Sharded,
    /// A stage holding some of its MoE layers' experts run without its expert-parallel
    /// group.
    #[error("the stage holds experts {held:?} of each MoE layer: it runs with its expert-parallel group (forward_train_parallel)")]
    ExpertsElsewhere {
        /// The experts it holds.
        held: Vec<usize>,
    },
    /// An expert placement that does not give every expert to exactly one member.
    #[error("expert placement {placement:?}: every one of the {num_experts} experts must be on exactly one member of the expert-parallel group, each member holding one at least, this member {held:?}")]
    BadPlacement {
        /// Each member's experts.
        placement: Vec<Vec<usize>>,
        /// Experts per layer.
        num_experts: usize,
        /// This member's.
        held: Vec<usize>,
    },
    /// A backward from a loss on a stage without the output layer.
    #[error("a backward from the loss needs the last stage (the output layer)")]
    NotLastStage,
    /// Sequence parallelism over a sequence the group cannot split evenly.
    #[error("sequence parallelism splits the sequence over the tensor-parallel group: sequence length {sequence} does not divide over {size} ranks")]
    SequenceNotDivisible {
        /// The sequence length.
        sequence: i64,
        /// Ranks in the group.
        size: usize,
    },
    /// A collective between tensor-parallel (or context-parallel) segments failed.
    #[error("tensor-parallel {op}: {source}")]
    Collective {
        /// The collective.
        op: &'static str,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Waiting for a model piece's parameters (still being gathered) failed.
    #[error("waiting for the parameters of model piece {piece}: {source}")]
    ParametersArriving {
        /// The piece (0 the embedding, `l + 1` decoder layer `l`, then the output layer).
        piece: usize,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Generation asked of a stage that is not the whole model.
    #[error("generation needs the whole model in one stage")]
    NotWholeModel,
    /// An empty prompt.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt token outside the vocabulary.
    #[error("prompt token {token} is outside the vocabulary of {vocab_size}")]
    TokenOutsideVocabulary {
        /// The token.
        token: i64,
        /// The vocabulary size.
        vocab_size: i64,
    },
}
