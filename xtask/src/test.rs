//! `cargo xtask test`: setup, then every check CI gates on, stopping at the first failure.

use crate::setup;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

pub fn run(root: &Path) -> Result<()> {
    let started = Instant::now();
    // The reference packages too: megatron-core loads the index caches synerfuse writes
    // in `synerfuse-data`'s tests.
    setup::run(root, true)?;
    check_dependency_rules(root)?;
    crate::structure::run(root)?;
    let nextest = Command::new("cargo")
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    let mut steps: Vec<(&str, Vec<&str>)> = Vec::new();
    if nextest {
        steps.push((
            "tests (nextest)",
            vec!["nextest", "run", "--workspace", "--no-fail-fast"],
        ));
        // nextest does not run doc tests; the READMEs' examples are doc tests.
        steps.push(("doc tests", vec!["test", "--workspace", "--doc"]));
    } else {
        println!("cargo-nextest not found; using cargo test (install it with `cargo install cargo-nextest`)");
        steps.push((
            "tests (cargo test)",
            vec!["test", "--workspace", "--no-fail-fast"],
        ));
    }
    steps.push((
        "clippy",
        vec![
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
            // Every unsafe block says why it is sound.
            "-D",
            "clippy::undocumented_unsafe_blocks",
        ],
    ));
    // `cargo add synerfuse-data` with default-features = false: no tokenizers, no C++.
    steps.push((
        "data crate without tokenizers",
        vec![
            "clippy",
            "--package",
            "synerfuse-data",
            "--no-default-features",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    ));
    steps.push(("rustfmt", vec!["fmt", "--all", "--", "--check"]));
    // The API documentation builds without a warning (broken links included).
    steps.push(("docs", vec!["doc", "--workspace", "--no-deps"]));
    for (name, args) in steps {
        let step_started = Instant::now();
        println!("== {name}: cargo {}", args.join(" "));
        let mut cargo = Command::new("cargo");
        if name == "docs" {
            cargo.env("RUSTDOCFLAGS", "-D warnings");
        }
        let status = cargo
            .args(&args)
            .current_dir(root)
            .status()
            .with_context(|| format!("could not start cargo for {name}"))?;
        if !status.success() {
            bail!("{name} failed ({status}): cargo {}", args.join(" "));
        }
        println!(
            "== {name}: ok in {:.1}s",
            step_started.elapsed().as_secs_f64()
        );
    }
    gpu_bundle_step(root)?;
    println!(
        "all checks passed in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The GPU machines' procedure as far as it runs without a GPU: a bundle of the debug
/// binaries the tests built, its `check.sh --cpu` in the GPU machine's view of the
/// filesystem (no system OpenMPI, no build tree, PyTorch at /opt/torch/.venv).
fn gpu_bundle_step(root: &Path) -> Result<()> {
    let step_started = Instant::now();
    println!("== gpu bundle: cargo xtask gpu-bundle --debug --check-cpu");
    let root_user = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if !root_user {
        println!("== gpu bundle: skipped (its mount namespace needs root; CI runs it)");
        return Ok(());
    }
    let bundle = crate::gpu_bundle::run(root, true)?;
    crate::gpu_bundle::check_cpu_as_gpu_machine(root, &bundle)?;
    println!(
        "== gpu bundle: ok in {:.1}s",
        step_started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Crates that bring libtorch, MPI or CUDA into a build.
const RUNTIME_NATIVE: &[&str] = &["tch", "torch-sys", "mpi", "mpi-sys", "cudarc"];

/// Crates the model crate must not reach: what runs does not depend on what chooses.
const ABOVE_THE_MODEL: &[&str] = &["synerfuse-planner"];

/// The crate boundaries (ARCHITECTURE.md): data never pulls libtorch (nor MPI/CUDA); the plan
/// crate, the planner and xtask are pure Rust (no `-sys` crate at all), so they build
/// anywhere; the model crate never depends on the planner.
fn check_dependency_rules(root: &Path) -> Result<()> {
    // (package, no `-sys` crate at all, extra cargo-tree arguments)
    for (package, pure, extra) in [
        ("synerfuse-data", false, &[][..]),
        // Without its tokenizers, the data crate builds no native code.
        ("synerfuse-data", true, &["--no-default-features"][..]),
        ("synerfuse-plan", true, &[]),
        ("synerfuse-planner", true, &[]),
        ("xtask", true, &[]),
    ] {
        let offending: Vec<String> = crates_in_tree(root, package, extra)?
            .into_iter()
            .filter(|name| {
                RUNTIME_NATIVE.contains(&name.as_str()) || (pure && name.ends_with("-sys"))
            })
            .collect();
        if !offending.is_empty() {
            bail!(
                "dependency rule broken: {package} {} pulls in {}",
                extra.join(" "),
                offending.join(", ")
            );
        }
    }
    check_model_without_planner(root)?;
    println!(
        "== dependency rules: ok (data without libtorch/MPI/CUDA, and without native code with --no-default-features; plan, planner and xtask pure Rust; the model crate without the planner)"
    );
    Ok(())
}

/// The crates in `package`'s normal and build dependency tree (`cargo tree` with `extra`
/// arguments), one name per line of its listing.
fn crates_in_tree(root: &Path, package: &str, extra: &[&str]) -> Result<Vec<String>> {
    let out = Command::new("cargo")
        .args(["tree", "--package", package, "--edges", "normal,build"])
        .args(["--prefix", "none"])
        .args(extra)
        .current_dir(root)
        .output()
        .with_context(|| format!("could not run cargo tree for {package}"))?;
    if !out.status.success() {
        bail!(
            "cargo tree -p {package} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// `synerfuse-model` builds on the plan crate alone: the planner is not in its tree.
fn check_model_without_planner(root: &Path) -> Result<()> {
    let above: Vec<String> = crates_in_tree(root, "synerfuse-model", &[])?
        .into_iter()
        .filter(|name| ABOVE_THE_MODEL.contains(&name.as_str()))
        .collect();
    if !above.is_empty() {
        bail!(
            "dependency rule broken: synerfuse-model pulls in {}",
            above.join(", ")
        );
    }
    Ok(())
}
