//! `cargo xtask bench replan`: four emulated CPU ranks (speed 0.5 each: 2 cores' worth),
//! rank 1 four times slower from iteration 20 of 60, with the default watch (20 % over
//! 10 steps). Measured per repeat, in the same run: the step before the change; after
//! it without re-planning (`--replan off`); with `--replan auto`, the steps between the
//! change and the switch, the switch itself, and the last 20 steps against a fresh run
//! of the plan it switched to at the new speeds from its first step; and the whole
//! run's time both ways.

use crate::common::{data, median, release_binary, run, train_command, write_json, Data};
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};

const ITERS: usize = 60;
/// The first slow iteration.
const CHANGE: usize = 20;
const REPEATS: usize = 3;
/// Steps compared after the switch.
const LAST: usize = 20;
const SPEEDS: &str = "0.5,0.5,0.5,0.5";
const SLOWER: &str = "20:1:0.125";

fn model_flags() -> Vec<&'static str> {
    vec![
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "256",
        "--seq-length",
        "128",
        "--global-batch-size",
        "16",
        "--nproc",
        "4",
        "--threads",
        "1",
    ]
}

/// One run's iteration records and other records of its JSON log.
struct Log {
    /// Step seconds by iteration (1-based: `steps[i - 1]`).
    steps: Vec<f64>,
    records: Vec<serde_json::Value>,
}

impl Log {
    fn read(path: &Path) -> Result<Log> {
        let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        let records: Vec<serde_json::Value> = (text.lines())
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()
            .with_context(|| path.display().to_string())?;
        let steps = (records.iter())
            .filter_map(|r| r.get("elapsed_ms").and_then(|v| v.as_f64()))
            .map(|ms| ms / 1e3)
            .collect();
        Ok(Log { steps, records })
    }

    /// Median step over iterations `from..=to`.
    fn median(&self, from: usize, to: usize) -> f64 {
        median(&self.steps[from - 1..to])
    }

    fn total_s(&self) -> f64 {
        self.steps.iter().sum()
    }

    fn nested(&self, key: &str) -> Vec<&serde_json::Value> {
        self.records.iter().filter_map(|r| r.get(key)).collect()
    }
}

/// Trains the scenario (or a plan) with `extra`, logging to `NAME.jsonl`.
fn train(
    bin: &Path,
    data: &Data,
    dir: &Path,
    name: &str,
    iters: usize,
    extra: &[&str],
) -> Result<Log> {
    let log = dir.join(format!("{name}.jsonl"));
    let mut cmd = train_command(bin, data, dir, iters, &log);
    cmd.args(model_flags()).args(extra);
    run(&mut cmd, &format!("train {name}"))?;
    Log::read(&log)
}

/// What one repeat measured.
struct Repeat {
    before_s: f64,
    off_after_s: f64,
    auto_until_switch_s: f64,
    auto_last_s: f64,
    fresh_last_s: f64,
    switched_after: u64,
    switches: usize,
    switch_s: f64,
    predicted_s: f64,
    auto_total_s: f64,
    off_total_s: f64,
}

impl Repeat {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "before_s": self.before_s,
            "off_after_s": self.off_after_s,
            "auto_until_switch_s": self.auto_until_switch_s,
            "auto_last_s": self.auto_last_s,
            "fresh_last_s": self.fresh_last_s,
            "switched_after": self.switched_after,
            "switches": self.switches,
            "switch_s": self.switch_s,
            "predicted_s": self.predicted_s,
            "auto_total_s": self.auto_total_s,
            "off_total_s": self.off_total_s,
        })
    }
}

