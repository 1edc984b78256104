//! Mixture-of-experts routing and its load balance: dropless top-k routing (Mixtral's),
//! the load-balancing loss Megatron trains with, and transformers' for parity.
//!
//! The training loss of a layer is Megatron's Switch loss `E / (T² k) · Σ_e P_e · n_e`
//! (`P_e` the router probabilities of expert `e` summed over the `T` tokens it is taken
//! over, `n_e` the tokens that picked `e`). A micro-batch contributes it summed over its
//! sequences (the micro-batch's value times its sequences under `aux_loss`, each
//! sequence's own under `seq_aux_loss`), and the backward weighs that by the sequence's
//! weight in the step (1 / the step's sequences): with equal micro-batches that is
//! Megatron's 1 / micro-batches, and under `seq_aux_loss` any split of the batch over
//! replicas and micro-batches gives the same gradient.

use crate::config::LoadBalancing;
use crate::cp::ContextGroup;
use crate::llama::SwiGlu;
use crate::StageError;
use tch::{Kind, Tensor};

/// How one MoE layer routed a forward's tokens.
pub(crate) struct Routing {
    /// Global index of the layer.
    pub(crate) layer: usize,
    /// Router logits `[tokens, experts]`.
    pub(crate) logits: Tensor,
    /// Softmax over all experts in fp32 `[tokens, experts]` (graph to the router).
    pub(crate) probs: Tensor,
    /// The `top_k` experts each token picked `[tokens, top_k]`.
    pub(crate) chosen: Tensor,
}

/// Dropless top-k routing (transformers' `MixtralSparseMoeBlock`): softmax over the
/// router's logits in fp32, the `top_k` best renormalised to sum to 1, each token's
/// output the weighted sum of its experts' outputs. Every token reaches its experts,
/// so the result does not depend on which tokens share a batch.
pub(crate) fn route(
    h: &Tensor,
    router: &Tensor,
    experts: &[SwiGlu],
    top_k: i64,
    layer: usize,
) -> (Tensor, Routing) {
    let shape = h.size();
    let x = h.reshape([-1, shape[shape.len() - 1]]);
    let logits = x.linear::<Tensor>(router, None);
    let probs = logits.softmax(-1, Kind::Float);
    let (top, chosen) = probs.topk(top_k, -1, true, true);
    let weights = &top / top.sum_dim_intlist(-1, true, Kind::Float);
    let mut out = x.zeros_like();
    for (e, expert) in experts.iter().enumerate() {
        // (token, slot) of every choice of this expert. An expert no token chose runs on
        // none, so that its gradient is zero rather than undefined (every rank and step
        // then has the same gradients to reduce).
        let hits = chosen.eq(e as i64).nonzero();
        let (tokens, slots) = (hits.select(1, 0), hits.select(1, 1));
        let y = expert.forward(&x.index_select(0, &tokens));
        let w = weights.index(&[Some(&tokens), Some(&slots)]).unsqueeze(-1);
        out = out.index_add(0, &tokens, &(y * w).to_kind(x.kind()));
    }
    let routing = Routing {
        layer,
        logits,
        probs,
        chosen,
    };
    (out.reshape(shape.as_slice()), routing)
}

/// One MoE layer's load balance over a micro-batch on one rank: what its
/// load-balancing loss adds to the step and what the log reports.
pub struct LayerBalance {
    /// Global index of the layer.
    pub layer: usize,
    /// The layer's load-balancing loss without its coefficient, summed over the
    /// micro-batch's sequences (a scalar; under context parallelism this member's part
    /// of it, the group's parts summing to the whole). Carries the graph to the router
    /// in a training forward's regions, not in [`crate::ForwardPass::load_balance`].
    pub loss: Tensor,
    /// How many of this rank's tokens picked each expert `[experts]` (fp32).
    pub tokens_per_expert: Tensor,
}

impl LayerBalance {
    /// Its values without the graph (what a forward keeps for the log).
    pub(crate) fn detached(self) -> LayerBalance {
        LayerBalance {
            loss: self.loss.detach(),
            ..self
        }
    }
}

