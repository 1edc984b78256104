//! `cargo xtask bench hetero` and `cargo xtask bench planner`: the planner proven in real
//! runs on an emulated heterogeneous CPU cluster, and its speed on a large cluster.

use crate::common::{
    data, emulated_profile, last_json_line, median, median_step_s, number, release_binary, run,
    train_command, write_json, Data, EMULATED_CLUSTER, PROFILE_SPEED,
};
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The emulated cluster (examples/clusters/emulated-cpu.toml): 4 CPU ranks at relative
/// speeds 1 : 1 : 0.5 : 1/3, in cores (emulation charges CPU time / speed), 1.42 cores
/// in all so that a 2-core machine runs them without contention.
const SPEEDS: [f64; 4] = [0.5, 0.5, 0.25, 0.16667];
/// Steps per run; the median of steps 6 and later is the run's step time.
const ITERS: usize = 12;
/// Global batches planned and run on the 4 ranks. None is chosen for the speeds: their
/// shares (6 : 6 : 3 : 2 of 17) divide none of them, so each plan pays its own rounding.
const GLOBAL_BATCHES: [usize; 4] = [32, 36, 64, 128];
/// The 2-rank clusters: relative speeds 1 : 0.5 and 1 : 0.3, with the global batches each
/// runs (their shares 2 : 1 and 10 : 3 divide neither).
const PAIRS: [([f64; 2], [usize; 2]); 2] = [([1.0, 0.5], [32, 64]), ([1.0, 0.3], [32, 64])];
/// A pair's fastest rank emulates this much of a core, not all of it: a rank at a whole
/// core shares it with its MPI progress thread and its neighbour's polling, and its
/// computations then ran slower than emulated (pipelines 17–30 % slower than predicted
/// on 2026-11-27), where a rank with headroom sleeps off the difference.
const PAIR_SCALE: f64 = 0.8;
/// The acceleration-ratio target at batches of at least 64, and the integer-split
/// ceiling's at smaller ones (where rounding the shares costs more than 5 %).
const ACCELERATION_TARGET: f64 = 0.95;
const CEILING_TARGET: f64 = 0.97;
/// How far the written plan may be behind the fastest layout measured, and a layout's
/// prediction from its measured median.
const FASTEST_TOLERANCE: f64 = 0.03;
const PREDICTION_TOLERANCE: f64 = 0.10;
/// Micro-batch sizes open to the plan and to the even layouts alike.
const MICRO_BATCH_SIZES: &str = "1,2,4";
/// Runs of the plan and of the best even layout (the median and the spread).
const REPEATS: usize = 3;
/// Gradient-reduction buckets (`--ddp-bucket-size`) scaled to this model as Megatron's
/// default (40M parameters) is to a 7B model's layer (202M): a fifth of a layer (198k).
const BUCKET_SIZE: &str = "40000";

fn model_flags() -> Vec<&'static str> {
    vec![
        "--num-layers",
        "8",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "344",
        "--seq-length",
        "128",
    ]
}

fn train(bin: &Path, data: &Data, dir: &Path, extra: &[String], log: &Path) -> Command {
    let mut cmd = train_command(bin, data, dir, ITERS, log);
    cmd.args(model_flags()).args(extra);
    cmd
}

/// Whether the scenarios shard the optimizer (`SYNERFUSE_BENCH_HETERO_DISTRIBUTED=1`):
/// planned with `--use-distributed-optimizer on --overlap-param-gather`, so that every
/// layout of more than one replica reduce-scatters its gradients and gathers its
/// parameters behind the next forward, as priced.
fn distributed() -> bool {
    std::env::var("SYNERFUSE_BENCH_HETERO_DISTRIBUTED").is_ok_and(|v| v == "1")
}

/// `layout` with its data-parallel reduction after the whole pipeline, whole
/// (`--no-overlap-grad-reduce`), and its parameter gathers after the optimizer: what
/// overlapping them gains (not priced: NaN).
fn without_overlap(layout: &Layout) -> Layout {
    let mut train_flags: Vec<String> = (layout.train_flags.iter())
        .filter(|f| *f != "--overlap-param-gather")
        .cloned()
        .collect();
    train_flags.push("--no-overlap-grad-reduce".into());
    Layout {
        file: layout.file.clone(),
        label: format!("{} (reduction after the pipeline)", layout.label),
        predicted_s: f64::NAN,
        train_flags,
    }
}

/// Each rank's median, over the steps after the fifth, of `key` (ms) in `log`'s records.
fn rank_medians_ms(log: &Path, key: &str) -> Result<Vec<f64>> {
    let text = std::fs::read_to_string(log).with_context(|| log.display().to_string())?;
    let mut per_rank: Vec<Vec<f64>> = Vec::new();
    for line in text
        .lines()
        .filter(|l| l.contains("\"elapsed_ms\""))
        .skip(5)
    {
        let record = last_json_line(line)?;
        for (r, rank) in (record["ranks"].as_array().into_iter().flatten()).enumerate() {
            if per_rank.len() <= r {
                per_rank.push(Vec::new());
            }
            per_rank[r].push(number(rank, key)?);
        }
    }
    Ok(per_rank.iter().map(|v| median(v)).collect())
}

