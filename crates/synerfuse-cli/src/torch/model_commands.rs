//! `synerfuse score` and `synerfuse generate`: a Hugging Face LLaMA checkpoint, or a
//! synerfuse training checkpoint, run by synerfuse-model; `synerfuse export`: a training
//! checkpoint as a Hugging Face directory.

use crate::data_commands::TokenizerFlags;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use synerfuse_model::hf::{export_streaming, load_stage, ExportOptions};
use synerfuse_model::tch::{self, Tensor};
use synerfuse_model::{
    generate, DeviceRequest, GenerateOptions, LlamaConfig, ResolveDevice, Stage,
};
use synerfuse_train::checkpoint::Checkpoint;

/// Where the model comes from: exactly one of a Hugging Face directory or a checkpoint.
#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct ModelSource {
    /// Directory with config.json and model.safetensors (or shards)
    #[arg(long)]
    hf_dir: Option<PathBuf>,
    /// A `synerfuse train --save` directory (its `latest` checkpoint) or one `iter_N` in it
    #[arg(long)]
    load: Option<PathBuf>,
}

/// `synerfuse score`.
#[derive(Args, Debug)]
pub struct ScoreArgs {
    #[command(flatten)]
    source: ModelSource,
    /// JSON file: a list of token-id lists
    #[arg(long)]
    tokens: PathBuf,
    /// cpu, cuda, cuda:N or auto
    #[arg(long, default_value = "cpu")]
    device: DeviceRequest,
}

fn load_model(source: &ModelSource, device: DeviceRequest) -> Result<Stage> {
    let device = device.resolve()?;
    match (&source.hf_dir, &source.load) {
        (Some(dir), _) => {
            let config = LlamaConfig::from_hf_file(&dir.join("config.json"))?;
            Ok(load_stage(dir, 0..config.num_layers, device)?)
        }
        (None, Some(load)) => Ok(Checkpoint::open_any(load)?.load_model(device)?),
        (None, None) => bail!("give --hf-dir or --load"),
    }
}

/// Mean next-token negative log-likelihood of each sequence; `tokens` is the number of
/// predicted positions (length − 1), and `mean_loss` the mean over all of them.
pub fn run_score(args: ScoreArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.tokens)
        .with_context(|| format!("reading {}", args.tokens.display()))?;
    let sequences: Vec<Vec<i64>> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected a JSON list of token-id lists",
            args.tokens.display()
        )
    })?;
    let model = load_model(&args.source, args.device)?;
    let vocab = model.config().vocab_size as i64;
    let mut results = Vec::new();
    let (mut total, mut count) = (0f64, 0f64);
    for (i, seq) in sequences.iter().enumerate() {
        if seq.len() < 2 {
            bail!(
                "{}: sequence {i} has {} tokens; scoring needs at least 2",
                args.tokens.display(),
                seq.len()
            );
        }
        if let Some(bad) = seq.iter().find(|&&t| t < 0 || t >= vocab) {
            bail!(
                "{}: sequence {i}: token {bad} is outside the vocabulary of {vocab}",
                args.tokens.display()
            );
        }
        let ids = Tensor::from_slice(seq)
            .to_device(model.device())
            .unsqueeze(0);
        let n = seq.len() as i64;
        let (sum, tokens) = tch::no_grad(|| -> Result<(f64, f64)> {
            let logits = model.forward(&ids.narrow(1, 0, n - 1), None, None)?;
            let (sum, tokens) = Stage::loss(&logits, &ids.narrow(1, 1, n - 1), None);
            Ok((sum.double_value(&[]), tokens.double_value(&[])))
        })?;
        total += sum;
        count += tokens;
        results.push(json!({"loss": sum / tokens, "tokens": tokens as u64}));
    }
    let mean = if count > 0.0 { total / count } else { f64::NAN };
    println!("{}", json!({"sequences": results, "mean_loss": mean}));
    Ok(())
}

