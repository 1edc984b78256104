//! RMSNorm, shared by whole and tensor-parallel stages.

use tch::{Kind, Tensor};

/// RMSNorm as transformers computes it: in fp32, then back to the input dtype.
///
/// On a GPU, libtorch's fused kernel: the same fp32 arithmetic in one pass instead of
/// seven elementwise kernels over fp32 copies, rounded to the input dtype once, after
/// the weight, where transformers rounds before the weight too (bf16 only; fp32 agrees
/// to rounding).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    if x.device().is_cuda() {
        let hidden = x.size().last().copied().unwrap_or(0);
        return x.rms_norm([hidden], Some(weight), eps);
    }
    let kind = x.kind();
    let h = x.to_kind(Kind::Float);
    let variance = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let h = &h * (variance + eps).rsqrt();
    weight * h.to_kind(kind)
}
