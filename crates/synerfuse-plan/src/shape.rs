//! The shape of a LLaMA model (dense or with experts) and the arithmetic every layer of the
//! house shares: parameters, FLOPs (Megatron's count for throughput and MFU), activation and
//! message bytes. A description of what runs, so the plan checks, the runtime's throughput
//! and the planner's cost model all read one formula.

use serde::{Deserialize, Serialize};

/// The shape of a LLaMA model, as the planner needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Decoder layers.
    pub num_layers: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// FFN size.
    pub ffn_hidden_size: usize,
    /// Vocabulary (padded).
    pub vocab_size: usize,
    /// Tokens per sample.
    pub seq_length: usize,
    /// Tied embedding and head.
    pub tied: bool,
    /// A mixture of experts in place of some layers' MLP (none: dense).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertShape>,
}

/// The experts of an MoE model, as the planner needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertShape {
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Width of each expert's SwiGLU.
    pub ffn_hidden_size: usize,
    /// Layer `i` has experts when `i % layer_freq == 0`.
    pub layer_freq: usize,
}

impl ExpertShape {
    /// How many of `num_layers` layers have experts.
    pub fn moe_layers(&self, num_layers: usize) -> usize {
        num_layers.div_ceil(self.layer_freq.max(1))
    }
}

impl ModelShape {
    /// The MoE layers and the dense ones (all dense without experts).
    fn layer_kinds(&self) -> (f64, f64) {
        let moe = self.experts.map_or(0, |e| e.moe_layers(self.num_layers));
        (moe as f64, (self.num_layers - moe) as f64)
    }

    /// A mean layer's MLP widths: (parameters, per-token compute) in FFN columns, the
    /// MoE layers' all experts and their top-k, spread over all layers.
    fn mean_ffn(&self) -> (f64, f64) {
        let (moe, dense) = self.layer_kinds();
        let f = self.ffn_hidden_size as f64 * dense;
        let l = self.num_layers.max(1) as f64;
        match self.experts {
            Some(e) => {
                let fe = e.ffn_hidden_size as f64 * moe;
                (
                    (f + fe * e.num_experts as f64) / l,
                    (f + fe * e.top_k as f64) / l,
                )
            }
            None => (f / l, f / l),
        }
    }

    /// Megatron-LM's FLOPs of one training sample (`num_floating_point_operations` in
    /// its `training.py`, batch size 1): forward and backward of every GEMM (`12 = 3 x 2
    /// x 2`), the attention over `kv_channels`-wide heads with grouped key/value heads,
    /// SwiGLU's third projection (x 3/2), and the output layer over the padded
    /// vocabulary. Megatron counts the output layer once whether or not it is tied to
    /// the embedding, and so does this, so throughputs compare with its logs. With
    /// experts, as Megatron's later versions: an MoE layer's MLP counts its top-k
    /// experts' width (the router not at all).
    pub fn megatron_flops_per_sample(&self, kv_channels: usize) -> f64 {
        let (s, l, h) = (
            self.seq_length as f64,
            self.num_layers as f64,
            self.hidden_size as f64,
        );
        let heads = self.num_heads as f64;
        let query_to_hidden = kv_channels as f64 * heads / h;
        let attention = (1.0 + self.num_kv_heads as f64 / heads + s / h) * query_to_hidden;
        let mlp = self.mean_ffn().1 / h * 1.5;
        let logit = self.vocab_size as f64 / (2.0 * l * h);
        12.0 * s * l * h * h * (attention + mlp + logit)
    }

    fn kv_width(&self) -> f64 {
        (self.hidden_size * self.num_kv_heads / self.num_heads.max(1)) as f64
    }

    /// A mean layer's expert weights (every expert of the MoE layers, spread over all
    /// layers; routers not): what expert parallelism divides among its members.
    pub fn expert_layer_params(&self) -> f64 {
        let Some(e) = self.experts else {
            return 0.0;
        };
        let (moe, _) = self.layer_kinds();
        let width =
            (e.ffn_hidden_size * e.num_experts) as f64 * moe / self.num_layers.max(1) as f64;
        3.0 * self.hidden_size as f64 * width
    }

    /// The share of a mean layer's forward compute in its experts (0 without): what an
    /// expert-parallel member's unequal load stretches.
    pub fn expert_compute_fraction(&self, b: usize) -> f64 {
        let Some(e) = self.experts else {
            return 0.0;
        };
        let (moe, _) = self.layer_kinds();
        let width = (e.ffn_hidden_size * e.top_k) as f64 * moe / self.num_layers.max(1) as f64;
        let tokens = (b * self.seq_length) as f64;
        2.0 * tokens * 3.0 * self.hidden_size as f64 * width / self.layer_forward_flops(b).max(1.0)
    }

