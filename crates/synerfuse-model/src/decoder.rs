//! One LLaMA decoder layer: attention (whole, a tensor-parallel shard's heads, or over a
//! context-parallel group's keys and values) and its MLP (dense, or experts), with the
//! key/value cache of generation. The stage (`llama`) runs a range of them.

use crate::config::LlamaConfig;
use crate::error::StageError;
use crate::joined::{adjacent, joined_linear, lay_end_to_end};
use crate::mlp::{Linear, SwiGlu};
use crate::moe::{route, route_across, ExpertExchange, ExpertGroup, HeldExperts, Routing, TopK};
use crate::norm::rms_norm;
use crate::shim::new_tensor;
use std::ffi::c_char;
use synerfuse_plan::TpShard;
use tch::{nn, Device, Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn synerfuse_rope(
        x: *const C_tensor,
        cos: *const C_tensor,
        sin: *const C_tensor,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
}

/// RoPE of queries or keys `x` `[b, heads, s, d]` by the tables `cos`, `sin`
/// `[b, 1, s, d]`: transformers' `x·cos + rotate_half(x)·sin`, as one autograd node
/// (`csrc/rope.cpp`) of two passes each way instead of five kernels over copies.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let what = || format!("RoPE of {x:?} by {cos:?}");
    // SAFETY: the pointers are live tensors borrowed for the call; the shim writes a new
    // tensor it allocated into `out` only when it returns no error, else a message.
    unsafe {
        new_tensor(what, |out| {
            synerfuse_rope(x.as_ptr(), cos.as_ptr(), sin.as_ptr(), out)
        })
    }
}

/// Keys and values of earlier positions, per layer, for generation.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .next()
            .map_or(0, |(k, _)| k.size()[2] as usize)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A layer's MLP: one SwiGLU, or Mixtral's experts behind a router.
enum Mlp {
    Dense(SwiGlu),
    Experts {
        /// `[experts, hidden]`, no bias.
        router: Linear,
        /// The experts this rank holds.
        experts: HeldExperts,
        top_k: TopK,
    },
}

impl Mlp {
    /// The MLP's output for normed input `h` `[..., hidden]`, and under experts how
    /// layer `layer` routed its tokens.
    fn forward(&self, h: &Tensor, layer: usize) -> (Tensor, Option<Routing>) {
        match self {
            Mlp::Dense(mlp) => (mlp.forward(h), None),
            Mlp::Experts {
                router,
                experts,
                top_k,
            } => {
                let (out, routing) = route(h, &router.weight, experts, *top_k, layer);
                (out, Some(routing))
            }
        }
    }

    /// [`Self::forward`] with the experts spread over an expert-parallel `group`: an
    /// MoE layer's tokens go to their experts' members and back (what the backward of
    /// the exchange needs is returned with it).
    fn forward_across(
        &self,
        h: &Tensor,
        layer: usize,
        group: &ExpertGroup<'_>,
    ) -> Result<(Tensor, Option<Routing>, Option<ExpertExchange>), StageError> {
        match self {
            Mlp::Dense(mlp) => Ok((mlp.forward(h), None, None)),
            Mlp::Experts {
                router,
                experts,
                top_k,
            } => {
                let (out, routing, exchange) =
                    route_across(h, &router.weight, experts, *top_k, layer, group)?;
                Ok((out, Some(routing), Some(exchange)))
            }
        }
    }
}

/// One decoder layer of a stage (its shard's part under tensor parallelism).
pub(crate) struct DecoderLayer {
    index: usize,
    input_norm: Tensor,
    post_attention_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp: Mlp,
}

