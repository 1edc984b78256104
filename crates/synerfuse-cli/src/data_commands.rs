//! `synerfuse preprocess`, `merge` and `inspect`: Megatron's data tools.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::io::IsTerminal;
use std::path::PathBuf;
use synerfuse_data::indexed::merge_datasets;
use synerfuse_data::preprocess::{
    output_prefix_for_key, preprocess, read_json_texts, PreprocessConfig, PreprocessError,
    PreprocessStats,
};
use synerfuse_data::tokenizer::{
    build_tokenizer, train_byte_level_bpe, Tokenizer, TokenizerArgs, TokenizerArgument,
    TokenizerError, TokenizerType,
};
use synerfuse_data::IndexedDataset;

/// Megatron's tokenizer flags.
#[derive(Args, Debug)]
pub struct TokenizerFlags {
    /// GPT2BPETokenizer, Llama2Tokenizer, GPTSentencePieceTokenizer, SentencePieceTokenizer,
    /// HuggingFaceTokenizer or NullTokenizer
    #[arg(long)]
    pub tokenizer_type: Option<TokenizerType>,
    /// SentencePiece .model, or a Hugging Face tokenizer.json (file or directory)
    #[arg(long)]
    tokenizer_model: Option<PathBuf>,
    /// GPT-2 vocab.json
    #[arg(long)]
    vocab_file: Option<PathBuf>,
    /// GPT-2 merges.txt
    #[arg(long)]
    merge_file: Option<PathBuf>,
    /// Vocabulary size of the NullTokenizer
    #[arg(long, value_parser = crate::values::positive_count)]
    vocab_size: Option<usize>,
}

impl TokenizerFlags {
    /// The paths and sizes as typed.
    pub fn args(&self) -> TokenizerArgs {
        TokenizerArgs {
            tokenizer_model: self.tokenizer_model.clone(),
            vocab_file: self.vocab_file.clone(),
            merge_file: self.merge_file.clone(),
            vocab_size: self.vocab_size,
        }
    }

    pub fn build(&self) -> Result<Option<Box<dyn Tokenizer>>> {
        let Some(kind) = self.tokenizer_type else {
            return Ok(None);
        };
        Ok(Some(
            build_tokenizer(kind, &self.args()).map_err(tokenizer_flag_error)?,
        ))
    }
}

/// A tokenizer error with the flag behind it.
pub fn tokenizer_flag_error(error: TokenizerError) -> anyhow::Error {
    let flag = match &error {
        TokenizerError::MissingArgument { argument, .. } => match argument {
            TokenizerArgument::VocabFile => "--vocab-file",
            TokenizerArgument::MergeFile => "--merge-file",
            TokenizerArgument::TokenizerModel => "--tokenizer-model",
            TokenizerArgument::VocabSize => "--vocab-size",
        },
        _ => return error.into(),
    };
    anyhow::Error::new(error).context(format!("{flag} is required"))
}

/// `synerfuse preprocess`: JSONL → `{prefix}_{key}_document.{bin,idx}`.
#[derive(Args, Debug)]
pub struct PreprocessArgs {
    /// Input JSONL file, one document per line (.jsonl.gz accepted)
    #[arg(long)]
    input: PathBuf,
    /// Output prefix: writes PREFIX_KEY_document.bin/.idx for every key
    #[arg(long)]
    output_prefix: PathBuf,
    /// JSON keys to tokenize, one output dataset each
    #[arg(long, num_args = 1.., default_values_t = [String::from("text")])]
    json_keys: Vec<String>,
    #[command(flatten)]
    tokenizer: TokenizerFlags,
    /// Append the end-of-document token to every non-empty document
    #[arg(long)]
    append_eod: bool,
    /// Tokenizing threads
    #[arg(long, value_parser = crate::values::positive_count)]
    workers: usize,
    /// Megatron's partitions: lines are dealt round-robin, which reorders documents
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 1)]
    partitions: usize,
    /// With --partitions: contiguous blocks instead of round-robin (keeps input order)
    #[arg(long)]
    keep_sequential_samples: bool,
    /// Documents between progress lines when stderr is not a terminal
    #[arg(long, value_parser = crate::values::positive_u64, default_value_t = 1000)]
    log_interval: u64,
    /// Count malformed lines and continue instead of stopping at the first one
    #[arg(long)]
    skip_bad_lines: bool,
    /// Sentence splitting (NLTK punkt in Megatron): not supported
    #[arg(long)]
    split_sentences: bool,
    /// Only meaningful with --split-sentences
    #[arg(long)]
    keep_newlines: bool,
    /// Punkt language, only meaningful with --split-sentences
    #[arg(long, default_value = "english")]
    // Accepted so Megatron command lines run; unused without --split-sentences, as there.
    #[allow(dead_code)]
    lang: String,
}

