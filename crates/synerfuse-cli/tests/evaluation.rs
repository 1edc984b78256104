//! Evaluation: the validation and test losses do not depend on the plan, and read as
//! Megatron's.

mod support;

use support::*;

/// (split, iteration, at end, loss, ppl) of each evaluation record.
fn evaluations(log: &std::path::Path) -> Vec<(String, u64, bool, f64, f64)> {
    json_records(log)
        .iter()
        .filter(|v| v.get("evaluation").is_some())
        .map(|v| {
            (
                v["evaluation"].as_str().unwrap().to_owned(),
                v["iteration"].as_u64().unwrap(),
                v["at_end"].as_bool().unwrap(),
                v["lm_loss"].as_f64().unwrap(),
                v["lm_loss_ppl"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// `common`'s arguments with an 80/10/10 split, evaluating 2 global batches every 2 of
/// 4 iterations, logging to `name.jsonl` and saving to `name/`.
fn evaluating(
    d: &std::path::Path,
    data: &std::path::Path,
    name: &str,
    extra: &[&str],
) -> Vec<String> {
    let mut args = common(d, data, 4);
    let split = args.iter().position(|a| a == "--split").unwrap();
    args[split + 1] = "80,10,10".into();
    args.extend(strings(&["--eval-iters", "2", "--eval-interval", "2"]));
    args.extend(strings(extra));
    args.extend([
        "--log-json".into(),
        d.join(format!("{name}.jsonl")).display().to_string(),
        "--save".into(),
        d.join(name).display().to_string(),
    ]);
    args
}

#[test]
fn validation_and_test_losses_do_not_depend_on_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let out = synerfuse(&evaluating(
        d,
        &data,
        "single",
        &["--micro-batch-size", "1"],
    ));
    ok(&out, "single rank");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let reference = evaluations(&d.join("single.jsonl"));
    let points: Vec<(&str, u64, bool)> = reference
        .iter()
        .map(|(split, iteration, end, _, _)| (split.as_str(), *iteration, *end))
        .collect();
    assert_eq!(
        points,
        [
            ("validation", 2, false),
            ("validation", 4, false),
            ("validation", 4, true),
            ("test", 4, true),
        ]
    );
    for (_, _, _, loss, ppl) in &reference {
        assert!(loss.is_finite() && *loss > 0.0);
        assert!(
            (ppl - loss.exp()).abs() <= 1e-12 * ppl,
            "PPL {ppl} != exp({loss})"
        );
    }
    // Megatron's lines: the result between two rows of dashes as long as it, plus one.
    for prefix in [
        "iteration 2",
        "iteration 4 on validation set",
        "iteration 4 on test set",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!(" validation loss at {prefix} | lm loss value: ")))
            .unwrap_or_else(|| panic!("no line for {prefix} in\n{stdout}"));
        assert!(
            line.contains(" | lm loss PPL: ") && line.ends_with(" | "),
            "{line}"
        );
        let dashes = "-".repeat(line.len() + 1);
        assert!(
            stdout.contains(&format!("{dashes}\n{line}\n{dashes}")),
            "{stdout}"
        );
    }
    let plans: [(&str, Vec<&str>); 4] = [
        (
            "PP 2, layers [1,3], mbs 2 x 3",
            vec![
                "--nproc",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--hetero-pipeline-stages",
                "2",
                "1",
                "3",
                "--micro-batch-size",
                "2",
            ],
        ),
        (
            "DP 2, mbs [2,1] x counts [2,2]",
            vec![
                "--nproc",
                "2",
                "--micro-batch-size-per-dp",
                "1",
                "2",
                "1",
                "1",
                "--num-micro-batches-per-dp",
                "1",
                "2",
                "1",
                "2",
            ],
        ),
        (
            "TP 2 + SP x PP 2 interleaved, mbs 1 x 6",
            vec![
                "--nproc",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--micro-batch-size",
                "1",
            ],
        ),
        (
            "per-stage CP [2,1] x PP 2 by meshes, mbs 2 x 3",
            vec![
                "--nproc",
                "3",
                "--enable-hetero",
                "--hetero-process-meshes",
                "1",
                "2",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "--hetero-device-types",
                "a",
                "b",
                "--hetero-pipeline-layer-split",
                "2",
                "2",
                "--micro-batch-size",
                "2",
            ],
        ),
    ];
    for (i, (label, flags)) in plans.iter().enumerate() {
        let name = format!("plan{i}");
        ok(&synerfuse(&evaluating(d, &data, &name, flags)), label);
        let got = evaluations(&d.join(format!("{name}.jsonl")));
        assert_eq!(got.len(), reference.len(), "{label}");
        let mut worst: f64 = 0.0;
        for (a, b) in got.iter().zip(&reference) {
            assert_eq!((&a.0, a.1, a.2), (&b.0, b.1, b.2), "{label}");
            let rel = (a.3 - b.3).abs() / b.3;
            assert!(
                rel < 1e-5,
                "{label}: {} at {}: {} vs {} ({rel:e})",
                a.0,
                a.1,
                a.3,
                b.3
            );
            worst = worst.max(rel);
        }
        println!("| {label} | {worst:.2e} |");
    }
    // --skip-train evaluates the loaded checkpoint: the validation split from its start
    // and the test split, as the end of training did for the test split.
    let mut args = evaluating(
        d,
        &data,
        "skip",
        &["--micro-batch-size", "3", "--skip-train"],
    );
    args.extend(strings(&["--load", d.join("single").to_str().unwrap()]));
    ok(&synerfuse(&args), "--skip-train");
    let skipped = evaluations(&d.join("skip.jsonl"));
    assert_eq!(skipped.len(), 2);
    assert_eq!((skipped[1].0.as_str(), skipped[1].1), ("test", 4));
    assert!((skipped[1].3 - reference[3].3).abs() / reference[3].3 < 1e-5);
    assert!(json_records(&d.join("skip.jsonl"))
        .iter()
        .all(|v| v.get("evaluation").is_some()));
}

/// `--mock-data` trains and evaluates on Megatron's synthetic documents, the same under
/// a single rank and a pipeline; with --data-path it is refused, and a vocabulary smaller
/// than its token ids is named.
#[test]
fn mock_data_trains_and_evaluates_alike_under_any_plan() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let args = |name: &str, extra: &[&str]| {
        let mut args = strings(&[
            "train",
            "--mock-data",
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--ffn-hidden-size",
            "64",
            "--seq-length",
            "256",
            "--disable-bias-linear",
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--lr",
            "3e-3",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "3",
            "--eval-iters",
            "1",
            "--eval-interval",
            "2",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "4096",
            "--device",
            "cpu",
            "--seed",
            "5",
        ]);
        args.extend(strings(extra));
        args.extend(strings(&[
            "--log-json",
            d.join(format!("{name}.jsonl")).to_str().unwrap(),
        ]));
        args
    };
    ok(&synerfuse(&args("single", &[])), "single rank");
    let pp = ["--nproc", "2", "--pipeline-model-parallel-size", "2"];
    ok(&synerfuse(&args("pp", &pp)), "PP 2");
    let (single, pp) = (d.join("single.jsonl"), d.join("pp.jsonl"));
    assert_eq!(losses(&single).len(), 3);
    assert!(max_rel_loss_diff(&losses(&single), &losses(&pp)) < 1e-5);
    let evaluations =
        |log: &std::path::Path| -> Vec<f64> { evaluations(log).into_iter().map(|e| e.3).collect() };
    // Validation at iteration 2 and at the end, then the test split.
    assert_eq!(evaluations(&single).len(), 3);
    assert!(max_rel_loss_diff(&evaluations(&single), &evaluations(&pp)) < 1e-5);

    let both = synerfuse(&args("both", &["--data-path", "x"]));
    assert!(!both.status.success());
    assert!(String::from_utf8_lossy(&both.stderr).contains("--mock-data"));
    let mut small = args("small", &[]);
    let vocab = small.iter().position(|a| a == "--vocab-size").unwrap();
    small[vocab + 1] = "1000".into();
    let small = synerfuse(&small);
    assert!(!small.status.success());
    let stderr = String::from_utf8_lossy(&small.stderr);
    assert!(
        stderr.contains("--mock-data") && stderr.contains("up to 4094"),
        "{stderr}"
    );
}
