//! `cargo xtask bench cp`: one context-parallel group of two unequal devices (CPU ranks
//! emulated at speeds 1 and 0.5) on a sequence long enough that attention dominates, its
//! sequences split in the token shares the planner chooses for those speeds against
//! Megatron's even split, measured in alternation in the same run, with each rank's
//! memory.
//!
//! With even shares the slow device computes half of every sequence at half the speed,
//! so the pair runs at its pace; shares by speed give both the same time per layer:
//! ideally 1.5x faster per step, less what is not split (the exchange of keys and
//! values, the optimizer).

use crate::common::{
    alternate_runs, data, last_json_line, median, print_spread, release_binary, train_command,
    write_json,
};
use anyhow::{Context, Result};
use std::path::Path;
use synerfuse_plan::ModelShape;
use synerfuse_planner::planner::best_context_group;

/// Relative speeds of the two ranks, in cores (1.5 cores in all: a 2-core machine runs
/// them without contention).
const SPEEDS: [f64; 2] = [1.0, 0.5];
const ITERS: usize = 12;
const REPEATS: usize = 3;
const GLOBAL_BATCH: usize = 2;
const SEQUENCE: usize = 2048;

/// A narrow model over a long sequence: per layer the attention over 2048 positions
/// (about 4 S² h FLOPs) outweighs the projections and FFN (about 24 S h²) twelve to one.
fn model_flags() -> Vec<String> {
    [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "128",
        "--seq-length",
        &SEQUENCE.to_string(),
        "--max-position-embeddings",
        &SEQUENCE.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The planner's shares for the two speeds (each device's layer time the inverse of its
/// speed), in lowest terms.
fn planner_shares() -> Result<Vec<u32>> {
    let model = ModelShape {
        num_layers: 2,
        hidden_size: 64,
        num_heads: 4,
        num_kv_heads: 4,
        ffn_hidden_size: 128,
        vocab_size: 2048,
        seq_length: SEQUENCE,
        tied: true,
        experts: None,
    };
    let layer_s = SPEEDS.map(|s| 1.0 / s);
    let group = best_context_group(&model, &[0, 1], &layer_s)
        .context("the planner found no context-parallel split of the sequence")?;
    Ok(group.shares)
}

/// A one-replica plan of one stage on a context-parallel pair with `shares`.
fn plan(dir: &Path, name: &str, shares: &[u32]) -> Result<std::path::PathBuf> {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[[replica]]\nlayers = [2]\ncp = [2]\ncp_shares = [{shares:?}]\nmicro_batch_size = 1\nnum_micro_batches = {GLOBAL_BATCH}\n",
    );
    std::fs::write(&path, text)?;
    Ok(path)
}

/// Each rank's state and activation high-water mark in the log's last record, bytes.
fn rank_memory(log: &Path) -> Result<Vec<(u64, u64)>> {
    let text = std::fs::read_to_string(log).with_context(|| log.display().to_string())?;
    let last = (text.lines().rev())
        .find(|l| l.contains("\"ranks\""))
        .context("no step record")?;
    let record = last_json_line(last)?;
    let ranks = record["ranks"].as_array().context("no ranks")?;
    Ok(ranks
        .iter()
        .map(|r| {
            let bytes = |key: &str| r[key].as_u64().unwrap_or(0);
            (bytes("state_bytes"), bytes("activation_peak_bytes"))
        })
        .collect())
}

/// Each rank's median (over the steps after the first five) fraction of the step spent
/// in communication: the keys' and values' exchange, the gradients' all-reduce over the
/// pair, and the waits inside them. What a ring of sends overlapped with attention could
/// hide at most.
fn communication_fractions(log: &Path) -> Result<Vec<f64>> {
    let text = std::fs::read_to_string(log).with_context(|| log.display().to_string())?;
    let mut by_rank: Vec<Vec<f64>> = Vec::new();
    for line in text.lines().filter(|l| l.contains("\"ranks\"")).skip(5) {
        let record = last_json_line(line)?;
        let ranks = record["ranks"].as_array().context("no ranks")?;
        by_rank.resize(ranks.len(), Vec::new());
        for (rank, times) in ranks.iter().enumerate() {
            let (communication, compute, idle) = (
                times["communication_ms"].as_f64().unwrap_or(0.0),
                times["compute_ms"].as_f64().unwrap_or(0.0),
                times["idle_ms"].as_f64().unwrap_or(0.0),
            );
            let step = communication + compute + idle;
            if step > 0.0 {
                by_rank[rank].push(communication / step);
            }
        }
    }
    Ok(by_rank.iter().map(|f| median(f)).collect())
}

pub fn cp(root: &Path) -> Result<()> {
    let bin = release_binary(root)?;
    let dir = root.join("target/bench/cp");
    std::fs::create_dir_all(&dir)?;
    let data = data(root, &bin, &dir)?;
    let shares = planner_shares()?;
    let layouts = [
        ("even", plan(&dir, "even", &[1, 1])?),
        ("planner", plan(&dir, "planner", &shares)?),
    ];
    let speeds = SPEEDS.map(|s| s.to_string()).join(",");
    let runs = alternate_runs(&dir, &layouts, REPEATS, |layout, log| {
        let mut cmd = train_command(&bin, &data, &dir, ITERS, log);
        cmd.args(model_flags())
            .args(["--nproc", "2", "--threads", "1"])
            .args(["--emulate-device-speed", &speeds])
            .arg("--plan")
            .arg(layout);
        cmd
    })?;
    let steps: Vec<Vec<f64>> = (runs.iter())
        .map(|r| r.iter().map(|(s, _)| *s).collect())
        .collect();
    // Each layout's memory as its last run measured it.
    let memory = (runs.iter())
        .map(|r| rank_memory(&r[r.len() - 1].1))
        .collect::<Result<Vec<_>>>()?;
    print_spread("cp", &layouts.each_ref().map(|(name, _)| *name), &steps);
    for ((name, _), ranks) in layouts.iter().zip(&memory) {
        for (rank, (state, peak)) in ranks.iter().enumerate() {
            println!("[cp] shares {name}: rank {rank} state {state} B, activation peak {peak} B");
        }
    }
    // Communication per rank, each layout's runs' medians.
    let communication = (runs.iter())
        .map(|r| {
            let each = (r.iter())
                .map(|(_, log)| communication_fractions(log))
                .collect::<Result<Vec<_>>>()?;
            Ok((0..SPEEDS.len())
                .map(|rank| median(&each.iter().map(|f| f[rank]).collect::<Vec<_>>()))
                .collect::<Vec<f64>>())
        })
        .collect::<Result<Vec<_>>>()?;
    for ((name, _), fractions) in layouts.iter().zip(&communication) {
        let percent: Vec<String> = fractions
            .iter()
            .map(|f| format!("{:.1} %", 100.0 * f))
            .collect();
        println!("[cp] shares {name}: communication per rank (of its step) {percent:?}");
    }
    let (even_s, planner_s) = (median(&steps[0]), median(&steps[1]));
    let speedup = even_s / planner_s;
    println!(
        "[cp] one CP group of speeds {SPEEDS:?}, sequence {SEQUENCE}: the planner's shares {shares:?} {planner_s:.4} s vs even {even_s:.4} s per step = {speedup:.2}x (ideal 1.5x; target >= 1.3x)"
    );
    let out = root.join("target/bench/cp.json");
    let memory_json = |ranks: &[(u64, u64)]| -> Vec<serde_json::Value> {
        (ranks.iter())
            .map(|&(s, a)| serde_json::json!({"state_bytes": s, "activation_peak_bytes": a}))
            .collect()
    };
    write_json(
        &out,
        &serde_json::json!({
            "benchmark": "cp",
            "speeds": SPEEDS,
            "sequence_length": SEQUENCE,
            "global_batch_size": GLOBAL_BATCH,
            "iterations": ITERS,
            "repeats": REPEATS,
            "planner_shares": shares,
            "even_step_s": even_s,
            "planner_step_s": planner_s,
            "speedup": speedup,
            "step_s_runs": { "even": steps[0], "planner": steps[1] },
            "memory_per_rank": { "even": memory_json(&memory[0]), "planner": memory_json(&memory[1]) },
            "communication_fraction_per_rank": { "even": communication[0], "planner": communication[1] },
        }),
    )?;
    println!("wrote {}", out.display());
    Ok(())
}
