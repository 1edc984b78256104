//! The pipeline `Stage`: a contiguous range of LLaMA decoder layers (`decoder`), plus
//! the embedding on the first stage and the final norm and head on the last.
//!
//! Numerics follow transformers' `LlamaForCausalLM`: RMSNorm in fp32 then cast back,
//! rotary tables in fp32, attention through libtorch's scaled_dot_product_attention,
//! SwiGLU, logits upcast to fp32 for the loss. Parameters carry transformers' names with
//! *global* layer indices (`model.layers.17.mlp.up_proj.weight`), so a stage's tensors
//! mean the same thing whatever the layout, and checkpoints move between layouts.

use crate::collectives::{OpenGate, PieceGate};
use crate::config::LlamaConfig;
use crate::cp::ContextGroup;
use crate::decoder::{DecoderLayer, KvCache};
use crate::error::StageError;
use crate::loss::StageHead;
use crate::moe::{LayerBalance, Routing};
use crate::norm::rms_norm;
use crate::pass::{ForwardPass, SavedInputs};
use std::ops::Range;
use synerfuse_plan::TpShard;
use tch::{nn, Device, Kind, Tensor};

/// `cos` and `sin` tables `[batch, 1, seq, head_dim]` for `position_ids` `[batch, seq]`.
fn rotary_tables(inv_freq: &Tensor, position_ids: &Tensor, kind: Kind) -> (Tensor, Tensor) {
    let freqs = position_ids.to_kind(Kind::Float).unsqueeze(-1) * inv_freq.view([1, 1, -1]);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (
        emb.cos().to_kind(kind).unsqueeze(1),
        emb.sin().to_kind(kind).unsqueeze(1),
    )
}

/// Whether parameter `name` is an MoE layer's router.
fn is_router(name: &str) -> bool {
    name.ends_with("block_sparse_moe.gate.weight")
}

/// A contiguous range of decoder layers, plus the embedding on the first stage and the
/// final norm and LM head on the last.
pub struct Stage {
    config: LlamaConfig,
    layers: Range<usize>,
    vs: nn::VarStore,
    embedding: Option<Tensor>,
    decoder: Vec<DecoderLayer>,
    norm: Option<Tensor>,
    head: Option<Tensor>,
    inv_freq: Tensor,
    recompute: bool,
    /// Megatron's sequence parallelism under tensor parallelism: norms and residuals on
    /// each rank's sequence rows.
    sequence_parallel: bool,
    /// Under sequence parallelism: whether the input gradient and the output leave as
    /// this rank's sequence rows (to a neighbour of equal tensor-parallel size) rather
    /// than whole (see [`Stage::set_sequence_rows_io`]).
    sequence_rows_io: (bool, bool),
    /// What this rank holds of the stage's tensors (the whole stage without tensor
    /// parallelism).
    shard: TpShard,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("layers", &self.layers)
            .field("first", &self.is_first())
            .field("last", &self.is_last())
            .field("device", &self.vs.device())
            .finish()
    }
}

impl Stage {
    /// A stage holding global layers `layers`, randomly initialised as Megatron does
    /// (normal with `init_std`, output projections scaled by 1/sqrt(2·layers), norms 1).
    /// The first stage (layers start at 0) holds the embedding; the last the norm and head.
    pub fn new(
        config: &LlamaConfig,
        layers: Range<usize>,
        device: Device,
    ) -> Result<Stage, StageError> {
        let mut whole = TpShard::whole(
            config.num_kv_heads,
            config.intermediate_size,
            config.vocab_size,
        );
        if let Some(moe) = config.moe {
            whole.expert_columns = 0..moe.ffn_hidden_size;
        }
        Self::new_sharded(config, layers, whole, device)
    }

