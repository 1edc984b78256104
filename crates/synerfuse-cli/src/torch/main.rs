//! `synerfuse-torch`: every `synerfuse` command, including those that need libtorch and
//! MPI (`train`, `profile`, `plan`, `score`, `generate`, `export`, `checkpoint`,
//! `env`), which the
//! libtorch-free `synerfuse` binary hands to it (see `entry`). The shared modules are the
//! `synerfuse_cli` library; the libtorch commands are this binary's own.
//!
//! Argument parsing and wiring only; the work lives in the library crates.

mod calibrate_command;
mod checkpoint_command;
mod env_report;
mod model_commands;
mod model_flags;
mod plan_commands;
mod plan_report;
mod plan_try;
mod restart;
mod train_command;

// The library's modules, under the names the command modules use (`crate::values`, ...).
use synerfuse_cli::{data_commands, entry, files, index_command, values};

use clap::{Parser, Subcommand};
use entry::about;

#[derive(Parser)]
#[command(
    name = "synerfuse",
    version,
    about = entry::about::SYNERFUSE,
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Data(entry::DataCommand),
    #[command(about = about::PROFILE)]
    Profile(Box<plan_commands::ProfileArgs>),
    #[command(about = about::PLAN)]
    Plan(Box<plan_commands::PlanArgs>),
    #[command(about = about::TRAIN)]
    Train(Box<train_command::TrainArgs>),
    #[command(about = about::SCORE)]
    Score(model_commands::ScoreArgs),
    #[command(about = about::GENERATE)]
    Generate(model_commands::GenerateArgs),
    #[command(about = about::EXPORT)]
    Export(model_commands::ExportArgs),
    #[command(about = about::CHECKPOINT, subcommand)]
    Checkpoint(checkpoint_command::CheckpointCommand),
    #[command(about = about::ENV)]
    Env {
        /// Print one JSON object instead of a table
        #[arg(long)]
        json: bool,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    entry::main_with_logging(|| {
        // Test only (SYNERFUSE_TEST_ONE_GPU_RANKS): NCCL's environment, before any thread
        // or communicator reads it.
        synerfuse_train::comm::one_gpu::prepare();
        run(cli.command)
    })
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Data(command) => command.run(),
        Command::Env { json } => env_report::run(json),
        Command::Profile(args) => plan_commands::run_profile(*args),
        Command::Plan(args) => plan_commands::run_plan(*args),
        Command::Train(args) => train_command::run_train(*args),
        Command::Score(args) => model_commands::run_score(args),
        Command::Generate(args) => model_commands::run_generate(args),
        Command::Export(args) => model_commands::run_export(args),
        Command::Checkpoint(command) => command.run(),
    }
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

    /// `synerfuse` hands exactly the commands this binary adds to the data commands.
    #[test]
    fn the_torch_commands_are_the_ones_synerfuse_hands_over() {
        let data = entry::DataCommand::augment_subcommands(clap::Command::new("data"));
        let data: Vec<&str> = data.get_subcommands().map(|c| c.get_name()).collect();
        let command = Cli::command();
        let torch: Vec<(String, String)> = command
            .get_subcommands()
            .filter(|c| !data.contains(&c.get_name()))
            .map(|c| {
                (
                    c.get_name().into(),
                    c.get_about().map(ToString::to_string).unwrap_or_default(),
                )
            })
            .collect();
        let handed: Vec<(String, String)> = entry::TORCH_COMMANDS
            .iter()
            .map(|(name, about)| (name.to_string(), about.to_string()))
            .collect();
        assert_eq!(torch, handed);
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
