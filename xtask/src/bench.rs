//! `cargo xtask bench NAME`: ours against a reference measured in the same run, as a ratio.

use crate::common::{last_json_line, median, number, release_binary, write_json};
use crate::setup;
use anyhow::{bail, ensure, Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Every benchmark, in the order `cargo xtask bench` runs them.
const ALL: [&str; 10] = [
    "preprocess",
    "index",
    "model",
    "hetero",
    "tp",
    "cp",
    "moe",
    "planner",
    "replan",
    "islands",
];

pub fn run(root: &Path, name: Option<&str>) -> Result<()> {
    match name {
        // The table again from the benchmarks' latest results (after one was rerun).
        Some("summary") => summarize(root),
        Some(name) => run_one(root, name),
        None => {
            for name in ALL {
                println!("\n===== cargo xtask bench {name} =====");
                let started = Instant::now();
                run_one(root, name)?;
                println!(
                    "===== {name}: {:.0} s =====",
                    started.elapsed().as_secs_f64()
                );
            }
            summarize(root)
        }
    }
}

/// One headline row of the summary table.
struct Headline {
    benchmark: &'static str,
    measure: String,
    value: String,
    target: String,
    met: Option<bool>,
}

/// Reads every `target/bench/NAME.json` and writes `target/bench/results.json` (all of
/// them, dated) and `target/bench/results.md` (the headline table), and prints the table.
fn summarize(root: &Path) -> Result<()> {
    let dir = root.join("target/bench");
    let mut all = serde_json::Map::new();
    let mut rows = Vec::new();
    for name in ALL {
        let path = dir.join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| path.display().to_string())?;
        rows.extend(headlines(name, &v));
        all.insert(name.to_owned(), v);
    }
    let date = String::from_utf8_lossy(
        &Command::new("date")
            .args(["-u", "+%Y-%m-%d"])
            .output()
            .context("date")?
            .stdout,
    )
    .trim()
    .to_owned();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let machine = format!("{cores} cores ({cpu}), no GPU");
    let results = serde_json::json!({
        "date": date,
        "machine": machine,
        "command": "cargo xtask bench",
        "benchmarks": all,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&results)? + "\n",
    )?;
    let mut md = format!(
        "Measured {date} on {machine} with `cargo xtask bench`.\n\n\
         | benchmark | measure | result | target | met |\n|---|---|---|---|---|\n"
    );
    for r in &rows {
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "",
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {met} |\n",
            r.benchmark, r.measure, r.value, r.target
        ));
    }
    std::fs::write(dir.join("results.md"), &md)?;
    println!("\n{md}");
    println!(
        "wrote {} and {}",
        dir.join("results.json").display(),
        dir.join("results.md").display()
    );
    Ok(())
}

/// The number `key` of a benchmark's JSON (NaN when missing, so a row still prints).
fn field(v: &serde_json::Value, key: &str) -> f64 {
    v.get(key).and_then(|x| x.as_f64()).unwrap_or(f64::NAN)
}

/// The headline rows of one benchmark's JSON.
fn headlines(name: &'static str, v: &serde_json::Value) -> Vec<Headline> {
    let rows: Vec<(String, String, String, Option<bool>)> = match name {
        "preprocess" => preprocess_headlines(v),
        "index" => index_headlines(v),
        "model" => model_headlines(v),
        "hetero" => hetero_headlines(v),
        "tp" => tp_headlines(v),
        "cp" => cp_headlines(v),
        "moe" => moe_headlines(v),
        "planner" => planner_headlines(v),
        "replan" => replan_headlines(v),
        "islands" => islands_headlines(v),
        _ => Vec::new(),
    };
    rows.into_iter()
        .map(|(measure, value, target, met)| Headline {
            benchmark: name,
            measure,
            value,
            target,
            met,
        })
        .collect()
}

/// A headline row: measure, result, target, whether it was met.
type Row = (String, String, String, Option<bool>);

fn preprocess_headlines(v: &serde_json::Value) -> Vec<Row> {
    let mut out = Vec::new();
    let mb = field(v, "bytes") / 1e6;
    for r in v["results"].as_array().into_iter().flatten() {
        let tokenizer = r["tokenizer"].as_str().unwrap_or("?");
        let target = if tokenizer == "GPT2BPETokenizer" {
            4.0
        } else {
            3.0
        };
        let ratio = field(r, "ratio");
        out.push((
            format!(
                "preprocess {mb:.0} MB JSONL, {tokenizer}, 2 workers: ours vs Megatron's Python"
            ),
            format!(
                "{:.1} vs {:.1} MB/s = {ratio:.2}x, byte-identical{}",
                field(r, "ours_mb_s"),
                field(r, "reference_mb_s"),
                runs_note(r, &["ours_mb_s_runs", "reference_mb_s_runs"])
            ),
            format!(">= {target}x"),
            Some(ratio >= target),
        ));
        let paired: Vec<f64> = (v["hf_vs_gpt2_runs"].as_array().into_iter().flatten())
            .filter_map(serde_json::Value::as_f64)
            .collect();
        if tokenizer.starts_with("HuggingFaceTokenizer") && !paired.is_empty() {
            let share = median(&paired);
            out.push((
                "the same: ours with the tokenizer.json vs ours with GPT2BPETokenizer's files (speed, paired runs)"
                    .into(),
                format!(
                    "{share:.2}x (median of {}: {})",
                    paired.len(),
                    spread(&paired)
                ),
                ">= 0.9x".into(),
                Some(share >= 0.9),
            ));
        }
        if let Some(ceiling) = r["library_ceiling_mb_s"].as_f64() {
            let share = field(r, "ours_mb_s") / ceiling;
            out.push((
                "the same: ours vs the SentencePiece library's own id encoding, 2 threads".into(),
                format!(
                    "{:.1} vs {ceiling:.1} MB/s = {share:.2}x{}",
                    field(r, "ours_mb_s"),
                    runs_note(r, &["ours_mb_s_runs", "library_ceiling_mb_s_runs"])
                ),
                ">= 1.0x".into(),
                Some(share >= 1.0),
            ));
        }
    }
    out
}

