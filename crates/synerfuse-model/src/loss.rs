//! The last stage's output layer and cross-entropy run together, a chunk of tokens at a
//! time, so that the fp32 logits of the whole micro-batch (and their softmax and
//! gradient, each as large) never exist at once: Liger-Kernel's fused linear
//! cross-entropy, in libtorch's own kernels. The gradients with respect to the normed
//! hidden states and the output weight are computed in the same pass, and the backward
//! is handed them through a surrogate scalar (see [`HeadLoss::surrogate`]).

use tch::{Kind, Tensor};

/// What a last stage's training forward ends with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StageHead {
    /// The logits `[b, s, vocab]` (in the stage's dtype).
    #[default]
    Logits,
    /// The normed hidden states `[b, s, hidden]`: the output layer runs with the loss,
    /// in chunks, when [`crate::Stage::attach_loss`] computes it. A stage that recomputes
    /// its forward, and any stage but the last, ends as it would with `Logits`.
    WithLoss,
}

/// The loss of one micro-batch computed with the output layer.
pub(crate) struct HeadLoss {
    /// Σ per-token loss where the loss mask is 1 (fp32 scalar, no graph).
    pub(crate) sum: Tensor,
    /// Tokens the loss counts (fp32 scalar).
    pub(crate) count: Tensor,
    /// A scalar whose gradient with respect to the hidden states and the output weight
    /// is that of `sum` (its value is not the loss): the backward starts from it.
    pub(crate) surrogate: Tensor,
}

/// Tokens per chunk: a chunk's logits about four times as many numbers as the hidden
/// states of the whole micro-batch, so that the loss holds a few activations' worth,
/// not the vocabulary's. Liger-Kernel's rule is one times; on the CPU bench's shape
/// (2048 tokens, hidden 512, vocabulary 8192) 128-token chunks stepped ~2 % slower than
/// the whole logits, 512-token ones as fast (2026-11-30).
pub(crate) fn chunk_tokens(tokens: i64, hidden: i64, vocab: i64) -> i64 {
    let vocab = vocab.max(1);
    ((4 * tokens * hidden + vocab - 1) / vocab).clamp(1, tokens.max(1))
}

/// The masked next-token cross-entropy of `head`'s logits of `h` (the normed hidden
/// states `[b, s, hidden]`, with their graph) against `labels` `[b, s]` (-100 ignored),
/// chunk by chunk. The per-token losses are those of [`crate::Stage::loss`] on the whole
/// logits, bit for bit, and summed the same way.
pub(crate) fn head_cross_entropy(
    h: &Tensor,
    head: &Tensor,
    labels: &Tensor,
    loss_mask: Option<&Tensor>,
) -> HeadLoss {
    let hidden = *h.size().last().unwrap_or(&1);
    let flat = h.reshape([-1, hidden]);
    let labels = labels.reshape([-1]);
    let mask = loss_mask.map(|m| m.to_kind(Kind::Float).reshape([-1]));
    let (per_token, grad_h, grad_w) =
        tch::no_grad(|| chunked_loss_and_grads(&flat, head, &labels, mask.as_ref()));
    let (sum, count) = match &mask {
        Some(mask) => ((&per_token * mask).sum(Kind::Float), mask.sum(Kind::Float)),
        None => {
            let count = Tensor::from(per_token.numel() as f32).to_device(per_token.device());
            (per_token.sum(Kind::Float), count)
        }
    };
    let surrogate =
        (&flat * &grad_h).sum(Kind::Float) + (head * grad_w.to_kind(head.kind())).sum(Kind::Float);
    HeadLoss {
        sum,
        count,
        surrogate,
    }
}

/// Per-token losses `[tokens]` (fp32, 0 where ignored), and the gradients of their
/// masked sum with respect to `x` `[tokens, hidden]` (in `x`'s dtype) and `head`
/// `[vocab, hidden]` (fp32, summed over the chunks).
fn chunked_loss_and_grads(
    x: &Tensor,
    head: &Tensor,
    labels: &Tensor,
    mask: Option<&Tensor>,
) -> (Tensor, Tensor, Tensor) {
    let (tokens, hidden) = (x.size()[0], x.size()[1]);
    let vocab = head.size()[0];
    let device = x.device();
    let valid = labels.ne(-100);
    // d(Σ mask·loss)/d(loss) per token: the mask where the label counts, else 0.
    let weights = match mask {
        Some(mask) => mask * valid.to_kind(Kind::Float),
        None => valid.to_kind(Kind::Float),
    };
    let per_token = Tensor::zeros([tokens], (Kind::Float, device));
    let grad_x = x.zeros_like();
    let mut grad_w = Tensor::zeros([vocab, hidden], (Kind::Float, device));
    let step = chunk_tokens(tokens, hidden, vocab);
    let mut start = 0;
    while start < tokens {
        let n = step.min(tokens - start);
        let xc = x.narrow(0, start, n);
        let target = labels.narrow(0, start, n).clamp_min(0).unsqueeze(1);
        let log_probs = xc
            .linear::<Tensor>(head, None)
            .to_kind(Kind::Float)
            .log_softmax(1, Kind::Float);
        let ignored = valid.narrow(0, start, n).logical_not();
        let nll = log_probs.gather(1, &target, false).squeeze_dim(1).neg();
        per_token
            .narrow(0, start, n)
            .copy_(&nll.masked_fill(&ignored, 0.0));
        // The log-softmax's backward from a gradient of -w at the label: w·softmax,
        // less w at the label.
        // (In place: the log-probabilities are not needed after this.)
        let w = weights.narrow(0, start, n).unsqueeze(1);
        let mut grad_logits = log_probs;
        let _ = grad_logits.exp_();
        let _ = grad_logits.g_mul_(&w);
        let _ = grad_logits.scatter_add_(1, &target, &w.neg());
        let grad_logits = grad_logits.to_kind(x.kind());
        grad_x.narrow(0, start, n).copy_(&grad_logits.mm(head));
        match x.kind() {
            Kind::Float => {
                let _ = grad_w.addmm_(&grad_logits.tr(), &xc);
            }
            _ => grad_w += grad_logits.tr().mm(&xc).to_kind(Kind::Float),
        }
        start += n;
    }
    (per_token, grad_x, grad_w)
}

#[cfg(test)]
mod tests {
    use super::chunk_tokens;

    #[test]
    fn a_chunks_logits_are_a_few_times_the_hidden_states_of_the_micro_batch() {
        // The CPU bench's shape: 2048 tokens, hidden 512, vocabulary 8192.
        assert_eq!(chunk_tokens(2048, 512, 8192), 512);
        // A hidden size above the vocabulary's: one chunk.
        assert_eq!(chunk_tokens(100, 4096, 512), 100);
        assert_eq!(chunk_tokens(50, 32, 512), 13);
        assert_eq!(chunk_tokens(1, 8, 1 << 20), 1);
        assert_eq!(chunk_tokens(0, 8, 16), 1);
    }
}
