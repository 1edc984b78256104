//! What both binaries share: the data commands (which never load libtorch), the list of
//! the commands that do, logging with the rank, and the one-line error.
//!
//! `synerfuse` is built without libtorch, so that preprocessing and the other data tools
//! start in milliseconds and run on machines with no CUDA stack; it hands every command
//! that needs libtorch or MPI to `synerfuse-torch`, installed next to it, by `exec`
//! (same process, same launcher environment).

use crate::{data_commands, index_command, timeline_command, topology_command};
use anyhow::Result;
use clap::Subcommand;

/// Help lines that both binaries print: their own, and those of the commands that
/// need libtorch (or MPI).
pub mod about {
    /// Both binaries' own.
    pub const SYNERFUSE: &str =
        "Train LLaMA-family models on heterogeneous clusters, Megatron-LM compatible";
    pub const PROFILE: &str =
        "Measure per-layer costs and links on this machine's devices (input to `plan`)";
    pub const PLAN: &str =
        "Search the fastest heterogeneous layout for a cluster file; writes plan.toml";
    pub const TRAIN: &str =
        "Train a LLaMA model: hetero pipeline x hetero data parallel, over MPI (and NCCL)";
    pub const SCORE: &str = "Mean next-token loss of token sequences under a Hugging Face LLaMA or a training checkpoint";
    pub const GENERATE: &str = "Continue a prompt with a Hugging Face LLaMA or a training checkpoint (KV cache, greedy or top-k)";
    pub const EXPORT: &str = "Write a training checkpoint as a Hugging Face LLaMA directory (config.json, safetensors shards, index)";
    pub const CHECKPOINT: &str =
        "Training checkpoints: list what one holds (tensors, shapes, the ranks that wrote them) and verify its files";
    pub const ENV: &str =
        "Report the native stack this binary runs on: libtorch, CUDA, MPI, NCCL, launcher rank";
}

/// The commands `synerfuse` hands to `synerfuse-torch`, with their help lines.
// `synerfuse-torch` reads it only in a test (that its commands are these).
#[cfg_attr(not(test), allow(dead_code))]
pub const TORCH_COMMANDS: [(&str, &str); 8] = [
    ("profile", about::PROFILE),
    ("plan", about::PLAN),
    ("train", about::TRAIN),
    ("score", about::SCORE),
    ("generate", about::GENERATE),
    ("export", about::EXPORT),
    ("checkpoint", about::CHECKPOINT),
    ("env", about::ENV),
];

/// The commands that run without libtorch.
#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenize JSONL into Megatron .bin/.idx datasets (Megatron's preprocess_data.py flags)
    Preprocess(data_commands::PreprocessArgs),
    /// Merge every .bin/.idx dataset of a directory into one (Megatron's merge_datasets.py)
    Merge(data_commands::MergeArgs),
    /// Show counts, dtype, length statistics and the first documents of a dataset
    Inspect(data_commands::InspectArgs),
    /// Tokenizer tools: train a byte-level BPE for corpora that have no tokenizer
    #[command(subcommand)]
    Tokenizer(data_commands::TokenizerCommand),
    /// Build or load the GPT sample indices of every split (Megatron's caches, shared both ways)
    Index(index_command::IndexArgs),
    /// Every communication group (tp, pp, dp, ...) Megatron builds for these sizes and order
    Topology(topology_command::TopologyArgs),
    /// Draw a training run's measured step per rank (from --log-json) under the plan's prediction (SVG)
    Timeline(timeline_command::TimelineArgs),
}

impl DataCommand {
    pub fn run(self) -> Result<()> {
        match self {
            DataCommand::Preprocess(args) => data_commands::run_preprocess(args),
            DataCommand::Index(args) => index_command::run_index(args),
            DataCommand::Topology(args) => topology_command::run_topology(args),
            DataCommand::Merge(args) => data_commands::run_merge(args),
            DataCommand::Inspect(args) => data_commands::run_inspect(args),
            DataCommand::Timeline(args) => timeline_command::run(args),
            DataCommand::Tokenizer(command) => data_commands::run_tokenizer(command),
        }
    }
}

/// Runs `command` with logging set up and the launcher's rank in every log line
/// (`rank{r=3}: ...`); the exit code, with the error printed once on one line.
pub fn main_with_logging(command: impl FnOnce() -> Result<()>) -> std::process::ExitCode {
    init_logging();
    let rank = synerfuse_plan::launcher::launcher_rank().map_or(0, |(rank, _)| rank);
    let result = tracing::info_span!("rank", r = rank).in_scope(command);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", error_line(&error));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, without a backtrace dump, each cause once:
/// library errors often embed their source's message already, which a plain `{:#}`
/// would print a second time.
pub fn error_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Logs go to stderr; `SYNERFUSE_LOG` filters them like `RUST_LOG`.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SYNERFUSE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