    /// One tensor-parallel rank's part of the stage: its query groups' heads, FFN columns
    /// and vocabulary rows (Megatron's column- and row-parallel split); norms whole on
    /// every rank, the row-parallel output biases on shard 0. Parameters keep their global
    /// names; [`Stage::shard_of`] says which slice of the whole tensor each holds.
    pub fn new_sharded(
        config: &LlamaConfig,
        layers: Range<usize>,
        shard: TpShard,
        device: Device,
    ) -> Result<Stage, StageError> {
        if layers.start >= layers.end || layers.end > config.num_layers {
            return Err(StageError::BadRange {
                start: layers.start,
                end: layers.end,
                num_layers: config.num_layers,
            });
        }
        let fits = |r: &Range<usize>, n: usize| r.start < r.end && r.end <= n;
        if !(fits(&shard.query_groups, config.num_kv_heads)
            && fits(&shard.ffn_columns, config.intermediate_size)
            && config
                .moe
                .is_none_or(|m| fits(&shard.expert_columns, m.ffn_hidden_size))
            && fits(&shard.vocab_rows, config.vocab_size))
            || config.num_kv_heads == 0
            || config.num_heads % config.num_kv_heads != 0
        {
            return Err(StageError::BadShard { shard });
        }
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let (first, last) = (layers.start == 0, layers.end == config.num_layers);
        let (v, h) = (shard.vocab_rows.len() as i64, config.hidden_size as i64);
        let std = config.init_std;
        // With tied weights the last stage keeps its own copy of the embedding under the
        // same name (Megatron's embedding group keeps the copies in sync).
        let embedding = (first || (last && config.tie_word_embeddings)).then(|| {
            (&root / "model" / "embed_tokens").var(
                "weight",
                &[v, h],
                nn::Init::Randn {
                    mean: 0.0,
                    stdev: std,
                },
            )
        });
        let decoder = (layers.clone())
            .map(|i| {
                let mut layer = DecoderLayer::new(&root, i, config, &shard);
                layer.lay_weights_end_to_end();
                layer
            })
            .collect();
        let norm =
            last.then(|| (&root / "model" / "norm").var("weight", &[h], nn::Init::Const(1.0)));
        let head = last.then(|| {
            if config.tie_word_embeddings {
                embedding
                    .as_ref()
                    .expect("tied last stage holds the embedding")
                    .shallow_clone()
            } else {
                (&root / "lm_head").var(
                    "weight",
                    &[v, h],
                    nn::Init::Randn {
                        mean: 0.0,
                        stdev: std,
                    },
                )
            }
        });
        let hd = config.head_dim as i64;
        let inv_freq = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            .divide_scalar(hd as f64);
        // transformers: 1 / base ** (arange(0, d, 2) / d), all in fp32.
        let inv_freq = Tensor::pow_scalar(config.rope_theta, &inv_freq).reciprocal();
        Ok(Stage {
            config: config.clone(),
            layers,
            vs,
            embedding: embedding.filter(|_| first),
            decoder,
            norm,
            head,
            inv_freq,
            recompute: false,
            sequence_parallel: false,
            sequence_rows_io: (false, false),
            shard,
        })
    }

    /// This rank's part of the stage.
    pub fn shard(&self) -> &TpShard {
        &self.shard
    }

    /// Which slice of the whole tensor `name` this shard holds, as (dimension, range),
    /// or `None` for a tensor held whole (norms, and everything without tensor
    /// parallelism). Checkpoints and weight loading cut and join shards by it.
    pub fn shard_of(&self, name: &str) -> Option<(usize, Range<i64>)> {
        if self.shard.is_whole() {
            return None;
        }
        let c = &self.config;
        let hd = c.head_dim;
        let per_group = c.num_heads / c.num_kv_heads;
        let scaled = |r: &Range<usize>, k: usize| (r.start * k) as i64..(r.end * k) as i64;
        let groups = &self.shard.query_groups;
        let rows = |r: Range<i64>| Some((0, r));
        let columns = |r: Range<i64>| Some((1, r));
        let leaf = name.rsplit('.').nth(1).unwrap_or("");
        let weight = name.ends_with(".weight");
        match leaf {
            "q_proj" => rows(scaled(groups, per_group * hd)),
            "k_proj" | "v_proj" => rows(scaled(groups, hd)),
            "o_proj" if weight => columns(scaled(groups, per_group * hd)),
            "gate_proj" | "up_proj" => rows(scaled(&self.shard.ffn_columns, 1)),
            "down_proj" if weight => columns(scaled(&self.shard.ffn_columns, 1)),
            "w1" | "w3" => rows(scaled(&self.shard.expert_columns, 1)),
            "w2" if weight => columns(scaled(&self.shard.expert_columns, 1)),
            "embed_tokens" | "lm_head" => rows(scaled(&self.shard.vocab_rows, 1)),
            _ => None,
        }
    }

