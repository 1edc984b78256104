//! Projections that share one GEMM (q, k and v; gate and up) through the C++ shim in
//! `csrc/joined_linear.cpp`: the weights stay parameters with transformers' names (what
//! checkpoints, Hugging Face import and export, tensor-parallel shards and the optimizer
//! see), but their rows lie end to end in one buffer ([`lay_end_to_end`]), so the GEMM
//! reads the buffer as one weight: no concatenated copy per forward, and none kept for
//! the backward (Megatron stores `linear_qkv` and `linear_fc1` fused for the same reason).

use std::ffi::c_char;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::shim::{new_tensor, pointers};

extern "C" {
    fn synerfuse_joined_linear(
        x: *const C_tensor,
        weights: *const *mut C_tensor,
        biases: *const *mut C_tensor,
        n: usize,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn synerfuse_weights_adjacent(weights: *const *mut C_tensor, n: usize) -> bool;
}

/// `x·[w₀; w₁; …]ᵀ + [b₀; b₁; …]` (`x` `[..., inputs]`, each weight `[rows, inputs]`):
/// one GEMM over the weights' buffer where they lie end to end, else over their
/// concatenation (the same value). The backward gives each weight its rows of the one
/// weight gradient.
///
/// Panics, as tch's own operators do, when libtorch refuses the shapes (a bug here: the
/// shapes come from the configuration, checked when the stage is built).
pub(crate) fn joined_linear(x: &Tensor, weights: &[&Tensor], biases: Option<&[&Tensor]>) -> Tensor {
    let w = pointers(weights);
    let b = biases.map(pointers);
    assert!(b.as_ref().is_none_or(|b| b.len() == w.len()));
    let what = || format!("joined projection of {x:?} by {} weights", weights.len());
    // SAFETY: every pointer is a live tensor borrowed for the call; the shim writes a new
    // tensor it allocated into `out` only when it returns no error, else a message.
    unsafe {
        new_tensor(what, |out| {
            synerfuse_joined_linear(
                x.as_ptr(),
                w.as_ptr(),
                b.as_ref().map_or(std::ptr::null(), |b| b.as_ptr()),
                w.len(),
                out,
            )
        })
    }
}

/// Whether `weights` are rows of one buffer laid end to end (what [`joined_linear`]
/// reads without a copy).
pub(crate) fn adjacent(weights: &[&Tensor]) -> bool {
    let w = pointers(weights);
    // SAFETY: the pointers are live tensors borrowed for the call, only read.
    unsafe { synerfuse_weights_adjacent(w.as_ptr(), w.len()) }
}

/// Moves the values of `weights` (2-D, one column count, kind and device) into one new
/// buffer, their rows end to end, each weight then a slice of it: the same parameters
/// (autograd leaves, their names and gradients their own), their storage shared. Whatever
/// replaces a weight's storage afterwards (a cast) must lay them out again.
pub(crate) fn lay_end_to_end(weights: &mut [&mut Tensor]) {
    let rows: i64 = weights.iter().map(|w| w.size()[0]).sum();
    let first = &weights[0];
    let buffer = Tensor::empty([rows, first.size()[1]], (first.kind(), first.device()));
    let mut row = 0;
    for w in weights.iter_mut() {
        let n = w.size()[0];
        let mut slice = buffer.narrow(0, row, n);
        tch::no_grad(|| slice.copy_(w));
        w.set_data(&slice);
        row += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn leaf(shape: &[i64], seed: i64) -> Tensor {
        crate::test_values::leaf(shape, seed as f64, 1.0)
    }

    /// The value and the gradients of `x`, the weights and the biases after a backward
    /// from a fixed upstream gradient, through `project`, twice (as two micro-batches
    /// accumulate).
    fn run(
        project: impl Fn(&Tensor, &[&Tensor], &[&Tensor]) -> Tensor,
        end_to_end: bool,
    ) -> (Tensor, Vec<Tensor>) {
        let x = leaf(&[2, 5, 8], 1);
        let mut weights = [leaf(&[6, 8], 2), leaf(&[3, 8], 3), leaf(&[3, 8], 4)];
        let biases = [leaf(&[6], 5), leaf(&[3], 6), leaf(&[3], 7)];
        if end_to_end {
            let [q, k, v] = &mut weights;
            lay_end_to_end(&mut [q, k, v]);
            assert!(adjacent(&[q, k, v]) && adjacent(&[k, v]));
        } else {
            assert!(!adjacent(&[&weights[0], &weights[1], &weights[2]]));
        }
        let w: Vec<&Tensor> = weights.iter().collect();
        let b: Vec<&Tensor> = biases.iter().collect();
        let upstream = leaf(&[2, 5, 12], 8).detach();
        let mut y = Tensor::new();
        for _ in 0..2 {
            y = project(&x, &w, &b);
            (&y * &upstream).sum(Kind::Float).backward();
        }
        let grads = [&x].into_iter().chain(&weights).chain(&biases);
        (y.detach(), grads.map(|t| t.grad().copy()).collect())
    }

    fn through_cat(x: &Tensor, w: &[&Tensor], b: &[&Tensor]) -> Tensor {
        x.linear(&Tensor::cat(w, 0), Some(&Tensor::cat(b, 0)))
    }

    fn joined(x: &Tensor, w: &[&Tensor], b: &[&Tensor]) -> Tensor {
        joined_linear(x, w, Some(b))
    }

    #[test]
    fn a_joined_projection_is_the_concatenated_one() {
        let (want, want_grads) = run(through_cat, false);
        for end_to_end in [true, false] {
            let (got, grads) = run(joined, end_to_end);
            // The forward is the same GEMM: the same bits.
            assert!(got.equal(&want), "end to end: {end_to_end}");
            for (g, w) in grads.iter().zip(&want_grads) {
                let err = (g - w).abs().max().double_value(&[]);
                assert!(err < 1e-5, "end to end {end_to_end}: gradient off by {err}");
            }
        }
    }

    #[test]
    fn a_projection_without_biases_or_input_gradient_differentiates_its_weights() {
        let x = leaf(&[4, 8], 1).detach();
        let mut weights = [leaf(&[6, 8], 2), leaf(&[6, 8], 3)];
        let [g, u] = &mut weights;
        lay_end_to_end(&mut [g, u]);
        joined_linear(&x, &[g, u], None).sum(Kind::Float).backward();
        let want = x
            .sum_dim_intlist(0, true, Kind::Float)
            .expand([6, 8], false);
        assert!(g.grad().allclose(&want, 1e-6, 1e-6, false));
        assert!(u.grad().allclose(&want, 1e-6, 1e-6, false));
    }

    /// libtorch's refusal comes back through the shim as a message, not an exception
    /// across the C boundary.
    #[test]
    #[should_panic(expected = "by 2 weights: ")]
    fn a_refused_projection_names_libtorchs_reason() {
        let x = leaf(&[4, 8], 1);
        let _ = joined_linear(&x, &[&leaf(&[6, 8], 2), &leaf(&[3, 7], 3)], None);
    }

    #[test]
    fn laying_weights_end_to_end_keeps_their_values_and_leaves() {
        let mut weights = [leaf(&[2, 4], 1), leaf(&[3, 4], 2)];
        let before: Vec<Tensor> = weights.iter().map(|w| w.detach().copy()).collect();
        let [a, b] = &mut weights;
        lay_end_to_end(&mut [a, b]);
        for (w, v) in weights.iter().zip(&before) {
            assert!(w.equal(v) && w.requires_grad() && w.is_leaf());
        }
    }
}
