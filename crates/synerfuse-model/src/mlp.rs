//! Dense projections and the SwiGLU MLP built from them: a dense layer's MLP and each
//! expert's, below both the decoder layers and the mixture of experts that use them.

use tch::{nn, Tensor};

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

    /// [`Self::forward`] in three products without joining the gate and up weights: no
    /// copy of them per call, fewer operations for an expert's few rows.
    pub(crate) fn forward_unjoined(&self, h: &Tensor) -> Tensor {
        self.down
            .forward(&(self.gate.forward(h).silu() * self.up.forward(h)))
    }

    pub(crate) fn forward(&self, h: &Tensor) -> Tensor {
        let ffn = self.gate.weight.size()[0];
        let gate_up = h.linear(
            &Tensor::cat(&[&self.gate.weight, &self.up.weight], 0),
            match (&self.gate.bias, &self.up.bias) {
                (Some(g), Some(u)) => Some(Tensor::cat(&[g, u], 0)),
                _ => None,
            }
            .as_ref(),
        );
        let gate_up = gate_up.split_with_sizes([ffn, ffn], -1);
        self.down.forward(&(gate_up[0].silu() * &gate_up[1]))
    }
}
