//! Text generation with a key/value cache: greedy, or top-k sampling with a temperature.

use crate::decoder::KvCache;
use crate::error::StageError;
use crate::llama::Stage;
use tch::{Kind, Tensor};

/// How to pick each next token.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to add.
    pub max_new_tokens: usize,
    /// Sample among the k most likely tokens; 0 or 1 with temperature 0 is greedy.
    pub top_k: usize,
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f64,
    /// Seed of the sampler.
    pub seed: u64,
    /// Stop after emitting this id.
    pub stop_token: Option<i64>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 32,
            top_k: 0,
            temperature: 0.0,
            seed: 1234,
            stop_token: None,
        }
    }
}

/// Continues `prompt` with a model held by one stage (first and last). The prompt is
/// computed once; each new token costs one position thanks to the cache.
pub fn generate(
    stage: &Stage,
    prompt: &[i64],
    options: &GenerateOptions,
) -> Result<Vec<i64>, StageError> {
    if !(stage.is_first() && stage.is_last()) {
        return Err(StageError::NotWholeModel);
    }
    if prompt.is_empty() {
        return Err(StageError::EmptyPrompt);
    }
    let vocab = stage.config().vocab_size as i64;
    if let Some(bad) = prompt.iter().find(|&&t| t < 0 || t >= vocab) {
        return Err(StageError::TokenOutsideVocabulary {
            token: *bad,
            vocab_size: vocab,
        });
    }
    tch::manual_seed(options.seed as i64);
    let device = stage.device();
    let mut cache = KvCache::new();
    let mut out = Vec::with_capacity(options.max_new_tokens);
    let mut input = Tensor::from_slice(prompt).to_device(device).unsqueeze(0);
    tch::no_grad(|| -> Result<(), StageError> {
        for _ in 0..options.max_new_tokens {
            let logits = stage.forward_cached(&input, &mut cache)?;
            let last = logits.select(1, -1).squeeze_dim(0).to_kind(Kind::Float);
            let next = if options.temperature <= 0.0 {
                last.argmax(0, false).int64_value(&[])
            } else {
                let mut scaled = last / options.temperature;
                if options.top_k > 0 && (options.top_k as i64) < vocab {
                    let (values, _) = scaled.topk(options.top_k as i64, 0, true, true);
                    let threshold = values.get(options.top_k as i64 - 1);
                    scaled = scaled.where_self(
                        &scaled.ge_tensor(&threshold),
                        &Tensor::from(f64::NEG_INFINITY).to_device(device),
                    );
                }
                scaled
                    .softmax(0, Kind::Float)
                    .multinomial(1, false)
                    .int64_value(&[0])
            };
            out.push(next);
            if Some(next) == options.stop_token {
                break;
            }
            input = Tensor::from_slice(&[next]).to_device(device).unsqueeze(0);
        }
        Ok(())
    })?;
    Ok(out)
}