/// `" (median of N: a–b vs c–d)"` from the runs under `keys`, or nothing for a result
/// without runs.
fn runs_note(r: &serde_json::Value, keys: &[&str]) -> String {
    let runs: Vec<Vec<f64>> = keys
        .iter()
        .filter_map(|key| r[key].as_array())
        .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
        .collect();
    match runs.first() {
        Some(first) if runs.len() == keys.len() => format!(
            " (median of {}: {})",
            first.len(),
            runs.iter()
                .map(|r| spread(r))
                .collect::<Vec<_>>()
                .join(" vs ")
        ),
        _ => String::new(),
    }
}

fn index_headlines(v: &serde_json::Value) -> Vec<Row> {
    let mut out = Vec::new();
    let ratio = field(v, "ratio");
    out.push((
        format!(
            "GPT index build, {:.2}B tokens, seq {}: ours vs megatron-core 0.8.0",
            field(v, "tokens") / 1e9,
            field(v, "seq_length")
        ),
        format!(
            "{:.2} vs {:.2} s = {ratio:.2}x, caches identical",
            field(v, "ours_cold_s"),
            field(v, "reference_cold_s")
        ),
        ">= 1.5x".into(),
        Some(ratio >= 1.5),
    ));
    out
}

fn model_headlines(v: &serde_json::Value) -> Vec<Row> {
    let mut out = Vec::new();
    let ratio = field(v, "ratio");
    out.push((
        format!(
            "training step, LLaMA {:.0}M, CPU 2 threads: ours vs transformers eager",
            field(v, "parameters") / 1e6
        ),
        format!(
            "{:.0} vs {:.0} tokens/s = {ratio:.3}x{}; the matrix products alone take {:.2} s of our {:.2} s step, with the attention {:.2} s (at most {:.2}x on these kernels)",
            field(v, "ours_tokens_per_s"),
            field(v, "reference_tokens_per_s"),
            runs_note(
                v,
                &["ours_tokens_per_s_runs", "reference_tokens_per_s_runs"]
            ),
            field(v, "gemm_floor_s"),
            field(v, "ours_step_s"),
            field(v, "gemm_floor_s") + field(v, "attention_floor_s"),
            field(v, "reference_step_s")
                / (field(v, "gemm_floor_s") + field(v, "attention_floor_s")),
        ),
        ">= 1.2x".into(),
        Some(ratio >= 1.2),
    ));
    if v.get("whole_logits_peak_rss_mb").is_some() {
        out.push((
            "the same, our loss in chunks with the output layer vs the whole logits".into(),
            format!(
                "peak RSS {:.0} vs {:.0} MB, {:.0} vs {:.0} tokens/s{} (transformers: {:.0} MB)",
                field(v, "ours_peak_rss_mb"),
                field(v, "whole_logits_peak_rss_mb"),
                field(v, "ours_tokens_per_s"),
                field(v, "whole_logits_tokens_per_s"),
                runs_note(
                    v,
                    &["ours_tokens_per_s_runs", "whole_logits_tokens_per_s_runs"]
                ),
                field(v, "reference_peak_rss_mb"),
            ),
            String::new(),
            None,
        ));
    }
    out
}

fn hetero_headlines(v: &serde_json::Value) -> Vec<Row> {
    let mut out = Vec::new();
    let batches = v["batches"].as_array().cloned().unwrap_or_default();
    for b in &batches {
        let g = b["global_batch_size"].as_u64().unwrap_or(0);
        let cluster = b["cluster"]
            .as_str()
            .unwrap_or("4 emulated CPU ranks (1 : 1 : 0.5 : 1/3)");
        let speedup = field(b, "speedup");
        out.push((
            format!("{cluster}, global batch {g}: plan vs best measured grid layout"),
            format!(
                "{:.3} vs {:.3} s per step = {speedup:.2}x ({})",
                field(b, "plan_step_s"),
                field(b, "best_grid_step_s"),
                b["best_grid"].as_str().unwrap_or("")
            ),
            ">= 1.3x".into(),
            Some(speedup >= 1.3),
        ));
        out.extend(acceleration_rows(b, g));
        out.push(fastest_row(b, &format!("{cluster}, global batch {g}")));
    }
    if let Some(skewed) = v.get("skewed").filter(|s| !s.is_null()) {
        let speedup = field(skewed, "speedup");
        out.push((
            format!(
                "memory-skewed cluster (1 rank holding the model, 3 at 1/4 its speed holding a third), global batch {}: {} vs best measured grid layout",
                skewed["global_batch_size"].as_u64().unwrap_or(0),
                match skewed["written_kind"].as_str() {
                    Some("per_replica_pipelines") => "per-replica pipelines",
                    _ => "the planner's grid plan",
                }
            ),
            format!(
                "{:.3} vs {:.3} s per step = {speedup:.2}x ({})",
                field(skewed, "plan_step_s"),
                field(skewed, "best_grid_step_s"),
                skewed["best_grid"].as_str().unwrap_or("")
            ),
            ">= 1.15x".into(),
            Some(speedup >= 1.15),
        ));
        out.push(fastest_row(skewed, "memory-skewed cluster"));
    }
    if !batches.is_empty() {
        let error = field(v, "max_prediction_error");
        out.push((
            "predicted vs measured step time, every layout run (worst)".into(),
            format!("{:.1} % off", error * 100.0),
            "within 10 %".into(),
            Some(error <= 0.10),
        ));
        let calibrated = field(v, "max_calibrated_prediction_error");
        out.push((
            "predicted vs measured step time after calibration by the scenario's other layouts (worst)".into(),
            match calibrated.is_nan() {
                true => "not measured: no calibration yet".into(),
                false => format!("{:.1} % off", calibrated * 100.0),
            },
            "within 5 %".into(),
            Some(calibrated <= 0.05),
        ));
    }
    out
}

