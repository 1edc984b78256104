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

/// Preprocessing of >= 50 MB of Shakespeare JSONL with 2 workers, GPT-2 BPE and LLaMA-2
/// SentencePiece: our binary vs Megatron's preprocess logic (Python pool + megatron-core
/// builder), outputs byte-identical; for SentencePiece also the library's own 2-thread
/// id encoding, the ceiling of any wrapper.
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
    let python_timing = |args: &[&str]| -> Result<serde_like::Timing> {
        let out = Command::new(&python).arg(&script).args(args).output()?;
        ensure!(
            out.status.success(),
            "{args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        serde_like::parse(stdout.lines().last().unwrap_or(""))
            .with_context(|| format!("{args:?} printed {stdout}"))
    };
    let tok = dir.join("tokenizer");
    let cases: [(&str, &str, Vec<std::ffi::OsString>); 2] = [
        (
            "gpt2",
            "GPT2BPETokenizer",
            vec![
                "--vocab-file".into(),
                tok.join("vocab.json").into(),
                "--merge-file".into(),
                tok.join("merges.txt").into(),
            ],
        ),
        (
            "llama2",
            "Llama2Tokenizer",
            vec!["--tokenizer-model".into(), tok.join("llama.model").into()],
        ),
    ];
    let mut rows = Vec::new();
    let mut json = Vec::new();
    for (name, kind, flags) in cases {
        let reference_prefix = dir.join(format!("reference-{name}"));
        let reference = python_timing(&[
            "reference",
            dir.to_str().context("utf-8 path")?,
            &workers.to_string(),
            reference_prefix.to_str().context("utf-8 path")?,
            name,
        ])?;
        let ours_prefix = dir.join(format!("ours-{name}"));
        let started = Instant::now();
        let ours = Command::new(&synerfuse)
            .args([
                "preprocess",
                "--json-keys",
                "text",
                "--append-eod",
                "--tokenizer-type",
                kind,
            ])
            .args(&flags)
            .arg("--input")
            .arg(&corpus)
            .arg("--output-prefix")
            .arg(&ours_prefix)
            .args(["--workers", &workers.to_string()])
            .output()?;
        let seconds = started.elapsed().as_secs_f64();
        ensure!(
            ours.status.success(),
            "synerfuse preprocess failed: {}",
            String::from_utf8_lossy(&ours.stderr)
        );
        for ext in ["bin", "idx"] {
            let a = std::fs::read(format!("{}_text_document.{ext}", ours_prefix.display()))?;
            let b = std::fs::read(format!(
                "{}_text_document.{ext}",
                reference_prefix.display()
            ))?;
            ensure!(a == b, "{name}: outputs differ (.{ext})");
        }
        let ours_mbs = bytes / seconds / 1e6;
        let reference_mbs = reference.bytes / reference.seconds / 1e6;
        let ratio = ours_mbs / reference_mbs;
        let target = if name == "gpt2" { 4.0 } else { 3.0 };
        rows.push(format!("| {kind} | {ours_mbs:.2} | {reference_mbs:.2} | {ratio:.2}x (target >= {target}x) | yes |"));
        let mut entry = format!(
            "{{\"tokenizer\": \"{kind}\", \"ours_mb_s\": {ours_mbs:.3}, \"reference_mb_s\": {reference_mbs:.3}, \"ratio\": {ratio:.3}, \"byte_identical\": true"
        );
        if name == "llama2" {
            let ceiling = python_timing(&[
                "ceiling",
                dir.to_str().context("utf-8 path")?,
                &workers.to_string(),
            ])?;
            let ceiling_mbs = ceiling.bytes / ceiling.seconds / 1e6;
            let share = ours_mbs / ceiling_mbs;
            rows.push(format!(
                "| SentencePiece library alone (ids only, {workers} threads) | {ceiling_mbs:.2} | | ours = {:.0}% of it (target >= 90%) | |",
                share * 100.0
            ));
            entry.push_str(&format!(
                ", \"library_ceiling_mb_s\": {ceiling_mbs:.3}, \"share_of_ceiling\": {share:.3}"
            ));
        }
        entry.push('}');
        json.push(entry);
    }
    println!();
    println!(
        "preprocess, {workers} workers, {:.1} MB of JSONL (Shakespeare, ~4 KB documents)",
        bytes / 1e6
    );
    println!();
    println!(
        "| tokenizer | synerfuse MB/s | Megatron-style Python MB/s | ratio | byte-identical |"
    );
    println!("|---|---|---|---|---|");
    for row in rows {
        println!("{row}");
    }
    std::fs::write(
        root.join("target/bench/preprocess.json"),
        format!("{{\"benchmark\": \"preprocess\", \"workers\": {workers}, \"bytes\": {bytes}, \"results\": [{}]}}\n", json.join(", ")),
    )?;
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
