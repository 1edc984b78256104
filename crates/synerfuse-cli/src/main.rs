//! `synerfuse`: preprocess, plan and train LLaMA-family models on heterogeneous clusters.
//!
//! This binary does not link libtorch: it runs the data commands itself and hands the
//! others to `synerfuse-torch` (see `entry`). Argument parsing and wiring only; the work
//! lives in the library crates.

use synerfuse_cli::entry;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser};
use std::ffi::OsString;

/// The binary that runs [`entry::TORCH_COMMANDS`], installed next to this one.
const TORCH_BINARY: &str = "synerfuse-torch";

#[derive(Parser)]
#[command(
    name = "synerfuse",
    version,
    about = entry::about::SYNERFUSE,
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: entry::DataCommand,
}

fn main() -> std::process::ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if hands_over(&args) {
        // Only returns if the exec failed.
        return entry::main_with_logging(|| exec_torch_binary(&args[0], &args[1..]));
    }
    let matches = command().get_matches_from(&args);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    entry::main_with_logging(|| cli.command.run())
}

/// The data commands, and the libtorch ones listed for `--help` (never parsed here).
fn command() -> clap::Command {
    entry::TORCH_COMMANDS
        .iter()
        .fold(Cli::command(), |cli, (name, about)| {
            cli.subcommand(clap::Command::new(*name).about(*about))
        })
}

/// Whether `args` name a command of `synerfuse-torch` (`train ...`, `help train`).
fn hands_over(args: &[OsString]) -> bool {
    let is_torch = |arg: Option<&OsString>| {
        arg.is_some_and(|a| entry::TORCH_COMMANDS.iter().any(|(name, _)| a == name))
    };
    is_torch(args.get(1)) || (args.get(1).is_some_and(|a| a == "help") && is_torch(args.get(2)))
}

/// Replaces this process with `synerfuse-torch args`: the same pid, environment and
/// descriptors, so launchers (`mpirun`, `srun`) see the rank they started.
fn exec_torch_binary(argv0: &OsString, args: &[OsString]) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("locating the synerfuse binary")?;
    let torch = exe.with_file_name(TORCH_BINARY);
    let command = args.first().map_or("".into(), |a| a.to_string_lossy());
    anyhow::ensure!(
        torch.is_file(),
        "`synerfuse {command}` needs libtorch and runs in {}, which is missing next to {} \
         (`cargo install synerfuse-cli` installs both binaries)",
        TORCH_BINARY,
        exe.display()
    );
    // Its usage lines then name `synerfuse`, as typed.
    let error = std::process::Command::new(&torch)
        .arg0(argv0)
        .args(args)
        .exec();
    Err(error).with_context(|| format!("starting {}", torch.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_definition_is_consistent() {
        command().debug_assert();
    }

    #[test]
    fn libtorch_commands_are_handed_over_and_data_commands_are_not() {
        let args = |line: &str| -> Vec<OsString> { line.split(' ').map(OsString::from).collect() };
        for line in [
            "synerfuse train --lr 1",
            "synerfuse help env",
            "synerfuse plan",
        ] {
            assert!(hands_over(&args(line)), "{line}");
        }
        for line in [
            "synerfuse preprocess --help",
            "synerfuse help index",
            "synerfuse",
            "synerfuse --help",
        ] {
            assert!(!hands_over(&args(line)), "{line}");
        }
    }
}
