//! `cargo xtask bench islands`: reductions across emulated hosts and sites.
//!
//! "Within a host" is the machine's own all-reduce bandwidth between its ranks (MPI over
//! shared memory, the bus bandwidth `synerfuse profile` measures in the same run, with
//! four ranks on it); links between emulated hosts and sites are stated against it.
//!
//! 1. Four CPU ranks (speed 0.5 each: two cores' worth) in one data-parallel group on
//!    two emulated hosts, joined by a link ten times slower than within a host: the
//!    hierarchical reduction's step against the flat one's, alternating, with the bytes
//!    each sent across the link per step and the losses of both (the same within fp32
//!    rounding).
//! 2. The same four ranks as two emulated sites of two hosts each: hosts ten times
//!    slower than within a host, sites a hundred times: the plan `synerfuse plan`
//!    writes (priced as the runtime reduces, island by island) against the plan that
//!    keeps data parallelism flat across the sites (every rank a replica, reduced flat;
//!    the planner's own pricing of it with `--no-hierarchical-reduction`), both
//!    measured, with the prediction error of each.

use crate::common::{
    alternate_runs, data, emulated_profile, last_json_line, median, number, print_spread,
    release_binary, run, train_command, write_json, Data,
};
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

const ITERS: usize = 10;
const REPEATS: usize = 3;
const SPEED: f64 = 0.5;
const GLOBAL_BATCH: usize = 4;
/// Runs of each layout across the sites (flat across them, a step takes seconds).
const SITE_REPEATS: usize = 2;

/// A small model over short sequences (3.2M parameters, 16 tokens per rank and step):
/// the reduction, not the computation, sets the step (what the bench is about); four
/// layers, so that pipelines can split it across the sites.
fn model_flags() -> Vec<String> {
    [
        "--num-layers",
        "4",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "512",
        "--seq-length",
        "16",
        // Untied: the planner does not price the tied embedding's all-reduce between a
        // pipeline's first and last stages (Megatron's embedding group), which across
        // the sites is most of a pipeline's step.
        "--untie-embeddings-and-output-weights",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The machine's all-reduce bus bandwidth between its ranks (GB/s), as `synerfuse
/// profile` measured it into `profile`.
fn machine_gbs(profile: &Path) -> Result<f64> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(profile)?)?;
    Ok(number(&json["network"], "allreduce_bytes_per_s")? / 1e9)
}

/// Four data-parallel replicas of one rank (all four layers) on hosts a, a, b, b.
fn two_hosts_plan(dir: &Path, name: &str, intra_gbs: f64) -> Result<PathBuf> {
    let replica = |node: &str| {
        format!("[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 1\nspeeds = [{SPEED}]\nnodes = [\"{node}\"]\n\n")
    };
    let text = format!(
        "[network]\nintra_node_gbs = {intra_gbs}\ninter_node_gbs = {}\n\n{}",
        intra_gbs / 10.0,
        ["a", "a", "b", "b"].map(replica).concat()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text)?;
    Ok(path)
}

/// What crossed the emulated links per step (after the first five, medians, bytes).
struct Crossed {
    /// All ranks' bytes between nodes of one site.
    nodes: f64,
    /// The most one rank sent between nodes of one site.
    busiest: f64,
    /// All ranks' bytes between sites.
    sites: f64,
}

/// What crossed the links per step, and the losses.
fn crossed_and_losses(log: &Path) -> Result<(Crossed, Vec<f64>)> {
    let text = std::fs::read_to_string(log).with_context(|| log.display().to_string())?;
    let (mut nodes, mut busiest, mut sites, mut losses) = (vec![], vec![], vec![], vec![]);
    for line in text.lines().filter(|l| l.contains("\"ranks\"")) {
        let record = last_json_line(line)?;
        losses.push(number(&record, "loss")?);
        let ranks = record["ranks"].as_array().context("no ranks")?;
        let each = |key: &str| {
            ranks
                .iter()
                .filter_map(|r| r[key].as_f64())
                .collect::<Vec<_>>()
        };
        nodes.push(each("bytes_across_nodes").iter().sum());
        busiest.push(each("bytes_across_nodes").into_iter().fold(0.0, f64::max));
        sites.push(each("bytes_across_sites").iter().sum());
    }
    let steady = |v: Vec<f64>| median(&v.into_iter().skip(5).collect::<Vec<_>>());
    let crossed = Crossed {
        nodes: steady(nodes),
        busiest: steady(busiest),
        sites: steady(sites),
    };
    Ok((crossed, losses))
}

fn train(bin: &Path, data: &Data, dir: &Path, log: &Path) -> Command {
    let mut cmd = train_command(bin, data, dir, ITERS, log);
    cmd.args(model_flags()).args([
        "--nproc",
        "4",
        "--threads",
        "1",
        "--global-batch-size",
        &GLOBAL_BATCH.to_string(),
        "--max-position-embeddings",
        "16",
    ]);
    cmd
}

