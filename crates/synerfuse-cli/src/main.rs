//! `synerfuse`: preprocess, plan and train LLaMA-family models on heterogeneous clusters.
//!
//! Argument parsing and wiring only; the work lives in the library crates.

mod data_commands;
mod env_report;
mod index_command;
mod model_commands;
mod plan_commands;
mod restart;
mod timeline_command;
mod topology_command;
mod train_command;
mod values;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "synerfuse",
    version,
    about = "Train LLaMA-family models on heterogeneous clusters, Megatron-LM compatible",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize JSONL into Megatron .bin/.idx datasets (Megatron's preprocess_data.py flags)
    Preprocess(data_commands::PreprocessArgs),
    /// Build or load the GPT sample indices of every split (Megatron's caches, shared both ways)
    Index(index_command::IndexArgs),
    /// Measure per-layer costs and links on this machine's devices (input to `plan`)
    Profile(Box<plan_commands::ProfileArgs>),
    /// Search the fastest heterogeneous layout for a cluster file; writes plan.toml
    Plan(Box<plan_commands::PlanArgs>),
    /// Train a LLaMA model: hetero pipeline x hetero data parallel, over MPI (and NCCL)
    Train(Box<train_command::TrainArgs>),
    /// Every communication group (tp, pp, dp, ...) Megatron builds for these sizes and order
    Topology(topology_command::TopologyArgs),
    /// Mean next-token loss of token sequences under a Hugging Face LLaMA or a training checkpoint
    Score(model_commands::ScoreArgs),
    /// Continue a prompt with a Hugging Face LLaMA or a training checkpoint (KV cache, greedy or top-k)
    Generate(model_commands::GenerateArgs),
    /// Write a training checkpoint as a Hugging Face LLaMA directory (config.json, safetensors shards, index)
    Export(model_commands::ExportArgs),
    /// Merge every .bin/.idx dataset of a directory into one (Megatron's merge_datasets.py)
    Merge(data_commands::MergeArgs),
    /// Show counts, dtype, length statistics and the first documents of a dataset
    Inspect(data_commands::InspectArgs),
    /// Draw a training run's measured step per rank (from --log-json) under the plan's prediction (SVG)
    Timeline(timeline_command::TimelineArgs),
    /// Tokenizer tools: train a byte-level BPE for corpora that have no tokenizer
    #[command(subcommand)]
    Tokenizer(data_commands::TokenizerCommand),
    /// Report the native stack this binary runs on: libtorch, CUDA, MPI, NCCL, launcher rank
    Env {
        /// Print one JSON object instead of a table
        #[arg(long)]
        json: bool,
    },
}

fn main() -> std::process::ExitCode {
    match run() {
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
pub(crate) fn error_line(error: &anyhow::Error) -> String {
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

fn run() -> Result<()> {
    let cli = Cli::parse();
    init_logging();
    // Every log line carries the rank: `rank{r=3}: ...`.
    let rank = synerfuse_train::comm::launcher_rank().map_or(0, |(rank, _)| rank);
    let _rank_span = tracing::info_span!("rank", r = rank).entered();
    match cli.command {
        Command::Env { json } => env_report::run(json),
        Command::Preprocess(args) => data_commands::run_preprocess(args),
        Command::Merge(args) => data_commands::run_merge(args),
        Command::Index(args) => index_command::run_index(args),
        Command::Profile(args) => plan_commands::run_profile(*args),
        Command::Plan(args) => plan_commands::run_plan(*args),
        Command::Timeline(args) => timeline_command::run(args),
        Command::Train(args) => train_command::run_train(*args),
        Command::Topology(args) => topology_command::run_topology(args),
        Command::Score(args) => model_commands::run_score(args),
        Command::Generate(args) => model_commands::run_generate(args),
        Command::Export(args) => model_commands::run_export(args),
        Command::Inspect(args) => data_commands::run_inspect(args),
        Command::Tokenizer(command) => data_commands::run_tokenizer(command),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use proptest::prelude::*;

    /// Subcommand names, every long flag of every subcommand, and awkward values.
    fn tokens() -> Vec<String> {
        let command = Cli::command();
        let mut tokens: Vec<String> = command
            .get_subcommands()
            .flat_map(|sub| {
                std::iter::once(sub.get_name().to_owned()).chain(
                    sub.get_arguments()
                        .filter_map(|a| a.get_long().map(|l| format!("--{l}"))),
                )
            })
            .collect();
        for value in [
            "0",
            "1",
            "-1",
            "3",
            "1.5",
            "nan",
            "inf",
            "-inf",
            "1e999",
            "",
            " ",
            "18446744073709551616",
            "4294967296",
            "cuda:99",
            "cuda:",
            "auto",
            "gpipe",
            "1f1b",
            "x",
            "0,0",
            "1,2,4",
            "--",
            "-",
            "=",
            "--nproc=0",
            "--threads=0",
        ] {
            tokens.push(value.to_owned());
        }
        tokens
    }

    #[test]
    fn the_command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any argument list parses or is refused with a usage error; nothing panics.
        #[test]
        fn argument_parsing_never_panics(
            picks in prop::collection::vec(any::<prop::sample::Index>(), 0..16),
            free in prop::collection::vec(".{0,8}", 0..3),
        ) {
            let tokens = tokens();
            let args: Vec<String> = std::iter::once("synerfuse".to_owned())
                .chain(picks.iter().map(|i| i.get(&tokens).clone()))
                .chain(free)
                .collect();
            let _ = Cli::try_parse_from(args);
        }
    }
}