impl DecoderLayer {
    /// The layer's part on `shard`: its query groups' heads, its FFN columns; the row-
    /// parallel output biases live on shard 0 only, so the sum over shards adds them once.
    pub(crate) fn new(
        path: &nn::Path,
        index: usize,
        c: &LlamaConfig,
        shard: &TpShard,
    ) -> DecoderLayer {
        let p = path / "model" / "layers" / index;
        let attn = &p / "self_attn";
        let std = c.init_std;
        // Megatron scales the init of the two output projections by 1/sqrt(2·layers).
        let out_std = std / (2.0 * c.num_layers as f64).sqrt();
        let groups = shard.query_groups.len();
        let (h, q, kv, ffn) = (
            c.hidden_size,
            groups * (c.num_heads / c.num_kv_heads) * c.head_dim,
            groups * c.head_dim,
            shard.ffn_columns.len(),
        );
        let expert_ffn = shard.expert_columns.len();
        let first = shard.rank == 0;
        DecoderLayer {
            index,
            input_norm: (&p / "input_layernorm").var("weight", &[h as i64], nn::Init::Const(1.0)),
            post_attention_norm: (&p / "post_attention_layernorm").var(
                "weight",
                &[h as i64],
                nn::Init::Const(1.0),
            ),
            q: Linear::new(&attn / "q_proj", h, q, c.attention_bias, std),
            k: Linear::new(&attn / "k_proj", h, kv, c.attention_bias, std),
            v: Linear::new(&attn / "v_proj", h, kv, c.attention_bias, std),
            o: Linear::new(&attn / "o_proj", q, h, c.attention_bias && first, out_std),
            mlp: match c.moe.filter(|m| m.has_experts(index)) {
                None => Mlp::Dense(SwiGlu::new(
                    &(&p / "mlp"),
                    ["gate_proj", "up_proj", "down_proj"],
                    (h, ffn),
                    (c.mlp_bias, c.mlp_bias && first),
                    (std, out_std),
                )),
                // Every tensor-parallel rank routes alike (the router is whole) and
                // computes its FFN columns of each expert.
                Some(moe) => {
                    let block = &p / "block_sparse_moe";
                    let router = Linear::new(&block / "gate", h, moe.num_experts, false, std);
                    let all: Vec<usize> = (0..moe.num_experts).collect();
                    let held = (shard.experts.as_deref().unwrap_or(&all).iter())
                        .map(|&e| {
                            let expert = SwiGlu::new(
                                &(&block / "experts" / e),
                                ["w1", "w3", "w2"],
                                (h, expert_ffn),
                                // Megatron's experts have biases unless
                                // --disable-bias-linear (the output's on shard 0).
                                (c.mlp_bias, c.mlp_bias && first),
                                (std, out_std),
                            );
                            (e, expert)
                        })
                        .collect();
                    Mlp::Experts {
                        router,
                        experts: HeldExperts::new(held),
                        top_k: TopK::of(&moe),
                    }
                }
            },
        }
    }