    /// This shard's slice of `whole`, the whole tensor of parameter `name` (itself for a
    /// tensor held whole): how checkpoints and Hugging Face weights fill a shard.
    pub fn local_slice(&self, name: &str, whole: &Tensor) -> Tensor {
        match self.shard_of(name) {
            Some((dim, r)) => whole.narrow(dim as i64, r.start, r.end - r.start),
            None => whole.shallow_clone(),
        }
    }

    /// Whether this rank's `name` is the group's only copy or its own slice: false for a
    /// tensor every rank of the group holds whole (the norms) on ranks other than 0, so
    /// norms and checkpoints count each value once.
    pub fn holds_unique(&self, name: &str) -> bool {
        self.shard.rank == 0 || self.shard_of(name).is_some()
    }

    /// Whether each rank of the group holds only a partial gradient of `name`, to be
    /// summed over the group once per step: the norms, held whole on every rank but
    /// reached only through the rank's own heads, columns or vocabulary rows, and an MoE
    /// layer's router (whole on every rank, its weights scaling the rank's partial
    /// expert outputs).
    pub fn grad_summed_over_group(&self, name: &str) -> bool {
        !self.shard.is_whole() && (name.ends_with("norm.weight") || is_router(name))
    }

    /// Every parameter of the stage with its whole shape, by name: what the ranks of its
    /// tensor-parallel group hold between them (the row-parallel output biases too,
    /// which only shard 0 holds). Ranks that split the stage differently agree on it, so
    /// a gradient reduction across splits lays its whole tensors out by it.
    pub fn whole_parameters(&self) -> std::collections::BTreeMap<String, Vec<i64>> {
        let mut whole: std::collections::BTreeMap<String, Vec<i64>> = (self.vs.variables())
            .into_iter()
            .map(|(name, t)| {
                let shape = self.whole_shape(&name, &t.size());
                (name, shape)
            })
            .collect();
        let (c, h) = (&self.config, self.config.hidden_size as i64);
        for i in self.layers.clone() {
            let layer = format!("model.layers.{i}");
            if c.attention_bias {
                whole.insert(format!("{layer}.self_attn.o_proj.bias"), vec![h]);
            }
            match c.moe.filter(|m| m.has_experts(i)) {
                _ if !c.mlp_bias => {}
                None => {
                    whole.insert(format!("{layer}.mlp.down_proj.bias"), vec![h]);
                }
                Some(moe) => {
                    let all: Vec<usize> = (0..moe.num_experts).collect();
                    for e in self.shard.experts.as_deref().unwrap_or(&all) {
                        let name = format!("{layer}.block_sparse_moe.experts.{e}.w2.bias");
                        whole.insert(name, vec![h]);
                    }
                }
            }
        }
        whole
    }

    /// The whole tensor's shape of parameter `name` held as `local` shape.
    pub fn whole_shape(&self, name: &str, local: &[i64]) -> Vec<i64> {
        let c = &self.config;
        let mut shape = local.to_vec();
        if let Some((dim, _)) = self.shard_of(name) {
            let leaf = name.rsplit('.').nth(1).unwrap_or("");
            shape[dim] = match leaf {
                "q_proj" | "o_proj" => (c.num_heads * c.head_dim) as i64,
                "k_proj" | "v_proj" => (c.num_kv_heads * c.head_dim) as i64,
                "gate_proj" | "up_proj" | "down_proj" => c.intermediate_size as i64,
                "w1" | "w2" | "w3" => c.moe.map_or(0, |m| m.ffn_hidden_size) as i64,
                _ => c.vocab_size as i64,
            };
        }
        shape
    }

