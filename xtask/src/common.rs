//! What the benchmarks and the demo share: running commands, the release binary, JSON
//! results, medians, and the emulated 4-rank cluster with its tokenized corpus.

use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds the release `synerfuse` binary and returns its path.
pub fn release_binary(root: &Path) -> Result<PathBuf> {
    let status = Command::new("cargo")
        .args(["build", "--release", "--quiet", "-p", "synerfuse-cli"])
        .current_dir(root)
        .status()?;
    ensure!(status.success(), "cargo build --release failed");
    Ok(root.join("target/release/synerfuse"))
}

/// Runs `cmd` to completion; its stdout, or an error with both streams.
pub fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not run {what}"))?;
    ensure!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The median of `values` (upper median for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The last line of `text` as a JSON object (what the reference scripts and
/// `synerfuse ... --json` print).
pub fn last_json_line(text: &str) -> Result<serde_json::Value> {
    let line = text.lines().last().unwrap_or("");
    serde_json::from_str(line).with_context(|| format!("not a JSON line: {line}"))
}

/// The number `key` of a JSON object.
pub fn number(value: &serde_json::Value, key: &str) -> Result<f64> {
    value
        .get(key)
        .and_then(serde_json::Value::as_f64)
        .with_context(|| format!("no number {key} in {value}"))
}

/// Writes a benchmark's result as one JSON line (temp name, then rename).
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, format!("{value}\n")).with_context(|| tmp.display().to_string())?;
    std::fs::rename(&tmp, path).with_context(|| path.display().to_string())
}

/// The profile's emulated speed: 4 ranks at once within 2 cores.
pub const PROFILE_SPEED: f64 = 0.3;
/// The emulated 4-rank cluster of the bench, the tests and the demo.
pub const EMULATED_CLUSTER: &str = "examples/clusters/emulated-cpu.toml";

/// `synerfuse profile` on 4 CPU ranks at once, each emulated at [`PROFILE_SPEED`], for a
/// model (its flags) and micro-batch sizes, into `output`; returns what it printed.
pub fn emulated_profile(
    bin: &Path,
    model_flags: &[String],
    micro_batch_sizes: &str,
    output: &Path,
) -> Result<String> {
    run(
        Command::new(bin)
            .args([
                "profile",
                "--nproc",
                "4",
                "--device",
                "cpu",
                "--device-kind",
                "cpu",
            ])
            .args(["--micro-batch-sizes", micro_batch_sizes])
            .args(["--emulate-device-speed", &PROFILE_SPEED.to_string()])
            .args(model_flags)
            // The model train_command trains.
            .args(["--disable-bias-linear", "--vocab-size", "2048", "--output"])
            .arg(output),
        "synerfuse profile",
    )
}
/// The Shakespeare corpus, tokenized: a GPT-2-style BPE of 2048 tokens trained on it.
pub struct Data {
    pub prefix: PathBuf,
    pub vocab: PathBuf,
    pub merges: PathBuf,
}

/// Trains the tokenizer and preprocesses the corpus into `dir`, unless already there.
pub fn data(root: &Path, bin: &Path, dir: &Path) -> Result<Data> {
    let python = root.join(".venv/bin/python");
    let corpus = crate::setup::corpus_step(root, &python)?;
    tokenized(bin, &corpus, dir)
}

