//! The model flags of every command that builds or prices the model (`train`, `plan`,
//! `profile`), and their `--bf16`/`--fp16`: Megatron's, defined once, so the model flags
//! of a `run.sh` mean the same model wherever they are pasted.

use anyhow::{bail, Context, Result};
use clap::Args;
use synerfuse_model::{LlamaConfig, LoadBalancing, MegatronModelArgs};
use synerfuse_plan::Precision;

/// The model's shape and settings, as Megatron's flags give them.
#[derive(Args, Debug, Clone)]
pub struct ModelFlags {
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Model")]
    pub(crate) num_layers: Option<usize>,
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Model")]
    hidden_size: Option<usize>,
    /// Width of the SwiGLU MLP [default: 4 x --hidden-size]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Model")]
    ffn_hidden_size: Option<usize>,
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Model")]
    num_attention_heads: Option<usize>,
    /// Share each key/value head among --num-query-groups groups of heads (without it,
    /// as in Megatron, --num-query-groups has no effect)
    #[arg(long, help_heading = "Model")]
    group_query_attention: bool,
    /// Key/value heads under --group-query-attention
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Model")]
    num_query_groups: Option<usize>,
    /// Tokens per sample
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Model")]
    seq_length: Option<usize>,
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Model")]
    max_position_embeddings: Option<usize>,
    #[arg(long, value_parser = crate::values::positive, default_value_t = 10000.0, help_heading = "Model")]
    rotary_base: f64,
    #[arg(long, value_parser = crate::values::positive, default_value_t = 1e-5, help_heading = "Model")]
    norm_epsilon: f64,
    #[arg(long, help_heading = "Model")]
    untie_embeddings_and_output_weights: bool,
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 128, help_heading = "Model")]
    make_vocab_size_divisible_by: usize,
    #[arg(long, value_parser = crate::values::non_negative, default_value_t = 0.02, help_heading = "Model")]
    init_method_std: f64,
    /// No biases in linear layers (LLaMA); Megatron's default, and synerfuse's, is to add
    /// them (to the attention, the MLPs and every expert)
    #[arg(long, help_heading = "Model")]
    disable_bias_linear: bool,
    /// Accepted for Megatron compatibility: the MLP is always SwiGLU
    #[arg(long, help_heading = "Model")]
    swiglu: bool,
    /// RMSNorm (the only normalisation of LLaMA)
    #[arg(long, help_heading = "Model")]
    normalization: Option<String>,
    /// rope (the only position embedding of LLaMA)
    #[arg(long, help_heading = "Model")]
    position_embedding_type: Option<String>,
    /// Must be 0: no dropout
    #[arg(long, value_parser = crate::values::fraction, help_heading = "Model")]
    attention_dropout: Option<f64>,
    /// Must be 0: no dropout
    #[arg(long, value_parser = crate::values::fraction, help_heading = "Model")]
    hidden_dropout: Option<f64>,
    /// Rotary position embeddings: what synerfuse always uses
    #[arg(long, help_heading = "Megatron compatibility")]
    use_rotary_position_embeddings: bool,
    /// No learned absolute position embedding: what synerfuse always does
    #[arg(long, help_heading = "Megatron compatibility")]
    no_position_embedding: bool,
    /// Attention runs libtorch's scaled_dot_product_attention, which takes the flash
    /// kernels on GPUs that have them
    #[arg(long, help_heading = "Megatron compatibility")]
    use_flash_attn: bool,
    /// No effect: the attention kernels choose their own accumulation precision
    #[arg(long, help_heading = "Megatron compatibility")]
    attention_softmax_in_fp32: bool,
    /// local or transformer_engine: synerfuse has one implementation
    #[arg(long, help_heading = "Megatron compatibility")]
    transformer_impl: Option<String>,
    #[command(flatten)]
    pub(crate) experts: ExpertFlags,
}

