//! How a step's tokens spread over the experts: each rank sums its MoE layers' load
//! balance over its micro-batches, the step's all-gather adds the ranks up, and rank 0
//! logs Megatron's `load_balancing_loss` (and `z_loss` when trained) and the tokens
//! each expert took.

use synerfuse_model::tch::{Device, Kind, Tensor};
use synerfuse_model::{LayerBalance, LlamaConfig};

/// The load balance of the MoE layers this rank runs, summed over the step's micro-
/// batches: per global layer, `[loss, z-loss, tokens of expert 0, ...]` (the load-
/// balancing loss and the router z-loss without their coefficients summed over
/// sequences, and the tokens that picked each expert), in fp64 on the stage's device:
/// summed there, read back once per step.
#[derive(Debug, Default)]
pub struct ExpertLoad {
    layers: std::collections::BTreeMap<usize, Tensor>,
}

impl Clone for ExpertLoad {
    fn clone(&self) -> Self {
        let layers = (self.layers.iter()).map(|(&l, t)| (l, t.copy())).collect();
        ExpertLoad { layers }
    }
}

impl ExpertLoad {
    /// Adds one micro-batch's forward through a stage (no read-back: no device sync).
    pub fn add(&mut self, balance: &[LayerBalance]) {
        for layer in balance {
            let cells = Tensor::cat(
                &[
                    layer.loss.to_kind(Kind::Double).reshape([1]),
                    layer.z_loss.to_kind(Kind::Double).reshape([1]),
                    layer.tokens_per_expert.to_kind(Kind::Double),
                ],
                0,
            );
            let sum = match self.layers.remove(&layer.layer) {
                Some(sum) => sum + cells,
                None => cells,
            };
            self.layers.insert(layer.layer, sum);
        }
    }

    /// The model's MoE layers in order, each as `[loss, z-loss, tokens of expert 0, ...]`
    /// (zeros for layers this rank does not run): a row of the same length on every
    /// rank, whose sum over the ranks is the step's.
    pub fn row(&self, model: &LlamaConfig) -> Vec<f64> {
        let Some(moe) = model.moe else {
            return Vec::new();
        };
        let width = LOSSES + moe.num_experts;
        (0..model.num_layers)
            .filter(|&l| moe.has_experts(l))
            .flat_map(|l| {
                let mut cells = vec![0.0; width];
                if let Some(sum) = self.layers.get(&l) {
                    let sum = Vec::<f64>::try_from(sum.to_device(Device::Cpu)).unwrap_or_default();
                    for (cell, n) in cells.iter_mut().zip(sum) {
                        *cell = n;
                    }
                }
                cells
            })
            .collect()
    }
}

/// The losses before the tokens per expert in a layer's row.
const LOSSES: usize = 2;

/// A step's load balance over the whole model (every rank's rows summed).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ExpertStep {
    /// The MoE layers (global indices).
    pub layers: Vec<usize>,
    /// Each layer's load-balancing loss without its coefficient, as a mean over the
    /// step's sequences (Megatron's `load_balancing_loss` per layer); none under
    /// `--moe-router-load-balancing-type none`, as Megatron tracks none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_balancing_loss: Option<Vec<f64>>,
    /// Each layer's router z-loss without its coefficient, as a mean over the step's
    /// sequences (Megatron's `z_loss` per layer); only where it is trained
    /// (`--moe-z-loss-coeff` above 0), as Megatron tracks it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub z_loss: Option<Vec<f64>>,
    /// Each layer's tokens per expert over the step.
    pub tokens_per_expert: Vec<Vec<f64>>,
}

impl ExpertStep {
    /// From the sum over ranks of [`ExpertLoad::row`] and the step's sequences.
    pub fn from_sums(model: &LlamaConfig, sums: &[f64], sequences: f64) -> Option<Self> {
        let moe = model.moe?;
        let layers: Vec<usize> = (0..model.num_layers)
            .filter(|&l| moe.has_experts(l))
            .collect();
        let rows: Vec<&[f64]> = sums.chunks(LOSSES + moe.num_experts).collect();
        if rows.len() != layers.len() {
            return None;
        }
        let mean = |at: usize| rows.iter().map(|r| r[at] / sequences.max(1.0)).collect();
        Some(ExpertStep {
            load_balancing_loss: moe.balances_load().then(|| mean(0)),
            z_loss: moe.trains_z_loss().then(|| mean(1)),
            tokens_per_expert: rows.iter().map(|r| r[LOSSES..].to_vec()).collect(),
            layers,
        })
    }

    /// The mean over the MoE layers of their load-balancing loss (the log line's),
    /// where it is taken.
    pub fn mean_loss(&self) -> Option<f64> {
        self.load_balancing_loss.as_deref().map(mean_over_layers)
    }

