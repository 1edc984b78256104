//! `cargo xtask`: the workspace's developer tasks.
//!
//! * `cargo xtask setup [--reference]` installs the native stack (Debian packages, the
//!   PyPI `torch` wheel in `.venv/`) and is idempotent.
//! * `cargo xtask test` runs setup, then the whole test suite, clippy, rustfmt and the docs.
//! * `cargo xtask demo` runs the tour: data, tokenizer, plan, training, plot, generation.
//! * `cargo xtask bench [NAME]` runs the benchmarks (all of them without NAME).
//! * `cargo xtask structure` checks the house rules the compiler cannot see (CI runs it in
//!   `cargo xtask test`).
//! * `cargo xtask gpu-bundle [--check-cpu]` packs what a GPU machine needs to run
//!   `check.sh`, and checks it here with the GPU machine's view of the filesystem.

mod bench;
mod bench_cp;
mod bench_hetero;
mod bench_islands;
mod bench_moe;
mod bench_replan;
mod bench_tp;
mod common;
mod demo;
mod gpu_bundle;
mod setup;
mod structure;
mod test;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Developer tasks for the synerfuse workspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install OpenMPI, libclang, cmake, pkg-config (apt) and libtorch (PyPI torch wheel in .venv/).
    Setup {
        /// Also install the reference oracles (megatron-core 0.8.0, transformers, ...) into .venv/.
        #[arg(long)]
        reference: bool,
    },
    /// Setup, then tests (nextest, doc tests), clippy with -D warnings and rustfmt --check.
    Test,
    /// The house rules the compiler cannot see: no module import circle inside a crate, no
    /// library function over 100 lines, no planner-crate file over 700 lines.
    Structure,
    /// Regenerate the committed test fixtures with the reference oracles (megatron-core 0.8.0).
    Fixtures,
    /// Benchmarks against references measured in the same run; without NAME all of them,
    /// then target/bench/results.json and results.md.
    Bench {
        /// One benchmark: preprocess, index, model, hetero, tp, cp, moe, planner or replan; or
        /// summary: results.json and results.md again from each one's latest results
        name: Option<String>,
    },
    /// The five-minute tour on this machine: Shakespeare, tokenizer, preprocess, profile,
    /// plan, train on 4 emulated heterogeneous ranks, loss plot, a generated passage.
    Demo,
    /// target/gpu-bundle/: the binaries, the OpenMPI runtime, data and check.sh for a
    /// borrowed GPU machine (run there: bash target/gpu-bundle/check.sh).
    GpuBundle {
        /// Bundle the debug binaries into target/gpu-bundle-debug (a quicker build, checked
        /// here with --check-cpu; never carried to a GPU machine)
        #[arg(long)]
        debug: bool,
        /// Then run `check.sh --cpu` as the GPU machine would: in a mount namespace where
        /// this machine's OpenMPI, .venv and target/ are hidden and .venv stands in for
        /// the GPU machine's /opt/torch/.venv (needs root)
        #[arg(long)]
        check_cpu: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.command {
        Command::Setup { reference } => setup::run(&root, reference),
        Command::Test => test::run(&root),
        Command::Structure => structure::run(&root),
        Command::Fixtures => fixtures(&root),
        Command::Bench { name } => bench::run(&root, name.as_deref()),
        Command::Demo => demo::run(&root),
        Command::GpuBundle { debug, check_cpu } => {
            let bundle = gpu_bundle::run(&root, debug)?;
            if check_cpu {
                gpu_bundle::check_cpu_as_gpu_machine(&root, &bundle)?;
            }
            Ok(())
        }
    }
}

/// Runs the fixture generators with the reference Python environment.
fn fixtures(root: &std::path::Path) -> Result<()> {
    setup::run(root, true)?;
    let python = root.join(".venv/bin/python");
    for script in [
        "data_fixtures.py",
        "index_fixtures.py",
        "parallel_fixtures.py",
        "model_fixtures.py",
        "loss_scale_fixtures.py",
    ] {
        let script = root.join("xtask/fixtures").join(script);
        let status = std::process::Command::new(&python)
            .arg(&script)
            .arg(root)
            .status()?;
        anyhow::ensure!(status.success(), "{} failed ({status})", script.display());
    }
    Ok(())
}

/// The workspace root: xtask lives one level below it.
fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest_dir)
}
