//! Dense projections and the SwiGLU MLP built from them: a dense layer's MLP and each
//! expert's, below both the decoder layers and the mixture of experts that use them.

use tch::{nn, Tensor};

use crate::joined::{adjacent, joined_linear, lay_end_to_end};

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
            .forward(&(self.gate.forward(h).silu() * self.up.forward(h)))
    }

    /// The gate and up projections as one GEMM over their weights' buffer (see
    /// [`crate::joined`]), then SwiGLU and the down projection.
    pub(crate) fn forward(&self, h: &Tensor) -> Tensor {
        let ffn = self.gate.weight.size()[0];
        let biases = match (&self.gate.bias, &self.up.bias) {
            (Some(g), Some(u)) => Some([g, u]),
            _ => None,
        };
        let gate_up = joined_linear(
            h,
            &[&self.gate.weight, &self.up.weight],
            biases.as_ref().map(|b| &b[..]),
        );
        let gate_up = gate_up.split_with_sizes([ffn, ffn], -1);
        self.down.forward(&(gate_up[0].silu() * &gate_up[1]))
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
