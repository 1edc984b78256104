//! The calibration's tests: logs priced by a known profile, fitted back.

use super::*;
use synerfuse_plan::{MeasuredCosts, MeasuredNetwork, Plan, RunReduction};

fn model() -> ModelShape {
    ModelShape {
        num_layers: 4,
        hidden_size: 64,
        num_heads: 4,
        num_kv_heads: 4,
        ffn_hidden_size: 172,
        vocab_size: 256,
        seq_length: 32,
        tied: false,
        experts: None,
    }
}

fn profile(scale: f64) -> Profile {
    let costs = |b: f64| MeasuredCosts {
        layer_fwd_s: 1e-3 * b * scale,
        layer_bwd_s: 2e-3 * b * scale,
        embedding_s: 1e-4 * b * scale,
        head_s: 5e-4 * b * scale,
        layer_activation_bytes: 1e5 * b,
        optimizer_s_per_param: Some(1e-8),
    };
    Profile {
        model: model(),
        devices: BTreeMap::from([(
            "cpu".to_owned(),
            BTreeMap::from([(1, costs(1.0)), (2, costs(1.8))]),
        )]),
        network: Some(MeasuredNetwork {
            p2p_bytes_per_s: 1e9,
            allreduce_bytes_per_s: 5e8,
            latency_s: 2e-5,
            ranks: 3,
        }),
        calibration: None,
    }
}

/// A pipeline of two ranks beside a rank holding the model.
const PLAN: &str = r#"
[[replica]]
layers = [2, 2]
micro_batch_size = 2
num_micro_batches = 3
speeds = [1.0, 0.5]
kinds = ["cpu", "cpu"]

[[replica]]
layers = [4]
micro_batch_sizes = [2, 2, 1]
speeds = [1.0]
kinds = ["cpu"]
"#;

fn record(plan: &Plan) -> RunRecord {
    RunRecord {
        model: model(),
        plan: plan.clone(),
        hosts: Vec::new(),
        recompute: false,
        distributed_optimizer: false,
        compute_bytes: 4.0,
        reduction: RunReduction::default(),
    }
}

/// A log of `steps` steps of `plan` as `truth` prices it, each `overhead_s` longer.
fn log(plan: &Plan, truth: &Profile, overhead_s: f64, steps: u64) -> String {
    log_reducing(plan, truth, (overhead_s, steps), RunReduction::default())
}

/// [`log`] of a run that reduced as `reduction` (its record saying so).
fn log_reducing(
    plan: &Plan,
    truth: &Profile,
    (overhead_s, steps): (f64, u64),
    reduction: RunReduction,
) -> String {
    let run = RunRecord {
        reduction,
        ..record(plan)
    };
    let (step_s, rows) = predict_timeline(&run_cost_model(&run, truth), plan).unwrap();
    let record = serde_json::json!({ "run": run });
    let mut text = format!("{record}\n");
    for iteration in 1..=steps {
        let ranks: Vec<_> = (rows.iter())
            .map(|r| serde_json::json!({ "compute_ms": 1.0, "spans": r.spans }))
            .collect();
        let record = serde_json::json!({
            "iteration": iteration,
            "elapsed_ms": (step_s + overhead_s) * 1e3,
            "ranks": ranks,
        });
        text += &format!(
            "{record}\n{}\n",
            serde_json::json!({"evaluation": "validation", "elapsed_ms": 1.0})
        );
    }
    text
}

#[test]
fn a_calibration_recovers_the_measured_steps_of_its_runs() {
    let plan = Plan::from_toml(PLAN, None).unwrap();
    let truth = profile(1.25);
    let runs =
        MeasuredRun::parse("run.jsonl", &log(&plan, &truth, 0.04, 9), WARM_UP_STEPS).unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].steps_s.len(), 9 - WARM_UP_STEPS);
    let given = profile(1.0);
    let (fitted, checks) = calibrate(&given, &runs).unwrap();
    let c = fitted.calibration.as_ref().unwrap();
    for scale in c.compute_scale["cpu"].values() {
        assert!((scale.forward - 1.25).abs() < 1e-9, "{c:?}");
        assert!((scale.backward - 1.25).abs() < 1e-9, "{c:?}");
    }
    assert!((c.step_overhead_s - 0.04).abs() < 1e-9, "{c:?}");
    let run = &checks[0];
    assert!(run.before_s < run.measured_s * 0.9, "{run:?}");
    assert!(((run.after_s - run.measured_s) / run.measured_s).abs() < 1e-9);
    // The fitted profile prices the run as measured, and a second calibration
    // changes nothing.
    let (refitted, again) = calibrate(&fitted, &runs).unwrap();
    assert!((again[0].before_s - run.measured_s).abs() < 1e-9);
    let refit = refitted.calibration.unwrap();
    assert!((refit.step_overhead_s - 0.04).abs() < 1e-9, "{refit:?}");
}