    /// Re-draws every parameter from its own generator, seeded by `seed` and the
    /// parameter's global name, with Megatron's init (normal with `init_std`, output
    /// projections scaled by 1/sqrt(2·layers), norms 1, biases 0). The values then do not
    /// depend on how layers are split into stages or on the device, so every pipeline
    /// layout starts from the same model (and a tied head's copy equals the embedding);
    /// a tensor-parallel shard takes its slice of the whole tensor. It reseeds libtorch's
    /// global generator, so stages of one process are initialised one at a time.
    pub fn init_by_name(&mut self, seed: u64) {
        let std = self.config.init_std;
        let out_std = std / (2.0 * self.config.num_layers as f64).sqrt();
        for (name, mut var) in self.vs.variables() {
            let size = self.whole_shape(&name, &var.size());
            let value = if name.ends_with("norm.weight") {
                Tensor::ones(size, (Kind::Float, Device::Cpu))
            } else if name.ends_with(".bias") {
                Tensor::zeros(size, (Kind::Float, Device::Cpu))
            } else {
                let output = ["o_proj.weight", "down_proj.weight", ".w2.weight"];
                let scale = if output.iter().any(|o| name.ends_with(o)) {
                    out_std
                } else {
                    std
                };
                tch::manual_seed(name_seed(seed, &name));
                Tensor::randn(size, (Kind::Float, Device::Cpu)) * scale
            };
            // A shard takes its slice of the whole tensor drawn by name.
            let value = self.local_slice(&name, &value);
            tch::no_grad(|| var.copy_(&value.to_kind(var.kind()).to_device(var.device())));
        }
    }

    /// The model configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Global indices of the decoder layers held.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Holds the embedding (takes token ids).
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// Holds the norm and head (produces logits).
    pub fn is_last(&self) -> bool {
        self.layers.end == self.config.num_layers
    }

