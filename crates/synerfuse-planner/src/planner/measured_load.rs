//! The routing a run measured, fed back to the planner: the tokens each expert took per
//! MoE layer, summed over the iteration records of a `synerfuse train --log-json` log.

use synerfuse_plan::ModelShape;

/// A log that does not give a model's tokens per expert.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MeasuredLoadError {
    /// The model has no experts.
    #[error("the model is dense: it has no experts to place")]
    Dense,
    /// A line that is not JSON.
    #[error("line {line}: not a JSON record: {problem}")]
    NotJson {
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        problem: String,
    },
    /// A record whose `moe` is not the model's (another model's run).
    #[error(
        "line {line}: its moe record has {found}, the model {expected}: a run of another model"
    )]
    OtherModel {
        /// 1-based line number.
        line: usize,
        /// What the record has.
        found: String,
        /// What the model has.
        expected: String,
    },
    /// A token count that is negative or not a number.
    #[error("line {line}: tokens per expert must be non-negative numbers")]
    BadCount {
        /// 1-based line number.
        line: usize,
    },
    /// No iteration record carries tokens per expert.
    #[error("no iteration record has tokens per expert (moe.tokens_per_expert): not a log of a mixture of experts' run")]
    Nothing,
}

#[derive(serde::Deserialize)]
struct Record {
    moe: Option<Moe>,
}

#[derive(serde::Deserialize)]
struct Moe {
    layers: Vec<usize>,
    tokens_per_expert: Vec<Vec<f64>>,
}

/// Per MoE layer of `model` (in layer order), the tokens each expert took over every
/// iteration record of the JSON-lines log `text`.
pub fn measured_expert_load(
    text: &str,
    model: &ModelShape,
) -> Result<Vec<Vec<f64>>, MeasuredLoadError> {
    let e = model.experts.ok_or(MeasuredLoadError::Dense)?;
    let layers: Vec<usize> = (0..model.num_layers)
        .filter(|l| l % e.layer_freq.max(1) == 0)
        .collect();
    let mut sums = vec![vec![0.0; e.num_experts]; layers.len()];
    let mut found = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: Record =
            serde_json::from_str(line).map_err(|err| MeasuredLoadError::NotJson {
                line: i + 1,
                problem: err.to_string(),
            })?;
        let Some(moe) = record.moe else {
            continue;
        };
        let widths = moe
            .tokens_per_expert
            .iter()
            .all(|r| r.len() == e.num_experts);
        if moe.layers != layers || moe.tokens_per_expert.len() != layers.len() || !widths {
            let width = moe.tokens_per_expert.first().map_or(0, Vec::len);
            return Err(MeasuredLoadError::OtherModel {
                line: i + 1,
                found: format!("MoE layers {:?} of {width} experts", moe.layers),
                expected: format!("MoE layers {layers:?} of {} experts", e.num_experts),
            });
        }
        let counts = moe.tokens_per_expert.iter().flatten();
        if counts.clone().any(|x| !(*x >= 0.0 && x.is_finite())) {
            return Err(MeasuredLoadError::BadCount { line: i + 1 });
        }
        for (sum, row) in sums.iter_mut().zip(&moe.tokens_per_expert) {
            for (s, x) in sum.iter_mut().zip(row) {
                *s += x;
            }
        }
        found = true;
    }
    match found {
        true => Ok(sums),
        false => Err(MeasuredLoadError::Nothing),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use synerfuse_plan::ExpertShape;

    fn model(layer_freq: usize) -> ModelShape {
        ModelShape {
            num_layers: 4,
            hidden_size: 64,
            num_heads: 4,
            num_kv_heads: 4,
            ffn_hidden_size: 128,
            vocab_size: 256,
            seq_length: 32,
            tied: false,
            experts: Some(ExpertShape {
                num_experts: 3,
                top_k: 2,
                ffn_hidden_size: 64,
                layer_freq,
            }),
        }
    }

    #[test]
    fn iteration_records_sum_and_others_are_skipped_or_named() {
        let log = r#"{"iteration": 1, "lm_loss": 5.0, "moe": {"layers": [0, 2], "load_balancing_loss": [1.0, 1.1], "tokens_per_expert": [[4, 2, 0], [1, 1, 4]]}}
{"iteration": 1, "evaluation": true, "lm_loss": 5.1}

{"iteration": 2, "moe": {"layers": [0, 2], "load_balancing_loss": [1.0, 1.0], "tokens_per_expert": [[2, 2, 2], [0, 3, 3]]}}
"#;
        let load = measured_expert_load(log, &model(2)).unwrap();
        assert_eq!(load, [[6.0, 4.0, 2.0], [1.0, 4.0, 7.0]]);
        assert!(matches!(
            measured_expert_load(log, &model(1)),
            Err(MeasuredLoadError::OtherModel { line: 1, .. })
        ));
        let dense = ModelShape {
            experts: None,
            ..model(1)
        };
        assert_eq!(
            measured_expert_load(log, &dense),
            Err(MeasuredLoadError::Dense)
        );
        assert_eq!(
            measured_expert_load("{\"iteration\": 1}\n", &model(2)),
            Err(MeasuredLoadError::Nothing)
        );
        assert!(matches!(
            measured_expert_load("{\"iteration\": 1}\n{\"moe\": [", &model(2)),
            Err(MeasuredLoadError::NotJson { line: 2, .. })
        ));
        let negative = log.replacen("[4, 2, 0]", "[4, -2, 0]", 1);
        assert_eq!(
            measured_expert_load(&negative, &model(2)),
            Err(MeasuredLoadError::BadCount { line: 1 })
        );
    }
}
