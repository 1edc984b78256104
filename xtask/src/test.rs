//! `cargo xtask test`: setup, then every check CI gates on, stopping at the first failure.

use crate::setup;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

pub fn run(root: &Path) -> Result<()> {
    let started = Instant::now();
    setup::run(root, false)?;
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
        ],
    ));
    steps.push(("rustfmt", vec!["fmt", "--all", "--", "--check"]));
    for (name, args) in steps {
        let step_started = Instant::now();
        println!("== {name}: cargo {}", args.join(" "));
        let status = Command::new("cargo")
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
    println!(
        "all checks passed in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
