//! `synerfuse index`: build (or load) the GPT sample indices of every split, with
//! Megatron's flags, cache names and files, so either tool reuses the other's caches.

use crate::data_commands::TokenizerFlags;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use synerfuse_data::gpt::{
    build_split_datasets, Blend, GptDataConfig, GptDatasetConfig, Split, SplitDataset,
};
use synerfuse_data::tokenizer::megatron_tokenizer_identifiers;

/// Megatron's default `--split` when `--data-path` is given without one.
const DEFAULT_SPLIT: &str = "969, 30, 1";

/// Where the data of a run comes from (Megatron's data flags).
pub(crate) struct DataPaths<'a> {
    pub data_path: &'a [String],
    pub per_split: [&'a [String]; 3],
    pub split: Option<&'a str>,
    pub data_cache_path: Option<&'a std::path::Path>,
}

/// Megatron's GPT dataset configuration from its flags, checked as Megatron checks them.
pub(crate) fn gpt_data_config(
    paths: &DataPaths<'_>,
    seed: u32,
    seq_length: usize,
    tokenizer: &TokenizerFlags,
) -> Result<GptDataConfig> {
    let has_per_split = paths.per_split.iter().any(|p| !p.is_empty());
    if !paths.data_path.is_empty() && has_per_split {
        bail!("--data-path cannot be combined with --train-data-path/--valid-data-path/--test-data-path");
    }
    if paths.data_path.is_empty() && !has_per_split {
        bail!("give --data-path, or --train-data-path/--valid-data-path/--test-data-path");
    }
    if has_per_split && paths.split.is_some() {
        bail!("--split applies to --data-path only, not to --train/valid/test-data-path");
    }
    let Some(kind) = tokenizer.tokenizer_type else {
        bail!("--tokenizer-type is required: the tokenizer is part of the cache names");
    };
    // Load it as Megatron does, so a wrong path fails here rather than naming a cache.
    tokenizer.build()?;
    let identifiers = megatron_tokenizer_identifiers(kind, &tokenizer.args())?;
    let blend = (!paths.data_path.is_empty())
        .then(|| Blend::from_list(paths.data_path))
        .transpose()?;
    let mut blend_per_split = [None, None, None];
    for (slot, split_paths) in blend_per_split.iter_mut().zip(paths.per_split) {
        if !split_paths.is_empty() {
            *slot = Some(Blend::from_list(split_paths)?);
        }
    }
    if seq_length == 0 {
        bail!("--seq-length must be at least 1");
    }
    Ok(GptDataConfig {
        blend,
        blend_per_split,
        dataset: GptDatasetConfig {
            seed,
            sequence_length: seq_length,
            split: match has_per_split {
                true => None,
                false => Some(paths.split.unwrap_or(DEFAULT_SPLIT).to_owned()),
            },
            path_to_cache: paths.data_cache_path.map(std::path::Path::to_path_buf),
            tokenizer: identifiers,
            add_extra_token: true,
            drop_last_partial_validation: true,
        },
    })
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
    #[arg(long)]
    seq_length: usize,
    /// Random seed of the shuffles
    #[arg(long, default_value_t = 1234)]
    seed: u32,
    /// Training samples (or give --train-iters and --global-batch-size)
    #[arg(long)]
    train_samples: Option<u64>,
    /// Validation samples [default: Megatron's (train_iters / eval_interval + 1) · eval_iters · gbs]
    #[arg(long)]
    valid_samples: Option<u64>,
    /// Test samples [default: Megatron's eval_iters · gbs]
    #[arg(long)]
    test_samples: Option<u64>,
    /// Training iterations (with --global-batch-size, instead of --train-samples)
    #[arg(long)]
    train_iters: Option<u64>,
    /// Samples per training step, used to size the splits as Megatron does
    #[arg(long)]
    global_batch_size: Option<u64>,
    /// Evaluation iterations per evaluation
    #[arg(long, default_value_t = 100)]
    eval_iters: u64,
    /// Iterations between evaluations
    #[arg(long, default_value_t = 1000)]
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
        if self.eval_interval == 0 {
            bail!("--eval-interval must be at least 1");
        }
        let gbs = self.global_batch_size;
        let train = match (self.train_samples, self.train_iters, gbs) {
            (Some(samples), _, _) => samples,
            (None, Some(iters), Some(gbs)) => iters * gbs,
            (None, _, _) => {
                bail!("give --train-samples, or --train-iters with --global-batch-size")
            }
        };
        let train_iters = match (self.train_iters, gbs) {
            (Some(iters), _) => Some(iters),
            (None, Some(gbs)) if gbs > 0 => Some(train / gbs),
            _ => None,
        };
        let valid = match (self.valid_samples, train_iters, gbs) {
            (Some(samples), _, _) => samples,
            (None, Some(iters), Some(gbs)) => {
                (iters / self.eval_interval + 1) * self.eval_iters * gbs
            }
            _ => 0,
        };
        let test = match (self.test_samples, gbs) {
            (Some(samples), _) => samples,
            (None, Some(gbs)) => self.eval_iters * gbs,
            _ => 0,
        };
        Ok([Some(train), Some(valid), Some(test)])
    }
}

pub fn run_index(args: IndexArgs) -> Result<()> {
    let sizes = args.sizes()?;
    let config = gpt_data_config(
        &DataPaths {
            data_path: &args.data_path,
            per_split: [
                &args.train_data_path,
                &args.valid_data_path,
                &args.test_data_path,
            ],
            split: args.split.as_deref(),
            data_cache_path: args.data_cache_path.as_deref(),
        },
        args.seed,
        args.seq_length,
        &args.tokenizer,
    )?;
    let started = std::time::Instant::now();
    let datasets = build_split_datasets(&config, sizes).context("building the sample indices")?;
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