/// A layout to run: its plan file, what it is, and the planner's predicted step.
struct Layout {
    file: PathBuf,
    label: String,
    predicted_s: f64,
    /// Flags it was priced with beside `--plan` (recomputation, the distributed
    /// optimizer, sequence parallelism).
    train_flags: Vec<String>,
}

/// A cluster and global batch to plan and run.
struct Scenario {
    /// The file-name stem of its plans and logs.
    name: String,
    /// What the cluster is, for the table.
    label: String,
    cluster: PathBuf,
    /// Each rank's emulated speed, in cores.
    speeds: Vec<f64>,
    global_batch: usize,
    /// Whether each device also runs alone (the acceleration ratio).
    alone: bool,
}

/// A cluster file of CPU ranks on this machine at `speeds` (one group each).
fn cluster_file(speeds: &[f64]) -> String {
    let groups: String = (speeds.iter())
        .map(|s| {
            format!("[[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"localhost\"\nspeed = {s}\n\n")
        })
        .collect();
    format!("{groups}[network]\nintra_node_gbs = 5\ninter_node_gbs = 5\nlatency_us = 20\n")
}

/// What `synerfuse plan --json` said for one scenario: the plan written, every grid
/// layout it considered (each even layout, and its best grid plan where per-replica
/// pipelines were written instead), and the largest micro-batch size of the plan.
struct Planned {
    plan: Layout,
    /// `grid` or `per_replica_pipelines`.
    written_kind: String,
    grids: Vec<Layout>,
    flags: String,
    micro_batch_size: usize,
    /// The integer-split ceiling as a fraction of the summed devices, as priced.
    integer_split_fraction: f64,
}

