//! `synerfuse plan --try K`: the K best predicted plans trained for a few steps each on
//! the real ranks, predicted against measured, and the measured fastest written (what
//! FlagScale's autotuner does, with the planner's prices choosing what to try).

use crate::files::write_atomically;
use crate::plan_report::{pooled_train_flags, WrittenPlan};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use synerfuse_plan::Plan;
use synerfuse_planner::calibrate::{calibrate, MeasuredRun};
use synerfuse_planner::cost::CostModel;
use synerfuse_planner::planner::{PlanOutcome, ThroughputBound};
use synerfuse_planner::profile::Profile;

/// Flags `--try` sets on every training run itself.
const OWNED_FLAGS: [&str; 4] = ["--plan", "--train-iters", "--log-json", "--nproc"];

/// Flags that would tie the tries together (each would resume the last one's state, or
/// overwrite its checkpoint): every plan starts from the same weights.
const SHARED_STATE_FLAGS: [&str; 2] = ["--save", "--load"];

/// Flags the plans are priced with, which each tried plan's training flags carry.
const PRICED_FLAGS: [&str; 5] = [
    "--overlap-grad-reduce",
    "--no-overlap-grad-reduce",
    "--ddp-bucket-size",
    "--overlap-param-gather",
    "--no-hierarchical-reduction",
];

/// How plans are tried.
#[derive(Debug, Clone)]
pub(crate) struct TrySettings {
    /// How many of the best predicted plans.
    pub(crate) plans: usize,
    /// Steps each trains; the first third (at least one) are warm-up, not timed.
    pub(crate) iters: u64,
    /// The training run's own arguments (data, tokenizer, model, optimizer).
    pub(crate) train_args: Vec<String>,
    /// Where each tried plan, its JSON log and its output go.
    pub(crate) dir: PathBuf,
}

impl TrySettings {
    /// Refuses training arguments that `--try` sets itself, and too few steps to time.
    pub(crate) fn check(&self) -> Result<()> {
        if let Some(flag) = (self.train_args.iter())
            .find(|a| OWNED_FLAGS.contains(&a.split('=').next().unwrap_or(a)))
        {
            bail!("--try sets {flag} on each training run itself; drop it from the training arguments after --");
        }
        if let Some(flag) = (self.train_args.iter())
            .find(|a| SHARED_STATE_FLAGS.contains(&a.split('=').next().unwrap_or(a)))
        {
            bail!("--try trains each plan from the same start; {flag} after -- would carry one try's state into the next (--finetune-from-hf is fine)");
        }
        if let Some(flag) = (self.train_args.iter())
            .find(|a| PRICED_FLAGS.contains(&a.split('=').next().unwrap_or(a)))
        {
            bail!("--try trains each plan with the gradient reduction it was priced with; give {flag} to plan itself, before --");
        }
        if self.iters < 2 {
            bail!(
                "--try-iters {}: at least 2 steps (the first is warm-up, not timed)",
                self.iters
            );
        }
        Ok(())
    }

    /// Steps not timed.
    fn warm_up(&self) -> usize {
        (self.iters as usize).div_ceil(3).max(1)
    }
}

/// A plan to try, as the planner predicted it.
#[derive(Debug, Clone)]
pub(crate) struct PlanToTry {
    /// `grid` or `per_replica_pipelines`, as `written_plan` says.
    pub(crate) kind: &'static str,
    pub(crate) label: String,
    pub(crate) plan: Plan,
    pub(crate) predicted_s: f64,
    pub(crate) train_flags: Vec<String>,
}