/// Megatron's mixture-of-experts flags.
#[derive(Args, Debug, Clone)]
pub struct ExpertFlags {
    /// Experts in each MoE layer (a Mixtral model) [default: none, a dense model]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Mixture of experts")]
    num_experts: Option<usize>,
    /// Experts each token is routed to [default: 2, or a Hugging Face model's]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Mixture of experts")]
    moe_router_topk: Option<usize>,
    /// Width of each expert's SwiGLU [default: --ffn-hidden-size]
    #[arg(long, value_parser = crate::values::positive_count, help_heading = "Mixture of experts")]
    moe_ffn_hidden_size: Option<usize>,
    /// Layer i has experts when i % N == 0, the others a dense MLP
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 1, help_heading = "Mixture of experts")]
    moe_layer_freq: usize,
    /// Weight of the load-balancing loss [default: 0, or a Hugging Face model's
    /// router_aux_loss_coef]
    #[arg(long, value_parser = crate::values::non_negative, help_heading = "Mixture of experts")]
    moe_aux_loss_coeff: Option<f64>,
    /// aux_loss (over each micro-batch), seq_aux_loss (over each sequence: the same for
    /// any split of the batch) or none
    #[arg(long, default_value = "aux_loss", help_heading = "Mixture of experts")]
    moe_router_load_balancing_type: LoadBalancing,
    /// Log the load-balancing loss of every MoE layer to TensorBoard, not only their mean
    #[arg(long, help_heading = "Mixture of experts")]
    pub(crate) moe_per_layer_logging: bool,
    /// Not supported: routing is dropless (every token reaches its top-k experts, so
    /// every split of the batch trains alike)
    #[arg(long, value_parser = crate::values::positive, help_heading = "Mixture of experts")]
    moe_expert_capacity_factor: Option<f64>,
    /// Not supported (it pads to a capacity; routing is dropless)
    #[arg(long, help_heading = "Mixture of experts")]
    moe_pad_expert_input_to_capacity: bool,
    /// Weight of the router's z-loss (ST-MoE's mean of logsumexp(logits)², which keeps
    /// the router's logits small) [default: 0]
    #[arg(long, value_parser = crate::values::non_negative, help_heading = "Mixture of experts")]
    moe_z_loss_coeff: Option<f64>,
    /// Not supported above 0: no noise is added to the router's input
    #[arg(long, help_heading = "Mixture of experts")]
    moe_input_jitter_eps: Option<f64>,
    /// Weigh each token's top-k experts by their probabilities over all experts, not
    /// renormalised over the k (Mixtral's routing, the default, renormalises; a model so
    /// routed has no Hugging Face form)
    #[arg(long, help_heading = "Mixture of experts")]
    moe_router_pre_softmax: bool,
    /// alltoall or allgather: tokens reach their experts' ranks by all-to-all either way
    /// (the same results)
    #[arg(long, value_parser = ["alltoall", "allgather"], help_heading = "Megatron compatibility")]
    moe_token_dispatcher_type: Option<String>,
    /// Accepted: each expert runs its own matrix products (the same results)
    #[arg(long, help_heading = "Megatron compatibility")]
    moe_grouped_gemm: bool,
    /// probs or position: which tokens a capacity drops; no effect on dropless routing
    #[arg(long, value_parser = ["probs", "position"], help_heading = "Megatron compatibility")]
    moe_token_drop_policy: Option<String>,
}

/// `--bf16` and `--fp16`.
#[derive(Args, Debug, Clone, Copy)]
pub struct PrecisionFlags {
    /// Compute in bf16: fp32 master weights, main gradients and reductions
    #[arg(long, help_heading = "Precision")]
    bf16: bool,
    /// Compute in fp16: fp32 master weights, main gradients and reductions, and
    /// Megatron's loss scaling (dynamic unless --loss-scale); a step whose gradients
    /// overflow on any rank is skipped everywhere
    #[arg(long, conflicts_with = "bf16", help_heading = "Precision")]
    fp16: bool,
}

impl PrecisionFlags {
    /// The precision asked for, if either flag was given.
    pub(crate) fn asked(self) -> Option<Precision> {
        match (self.bf16, self.fp16) {
            (true, _) => Some(Precision::Bf16),
            (_, true) => Some(Precision::Fp16),
            _ => None,
        }
    }
}