/// Plans the scenario with `profile`, writing the plan, the best grid plan and every
/// even layout under `dir`.
fn plan_scenario(bin: &Path, profile: &Path, dir: &Path, scenario: &Scenario) -> Result<Planned> {
    let name = &scenario.name;
    let plan = dir.join(format!("plan-{name}.toml"));
    let grid = dir.join(format!("grid-{name}.toml"));
    let evens_dir = dir.join(format!("even-{name}"));
    let _ = std::fs::remove_dir_all(&evens_dir);
    let sharded = match distributed() {
        true => &[
            "--use-distributed-optimizer",
            "on",
            "--overlap-param-gather",
        ][..],
        false => &[],
    };
    let json = run(
        Command::new(bin)
            .args(["plan", "--json", "--micro-batch-sizes", MICRO_BATCH_SIZES])
            .args(sharded)
            // Priced with the buckets it trains with: its train_flags carry them.
            .args(["--ddp-bucket-size", BUCKET_SIZE])
            .args(["--global-batch-size", &scenario.global_batch.to_string()])
            .args(model_flags())
            .args(["--vocab-size", "2048", "--cluster"])
            .arg(&scenario.cluster)
            .arg("--profile")
            .arg(profile)
            .arg("--output")
            .arg(&plan)
            .arg("--grid-output")
            .arg(&grid)
            .arg("--uniform-layouts-dir")
            .arg(&evens_dir),
        "plan",
    )?;
    let j: serde_json::Value = serde_json::from_str(&json).context("plan --json")?;
    let layers: Vec<u64> = (j["layers_per_stage"].as_array().into_iter().flatten())
        .filter_map(|x| x.as_u64())
        .collect();
    let sizes = &j["micro_batch_size_per_replica"];
    let counts = &j["num_micro_batches_per_replica"];
    let grid_label = format!(
        "grid plan: pp {} x dp {}, layers {layers:?}, micro-batch sizes {sizes}, counts {counts}",
        j["pipeline_parallel_size"], j["data_parallel_size"]
    );
    // The written plan: the grid plan, or per-replica pipelines where they are faster.
    let written = &j["written_plan"];
    let written_kind = written["kind"].as_str().unwrap_or("grid").to_owned();
    let pooled = written_kind == "per_replica_pipelines";
    let label = match pooled {
        true => format!(
            "per-replica pipelines: {}",
            j["per_replica_pipelines"]["replicas"]
        ),
        false => grid_label.clone(),
    };
    let plan = Layout {
        label,
        file: plan,
        predicted_s: number(written, "predicted_step_time_s")?,
        train_flags: train_flags(written),
    };
    let mut grids = (j["uniform_layouts"].as_array().into_iter().flatten())
        .enumerate()
        .map(|(k, u)| {
            Ok(Layout {
                file: evens_dir.join(format!("uniform-{k}.toml")),
                label: format!(
                    "even pp {} x dp {}, micro-batch size {} ({})",
                    u["pipeline_parallel_size"],
                    u["data_parallel_size"],
                    u["micro_batch_size"],
                    u["arrangement"].as_str().unwrap_or("")
                ),
                predicted_s: number(u, "predicted_step_time_s")?,
                train_flags: train_flags(u),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if pooled {
        grids.push(Layout {
            file: grid,
            label: grid_label,
            predicted_s: number(&j, "predicted_step_time_s")?,
            train_flags: train_flags(&j),
        });
    }
    ensure!(!grids.is_empty(), "no grid layout fits scenario {name}");
    Ok(Planned {
        plan,
        written_kind,
        grids,
        // Per-replica pipelines have no SynerFuse flags.
        integer_split_fraction: number(&j, "integer_split_tokens_per_s")?
            / number(&j, "bound_tokens_per_s")?,
        flags: match pooled {
            true => String::new(),
            false => j["synerfuse_flags"].as_str().unwrap_or("").to_owned(),
        },
        micro_batch_size: match pooled {
            true => &j["per_replica_pipelines"]["replicas"],
            false => sizes,
        }
        .as_array()
        .and_then(|v| {
            let size = |x: &serde_json::Value| x.get("micro_batch_size").unwrap_or(x).as_u64();
            v.iter().filter_map(size).max()
        })
        .context("the written plan's micro-batch sizes")? as usize,
    })
}

/// The `synerfuse train` flags `synerfuse plan` priced a plan with (its JSON's
/// `train_flags`).
fn train_flags(j: &serde_json::Value) -> Vec<String> {
    (j["train_flags"].as_array().into_iter().flatten())
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect()
}

/// One run of `layout` on `nproc` emulated ranks: its median step time.
fn measure(
    bin: &Path,
    data: &Data,
    (dir, nproc): (&Path, usize),
    layout: &Layout,
    run_name: &str,
) -> Result<f64> {
    let log = dir.join(format!("{run_name}.jsonl"));
    let mut flags = vec![
        "--nproc".to_owned(),
        nproc.to_string(),
        "--plan".to_owned(),
        layout.file.display().to_string(),
    ];
    flags.extend(layout.train_flags.iter().cloned());
    run(
        &mut train(bin, data, dir, &flags, &log),
        &format!("train {}", layout.label),
    )?;
    let step = median_step_s(&log)?;
    println!(
        "[hetero] {}: {step:.4} s per step (predicted {:.4} s, {:+.1}%)",
        layout.label,
        layout.predicted_s,
        (layout.predicted_s / step - 1.0) * 100.0
    );
    Ok(step)
}

/// Summed tokens/s of each device alone: one rank, the whole global batch, its emulated
/// speed. Emulation charges CPU time, so they run at once without slowing each other
/// (their speeds fit in the machine's cores).
fn alone_tokens_per_s(
    bin: &Path,
    data: &Data,
    dir: &Path,
    scenario: &Scenario,
    micro_batch_size: usize,
) -> Result<f64> {
    let (name, global_batch) = (&scenario.name, scenario.global_batch);
    println!(
        "[hetero] each device alone ({} single-rank jobs at once), micro-batch size {micro_batch_size}",
        scenario.speeds.len()
    );
    let mut children = Vec::new();
    for (i, speed) in scenario.speeds.iter().enumerate() {
        let log = dir.join(format!("alone-{name}-{i}.jsonl"));
        let flags = [
            "--micro-batch-size".to_owned(),
            micro_batch_size.to_string(),
            "--global-batch-size".to_owned(),
            global_batch.to_string(),
            "--threads".to_owned(),
            "1".to_owned(),
            "--emulate-device-speed".to_owned(),
            speed.to_string(),
        ];
        let child = train(bin, data, dir, &flags, &log)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        children.push((log, child));
    }
    let tokens = (global_batch * 128) as f64;
    let mut total = 0.0;
    for (log, mut child) in children {
        ensure!(
            child.wait()?.success(),
            "single-device run {} failed",
            log.display()
        );
        total += tokens / median_step_s(&log)?;
    }
    Ok(total)
}

/// One scenario: every grid layout once, the plan and the fastest measured grid layout
/// REPEATS times in alternation, each device alone where asked; its JSON row.
fn one_scenario(
    bin: &Path,
    data: &Data,
    dir: &Path,
    scenario: &Scenario,
) -> Result<serde_json::Value> {
    let (name, global_batch) = (&scenario.name, scenario.global_batch);
    // Profiled just before its runs, and again after them: this shared machine's speed
    // drifts by tens of percent over the benchmark's hour and a half, which one profile
    // for every scenario would count as the model's error.
    let profile = profiled(bin, dir, &format!("profile-{name}"))?;
    let planned = plan_scenario(bin, &profile, dir, scenario)?;
    let on = (dir, scenario.speeds.len());
    println!("[hetero] {name}: {}", planned.plan.label);
    let mut grids = Vec::new();
    for (k, layout) in planned.grids.iter().enumerate() {
        grids.push(measure(bin, data, on, layout, &format!("grid-{name}-{k}"))?);
    }
    let best = (0..grids.len())
        .min_by(|&a, &b| grids[a].total_cmp(&grids[b]))
        .expect("a grid layout");
    let mut best_runs = vec![grids[best]];
    let mut plan_runs = Vec::new();
    // With each device alone measured (the acceleration ratio), the plan also runs with
    // its reduction after the pipeline, in alternation: what overlapping it gains.
    let (mut off_runs, off) = (Vec::new(), without_overlap(&planned.plan));
    for repeat in 0..REPEATS {
        let run_name = format!("plan-{name}-{repeat}");
        plan_runs.push(measure(bin, data, on, &planned.plan, &run_name)?);
        if scenario.alone {
            let run_name = format!("plan-no-overlap-{name}-{repeat}");
            off_runs.push(measure(bin, data, on, &off, &run_name)?);
        }
        if repeat > 0 {
            let run_name = format!("best-grid-{name}-{repeat}");
            best_runs.push(measure(bin, data, on, &planned.grids[best], &run_name)?);
        }
    }
    let tokens = (global_batch * 128) as f64;
    let (plan_s, best_s) = (median(&plan_runs), median(&best_runs));
    // Every layout's measured median: the best grid layout's over its repeats.
    let mut medians = grids.clone();
    medians[best] = best_s;
    // Each layout's first run's log (what a calibration prices it by).
    let logs = (0..grids.len())
        .map(|k| format!("grid-{name}-{k}"))
        .chain([format!("plan-{name}-0")])
        .map(|run| dir.join(format!("{run}.jsonl")));
    let mut layouts: Vec<serde_json::Value> = (planned.grids.iter().zip(&medians))
        .chain([(&planned.plan, &plan_s)])
        .zip(logs)
        .map(|((l, m), log)| {
            serde_json::json!({
                "layout": l.label, "predicted_step_s": l.predicted_s, "step_s": m,
                "prediction_error": (l.predicted_s - m) / m, "log": log,
            })
        })
        .collect();
    let after = profiled(bin, dir, &format!("profile-{name}-after"))?;
    let drift = machine_drift(&profile, &after)?;
    let calibration = calibrate_half(bin, dir, &profile, name, &mut layouts)
        .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let max_error = (layouts.iter())
        .filter_map(|l| l["prediction_error"].as_f64())
        .fold(0.0, |worst: f64, e| worst.max(e.abs()));
    let max_calibrated_error = (layouts.iter())
        .filter_map(|l| l["calibrated_prediction_error"].as_f64())
        .fold(f64::NAN, |worst: f64, e| worst.max(e.abs()));
    let fastest_grid = medians.iter().copied().fold(f64::MAX, f64::min);
    let mut row = serde_json::json!({
        "scenario": name,
        "cluster": scenario.label,
        "speeds": scenario.speeds,
        "global_batch_size": global_batch,
        "plan": planned.plan.label,
        "written_kind": planned.written_kind,
        "plan_flags": planned.flags,
        "plan_predicted_step_s": planned.plan.predicted_s,
        "plan_step_s_runs": plan_runs,
        "plan_step_s": plan_s,
        "best_grid": planned.grids[best].label,
        "best_grid_predicted_step_s": planned.grids[best].predicted_s,
        "best_grid_step_s_runs": best_runs,
        "best_grid_step_s": best_s,
        "best_grid_predicted_best": (0..grids.len()).all(|k| {
            planned.grids[best].predicted_s <= planned.grids[k].predicted_s
        }),
        "speedup": best_s / plan_s,
        // The written plan against the fastest layout measured (itself included).
        "plan_over_fastest": plan_s / plan_s.min(fastest_grid),
        "fastest_tolerance": FASTEST_TOLERANCE,
        "layouts": layouts,
        "max_prediction_error": max_error,
        "prediction_tolerance": PREDICTION_TOLERANCE,
        "calibration": calibration,
        "max_calibrated_prediction_error": max_calibrated_error,
        "machine_drift": drift,
        "integer_split_fraction": planned.integer_split_fraction,
    });
    let mut line = format!(
        "[hetero] {name}: plan {plan_s:.4} s (runs {plan_runs:?}) vs best measured grid layout {best_s:.4} s ({}) = {:.2}x; worst prediction {:.1}% off, {:.1}% after calibration by the other half; a layer {:+.1}% slower on this machine after the runs than before",
        planned.grids[best].label,
        best_s / plan_s,
        max_error * 100.0,
        max_calibrated_error * 100.0,
        drift * 100.0
    );
    if scenario.alone {
        // Alone at the plan's largest micro-batch size that divides the batch.
        let size = (1..=planned.micro_batch_size)
            .rev()
            .find(|b| global_batch % b == 0)
            .unwrap_or(1);
        let alone = alone_tokens_per_s(bin, data, dir, scenario, size)?;
        let ratios: Vec<f64> = plan_runs.iter().map(|s| tokens / s / alone).collect();
        let off_ratios: Vec<f64> = off_runs.iter().map(|s| tokens / s / alone).collect();
        let waits = |run: &str| {
            rank_medians_ms(&dir.join(format!("{run}-{name}-0.jsonl")), "reduce_wait_ms")
        };
        let (wait_on, wait_off) = (waits("plan")?, waits("plan-no-overlap")?);
        line += &format!(
            "; overlap off: acceleration ratio {:.1}% (runs {off_ratios:?}); waiting for the gradient reduction per rank {wait_off:.1?} ms off, {wait_on:.1?} ms on",
            median(&off_ratios) * 100.0
        );
        if distributed() {
            let gathers = |run: &str| {
                let log = dir.join(format!("{run}-{name}-0.jsonl"));
                rank_medians_ms(&log, "param_gather_wait_ms")
            };
            let (on, off) = (gathers("plan")?, gathers("plan-no-overlap")?);
            line += &format!(
                "; waiting for the parameter gathers per rank {off:.1?} ms after the optimizer, {on:.1?} ms overlapped"
            );
            row["distributed_optimizer"] = true.into();
            row["param_gather_wait_ms_per_rank"] = on.into();
            row["param_gather_wait_ms_per_rank_no_overlap"] = off.into();
        }
        row["no_overlap_step_s_runs"] = off_runs.clone().into();
        row["acceleration_ratio_no_overlap"] = median(&off_ratios).into();
        row["acceleration_ratio_no_overlap_runs"] = off_ratios.into();
        row["reduce_wait_ms_per_rank"] = wait_on.into();
        row["reduce_wait_ms_per_rank_no_overlap"] = wait_off.into();
        row["ddp_bucket_size"] = BUCKET_SIZE.into();
        let of_ceiling: Vec<f64> = (ratios.iter())
            .map(|r| r / planned.integer_split_fraction)
            .collect();
        line += &format!(
            "; acceleration ratio {:.1}% (runs {ratios:?}), {:.1}% of the integer-split ceiling ({:.1}%)",
            median(&ratios) * 100.0,
            median(&of_ceiling) * 100.0,
            planned.integer_split_fraction * 100.0
        );
        row["alone_tokens_per_s"] = alone.into();
        row["acceleration_ratio"] = median(&ratios).into();
        row["acceleration_ratio_runs"] = ratios.into();
        row["fraction_of_integer_split"] = median(&of_ceiling).into();
        row["fraction_of_integer_split_runs"] = of_ceiling.into();
        // Which target the batch is held to: the ratio itself at 64 and more.
        let (key, target) = match global_batch >= 64 {
            true => ("acceleration_ratio", ACCELERATION_TARGET),
            false => ("fraction_of_integer_split", CEILING_TARGET),
        };
        row["target"] = serde_json::json!({ "measure": key, "at_least": target });
    }
    println!("{line}");
    Ok(row)
}

/// The profile the benchmark's ranks measure now, written to `DIR/STEM.json`.
fn profiled(bin: &Path, dir: &Path, stem: &str) -> Result<PathBuf> {
    let profile = dir.join(format!("{stem}.json"));
    let flags: Vec<String> = model_flags().into_iter().map(str::to_owned).collect();
    emulated_profile(bin, &flags, MICRO_BATCH_SIZES, &profile)?;
    Ok(profile)
}

/// How much slower a layer's forward and backward are in `after` than in `before`
/// (their sum over the micro-batch sizes), as a fraction.
fn machine_drift(before: &Path, after: &Path) -> Result<f64> {
    let layer_s = |path: &Path| -> Result<f64> {
        let profile: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        let sizes = profile["devices"]["cpu"]
            .as_object()
            .context("a cpu profile")?;
        Ok((sizes.values())
            .map(|c| {
                number(c, "layer_fwd_s").unwrap_or(0.0) + number(c, "layer_bwd_s").unwrap_or(0.0)
            })
            .sum())
    };
    Ok(layer_s(after)? / layer_s(before)? - 1.0)
}

/// Calibrates `profile` by the runs of every other layout of a scenario (the first, the
/// third, ...: what `plan --try` does with the plans it tries), then prices the rest
/// with it, out of sample: each of those layouts' `calibrated_predicted_step_s` and
/// error. Returns the fitted terms.
fn calibrate_half(
    bin: &Path,
    dir: &Path,
    profile: &Path,
    name: &str,
    layouts: &mut [serde_json::Value],
) -> Result<serde_json::Value> {
    let logs = |parity: usize| -> Vec<String> {
        (layouts.iter().enumerate())
            .filter(|(k, _)| k % 2 == parity)
            .filter_map(|(_, l)| l["log"].as_str().map(str::to_owned))
            .collect()
    };
    let (by, checked) = (logs(0), logs(1));
    ensure!(
        !checked.is_empty(),
        "{name}: one layout, none left to check a calibration by"
    );
    let calibrated = dir.join(format!("profile-{name}-calibrated.json"));
    let fitted = calibrate(bin, profile, &calibrated, &by)?;
    let priced = calibrate(bin, &calibrated, &dir.join("unused.json"), &checked)?;
    let runs = priced["runs"].as_array().cloned().unwrap_or_default();
    for layout in layouts.iter_mut().skip(1).step_by(2) {
        // The run of the layout's plan (the log's first).
        let run = (runs.iter())
            .find(|r| r["name"] == layout["log"])
            .with_context(|| format!("no calibrated price of {}", layout["log"]))?;
        let predicted = number(run, "before_s")?;
        let measured = number(layout, "step_s")?;
        layout["calibrated_predicted_step_s"] = predicted.into();
        layout["calibrated_prediction_error"] = ((predicted - measured) / measured).into();
    }
    Ok(fitted["calibration"].clone())
}

/// `synerfuse profile --calibrate logs --profile profile --output output --json`.
fn calibrate(
    bin: &Path,
    profile: &Path,
    output: &Path,
    logs: &[String],
) -> Result<serde_json::Value> {
    let json = run(
        Command::new(bin)
            .args(["profile", "--json", "--profile"])
            .arg(profile)
            .arg("--output")
            .arg(output)
            .arg("--calibrate")
            .args(logs),
        "synerfuse profile --calibrate",
    )?;
    last_json_line(&json)
}

/// The memory-skewed cluster: one fast rank whose memory holds the whole model's training
/// state and three at a quarter of its speed with 30 MB, which (by the planner's memory
/// model) hold three layers and the embedding or head but not half the model: a grid
/// (every replica the same stages) can only be one four-stage pipeline, while per-replica
/// pipelines keep the fast rank whole beside a pipeline of the slow three.
const SKEWED_CLUSTER: &str = "\
[[group]]
kind = \"cpu\"
count = 1
node = \"localhost\"
speed = 0.5
memory_gb = 1

[[group]]
kind = \"cpu\"
count = 3
node = \"localhost\"
speed = 0.125
memory_gb = 0.03

[network]
intra_node_gbs = 5
inter_node_gbs = 5
latency_us = 20
";
/// Its global batch (shares 4 : 1 : 1 : 1 of 7 do not divide it).
const SKEWED_GLOBAL_BATCH: usize = 16;

/// The scenarios to run: those `SYNERFUSE_BENCH_HETERO` names (comma-separated: `32`,
/// `pair-1-0.5-64`, `skewed`, ...), every one when it is unset.
fn scenarios_wanted() -> impl Fn(&str) -> bool {
    let names: Option<Vec<String>> = std::env::var("SYNERFUSE_BENCH_HETERO")
        .ok()
        .map(|v| v.split(',').map(|n| n.trim().to_owned()).collect());
    move |name| names.as_ref().is_none_or(|n| n.iter().any(|x| x == name))
}

pub fn hetero(root: &Path) -> Result<()> {
    let bin = release_binary(root)?;
    let dir = root.join("target/bench/hetero");
    std::fs::create_dir_all(&dir)?;
    let data = data(root, &bin, &dir)?;
    println!(
        "[hetero] profiling before and after each scenario on 4 CPU ranks at once, each emulated at {PROFILE_SPEED} of a core"
    );
    let wanted = scenarios_wanted();
    let mut batches = Vec::new();
    for global_batch in GLOBAL_BATCHES {
        let scenario = Scenario {
            name: global_batch.to_string(),
            label: "4 emulated CPU ranks (1 : 1 : 0.5 : 1/3)".into(),
            cluster: root.join(EMULATED_CLUSTER),
            speeds: SPEEDS.to_vec(),
            global_batch,
            alone: true,
        };
        if wanted(&scenario.name) {
            batches.push(one_scenario(&bin, &data, &dir, &scenario)?);
            write_json(&dir.join("partial.json"), &serde_json::json!(batches))?;
        }
    }
    for (speeds, global_batches) in PAIRS {
        let stem = format!("pair-{}-{}", speeds[0], speeds[1]);
        let cluster = dir.join(format!("{stem}.toml"));
        let speeds = speeds.map(|s| s * PAIR_SCALE);
        std::fs::write(&cluster, cluster_file(&speeds))?;
        for global_batch in global_batches {
            let scenario = Scenario {
                name: format!("{stem}-{global_batch}"),
                label: format!(
                    "2 emulated CPU ranks (1 : {})",
                    (speeds[1] / speeds[0] * 100.0).round() / 100.0
                ),
                cluster: cluster.clone(),
                speeds: speeds.to_vec(),
                global_batch,
                alone: true,
            };
            if wanted(&scenario.name) {
                batches.push(one_scenario(&bin, &data, &dir, &scenario)?);
                write_json(&dir.join("partial.json"), &serde_json::json!(batches))?;
            }
        }
    }
    let skewed_cluster = dir.join("skewed-cluster.toml");
    std::fs::write(&skewed_cluster, SKEWED_CLUSTER)?;
    let skewed = Scenario {
        name: "skewed".into(),
        label:
            "memory-skewed cluster (1 rank holding the model, 3 at 1/4 its speed holding a third)"
                .into(),
        cluster: skewed_cluster,
        speeds: vec![0.5, 0.125, 0.125, 0.125],
        global_batch: SKEWED_GLOBAL_BATCH,
        alone: false,
    };
    let skewed = match wanted(&skewed.name) {
        true => one_scenario(&bin, &data, &dir, &skewed)?,
        false => serde_json::Value::Null,
    };
    let worst = |key: &str, pick: fn(f64, f64) -> f64, start: f64| {
        (batches.iter().chain([&skewed]))
            .filter_map(|b| b[key].as_f64())
            .fold(start, pick)
    };
    let summary = serde_json::json!({
        "benchmark": "hetero",
        "speeds": SPEEDS,
        "iterations": ITERS,
        "repeats": REPEATS,
        "micro_batch_sizes": MICRO_BATCH_SIZES,
        "batches": batches,
        "skewed": skewed,
        "min_speedup": (batches.iter())
            .filter_map(|b| b["speedup"].as_f64())
            .fold(f64::MAX, f64::min),
        "min_acceleration_ratio": worst("acceleration_ratio", f64::min, f64::MAX),
        "max_prediction_error": worst("max_prediction_error", f64::max, 0.0),
        "prediction_tolerance": PREDICTION_TOLERANCE,
        "max_plan_over_fastest": worst("plan_over_fastest", f64::max, 0.0),
        // NaN (null: "not measured") where no scenario's calibration was checked.
        "max_calibrated_prediction_error": worst("max_calibrated_prediction_error", f64::max, f64::NAN),
        "fastest_tolerance": FASTEST_TOLERANCE,
    });
    let out = root.join("target/bench/hetero.json");
    write_json(&out, &summary)?;
    println!("wrote {}", out.display());
    Ok(())
}

/// What one `synerfuse plan` run at scale gave: the planner's seconds, the command's,
/// and the written plan's fraction of the bound (each device alone, summed).
struct PlanningRun {
    planning_s: f64,
    command_s: f64,
    fraction_of_bound: f64,
    /// The expert layout's (TP in every node, fewest stages, even layers), priced alike.
    expert_fraction_of_bound: Option<f64>,
    /// Copies of a smaller cluster the search ran on (1: searched whole).
    folded: u64,
}

/// An 80-layer model of hidden 4096 (32 heads, 8 KV groups, FFN 11008), global batch 4096.
const MODEL_80_LAYERS: [&str; 17] = [
    "--num-layers",
    "80",
    "--hidden-size",
    "4096",
    "--num-attention-heads",
    "32",
    "--group-query-attention",
    "--num-query-groups",
    "8",
    "--ffn-hidden-size",
    "11008",
    "--vocab-size",
    "32000",
    "--seq-length",
    "4096",
    "--global-batch-size",
    "4096",
];
/// A 70B LLaMA (hidden 8192, 80 layers, 64 heads, 8 KV groups, FFN 28672), global batch
/// 1024 of 4096 tokens: issue 38's case.
const LLAMA_70B: [&str; 17] = [
    "--num-layers",
    "80",
    "--hidden-size",
    "8192",
    "--num-attention-heads",
    "64",
    "--group-query-attention",
    "--num-query-groups",
    "8",
    "--ffn-hidden-size",
    "28672",
    "--vocab-size",
    "32000",
    "--seq-length",
    "4096",
    "--global-batch-size",
    "1024",
];

/// The flags of `args` (each a name and its value, or a switch such as
/// `--group-query-attention` that takes none) less those whose names `extra` holds.
fn without_flags<'a>(args: &[&'a str], extra: &[&str]) -> Vec<&'a str> {
    let mut kept = Vec::with_capacity(args.len());
    let mut i = 0;
    while i < args.len() {
        let takes_value = args.get(i + 1).is_some_and(|next| !next.starts_with("--"));
        let end = i + 1 + usize::from(takes_value);
        if !extra.contains(&args[i]) {
            kept.extend_from_slice(&args[i..end]);
        }
        i = end;
    }
    kept
}

/// `synerfuse plan --json` for `model` on `nodes` nodes of 8 devices, shared out among
/// `kinds` (200 GB/s in a node, 25 GB/s between nodes), with `extra` flags (which replace
/// the model's of the same name).
fn time_planning(
    bin: &Path,
    dir: &Path,
    kinds: &[&str],
    nodes: usize,
    model: &[&str],
    extra: &[&str],
) -> Result<PlanningRun> {
    let devices = nodes * 8;
    let cluster = dir.join(format!("planner-{devices}.toml"));
    let mut text = String::new();
    for (i, kind) in kinds.iter().enumerate() {
        for node in 0..nodes / kinds.len() + usize::from(i < nodes % kinds.len()) {
            text.push_str(&format!(
                "[[group]]\nkind = \"{kind}\"\ncount = 8\nnode = \"{kind}-{i}-{node}\"\n"
            ));
        }
    }
    text.push_str("[network]\nintra_node_gbs = 200\ninter_node_gbs = 25\n");
    std::fs::write(&cluster, text)?;
    let model_flags = without_flags(model, extra);
    let started = std::time::Instant::now();
    let json = run(
        Command::new(bin)
            .args(["plan", "--json"])
            .args(&model_flags)
            .args(extra)
            .arg("--cluster")
            .arg(&cluster),
        "plan",
    )?;
    let command_s = started.elapsed().as_secs_f64();
    let report = last_json_line(&json)?;
    let planning_s = number(&report, "planning_time_s")?;
    let fraction_of_bound = number(&report["written_plan"], "fraction_of_bound")?;
    let expert_fraction_of_bound = report["expert_layout"]["fraction_of_bound"].as_f64();
    let folded = report["folded"].as_u64().unwrap_or(1);
    let expert =
        expert_fraction_of_bound.map_or("none fits".to_string(), |f| format!("{:.1} %", f * 100.0));
    println!(
        "planning {devices} devices of {} kinds ({nodes} nodes, searched on one of {folded} alike copies), {} {}: {planning_s:.3} s in the planner, {command_s:.3} s for the whole command; the written plan at {:.1} % of the bound, the expert layout at {expert}",
        kinds.len(),
        model_flags.join(" "),
        extra.join(" "),
        fraction_of_bound * 100.0
    );
    Ok(PlanningRun {
        planning_s,
        command_s,
        fraction_of_bound,
        expert_fraction_of_bound,
        folded,
    })
}

pub fn planner(root: &Path) -> Result<()> {
    let bin = release_binary(root)?;
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let four = ["h100-sxm", "a100-80g", "l40s", "a10"];
    let six = ["h100-sxm", "a100-80g", "l40s", "a10", "mi300x", "v100"];
    let small = time_planning(&bin, &dir, &four, 128, &MODEL_80_LAYERS, &[])?;
    let large = time_planning(&bin, &dir, &six, 1024, &MODEL_80_LAYERS, &[])?;
    let llama_70b = time_planning(&bin, &dir, &four, 128, &LLAMA_70B, &[])?;
    // 131,072 devices (16,384 nodes of 8, 4 kinds), the 70B model at 16,384 samples.
    let huge = time_planning(
        &bin,
        &dir,
        &four,
        16_384,
        &LLAMA_70B,
        &["--global-batch-size", "16384"],
    )?;
    write_json(
        &dir.join("planner.json"),
        &serde_json::json!({
            "benchmark": "planner",
            "devices": 1024,
            "kinds": 4,
            "layers": 80,
            "planning_s": small.planning_s,
            "command_s": small.command_s,
            "large_devices": 8192,
            "large_kinds": 6,
            "large_planning_s": large.planning_s,
            "large_command_s": large.command_s,
            "llama_70b_planning_s": llama_70b.planning_s,
            "llama_70b_command_s": llama_70b.command_s,
            "llama_70b_fraction_of_bound": llama_70b.fraction_of_bound,
            "llama_70b_expert_fraction_of_bound": llama_70b.expert_fraction_of_bound,
            "llama_70b_131072_devices_planning_s": huge.planning_s,
            "llama_70b_131072_devices_command_s": huge.command_s,
            "llama_70b_131072_devices_fraction_of_bound": huge.fraction_of_bound,
            "llama_70b_131072_devices_expert_fraction_of_bound": huge.expert_fraction_of_bound,
            "llama_70b_131072_devices_folded": huge.folded,
        }),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::without_flags;

    /// A switch between flags shifts no pair: the replaced flag and its value go, the
    /// switch stays (a `chunks(2)` over the arguments once kept a doubled
    /// `--global-batch-size` behind `--group-query-attention`).
    #[test]
    fn replaced_flags_go_with_their_values_and_switches_stay() {
        let model = [
            "--num-layers",
            "80",
            "--group-query-attention",
            "--num-query-groups",
            "8",
            "--global-batch-size",
            "1024",
        ];
        assert_eq!(
            without_flags(&model, &["--global-batch-size", "16384"]),
            [
                "--num-layers",
                "80",
                "--group-query-attention",
                "--num-query-groups",
                "8"
            ]
        );
        assert_eq!(without_flags(&model, &[]), model);
    }
}
