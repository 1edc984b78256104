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

use crate::collectives::{collective, TpCollectives};
use crate::config::{LoadBalancing, MoeConfig};
use crate::cp::ContextGroup;
use crate::error::StageError;
use crate::mlp::SwiGlu;
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

/// How a router picks each token's experts from its softmax over all of them, and
/// weighs their outputs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TopK {
    /// Experts per token.
    k: i64,
    /// Whether the `k` weights are renormalised to sum to 1 (Mixtral's routing, and
    /// Megatron's without `--moe-router-pre-softmax`); otherwise each is the expert's
    /// probability over all experts (in fp32, as transformers; Megatron rounds it to the
    /// logits' type first, which differs under bf16 only)
    renormalised: bool,
}

impl TopK {
    /// The routing of layer `layer`'s rows `x` `[tokens, hidden]` by `router`: its
    /// logits, their softmax in fp32 and each token's experts, with their weights.
    fn route(&self, x: &Tensor, router: &Tensor, layer: usize) -> (Routing, Tensor) {
        let logits = x.linear::<Tensor>(router, None);
        let probs = logits.softmax(-1, Kind::Float);
        let (weights, chosen) = self.pick(&probs);
        let routing = Routing {
            layer,
            logits,
            probs,
            chosen,
        };
        (routing, weights)
    }

    pub(crate) fn of(moe: &MoeConfig) -> Self {
        TopK {
            k: moe.top_k as i64,
            renormalised: !moe.router_pre_softmax,
        }
    }

    /// Each token's `k` best experts by `probs` `[tokens, experts]`, and their weights
    /// (both `[tokens, k]`).
    fn pick(&self, probs: &Tensor) -> (Tensor, Tensor) {
        let (top, chosen) = probs.topk(self.k, -1, true, true);
        match self.renormalised {
            true => (&top / top.sum_dim_intlist(-1, true, Kind::Float), chosen),
            false => (top, chosen),
        }
    }
}

/// Dropless top-k routing (transformers' `MixtralSparseMoeBlock`): softmax over the
/// router's logits in fp32, the `top_k` best (renormalised to sum to 1 unless routed
/// pre-softmax), each token's output the weighted sum of its experts' outputs. Every
/// token reaches its experts, so the result does not depend on which tokens share a
/// batch.
pub(crate) fn route(
    h: &Tensor,
    router: &Tensor,
    experts: &HeldExperts,
    top_k: TopK,
    layer: usize,
) -> (Tensor, Routing) {
    let shape = h.size();
    let x = h.reshape([-1, shape[shape.len() - 1]]);
    let (routing, weights) = top_k.route(&x, router, layer);
    // Every (token, slot) choice, grouped by expert (token order within each).
    let picks = routing.chosen.reshape([-1]);
    let (_, order) = picks.sort_stable(true, 0, false);
    // `order` holds flat (token, slot) indices: the token is the index over top_k.
    let tokens = order.divide_scalar_mode(top_k.k, "floor");
    let y = experts.run(&x.index_select(0, &tokens), &picks, router.size()[0]);
    let w = weights.reshape([-1]).index_select(0, &order).unsqueeze(-1);
    let out = x
        .zeros_like()
        .index_add(0, &tokens, &(y * w).to_kind(x.kind()));
    (out.reshape(shape.as_slice()), routing)
}

/// The experts a rank holds of one MoE layer (all without expert parallelism).
pub(crate) struct HeldExperts {
    /// By index, ascending.
    experts: Vec<(usize, SwiGlu)>,
}

impl HeldExperts {
    pub(crate) fn new(mut experts: Vec<(usize, SwiGlu)>) -> Self {
        experts.sort_by_key(|(e, _)| *e);
        HeldExperts { experts }
    }

    /// The experts' indices, ascending.
    pub(crate) fn indices(&self) -> Vec<usize> {
        self.experts.iter().map(|(e, _)| *e).collect()
    }

    /// Rows `sorted` (grouped by their experts `ids`, ascending, all held here) through
    /// those experts, the outputs in the same order: the counts read once, each expert
    /// on its contiguous part (not a search of every row per expert). Every expert runs, on no rows where none chose it, so that
    /// its gradient is zero rather than undefined (every rank and step then has the same
    /// gradients to reduce).
    pub(crate) fn run(&self, sorted: &Tensor, ids: &Tensor, num_experts: i64) -> Tensor {
        let counts: Vec<i64> =
            Vec::try_from(ids.bincount::<Tensor>(None, num_experts)).unwrap_or_default();
        let parts = sorted.split_with_sizes(&counts, 0);
        let outputs: Vec<Tensor> = (self.experts.iter())
            .map(|(e, expert)| expert.forward_unjoined(&parts[*e]))
            .collect();
        match outputs.is_empty() {
            true => sorted.zeros_like(),
            false => Tensor::cat(&outputs, 0),
        }
    }
}