impl Routing {
    /// The layer's load balance over a micro-batch of `sequences` sequences, of
    /// `kind`; `context`: the context-parallel group whose members hold the other
    /// tokens of the same sequences (their picks are summed over it; the probabilities
    /// stay local, each member's loss being its part of the whole).
    pub(crate) fn balance(
        &self,
        sequences: i64,
        kind: LoadBalancing,
        top_k: usize,
        context: Option<&ContextGroup<'_>>,
    ) -> Result<LayerBalance, StageError> {
        let experts = self.probs.size()[1];
        let picks = tch::no_grad(|| {
            self.chosen
                .one_hot(experts)
                .to_kind(Kind::Float)
                .reshape([sequences, -1, experts])
                .sum_dim_intlist(1, false, Kind::Float)
        });
        let tokens_per_expert = picks.sum_dim_intlist(0, false, Kind::Float);
        if kind == LoadBalancing::None {
            let loss = Tensor::zeros([], (Kind::Float, self.probs.device()));
            return Ok(LayerBalance {
                layer: self.layer,
                loss,
                tokens_per_expert,
            });
        }
        let (picks, tokens) = match context {
            Some(cp) if cp.collectives.size() > 1 => {
                let whole = (cp.collectives.all_reduce_sum(&picks)).map_err(|source| {
                    StageError::Collective {
                        op: "all-reduce (tokens per expert)",
                        source,
                    }
                })?;
                (
                    whole,
                    cp.positions.iter().map(Vec::len).sum::<usize>() as f64,
                )
            }
            _ => (picks, (self.probs.size()[0] / sequences.max(1)) as f64),
        };
        let probs = self
            .probs
            .reshape([sequences, -1, experts])
            .sum_dim_intlist(1, false, Kind::Float);
        let scale = experts as f64 / (top_k as f64);
        let loss = match kind {
            LoadBalancing::AuxLoss => {
                let t = tokens * sequences as f64;
                let summed = |x: &Tensor| x.sum_dim_intlist(0, false, Kind::Float);
                (summed(&probs) * summed(&picks)).sum(Kind::Float)
                    * (scale / (t * t))
                    * sequences as f64
            }
            _ => (probs * picks).sum(Kind::Float) * (scale / (tokens * tokens)),
        };
        Ok(LayerBalance {
            layer: self.layer,
            loss,
            tokens_per_expert,
        })
    }
}

/// transformers' `load_balancing_loss_func` (Switch Transformer's auxiliary loss) over
/// the router logits of every MoE layer of a forward: with `f_e` the fraction of the
/// top-k choices and `P_e` the mean router probability of expert `e` over all layers'
/// tokens, `experts · Σ_e f_e · P_e` (`f` counts choices, so it sums to `top_k`).
pub fn load_balancing_loss(router_logits: &[Tensor], num_experts: usize, top_k: usize) -> Tensor {
    let all = Tensor::cat(router_logits, 0).to_kind(Kind::Float);
    let rows = all.size()[0] as f64;
    let probs = all.softmax(-1, Kind::Float);
    let (_, chosen) = probs.topk(top_k as i64, -1, true, true);
    let counts = chosen
        .reshape([-1])
        .one_hot(num_experts as i64)
        .to_kind(Kind::Float)
        .sum_dim_intlist(0, false, Kind::Float);
    let mean_probs = probs.sum_dim_intlist(0, false, Kind::Float) / rows;
    (counts / rows * mean_probs).sum(Kind::Float) * num_experts as f64
}

#[cfg(test)]
mod tests {
    use crate::config::{LoadBalancing, MoeConfig};
    use crate::{BackwardFrom, LlamaConfig, Stage};
    use tch::{Device, Kind, Tensor};

    /// Megatron's `switch_load_balancing_loss_func` over one layer's router logits
    /// `[tokens, experts]`, transcribed.
    fn megatron_switch_loss(logits: &Tensor, top_k: i64) -> Tensor {
        let probs = logits.softmax(-1, Kind::Float);
        let (tokens, experts) = (probs.size()[0], probs.size()[1]);
        let (_, chosen) = probs.topk(top_k, -1, true, true);
        let per_expert = chosen
            .reshape([-1])
            .one_hot(experts)
            .to_kind(Kind::Float)
            .sum_dim_intlist(0, false, Kind::Float);
        let aggregated = probs.sum_dim_intlist(0, false, Kind::Float);
        (aggregated * per_expert).sum(Kind::Float) * experts as f64
            / (tokens * tokens * top_k) as f64
    }

