//! What a stage's forward keeps for its backward, whole or tensor-parallel: the types
//! the whole stage (`llama`) and the sharded one (`tp`) share, below both, so that the
//! whole stage never imports the sharded one.

use crate::config::LlamaConfig;
use crate::cp::KvExchange;
use crate::loss::StageHead;
use crate::moe::{ExpertExchange, LayerBalance};
use tch::Tensor;

/// The inputs a stage's forward was run on, for a backward that recomputes it.
pub(crate) struct SavedInputs {
    pub(crate) input: Tensor,
    pub(crate) position_ids: Option<Tensor>,
    pub(crate) attention_mask: Option<Tensor>,
}

/// One micro-batch's forward through a stage, kept until its backward.
pub struct ForwardPass {
    /// The stage output (hidden states or logits; a last stage's normed hidden states
    /// when its forward ended with [`crate::StageHead::WithLoss`]), detached from
    /// nothing: send it on.
    pub output: Tensor,
    /// The autograd graph's output (none when the backward recomputes the forward).
    pub(crate) graph: Option<Tensor>,
    pub(crate) saved: SavedInputs,
    /// The regions of a tensor-parallel pass (empty for a whole stage).
    pub(crate) regions: Vec<Region>,
    /// Each MoE layer's load balance over the micro-batch (values, no graph).
    pub(crate) balance: Vec<LayerBalance>,
    /// A whole stage's router losses (load-balancing and z-loss, each times its
    /// coefficient) summed, with their graph (none without experts, when recomputed, and
    /// for a parallel pass, whose regions hold them).
    pub(crate) router_loss_graph: Option<Tensor>,
    /// Sequences in the micro-batch.
    pub(crate) sequences: i64,
    /// The weight of each sequence in the step's objective (default: 1 / sequences).
    pub(crate) sequence_weight: Option<f64>,
    /// A whole stage's graph cut at its pieces (instead of `graph`), for a backward that
    /// reports each piece's gradients final as it goes.
    pub(crate) cuts: Option<Vec<CutPiece>>,
    /// The last stage's loss sum with its graph, computed once in the forward
    /// ([`crate::Stage::attach_loss`]) for the backward to start from.
    pub(crate) loss: Option<Tensor>,
    /// What the forward ended with: the logits, or the normed hidden states for
    /// [`crate::Stage::attach_loss`] to run the output layer with the loss.
    pub(crate) ends_with: StageHead,
}

/// One model piece of a whole stage's forward cut at its pieces (the embedding, each
/// decoder layer, the final norm and head): its graph starts at a leaf, so its backward
/// runs on its own, and once it has run the piece's parameters have their gradients.
pub(crate) struct CutPiece {
    /// The piece (0 the embedding, 1..=L the decoder layers, L + 1 the norm and head; see
    /// [`synerfuse_plan::parameter_piece`]).
    pub(crate) piece: usize,
    /// The leaf the graph starts from (none for the embedding, whose input is tokens).
    pub(crate) input: Option<Tensor>,
    pub(crate) output: Tensor,
    /// An MoE layer's router losses (each times its coefficient), with their graph.
    pub(crate) objective: Option<Tensor>,
}

impl CutPiece {
    pub(crate) fn new(piece: usize, input: Option<Tensor>, output: Tensor) -> Self {
        CutPiece {
            piece,
            input,
            output,
            objective: None,
        }
    }
}

/// Reported during a backward that runs piece by piece: every parameter of model pieces
/// `from_piece..` has its gradient of this pass (0: all of them). A caller reducing
/// gradients over replicas can start on those while the backward goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinalGrads {
    /// The first model piece whose parameters are final (see
    /// [`synerfuse_plan::parameter_piece`]).
    pub from_piece: usize,
}

impl ForwardPass {
    pub(crate) fn new(output: Tensor, saved: SavedInputs, sequences: i64) -> Self {
        ForwardPass {
            output,
            graph: None,
            saved,
            regions: Vec::new(),
            balance: Vec::new(),
            router_loss_graph: None,
            sequences,
            sequence_weight: None,
            cuts: None,
            loss: None,
            ends_with: StageHead::Logits,
        }
    }

    /// The loss sum [`crate::Stage::attach_loss`] kept with its graph, taken out (none
    /// where the backward recomputes the forward).
    pub fn take_attached_loss(&mut self) -> Option<Tensor> {
        self.loss.take()
    }

    pub(crate) fn into_regions(self) -> (Vec<Region>, SavedInputs) {
        (self.regions, self.saved)
    }

    /// Each MoE layer's load balance over this micro-batch (none for a dense stage):
    /// the load-balancing loss and tokens per expert the log reports.
    pub fn load_balance(&self) -> &[LayerBalance] {
        &self.balance
    }

    /// Weighs this micro-batch's router losses (load-balancing, z-loss) in the backward by `weight` per
    /// sequence: 1 / the sequences of the whole step (over micro-batches and data-
    /// parallel replicas), so that it enters the step's objective as a mean over
    /// sequences. Without it the micro-batch counts as a whole step (1 / its sequences).
    pub fn set_sequence_weight(&mut self, weight: f64) {
        self.sequence_weight = Some(weight);
    }

    /// What the summed objectives of the MoE layers' losses (each times its
    /// coefficient) are multiplied by in the backward: each sequence's weight, over
    /// `tensor_parallel` ranks that each compute the whole losses (0 without experts or
    /// without a coefficient, so that the backward skips them).
    pub(crate) fn router_loss_weight(&self, config: &LlamaConfig, tensor_parallel: usize) -> f64 {
        let trained = (config.moe).is_some_and(|m| m.balance_coeff() > 0.0 || m.trains_z_loss());
        let weight = (self.sequence_weight).unwrap_or(1.0 / self.sequences.max(1) as f64);
        match trained {
            true => weight / tensor_parallel.max(1) as f64,
            false => 0.0,
        }
    }
}

/// One region of a tensor-parallel forward, kept for its backward.
pub(crate) enum Region {
    /// This rank's rows of the embedding looked up (zeros for other ranks' tokens).
    Embedding { partial: Tensor },
    /// A norm on this rank's sequence rows (sequence parallelism): its leaf input and
    /// output, which the next region all-gathers.
    Norm { input: Tensor, normed: Tensor },
    /// An attention or MLP block.
    Block(Block),
    /// The final norm (unless sequence-parallel) and this rank's slice of the output layer,
    /// with the vocabulary-parallel loss where the forward computed it for the backward.
    Head {
        input: Tensor,
        logits: Tensor,
        loss: Option<VocabParallelLoss>,
    },
}

/// A vocabulary-parallel cross-entropy's result on this rank.
pub(crate) struct VocabParallelLoss {
    /// `[n]` per-token loss (0 where the label is -100).
    pub(crate) per_token: Tensor,
    /// `[n, local vocab]` d loss_token / d logits (softmax − one-hot), 0 for ignored labels.
    pub(crate) grad: Tensor,
}

/// An attention or MLP block of a tensor-parallel forward: its replicated leaf input (the
/// residual stream, or under sequence parallelism the gathered normed rows) and its
/// partial output; under context parallelism an attention block's exchanged keys and
/// values.
pub(crate) struct Block {
    pub(crate) input: Tensor,
    pub(crate) partial: Tensor,
    pub(crate) kv: Option<KvExchange>,
    /// An MoE block's load-balancing loss over the micro-batch (graph to the router).
    pub(crate) balance: Option<Tensor>,
    /// An MoE block's token exchange with its expert-parallel group.
    pub(crate) exchange: Option<ExpertExchange>,
}
