//! A training forward that waits, before each model piece, for that piece's parameters:
//! under Megatron's `--overlap-param-gather` the distributed optimizer's all-gather of
//! the updated parameters is still in flight when the next step's forward begins, bucket
//! by bucket, and each piece waits only for its own (the caller's [`PieceGate`], with
//! the collectives at the bottom of the crate).

use crate::collectives::{PieceGate, TpCollectives};
use crate::cp::ContextGroup;
use crate::error::StageError;
use crate::llama::Stage;
use crate::loss::StageHead;
use crate::moe::ExpertGroup;
use crate::pass::ForwardPass;
use tch::Tensor;

/// A stage whose training forwards wait on a [`PieceGate`] before each of its model
/// pieces (see [`Stage::gated`]); otherwise the stage's own forwards, bit for bit.
pub struct GatedStage<'a> {
    stage: &'a Stage,
    gate: &'a dyn PieceGate,
    ends_with: StageHead,
}

impl Stage {
    /// This stage's training forwards, each piece waiting on `gate` first.
    pub fn gated<'a>(&'a self, gate: &'a dyn PieceGate) -> GatedStage<'a> {
        GatedStage {
            stage: self,
            gate,
            ends_with: StageHead::Logits,
        }
    }
}

impl GatedStage<'_> {
    /// The same forwards, a last stage's ending with `ends_with` (whole stages: a
    /// tensor-parallel stage's forward ends with its logits).
    pub fn ending_with(self, ends_with: StageHead) -> Self {
        GatedStage { ends_with, ..self }
    }

    /// [`Stage::forward_train`], gated.
    pub fn forward_train(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<ForwardPass, StageError> {
        let (mask, head) = (attention_mask, self.ends_with);
        (self.stage).forward_train_gated(input, position_ids, mask, self.gate, head)
    }

    /// [`Stage::forward_train_cut`], gated.
    pub fn forward_train_cut(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<ForwardPass, StageError> {
        let (mask, head) = (attention_mask, self.ends_with);
        (self.stage).forward_train_cut_gated(input, position_ids, mask, self.gate, head)
    }

    /// [`Stage::forward_train_parallel`], gated.
    pub fn forward_train_parallel(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        tp: &dyn TpCollectives,
        groups: (Option<&ContextGroup<'_>>, Option<&ExpertGroup<'_>>),
    ) -> Result<ForwardPass, StageError> {
        let (stage, gate) = (self.stage, self.gate);
        stage.forward_train_parallel_gated(input, position_ids, attention_mask, tp, groups, gate)
    }
}