    /// The parameters, by global transformers name.
    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Casts the parameters (fp32 master weights stay the caller's business), laying the
    /// weights that share a GEMM end to end again (a cast gives each its own storage).
    pub fn set_kind(&mut self, kind: Kind) {
        self.vs.set_kind(kind);
        self.decoder
            .iter_mut()
            .for_each(|l| l.lay_weights_end_to_end());
    }

    /// Whether the weights that share a GEMM (q, k, v; a dense MLP's gate and up) lie
    /// end to end in one buffer, so their projections read them without a copy: true
    /// unless something replaced a parameter's storage after the stage was built or cast.
    pub fn weights_end_to_end(&self) -> bool {
        self.decoder.iter().all(|l| l.weights_end_to_end())
    }

    /// Full activation recomputation: `forward_train` keeps only the stage input and
    /// `backward` runs the forward again (less memory, one more forward).
    pub fn set_recompute(&mut self, recompute: bool) {
        self.recompute = recompute;
    }

    /// Megatron's sequence parallelism for a tensor-parallel shard: between its
    /// collectives the residual stream, the norms and the stage's input and output
    /// gradients are held as each rank's rows of the sequence (an all-gather before and a
    /// reduce-scatter after every parallel region instead of one all-reduce).
    pub fn set_sequence_parallel(&mut self, sequence_parallel: bool) {
        self.sequence_parallel = sequence_parallel;
    }

    pub(crate) fn recomputes(&self) -> bool {
        self.recompute
    }

    pub(crate) fn sequence_parallel(&self) -> bool {
        self.sequence_parallel && !self.shard.is_whole()
    }

    /// Under sequence parallelism a stage's input and its output's gradient arrive as
    /// this rank's rows of the sequence (each receiver gets what it owns); what it sends
    /// stays rows when the neighbour's tensor-parallel group has the stage's own size
    /// (`previous` for the input gradient, `next` for the output, as Megatron passes
    /// them), and is gathered whole otherwise, for the sender to cut into each
    /// receiver's rows.
    pub fn set_sequence_rows_io(&mut self, previous: bool, next: bool) {
        self.sequence_rows_io = (previous, next);
    }

    /// Whether the stage input arrives as this rank's sequence rows.
    pub fn takes_sequence_rows(&self) -> bool {
        self.sequence_parallel() && !self.is_first()
    }

    /// Whether the gradient of the stage output arrives as this rank's sequence rows.
    pub fn takes_output_grad_rows(&self) -> bool {
        self.sequence_parallel() && !self.is_last()
    }

    /// Whether the stage output leaves as this rank's sequence rows (else whole).
    pub fn gives_sequence_rows(&self) -> bool {
        self.sequence_parallel() && !self.is_last() && self.sequence_rows_io.1
    }

    /// Whether the gradient of the stage input leaves as this rank's sequence rows
    /// (else whole).
    pub fn gives_input_grad_rows(&self) -> bool {
        self.sequence_parallel() && !self.is_first() && self.sequence_rows_io.0
    }

    /// The stage's computation: token ids `[b, s]` (first stage) or hidden states
    /// `[b, s, hidden]` in, hidden states (or fp32-upcastable logits `[b, s, vocab]` on the
    /// last stage) out. `position_ids` `[b, s]` default to `0..s`; `attention_mask`
    /// `[b, 1, s, s]` bool, true = masked (the data loader's), defaults to causal.
    pub fn forward(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor, StageError> {
        Ok(self.forward_logits(input, position_ids, attention_mask)?.0)
    }

    /// [`Self::forward_inner`] to the logits, without a cache or a gate.
    fn forward_logits(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<Routing>), StageError> {
        let (mask, gate) = (attention_mask, &OpenGate);
        self.forward_inner(input, position_ids, mask, None, gate, StageHead::Logits)
    }

    /// [`Stage::forward`], and the router logits `[tokens, experts]` of each of the
    /// stage's MoE layers in order (none for a dense model): what the load-balancing
    /// loss ([`crate::load_balancing_loss`]) and the tokens per expert are computed from.
    pub fn forward_with_router_logits(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<Tensor>), StageError> {
        let (output, routings) = self.forward_logits(input, position_ids, attention_mask)?;
        Ok((output, routings.into_iter().map(|r| r.logits).collect()))
    }

    /// [`Stage::forward`] with a key/value cache: positions continue after the cached
    /// ones, and only the new tokens are computed.
    pub fn forward_cached(
        &self,
        input: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor, StageError> {
        let s = input.size()[1];
        let start = cache.len() as i64;
        let b = input.size()[0];
        let positions = Tensor::arange_start(start, start + s, (Kind::Int64, self.device()))
            .unsqueeze(0)
            .expand([b, s], false);
        Ok(self
            .forward_inner(
                input,
                Some(&positions),
                None,
                Some(cache),
                &OpenGate,
                StageHead::Logits,
            )?
            .0)
    }

    pub(crate) fn forward_inner(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        mut cache: Option<&mut KvCache>,
        gate: &dyn PieceGate,
        ends_with: StageHead,
    ) -> Result<(Tensor, Vec<Routing>), StageError> {
        if !self.shard.is_whole() {
            return Err(StageError::Sharded);
        }
        self.check_experts_held()?;
        let mut x = match &self.embedding {
            Some(embedding) => {
                self.check_tokens(input)?;
                self.await_piece(gate, 0)?;
                Tensor::embedding(embedding, input, -1, false, false)
            }
            None => {
                self.check_hidden(input)?;
                input.shallow_clone()
            }
        };
        let (cos, sin) = self.rotary(&x, position_ids);
        let mut routings = Vec::new();
        for (layer, index) in self.decoder.iter().zip(self.layers()) {
            self.await_piece(gate, index + 1)?;
            x = layer.forward(
                &x,
                &self.config,
                (&cos, &sin),
                attention_mask,
                cache.as_deref_mut(),
                &mut routings,
            );
        }
        if let (Some(norm), Some(head)) = (&self.norm, &self.head) {
            self.await_piece(gate, self.head_piece())?;
            let h = rms_norm(&x, norm, self.config.rms_norm_eps);
            x = match ends_with {
                StageHead::Logits => h.linear::<Tensor>(head, None),
                StageHead::WithLoss => h,
            };
        }
        Ok((x, routings))
    }

    /// Refuses a stage holding only some experts of its MoE layers (which runs with
    /// its expert-parallel group).
    pub(crate) fn check_experts_held(&self) -> Result<(), StageError> {
        let moe = self
            .config
            .moe
            .filter(|m| self.layers.clone().any(|l| m.has_experts(l)));
        match (&self.shard.experts, moe) {
            (Some(held), Some(moe)) if held.len() < moe.num_experts => {
                Err(StageError::ExpertsElsewhere { held: held.clone() })
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn check_tokens(&self, input: &Tensor) -> Result<(), StageError> {
        if input.dim() != 2 || !matches!(input.kind(), Kind::Int64 | Kind::Int) {
            return Err(StageError::NotTokenIds {
                shape: input.size(),
                kind: input.kind(),
            });
        }
        Ok(())
    }

    pub(crate) fn check_hidden(&self, input: &Tensor) -> Result<(), StageError> {
        if input.dim() != 3 || input.size()[2] != self.config.hidden_size as i64 {
            return Err(StageError::NotHiddenStates {
                layers: self.layers.clone(),
                hidden_size: self.config.hidden_size,
                shape: input.size(),
            });
        }
        Ok(())
    }

    /// Rotary `cos`/`sin` tables for hidden states `x` at `position_ids` (default `0..s`).
    pub(crate) fn rotary(&self, x: &Tensor, position_ids: Option<&Tensor>) -> (Tensor, Tensor) {
        let (b, s) = (x.size()[0], x.size()[1]);
        match position_ids {
            Some(p) => rotary_tables(&self.inv_freq, p, x.kind()),
            None => {
                let positions = Tensor::arange(s, (Kind::Int64, x.device()))
                    .unsqueeze(0)
                    .expand([b, s], false);
                rotary_tables(&self.inv_freq, &positions, x.kind())
            }
        }
    }

    pub(crate) fn decoder_layers(&self) -> &[DecoderLayer] {
        &self.decoder
    }

    pub(crate) fn norm_and_head(&self) -> Option<(&Tensor, &Tensor)> {
        self.norm.as_ref().zip(self.head.as_ref())
    }

    pub(crate) fn embedding_weight(&self) -> Option<&Tensor> {
        self.embedding.as_ref()
    }

    /// Masked next-token cross-entropy of last-stage `logits` `[b, s, vocab]` against
    /// `labels` `[b, s]`: (sum of the per-token losses where `loss_mask` is 1, number of
    /// such tokens), both fp32 scalars, so the caller divides by the global count.
    pub fn loss(logits: &Tensor, labels: &Tensor, loss_mask: Option<&Tensor>) -> (Tensor, Tensor) {
        let vocab = logits.size()[2];
        let per_token = logits
            .to_kind(Kind::Float)
            .reshape([-1, vocab])
            .cross_entropy_loss::<Tensor>(
                &labels.reshape([-1]),
                None,
                tch::Reduction::None,
                -100,
                0.0,
            );
        match loss_mask {
            Some(m) => {
                let mask = m.to_kind(Kind::Float).reshape([-1]);
                ((per_token * &mask).sum(Kind::Float), mask.sum(Kind::Float))
            }
            None => {
                let count = Tensor::from(per_token.numel() as f32).to_device(per_token.device());
                (per_token.sum(Kind::Float), count)
            }
        }
    }

    /// Waits on `gate` for model piece `piece`.
    pub(crate) fn await_piece(&self, gate: &dyn PieceGate, piece: usize) -> Result<(), StageError> {
        gate.before_piece(piece)
            .map_err(|source| StageError::ParametersArriving { piece, source })
    }

    /// The model piece of the final norm and output layer.
    pub(crate) fn head_piece(&self) -> usize {
        self.config().num_layers + 1
    }

    /// A training forward's input (a leaf whose gradient goes back to the previous
    /// stage, after the first) and what its backward keeps of its inputs.
    pub(crate) fn training_input(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> (Tensor, SavedInputs) {
        let input = match self.is_first() {
            true => input.shallow_clone(),
            false => input.detach().set_requires_grad(true),
        };
        let saved = SavedInputs {
            input: input.shallow_clone(),
            position_ids: position_ids.map(Tensor::shallow_clone),
            attention_mask: attention_mask.map(Tensor::shallow_clone),
        };
        (input, saved)
    }

    /// A training forward: the output and what the backward needs (the graph, or with
    /// recomputation only the input).
    pub fn forward_train(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<ForwardPass, StageError> {
        self.forward_train_gated(
            input,
            position_ids,
            attention_mask,
            &OpenGate,
            StageHead::Logits,
        )
    }

    /// [`Stage::forward_train`], each piece waiting on `gate` first, a last stage's
    /// ending with what `ends_with` says (the logits under recomputation).
    pub(crate) fn forward_train_gated(
        &self,
        input: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        gate: &dyn PieceGate,
        ends_with: StageHead,
    ) -> Result<ForwardPass, StageError> {
        let (input, saved) = self.training_input(input, position_ids, attention_mask);
        let sequences = input.size()[0];
        let ends_with = self.training_head(ends_with);
        let run = || -> Result<_, StageError> {
            let (output, routings) =
                self.forward_inner(&input, position_ids, attention_mask, None, gate, ends_with)?;
            Ok((output, self.balances(&routings, sequences, None)?))
        };
        let (output, balance) = match self.recompute {
            true => tch::no_grad(run)?,
            false => run()?,
        };
        let mut pass = ForwardPass::new(output.detach(), saved, sequences);
        pass.ends_with = ends_with;
        if !self.recompute {
            pass.graph = Some(output);
            pass.router_loss_graph = self.summed_objectives(&balance);
        }
        pass.balance = balance.into_iter().map(LayerBalance::detached).collect();
        Ok(pass)
    }

    /// What a training forward asked to end with `ends_with` ends with: the logits but on
    /// a last stage that keeps its graph.
    pub(crate) fn training_head(&self, ends_with: StageHead) -> StageHead {
        match self.is_last() && !self.recompute {
            true => ends_with,
            false => StageHead::Logits,
        }
    }

    /// Each MoE layer's load balance over a micro-batch of `sequences` sequences, from
    /// its `routings` (context: see [`Routing::balance`]).
    pub(crate) fn balances(
        &self,
        routings: &[Routing],
        sequences: i64,
        context: Option<&ContextGroup<'_>>,
    ) -> Result<Vec<LayerBalance>, StageError> {
        let Some(moe) = self.config.moe else {
            return Ok(Vec::new());
        };
        (routings.iter())
            .map(|r| r.balance(sequences, &moe, context))
            .collect()
    }

    /// What the layers' `balance` add to the training objective per sequence weight,
    /// summed (none for a dense stage).
    pub(crate) fn summed_objectives(&self, balance: &[LayerBalance]) -> Option<Tensor> {
        let moe = self.config.moe?;
        (balance.iter().map(|b| b.objective(&moe))).reduce(|a, b| a + b)
    }
}

/// A 63-bit seed from a run seed and a parameter name (FNV-1a, stable across builds).
fn name_seed(seed: u64, name: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 1) as i64
}

/// Where a stage's backward starts.
pub enum BackwardFrom<'a> {
    /// The gradient of the stage output, received from the next stage.
    OutputGrad(&'a Tensor),
    /// A scalar loss computed from the output (logits) of the last stage.
    Loss(&'a dyn Fn(&Tensor) -> Tensor),
}
