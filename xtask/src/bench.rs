//! `cargo xtask bench NAME`: ours against a reference measured in the same run, as a ratio.

use crate::setup;
use anyhow::{bail, ensure, Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

pub fn run(root: &Path, name: &str) -> Result<()> {
    match name {
        "preprocess" => preprocess(root),
        other => bail!("unknown benchmark {other:?}; available: preprocess"),
    }
}

fn cargo_release_binary(root: &Path) -> Result<std::path::PathBuf> {
    let status = Command::new("cargo")
        .args(["build", "--release", "--quiet", "-p", "synerfuse-cli"])
        .current_dir(root)
        .status()?;
    ensure!(status.success(), "cargo build --release failed");
    Ok(root.join("target/release/synerfuse"))
}

/// GPT-2 BPE preprocessing of >= 50 MB of Shakespeare JSONL with 2 workers: our binary
/// vs Megatron's preprocess logic (Python pool + megatron-core builder); outputs must be
/// byte-identical.
fn preprocess(root: &Path) -> Result<()> {
    setup::run(root, true)?;
    let synerfuse = cargo_release_binary(root)?;
    let python = root.join(".venv/bin/python");
    let script = root.join("xtask/fixtures/bench_preprocess.py");
    let dir = root.join("target/bench/preprocess");
    let status = Command::new(&python)
        .arg(&script)
        .arg("prepare")
        .arg(root)
        .arg(&dir)
        .status()?;
    ensure!(status.success(), "preparing the corpus failed");
    let workers = 2;
    let corpus = dir.join("corpus.jsonl");
    let bytes = std::fs::metadata(&corpus)?.len() as f64;

    let reference = Command::new(&python)
        .arg(&script)
        .arg("reference")
        .arg(&dir)
        .arg(workers.to_string())
        .arg(dir.join("reference"))
        .output()?;
    ensure!(
        reference.status.success(),
        "reference failed: {}",
        String::from_utf8_lossy(&reference.stderr)
    );
    let stdout = String::from_utf8_lossy(&reference.stdout);
    let timing: serde_like::Timing = serde_like::parse(stdout.lines().last().unwrap_or(""))
        .with_context(|| format!("reference printed {stdout}"))?;

    let started = Instant::now();
    let ours = Command::new(&synerfuse)
        .args([
            "preprocess",
            "--json-keys",
            "text",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--append-eod",
        ])
        .arg("--input")
        .arg(&corpus)
        .arg("--output-prefix")
        .arg(dir.join("ours"))
        .arg("--vocab-file")
        .arg(dir.join("tokenizer/vocab.json"))
        .arg("--merge-file")
        .arg(dir.join("tokenizer/merges.txt"))
        .args(["--workers", &workers.to_string()])
        .output()?;
    let ours_seconds = started.elapsed().as_secs_f64();
    ensure!(
        ours.status.success(),
        "synerfuse preprocess failed: {}",
        String::from_utf8_lossy(&ours.stderr)
    );

    for ext in ["bin", "idx"] {
        let a = std::fs::read(dir.join(format!("ours_text_document.{ext}")))?;
        let b = std::fs::read(dir.join(format!("reference_text_document.{ext}")))?;
        ensure!(
            a == b,
            "outputs differ: ours_text_document.{ext} vs reference_text_document.{ext}"
        );
    }
    let ours_mbs = bytes / ours_seconds / 1e6;
    let reference_mbs = timing.bytes / timing.seconds / 1e6;
    let ratio = ours_mbs / reference_mbs;
    println!();
    println!(
        "| preprocess, GPT2BPETokenizer, {workers} workers, {:.1} MB | MB/s |",
        bytes / 1e6
    );
    println!("|---|---|");
    println!("| synerfuse | {ours_mbs:.2} |");
    println!("| Megatron-style Python (megatron-core 0.8.0 builder) | {reference_mbs:.2} |");
    println!("| ratio | {ratio:.2}x (target >= 4x), outputs byte-identical |");
    let json = format!(
        "{{\"benchmark\": \"preprocess-gpt2bpe\", \"workers\": {workers}, \"bytes\": {bytes}, \"ours_mb_s\": {ours_mbs:.3}, \"reference_mb_s\": {reference_mbs:.3}, \"ratio\": {ratio:.3}, \"byte_identical\": true}}\n"
    );
    std::fs::write(root.join("target/bench/preprocess.json"), json)?;
    Ok(())
}

/// The reference's one-line JSON result, read without a JSON dependency in xtask.
mod serde_like {
    use anyhow::{Context, Result};

    pub struct Timing {
        pub seconds: f64,
        pub bytes: f64,
    }

    pub fn parse(line: &str) -> Result<Timing> {
        let field = |name: &str| -> Result<f64> {
            let at = line
                .find(&format!("\"{name}\": "))
                .with_context(|| format!("no {name}"))?;
            let rest = &line[at + name.len() + 4..];
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            Ok(rest[..end].trim().parse()?)
        };
        Ok(Timing {
            seconds: field("seconds")?,
            bytes: field("bytes")?,
        })
    }
}