    /// The layer's output; an MoE layer's routing pushed onto `routings`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        c: &LlamaConfig,
        (cos, sin): (&Tensor, &Tensor),
        attention_mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
        routings: &mut Vec<Routing>,
    ) -> Tensor {
        let x = x + self.attention_out(x, c, cos, sin, attention_mask, cache);
        let (mlp, routing) = self.mlp_out(&x, c);
        routings.extend(routing);
        x + mlp
    }

    /// The attention block's output (before the residual): normed input, this shard's
    /// heads, its slice of the output projection (a partial sum under tensor parallelism).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_out(
        &self,
        x: &Tensor,
        c: &LlamaConfig,
        cos: &Tensor,
        sin: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Tensor {
        let h = self.block_norm(true, x, c);
        self.attention_core(&h, c, cos, sin, attention_mask, cache)
    }

    /// The norm that opens the attention block (`attention`) or the MLP block: per
    /// token, so sequence parallelism runs it on each rank's sequence rows.
    pub(crate) fn block_norm(&self, attention: bool, x: &Tensor, c: &LlamaConfig) -> Tensor {
        let weight = match attention {
            true => &self.input_norm,
            false => &self.post_attention_norm,
        };
        rms_norm(x, weight, c.rms_norm_eps)
    }

    /// The projections `parts` of `h` as one GEMM (their biases joined where present).
    fn joined_projection<const N: usize>(&self, h: &Tensor, parts: [&Linear; N]) -> Tensor {
        let weights = parts.map(|p| &p.weight);
        let biases: Option<Vec<&Tensor>> = parts.iter().map(|p| p.bias.as_ref()).collect();
        joined_linear(h, &weights, biases.as_deref())
    }

    /// Lays the q, k and v weights end to end in one buffer, and a dense MLP's gate and
    /// up weights in another (see [`crate::joined::lay_end_to_end`]).
    pub(crate) fn lay_weights_end_to_end(&mut self) {
        lay_end_to_end(&mut [&mut self.q.weight, &mut self.k.weight, &mut self.v.weight]);
        if let Mlp::Dense(mlp) = &mut self.mlp {
            mlp.lay_weights_end_to_end();
        }
    }

    /// Whether the weights that share a GEMM lie end to end.
    pub(crate) fn weights_end_to_end(&self) -> bool {
        let mlp = match &self.mlp {
            Mlp::Dense(mlp) => mlp.weights_end_to_end(),
            Mlp::Experts { .. } => true,
        };
        mlp && adjacent(&[&self.q.weight, &self.k.weight, &self.v.weight])
    }

    /// [`Self::attention_out`] after its norm: `h` is the normed input.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_core(
        &self,
        h: &Tensor,
        c: &LlamaConfig,
        cos: &Tensor,
        sin: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Tensor {
        let (b, s) = (h.size()[0], h.size()[1]);
        let hd = c.head_dim as i64;
        // One GEMM for q, k and v over their weights' buffer (see `crate::joined`).
        let (nq, nkv) = (self.q.weight.size()[0], self.k.weight.size()[0]);
        let (heads, kv_heads) = (nq / hd, nkv / hd);
        let qkv = self.joined_projection(h, [&self.q, &self.k, &self.v]);
        let parts = qkv.split_with_sizes([nq, nkv, nkv], -1);
        let q = parts[0].view([b, s, heads, hd]).transpose(1, 2);
        let k = parts[1].view([b, s, kv_heads, hd]).transpose(1, 2);
        let v = parts[2].view([b, s, kv_heads, hd]).transpose(1, 2);
        let q = rope(&q, cos, sin);
        let k = rope(&k, cos, sin);
        let (k, v, had_cache) = match cache {
            Some(cache) => self.extend_cache(cache, k, v),
            None => (k, v, false),
        };
        // True in the loader's mask means "masked"; libtorch's boolean mask means "attend".
        let allowed = match attention_mask {
            Some(m) => Some(m.logical_not()),
            // New queries after cached keys: query i (position start + i) sees keys
            // ..= start + i.
            None if had_cache && s > 1 => Some(cached_causal_mask(k.size()[2], s, h.device())),
            None => None,
        };
        let causal = allowed.is_none() && s > 1;
        let attn = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            allowed.as_ref(),
            0.0,
            causal,
            (c.head_dim as f64).powf(-0.5),
            c.num_kv_heads != c.num_heads,
        );
        let attn = attn.transpose(1, 2).reshape([b, s, nq]);
        self.o.forward(&attn)
    }

    /// Under context parallelism: this member's keys and values `[b, kv heads, s, d]`
    /// (its tokens, RoPE at their true positions) from the normed input `h`, in a graph
    /// apart from the queries' (they share only the leaf input), so that the backward of
    /// the attention and that of the gathered keys and values never share a node.
    pub(crate) fn keys_values(
        &self,
        h: &Tensor,
        c: &LlamaConfig,
        cos: &Tensor,
        sin: &Tensor,
    ) -> (Tensor, Tensor) {
        let (b, s) = (h.size()[0], h.size()[1]);
        let hd = c.head_dim as i64;
        let nkv = self.k.weight.size()[0];
        let kv = self.joined_projection(h, [&self.k, &self.v]);
        let parts = kv.split_with_sizes([nkv, nkv], -1);
        let k = parts[0].view([b, s, nkv / hd, hd]).transpose(1, 2);
        let v = parts[1].view([b, s, nkv / hd, hd]).transpose(1, 2);
        let k = rope(&k, cos, sin);
        (k, v)
    }

    /// The attention block's core for this member's queries (from the normed input `h`,
    /// its tokens at sequence indices `positions` `[s]`) over the keys and values of the
    /// whole sequence `k`, `v` `[b, kv heads, S, d]` in sequence order: causal by index,
    /// so a query attends to exactly the keys it would on one rank; with a document
    /// `mask` (`[b, 1, s, S]`, its queries' rows of the loader's, true where masked) as
    /// that mask says.
    pub(crate) fn attention_over(
        &self,
        h: &Tensor,
        c: &LlamaConfig,
        (cos, sin): (&Tensor, &Tensor),
        (k, v): (&Tensor, &Tensor),
        positions: &Tensor,
        mask: Option<&Tensor>,
    ) -> Tensor {
        let (b, s) = (h.size()[0], h.size()[1]);
        let hd = c.head_dim as i64;
        let nq = self.q.weight.size()[0];
        let q = self.q.forward(h).view([b, s, nq / hd, hd]).transpose(1, 2);
        let q = rope(&q, cos, sin);
        let allowed = match mask {
            Some(mask) => mask.logical_not(),
            None => {
                let keys = Tensor::arange(k.size()[2], (Kind::Int64, h.device()));
                keys.unsqueeze(0).le_tensor(&positions.unsqueeze(1))
            }
        };
        let attn = Tensor::scaled_dot_product_attention(
            &q,
            k,
            v,
            Some(&allowed),
            0.0,
            false,
            (c.head_dim as f64).powf(-0.5),
            c.num_kv_heads != c.num_heads,
        );
        self.o.forward(&attn.transpose(1, 2).reshape([b, s, nq]))
    }

    /// The MLP block's output (before the residual): normed input, SwiGLU over this
    /// shard's FFN columns, with the gate and up projections in one GEMM.
    /// An MoE layer's routing with it.
    pub(crate) fn mlp_out(&self, x: &Tensor, c: &LlamaConfig) -> (Tensor, Option<Routing>) {
        self.mlp_core(&self.block_norm(false, x, c))
    }

    /// [`Self::mlp_out`] after its norm: `h` is the normed input.
    pub(crate) fn mlp_core(&self, h: &Tensor) -> (Tensor, Option<Routing>) {
        self.mlp.forward(h, self.index)
    }

    /// [`Self::mlp_core`] with the experts spread over `group`.
    pub(crate) fn mlp_across(
        &self,
        h: &Tensor,
        group: &ExpertGroup<'_>,
    ) -> Result<(Tensor, Option<Routing>, Option<ExpertExchange>), StageError> {
        self.mlp.forward_across(h, self.index, group)
    }

    /// Appends this step's keys and values to the layer's cache; returns the keys and
    /// values to attend over and whether earlier ones were cached.
    fn extend_cache(&self, cache: &mut KvCache, k: Tensor, v: Tensor) -> (Tensor, Tensor, bool) {
        if cache.layers.len() <= self.index {
            cache.layers.resize_with(self.index + 1, || None);
        }
        let slot = &mut cache.layers[self.index];
        let (k, v, had) = match slot.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2), Tensor::cat(&[&pv, &v], 2), true),
            None => (k, v, false),
        };
        *slot = Some((k.shallow_clone(), v.shallow_clone()));
        (k, v, had)
    }
}