pub fn run_preprocess(args: PreprocessArgs) -> Result<()> {
    if args.split_sentences {
        bail!(
            "--split-sentences is not supported: synerfuse has no port of NLTK's punkt splitter. Split sentences \
             beforehand and pass each document's sentences as a JSON list; each list item becomes one sequence"
        );
    }
    if args.keep_newlines {
        bail!("--keep-newlines only applies to --split-sentences, which is not supported");
    }
    let tokenizer = args
        .tokenizer
        .build()?
        .context("--tokenizer-type is required")?;
    if let Some(reason) = tokenizer.library_reason() {
        tracing::info!(
            "this tokenizer encodes through its library, slower than synerfuse's own encoders: {reason}"
        );
    }
    let config = PreprocessConfig {
        input: args.input.clone(),
        output_prefix: args.output_prefix.clone(),
        json_keys: args.json_keys.clone(),
        append_eod: args.append_eod,
        workers: args.workers,
        partitions: args.partitions,
        keep_sequential_samples: args.keep_sequential_samples,
        skip_bad_lines: args.skip_bad_lines,
    };
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}")
                .expect("valid template"),
        );
        bar
    });
    let rates = |s: &PreprocessStats| {
        let secs = s.elapsed.as_secs_f64().max(1e-9);
        format!(
            "{} docs ({:.0} docs/s, {:.2} MB/s, {:.0} tokens/s)",
            s.documents,
            s.documents as f64 / secs,
            s.bytes as f64 / secs / 1e6,
            s.tokens as f64 / secs
        )
    };
    let mut next_log = args.log_interval.max(1);
    let stats = preprocess(&config, tokenizer.as_ref(), |s| match &bar {
        Some(bar) => bar.set_message(rates(s)),
        None if s.documents >= next_log => {
            tracing::info!("processed {}", rates(s));
            next_log = (s.documents / args.log_interval.max(1) + 1) * args.log_interval.max(1);
        }
        None => {}
    })
    .map_err(preprocess_flag_error)?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if stats.bad_lines > 0 {
        tracing::warn!(
            "skipped {} malformed line(s) (--skip-bad-lines)",
            stats.bad_lines
        );
    }
    tracing::info!("done: {}, {} tokens", rates(&stats), stats.tokens);
    for key in &args.json_keys {
        println!(
            "{}",
            output_prefix_for_key(&args.output_prefix, key).display()
        );
    }
    Ok(())
}

/// A preprocessing error with the flags behind it.
fn preprocess_flag_error(error: PreprocessError) -> anyhow::Error {
    let flags = match &error {
        PreprocessError::NoKeys => "--json-keys",
        PreprocessError::NoWorkers { .. } | PreprocessError::UnevenWorkers { .. } => {
            "--workers / --partitions"
        }
        PreprocessError::Pool { .. } => "--workers",
        PreprocessError::NoEod => "--append-eod",
        _ => return error.into(),
    };
    anyhow::Error::new(error).context(flags)
}

/// `synerfuse merge`: every dataset of a directory into one (Megatron's merge_datasets.py).
#[derive(Args, Debug)]
pub struct MergeArgs {
    /// Directory holding PREFIX.bin/PREFIX.idx pairs, merged in sorted prefix order
    #[arg(long)]
    input: PathBuf,
    /// Output prefix of the merged dataset
    #[arg(long)]
    output_prefix: PathBuf,
    /// The datasets carry a modes array (Megatron's multimodal datasets)
    #[arg(long)]
    multimodal: bool,
}

pub fn run_merge(args: MergeArgs) -> Result<()> {
    if !args.input.is_dir() {
        bail!("--input {}: not a directory", args.input.display());
    }
    if let Some(parent) = args
        .output_prefix
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
    {
        if !parent.is_dir() {
            bail!(
                "--output-prefix {}: directory {} does not exist",
                args.output_prefix.display(),
                parent.display()
            );
        }
    }
    let merged = merge_datasets(&args.input, &args.output_prefix, args.multimodal)?;
    tracing::info!(
        "merged {} datasets into {}",
        merged.len(),
        args.output_prefix.display()
    );
    for prefix in merged {
        println!("{}", prefix.display());
    }
    Ok(())
}

/// `synerfuse inspect`: counts, dtype, length statistics, first documents.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Dataset prefix (PREFIX.bin + PREFIX.idx)
    prefix: PathBuf,
    #[command(flatten)]
    tokenizer: TokenizerFlags,
    /// Documents to show (decoded when a tokenizer is given)
    #[arg(long, default_value_t = 3)]
    documents: usize,
    /// The dataset carries a modes array
    #[arg(long)]
    multimodal: bool,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
}

