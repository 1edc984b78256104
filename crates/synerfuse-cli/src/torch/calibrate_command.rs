//! `synerfuse profile --calibrate LOG.jsonl... --profile P --output Q`: a profile fitted
//! to measured runs (the fitting is `synerfuse_planner::calibrate`'s).

use crate::files::write_atomically;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use synerfuse_planner::calibrate::{calibrate, MeasuredRun, RunCheck, WARM_UP_STEPS};
use synerfuse_planner::profile::Calibration;
use synerfuse_planner::profile::Profile;

/// Reads `profile` and the runs of `logs`, writes the calibrated profile to `output`,
/// and prints the fitted terms and each run predicted before and after.
pub fn run(profile: &Path, logs: &[PathBuf], output: &Path, json: bool) -> Result<()> {
    let text = std::fs::read_to_string(profile)
        .with_context(|| format!("reading {}", profile.display()))?;
    let profile: Profile = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a synerfuse profile", profile.display()))?;
    let mut runs = Vec::new();
    for log in logs {
        let text =
            std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
        runs.extend(MeasuredRun::parse(
            &log.display().to_string(),
            &text,
            WARM_UP_STEPS,
        )?);
    }
    let (fitted, checks) = calibrate(&profile, &runs)?;
    write_atomically(output, &serde_json::to_string_pretty(&fitted)?)?;
    let calibration = fitted.calibration.as_ref().expect("a calibrated profile");
    match json {
        true => println!(
            "{}",
            serde_json::json!({ "calibration": calibration, "runs": checks, "output": output })
        ),
        false => print_report(calibration, &checks, output),
    }
    Ok(())
}

fn print_report(c: &Calibration, checks: &[RunCheck], output: &Path) {
    println!(
        "calibrated from {} runs ({} steps with spans):",
        c.runs, c.steps
    );
    for (kind, sizes) in &c.compute_scale {
        for (size, s) in sizes {
            println!(
                "  {kind}, micro-batch size {size}: forward x{:.3}, backward x{:.3} (measured / profiled)",
                s.forward, s.backward
            );
        }
    }
    if let Some(send) = c.send_s {
        println!("  a send's fixed cost: {:.1} us", send * 1e6);
    }
    if let Some(scale) = c.reduce_scale {
        println!("  gradient reduction: x{scale:.3} (measured / simulated)");
    }
    for (kind, scale) in &c.optimizer_scale {
        println!("  {kind} optimizer step: x{scale:.3} (measured / simulated)");
    }
    println!("  step overhead: {:.2} ms", c.step_overhead_s * 1e3);
    for r in checks {
        let off = |s: f64| (s - r.measured_s) / r.measured_s * 100.0;
        println!(
            "{}: measured {:.4} s per step; predicted {:.4} s ({:+.1}%) before, {:.4} s ({:+.1}%) after",
            r.name,
            r.measured_s,
            r.before_s,
            off(r.before_s),
            r.after_s,
            off(r.after_s)
        );
    }
    println!("wrote {}", output.display());
}
