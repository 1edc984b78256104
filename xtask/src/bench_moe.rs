//! `cargo xtask bench moe`: an 8-expert model (top 2) on an expert-parallel pair of
//! unequal devices (CPU ranks emulated at speeds 1 and 0.5), each replica its own data.
//! Megatron's layout (equal batches, even experts) against the same batch split by pace
//! with even experts, and with the experts placed by pace too (`place_experts` over the
//! tokens per expert a first run measured: routing imbalance fed back), measured in
//! alternation in the same run; and tokens/s against the dense model of the same active
//! parameters (FFN width 2 x the experts') on the same pair.

use crate::common::{alternate_runs, data, median, print_spread, release_binary, run, write_json};
use crate::common::{train_command, Data};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use synerfuse_planner::planner::{place_experts, slowest_time, ExpertMember};

const SPEEDS: [f64; 2] = [1.0, 0.5];
const ITERS: usize = 12;
const REPEATS: usize = 3;
const EXPERTS: usize = 8;
const EXPERT_FFN: usize = 128;
const GLOBAL_BATCH: usize = 6;

/// The model: 2 layers of width 64 over 128 tokens, each MLP 8 experts of width 128 with
/// the top 2 per token (or, dense, one MLP of the same active width).
fn model_flags(experts: bool) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--max-position-embeddings",
        "128",
    ]
    .map(str::to_owned)
    .to_vec();
    let ffn = match experts {
        true => EXPERT_FFN,
        false => 2 * EXPERT_FFN,
    };
    flags.extend(["--ffn-hidden-size".into(), ffn.to_string()]);
    if experts {
        flags.extend(
            [
                "--num-experts",
                "8",
                "--moe-router-topk",
                "2",
                "--moe-aux-loss-coeff",
                "0.01",
            ]
            .map(str::to_owned),
        );
    }
    flags
}

/// A two-replica plan: micro-batches of `sizes[r]` (two each, or three of one), each
/// replica holding `experts[r]` (none: a dense model).
fn plan(
    dir: &Path,
    name: &str,
    sizes: [usize; 2],
    experts: Option<&[Vec<usize>]>,
) -> Result<PathBuf> {
    let path = dir.join(format!("{name}.toml"));
    let count = GLOBAL_BATCH / sizes.iter().sum::<usize>();
    let text: String = (0..2)
        .map(|r| {
            let held = experts.map_or(String::new(), |e| format!("experts = [{:?}]\n", e[r]));
            format!(
                "[[replica]]\nlayers = [2]\nmicro_batch_size = {}\nnum_micro_batches = {count}\n{held}\n",
                sizes[r]
            )
        })
        .collect();
    std::fs::write(&path, text)?;
    Ok(path)
}

/// Tokens per expert over a run (every step, both MoE layers), from its `--log-json`.
fn measured_load(log: &Path) -> Result<Vec<f64>> {
    let text = std::fs::read_to_string(log).with_context(|| log.display().to_string())?;
    let mut load = vec![0.0; EXPERTS];
    for line in text.lines().filter(|l| l.contains("\"tokens_per_expert\"")) {
        let record: serde_json::Value = serde_json::from_str(line)?;
        let layers = record["moe"]["tokens_per_expert"]
            .as_array()
            .context("no tokens")?;
        for layer in layers {
            for (e, n) in layer.as_array().context("no layer")?.iter().enumerate() {
                load[e] += n.as_f64().unwrap_or(0.0);
            }
        }
    }
    Ok(load)
}

fn command(
    bin: &Path,
    data: &Data,
    dir: &Path,
    layout: &Path,
    log: &Path,
) -> std::process::Command {
    let speeds = SPEEDS.map(|s| s.to_string()).join(",");
    let dense = layout.to_string_lossy().contains("dense");
    let mut cmd = train_command(bin, data, dir, ITERS, log);
    cmd.args(model_flags(!dense))
        .args(["--nproc", "2", "--threads", "1"])
        .args(["--emulate-device-speed", &speeds])
        .arg("--plan")
        .arg(layout);
    cmd
}