/// A stage's expert-parallel group: members that each hold some experts of every MoE
/// layer of the stage and route their own tokens to all of them. Every member runs the
/// same passes in the same order (each MoE layer's exchange is collective).
pub struct ExpertGroup<'a> {
    /// The group's collectives (member order).
    pub collectives: &'a dyn TpCollectives,
    /// The experts each member holds, in member order.
    pub placement: Vec<Vec<usize>>,
    /// The dtype tokens and their gradients travel in where the members compute in
    /// different precisions (fp32: every member's values exactly; each converts what it
    /// receives to its own); `None` where they all compute in one.
    pub exchange_kind: Option<Kind>,
}

impl ExpertGroup<'_> {
    /// The member holding each expert, checked against `held` (this member's, ascending).
    fn owners(&self, num_experts: usize, held: &[usize]) -> Result<Vec<i64>, StageError> {
        let bad = || StageError::BadPlacement {
            placement: self.placement.clone(),
            num_experts,
            held: held.to_vec(),
        };
        if self.placement.iter().any(Vec::is_empty) {
            return Err(bad());
        }
        let mut owner = vec![-1i64; num_experts];
        for (member, experts) in self.placement.iter().enumerate() {
            for &e in experts {
                match owner.get_mut(e) {
                    Some(o) if *o < 0 => *o = member as i64,
                    _ => return Err(bad()),
                }
            }
        }
        // `held` ascending; a placement may list a member's experts in any order.
        let mut mine = self.placement.get(self.collectives.rank()).cloned();
        if let Some(m) = &mut mine {
            m.sort_unstable();
        }
        if owner.contains(&-1) || mine.as_deref() != Some(held) {
            return Err(bad());
        }
        Ok(owner)
    }

    /// `parts[m]` to member `m`; floating-point parts travel in the group's
    /// `exchange_kind` where it has one and come back in this member's dtype.
    fn all_to_all(&self, parts: &[Tensor], what: &'static str) -> Result<Vec<Tensor>, StageError> {
        let local = parts.first().map(Tensor::kind);
        let floating = [Kind::Float, Kind::Half, Kind::BFloat16, Kind::Double];
        match (self.exchange_kind, local) {
            (Some(wire), Some(kind)) if kind != wire && floating.contains(&kind) => {
                let sent: Vec<Tensor> = parts.iter().map(|p| p.to_kind(wire)).collect();
                let received = collective(what, self.collectives.all_to_all(&sent))?;
                Ok(received.into_iter().map(|t| t.to_kind(kind)).collect())
            }
            _ => collective(what, self.collectives.all_to_all(parts)),
        }
    }
}

/// One MoE layer's token exchange in a forward, kept for its backward: the graph is cut
/// at each all-to-all, as tensor parallelism cuts at its collectives.
pub(crate) struct ExpertExchange {
    /// The MoE block's normed input (graph to the block's input), and the leaf the
    /// routing and the rows sent start from.
    input: (Tensor, Tensor),
    /// The rows sent, grouped by member (graph to the input leaf).
    sent: Tensor,
    /// Rows sent to each member, and received from each.
    counts: (Vec<i64>, Vec<i64>),
    /// The rows received (a leaf), and the local experts' outputs for them.
    received: Tensor,
    computed: Tensor,
    /// The outputs the experts' members returned (a leaf the combine's backward fills).
    returned: Tensor,
}

impl ExpertExchange {
    /// The exchange's backward, after the combine's has filled the returned outputs'
    /// gradient: that gradient to the experts' members, their backward, the received
    /// rows' gradient back to the tokens' members, through the rows sent, and with the
    /// router's part on into the block input's gradient. Collective over the group.
    pub(crate) fn backward(self, group: &ExpertGroup<'_>) -> Result<(), StageError> {
        let grad = |t: &Tensor| match t.grad().defined() {
            true => t.grad(),
            false => t.zeros_like(),
        };
        let (sent_counts, received_counts) = &self.counts;
        let to_experts = grad(&self.returned).split_with_sizes(sent_counts, 0);
        let computed_grad = Tensor::cat(
            &group.all_to_all(&to_experts, "all-to-all (expert gradients)")?,
            0,
        );
        (&self.computed * computed_grad.to_kind(self.computed.kind()))
            .sum(Kind::Float)
            .backward();
        let to_tokens = grad(&self.received).split_with_sizes(received_counts, 0);
        let sent_grad = Tensor::cat(
            &group.all_to_all(&to_tokens, "all-to-all (token gradients)")?,
            0,
        );
        (&self.sent * sent_grad.to_kind(self.sent.kind()))
            .sum(Kind::Float)
            .backward();
        // The router's and the rows' gradients of the input leaf, through the norm.
        let (input, leaf) = &self.input;
        (input * grad(leaf).to_kind(input.kind()))
            .sum(Kind::Float)
            .backward();
        Ok(())
    }
}