/// A batch's acceleration ratio (plan ÷ Σ each device alone) and its share of the
/// integer-split ceiling, each judged where the batch's `target` names it.
fn acceleration_rows(b: &serde_json::Value, g: u64) -> Vec<Row> {
    let target = &b["target"];
    let judged = |key: &str| {
        (target["measure"].as_str() == Some(key))
            .then(|| target["at_least"].as_f64().unwrap_or(1.0))
    };
    let spread = |key: &str| {
        let runs: Vec<f64> = (b[key].as_array().into_iter().flatten())
            .filter_map(|x| x.as_f64())
            .collect();
        let (lo, hi) = (runs.iter()).fold((f64::MAX, f64::MIN), |(l, h), &r| (l.min(r), h.max(r)));
        (runs.len(), lo, hi)
    };
    let mut rows = Vec::new();
    for (key, runs_key, what) in [
        (
            "acceleration_ratio_no_overlap",
            "acceleration_ratio_no_overlap_runs",
            "acceleration ratio, reduction after the pipeline (--no-overlap-grad-reduce)"
                .to_owned(),
        ),
        (
            "acceleration_ratio",
            "acceleration_ratio_runs",
            "acceleration ratio (plan ÷ Σ each device alone)".to_owned(),
        ),
        (
            "fraction_of_integer_split",
            "fraction_of_integer_split_runs",
            format!(
                "of the integer-split ceiling ({:.1} % of Σ devices)",
                field(b, "integer_split_fraction") * 100.0
            ),
        ),
    ] {
        let value = field(b, key);
        if value.is_nan() {
            continue;
        }
        let (n, lo, hi) = spread(runs_key);
        let at_least = judged(key);
        rows.push((
            format!("global batch {g}: {what}, median of {n}"),
            format!(
                "{:.1} % ({:.1}–{:.1} %)",
                value * 100.0,
                lo * 100.0,
                hi * 100.0
            ),
            at_least.map_or("".into(), |t| format!(">= {:.0} %", t * 100.0)),
            at_least.map(|t| value >= t),
        ));
    }
    rows
}

/// The written plan's median step against the fastest layout measured.
fn fastest_row(b: &serde_json::Value, what: &str) -> Row {
    let over = field(b, "plan_over_fastest");
    (
        format!("{what}: written plan ÷ fastest measured layout"),
        format!("{over:.3}"),
        "<= 1.03".into(),
        Some(over <= 1.03),
    )
}

fn tp_headlines(v: &serde_json::Value) -> Vec<Row> {
    let speedup = field(v, "speedup");
    vec![(
        "one TP group of 2 emulated CPU ranks (1 : 0.5): shares [2, 1] vs even".into(),
        format!(
            "{:.3} vs {:.3} s per step = {speedup:.2}x (ideal 1.5x)",
            field(v, "by_speed_step_s"),
            field(v, "even_step_s")
        ),
        ">= 1.3x".into(),
        Some(speedup >= 1.3),
    )]
}

fn moe_headlines(v: &serde_json::Value) -> Vec<Row> {
    let speedup = field(v, "speedup");
    vec![
        (
            format!(
                "an 8-expert model (top 2) on an EP pair of 2 emulated CPU ranks (1 : 0.5): experts {} and batch by pace vs Megatron's even split",
                v["placement_by_pace"]
            ),
            format!(
                "{:.3} vs {:.3} s per step = {speedup:.2}x (batch by pace alone: {:.3} s)",
                field(v, "experts_by_pace_step_s"),
                field(v, "megatron_step_s"),
                field(v, "batch_by_pace_step_s"),
            ),
            ">= 1.2x".into(),
            Some(speedup >= 1.2),
        ),
        (
            "the same pair: the MoE model vs the dense model of the same active parameters".into(),
            format!(
                "{:.0} vs {:.0} tokens/s",
                field(v, "tokens_per_s"),
                field(v, "dense_tokens_per_s")
            ),
            String::new(),
            None,
        ),
    ]
}

fn cp_headlines(v: &serde_json::Value) -> Vec<Row> {
    let speedup = field(v, "speedup");
    let peaks = |layout: &str| -> String {
        let ranks = v["memory_per_rank"][layout]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mb: Vec<String> = (ranks.iter())
            .map(|r| {
                format!(
                    "{:.0}",
                    r["activation_peak_bytes"].as_f64().unwrap_or(f64::NAN) / 1e6
                )
            })
            .collect();
        mb.join(" / ")
    };
    vec![(
        format!(
            "one CP group of 2 emulated CPU ranks (1 : 0.5), sequence 2048: the planner's shares {} vs even",
            v["planner_shares"]
        ),
        format!(
            "{:.3} vs {:.3} s per step = {speedup:.2}x (ideal 1.5x); activation peaks per rank {} MB vs {} MB",
            field(v, "planner_step_s"),
            field(v, "even_step_s"),
            peaks("planner"),
            peaks("even"),
        ),
        ">= 1.3x".into(),
        Some(speedup >= 1.3),
    )]
}

