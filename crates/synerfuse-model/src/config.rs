//! The shape of a LLaMA model, from a Hugging Face `config.json` or from Megatron's flags.

use serde_json::{json, Value};
use std::path::Path;

/// A configuration that cannot describe a model.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A field is missing, of the wrong type, or unsupported.
    #[error("{source_name}: {field}: {problem}")]
    Field {
        /// The file or flag set.
        source_name: String,
        /// The field or flag.
        field: String,
        /// What is wrong.
        problem: String,
    },
}

/// A mixture of experts in place of the MLP of every `layer_freq`-th layer (Mixtral's
/// sparse MoE block in all of them): a router without bias, softmax over the experts,
/// the `top_k` best with their weights renormalised to sum to 1 (or not: Megatron's
/// pre-softmax routing), each a SwiGLU MLP of
/// `ffn_hidden_size`; dropless (every token reaches its experts, so any split of the
/// tokens computes the same).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer (`num_local_experts`, Megatron's `--num-experts`).
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`, `--moe-router-topk`).
    pub top_k: usize,
    /// Width of each expert's SwiGLU (`--moe-ffn-hidden-size`; Mixtral's
    /// `intermediate_size`).
    pub ffn_hidden_size: usize,
    /// Layer `i` has experts when `i % layer_freq == 0` (`--moe-layer-freq`, as
    /// Megatron); the others a dense MLP of the model's `intermediate_size`.
    pub layer_freq: usize,
    /// Weight of the load-balancing loss in training (`--moe-aux-loss-coeff`,
    /// transformers' `router_aux_loss_coef`).
    pub aux_loss_coeff: f64,
    /// Over which tokens the load-balancing loss is taken.
    pub load_balancing: LoadBalancing,
    /// Weight of the router's z-loss in training (`--moe-z-loss-coeff`; ST-MoE's
    /// `mean(logsumexp(logits)²)`, which keeps the router's logits small). Training only:
    /// not in a Hugging Face config.
    pub z_loss_coeff: f64,
    /// The top-k weights are the experts' probabilities over all experts, not
    /// renormalised over the k (`--moe-router-pre-softmax`, Megatron's; not Mixtral's,
    /// so not exportable).
    pub router_pre_softmax: bool,
}

impl MoeConfig {
    /// Mixtral's layout: `num_experts` experts of width `ffn_hidden_size` in every
    /// layer, `top_k` per token, no load-balancing loss in training.
    pub fn every_layer(num_experts: usize, top_k: usize, ffn_hidden_size: usize) -> Self {
        MoeConfig {
            num_experts,
            top_k,
            ffn_hidden_size,
            layer_freq: 1,
            aux_loss_coeff: 0.0,
            load_balancing: LoadBalancing::AuxLoss,
            z_loss_coeff: 0.0,
            router_pre_softmax: false,
        }
    }

    /// Whether global layer `layer` has experts.
    pub fn has_experts(&self, layer: usize) -> bool {
        layer % self.layer_freq.max(1) == 0
    }

    /// Whether training takes a load-balancing loss (a type other than `none`).
    pub fn balances_load(&self) -> bool {
        self.load_balancing != LoadBalancing::None
    }

    /// The load-balancing loss's weight in training (0 under `none`).
    pub fn balance_coeff(&self) -> f64 {
        match self.balances_load() {
            true => self.aux_loss_coeff,
            false => 0.0,
        }
    }

    /// Whether training adds the router's z-loss.
    pub fn trains_z_loss(&self) -> bool {
        self.z_loss_coeff > 0.0
    }
}

/// Megatron's `--moe-router-load-balancing-type`: the Switch Transformer loss
/// `E / (T² k) · Σ_e P_e · n_e` (`P_e` the router probabilities of expert `e` summed over
/// `T` tokens, `n_e` its top-k picks), per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadBalancing {
    /// `aux_loss`: over each micro-batch's tokens (Megatron's default). The loss then
    /// depends on which sequences share a micro-batch.
    AuxLoss,
    /// `seq_aux_loss`: over each sequence's tokens, averaged over sequences; the same
    /// for any split of the batch.
    SeqAuxLoss,
    /// `none`: no load-balancing loss.
    None,
}

impl LoadBalancing {
    /// Megatron's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadBalancing::AuxLoss => "aux_loss",
            LoadBalancing::SeqAuxLoss => "seq_aux_loss",
            LoadBalancing::None => "none",
        }
    }
}

impl std::str::FromStr for LoadBalancing {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "aux_loss" => Ok(LoadBalancing::AuxLoss),
            "seq_aux_loss" => Ok(LoadBalancing::SeqAuxLoss),
            "none" => Ok(LoadBalancing::None),
            _ => Err(format!("{s:?}: use aux_loss, seq_aux_loss or none")),
        }
    }
}

/// A LLaMA-family decoder (what transformers' `LlamaConfig` and Megatron's flags describe).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Rows of the embedding and the LM head (padded vocabulary).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Longest position the model is meant for.
    pub max_position_embeddings: usize,
    /// Rotary base θ.
    pub rope_theta: f64,
    /// RMSNorm ε.
    pub rms_norm_eps: f64,
    /// The LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o projections.
    pub attention_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// Standard deviation of the initial weights (`--init-method-std`).
    pub init_std: f64,
    /// Experts in place of the MLP of some layers (a Mixtral model); `None`: dense.
    pub moe: Option<MoeConfig>,
}

/// synerfuse's own keys for `--moe-layer-freq` (with the dense layers' width) and
/// `--moe-router-pre-softmax` in a model's config (a checkpoint's `state.json`):
/// transformers' Mixtral has experts in every layer and renormalises the top-k weights,
/// so an export, which refuses other models, never writes them.
const LAYER_FREQ_KEY: &str = "moe_layer_freq";
const DENSE_FFN_KEY: &str = "moe_dense_intermediate_size";
const PRE_SOFTMAX_KEY: &str = "moe_router_pre_softmax";

impl LlamaConfig {
    /// Reads a Hugging Face `config.json` of a `llama` or `mixtral` model.
    pub fn from_hf_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_hf_json(&text, &path.display().to_string())
    }

    /// Parses the text of a Hugging Face `config.json`; `source_name` names it in errors.
    pub fn from_hf_json(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| field_error(source_name, "(json)", e.to_string()))?;
        let json = HfJson { v: &v, source_name };
        let kind = json.model_type()?;
        // synerfuse's own keys come from a checkpoint's state.json; read from any
        // config.json, they still describe the model (an export never writes them).
        let moe = match kind {
            "mixtral" => Some(MoeConfig {
                aux_loss_coeff: json.float("router_aux_loss_coef", 0.0),
                layer_freq: json.opt_int(LAYER_FREQ_KEY).unwrap_or(1),
                router_pre_softmax: json.flag(PRE_SOFTMAX_KEY, false),
                ..MoeConfig::every_layer(
                    json.int("num_local_experts")?,
                    json.int("num_experts_per_tok")?,
                    json.int("intermediate_size")?,
                )
            }),
            _ => None,
        };
        json.check_activation()?;
        let rope_theta = json.rope_theta()?;
        let hidden_size = json.int("hidden_size")?;
        let num_heads = json.int("num_attention_heads")?;
        let config = LlamaConfig {
            vocab_size: json.int("vocab_size")?,
            hidden_size,
            intermediate_size: (json.opt_int(DENSE_FFN_KEY))
                .map_or_else(|| json.int("intermediate_size"), Ok)?,
            num_layers: json.int("num_hidden_layers")?,
            num_heads,
            num_kv_heads: json.opt_int("num_key_value_heads").unwrap_or(num_heads),
            head_dim: (json.opt_int("head_dim"))
                .unwrap_or(hidden_size.checked_div(num_heads).unwrap_or(0)),
            max_position_embeddings: json.opt_int("max_position_embeddings").unwrap_or(2048),
            rope_theta,
            rms_norm_eps: json.float("rms_norm_eps", 1e-6),
            tie_word_embeddings: json.flag("tie_word_embeddings", false),
            attention_bias: json.flag("attention_bias", false),
            mlp_bias: json.flag("mlp_bias", false),
            init_std: json.float("initializer_range", 0.02),
            moe,
        };
        config.validate(source_name)?;
        Ok(config)
    }

    /// Checks that the sizes fit together.
    pub fn validate(&self, source_name: &str) -> Result<(), ConfigError> {
        let err = |field: &str, problem: String| {
            Err(ConfigError::Field {
                source_name: source_name.to_owned(),
                field: field.to_owned(),
                problem,
            })
        };
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if value == 0 {
                return err(field, "must be at least 1".into());
            }
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return err(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_kv_heads, self.num_heads
                ),
            );
        }
        if let Some(moe) = self.moe {
            if moe.num_experts == 0 || moe.top_k == 0 || moe.top_k > moe.num_experts {
                return err(
                    "num_experts_per_tok",
                    format!(
                        "{} experts per token of {} experts: needs 1 to {}",
                        moe.top_k, moe.num_experts, moe.num_experts
                    ),
                );
            }
            if moe.ffn_hidden_size == 0 || moe.layer_freq == 0 {
                return err(
                    "moe_ffn_hidden_size",
                    "the experts' width and the MoE layer frequency must be at least 1".into(),
                );
            }
            for (field, coeff) in [
                ("router_aux_loss_coef", moe.aux_loss_coeff),
                ("moe_z_loss_coeff", moe.z_loss_coeff),
            ] {
                if !(coeff >= 0.0 && coeff.is_finite()) {
                    return err(
                        field,
                        format!("{coeff}: must be a finite non-negative number"),
                    );
                }
            }
        }
        if self.head_dim % 2 != 0 {
            return err(
                "head_dim",
                format!(
                    "{} is odd; rotary embeddings need an even width",
                    self.head_dim
                ),
            );
        }
        Ok(())
    }

    /// Whether transformers can hold this model: a Mixtral model has experts in every
    /// layer (none dense between them) and renormalises each token's top-k weights.
    pub fn check_hf_exportable(&self) -> Result<(), ConfigError> {
        let refused = |field: &str, problem: String| {
            Err(ConfigError::Field {
                source_name: "model".into(),
                field: field.into(),
                problem,
            })
        };
        match self.moe {
            Some(moe) if moe.layer_freq != 1 => refused(
                "--moe-layer-freq",
                format!(
                    "{}: dense layers between the MoE layers have no place in a Hugging Face \
                     Mixtral checkpoint (every layer has experts there)",
                    moe.layer_freq
                ),
            ),
            Some(_) if self.attention_bias || self.mlp_bias => refused(
                "--disable-bias-linear",
                "a Hugging Face Mixtral checkpoint has no biases (its attention's and \
                 experts' linear layers have none); train with --disable-bias-linear"
                    .into(),
            ),
            Some(moe) if moe.router_pre_softmax => refused(
                "--moe-router-pre-softmax",
                "a Hugging Face Mixtral checkpoint renormalises the top-k weights (its \
                 routing would differ)"
                    .into(),
            ),
            _ => Ok(()),
        }
    }

    /// The `config.json` transformers writes for this model (`MixtralForCausalLM` with
    /// experts; see [`Self::check_hf_exportable`]), which a checkpoint's `state.json`
    /// also keeps: with synerfuse's own keys for what transformers cannot hold.
    pub fn to_hf_json(&self) -> String {
        let mut v = json!({
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.init_std,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": self.mlp_bias,
            "model_type": "llama",
            "num_attention_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
            "vocab_size": self.vocab_size,
        });
        if let Some(moe) = self.moe {
            v["architectures"] = json!(["MixtralForCausalLM"]);
            v["model_type"] = json!("mixtral");
            v["num_local_experts"] = json!(moe.num_experts);
            v["num_experts_per_tok"] = json!(moe.top_k);
            v["intermediate_size"] = json!(moe.ffn_hidden_size);
            v["output_router_logits"] = json!(false);
            v["router_aux_loss_coef"] = json!(moe.aux_loss_coeff);
            v["router_jitter_noise"] = json!(0.0);
            v["sliding_window"] = Value::Null;
            if moe.layer_freq != 1 {
                v[LAYER_FREQ_KEY] = json!(moe.layer_freq);
                v[DENSE_FFN_KEY] = json!(self.intermediate_size);
            }
            if moe.router_pre_softmax {
                v[PRE_SOFTMAX_KEY] = json!(true);
            }
            // Ours (a checkpoint's state) only: a Mixtral's experts have no biases.
            if let (Some(map), false) = (v.as_object_mut(), self.mlp_bias) {
                map.remove("mlp_bias");
            }
        }
        serde_json::to_string_pretty(&v).expect("json")
    }

    /// Every parameter of the whole model with its shape, by Hugging Face name, in model
    /// order: what a whole [`crate::Stage`] holds (what an export must find).
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let [h, ffn, vocab] =
            [self.hidden_size, self.intermediate_size, self.vocab_size].map(|n| n as i64);
        let q = (self.num_heads * self.head_dim) as i64;
        let kv = (self.num_kv_heads * self.head_dim) as i64;
        let mut out = vec![("model.embed_tokens.weight".to_owned(), vec![vocab, h])];
        for i in 0..self.num_layers {
            let layer = format!("model.layers.{i}");
            let mut push =
                |name: &str, shape: Vec<i64>| out.push((format!("{layer}.{name}"), shape));
            push("input_layernorm.weight", vec![h]);
            push("post_attention_layernorm.weight", vec![h]);
            for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                push(&format!("self_attn.{proj}.weight"), vec![rows, h]);
                if self.attention_bias {
                    push(&format!("self_attn.{proj}.bias"), vec![rows]);
                }
            }
            push("self_attn.o_proj.weight", vec![h, q]);
            if self.attention_bias {
                push("self_attn.o_proj.bias", vec![h]);
            }
            if let Some(moe) = self.moe.filter(|m| m.has_experts(i)) {
                let ffn = moe.ffn_hidden_size as i64;
                push(
                    "block_sparse_moe.gate.weight",
                    vec![moe.num_experts as i64, h],
                );
                for e in 0..moe.num_experts {
                    let expert = format!("block_sparse_moe.experts.{e}");
                    for (proj, shape) in [("w1", [ffn, h]), ("w2", [h, ffn]), ("w3", [ffn, h])] {
                        push(&format!("{expert}.{proj}.weight"), shape.to_vec());
                        if self.mlp_bias {
                            push(&format!("{expert}.{proj}.bias"), vec![shape[0]]);
                        }
                    }
                }
                continue;
            }
            for proj in ["gate_proj", "up_proj"] {
                push(&format!("mlp.{proj}.weight"), vec![ffn, h]);
                if self.mlp_bias {
                    push(&format!("mlp.{proj}.bias"), vec![ffn]);
                }
            }
            push("mlp.down_proj.weight", vec![h, ffn]);
            if self.mlp_bias {
                push("mlp.down_proj.bias", vec![h]);
            }
        }
        out.push(("model.norm.weight".to_owned(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_owned(), vec![vocab, h]));
        }
        out
    }

    /// Parameters of the whole model.
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let attention = h * q
            + 2 * h * kv
            + q * h
            + if self.attention_bias {
                q + 2 * kv + h
            } else {
                0
            };
        let dense = 3 * h * self.intermediate_size
            + if self.mlp_bias {
                2 * self.intermediate_size + h
            } else {
                0
            };
        let mlps: usize = (0..self.num_layers)
            .map(|i| match self.moe.filter(|m| m.has_experts(i)) {
                Some(moe) => {
                    let biases = match self.mlp_bias {
                        true => 2 * moe.ffn_hidden_size + h,
                        false => 0,
                    };
                    moe.num_experts * (3 * h * moe.ffn_hidden_size + h + biases)
                }
                None => dense,
            })
            .sum();
        let layer = attention + 2 * h;
        let embedding = self.vocab_size * h;
        embedding * if self.tie_word_embeddings { 1 } else { 2 }
            + self.num_layers * layer
            + mlps
            + h
    }
}

/// A [`ConfigError::Field`] of `source_name`.
fn field_error(source_name: &str, field: &str, problem: String) -> ConfigError {
    ConfigError::Field {
        source_name: source_name.to_owned(),
        field: field.to_owned(),
        problem,
    }
}

/// A parsed Hugging Face `config.json` and the name its errors give it: typed reads of
/// its fields, and the checks of what synerfuse supports.
struct HfJson<'a> {
    v: &'a Value,
    source_name: &'a str,
}

impl<'a> HfJson<'a> {
    fn error(&self, field: &str, problem: String) -> ConfigError {
        field_error(self.source_name, field, problem)
    }

    /// A required non-negative integer.
    fn int(&self, key: &str) -> Result<usize, ConfigError> {
        self.opt_int(key)
            .ok_or_else(|| self.error(key, "missing or not a non-negative integer".into()))
    }

    fn opt_int(&self, key: &str) -> Option<usize> {
        self.v.get(key).and_then(Value::as_u64).map(|x| x as usize)
    }

    fn float(&self, key: &str, default: f64) -> f64 {
        self.v.get(key).and_then(Value::as_f64).unwrap_or(default)
    }

    fn flag(&self, key: &str, default: bool) -> bool {
        self.v.get(key).and_then(Value::as_bool).unwrap_or(default)
    }

    /// `llama` (the default) or `mixtral` without sliding-window attention.
    fn model_type(&self) -> Result<&'a str, ConfigError> {
        let v = self.v;
        let kind = v
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("llama");
        if !matches!(kind, "llama" | "mixtral") {
            return Err(self.error(
                "model_type",
                format!("{kind:?} is not a LLaMA model (llama or mixtral)"),
            ));
        }
        if kind == "mixtral" && v.get("sliding_window").is_some_and(|w| !w.is_null()) {
            return Err(self.error(
                "sliding_window",
                "sliding-window attention is not supported (null: full causal attention)".into(),
            ));
        }
        Ok(kind)
    }

    /// Refuses an MLP activation other than SiLU (SwiGLU), the only one implemented.
    fn check_activation(&self) -> Result<(), ConfigError> {
        if let Some(act) = self.v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(self.error(
                    "hidden_act",
                    format!("{act:?}; only silu (SwiGLU) is supported"),
                ));
            }
        }
        Ok(())
    }

    /// The rotary base θ, refusing any RoPE scaling.
    fn rope_theta(&self) -> Result<f64, ConfigError> {
        // transformers 5 keeps rotary settings in `rope_parameters`, 4.x in `rope_theta`
        // and `rope_scaling`.
        let rope = (self.v.get("rope_parameters"))
            .or_else(|| self.v.get("rope_scaling"))
            .filter(|r| !r.is_null());
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if rope_type != "default" {
            return Err(self.error(
                "rope_parameters",
                format!("rope_type {rope_type:?} is not supported (only default)"),
            ));
        }
        Ok(rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or_else(|| self.float("rope_theta", 10000.0)))
    }
}

/// Megatron's model flags (what `pretrain_gpt.py` takes for a LLaMA run).
#[derive(Debug, Clone, PartialEq)]
pub struct MegatronModelArgs {
    /// `--num-layers`.
    pub num_layers: usize,
    /// `--hidden-size`.
    pub hidden_size: usize,
    /// `--ffn-hidden-size` (Megatron's default: 4 × hidden).
    pub ffn_hidden_size: Option<usize>,
    /// `--num-attention-heads`.
    pub num_attention_heads: usize,
    /// `--group-query-attention`.
    pub group_query_attention: bool,
    /// `--num-query-groups`.
    pub num_query_groups: Option<usize>,
    /// `--seq-length`.
    pub seq_length: usize,
    /// `--max-position-embeddings` (default: seq length).
    pub max_position_embeddings: Option<usize>,
    /// `--rotary-base`.
    pub rotary_base: f64,
    /// `--norm-epsilon`.
    pub norm_epsilon: f64,
    /// `--untie-embeddings-and-output-weights`.
    pub untie_embeddings_and_output_weights: bool,
    /// `--make-vocab-size-divisible-by`.
    pub make_vocab_size_divisible_by: usize,
    /// `--tensor-model-parallel-size` (the vocabulary is padded to a multiple of both).
    pub tensor_model_parallel_size: usize,
    /// `--init-method-std`.
    pub init_method_std: f64,
    /// `--add-bias-linear` (LLaMA runs pass `--disable-bias-linear`).
    pub add_bias_linear: bool,
    /// `--num-experts` (none: a dense model).
    pub num_experts: Option<usize>,
    /// `--moe-router-topk`.
    pub moe_router_topk: usize,
    /// `--moe-ffn-hidden-size` (default: the FFN width).
    pub moe_ffn_hidden_size: Option<usize>,
    /// `--moe-layer-freq`.
    pub moe_layer_freq: usize,
    /// `--moe-aux-loss-coeff`.
    pub moe_aux_loss_coeff: f64,
    /// `--moe-router-load-balancing-type`.
    pub moe_router_load_balancing_type: LoadBalancing,
    /// `--moe-z-loss-coeff`.
    pub moe_z_loss_coeff: f64,
    /// `--moe-router-pre-softmax`.
    pub moe_router_pre_softmax: bool,
}

impl Default for MegatronModelArgs {
    fn default() -> Self {
        MegatronModelArgs {
            num_layers: 0,
            hidden_size: 0,
            ffn_hidden_size: None,
            num_attention_heads: 0,
            group_query_attention: false,
            num_query_groups: None,
            seq_length: 0,
            max_position_embeddings: None,
            rotary_base: 10000.0,
            norm_epsilon: 1e-5,
            untie_embeddings_and_output_weights: false,
            make_vocab_size_divisible_by: 128,
            tensor_model_parallel_size: 1,
            init_method_std: 0.02,
            add_bias_linear: false,
            num_experts: None,
            moe_router_topk: 2,
            moe_ffn_hidden_size: None,
            moe_layer_freq: 1,
            moe_aux_loss_coeff: 0.0,
            moe_router_load_balancing_type: LoadBalancing::AuxLoss,
            moe_z_loss_coeff: 0.0,
            moe_router_pre_softmax: false,
        }
    }
}

/// Megatron's `_vocab_size_with_padding`: up to a multiple of
/// `make_vocab_size_divisible_by · tensor_model_parallel_size`.
pub fn padded_vocab_size(vocab: usize, divisible_by: usize, tensor_parallel: usize) -> usize {
    let multiple = (divisible_by * tensor_parallel).max(1);
    vocab.div_ceil(multiple) * multiple
}

impl LlamaConfig {
    /// The model Megatron builds from `args` for a tokenizer of `tokenizer_vocab_size`
    /// ids (padded as Megatron pads it).
    pub fn from_megatron(
        args: &MegatronModelArgs,
        tokenizer_vocab_size: usize,
    ) -> Result<Self, ConfigError> {
        let err = |field: &str, problem: String| ConfigError::Field {
            source_name: "flags".into(),
            field: field.to_owned(),
            problem,
        };
        if args.num_attention_heads == 0 || args.hidden_size % args.num_attention_heads != 0 {
            return Err(err(
                "--num-attention-heads",
                format!(
                    "{} does not divide --hidden-size {}",
                    args.num_attention_heads, args.hidden_size
                ),
            ));
        }
        let num_kv_heads = match (args.group_query_attention, args.num_query_groups) {
            (true, Some(groups)) => groups,
            (true, None) => {
                return Err(err(
                    "--num-query-groups",
                    "is required with --group-query-attention".into(),
                ))
            }
            // As in Megatron, the group count counts only with --group-query-attention.
            (false, _) => args.num_attention_heads,
        };
        let intermediate_size = args.ffn_hidden_size.unwrap_or(4 * args.hidden_size);
        if let Some(n) = args.num_experts {
            if args.moe_router_topk == 0 || args.moe_router_topk > n {
                return Err(err(
                    "--moe-router-topk",
                    format!(
                        "{} experts per token of {n} experts (--num-experts): needs 1 to {n}",
                        args.moe_router_topk
                    ),
                ));
            }
        }
        let moe = args.num_experts.map(|num_experts| MoeConfig {
            num_experts,
            top_k: args.moe_router_topk,
            ffn_hidden_size: args.moe_ffn_hidden_size.unwrap_or(intermediate_size),
            layer_freq: args.moe_layer_freq,
            aux_loss_coeff: args.moe_aux_loss_coeff,
            load_balancing: args.moe_router_load_balancing_type,
            z_loss_coeff: args.moe_z_loss_coeff,
            router_pre_softmax: args.moe_router_pre_softmax,
        });
        let config = LlamaConfig {
            vocab_size: padded_vocab_size(
                tokenizer_vocab_size,
                args.make_vocab_size_divisible_by,
                args.tensor_model_parallel_size,
            ),
            hidden_size: args.hidden_size,
            intermediate_size,
            num_layers: args.num_layers,
            num_heads: args.num_attention_heads,
            num_kv_heads,
            head_dim: args.hidden_size / args.num_attention_heads,
            max_position_embeddings: args.max_position_embeddings.unwrap_or(args.seq_length),
            rope_theta: args.rotary_base,
            rms_norm_eps: args.norm_epsilon,
            tie_word_embeddings: !args.untie_embeddings_and_output_weights,
            attention_bias: args.add_bias_linear,
            mlp_bias: args.add_bias_linear,
            init_std: args.init_method_std,
            moe,
        };
        config.validate("flags")?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_shapes_are_a_whole_stages() {
        let experts = MoeConfig::every_layer(3, 2, 40);
        let every_other = MoeConfig {
            layer_freq: 2,
            ..experts
        };
        for (tied, bias, moe) in [
            (true, false, None),
            (false, true, None),
            (false, false, Some(experts)),
            (true, false, Some(every_other)),
            (false, true, Some(every_other)),
        ] {
            let c = LlamaConfig {
                vocab_size: 64,
                hidden_size: 32,
                intermediate_size: 48,
                num_layers: 2,
                num_heads: 8,
                num_kv_heads: 4,
                head_dim: 4,
                max_position_embeddings: 32,
                rope_theta: 10_000.0,
                rms_norm_eps: 1e-5,
                tie_word_embeddings: tied,
                attention_bias: bias,
                mlp_bias: bias,
                init_std: 0.02,
                moe,
            };
            let stage = crate::Stage::new(&c, 0..2, tch::Device::Cpu).unwrap();
            let held: std::collections::BTreeMap<String, Vec<i64>> = (stage.var_store())
                .variables()
                .into_iter()
                .map(|(n, t)| (n, t.size()))
                .collect();
            let listed: std::collections::BTreeMap<String, Vec<i64>> =
                c.parameter_shapes().into_iter().collect();
            assert_eq!(listed, held);
            let numel: i64 = listed.values().map(|s| s.iter().product::<i64>()).sum();
            assert_eq!(numel as usize, c.num_parameters());
        }
    }

    #[test]
    fn reads_transformers_5_and_4_configs() {
        let v5 = r#"{"model_type":"llama","vocab_size":96,"hidden_size":32,"intermediate_size":64,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
            "rms_norm_eps":1e-6,"rope_parameters":{"rope_theta":500000.0,"rope_type":"default"},
            "tie_word_embeddings":false,"hidden_act":"silu"}"#;
        let c = LlamaConfig::from_hf_json(v5, "config.json").unwrap();
        assert_eq!((c.num_kv_heads, c.head_dim, c.rope_theta), (2, 8, 500000.0));
        let v4 = v5.replace(
            r#""rope_parameters":{"rope_theta":500000.0,"rope_type":"default"}"#,
            r#""rope_theta":1000.0"#,
        );
        assert_eq!(
            LlamaConfig::from_hf_json(&v4, "c").unwrap().rope_theta,
            1000.0
        );
        let back = LlamaConfig::from_hf_json(&c.to_hf_json(), "c").unwrap();
        assert_eq!(back, c);
        let bad = v5.replace(r#""num_key_value_heads":2"#, r#""num_key_value_heads":3"#);
        let e = LlamaConfig::from_hf_json(&bad, "config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json") && e.contains("num_key_value_heads"),
            "{e}"
        );
        let scaled = v5.replace(r#""rope_type":"default""#, r#""rope_type":"llama3""#);
        assert!(LlamaConfig::from_hf_json(&scaled, "c").is_err());
    }

    #[test]
    fn reads_and_writes_mixtral_configs() {
        let text = r#"{"model_type":"mixtral","vocab_size":96,"hidden_size":32,
            "intermediate_size":48,"num_hidden_layers":3,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":null,"num_local_experts":4,
            "num_experts_per_tok":2,"sliding_window":null,"tie_word_embeddings":false,
            "rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"}}"#;
        let c = LlamaConfig::from_hf_json(text, "config.json").unwrap();
        let experts = MoeConfig::every_layer(4, 2, 48);
        assert_eq!((c.moe, c.head_dim), (Some(experts), 8));
        let back = LlamaConfig::from_hf_json(&c.to_hf_json(), "c").unwrap();
        assert_eq!(back, c);
        assert!(c.to_hf_json().contains("MixtralForCausalLM"));
        let error = |text: String| {
            LlamaConfig::from_hf_json(&text, "config.json")
                .unwrap_err()
                .to_string()
        };
        let e = error(text.replace(r#""num_experts_per_tok":2"#, r#""num_experts_per_tok":5"#));
        assert!(
            e.contains("num_experts_per_tok") && e.contains("5 experts per token"),
            "{e}"
        );
        let e = error(text.replace(r#""sliding_window":null"#, r#""sliding_window":16"#));
        assert!(e.contains("sliding_window"), "{e}");
        let e = error(text.replace(r#""num_local_experts":4,"#, ""));
        assert!(e.contains("num_local_experts"), "{e}");
        let e = error(text.replace("mixtral", "mistral"));
        assert!(e.contains("\"mistral\" is not a LLaMA model"), "{e}");
    }

    #[test]
    fn megatron_flags_and_vocab_padding() {
        assert_eq!(padded_vocab_size(50257, 128, 1), 50304);
        assert_eq!(padded_vocab_size(32000, 128, 2), 32000);
        assert_eq!(padded_vocab_size(32001, 128, 2), 32256);
        let args = MegatronModelArgs {
            num_layers: 4,
            hidden_size: 256,
            ffn_hidden_size: Some(688),
            num_attention_heads: 8,
            group_query_attention: true,
            num_query_groups: Some(2),
            seq_length: 512,
            untie_embeddings_and_output_weights: true,
            ..Default::default()
        };
        let c = LlamaConfig::from_megatron(&args, 8000).unwrap();
        assert_eq!(
            (
                c.vocab_size,
                c.num_kv_heads,
                c.head_dim,
                c.tie_word_embeddings
            ),
            (8064, 2, 32, false)
        );
        assert_eq!(c.max_position_embeddings, 512);
        let bad = MegatronModelArgs {
            num_query_groups: Some(3),
            ..args.clone()
        };
        assert!(LlamaConfig::from_megatron(&bad, 8000).is_err());
        // Without --group-query-attention the group count has no effect (Megatron's
        // run.sh files pass it anyway).
        let mha = MegatronModelArgs {
            group_query_attention: false,
            num_query_groups: Some(3),
            ..args
        };
        assert_eq!(
            LlamaConfig::from_megatron(&mha, 8000).unwrap().num_kv_heads,
            8
        );
    }

    /// Megatron's MoE flags: experts of their own width in every `--moe-layer-freq`-th
    /// layer; a model with dense layers between them is not a Mixtral checkpoint.
    #[test]
    fn megatron_moe_flags() {
        let args = MegatronModelArgs {
            num_layers: 4,
            hidden_size: 64,
            ffn_hidden_size: Some(128),
            num_attention_heads: 4,
            seq_length: 32,
            num_experts: Some(8),
            moe_router_topk: 2,
            moe_ffn_hidden_size: Some(32),
            moe_layer_freq: 2,
            moe_aux_loss_coeff: 0.01,
            moe_router_load_balancing_type: LoadBalancing::SeqAuxLoss,
            ..Default::default()
        };
        let c = LlamaConfig::from_megatron(&args, 1000).unwrap();
        let moe = c.moe.unwrap();
        assert_eq!((moe.ffn_hidden_size, moe.aux_loss_coeff), (32, 0.01));
        assert_eq!(
            (0..4).map(|l| moe.has_experts(l)).collect::<Vec<_>>(),
            [true, false, true, false]
        );
        let e = c.check_hf_exportable().unwrap_err().to_string();
        assert!(e.contains("--moe-layer-freq"), "{e}");
        // A checkpoint's model config keeps the dense layers between the MoE ones.
        let kept = LlamaConfig::from_hf_json(&c.to_hf_json(), "state.json").unwrap();
        assert_eq!(kept.moe.map(|m| m.layer_freq), Some(2));
        assert_eq!(kept.parameter_shapes(), c.parameter_shapes());
        // And its pre-softmax routing, which no export writes either.
        let pre = LlamaConfig::from_megatron(
            &MegatronModelArgs {
                moe_layer_freq: 1,
                moe_router_pre_softmax: true,
                ..args.clone()
            },
            1000,
        )
        .unwrap();
        let e = pre.check_hf_exportable().unwrap_err().to_string();
        assert!(e.contains("--moe-router-pre-softmax"), "{e}");
        let kept = LlamaConfig::from_hf_json(&pre.to_hf_json(), "state.json").unwrap();
        assert_eq!(kept.moe.map(|m| m.router_pre_softmax), Some(true));
        let every = LlamaConfig::from_megatron(
            &MegatronModelArgs {
                moe_layer_freq: 1,
                ..args.clone()
            },
            1000,
        )
        .unwrap();
        every.check_hf_exportable().unwrap();
        let back = LlamaConfig::from_hf_json(&every.to_hf_json(), "c").unwrap();
        assert_eq!(
            back.moe.map(|m| (m.ffn_hidden_size, m.aux_loss_coeff)),
            Some((32, 0.01))
        );
        // Megatron's experts have biases unless --disable-bias-linear: kept by a
        // checkpoint's config, refused by an export (a Mixtral's have none).
        let biased = LlamaConfig::from_megatron(
            &MegatronModelArgs {
                moe_layer_freq: 1,
                add_bias_linear: true,
                ..args.clone()
            },
            1000,
        )
        .unwrap();
        let e = biased.check_hf_exportable().unwrap_err().to_string();
        assert!(e.contains("--disable-bias-linear"), "{e}");
        let kept = LlamaConfig::from_hf_json(&biased.to_hf_json(), "state.json").unwrap();
        assert_eq!(kept.parameter_shapes(), biased.parameter_shapes());
        let shapes = biased.parameter_shapes();
        let shape_of = |n: &str| {
            shapes
                .iter()
                .find(|(name, _)| name == n)
                .map(|s| s.1.clone())
        };
        let expert = "model.layers.1.block_sparse_moe.experts.7";
        assert_eq!(shape_of(&format!("{expert}.w1.bias")), Some(vec![32]));
        assert_eq!(shape_of(&format!("{expert}.w2.bias")), Some(vec![64]));
        let count: i64 = shapes.iter().map(|(_, s)| s.iter().product::<i64>()).sum();
        assert_eq!(count as usize, biased.num_parameters());
        let bad = MegatronModelArgs {
            moe_router_topk: 9,
            ..args
        };
        let e = LlamaConfig::from_megatron(&bad, 1000)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--moe-router-topk") && e.contains("9 experts per token"),
            "{e}"
        );
    }
}