/// [`route`] over an expert-parallel `group`: each token's top-k rows go to the members
/// holding their experts (one all-to-all), each member runs its `experts` on what it
/// received, the outputs come back (another), and each token's output is the weighted
/// sum of its experts', as on one rank.
pub(crate) fn route_across(
    h: &Tensor,
    router: &Tensor,
    experts: &HeldExperts,
    top_k: TopK,
    layer: usize,
    group: &ExpertGroup<'_>,
) -> Result<(Tensor, Routing, ExpertExchange), StageError> {
    let held: Vec<usize> = experts.indices();
    let owners = group.owners(router.size()[0] as usize, &held)?;
    // The backward runs in pieces (cut at the all-to-alls) that meet at this leaf.
    let input = h.shallow_clone();
    let h = &h.detach().set_requires_grad(true);
    let shape = h.size();
    let hidden = shape[shape.len() - 1];
    let x = h.reshape([-1, hidden]);
    let (routing, weights) = top_k.route(&x, router, layer);
    // Every (token, slot) choice, grouped by the member holding its expert.
    let device = h.device();
    let picks = routing.chosen.reshape([-1]);
    let members = Tensor::from_slice(&owners)
        .to_device(device)
        .index_select(0, &picks);
    let (_, order) = members.sort_stable(true, 0, false);
    let tokens = order.divide_scalar_mode(top_k.k, "floor");
    let sent_counts: Vec<i64> =
        Vec::try_from(members.bincount::<Tensor>(None, group.placement.len() as i64))
            .unwrap_or_default();
    // A graph of its own from the block input, apart from the router's.
    let sent = h.reshape([-1, hidden]).index_select(0, &tokens);
    let rows = group.all_to_all(
        &sent.detach().split_with_sizes(&sent_counts, 0),
        "all-to-all (tokens to experts)",
    )?;
    let ids = group.all_to_all(
        &picks
            .index_select(0, &order)
            .split_with_sizes(&sent_counts, 0),
        "all-to-all (expert of each token)",
    )?;
    let received_counts: Vec<i64> = rows.iter().map(|r| r.size()[0]).collect();
    let received = Tensor::cat(&rows, 0).set_requires_grad(true);
    let ids = Tensor::cat(&ids, 0);
    // The rows received grouped by expert, run, and back in the order received.
    let (_, by_expert) = ids.sort_stable(true, 0, false);
    let computed = experts
        .run(
            &received.index_select(0, &by_expert),
            &ids,
            router.size()[0],
        )
        .index_select(0, &by_expert.argsort(0, false));
    let back = group.all_to_all(
        &computed.detach().split_with_sizes(&received_counts, 0),
        "all-to-all (expert outputs back)",
    )?;
    let returned = Tensor::cat(&back, 0).set_requires_grad(true);
    let w = weights.reshape([-1]).index_select(0, &order).unsqueeze(-1);
    let out = x
        .zeros_like()
        .index_add(0, &tokens, &(&returned * w).to_kind(x.kind()));
    let exchange = ExpertExchange {
        input: (input, h.shallow_clone()),
        sent,
        counts: (sent_counts, received_counts),
        received,
        computed,
        returned,
    };
    Ok((out.reshape(shape.as_slice()), routing, exchange))
}

/// One MoE layer's load balance over a micro-batch on one rank: what its
/// load-balancing loss and z-loss add to the step and what the log reports.
pub struct LayerBalance {
    /// Global index of the layer.
    pub layer: usize,
    /// The layer's load-balancing loss without its coefficient, summed over the
    /// micro-batch's sequences (a scalar; under context parallelism this member's part
    /// of it, the group's parts summing to the whole). Carries the graph to the router
    /// in a training forward's regions, not in [`crate::ForwardPass::load_balance`].
    pub loss: Tensor,
    /// The layer's router z-loss without its coefficient (each sequence's mean over its
    /// tokens of `logsumexp(logits)²`), summed over the micro-batch's sequences (under
    /// context parallelism this member's part); with the graph as `loss`.
    pub z_loss: Tensor,
    /// How many of this rank's tokens picked each expert `[experts]` (fp32).
    pub tokens_per_expert: Tensor,
}