fn islands_headlines(v: &serde_json::Value) -> Vec<Row> {
    let hosts = &v["two_hosts"];
    let sites = &v["two_sites"];
    let speedup = field(hosts, "speedup");
    let site_speedup = field(sites, "speedup");
    vec![
        (
            format!(
                "4 emulated CPU ranks on 2 emulated hosts, link {:.3} GB/s (within a host / 10): hierarchical vs flat reduction",
                field(hosts, "link_gbs")
            ),
            format!(
                "{:.3} vs {:.3} s per step = {speedup:.2}x; losses within {:.1e}",
                field(hosts, "hierarchical_step_s"),
                field(hosts, "flat_step_s"),
                field(hosts, "max_rel_loss_diff")
            ),
            ">= 1.5x".into(),
            Some(speedup >= 1.5),
        ),
        (
            "the same: bytes sent across the link per step, hierarchical / flat".into(),
            format!(
                "{:.3} in all, {:.3} on the busiest member's link",
                field(hosts, "bytes_ratio"),
                field(hosts, "busiest_link_bytes_ratio")
            ),
            "about 1/g (g = 2)".into(),
            None,
        ),
        (
            format!(
                "2 emulated sites x 2 hosts, sites at {:.4} GB/s: the planner's plan ({}) vs data parallelism flat across the sites",
                field(sites, "site_link_gbs"),
                sites["plan"].as_str().unwrap_or("?")
            ),
            format!(
                "{:.3} vs {:.3} s = {site_speedup:.2}x; prediction errors {:+.1} % and {:+.1} %",
                field(sites, "plan_step_s"),
                field(sites, "flat_dp_step_s"),
                100.0 * field(sites, "plan_prediction_error"),
                100.0 * field(sites, "flat_dp_prediction_error")
            ),
            "faster".into(),
            Some(site_speedup > 1.0),
        ),
    ]
}

fn planner_headlines(v: &serde_json::Value) -> Vec<Row> {
    let mut out = Vec::new();
    let s = field(v, "planning_s");
    out.push((
        "planning 1024 devices of 4 kinds, 80 layers".into(),
        format!("{s:.2} s ({:.2} s for the command)", field(v, "command_s")),
        "< 2 s".into(),
        Some(s < 2.0),
    ));
    if let Some(large) = v["large_planning_s"].as_f64() {
        out.push((
            format!(
                "planning {} devices of 6 kinds, 80 layers",
                v["large_devices"].as_u64().unwrap_or(0)
            ),
            format!(
                "{large:.2} s ({:.2} s for the command)",
                field(v, "large_command_s")
            ),
            "< 10 s".into(),
            Some(large < 10.0),
        ));
    }
    if let Some(fraction) = v["llama_70b_fraction_of_bound"].as_f64() {
        out.push((
            "LLaMA 70B on 1024 GPUs (32 nodes each of H100, A100-80G, L40S, A10), global batch 1024 x 4096: the written plan's fraction of the bound".into(),
            format!(
                "{:.1} % (planned in {:.2} s)",
                fraction * 100.0,
                field(v, "llama_70b_planning_s")
            ),
            ">= 50 %".into(),
            Some(fraction >= 0.5),
        ));
    }
    out
}

fn replan_headlines(v: &serde_json::Value) -> Vec<Row> {
    let vs_fresh = field(v, "after_vs_fresh");
    vec![
        (
            "4 emulated ranks, rank 1 4x slower from iteration 20 of 60: last 20 steps after the switch vs a fresh run of the new plan".into(),
            format!(
                "{:.4} vs {:.4} s per step = {vs_fresh:.3}x",
                field(v, "after_switch_step_s"),
                field(v, "fresh_step_s")
            ),
            "<= 1.10x".into(),
            Some(vs_fresh <= 1.10),
        ),
        (
            "the same, --replan auto vs off: steps after the switch, whole run; time to switch".into(),
            format!(
                "{:.2}x, {:.2}x; {:.3} s",
                field(v, "gain_vs_off"),
                field(v, "run_speedup"),
                field(v, "switch_s")
            ),
            String::new(),
            None,
        ),
    ]
}

fn run_one(root: &Path, name: &str) -> Result<()> {
    match name {
        "preprocess" => preprocess(root),
        "index" => index(root),
        "model" => model(root),
        "hetero" => crate::bench_hetero::hetero(root),
        "tp" => crate::bench_tp::tp(root),
        "cp" => crate::bench_cp::cp(root),
        "moe" => crate::bench_moe::moe(root),
        "planner" => crate::bench_hetero::planner(root),
        "replan" => crate::bench_replan::replan(root),
        "islands" => crate::bench_islands::islands(root),
        other => bail!(
            "unknown benchmark {other:?}; available: preprocess, index, model, hetero, tp, cp, moe, planner, replan, islands (or summary: the table from the latest results)"
        ),
    }
}

/// Preprocessing of >= 50 MB of Shakespeare JSONL with 2 workers, GPT-2 BPE and LLaMA-2
/// SentencePiece: our binary vs Megatron's preprocess logic (Python pool + megatron-core
/// builder), outputs byte-identical; for SentencePiece also the library's own 2-thread
/// id encoding, the ceiling of any wrapper. Each side runs 3 times, alternating; the
/// medians are compared.
fn preprocess(root: &Path) -> Result<()> {
    setup::run(root, true)?;
    let dir = root.join("target/bench/preprocess");
    let bench = PreprocessBench {
        synerfuse: release_binary(root)?,
        python: root.join(".venv/bin/python"),
        script: root.join("xtask/fixtures/bench_preprocess.py"),
        corpus: dir.join("corpus.jsonl"),
        dir,
        workers: 2,
    };
    let status = Command::new(&bench.python)
        .arg(&bench.script)
        .arg("prepare")
        .arg(root)
        .arg(&bench.dir)
        .status()?;
    ensure!(status.success(), "preparing the corpus failed");
    let bytes = std::fs::metadata(&bench.corpus)?.len() as f64;
    let tok = bench.dir.join("tokenizer");
    let cases: [(&str, &str, Vec<std::ffi::OsString>); 5] = [
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
            "hf",
            "HuggingFaceTokenizer (the GPT-2 BPE's tokenizer.json)",
            vec![
                "--tokenizer-model".into(),
                tok.join("tokenizer.json").into(),
            ],
        ),
        (
            "llama2",
            "Llama2Tokenizer",
            vec!["--tokenizer-model".into(), tok.join("llama.model").into()],
        ),
        (
            "llama2-nfkc",
            "Llama2Tokenizer (NFKC BPE)",
            vec!["--tokenizer-model".into(), tok.join("nfkc.model").into()],
        ),
        (
            "unigram",
            "GPTSentencePieceTokenizer (NFKC Unigram)",
            vec!["--tokenizer-model".into(), tok.join("unigram.model").into()],
        ),
    ];
    let mut rows = Vec::new();
    let mut json = Vec::new();
    for (name, kind, flags) in &cases {
        let (case_rows, entry) = bench.case(name, kind, flags, bytes)?;
        rows.extend(case_rows);
        json.push(entry);
    }
    // The tokenizer.json against the GPT-2 files of the same vocabulary, ours both:
    // paired runs, alternating, so that the machine's drift between cases cancels.
    let (gpt2, hf) = (&cases[0], &cases[1]);
    let mut shares = Vec::new();
    for _ in 0..PAIRED_RUNS {
        let hf_s = bench.ours_seconds(hf.1, &hf.2, &bench.dir.join("ours-hf"))?;
        let gpt2_s = bench.ours_seconds(gpt2.1, &gpt2.2, &bench.dir.join("ours-gpt2"))?;
        shares.push(gpt2_s / hf_s);
    }
    rows.push(format!(
        "| tokenizer.json vs GPT2BPETokenizer's files, ours both, paired | | | {:.2}x ({}) (target >= 0.9x) | |",
        median(&shares),
        spread(&shares)
    ));
    println!();
    println!(
        "preprocess, {} workers, {:.1} MB of JSONL (Shakespeare, ~4 KB documents)",
        bench.workers,
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
    write_json(
        &root.join("target/bench/preprocess.json"),
        &serde_json::json!({
            "benchmark": "preprocess",
            "workers": bench.workers,
            "bytes": bytes,
            "results": json,
            "hf_vs_gpt2_runs": shares,
        }),
    )?;
    Ok(())
}