fn repeat(bin: &Path, data: &Data, dir: &Path, k: usize) -> Result<Repeat> {
    let base = ["--micro-batch-size", "1", "--emulate-device-speed", SPEEDS];
    let with = |mode| {
        [
            &base[..],
            &["--emulate-speed-change", SLOWER, "--replan", mode],
        ]
        .concat()
    };
    let auto = train(bin, data, dir, &format!("auto-{k}"), ITERS, &with("auto"))?;
    let off = train(bin, data, dir, &format!("off-{k}"), ITERS, &with("off"))?;
    let decisions = auto.nested("replan");
    let switched: Vec<_> = (decisions.iter())
        .filter(|d| d["switched"].as_bool() == Some(true))
        .collect();
    ensure!(!switched.is_empty(), "auto-{k}: no switch: {decisions:?}");
    let first = switched[0];
    let switched_after = first["iteration"].as_u64().unwrap_or(0);
    let plan: PathBuf = dir.join(format!("replanned-{k}.json"));
    std::fs::write(&plan, first["proposed_plan"].to_string())?;
    let plan = plan.display().to_string();
    let fresh_args = [
        "--plan",
        &plan,
        "--emulate-device-speed",
        "0.5,0.125,0.5,0.5",
    ];
    let fresh = train(bin, data, dir, &format!("fresh-{k}"), 30, &fresh_args)?;
    let outcome = auto.nested("replan_outcome");
    let switch_s = outcome
        .first()
        .and_then(|o| o["switch_s"].as_f64())
        .unwrap_or(f64::NAN);
    Ok(Repeat {
        before_s: auto.median(6, CHANGE - 1),
        off_after_s: off.median(CHANGE + 10, ITERS),
        auto_until_switch_s: auto.median(CHANGE, switched_after as usize),
        auto_last_s: auto.median(ITERS - LAST + 1, ITERS),
        fresh_last_s: fresh.median(30 - LAST + 1, 30),
        switched_after,
        switches: switched.len(),
        switch_s,
        predicted_s: first["proposed_step_s"].as_f64().unwrap_or(f64::NAN),
        auto_total_s: auto.total_s(),
        off_total_s: off.total_s(),
    })
}

fn spread(values: &[f64]) -> String {
    let (lo, hi) = (values.iter()).fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    format!("{:.4} s ({lo:.4}..{hi:.4})", median(values))
}

pub fn replan(root: &Path) -> Result<()> {
    let bin = release_binary(root)?;
    let dir = root.join("target/bench/replan");
    std::fs::create_dir_all(&dir)?;
    let data = data(root, &bin, &dir)?;
    let mut runs = Vec::new();
    for k in 0..REPEATS {
        runs.push(repeat(&bin, &data, &dir, k)?);
    }
    let col = |f: fn(&Repeat) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
    let (before, off, until, last, fresh) = (
        col(|r| r.before_s),
        col(|r| r.off_after_s),
        col(|r| r.auto_until_switch_s),
        col(|r| r.auto_last_s),
        col(|r| r.fresh_last_s),
    );
    let (switch, auto_total, off_total) = (
        col(|r| r.switch_s),
        col(|r| r.auto_total_s),
        col(|r| r.off_total_s),
    );
    let vs_fresh = median(&last) / median(&fresh);
    let gain = median(&off) / median(&last);
    let end_to_end = median(&off_total) / median(&auto_total);
    println!("[replan] {REPEATS} repeats, median (min..max):");
    println!("[replan] step before the change: {}", spread(&before));
    println!("[replan] after it, --replan off: {}", spread(&off));
    println!(
        "[replan] after it, --replan auto, until the switch: {}",
        spread(&until)
    );
    println!("[replan] last {LAST} steps after the switch: {}; a fresh run of that plan: {} ({vs_fresh:.3}x; target <= 1.10)", spread(&last), spread(&fresh));
    println!(
        "[replan] the switch: {}; switches per run {:?}, after iterations {:?}",
        spread(&switch),
        runs.iter().map(|r| r.switches).collect::<Vec<_>>(),
        runs.iter().map(|r| r.switched_after).collect::<Vec<_>>()
    );
    println!("[replan] {gain:.2}x faster steps than staying slow; the whole {ITERS}-iteration run {end_to_end:.2}x ({} vs {})", spread(&auto_total), spread(&off_total));
    let out = root.join("target/bench/replan.json");
    write_json(
        &out,
        &serde_json::json!({
            "benchmark": "replan",
            "iterations": ITERS,
            "change": SLOWER,
            "speeds": SPEEDS,
            "repeats": REPEATS,
            "before_step_s": median(&before),
            "off_step_s": median(&off),
            "until_switch_step_s": median(&until),
            "after_switch_step_s": median(&last),
            "fresh_step_s": median(&fresh),
            "after_vs_fresh": vs_fresh,
            "gain_vs_off": gain,
            "run_speedup": end_to_end,
            "switch_s": median(&switch),
            "runs": runs.iter().map(Repeat::to_json).collect::<Vec<_>>(),
        }),
    )?;
    println!("wrote {}", out.display());
    Ok(())
}