pub fn islands(root: &Path) -> Result<()> {
    let bin = release_binary(root)?;
    let dir = root.join("target/bench/islands");
    std::fs::create_dir_all(&dir)?;
    let data = data(root, &bin, &dir)?;
    let profile = dir.join("profile.json");
    emulated_profile(&bin, &model_flags(), "1", &profile)?;
    let machine = machine_gbs(&profile)?;
    let hosts = two_hosts(&bin, &data, &dir, machine)?;
    let sites = two_sites(&bin, &data, &dir, (&profile, machine))?;
    let out = root.join("target/bench/islands.json");
    write_json(
        &out,
        &serde_json::json!({
            "benchmark": "islands",
            "machine_allreduce_gbs": machine,
            "speed": SPEED,
            "iterations": ITERS,
            "repeats": REPEATS,
            "two_hosts": hosts,
            "two_sites": sites,
        }),
    )?;
    println!("wrote {}", out.display());
    Ok(())
}

/// Row 1: hierarchical against flat over two emulated hosts.
fn two_hosts(bin: &Path, data: &Data, dir: &Path, machine: f64) -> Result<serde_json::Value> {
    let plan = two_hosts_plan(dir, "two-hosts", machine)?;
    let layouts = [("hierarchical", plan.clone()), ("flat", plan)];
    let runs = alternate_runs(dir, &layouts, REPEATS, |_, log| {
        let mut cmd = train(bin, data, dir, log);
        cmd.arg("--plan").arg(&layouts[0].1);
        if log
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("flat"))
        {
            cmd.arg("--no-hierarchical-reduction");
        }
        cmd
    })?;
    let steps: Vec<Vec<f64>> = (runs.iter())
        .map(|r| r.iter().map(|(s, _)| *s).collect())
        .collect();
    print_spread("islands", &["hierarchical", "flat"], &steps);
    let (hier, hier_losses) = crossed_and_losses(&runs[0][0].1)?;
    let (flat, flat_losses) = crossed_and_losses(&runs[1][0].1)?;
    let (hier_bytes, flat_bytes) = (hier.nodes, flat.nodes);
    let busiest_ratio = hier.busiest / flat.busiest;
    let loss_diff = (hier_losses.iter().zip(&flat_losses))
        .map(|(a, b)| ((a - b) / b).abs())
        .fold(0.0, f64::max);
    let (hier_s, flat_s) = (median(&steps[0]), median(&steps[1]));
    let speedup = flat_s / hier_s;
    println!(
        "[islands] 4 ranks on 2 emulated hosts, link {:.3} GB/s (within a host {machine:.2} GB/s / 10): hierarchical {hier_s:.4} s vs flat {flat_s:.4} s per step = {speedup:.2}x (target >= 1.5x); bytes across per step {hier_bytes:.0} vs {flat_bytes:.0} = {:.3} in all, {busiest_ratio:.3} on the busiest member's link (islands of 2: each member half the gradient, against a ring's 3/2 on each of its two crossing members); losses within {loss_diff:.1e}",
        machine / 10.0,
        hier_bytes / flat_bytes
    );
    Ok(serde_json::json!({
        "link_gbs": machine / 10.0,
        "hierarchical_step_s": hier_s,
        "flat_step_s": flat_s,
        "speedup": speedup,
        "target": 1.5,
        "step_s_runs": { "hierarchical": steps[0], "flat": steps[1] },
        "bytes_across_per_step": { "hierarchical": hier_bytes, "flat": flat_bytes },
        "bytes_ratio": hier_bytes / flat_bytes,
        "busiest_link_bytes_ratio": busiest_ratio,
        "max_rel_loss_diff": loss_diff,
    }))
}