/// The preprocessing bench's programs and corpus.
struct PreprocessBench {
    synerfuse: std::path::PathBuf,
    python: std::path::PathBuf,
    script: std::path::PathBuf,
    dir: std::path::PathBuf,
    corpus: std::path::PathBuf,
    workers: usize,
}

impl PreprocessBench {
    /// (seconds, bytes) of a run of the reference script.
    fn reference_timing(&self, args: &[&str]) -> Result<(f64, f64)> {
        let out = Command::new(&self.python)
            .arg(&self.script)
            .args(args)
            .output()?;
        ensure!(
            out.status.success(),
            "{args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = last_json_line(&stdout).with_context(|| format!("{args:?} printed {stdout}"))?;
        Ok((number(&line, "seconds")?, number(&line, "bytes")?))
    }

    /// One tokenizer: the reference, ours, outputs compared byte for byte; for
    /// SentencePiece also the library's own id encoding. The table rows and the JSON.
    fn case(
        &self,
        name: &str,
        kind: &str,
        flags: &[std::ffi::OsString],
        bytes: f64,
    ) -> Result<(Vec<String>, serde_json::Value)> {
        let (dir, workers) = (&self.dir, self.workers.to_string());
        let utf8 = |p: &Path| p.to_str().map(str::to_owned).context("utf-8 path");
        let reference_prefix = dir.join(format!("reference-{name}"));
        let ours_prefix = dir.join(format!("ours-{name}"));
        let with_ceiling = name.starts_with("llama2") || name == "unigram";
        let (mut ours_runs, mut reference_runs, mut ceiling_runs) = (vec![], vec![], vec![]);
        // Alternating, so that a slow spell of the shared machine hits both sides.
        for _ in 0..PREPROCESS_RUNS {
            let reference = self.reference_timing(&[
                "reference",
                &utf8(dir)?,
                &workers,
                &utf8(&reference_prefix)?,
                name,
            ])?;
            reference_runs.push(reference.1 / reference.0 / 1e6);
            ours_runs.push(bytes / self.ours_seconds(kind, flags, &ours_prefix)? / 1e6);
            if with_ceiling {
                let ceiling = self.reference_timing(&["ceiling", &utf8(dir)?, &workers, name])?;
                ceiling_runs.push(ceiling.1 / ceiling.0 / 1e6);
            }
        }
        for ext in ["bin", "idx"] {
            let file = |prefix: &Path| format!("{}_text_document.{ext}", prefix.display());
            let same =
                std::fs::read(file(&ours_prefix))? == std::fs::read(file(&reference_prefix))?;
            ensure!(same, "{name}: outputs differ (.{ext})");
        }
        let (ours_mbs, reference_mbs) = (median(&ours_runs), median(&reference_runs));
        let ratio = ours_mbs / reference_mbs;
        let target = if name == "gpt2" { 4.0 } else { 3.0 };
        let mut rows = vec![format!(
            "| {kind} | {ours_mbs:.2} ({}) | {reference_mbs:.2} ({}) | {ratio:.2}x (target >= {target}x) | yes |",
            spread(&ours_runs),
            spread(&reference_runs)
        )];
        let mut entry = serde_json::json!({
            "tokenizer": kind,
            "ours_mb_s": ours_mbs,
            "reference_mb_s": reference_mbs,
            "ours_mb_s_runs": ours_runs,
            "reference_mb_s_runs": reference_runs,
            "ratio": ratio,
            "byte_identical": true,
        });
        if with_ceiling {
            let ceiling_mbs = median(&ceiling_runs);
            let share = ours_mbs / ceiling_mbs;
            rows.push(format!(
                "| SentencePiece library alone (ids only, {workers} threads) | {ceiling_mbs:.2} ({}) | | ours = {:.0}% of it (target >= 100%) | |",
                spread(&ceiling_runs),
                share * 100.0
            ));
            entry["library_ceiling_mb_s"] = ceiling_mbs.into();
            entry["library_ceiling_mb_s_runs"] = ceiling_runs.into();
            entry["share_of_ceiling"] = share.into();
        }
        Ok((rows, entry))
    }

    /// Seconds of one `synerfuse preprocess` run of `kind` into `prefix`.
    fn ours_seconds(&self, kind: &str, flags: &[std::ffi::OsString], prefix: &Path) -> Result<f64> {
        let mut command = Command::new(&self.synerfuse);
        let flag = kind.split(' ').next().unwrap_or(kind);
        command
            .args(["preprocess", "--json-keys", "text", "--append-eod"])
            .args(["--tokenizer-type", flag])
            .args(flags)
            .arg("--input")
            .arg(&self.corpus)
            .arg("--output-prefix")
            .arg(prefix)
            .args(["--workers", &self.workers.to_string()]);
        timed_preprocess(command)
    }
}

/// Runs of each side of each preprocessing case; the median is reported.
const PREPROCESS_RUNS: usize = 3;

/// Pairs of the tokenizer.json against the GPT-2 files: a run is ~0.7 s and varies by
/// ±15 % on a shared 2-core machine, so 3 pairs do not tell 0.9x from 1.0x.
const PAIRED_RUNS: usize = 11;

/// `lowest–highest` of `values` (two decimals below 10, else one).
fn spread(values: &[f64]) -> String {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let digits = if high < 10.0 { 2 } else { 1 };
    format!("{low:.digits$}–{high:.digits$}")
}

/// Runs a `synerfuse preprocess` command; its wall-clock seconds.
fn timed_preprocess(mut command: Command) -> Result<f64> {
    let started = Instant::now();
    let out = command.output()?;
    let seconds = started.elapsed().as_secs_f64();
    ensure!(
        out.status.success(),
        "synerfuse preprocess failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(seconds)
}

/// The index bench's sequence length.
const INDEX_SEQ: u64 = 4096;

/// Cold build of the GPT indices of a synthetic ~1B-token dataset (5M documents of 20–400
/// tokens), sequence length 4096, about two epochs: `synerfuse index` vs megatron-core
/// 0.8.0 (numpy + its C++ helpers), best of 3 fresh cache directories each, cache files
/// identical; then the cost of opening the cached indices (mmap) on each side.
fn index(root: &Path) -> Result<()> {
    const SEQ: u64 = INDEX_SEQ;
    const RUNS: usize = 3;
    setup::run(root, true)?;
    let synerfuse = release_binary(root)?;
    let python = root.join(".venv/bin/python");
    let script = root.join("xtask/fixtures/bench_index.py");
    let dir = root.join("target/bench/index");
    let status = Command::new(&python)
        .arg(&script)
        .args(["prepare".as_ref(), dir.as_os_str()])
        .status()?;
    ensure!(status.success(), "preparing the dataset failed");
    // Sequence lengths are 20..=400 (mean 210): one epoch is about 256k samples of 4096;
    // 1.9 epochs' worth of samples needs two epochs without a separate last one.
    let idx = std::fs::read(dir.join("synth.idx"))?;
    let count = u64::from_le_bytes(idx[18..26].try_into()?) as usize;
    let tokens: u64 = idx[34..34 + 4 * count]
        .chunks_exact(4)
        .map(|b| u64::from(u32::from_le_bytes(b.try_into().unwrap())))
        .sum();
    let per_epoch = (tokens - 1) / SEQ;
    let train_samples = per_epoch * 19 / 10;
    let prefix = dir.join("synth");
    let mut ours_cold = f64::MAX;
    let mut ours_load = f64::MAX;
    let mut ref_cold = f64::MAX;
    let mut ref_load = f64::MAX;
    let mut samples = (0.0, 0.0);
    for run in 0..RUNS {
        let ours_dir = dir.join(format!("cache-ours-{run}"));
        let ref_dir = dir.join(format!("cache-megatron-{run}"));
        for d in [&ours_dir, &ref_dir] {
            if d.exists() {
                std::fs::remove_dir_all(d)?;
            }
        }
        let (cold, load, n) = reference_index(&python, &script, &dir, &ref_dir, train_samples)?;
        (ref_cold, ref_load, samples.1) = (ref_cold.min(cold), ref_load.min(load), n);
        let cold = ours_index(&synerfuse, &prefix, &ours_dir, train_samples, false)?;
        let load = ours_index(&synerfuse, &prefix, &ours_dir, train_samples, true)?;
        (ours_cold, ours_load, samples.0) = (ours_cold.min(cold.0), ours_load.min(load.0), load.1);
        same_caches(&ours_dir, &ref_dir)?;
        if run + 1 < RUNS {
            std::fs::remove_dir_all(&ours_dir)?;
            std::fs::remove_dir_all(&ref_dir)?;
        }
    }
    ensure!(samples.0 == samples.1, "sample counts differ: {samples:?}");
    let ratio = ref_cold / ours_cold;
    println!();
    println!(
        "index build: {count} documents, {tokens} tokens, seq {SEQ}, {train_samples} train samples (2 epochs, {} samples), best of {RUNS}",
        samples.0
    );
    println!();
    println!("| | synerfuse | megatron-core 0.8.0 | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| cold build + cache write | {ours_cold:.3} s | {ref_cold:.3} s | {ratio:.2}x (target >= 1.5x) |"
    );
    println!(
        "| open cached indices (mmap) | {:.1} ms | {:.1} ms | |",
        ours_load * 1e3,
        ref_load * 1e3
    );
    println!("cache files identical: yes");
    write_json(
        &root.join("target/bench/index.json"),
        &serde_json::json!({
            "benchmark": "index",
            "documents": count,
            "tokens": tokens,
            "seq_length": SEQ,
            "train_samples": train_samples,
            "ours_cold_s": ours_cold,
            "reference_cold_s": ref_cold,
            "ratio": ratio,
            "ours_open_s": ours_load,
            "reference_open_s": ref_load,
            "identical": true,
        }),
    )?;
    Ok(())
}

/// megatron-core's cold build, cached open and sample count for the index bench.
fn reference_index(
    python: &Path,
    script: &Path,
    dir: &Path,
    cache: &Path,
    train_samples: u64,
) -> Result<(f64, f64, f64)> {
    let out = Command::new(python)
        .arg(script)
        .arg("reference")
        .arg(dir)
        .arg(cache)
        .arg(train_samples.to_string())
        .arg(INDEX_SEQ.to_string())
        .output()?;
    ensure!(
        out.status.success(),
        "megatron-core failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = last_json_line(&String::from_utf8_lossy(&out.stdout))?;
    Ok((
        number(&line, "cold")?,
        number(&line, "load")?,
        number(&line, "samples")?,
    ))
}

/// `synerfuse index` into `cache`: (seconds, train samples); `load` says whether the
/// caches must already be there (and be loaded) or be built.
fn ours_index(
    synerfuse: &Path,
    prefix: &Path,
    cache: &Path,
    train_samples: u64,
    load: bool,
) -> Result<(f64, f64)> {
    let out = Command::new(synerfuse)
        .arg("index")
        .arg("--data-path")
        .arg(prefix)
        .args(["--split", "1", "--seq-length", &INDEX_SEQ.to_string()])
        .args(["--train-samples", &train_samples.to_string()])
        .arg("--data-cache-path")
        .arg(cache)
        .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"])
        .arg("--json")
        .output()?;
    ensure!(
        out.status.success(),
        "synerfuse index failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = last_json_line(&String::from_utf8_lossy(&out.stdout))?;
    let loaded = line["splits"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|split| split["caches"].as_array().into_iter().flatten())
        .any(|cache| cache["loaded"] == true);
    ensure!(
        loaded == load,
        "{} run: unexpected cache state: {line}",
        if load { "load" } else { "cold" }
    );
    Ok((
        number(&line, "seconds")?,
        number(&line["splits"][0], "samples")?,
    ))
}

/// Same file names, same arrays (headers may differ in padding across numpy versions).
fn same_caches(ours: &Path, theirs: &Path) -> Result<()> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(theirs)? {
        names.push(entry?.file_name());
    }
    ensure!(names.len() == 4, "megatron wrote {} files", names.len());
    let payload = |b: Vec<u8>| -> Vec<u8> {
        if b.starts_with(b"\x93NUMPY") {
            let len = u16::from_le_bytes([b[8], b[9]]) as usize;
            b[10 + len..].to_vec()
        } else {
            b
        }
    };
    for name in names {
        let reference = std::fs::read(theirs.join(&name))?;
        let mine = std::fs::read(ours.join(&name))
            .with_context(|| format!("synerfuse did not write {name:?}"))?;
        ensure!(
            payload(mine) == payload(reference),
            "{name:?} differs from megatron-core's"
        );
    }
    Ok(())
}

/// Training step (forward + backward + AdamW) of a ~21M-parameter LLaMA (hidden 512, 4
/// layers, 8 heads, FFN 1376, vocabulary 8192, untied), sequence 256, batch 8, fp32 on the
/// CPU with 2 threads: synerfuse-model (tch) with the trainer's own AdamW vs transformers'
/// LlamaForCausalLM in PyTorch eager with torch.optim.AdamW; ours also with the whole
/// logits instead of the loss in chunks, with each run's peak resident memory. Runs
/// alternate, 5 each (a
/// run varies by ±10 % on a shared 2-core machine); the ratio is of the medians, with
/// each side's spread and its median forward, backward and optimizer seconds (where a
/// gap goes).
fn model(root: &Path) -> Result<()> {
    const SHAPE: [&str; 10] = ["512", "4", "8", "8", "1376", "8192", "256", "8", "5", "2"];
    const RUNS: usize = 5;
    const PHASES: [&str; 3] = ["forward_s", "backward_s", "optimizer_s"];
    setup::run(root, true)?;
    let status = Command::new("cargo")
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "synerfuse-train",
            "--example",
            "step_throughput",
        ])
        .current_dir(root)
        .status()?;
    ensure!(
        status.success(),
        "building the step_throughput example failed"
    );
    let ours_bin = root.join("target/release/examples/step_throughput");
    let python = root.join(".venv/bin/python");
    let script = root.join("xtask/fixtures/bench_model.py");
    // tokens/s, parameters, then the phases' seconds.
    let run = |mut cmd: Command| -> Result<Vec<f64>> {
        let out = cmd.output()?;
        ensure!(
            out.status.success(),
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = last_json_line(&String::from_utf8_lossy(&out.stdout))?;
        ["tokens_per_second", "parameters"]
            .iter()
            .chain(&PHASES)
            .chain(&["peak_rss_mb"])
            .map(|key| number(&line, key))
            .collect()
    };
    // Ours with the loss run chunk by chunk with the output layer (the trainer's 1F1B
    // last stage), and with the whole logits: that change measured on its own.
    let (mut ours, mut whole_logits, mut reference) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        for (loss, runs) in [("chunked", &mut ours), ("whole", &mut whole_logits)] {
            let mut cmd = Command::new(&ours_bin);
            cmd.args(SHAPE).args(["cpu", "fp32", loss]);
            runs.push(run(cmd)?);
        }
        let mut cmd = Command::new(&python);
        cmd.arg(&script).args(SHAPE);
        reference.push(run(cmd)?);
    }
    let parameters = ours[0][1];
    ensure!(
        reference.iter().all(|r| r[1] == parameters),
        "parameter counts differ: {} vs {parameters}",
        reference[0][1]
    );
    // The floor under both: the step's matrix products alone, and its attention, on
    // libtorch's kernels.
    let mut cmd = Command::new(&python);
    cmd.arg(root.join("xtask/fixtures/bench_model_gemm.py"))
        .args(&SHAPE[..8])
        .args([&RUNS.to_string(), SHAPE[9]]);
    let out = cmd.output()?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let floor = last_json_line(&String::from_utf8_lossy(&out.stdout))?;
    let (gemm_s, attention_s) = (
        number(&floor, "gemm_seconds")?,
        number(&floor, "attention_seconds")?,
    );
    let column = |runs: &[Vec<f64>], i: usize| runs.iter().map(|r| r[i]).collect::<Vec<_>>();
    let (ours_tps, reference_tps) = (column(&ours, 0), column(&reference, 0));
    let step_tokens: f64 = SHAPE[6].parse::<f64>()? * SHAPE[7].parse::<f64>()?;
    let (ours_step_s, reference_step_s) = (
        step_tokens / median(&ours_tps),
        step_tokens / median(&reference_tps),
    );
    let ratio = median(&ours_tps) / median(&reference_tps);
    let phases = |runs: &[Vec<f64>]| -> serde_json::Value {
        (PHASES.iter().enumerate())
            .map(|(i, key)| (key.to_string(), median(&column(runs, i + 2)).into()))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    println!();
    println!(
        "training step, LLaMA {:.1}M parameters, seq 256, batch 8, fp32, CPU, 2 threads, median of {RUNS}",
        parameters / 1e6
    );
    println!();
    println!(
        "| | tokens/s (spread) | forward, backward, optimizer s (medians) | peak RSS MB (median) |"
    );
    println!("|---|---|---|---|");
    for (name, runs) in [
        (
            "synerfuse-model (tch, libtorch 2.11) + synerfuse-train AdamW, loss in chunks",
            &ours,
        ),
        ("the same with the whole logits", &whole_logits),
        ("transformers LlamaForCausalLM, PyTorch eager", &reference),
    ] {
        let tps = column(runs, 0);
        let [f, b, o, rss] = [2, 3, 4, 5].map(|i| median(&column(runs, i)));
        println!(
            "| {name} | {:.0} ({}) | {f:.3}, {b:.3}, {o:.4} | {rss:.0} |",
            median(&tps),
            spread(&tps)
        );
    }
    println!("| ratio | {ratio:.3}x (target >= 1.2x, issue 61) | |");
    println!();
    println!(
        "the step's matrix products alone (libtorch, same shapes and threads, median of {RUNS}): \
         {gemm_s:.3} s, {:.0} % of our step ({ours_step_s:.3} s) and {:.0} % of the reference's \
         ({reference_step_s:.3} s): no implementation on these kernels steps faster than {:.2}x \
         the reference",
        100.0 * gemm_s / ours_step_s,
        100.0 * gemm_s / reference_step_s,
        reference_step_s / gemm_s
    );
    let floor_s = gemm_s + attention_s;
    println!(
        "with the attention (scaled_dot_product_attention forward and backward, every layer: \
         {attention_s:.3} s): {floor_s:.3} s, at most {:.2}x the reference",
        reference_step_s / floor_s
    );
    write_json(
        &root.join("target/bench/model.json"),
        &serde_json::json!({
            "benchmark": "model",
            "parameters": parameters,
            "seq": 256,
            "batch": 8,
            "threads": 2,
            "runs": RUNS,
            "ours_tokens_per_s": median(&ours_tps),
            "reference_tokens_per_s": median(&reference_tps),
            "ours_tokens_per_s_runs": ours_tps,
            "reference_tokens_per_s_runs": reference_tps,
            "ours_phases_s": phases(&ours),
            "whole_logits_tokens_per_s": median(&column(&whole_logits, 0)),
            "whole_logits_tokens_per_s_runs": column(&whole_logits, 0),
            "whole_logits_phases_s": phases(&whole_logits),
            "ours_peak_rss_mb": median(&column(&ours, 5)),
            "whole_logits_peak_rss_mb": median(&column(&whole_logits, 5)),
            "reference_peak_rss_mb": median(&column(&reference, 5)),
            "reference_phases_s": phases(&reference),
            "ratio": ratio,
            "gemm_floor_s": gemm_s,
            "attention_floor_s": attention_s,
            "ours_step_s": ours_step_s,
            "reference_step_s": reference_step_s,
        }),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headlines_judge_each_target() {
        let hetero = serde_json::json!({
            "batches": [{
                "global_batch_size": 32, "speedup": 1.5, "plan_step_s": 1.0,
                "best_grid_step_s": 1.5, "best_grid": "even pp 2 x dp 2",
                "acceleration_ratio": 0.94, "acceleration_ratio_runs": [0.93, 0.94, 0.96],
                "fraction_of_integer_split": 0.98,
                "fraction_of_integer_split_runs": [0.97, 0.98, 0.99],
                "integer_split_fraction": 0.96,
                "target": {"measure": "fraction_of_integer_split", "at_least": 0.97},
                "plan_over_fastest": 1.01,
            }],
            "skewed": {
                "global_batch_size": 16, "speedup": 1.1, "plan_step_s": 1.0,
                "best_grid_step_s": 1.1, "written_kind": "per_replica_pipelines",
                "plan_over_fastest": 1.05,
            },
            "max_prediction_error": 0.05,
        });
        let rows = headlines("hetero", &hetero);
        let met: Vec<Option<bool>> = rows.iter().map(|r| r.met).collect();
        assert_eq!(
            met,
            [
                Some(true),
                None,
                Some(true),
                Some(true),
                Some(false),
                Some(false),
                Some(true),
                Some(false)
            ]
        );
        assert!(
            rows[4].measure.contains("per-replica pipelines"),
            "{}",
            rows[4].measure
        );
        assert!(rows[1].value.contains("(93.0–96.0 %)"), "{}", rows[1].value);
        assert!(
            rows[2].measure.contains("(96.0 % of"),
            "{}",
            rows[2].measure
        );
        assert!(
            rows[7].value.contains("no calibration"),
            "{}",
            rows[7].value
        );
        let planner = serde_json::json!({"planning_s": 0.5, "command_s": 0.7});
        assert_eq!(headlines("planner", &planner)[0].met, Some(true));
        assert!(headlines("unknown", &planner).is_empty());
    }
}