pub fn moe(root: &Path) -> Result<()> {
    let bin = release_binary(root)?;
    let dir = root.join("target/bench/moe");
    std::fs::create_dir_all(&dir)?;
    let data = data(root, &bin, &dir)?;
    let even_experts = vec![(0..4).collect::<Vec<_>>(), (4..8).collect()];
    let megatron = plan(&dir, "megatron", [1, 1], Some(&even_experts))?;
    // Routing imbalance fed back: the tokens each expert took in a first run.
    let calibration = dir.join("calibration.jsonl");
    run(
        &mut command(&bin, &data, &dir, &megatron, &calibration),
        "calibration run",
    )?;
    let load = measured_load(&calibration)?;
    let members = SPEEDS.map(|speed| ExpertMember {
        speed,
        capacity: EXPERTS,
    });
    let placed = place_experts(&load, &members)?;
    let layouts = [
        ("megatron", megatron),
        (
            "batch-by-pace",
            plan(&dir, "batch-by-pace", [2, 1], Some(&even_experts))?,
        ),
        (
            "experts-by-pace",
            plan(&dir, "experts-by-pace", [2, 1], Some(&placed))?,
        ),
        ("dense", plan(&dir, "dense", [2, 1], None)?),
    ];
    let runs = alternate_runs(&dir, &layouts, REPEATS, |layout, log| {
        command(&bin, &data, &dir, layout, log)
    })?;
    let steps: Vec<Vec<f64>> = (runs.iter())
        .map(|r| r.iter().map(|(s, _)| *s).collect())
        .collect();
    print_spread("moe", &layouts.each_ref().map(|(name, _)| *name), &steps);
    let step = |i: usize| median(&steps[i]);
    let tokens = (GLOBAL_BATCH * 128) as f64;
    let (megatron_s, batch_s, placed_s, dense_s) = (step(0), step(1), step(2), step(3));
    let speedup = megatron_s / placed_s;
    let share =
        (placed.iter()).map(|p| p.iter().map(|&e| load[e]).sum::<f64>() / load.iter().sum::<f64>());
    println!(
        "[moe] measured tokens per expert {load:?}; placed by pace {placed:?} (load shares {:?}; slowest member {:.0} vs even {:.0})",
        share.collect::<Vec<_>>(),
        slowest_time(&load, &members, &placed),
        slowest_time(&load, &members, &even_experts),
    );
    println!(
        "[moe] EP 2 at speeds {SPEEDS:?}: experts and batch by pace {placed_s:.4} s vs Megatron's even {megatron_s:.4} s per step = {speedup:.2}x (batch by pace, even experts: {batch_s:.4} s); {:.0} tokens/s vs the dense model of the same active parameters {:.0} tokens/s ({:.2}x)",
        tokens / placed_s,
        tokens / dense_s,
        dense_s / placed_s,
    );
    let out = root.join("target/bench/moe.json");
    write_json(
        &out,
        &serde_json::json!({
            "benchmark": "moe",
            "speeds": SPEEDS,
            "experts": EXPERTS,
            "top_k": 2,
            "global_batch_size": GLOBAL_BATCH,
            "iterations": ITERS,
            "repeats": REPEATS,
            "measured_tokens_per_expert": load,
            "placement_by_pace": placed,
            "megatron_step_s": megatron_s,
            "batch_by_pace_step_s": batch_s,
            "experts_by_pace_step_s": placed_s,
            "dense_step_s": dense_s,
            "speedup": speedup,
            "tokens_per_s": tokens / placed_s,
            "dense_tokens_per_s": tokens / dense_s,
            "step_s_runs": {
                "megatron": steps[0],
                "batch_by_pace": steps[1],
                "experts_by_pace": steps[2],
                "dense": steps[3],
            },
        }),
    )?;
    println!("wrote {}", out.display());
    Ok(())
}
