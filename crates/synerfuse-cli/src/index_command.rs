//! `synerfuse index`: build (or load) the GPT sample indices of every split, with
//! Megatron's flags, cache names and files, so either tool reuses the other's caches.

use crate::data_commands::{tokenizer_flag_error, TokenizerFlags};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use synerfuse_data::gpt::{
    build_split_datasets, BlendError, BudgetError, DataSources, GptDataConfig, GptDatasetError,
    SampleBudget, Split, SplitDataset,
};
use synerfuse_data::tokenizer::megatron_tokenizer_identifiers;

/// Megatron's data configuration from the data flags. The tokenizer is loaded as
/// Megatron loads it, so a wrong path fails here rather than naming a cache.
pub fn gpt_data_config(
    sources: &DataSources,
    seed: u32,
    seq_length: usize,
    tokenizer: &TokenizerFlags,
) -> Result<GptDataConfig> {
    let Some(kind) = tokenizer.tokenizer_type else {
        bail!("--tokenizer-type is required: the tokenizer is part of the cache names");
    };
    tokenizer.build()?;
    let identifiers =
        megatron_tokenizer_identifiers(kind, &tokenizer.args()).map_err(tokenizer_flag_error)?;
    GptDataConfig::from_sources(sources, seed, seq_length, identifiers).map_err(data_flag_error)
}

/// A data error with the flags behind it.
pub fn data_flag_error(error: GptDatasetError) -> anyhow::Error {
    let flags = match &error {
        GptDatasetError::Blend(BlendError::BlendAndPerSplit | BlendError::NoData) => {
            "--data-path / --train-data-path / --valid-data-path / --test-data-path"
        }
        GptDatasetError::Blend(BlendError::SplitWithPerSplit | BlendError::MissingSplit) => {
            "--split"
        }
        GptDatasetError::Blend(_) => {
            "--data-path (or --train-data-path / --valid-data-path / --test-data-path)"
        }
        GptDatasetError::ZeroSequenceLength => "--seq-length",
        GptDatasetError::Split(_) => "--split",
        _ => return error.into(),
    };
    anyhow::Error::new(error).context(flags)
}

/// `synerfuse index`.
#[derive(Args, Debug)]
pub struct IndexArgs {
    /// Dataset prefixes, optionally weighted: `PREFIX...` or `W1 PREFIX1 W2 PREFIX2 ...`
    #[arg(long, num_args = 1..)]
    data_path: Vec<String>,
    /// Training data only (instead of --data-path and --split)
    #[arg(long, num_args = 1..)]
    train_data_path: Vec<String>,
    /// Validation data only
    #[arg(long, num_args = 1..)]
    valid_data_path: Vec<String>,
    /// Test data only
    #[arg(long, num_args = 1..)]
    test_data_path: Vec<String>,
    /// Train/valid/test proportions of each --data-path dataset [default: "969, 30, 1"]
    #[arg(long)]
    split: Option<String>,
    /// Tokens per sample
    #[arg(long, value_parser = crate::values::positive_count)]
    seq_length: usize,
    /// Random seed of the shuffles
    #[arg(long, default_value_t = 1234)]
    seed: u32,
    /// Training samples (or give --train-iters and --global-batch-size)
    #[arg(long, value_parser = crate::values::positive_u64)]
    train_samples: Option<u64>,
    /// Validation samples [default: Megatron's (train_iters / eval_interval + 1) · eval_iters · gbs]
    #[arg(long)]
    valid_samples: Option<u64>,
    /// Test samples [default: Megatron's eval_iters · gbs]
    #[arg(long)]
    test_samples: Option<u64>,
    /// Training iterations (with --global-batch-size, instead of --train-samples)
    #[arg(long, value_parser = crate::values::positive_u64)]
    train_iters: Option<u64>,
    /// Samples per training step, used to size the splits as Megatron does
    #[arg(long, value_parser = crate::values::positive_u64)]
    global_batch_size: Option<u64>,
    /// Evaluation iterations per evaluation
    #[arg(long, default_value_t = 100)]
    eval_iters: u64,
    /// Iterations between evaluations
    #[arg(long, value_parser = crate::values::positive_u64, default_value_t = 1000)]
    eval_interval: u64,
    /// Directory of the index caches [default: PREFIX/cache/GPTDataset_indices per dataset;
    /// blends are then not cached, as in Megatron]
    #[arg(long)]
    data_cache_path: Option<PathBuf>,
    #[command(flatten)]
    tokenizer: TokenizerFlags,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
}