/// A GPT-2-style BPE of 2048 tokens trained on the JSONL `corpus` (`dir/tok/`) and the
/// corpus preprocessed with it (`dir/shk_text_document`), unless already there.
pub fn tokenized(bin: &Path, corpus: &Path, dir: &Path) -> Result<Data> {
    let tok = dir.join("tok");
    let data = Data {
        prefix: dir.join("shk_text_document"),
        vocab: tok.join("vocab.json"),
        merges: tok.join("merges.txt"),
    };
    if !data.vocab.exists() {
        run(
            Command::new(bin)
                .args(["tokenizer", "train", "--vocab-size", "2048", "--gpt2-files"])
                .arg("--input")
                .arg(corpus)
                .arg("--output")
                .arg(tok.join("tokenizer.json")),
            "tokenizer train",
        )?;
    }
    if !data.prefix.with_extension("idx").exists() {
        run(
            Command::new(bin)
                .args([
                    "preprocess",
                    "--tokenizer-type",
                    "GPT2BPETokenizer",
                    "--append-eod",
                    "--workers",
                    "2",
                ])
                .arg("--input")
                .arg(corpus)
                .arg("--output-prefix")
                .arg(dir.join("shk"))
                .arg("--vocab-file")
                .arg(&data.vocab)
                .arg("--merge-file")
                .arg(&data.merges),
            "preprocess",
        )?;
    }
    Ok(data)
}

/// Median `elapsed_ms` of iterations after the first 5 of a `--log-json` file (its
/// evaluation and speed-change records left out), in s.
pub fn median_step_s(log: &Path) -> Result<f64> {
    let text = std::fs::read_to_string(log).with_context(|| log.display().to_string())?;
    let mut ms: Vec<f64> = text
        .lines()
        .filter(|l| l.contains("\"elapsed_ms\""))
        .skip(5)
        .map(|l| number(&last_json_line(l)?, "elapsed_ms"))
        .collect::<Result<_>>()?;
    ensure!(!ms.is_empty(), "{} has too few iterations", log.display());
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2] / 1e3)
}

/// `synerfuse train` on CPU ranks over the benchmark data for `iters` iterations, logging
/// every iteration's record to `log` (removed first), each with every rank's spans (what
/// a calibration fits by; a log line per iteration); the caller adds the model and the
/// layout.
pub fn train_command(bin: &Path, data: &Data, dir: &Path, iters: usize, log: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("train")
        .args([
            "--disable-bias-linear",
            "--train-iters",
            &iters.to_string(),
            "--lr",
            "1e-3",
            "--device",
            "cpu",
        ])
        .args([
            "--split",
            "100,0,0",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--log-interval",
            "1",
        ])
        .arg("--data-path")
        .arg(&data.prefix)
        .arg("--data-cache-path")
        .arg(dir.join("cache"))
        .arg("--vocab-file")
        .arg(&data.vocab)
        .arg("--merge-file")
        .arg(&data.merges)
        .arg("--log-json")
        .arg(log);
    let _ = std::fs::remove_file(log);
    cmd
}

/// Runs `repeats` rounds of every one of `layouts` in turn (alternating, so drift hits
/// them alike), each run the command `command(layout, log)` builds, logging to
/// `dir/NAME-ROUND.jsonl`; per layout, each run's median step (s) and its log.
pub fn alternate_runs(
    dir: &Path,
    layouts: &[(&str, std::path::PathBuf)],
    repeats: usize,
    command: impl Fn(&Path, &Path) -> Command,
) -> Result<Vec<Vec<(f64, std::path::PathBuf)>>> {
    let mut runs: Vec<Vec<(f64, std::path::PathBuf)>> = vec![Vec::new(); layouts.len()];
    for repeat in 0..repeats {
        for ((name, layout), done) in layouts.iter().zip(&mut runs) {
            let log = dir.join(format!("{name}-{repeat}.jsonl"));
            run(&mut command(layout, &log), &format!("train {name}"))?;
            done.push((median_step_s(&log)?, log));
        }
    }
    Ok(runs)
}

/// Prints each layout's median step over its runs and their spread, tagged `tag`.
pub fn print_spread(tag: &str, names: &[&str], steps: &[Vec<f64>]) {
    for (name, times) in names.iter().zip(steps) {
        let (lo, hi) = (times.iter()).fold((f64::MAX, f64::MIN), |(l, h), &t| (l.min(t), h.max(t)));
        println!(
            "[{tag}] shares {name}: median step {:.4} s over {} runs ({lo:.4}..{hi:.4} s)",
            median(times),
            times.len()
        );
    }
}