    /// The mean over the MoE layers of their z-loss, where it is trained.
    pub fn mean_z_loss(&self) -> Option<f64> {
        self.z_loss.as_deref().map(mean_over_layers)
    }

    /// TensorBoard's scalars, Megatron's names: `z_loss` and `load_balancing_loss`
    /// (their means) where taken, and with `per_layer` each layer's
    /// (`moe/z_loss_layer_{i}`, `moe/load_balancing_loss_layer_{i}`) and its tokens per
    /// expert (`moe/tokens_per_expert_layer_{i}_expert_{e}`).
    pub fn scalars(&self, per_layer: bool) -> Vec<(String, f64)> {
        let losses = [
            ("z_loss", &self.z_loss),
            ("load_balancing_loss", &self.load_balancing_loss),
        ];
        let mut scalars = Vec::new();
        for (name, values) in losses {
            let Some(values) = values else { continue };
            scalars.push((name.to_owned(), mean_over_layers(values)));
            if per_layer {
                let layers = self.layers.iter().zip(values);
                scalars.extend(layers.map(|(l, v)| (format!("moe/{name}_layer_{l}"), *v)));
            }
        }
        if per_layer {
            for (layer, tokens) in self.layers.iter().zip(&self.tokens_per_expert) {
                scalars.extend(tokens.iter().enumerate().map(|(e, n)| {
                    (
                        format!("moe/tokens_per_expert_layer_{layer}_expert_{e}"),
                        *n,
                    )
                }));
            }
        }
        scalars
    }
}

/// The mean of one value per MoE layer.
fn mean_over_layers(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use synerfuse_model::tch::Tensor;
    use synerfuse_model::MoeConfig;

    #[test]
    fn rows_of_ranks_sum_to_the_step() {
        let mut model = small_config();
        model.moe = Some(MoeConfig {
            layer_freq: 2,
            z_loss_coeff: 1e-3,
            ..MoeConfig::every_layer(3, 1, 8)
        });
        let balance = |layer, loss: f64, tokens: &[f64]| LayerBalance {
            layer,
            loss: Tensor::from(loss),
            z_loss: Tensor::from(4.0 * loss),
            tokens_per_expert: Tensor::from_slice(tokens),
        };
        let (mut first, mut second) = (ExpertLoad::default(), ExpertLoad::default());
        first.add(&[balance(0, 0.5, &[1.0, 2.0, 3.0])]);
        first.add(&[balance(0, 0.25, &[3.0, 2.0, 1.0])]);
        second.add(&[balance(2, 1.0, &[0.0, 6.0, 0.0])]);
        let (a, b) = (first.row(&model), second.row(&model));
        assert_eq!(a.len(), 10, "layers 0 and 2, two losses and 3 experts each");
        let sums: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let step = ExpertStep::from_sums(&model, &sums, 4.0).unwrap();
        assert_eq!(step.layers, [0, 2]);
        assert_eq!(
            step.load_balancing_loss.as_deref(),
            Some(&[0.1875, 0.25][..])
        );
        assert_eq!(step.tokens_per_expert, [[4.0, 4.0, 4.0], [0.0, 6.0, 0.0]]);
        assert_eq!(step.mean_loss(), Some(0.21875));
        assert_eq!(step.z_loss.as_deref(), Some(&[0.75, 1.0][..]));
        assert_eq!(step.mean_z_loss(), Some(0.875));
        let names: Vec<String> = step.scalars(true).into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names[..6],
            [
                "z_loss",
                "moe/z_loss_layer_0",
                "moe/z_loss_layer_2",
                "load_balancing_loss",
                "moe/load_balancing_loss_layer_0",
                "moe/load_balancing_loss_layer_2"
            ]
        );
        // Megatron tracks neither loss where it is not taken.
        let moe = model.moe.as_mut().unwrap();
        moe.z_loss_coeff = 0.0;
        moe.load_balancing = synerfuse_model::LoadBalancing::None;
        let untrained = ExpertStep::from_sums(&model, &sums, 4.0).unwrap();
        assert_eq!(
            (untrained.mean_z_loss(), untrained.mean_loss()),
            (None, None)
        );
        let names: Vec<String> = untrained
            .scalars(true)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names[0], "moe/tokens_per_expert_layer_0_expert_0");
    }

    fn small_config() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 16,
            hidden_size: 8,
            intermediate_size: 8,
            num_layers: 4,
            num_heads: 2,
            num_kv_heads: 2,
            head_dim: 4,
            max_position_embeddings: 8,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            attention_bias: false,
            mlp_bias: false,
            init_std: 0.02,
            moe: None,
        }
    }
}