impl IndexArgs {
    /// Samples per split, as Megatron's `build_train_valid_test_datasets` sizes them.
    fn sizes(&self) -> Result<[Option<u64>; 3]> {
        let budget = SampleBudget {
            train_samples: self.train_samples,
            train_iters: self.train_iters,
            global_batch_size: self.global_batch_size,
            eval_interval: self.eval_interval,
            eval_iters: self.eval_iters,
            valid_samples: self.valid_samples,
            test_samples: self.test_samples,
        };
        budget.split_sizes().map_err(|e| {
            let flags = match e {
                BudgetError::ZeroEvalInterval => "--eval-interval",
                BudgetError::NoTrainSize => "--train-samples / --train-iters --global-batch-size",
                BudgetError::Overflow => "--train-iters / --global-batch-size / --eval-iters",
            };
            anyhow::Error::new(e).context(flags)
        })
    }

    fn sources(&self) -> DataSources {
        DataSources {
            blend: self.data_path.clone(),
            per_split: [
                self.train_data_path.clone(),
                self.valid_data_path.clone(),
                self.test_data_path.clone(),
            ],
            split: self.split.clone(),
            cache_dir: self.data_cache_path.clone(),
        }
    }
}

pub fn run_index(args: IndexArgs) -> Result<()> {
    let sizes = args.sizes()?;
    let config = gpt_data_config(&args.sources(), args.seed, args.seq_length, &args.tokenizer)?;
    let started = std::time::Instant::now();
    let datasets = build_split_datasets(&config, sizes)
        .map_err(data_flag_error)
        .context("building the sample indices")?;
    let elapsed = started.elapsed().as_secs_f64();
    let report: Vec<_> = Split::ALL
        .iter()
        .zip(&datasets)
        .zip(sizes)
        .map(|((split, dataset), requested)| {
            let Some(dataset) = dataset else {
                return json!({"split": split.name(), "requested": requested, "samples": null});
            };
            let caches: Vec<_> = dataset
                .cache_records()
                .into_iter()
                .map(|record| {
                    json!({
                        "loaded": record.loaded,
                        "files": record.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({
                "split": split.name(),
                "requested": requested,
                "samples": dataset.len(),
                "class": match dataset {
                    SplitDataset::Gpt(_) => "GPTDataset",
                    SplitDataset::Blended(_) => "BlendedDataset",
                },
                "caches": caches,
            })
        })
        .collect();
    if args.json {
        println!(
            "{}",
            json!({"splits": report, "seconds": elapsed, "seq_length": args.seq_length, "seed": args.seed})
        );
        return Ok(());
    }
    for entry in &report {
        let split = entry["split"].as_str().unwrap_or_default();
        if entry["samples"].is_null() {
            println!("{split}: no data");
            continue;
        }
        println!(
            "{split}: {} samples ({} requested), {}",
            entry["samples"],
            entry["requested"],
            entry["class"].as_str().unwrap_or_default()
        );
        for cache in entry["caches"].as_array().into_iter().flatten() {
            let state = if cache["loaded"].as_bool() == Some(true) {
                "loaded"
            } else {
                "built"
            };
            for file in cache["files"].as_array().into_iter().flatten() {
                println!("  {state} {}", file.as_str().unwrap_or_default());
            }
        }
    }
    println!("indices ready in {elapsed:.2}s");
    Ok(())
}