/// `synerfuse generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    source: ModelSource,
    /// Prompt text (needs --tokenizer-type and its files)
    #[arg(long, conflicts_with = "prompt_tokens")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids
    #[arg(long, value_delimiter = ',')]
    prompt_tokens: Option<Vec<i64>>,
    #[command(flatten)]
    tokenizer: TokenizerFlags,
    /// Tokens to generate
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sample among the k most likely tokens (0: all)
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Softmax temperature; 0 is greedy
    #[arg(long, value_parser = crate::values::non_negative, default_value_t = 0.0)]
    temperature: f64,
    /// Sampling seed
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// cpu, cuda, cuda:N or auto
    #[arg(long, default_value = "cpu")]
    device: DeviceRequest,
}

pub fn run_generate(args: GenerateArgs) -> Result<()> {
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!(
            "--temperature {} must be a finite number >= 0",
            args.temperature
        );
    }
    let tokenizer = args.tokenizer.build()?;
    let prompt: Vec<i64> = match (&args.prompt, &args.prompt_tokens, &tokenizer) {
        (Some(text), None, Some(tokenizer)) => tokenizer
            .tokenize(text)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (Some(_), None, None) => bail!("--prompt needs --tokenizer-type (or give --prompt-tokens)"),
        (None, Some(ids), _) => ids.clone(),
        _ => bail!("give --prompt or --prompt-tokens"),
    };
    let model = load_model(&args.source, args.device)?;
    let options = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        top_k: args.top_k,
        temperature: args.temperature,
        seed: args.seed,
        stop_token: tokenizer.as_ref().and_then(|t| t.eod()).map(i64::from),
    };
    let started = std::time::Instant::now();
    let ids = generate(&model, &prompt, &options)?;
    let seconds = started.elapsed().as_secs_f64();
    let text = match &tokenizer {
        Some(t) => Some(t.detokenize(&ids.iter().map(|&i| i as u32).collect::<Vec<_>>())?),
        None => None,
    };
    println!(
        "{}",
        json!({"prompt_tokens": prompt, "tokens": ids, "text": text,
               "tokens_per_second": ids.len() as f64 / seconds.max(1e-9)})
    );
    Ok(())
}

/// `synerfuse export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A `synerfuse train --save` directory (its `latest` checkpoint) or one `iter_N` in it
    #[arg(long)]
    load: PathBuf,
    /// The Hugging Face directory to create (it must not exist)
    #[arg(long)]
    output: PathBuf,
    /// Largest safetensors shard, as transformers' max_shard_size: bytes, or 500MB, 5GB, 2GiB
    #[arg(long, default_value = "5GB", value_parser = crate::values::byte_size)]
    max_shard_size: u64,
    /// Write bfloat16 weights (default: float32, the checkpoint's own precision)
    #[arg(long)]
    bf16: bool,
}

/// Writes the checkpoint's model as transformers does, one tensor at a time (each
/// assembled from the ranks' pieces that hold it): the model is never in memory whole.
pub fn run_export(args: ExportArgs) -> Result<()> {
    let checkpoint = Checkpoint::open_any(&args.load)?;
    let config = checkpoint.model_config()?;
    config.check_hf_exportable()?;
    let options = ExportOptions {
        max_shard_bytes: args.max_shard_size,
        kind: match args.bf16 {
            true => tch::Kind::BFloat16,
            false => tch::Kind::Float,
        },
    };
    let tensors = checkpoint.parameters()?;
    export_streaming(&config, &tensors, &args.output, options, |name| {
        Ok::<_, anyhow::Error>(checkpoint.tensor(name)?)
    })
    .with_context(|| format!("--output {}", args.output.display()))?;
    println!(
        "{}",
        json!({
            "exported": checkpoint.dir.display().to_string(),
            "iteration": checkpoint.state.iteration,
            "output": args.output.display().to_string(),
            "parameters": config.num_parameters(),
        })
    );
    Ok(())
}