impl ModelFlags {
    /// `--seq-length`, which every model needs.
    pub(crate) fn seq_length(&self) -> Result<usize> {
        self.seq_length.context("--seq-length is required")
    }

    /// Whether any flag of the model's shape was given.
    pub(crate) fn given(&self) -> bool {
        self.num_layers.is_some() || self.hidden_size.is_some() || self.seq_length.is_some()
    }

    /// Refuses the flags that ask for what synerfuse does not build.
    pub(crate) fn check(&self) -> Result<()> {
        if let Some(norm) = (self.normalization.as_ref()).filter(|n| *n != "RMSNorm") {
            bail!("--normalization {norm}: synerfuse trains LLaMA models, which use RMSNorm");
        }
        if let Some(kind) = (self.position_embedding_type.as_ref()).filter(|k| *k != "rope") {
            bail!(
                "--position-embedding-type {kind}: synerfuse trains LLaMA models, which use rope"
            );
        }
        for (flag, value) in [
            ("--attention-dropout", self.attention_dropout),
            ("--hidden-dropout", self.hidden_dropout),
        ] {
            if let Some(p) = value.filter(|&p| p != 0.0) {
                bail!("{flag} {p}: dropout is not implemented; pass 0");
            }
        }
        if let Some(implementation) = &self.transformer_impl {
            if implementation != "local" && implementation != "transformer_engine" {
                bail!("--transformer-impl {implementation}: use local or transformer_engine");
            }
        }
        self.experts.check()
    }

    /// Says what a flag given without effect does (call it on one rank).
    pub(crate) fn warn_ignored(&self) {
        if let (Some(groups), false) = (self.num_query_groups, self.group_query_attention) {
            tracing::warn!(
                "--num-query-groups {groups} has no effect without --group-query-attention (as in Megatron): every attention head has its own key/value head"
            );
        }
    }

    /// The model of these flags with `num_layers` layers and a tokenizer of
    /// `tokenizer_vocab` ids; `instead` names what could give the model in place of the
    /// shape flags (`--finetune-from-hf`, `--model config.json`).
    pub(crate) fn config(
        &self,
        num_layers: usize,
        tokenizer_vocab: usize,
        instead: &str,
    ) -> Result<LlamaConfig> {
        self.check()?;
        let e = &self.experts;
        if let (None, Some(flag)) = (e.num_experts, e.expert_flag()) {
            bail!("{flag}: the model has no experts (--num-experts)");
        }
        let need = |flag: &str, value: Option<usize>| {
            value.with_context(|| format!("{flag} is required (or {instead})"))
        };
        let args = MegatronModelArgs {
            num_layers,
            hidden_size: need("--hidden-size", self.hidden_size)?,
            ffn_hidden_size: self.ffn_hidden_size,
            num_attention_heads: need("--num-attention-heads", self.num_attention_heads)?,
            group_query_attention: self.group_query_attention,
            num_query_groups: self.num_query_groups,
            seq_length: self.seq_length()?,
            max_position_embeddings: self.max_position_embeddings,
            rotary_base: self.rotary_base,
            norm_epsilon: self.norm_epsilon,
            untie_embeddings_and_output_weights: self.untie_embeddings_and_output_weights,
            make_vocab_size_divisible_by: self.make_vocab_size_divisible_by,
            tensor_model_parallel_size: 1,
            init_method_std: self.init_method_std,
            add_bias_linear: !self.disable_bias_linear,
            num_experts: e.num_experts,
            moe_router_topk: e.moe_router_topk.unwrap_or(2),
            moe_ffn_hidden_size: e.moe_ffn_hidden_size,
            moe_layer_freq: e.moe_layer_freq,
            moe_aux_loss_coeff: e.moe_aux_loss_coeff.unwrap_or(0.0),
            moe_router_load_balancing_type: e.moe_router_load_balancing_type,
            moe_z_loss_coeff: e.moe_z_loss_coeff.unwrap_or(0.0),
            moe_router_pre_softmax: e.moe_router_pre_softmax,
        };
        Ok(LlamaConfig::from_megatron(&args, tokenizer_vocab)?)
    }

