//! A whole stage's backward: in one call, or piece by piece so that the gradients of its
//! last pieces can leave for their data-parallel reduction while the backward of its
//! first ones runs. Megatron hooks autograd's gradient accumulation for that; here the
//! forward's graph is cut where each model piece ends (a leaf at each piece's input), and
//! each piece's backward is its own call, the same arithmetic in the same order.

use crate::collectives::{OpenGate, PieceGate};
use crate::error::StageError;
use crate::llama::{BackwardFrom, Stage};
use crate::loss::{head_cross_entropy, StageHead};
use crate::moe::LayerBalance;
use crate::norm::rms_norm;
use crate::pass::{CutPiece, FinalGrads, ForwardPass};
use tch::{Kind, Tensor};

impl Stage {
    /// A training forward whose graph is cut at the stage's model pieces, for
    /// [`Stage::backward_reporting`] to hand each piece's gradients over as soon as they
    /// are final. With recomputation it keeps only the input, as [`Stage::forward_train`]
    /// does, and the backward recomputes the cut forward.
    pub fn forward_train_cut(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<ForwardPass, StageError> {
        let head = StageHead::Logits;
        self.forward_train_cut_gated(input, position_ids, attention_mask, &OpenGate, head)
    }

    /// [`Stage::forward_train_cut`], each piece waiting on `gate` first, a last stage's
    /// ending with what `ends_with` says (the logits under recomputation).
    pub(crate) fn forward_train_cut_gated(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        gate: &dyn PieceGate,
        ends_with: StageHead,
    ) -> Result<ForwardPass, StageError> {
        if self.recomputes() {
            let mask = attention_mask;
            return self.forward_train_gated(input, position_ids, mask, gate, ends_with);
        }
        let (input, saved) = self.training_input(input, position_ids, attention_mask);
        let mask = attention_mask;
        let ends_with = self.training_head(ends_with);
        let (cuts, balance) = self.cut_forward(&input, position_ids, mask, gate, ends_with)?;
        let output = match cuts.last() {
            Some(last) => last.output.detach(),
            None => input.detach(),
        };
        let mut pass = ForwardPass::new(output, saved, input.size()[0]);
        pass.balance = balance.into_iter().map(LayerBalance::detached).collect();
        pass.cuts = Some(cuts);
        pass.ends_with = ends_with;
        Ok(pass)
    }

    /// The forward of `forward_inner`, each piece's graph starting at a leaf (and each
    /// piece waiting on `gate` first): the pieces in forward order, and each MoE layer's
    /// load balance.
    fn cut_forward(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        gate: &dyn PieceGate,
        ends_with: StageHead,
    ) -> Result<(Vec<CutPiece>, Vec<LayerBalance>), StageError> {
        let sequences = input.size()[0];
        if !self.shard().is_whole() {
            return Err(StageError::Sharded);
        }
        self.check_experts_held()?;
        let mut cuts = Vec::new();
        let mut x = match self.embedding_weight() {
            Some(embedding) => {
                self.check_tokens(input)?;
                self.await_piece(gate, 0)?;
                let output = Tensor::embedding(embedding, input, -1, false, false);
                let leaf = output.detach().set_requires_grad(true);
                cuts.push(CutPiece::new(0, None, output));
                leaf
            }
            None => {
                self.check_hidden(input)?;
                input.shallow_clone()
            }
        };
        let (cos, sin) = self.rotary(&x, position_ids);
        let mut balances = Vec::new();
        for (layer, index) in self.decoder_layers().iter().zip(self.layers()) {
            self.await_piece(gate, index + 1)?;
            let mut routings = Vec::new();
            let config = self.config();
            let output = layer.forward(
                &x,
                config,
                (&cos, &sin),
                attention_mask,
                None,
                &mut routings,
            );
            let balance = self.balances(&routings, sequences, None)?;
            let mut cut = CutPiece::new(index + 1, Some(x), output.shallow_clone());
            cut.objective = self.summed_objectives(&balance);
            balances.extend(balance);
            cuts.push(cut);
            x = output.detach().set_requires_grad(true);
        }
        if let Some((norm, head)) = self.norm_and_head() {
            self.await_piece(gate, self.head_piece())?;
            let h = rms_norm(&x, norm, self.config().rms_norm_eps);
            let output = match ends_with {
                StageHead::Logits => h.linear::<Tensor>(head, None),
                StageHead::WithLoss => h,
            };
            cuts.push(CutPiece::new(self.head_piece(), Some(x), output));
        }
        Ok((cuts, balances))
    }

    /// The loss of a last stage's `pass` over `labels` (Σ per-token loss, loss tokens),
    /// values without a graph: computed from the forward's own graph and kept in the pass
    /// ([`ForwardPass::take_attached_loss`]), so that the backward starts from it rather
    /// than computing the loss again; without a graph (a recomputing stage) only the
    /// values. A pass that ended with its normed hidden states
    /// ([`crate::StageHead::WithLoss`]) runs the output layer here, with the loss, a chunk
    /// of tokens at a time, and keeps the gradients it computed on the way for the
    /// backward (the same losses, bit for bit). Neither value is read on the host here.
    pub fn attach_loss(
        &self,
        pass: &mut ForwardPass,
        labels: &Tensor,
        loss_mask: Option<&Tensor>,
    ) -> (Tensor, Tensor) {
        let graph = match (&pass.graph, &pass.cuts) {
            (Some(graph), _) => Some(graph.shallow_clone()),
            (None, Some(cuts)) => cuts.last().map(|c| c.output.shallow_clone()),
            (None, None) => None,
        };
        match (graph, pass.ends_with, self.norm_and_head()) {
            (Some(h), StageHead::WithLoss, Some((_, head))) => {
                let loss = head_cross_entropy(&h, head, labels, loss_mask);
                pass.loss = Some(loss.surrogate);
                (loss.sum, loss.count)
            }
            (Some(logits), ..) => {
                let (sum, count) = Stage::loss(&logits, labels, loss_mask);
                let value = sum.detach();
                pass.loss = Some(sum);
                (value, count)
            }
            (None, ..) => tch::no_grad(|| Stage::loss(&pass.output, labels, loss_mask)),
        }
    }

    /// Backpropagates `pass` given the gradient of its output (or, on the last stage, a
    /// scalar loss built from `pass.output`, with `output_grad = None`). Accumulates the
    /// parameter gradients and returns the gradient of the stage input (none on the
    /// first stage).
    pub fn backward(
        &self,
        pass: ForwardPass,
        loss_or_output_grad: BackwardFrom<'_>,
    ) -> Result<Option<Tensor>, StageError> {
        self.backward_reporting(pass, loss_or_output_grad, &mut |_| {})
    }

    /// [`Stage::backward`], telling `report` whenever more parameters have their
    /// gradients of this pass: piece by piece, from the last, for a pass of
    /// [`Stage::forward_train_cut`] (or a recomputed one); once, at the end, otherwise.
    /// The last report is always of every piece (`from_piece` 0).
    pub fn backward_reporting(
        &self,
        mut pass: ForwardPass,
        loss_or_output_grad: BackwardFrom<'_>,
        report: &mut dyn FnMut(FinalGrads),
    ) -> Result<Option<Tensor>, StageError> {
        if !pass.regions.is_empty() {
            return Err(StageError::Sharded);
        }
        let weight = pass.router_loss_weight(self.config(), 1);
        let saved = &pass.saved;
        let cuts = match (pass.cuts.take(), pass.graph.take()) {
            (Some(cuts), _) => cuts,
            (None, Some(graph)) => {
                let balance = pass.router_loss_graph.take();
                backward_through(&graph, &loss_or_output_grad, balance, weight);
                Vec::new()
            }
            // Recomputed: the forward again, cut, with the graph this time.
            (None, None) => {
                let (positions, mask) =
                    (saved.position_ids.as_ref(), saved.attention_mask.as_ref());
                self.cut_forward(&saved.input, positions, mask, &OpenGate, StageHead::Logits)?
                    .0
            }
        };
        backward_piece_by_piece(cuts, &loss_or_output_grad, weight, report);
        report(FinalGrads { from_piece: 0 });
        Ok((!self.is_first()).then(|| pass.saved.input.grad()))
    }
}

/// One backward through `output`, from the loss or the output's gradient, with the
/// router losses `balance` times `weight`.
fn backward_through(
    output: &Tensor,
    from: &BackwardFrom<'_>,
    balance: Option<Tensor>,
    weight: f64,
) {
    let loss = match from {
        BackwardFrom::OutputGrad(grad) => (output * *grad).sum(Kind::Float),
        BackwardFrom::Loss(loss_of) => loss_of(output),
    };
    match balance.filter(|_| weight != 0.0) {
        Some(balance) => (loss + balance * weight).backward(),
        None => loss.backward(),
    }
}

/// The backward of `cuts` from the last piece to the first, each from the gradient of
/// its output (the loss, or the stage output's gradient, for the last), reporting each
/// piece as its gradients become final.
fn backward_piece_by_piece(
    cuts: Vec<CutPiece>,
    from: &BackwardFrom<'_>,
    weight: f64,
    report: &mut dyn FnMut(FinalGrads),
) {
    let mut grad: Option<Tensor> = None;
    for cut in cuts.into_iter().rev() {
        let from_here = match &grad {
            Some(g) => BackwardFrom::OutputGrad(g),
            None => match from {
                BackwardFrom::OutputGrad(g) => BackwardFrom::OutputGrad(g),
                BackwardFrom::Loss(loss_of) => BackwardFrom::Loss(*loss_of),
            },
        };
        backward_through(&cut.output, &from_here, cut.objective, weight);
        report(FinalGrads {
            from_piece: cut.piece,
        });
        grad = cut.input.map(|leaf| leaf.grad());
    }
}
