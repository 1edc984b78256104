//! `cargo xtask bench tp`: one tensor-parallel group of two unequal devices (CPU ranks
//! emulated at speeds 1 and 0.5), its tensors split by the devices' speeds (shares
//! [2, 1]) against Megatron's even split, measured in alternation in the same run.
//!
//! With even shares the slow device computes half of every layer at half the speed, so
//! the group runs at its pace; shares [2, 1] give both devices the same time per layer:
//! ideally 1.5x faster per step, less what is not split (norms, residuals, the
//! collectives themselves).

use crate::common::{
    alternate_runs, data, median, print_spread, release_binary, train_command, write_json,
};
use anyhow::Result;
use std::path::Path;

/// Relative speeds of the two ranks, in cores (1.5 cores in all: a 2-core machine runs
/// them without contention).
const SPEEDS: [f64; 2] = [1.0, 0.5];
const ITERS: usize = 15;
const REPEATS: usize = 3;
const GLOBAL_BATCH: usize = 4;
const MICRO_BATCH: usize = 2;

/// 12 heads (one key/value head each), 768 FFN columns and the 2048-token vocabulary all
/// split 2 : 1 exactly, so the measured ratio is the runtime's, not rounding's.
fn model_flags() -> Vec<&'static str> {
    vec![
        "--num-layers",
        "4",
        "--hidden-size",
        "192",
        "--num-attention-heads",
        "12",
        "--ffn-hidden-size",
        "768",
        "--seq-length",
        "128",
    ]
}

/// A one-replica plan of one stage on a tensor-parallel group of 2 with `shares`.
fn plan(dir: &Path, name: &str, shares: [u32; 2]) -> Result<std::path::PathBuf> {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[[replica]]\nlayers = [4]\ntp = [2]\ntp_shares = [[{}, {}]]\nmicro_batch_size = {MICRO_BATCH}\nnum_micro_batches = {}\n",
        shares[0],
        shares[1],
        GLOBAL_BATCH / MICRO_BATCH
    );
    std::fs::write(&path, text)?;
    Ok(path)
}

pub fn tp(root: &Path) -> Result<()> {
    let bin = release_binary(root)?;
    let dir = root.join("target/bench/tp");
    std::fs::create_dir_all(&dir)?;
    let data = data(root, &bin, &dir)?;
    let layouts = [
        ("even", plan(&dir, "even", [1, 1])?),
        ("by-speed", plan(&dir, "by-speed", [2, 1])?),
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
    print_spread("tp", &layouts.each_ref().map(|(name, _)| *name), &steps);
    let (even_s, by_speed_s) = (median(&steps[0]), median(&steps[1]));
    let speedup = even_s / by_speed_s;
    println!(
        "[tp] one TP group of speeds {SPEEDS:?}: shares [2, 1] {by_speed_s:.4} s vs even {even_s:.4} s per step = {speedup:.2}x (ideal 1.5x; target >= 1.3x)"
    );
    let out = root.join("target/bench/tp.json");
    write_json(
        &out,
        &serde_json::json!({
            "benchmark": "tp",
            "speeds": SPEEDS,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": MICRO_BATCH,
            "iterations": ITERS,
            "repeats": REPEATS,
            "even_step_s": even_s,
            "by_speed_step_s": by_speed_s,
            "speedup": speedup,
            "step_s_runs": { "even": steps[0], "by_speed": steps[1] },
        }),
    )?;
    println!("wrote {}", out.display());
    Ok(())
}