/// The boolean "attend" mask of `queries` new positions after `total - queries` cached
/// ones: query i sees keys up to its own position.
fn cached_causal_mask(total: i64, queries: i64, device: Device) -> Tensor {
    let start = total - queries;
    let keys = Tensor::arange(total, (Kind::Int64, device)).unsqueeze(0);
    let positions = Tensor::arange_start(start, total, (Kind::Int64, device)).unsqueeze(1);
    keys.le_tensor(&positions)
}

#[cfg(test)]
mod rope_tests {
    use super::rope;
    use tch::{Kind, Tensor};

    fn values(shape: &[i64], seed: f64) -> Tensor {
        crate::test_values::seeded(shape, seed, 2.0)
    }

    /// transformers' formula.
    fn formula(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let half = x.size()[3] / 2;
        let rotated = Tensor::cat(&[&x.narrow(3, half, half).neg(), &x.narrow(3, 0, half)], 3);
        x * cos + rotated * sin
    }

    /// The value and the input's gradient through `f`, the input a transposed view
    /// `[b, heads, s, d]` of `[b, s, heads, d]` as the attention makes it.
    fn run(f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor, kind: Kind) -> (Tensor, Tensor) {
        let leaf = values(&[2, 5, 3, 8], 1.0)
            .to_kind(kind)
            .set_requires_grad(true);
        let x = leaf.transpose(1, 2);
        // Tables whose halves differ (transformers' repeat theirs): the backward must
        // take each half's own.
        let cos = values(&[2, 1, 5, 8], 2.0).to_kind(kind);
        let sin = values(&[2, 1, 5, 8], 3.0).to_kind(kind);
        let y = f(&x, &cos, &sin);
        let upstream = values(&[2, 3, 5, 8], 4.0).to_kind(kind);
        (&y * upstream).sum(Kind::Float).backward();
        (
            y.detach().to_kind(Kind::Float),
            leaf.grad().to_kind(Kind::Float),
        )
    }

    /// fp32 to rounding; bf16 within an ulp or two of the values' scale (the formula
    /// rounds each product to bf16, `addcmul` adds in fp32 and rounds once).
    #[test]
    fn rope_is_transformers_formula_in_value_and_gradient() {
        for (kind, tolerance) in [(Kind::Float, 1e-6), (Kind::BFloat16, 1e-2)] {
            let (want, want_grad) = run(formula, kind);
            let (got, grad) = run(rope, kind);
            for (what, a, b) in [("value", &got, &want), ("gradient", &grad, &want_grad)] {
                let off = (a - b).abs().max().double_value(&[]);
                let scale = b.abs().max().double_value(&[]);
                assert!(
                    off < tolerance * scale,
                    "{kind:?}: {what} off by {off} of {scale}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "an even head dimension")]
    fn rope_of_an_odd_head_dimension_is_refused() {
        let x = values(&[1, 1, 2, 3], 1.0);
        let _ = rope(&x, &values(&[1, 1, 2, 3], 2.0), &values(&[1, 1, 2, 3], 3.0));
    }
}