/// The planner's plans, predicted fastest first, each plan once: per-replica pipelines
/// (when found) and the grid plans.
pub(crate) fn plans_to_try(cost: &CostModel, outcome: &PlanOutcome) -> Result<Vec<PlanToTry>> {
    let mut plans = Vec::new();
    if let Some(p) = &outcome.pooled {
        plans.push(PlanToTry {
            kind: "per_replica_pipelines",
            label: format!(
                "per-replica pipelines, layers {:?}",
                p.pools.iter().map(|pool| &pool.layers).collect::<Vec<_>>()
            ),
            plan: p.to_plan(cost)?,
            predicted_s: p.step_time_s,
            train_flags: pooled_train_flags(p),
        });
    }
    for c in &outcome.plans {
        plans.push(PlanToTry {
            kind: "grid",
            label: format!(
                "grid {}, layers {:?}, {}",
                crate::plan_report::grid_text(c),
                c.layers,
                c.micro_batch_size_text()
            ),
            plan: c.to_plan(cost)?,
            predicted_s: c.prediction.step_time_s,
            train_flags: c.options.train_flags(),
        });
    }
    plans.sort_by(|a, b| a.predicted_s.total_cmp(&b.predicted_s));
    let mut distinct: Vec<PlanToTry> = Vec::with_capacity(plans.len());
    for p in plans {
        if !distinct.iter().any(|d| d.plan == p.plan) {
            distinct.push(p);
        }
    }
    Ok(distinct)
}

/// One plan as it ran.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct TriedPlan {
    pub(crate) kind: &'static str,
    pub(crate) label: String,
    pub(crate) file: PathBuf,
    pub(crate) log: PathBuf,
    pub(crate) predicted_step_time_s: f64,
    /// Median of the timed steps; `None` when the run failed.
    pub(crate) measured_step_time_s: Option<f64>,
    /// (predicted − measured) ÷ measured, %.
    pub(crate) prediction_error_percent: Option<f64>,
    /// The measured step's share of the summed devices, and of the integer-split
    /// ceiling (the planner's bound: each device alone, as priced).
    pub(crate) measured_fraction_of_bound: Option<f64>,
    pub(crate) measured_fraction_of_integer_split: Option<f64>,
    /// Why the run failed.
    pub(crate) failure: Option<String>,
    /// Whether this is the plan written to --output (the measured fastest).
    pub(crate) written: bool,
    /// Predicted again with the profile calibrated by every tried plan's run, s.
    pub(crate) calibrated_step_time_s: Option<f64>,
    #[serde(skip)]
    pub(crate) plan: Plan,
    pub(crate) train_flags: Vec<String>,
}

/// Every tried plan, and which was fastest.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct TryReport {
    pub(crate) steps_per_plan: u64,
    pub(crate) timed_steps: u64,
    pub(crate) tried: Vec<TriedPlan>,
    /// Index in `tried` of the measured fastest (the predicted fastest is 0).
    pub(crate) measured_best: usize,
    /// How much faster the measured best ran than the predicted best, % (0 when they
    /// are one plan; `None` when the predicted best failed).
    pub(crate) gain_over_predicted_best_percent: Option<f64>,
    /// The profile calibrated by the tried plans' runs (with `--profile`).
    pub(crate) calibrated_profile: Option<PathBuf>,
    /// Why no calibrated profile was written, when one was asked for.
    pub(crate) calibration_failure: Option<String>,
}

impl TryReport {
    pub(crate) fn best(&self) -> &TriedPlan {
        &self.tried[self.measured_best]
    }

    /// The plan `--output` holds: the measured fastest, with its predicted ratios.
    pub(crate) fn written_plan(&self, bound: &ThroughputBound, tokens: f64) -> WrittenPlan {
        let best = self.best();
        let step = (tokens, best.predicted_step_time_s);
        WrittenPlan::new(best.kind, bound, step, best.train_flags.clone())
    }
}