impl LayerBalance {
    /// Its values without the graph (what a forward keeps for the log).
    pub(crate) fn detached(self) -> LayerBalance {
        LayerBalance {
            loss: self.loss.detach(),
            z_loss: self.z_loss.detach(),
            ..self
        }
    }

    /// What the layer adds to the training objective per sequence weight: each loss
    /// times its coefficient (the load-balancing loss's none under `none`).
    pub(crate) fn objective(&self, moe: &MoeConfig) -> Tensor {
        &self.loss * moe.balance_coeff() + &self.z_loss * moe.z_loss_coeff
    }
}

impl Routing {
    /// The layer's load balance over a micro-batch of `sequences` sequences of an MoE
    /// model `moe`; `context`: the context-parallel group whose members hold the other
    /// tokens of the same sequences (their picks are summed over it; the probabilities
    /// and logits stay local, each member's losses being its part of the whole).
    pub(crate) fn balance(
        &self,
        sequences: i64,
        moe: &MoeConfig,
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
        let context = context.filter(|cp| cp.collectives.size() > 1);
        // Tokens per whole sequence (over the context-parallel group's members).
        let tokens = match context {
            Some(cp) => cp.positions.iter().map(Vec::len).sum::<usize>() as f64,
            None => (self.probs.size()[0] / sequences.max(1)) as f64,
        };
        let untrained = || Tensor::zeros([], (Kind::Float, self.probs.device()));
        // Megatron's z_loss_func, each sequence's mean: its part summed over its tokens.
        let z_loss = match moe.trains_z_loss() {
            true => {
                let lse = self.logits.to_kind(Kind::Float).logsumexp([-1], false);
                lse.square().sum(Kind::Float) / tokens
            }
            false => untrained(),
        };
        let loss = match moe.balances_load() {
            true => self.balance_loss(picks, sequences, tokens, moe, context)?,
            false => untrained(),
        };
        Ok(LayerBalance {
            layer: self.layer,
            loss,
            z_loss,
            tokens_per_expert,
        })
    }