pub fn run_inspect(args: InspectArgs) -> Result<()> {
    let ds = if args.multimodal {
        IndexedDataset::open_multimodal(&args.prefix)?
    } else {
        IndexedDataset::open(&args.prefix)?
    };
    let tokenizer = args.tokenizer.build()?;
    let mut lengths: Vec<i64> = ds.sequence_lengths().iter().map(i64::from).collect();
    let tokens: i64 = lengths.iter().sum();
    lengths.sort_unstable();
    let percentile = |p: f64| -> i64 {
        if lengths.is_empty() {
            0
        } else {
            lengths[((lengths.len() - 1) as f64 * p).round() as usize]
        }
    };
    let mut shown = Vec::new();
    for k in 0..args.documents.min(ds.num_documents()) {
        let mut ids = Vec::new();
        for i in ds.document(k)? {
            ids.extend(ds.get_i64(i, 0, None)?);
        }
        let text = match &tokenizer {
            Some(t) => {
                let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
                Some(t.detokenize(&ids)?)
            }
            None => None,
        };
        shown.push((k, ids, text));
    }
    let report = json!({
        "prefix": args.prefix,
        "dtype": format!("{:?}", ds.dtype()).to_lowercase(),
        "sequences": ds.len(),
        "documents": ds.num_documents(),
        "tokens": tokens,
        "sequence_length": {
            "min": lengths.first().copied().unwrap_or(0),
            "p50": percentile(0.5),
            "p99": percentile(0.99),
            "max": lengths.last().copied().unwrap_or(0),
            "mean": if lengths.is_empty() { 0.0 } else { tokens as f64 / lengths.len() as f64 },
        },
        "first_documents": shown.iter().map(|(k, ids, text)| json!({"document": k, "tokens": ids.len(), "ids": ids.iter().take(64).collect::<Vec<_>>(), "text": text})).collect::<Vec<_>>(),
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{}: {} sequences in {} documents, {} tokens, dtype {}",
        args.prefix.display(),
        ds.len(),
        ds.num_documents(),
        tokens,
        report["dtype"].as_str().unwrap_or("")
    );
    let l = &report["sequence_length"];
    println!(
        "sequence length: min {} p50 {} p99 {} max {} mean {:.1}",
        l["min"],
        l["p50"],
        l["p99"],
        l["max"],
        l["mean"].as_f64().unwrap_or(0.0)
    );
    for (k, ids, text) in shown {
        match text {
            Some(text) => println!("document {k} ({} tokens): {text:?}", ids.len()),
            None => println!(
                "document {k} ({} tokens): {:?}{}",
                ids.len(),
                &ids[..ids.len().min(32)],
                if ids.len() > 32 { " …" } else { "" }
            ),
        }
    }
    Ok(())
}

/// `synerfuse tokenizer ...`.
#[derive(clap::Subcommand, Debug)]
pub enum TokenizerCommand {
    /// Train a GPT-2 style byte-level BPE (with <|endoftext|>) on JSONL texts
    Train(TrainTokenizerArgs),
}

/// `synerfuse tokenizer train`.
#[derive(Args, Debug)]
pub struct TrainTokenizerArgs {
    /// Input JSONL (.jsonl.gz accepted)
    #[arg(long)]
    input: PathBuf,
    /// JSON keys whose texts to train on
    #[arg(long, num_args = 1.., default_values_t = [String::from("text")])]
    json_keys: Vec<String>,
    /// Vocabulary size, <|endoftext|> and the 256 byte tokens included
    #[arg(long, value_parser = crate::values::positive_count)]
    vocab_size: usize,
    /// Where to write the tokenizer.json (use with --tokenizer-type HuggingFaceTokenizer)
    #[arg(long)]
    output: PathBuf,
    /// Also write vocab.json and merges.txt beside it (use with --tokenizer-type GPT2BPETokenizer)
    #[arg(long)]
    gpt2_files: bool,
}

pub fn run_tokenizer(command: TokenizerCommand) -> Result<()> {
    let TokenizerCommand::Train(args) = command;
    if args.vocab_size <= 257 {
        bail!("--vocab-size {} leaves no room for merges: the 256 byte tokens and <|endoftext|> come first", args.vocab_size);
    }
    let texts = read_json_texts(&args.input, &args.json_keys)?;
    tracing::info!(
        "training a byte-level BPE of {} tokens on {} texts",
        args.vocab_size,
        texts.len()
    );
    let trained = train_byte_level_bpe(
        texts.into_iter(),
        args.vocab_size,
        &args.output,
        args.gpt2_files,
    )?;
    tracing::info!("vocabulary of {} tokens", trained.vocab_size);
    println!("{}", trained.tokenizer_json.display());
    if let Some((vocab, merges)) = trained.gpt2_files {
        println!("{}\n{}", vocab.display(), merges.display());
    }
    Ok(())
}