/// Trains each of the first `settings.plans` of `plans` and reports them, with
/// `profile` calibrated by their runs; an error when not one of them trained.
pub(crate) fn try_plans(
    settings: &TrySettings,
    plans: &[PlanToTry],
    profile: Option<&Profile>,
    (bound, tokens_per_step): (&ThroughputBound, f64),
) -> Result<TryReport> {
    std::fs::create_dir_all(&settings.dir)
        .with_context(|| format!("creating {}", settings.dir.display()))?;
    let exe = std::env::current_exe().context("finding this executable to train with")?;
    let mut tried = Vec::new();
    for (k, p) in plans.iter().take(settings.plans).enumerate() {
        eprintln!(
            "[plan --try] {}/{}: {} (predicted {:.4} s per step)",
            k + 1,
            settings.plans.min(plans.len()),
            p.label,
            p.predicted_s
        );
        let mut one = try_one(&exe, settings, k, p)?;
        if let Some(m) = one.measured_step_time_s {
            one.measured_fraction_of_bound = Some(bound.fraction(tokens_per_step, m));
            one.measured_fraction_of_integer_split =
                Some(bound.fraction_of_integer_split(tokens_per_step, m));
        }
        tried.push(one);
    }
    let measured = |t: &TriedPlan| t.measured_step_time_s.unwrap_or(f64::INFINITY);
    let measured_best = (0..tried.len())
        .min_by(|&a, &b| measured(&tried[a]).total_cmp(&measured(&tried[b])))
        .filter(|&best| tried[best].measured_step_time_s.is_some())
        .with_context(|| {
            let failures: Vec<String> = (tried.iter())
                .map(|t| format!("{}: {}", t.label, t.failure.clone().unwrap_or_default()))
                .collect();
            format!("--try: no tried plan trained:\n  {}", failures.join("\n  "))
        })?;
    tried[measured_best].written = true;
    let gain = (tried[0].measured_step_time_s)
        .map(|first| (first / measured(&tried[measured_best]) - 1.0) * 100.0);
    let mut report = TryReport {
        steps_per_plan: settings.iters,
        timed_steps: settings.iters - settings.warm_up() as u64,
        tried,
        measured_best,
        gain_over_predicted_best_percent: gain,
        calibrated_profile: None,
        calibration_failure: None,
    };
    if let Some(profile) = profile {
        if let Err(e) = calibrate_tried(settings, profile, &mut report) {
            report.calibration_failure = Some(format!("{e:#}"));
        }
    }
    Ok(report)
}

/// Calibrates `profile` by the tried plans' runs (the steps after the warm-up), writes
/// it beside them, and prices each tried plan again with it.
fn calibrate_tried(
    settings: &TrySettings,
    profile: &Profile,
    report: &mut TryReport,
) -> Result<()> {
    let mut runs = Vec::new();
    let mut of_tried = Vec::new();
    for (k, t) in report.tried.iter().enumerate() {
        if t.measured_step_time_s.is_none() {
            continue;
        }
        let text = std::fs::read_to_string(&t.log)
            .with_context(|| format!("reading {}", t.log.display()))?;
        let name = t.log.display().to_string();
        // The run of the plan tried (a re-planning switch would start a second).
        if let Some(run) = MeasuredRun::parse(&name, &text, settings.warm_up())?
            .into_iter()
            .next()
        {
            runs.push(run);
            of_tried.push(k);
        }
    }
    let (fitted, checks) = calibrate(profile, &runs)?;
    let file = settings.dir.join("calibrated-profile.json");
    write_atomically(&file, &serde_json::to_string_pretty(&fitted)?)?;
    for (k, check) in of_tried.into_iter().zip(checks) {
        report.tried[k].calibrated_step_time_s = Some(check.after_s);
    }
    report.calibrated_profile = Some(file);
    Ok(())
}