    /// A Hugging Face model (`source` names where it came from, e.g. `--finetune-from-hf
    /// DIR`) with the training settings of its experts (the load-balancing and z-losses)
    /// from the flags; the flags of its shape that were given must agree with it.
    pub(crate) fn with_hf_model(&self, config: LlamaConfig, source: &str) -> Result<LlamaConfig> {
        self.check()?;
        if let Some(layers) = self.num_layers.filter(|&l| l != config.num_layers) {
            bail!(
                "--num-layers {layers}: {source} has {} layers",
                config.num_layers
            );
        }
        self.experts.of_hf_model(config, source)
    }
}

impl ExpertFlags {
    /// Refuses token dropping and router noise, which would make splits of the batch
    /// train differently.
    fn check(&self) -> Result<()> {
        if let Some(factor) = self.moe_expert_capacity_factor {
            bail!("--moe-expert-capacity-factor {factor}: synerfuse routes dropless only (no token is dropped, so every split of the batch trains alike); leave it out");
        }
        if self.moe_pad_expert_input_to_capacity {
            bail!("--moe-pad-expert-input-to-capacity: synerfuse routes dropless only (no capacity to pad to); leave it out");
        }
        if let Some(eps) = self.moe_input_jitter_eps.filter(|&e| e != 0.0) {
            bail!("--moe-input-jitter-eps {eps}: synerfuse adds no noise to the router's input (every split of the batch trains alike); leave it out");
        }
        Ok(())
    }

    /// The first MoE flag given beside `--num-experts` (which a dense model refuses).
    fn expert_flag(&self) -> Option<&'static str> {
        [
            ("--moe-router-topk", self.moe_router_topk.is_some()),
            ("--moe-ffn-hidden-size", self.moe_ffn_hidden_size.is_some()),
            ("--moe-layer-freq", self.moe_layer_freq != 1),
            ("--moe-aux-loss-coeff", self.moe_aux_loss_coeff.is_some()),
            ("--moe-z-loss-coeff", self.moe_z_loss_coeff.is_some()),
            ("--moe-router-pre-softmax", self.moe_router_pre_softmax),
            ("--moe-per-layer-logging", self.moe_per_layer_logging),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag))
    }

    /// [`ModelFlags::with_hf_model`]'s experts.
    fn of_hf_model(&self, mut config: LlamaConfig, source: &str) -> Result<LlamaConfig> {
        let Some(moe) = config.moe.as_mut() else {
            if let Some(n) = self.num_experts {
                bail!("--num-experts {n}: {source} is a dense model");
            }
            if let Some(flag) = self.expert_flag() {
                bail!("{flag}: {source} is a dense model (no experts)");
            }
            return Ok(config);
        };
        for (flag, given, held) in [
            ("--num-experts", self.num_experts, moe.num_experts),
            (
                "--moe-ffn-hidden-size",
                self.moe_ffn_hidden_size,
                moe.ffn_hidden_size,
            ),
        ] {
            if let Some(n) = given.filter(|&n| n != held) {
                bail!("{flag} {n}: {source} has {held}");
            }
        }
        if let Some(k) = self.moe_router_topk.filter(|&k| k != moe.top_k) {
            bail!(
                "--moe-router-topk {k}: {source} routes each token to {}",
                moe.top_k
            );
        }
        if self.moe_layer_freq != 1 {
            bail!(
                "--moe-layer-freq {}: every layer of a Hugging Face Mixtral model has experts",
                self.moe_layer_freq
            );
        }
        moe.load_balancing = self.moe_router_load_balancing_type;
        if let Some(coeff) = self.moe_aux_loss_coeff {
            moe.aux_loss_coeff = coeff;
        }
        moe.z_loss_coeff = self.moe_z_loss_coeff.unwrap_or(0.0);
        moe.router_pre_softmax = self.moe_router_pre_softmax;
        Ok(config)
    }
}