    /// The load-balancing loss summed over the micro-batch's sequences, from each
    /// sequence's `picks` per expert `[sequences, experts]` over `tokens` tokens (whose
    /// other members' picks a context-parallel group adds).
    fn balance_loss(
        &self,
        picks: Tensor,
        sequences: i64,
        tokens: f64,
        moe: &MoeConfig,
        context: Option<&ContextGroup<'_>>,
    ) -> Result<Tensor, StageError> {
        let experts = self.probs.size()[1];
        let picks = match context {
            Some(cp) => collective(
                "all-reduce (tokens per expert)",
                cp.collectives.all_reduce_sum(&picks),
            )?,
            None => picks,
        };
        let probs = self
            .probs
            .reshape([sequences, -1, experts])
            .sum_dim_intlist(1, false, Kind::Float);
        let scale = experts as f64 / (moe.top_k as f64);
        Ok(match moe.load_balancing {
            LoadBalancing::AuxLoss => {
                let t = tokens * sequences as f64;
                let summed = |x: &Tensor| x.sum_dim_intlist(0, false, Kind::Float);
                (summed(&probs) * summed(&picks)).sum(Kind::Float)
                    * (scale / (t * t))
                    * sequences as f64
            }
            _ => (probs * picks).sum(Kind::Float) * (scale / (tokens * tokens)),
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
        z_loss_stage(balancing, coeff, 0.0)
    }

    fn z_loss_stage(balancing: LoadBalancing, coeff: f64, z_loss_coeff: f64) -> Stage {
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
                z_loss_coeff,
                ..MoeConfig::every_layer(4, 2, 12)
            }),
        };
        let mut stage = Stage::new(&c, 0..3, Device::Cpu).unwrap();
        stage.init_by_name(11);
        stage
    }

    /// A batch of 3 sequences of 5 random tokens and labels (of [`stage`]'s vocabulary),
    /// drawn after seeding with `seed`.
    fn batch(seed: i64) -> (i64, Tensor, Tensor) {
        tch::manual_seed(seed);
        let b = 3;
        let tokens = Tensor::randint(40, [b, 5], (Kind::Int64, Device::Cpu));
        let labels = Tensor::randint(40, [b, 5], (Kind::Int64, Device::Cpu));
        (b, tokens, labels)
    }

    /// The sum of scalar `losses` (0 for none).
    fn sum(losses: impl Iterator<Item = Tensor>) -> Tensor {
        losses.fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, l| a + l)
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
        let (b, tokens, labels) = batch(2);
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
                    _ => sum((r.chunk(b, 0).iter()).map(|seq| megatron_switch_loss(seq, 2))),
                }
            };
            let balance = sum(routers.iter().map(per_sequence));
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

    /// Megatron's `topk_softmax_with_capacity` without a capacity, transcribed: each
    /// token's weights and experts, pre-softmax (the top k of the softmax over all
    /// experts) or not (the softmax over the top k logits, which is Mixtral's
    /// renormalised top k).
    fn megatron_top_k(logits: &Tensor, k: i64, pre_softmax: bool) -> (Tensor, Tensor) {
        match pre_softmax {
            true => logits.softmax(-1, Kind::Float).topk(k, 1, true, true),
            false => {
                let (scores, chosen) = logits.topk(k, 1, true, true);
                (scores.softmax(-1, Kind::Float), chosen)
            }
        }
    }

    #[test]
    fn top_k_weights_are_megatrons_with_and_without_pre_softmax() {
        tch::manual_seed(4);
        let logits = Tensor::randn([6, 8], (Kind::Float, Device::Cpu));
        for (k, pre_softmax) in [(1, true), (2, true), (2, false), (3, false)] {
            let moe = MoeConfig {
                router_pre_softmax: pre_softmax,
                ..MoeConfig::every_layer(8, k as usize, 4)
            };
            let (weights, chosen) = super::TopK::of(&moe).pick(&logits.softmax(-1, Kind::Float));
            let (want_weights, want_chosen) = megatron_top_k(&logits, k, pre_softmax);
            assert!(
                chosen.equal(&want_chosen),
                "k {k}, pre-softmax {pre_softmax}"
            );
            let d = (weights - want_weights).abs().max().double_value(&[]);
            assert!(d < 1e-6, "k {k}, pre-softmax {pre_softmax}: {d}");
        }
    }

    /// Megatron's `z_loss_func` over one micro-batch's router logits `[tokens,
    /// experts]`, transcribed (without the coefficient).
    fn megatron_z_loss(logits: &Tensor) -> Tensor {
        logits.logsumexp([-1], false).square().mean(Kind::Float)
    }

    /// The backward adds the z-loss's coefficient times Megatron's z-loss of each MoE
    /// layer over the micro-batch, times its sequences and each sequence's weight (with
    /// equal sequences, a mean over the step's tokens), beside the load-balancing loss
    /// (or alone under `none`); the log reports it without the coefficient.
    #[test]
    fn the_backward_adds_megatrons_router_z_loss() {
        let (b, tokens, labels) = batch(3);
        let lm = |logits: &Tensor| Stage::loss(logits, &labels, None).0 * 0.1;
        let (coeff, z_coeff, weight) = (0.7, 0.05, 0.125);
        let mut seen = Vec::new();
        for balancing in [LoadBalancing::AuxLoss, LoadBalancing::None] {
            let stage = z_loss_stage(balancing, coeff, z_coeff);
            let (logits, routers) = stage
                .forward_with_router_logits(&tokens, None, None)
                .unwrap();
            let z = sum(routers.iter().map(|r| megatron_z_loss(r) * b as f64));
            let balance = match balancing {
                LoadBalancing::None => sum(std::iter::empty()),
                _ => sum(routers
                    .iter()
                    .map(|r| megatron_switch_loss(r, 2) * b as f64)),
            };
            (lm(&logits) + (&balance * coeff + &z * z_coeff) * weight).backward();
            let expected = router_grads(&stage);
            let mut pass = stage.forward_train(&tokens, None, None).unwrap();
            let logged: f64 = (pass.load_balance().iter())
                .map(|l| l.z_loss.double_value(&[]))
                .sum();
            assert!((logged - z.double_value(&[])).abs() < 1e-5 * logged.abs());
            pass.set_sequence_weight(weight);
            stage.backward(pass, BackwardFrom::Loss(&lm)).unwrap();
            let got = router_grads(&stage);
            let d = max_diff(&got, &expected);
            assert!(d < 1e-6, "{balancing:?}: {d}");
            seen.push(got);
        }
        let without = stage(LoadBalancing::None, coeff);
        let pass = without.forward_train(&tokens, None, None).unwrap();
        without.backward(pass, BackwardFrom::Loss(&lm)).unwrap();
        assert!(
            max_diff(&seen[1], &router_grads(&without)) > 1e-5,
            "the z-loss must count"
        );
    }
}