    fn stage(balancing: LoadBalancing, coeff: f64) -> Stage {
        let c = LlamaConfig {
            vocab_size: 40,
            hidden_size: 16,
            intermediate_size: 24,
            num_layers: 3,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 4,
            max_position_embeddings: 16,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            init_std: 0.2,
            moe: Some(MoeConfig {
                layer_freq: 2,
                aux_loss_coeff: coeff,
                load_balancing: balancing,
                ..MoeConfig::every_layer(4, 2, 12)
            }),
        };
        let mut stage = Stage::new(&c, 0..3, Device::Cpu).unwrap();
        stage.init_by_name(11);
        stage
    }

    fn router_grads(stage: &Stage) -> Vec<Tensor> {
        let mut vars = stage.var_store().variables();
        let mut names: Vec<String> = vars
            .keys()
            .filter(|n| n.contains(".gate."))
            .cloned()
            .collect();
        names.sort();
        let grads = names
            .iter()
            .map(|n| vars.remove(n).unwrap().grad().copy())
            .collect();
        stage.var_store().variables().values().for_each(|v| {
            let _ = v.grad().zero_();
        });
        grads
    }

    fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
        (a.iter().zip(b))
            .map(|(a, b)| (a - b).abs().max().double_value(&[]))
            .fold(0.0, f64::max)
    }

    /// The backward adds the coefficient times Megatron's loss of each MoE layer, over
    /// the micro-batch (`aux_loss`) or each sequence (`seq_aux_loss`), weighted per
    /// sequence; without a coefficient the router's gradient is the language model's.
    #[test]
    fn the_backward_adds_megatrons_load_balancing_loss() {
        tch::manual_seed(2);
        let (b, s) = (3, 5);
        let tokens = Tensor::randint(40, [b, s], (Kind::Int64, Device::Cpu));
        let labels = Tensor::randint(40, [b, s], (Kind::Int64, Device::Cpu));
        let lm = |logits: &Tensor| Stage::loss(logits, &labels, None).0 * 0.1;
        let (coeff, weight) = (0.7, 0.125);
        let mut seen = Vec::new();
        for balancing in [LoadBalancing::AuxLoss, LoadBalancing::SeqAuxLoss] {
            let stage = stage(balancing, coeff);
            let (logits, routers) = stage
                .forward_with_router_logits(&tokens, None, None)
                .unwrap();
            assert_eq!(routers.len(), 2, "layers 0 and 2 have experts");
            let per_sequence = |r: &Tensor| -> Tensor {
                match balancing {
                    LoadBalancing::AuxLoss => megatron_switch_loss(r, 2) * b as f64,
                    _ => (r.chunk(b, 0).iter())
                        .map(|seq| megatron_switch_loss(seq, 2))
                        .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, l| a + l),
                }
            };
            let balance: Tensor = (routers.iter().map(per_sequence))
                .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, l| a + l);
            (lm(&logits) + &balance * (coeff * weight)).backward();
            let expected = router_grads(&stage);
            let mut pass = stage.forward_train(&tokens, None, None).unwrap();
            let logged: f64 = (pass.load_balance().iter())
                .map(|l| l.loss.double_value(&[]))
                .sum();
            assert!((logged - balance.double_value(&[])).abs() < 1e-6);
            pass.set_sequence_weight(weight);
            stage.backward(pass, BackwardFrom::Loss(&lm)).unwrap();
            let got = router_grads(&stage);
            let d = max_diff(&got, &expected);
            assert!(d < 1e-6, "{balancing:?}: {d}");
            seen.push(got);
        }
        let without = stage(LoadBalancing::AuxLoss, 0.0);
        let pass = without.forward_train(&tokens, None, None).unwrap();
        without.backward(pass, BackwardFrom::Loss(&lm)).unwrap();
        let lm_only = router_grads(&without);
        assert!(max_diff(&seen[0], &lm_only) > 1e-4, "the loss must count");
        assert!(max_diff(&seen[0], &seen[1]) > 1e-5, "the two kinds differ");
    }
}