    /// The MoE layers among layers `from..to`.
    pub fn moe_layers_in(&self, from: usize, to: usize) -> usize {
        self.experts.map_or(0, |e| {
            (from..to).filter(|l| l % e.layer_freq.max(1) == 0).count()
        })
    }

    /// Bytes one member's all-to-all sends per MoE layer and direction for `b` samples:
    /// each token's hidden state to each of its top-k experts.
    pub fn expert_message_bytes(&self, b: usize, bytes: f64) -> f64 {
        let k = self.experts.map_or(0, |e| e.top_k);
        (b * self.seq_length * k * self.hidden_size) as f64 * bytes
    }

    /// Parameters of one decoder layer (of a mean one: MoE layers' experts and routers
    /// spread over all layers).
    pub fn layer_params(&self) -> f64 {
        let (h, f) = (self.hidden_size as f64, self.mean_ffn().0);
        let (moe, _) = self.layer_kinds();
        let routers = self.experts.map_or(0.0, |e| e.num_experts as f64 * h * moe)
            / self.num_layers.max(1) as f64;
        2.0 * h * h + 2.0 * h * self.kv_width() + 3.0 * h * f + 2.0 * h + routers
    }

    /// Embedding (or head) parameters.
    pub fn embedding_params(&self) -> f64 {
        (self.vocab_size * self.hidden_size) as f64
    }

    /// Parameters of a stage of `layers` layers, with the embedding when `first` and the
    /// final norm and output layer (a tied one is a copy of the embedding) when `last`.
    pub fn stage_params(&self, layers: usize, first: bool, last: bool) -> f64 {
        let mut params = layers as f64 * self.layer_params();
        if first {
            params += self.embedding_params();
        }
        if last {
            params += self.embedding_params() + self.hidden_size as f64;
        }
        params
    }

    /// Forward FLOPs of one layer for a micro-batch of `b` samples (of a mean one: each
    /// token through its top-k experts in the MoE layers).
    pub fn layer_forward_flops(&self, b: usize) -> f64 {
        let (h, f, s) = (
            self.hidden_size as f64,
            self.mean_ffn().1,
            self.seq_length as f64,
        );
        let b = b as f64;
        2.0 * b * s * (2.0 * h * h + 2.0 * h * self.kv_width() + 3.0 * h * f) + 4.0 * b * s * s * h
    }

    /// Forward FLOPs of the head.
    pub fn head_forward_flops(&self, b: usize) -> f64 {
        2.0 * (b * self.seq_length * self.hidden_size * self.vocab_size) as f64
    }

    /// Activation bytes one layer keeps for its backward, per micro-batch of `b`, as
    /// synerfuse's layer keeps them in the compute dtype of `bytes` per element. Per
    /// token: each norm's input and output (on accelerators, `fused_kernels`: libtorch's
    /// fused RMSNorm; elsewhere also the fp32 copy transformers' formula makes), the
    /// rotated queries and keys, the q/k/v projection (the values are a view of it), the
    /// attention output and its reshaped copy, the gate/up projection and the SwiGLU
    /// product (SwiGLU's backward recomputes SiLU rather than keep it); plus the attention scores and probabilities unless the attention
    /// kernel is fused (flash or memory-efficient SDPA, on accelerators). Read off the
    /// layer's code; on an H100 it put a 1.1B model's peak within a few per cent of the
    /// measured one. An estimate when no profile measured it.
    pub fn layer_activation_bytes(&self, b: usize, bytes: f64, fused_kernels: bool) -> f64 {
        // An MoE layer keeps its top-k experts' activations of each token.
        let (h, f, s, a) = (
            self.hidden_size as f64,
            self.mean_ffn().1,
            self.seq_length as f64,
            self.num_heads as f64,
        );
        let kv = self.kv_width();
        let b = b as f64;
        let (norms, scores) = match fused_kernels {
            true => (4.0 * bytes * h, 0.0),
            false => (8.0 * h + 4.0 * bytes * h, bytes * 2.0 * a * s * s * b),
        };
        let attention = bytes * (4.0 * h + 3.0 * kv);
        let mlp = bytes * 3.0 * f;
        s * b * (norms + attention + mlp) + scores
    }

    /// Bytes of one activation message between stages.
    pub fn activation_message_bytes(&self, b: usize, bytes: f64) -> f64 {
        (b * self.seq_length * self.hidden_size) as f64 * bytes
    }

    /// Bytes of the whole sequence's keys and values of one layer for `b` samples at
    /// `bytes` per element: what a context-parallel group exchanges per layer.
    pub fn kv_message_bytes(&self, b: usize, bytes: f64) -> f64 {
        2.0 * (b * self.seq_length) as f64 * self.kv_width() * bytes
    }
}