/// Writes plan `k`, trains it, and reads its timed steps back.
fn try_one(exe: &Path, settings: &TrySettings, k: usize, p: &PlanToTry) -> Result<TriedPlan> {
    let file = settings.dir.join(format!("try-{k}.toml"));
    let log = settings.dir.join(format!("try-{k}.jsonl"));
    let output = settings.dir.join(format!("try-{k}.log"));
    write_atomically(&file, &p.plan.to_toml()?)?;
    let _ = std::fs::remove_file(&log);
    let console =
        std::fs::File::create(&output).with_context(|| format!("creating {}", output.display()))?;
    let status = Command::new(exe)
        .arg("train")
        .args(["--nproc", &p.plan.world_size().to_string()])
        .arg("--plan")
        .arg(&file)
        .args(["--train-iters", &settings.iters.to_string()])
        .arg("--log-json")
        .arg(&log)
        .args(&p.train_flags)
        .args(&settings.train_args)
        .stdout(console.try_clone()?)
        .stderr(console)
        .status()
        .with_context(|| format!("starting {} train", exe.display()))?;
    let measured = match status.success() {
        true => timed_median_s(&log, settings.warm_up()),
        false => {
            let text = std::fs::read_to_string(&output).unwrap_or_default();
            let last = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            Err(anyhow::anyhow!(
                "training exited with {status}: {last} (its output: {})",
                output.display()
            ))
        }
    };
    let (measured, failure) = match measured {
        Ok(s) => (Some(s), None),
        Err(e) => (None, Some(format!("{e:#}"))),
    };
    Ok(TriedPlan {
        kind: p.kind,
        label: p.label.clone(),
        file,
        log,
        predicted_step_time_s: p.predicted_s,
        measured_step_time_s: measured,
        prediction_error_percent: measured.map(|m| (p.predicted_s - m) / m * 100.0),
        measured_fraction_of_bound: None,
        measured_fraction_of_integer_split: None,
        failure,
        written: false,
        calibrated_step_time_s: None,
        plan: p.plan.clone(),
        train_flags: p.train_flags.clone(),
    })
}

/// The median step of a `--log-json` log after its first `warm_up` iterations, s.
fn timed_median_s(log: &Path, warm_up: usize) -> Result<f64> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let mut steps: Vec<f64> = text
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|record| record.get("elapsed_ms").and_then(|v| v.as_f64()))
        .skip(warm_up)
        .collect();
    if steps.is_empty() {
        bail!("{}: no step after the warm-up was logged", log.display());
    }
    steps.sort_by(f64::total_cmp);
    Ok(steps[steps.len() / 2] / 1e3)
}

/// The report as a table.
pub(crate) fn print_try_report(report: &TryReport) {
    println!(
        "tried {} plans, {} steps each ({} timed, median):",
        report.tried.len(),
        report.steps_per_plan,
        report.timed_steps
    );
    for (k, t) in report.tried.iter().enumerate() {
        let measured = match (t.measured_step_time_s, &t.failure) {
            (Some(m), _) => format!(
                "measured {m:.4} s (predicted {:+.1} %; {:.1} % of the bound, {:.1} % of the integer split)",
                t.prediction_error_percent.unwrap_or_default(),
                t.measured_fraction_of_bound.unwrap_or_default() * 100.0,
                t.measured_fraction_of_integer_split.unwrap_or_default() * 100.0
            ),
            (None, failure) => format!("failed: {}", failure.as_deref().unwrap_or("")),
        };
        let mark = if k == report.measured_best { "*" } else { " " };
        let calibrated = match (t.calibrated_step_time_s, t.measured_step_time_s) {
            (Some(c), Some(m)) => format!("; calibrated {c:.4} s ({:+.1} %)", (c - m) / m * 100.0),
            _ => String::new(),
        };
        println!(
            "{mark} #{k} {}: predicted {:.4} s, {measured}{calibrated}",
            t.label, t.predicted_step_time_s
        );
    }
    match (&report.calibrated_profile, &report.calibration_failure) {
        (Some(file), _) => println!(
            "calibrated profile (the tried runs fitted in): {}",
            file.display()
        ),
        (None, Some(why)) => println!("no calibrated profile: {why}"),
        (None, None) => {}
    }
    match report.gain_over_predicted_best_percent {
        Some(_) if report.measured_best == 0 => {
            println!("the predicted best was also the measured best")
        }
        Some(g) => println!(
            "the measured best (#{}) ran {g:.1} % faster than the predicted best (#0)",
            report.measured_best
        ),
        None => println!(
            "the predicted best (#0) failed; the measured best is #{}",
            report.measured_best
        ),
    }
}
