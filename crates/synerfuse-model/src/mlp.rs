//! Dense projections and the SwiGLU MLP built from them: a dense layer's MLP and each
//! expert's, below both the decoder layers and the mixture of experts that use them.

use std::ffi::c_char;

use tch::{nn, Tensor};
use torch_sys::C_tensor;

use crate::joined::{adjacent, joined_linear, lay_end_to_end};
use crate::shim::new_tensor;

extern "C" {
    fn synerfuse_swiglu(
        gate: *const C_tensor,
        up: *const C_tensor,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn synerfuse_joined_swiglu(gate_up: *const C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
}

/// `silu(gate) · up` (same shapes) as one autograd node (`csrc/swiglu.cpp`) that keeps
/// only `gate` and `up` for the backward, which recomputes SiLU: autograd over the
/// formula would also keep SiLU's output, a `[tokens, ffn]` tensor per layer. Values and
/// gradients are the formula's, by the same libtorch kernels.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    let what = || format!("SwiGLU of {gate:?} and {up:?}");
    // SAFETY: both pointers are live tensors borrowed for the call; the shim writes a new
    // tensor it allocated into `out` only when it returns no error, else a message.
    unsafe {
        new_tensor(what, |out| {
            synerfuse_swiglu(gate.as_ptr(), up.as_ptr(), out)
        })
    }
}

/// [`swiglu`] of the halves of one projection `gate_up` `[..., 2·ffn]` (gate first), its
/// gradient's halves written in place in the backward (autograd would concatenate them).
pub(crate) fn joined_swiglu(gate_up: &Tensor) -> Tensor {
    let what = || format!("SwiGLU of the joined {gate_up:?}");
    // SAFETY: the pointer is a live tensor borrowed for the call; the shim writes a new
    // tensor it allocated into `out` only when it returns no error, else a message.
    unsafe { new_tensor(what, |out| synerfuse_joined_swiglu(gate_up.as_ptr(), out)) }
}

/// A dense projection `x·Wᵀ + b`: the attention's and the MLPs' (the router's too).
pub(crate) struct Linear {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
}

impl Linear {
    /// Under `path`, weights `[outputs, inputs]` drawn from N(0, `std`²) and, with
    /// `bias`, a zero bias.
    pub(crate) fn new(
        path: nn::Path,
        inputs: usize,
        outputs: usize,
        bias: bool,
        std: f64,
    ) -> Linear {
        let weight = path.var(
            "weight",
            &[outputs as i64, inputs as i64],
            nn::Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        );
        let bias = bias.then(|| path.var("bias", &[outputs as i64], nn::Init::Const(0.0)));
        Linear { weight, bias }
    }

    /// The projection of `x` `[..., inputs]`.
    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }
}

/// A SwiGLU MLP (a dense layer's, or one expert's), its gate and up projections run as
/// one GEMM.
pub(crate) struct SwiGlu {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl SwiGlu {
    /// Under `path`, projections named `names` (gate, up, down) between `h` and `ffn`;
    /// `bias` on gate and up, and on down.
    pub(crate) fn new(
        path: &nn::Path,
        [gate, up, down]: [&str; 3],
        (h, ffn): (usize, usize),
        (bias, down_bias): (bool, bool),
        (std, out_std): (f64, f64),
    ) -> SwiGlu {
        SwiGlu {
            gate: Linear::new(path / gate, h, ffn, bias, std),
            up: Linear::new(path / up, h, ffn, bias, std),
            down: Linear::new(path / down, ffn, h, down_bias, out_std),
        }
    }

    /// [`Self::forward`] in three products, the gate and up weights apart: an expert's,
    /// whose weights are not laid end to end, for its few rows.
    pub(crate) fn forward_unjoined(&self, h: &Tensor) -> Tensor {
        self.down
            .forward(&swiglu(&self.gate.forward(h), &self.up.forward(h)))
    }

    /// The gate and up projections as one GEMM over their weights' buffer (see
    /// [`crate::joined`]), then SwiGLU ([`joined_swiglu`]) and the down projection.
    pub(crate) fn forward(&self, h: &Tensor) -> Tensor {
        let biases = match (&self.gate.bias, &self.up.bias) {
            (Some(g), Some(u)) => Some([g, u]),
            _ => None,
        };
        let gate_up = joined_linear(
            h,
            &[&self.gate.weight, &self.up.weight],
            biases.as_ref().map(|b| &b[..]),
        );
        self.down.forward(&joined_swiglu(&gate_up))
    }

    /// Lays the gate and up weights end to end in one buffer (see
    /// [`crate::joined::lay_end_to_end`]).
    pub(crate) fn lay_weights_end_to_end(&mut self) {
        lay_end_to_end(&mut [&mut self.gate.weight, &mut self.up.weight]);
    }

    /// Whether the gate and up weights lie end to end.
    pub(crate) fn weights_end_to_end(&self) -> bool {
        adjacent(&[&self.gate.weight, &self.up.weight])
    }
}

#[cfg(test)]
mod tests {
    use super::{joined_swiglu, swiglu};
    use tch::{Kind, Tensor};

    fn leaf(shape: &[i64], seed: f64) -> Tensor {
        crate::test_values::leaf(shape, seed, 3.0)
    }

    /// The value and the gradients of `gate` and `up` through `f`, after two backwards
    /// (two micro-batches accumulating), with `up` a constant when not `up_grad`.
    fn run(f: impl Fn(&Tensor, &Tensor) -> Tensor, up_grad: bool) -> Vec<Tensor> {
        run_on_projection(|gate_up| {
            let parts = gate_up.split_with_sizes([5, 5], -1);
            let up = match up_grad {
                true => parts[1].shallow_clone(),
                false => parts[1].detach(),
            };
            f(&parts[0], &up)
        })
    }

    /// The value of `f` of a gate/up projection and the projection's gradient, after two
    /// backwards.
    fn run_on_projection(f: impl Fn(&Tensor) -> Tensor) -> Vec<Tensor> {
        let gate_up = leaf(&[3, 4, 10], 1.0);
        let upstream = leaf(&[3, 4, 5], 2.0).detach();
        let mut y = Tensor::new();
        for _ in 0..2 {
            y = f(&gate_up);
            (&y * &upstream).sum(Kind::Float).backward();
        }
        vec![y.detach(), gate_up.grad().copy()]
    }

    #[test]
    fn swiglu_is_the_formula_to_the_bit_in_value_and_gradients() {
        for up_grad in [true, false] {
            let want = run(|g, u| g.silu() * u, up_grad);
            let got = run(swiglu, up_grad);
            for (g, w) in got.iter().zip(&want) {
                assert!(g.equal(w), "up differentiated: {up_grad}: {g:?} vs {w:?}");
            }
        }
        // Over the joined projection: the halves' gradients written in place.
        let want = run(|g, u| g.silu() * u, true);
        let got = run_on_projection(joined_swiglu);
        for (g, w) in got.iter().zip(&want) {
            assert!(g.equal(w), "joined: {g:?} vs {w:?}");
        }
    }

    #[test]
    #[should_panic(expected = "differ in shape")]
    fn swiglu_of_unlike_shapes_names_them() {
        let _ = swiglu(&leaf(&[2, 5], 1.0), &leaf(&[2, 4], 2.0));
    }
}
