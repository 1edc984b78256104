//! What a stage's forward keeps for its backward, whole or tensor-parallel: the types
//! the whole stage (`llama`) and the sharded one (`tp`) share, so that neither imports
//! the other's.

use tch::Tensor;

/// The inputs a stage's forward was run on, for a backward that recomputes it.
pub(crate) struct SavedInputs {
    pub(crate) input: Tensor,
    pub(crate) position_ids: Option<Tensor>,
    pub(crate) attention_mask: Option<Tensor>,
}

/// One micro-batch's forward through a stage, kept until its backward.
pub struct ForwardPass {
    /// The stage output (hidden states or logits), detached from nothing: send it on.
    pub output: Tensor,
    /// The autograd graph's output (none when the backward recomputes the forward).
    pub(crate) graph: Option<Tensor>,
    pub(crate) saved: SavedInputs,
    /// The regions of a tensor-parallel pass (empty for a whole stage).
    pub(crate) regions: Vec<Region>,
}

impl ForwardPass {
    pub(crate) fn regions(output: Tensor, regions: Vec<Region>, saved: SavedInputs) -> Self {
        ForwardPass {
            output,
            graph: None,
            saved,
            regions,
        }
    }

    pub(crate) fn into_regions(self) -> (Vec<Region>, SavedInputs) {
        (self.regions, self.saved)
    }
}

/// One region of a tensor-parallel forward, kept for its backward.
pub(crate) enum Region {
    /// This rank's rows of the embedding looked up (zeros for other ranks' tokens).
    Embedding { partial: Tensor },
    /// A norm on this rank's sequence rows (sequence parallelism): its leaf input and
    /// output, which the next region all-gathers.
    Norm { input: Tensor, normed: Tensor },
    /// An attention or MLP block: its replicated leaf input (the residual stream, or
    /// under sequence parallelism the gathered normed rows) and its partial output; under
    /// context parallelism an attention block's exchanged keys and values.
    Block {
        input: Tensor,
        partial: Tensor,
        kv: Option<crate::cp::KvExchange>,
    },
    /// The final norm (unless sequence-parallel) and this rank's slice of the output layer.
    Head { input: Tensor, logits: Tensor },
}