/// A size the runs used but the profile lacks is fitted into the profile's table
/// (replicas of one size each: a replica's passes are filed under its largest).
#[test]
fn a_size_the_profile_lacks_is_fitted_from_the_runs() {
    let uniform = PLAN.replace(
        "micro_batch_sizes = [2, 2, 1]",
        "micro_batch_size = 1\nnum_micro_batches = 5",
    );
    let plan = Plan::from_toml(&uniform, None).unwrap();
    let runs = MeasuredRun::parse("run.jsonl", &log(&plan, &profile(1.25), 0.0, 9), 5).unwrap();
    let mut given = profile(1.0);
    given.devices.get_mut("cpu").unwrap().remove(&2);
    let (fitted, checks) = calibrate(&given, &runs).unwrap();
    let truth = profile(1.25).costs("cpu", 2).unwrap();
    let size_2 = fitted.devices["cpu"][&2];
    assert!(
        (size_2.layer_bwd_s - truth.layer_bwd_s).abs() < 1e-12,
        "{size_2:?}"
    );
    let run = &checks[0];
    assert!(
        ((run.after_s - run.measured_s) / run.measured_s).abs() < 1e-9,
        "{run:?}"
    );
}

#[test]
fn logs_without_a_run_record_or_spans_are_refused_by_name() {
    let plan = Plan::from_toml(PLAN, None).unwrap();
    let text = log(&plan, &profile(1.0), 0.0, 8);
    let steps_only: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
    let e = MeasuredRun::parse("old.jsonl", &steps_only, WARM_UP_STEPS).unwrap_err();
    assert!(
        e.to_string().starts_with("old.jsonl: step records before"),
        "{e}"
    );
    let short = log(&plan, &profile(1.0), 0.0, WARM_UP_STEPS as u64);
    let runs = MeasuredRun::parse("short.jsonl", &short, WARM_UP_STEPS).unwrap();
    assert!(runs.is_empty());
    let e = calibrate(&profile(1.0), &runs).unwrap_err();
    assert!(matches!(e, CalibrateError::TooShort { .. }), "{e}");
    let broken = text.replacen("\"elapsed_ms\"", "\"elapsed_ms\" 1", 3);
    let e = MeasuredRun::parse("broken.jsonl", &broken, WARM_UP_STEPS).unwrap_err();
    assert!(e.to_string().starts_with("broken.jsonl, line "), "{e}");
    let mut other = profile(1.0);
    other.model.seq_length = 64;
    let runs = MeasuredRun::parse("run.jsonl", &text, WARM_UP_STEPS).unwrap();
    let e = calibrate(&other, &runs).unwrap_err();
    assert!(matches!(e, CalibrateError::OtherModel { .. }), "{e}");
}

/// A run that reduced after the pipeline (its record says so) is priced so, not
/// overlapped (which would be faster); a record from before runs said reduced so too.
#[test]
fn a_run_is_priced_reducing_as_its_record_says() {
    let plan = Plan::from_toml(PLAN, None).unwrap();
    let after = RunReduction {
        overlap_grad_reduce: false,
        ddp_bucket_size: None,
        overlap_param_gather: false,
        hierarchical: true,
    };
    let text = log_reducing(&plan, &profile(1.25), (0.01, 9), after);
    let runs = MeasuredRun::parse("after.jsonl", &text, WARM_UP_STEPS).unwrap();
    assert_eq!(runs[0].run.reduction, after);
    let (step_s, _) = runs[0].simulate(&profile(1.25)).unwrap();
    assert!((step_s + 0.01 - runs[0].step_s()).abs() < 1e-12);
    let mut overlapped = runs[0].clone();
    overlapped.run.reduction = RunReduction::default();
    assert!(overlapped.simulate(&profile(1.25)).unwrap().0 < step_s - 1e-6);
    let old = text.replace(r#""overlap_grad_reduce":false,"#, "");
    let old = old.replace(r#","ddp_bucket_size":null"#, "");
    assert!(!old.contains("overlap_grad_reduce"), "{old}");
    let runs = MeasuredRun::parse("old.jsonl", &old, WARM_UP_STEPS).unwrap();
    assert_eq!(runs[0].run.reduction, after);
}