/// Two sites of two hosts of one rank each: hosts within a site at a tenth of the
/// machine's bandwidth, the sites at a hundredth.
fn sites_cluster(dir: &Path, machine: f64) -> Result<PathBuf> {
    let group = |node: &str, site: &str| {
        format!("[[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"{node}\"\nsite = \"{site}\"\nspeed = {SPEED}\nmemory_gb = 16\n\n")
    };
    let text = format!(
        "{}{}{}{}[network]\nintra_node_gbs = {machine}\ninter_node_gbs = {}\ninter_site_gbs = {}\n",
        group("e0", "east"),
        group("e1", "east"),
        group("w0", "west"),
        group("w1", "west"),
        machine / 10.0,
        machine / 100.0
    );
    let path = dir.join("two-sites.toml");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// `synerfuse plan --json` for the two-site cluster, its plan written to `output` and
/// every even layout to `evens`.
fn plan_json(
    bin: &Path,
    (cluster, profile): (&Path, &Path),
    output: &Path,
    evens: &Path,
    flat: bool,
) -> Result<serde_json::Value> {
    let mut cmd = Command::new(bin);
    cmd.args(["plan", "--json", "--micro-batch-sizes", "1"])
        .args(["--global-batch-size", &GLOBAL_BATCH.to_string()])
        .args(model_flags())
        .args(["--vocab-size", "2048", "--use-distributed-optimizer", "off"])
        .arg("--cluster")
        .arg(cluster)
        .arg("--profile")
        .arg(profile)
        .arg("--output")
        .arg(output)
        .arg("--uniform-layouts-dir")
        .arg(evens);
    if flat {
        cmd.arg("--no-hierarchical-reduction");
    }
    let json = run(&mut cmd, "plan")?;
    serde_json::from_str(&json).context("plan --json")
}

/// Row 2: the planner's plan against data parallelism kept flat across two sites.
fn two_sites(
    bin: &Path,
    data: &Data,
    dir: &Path,
    (profile, machine): (&Path, f64),
) -> Result<serde_json::Value> {
    let cluster = sites_cluster(dir, machine)?;
    let planned = dir.join("sites-plan.toml");
    let j = plan_json(
        bin,
        (&cluster, profile),
        &planned,
        &dir.join("evens"),
        false,
    )?;
    let written = &j["written_plan"];
    let plan_predicted = number(written, "predicted_step_time_s")?;
    let plan_flags: Vec<String> = (written["train_flags"].as_array().into_iter().flatten())
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect();
    // Every rank a replica, reduced flat: the one-stage even layout priced flat.
    let flat_dir = dir.join("evens-flat");
    let f = plan_json(
        bin,
        (&cluster, profile),
        &dir.join("flat-plan.toml"),
        &flat_dir,
        true,
    )?;
    let evens = f["uniform_layouts"].as_array().context("no even layouts")?;
    let k = (evens.iter())
        .position(|u| u["pipeline_parallel_size"].as_u64() == Some(1))
        .context("no data-parallel layout fits")?;
    let flat_predicted = number(&evens[k], "predicted_step_time_s")?;
    let flat_plan = flat_dir.join(format!("uniform-{k}.toml"));
    let layouts = [("planner", planned.clone()), ("flat-dp", flat_plan.clone())];
    let runs = alternate_runs(dir, &layouts, SITE_REPEATS, |layout, log| {
        let mut cmd = train(bin, data, dir, log);
        cmd.arg("--plan").arg(layout);
        match layout == planned.as_path() {
            true => cmd.args(&plan_flags),
            false => cmd.arg("--no-hierarchical-reduction"),
        };
        cmd
    })?;
    let steps: Vec<Vec<f64>> = (runs.iter())
        .map(|r| r.iter().map(|(s, _)| *s).collect())
        .collect();
    print_spread("islands", &["planner", "flat-dp"], &steps);
    let (plan_s, flat_s) = (median(&steps[0]), median(&steps[1]));
    let error = |predicted: f64, measured: f64| (predicted - measured) / measured;
    let plan_sites = crossed_and_losses(&runs[0][0].1)?.0.sites;
    let flat_sites = crossed_and_losses(&runs[1][0].1)?.0.sites;
    let label = format!(
        "pp {} x dp {} ({})",
        j["pipeline_parallel_size"],
        j["data_parallel_size"],
        written["kind"].as_str().unwrap_or("grid")
    );
    ensure!(plan_s > 0.0 && flat_s > 0.0, "no step measured");
    println!(
        "[islands] 2 sites x 2 hosts, sites at {:.4} GB/s: the planner's plan ({label}) {plan_s:.4} s (predicted {plan_predicted:.4}, error {:+.1} %) vs data parallelism flat across the sites {flat_s:.4} s (predicted {flat_predicted:.4}, error {:+.1} %) = {:.2}x; bytes across the sites per step {plan_sites:.0} vs {flat_sites:.0}",
        machine / 100.0,
        100.0 * error(plan_predicted, plan_s),
        100.0 * error(flat_predicted, flat_s),
        flat_s / plan_s
    );
    Ok(serde_json::json!({
        "site_link_gbs": machine / 100.0,
        "plan": label,
        "plan_train_flags": plan_flags,
        "plan_step_s": plan_s,
        "plan_predicted_step_s": plan_predicted,
        "plan_prediction_error": error(plan_predicted, plan_s),
        "flat_dp_step_s": flat_s,
        "flat_dp_predicted_step_s": flat_predicted,
        "flat_dp_prediction_error": error(flat_predicted, flat_s),
        "speedup": flat_s / plan_s,
        "step_s_runs": { "planner": steps[0], "flat_dp": steps[1] },
        "bytes_across_sites_per_step": { "planner": plan_sites, "flat_dp": flat_sites },
    }))
}
