//! `--fp16`: fp16 compute with fp32 master weights and main gradients, and Megatron's loss
//! scaling. Plans against one fp16 rank (the bf16 rows' tolerance), the dynamic scale's
//! skips as megatron-core's `DynamicGradScaler` takes them, a skipped step's parameters
//! untouched, the scaler resumed from a checkpoint, and the flags' errors.

mod support;

use support::*;
use synerfuse_train::loss_scale::{DynamicLossScale, GradScaler, LossScaling};
use tch::Kind;

/// A scale the tiny model's gradients never overflow at (it trains at 2^17..2^19 from
/// the default start): every step updates, on one rank as on many.
const NO_OVERFLOW: [&str; 3] = ["--fp16", "--initial-loss-scale", "4096"];

/// The iterations' records of a JSON log (not its run, save or evaluation records).
fn iterations(path: &std::path::Path) -> Vec<serde_json::Value> {
    (json_records(path).into_iter())
        .filter(|r| r.get("skipped").is_some())
        .collect()
}

/// Each iteration's `skipped` and `loss_scale` from a JSON log.
fn scales(path: &std::path::Path) -> Vec<(bool, f64)> {
    let field = |r: &serde_json::Value| (r["skipped"].as_bool(), r["loss_scale"].as_f64());
    (iterations(path).iter())
        .map(|r| match field(r) {
            (Some(skipped), Some(scale)) => (skipped, scale),
            _ => panic!("an iteration record without skipped or loss_scale: {r}"),
        })
        .collect()
}

#[test]
fn fp16_plans_match_one_fp16_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        [&NO_OVERFLOW[..], extra].concat()
    }
    let (reference, _) = run(d, &data, "one", &with(&["--micro-batch-size", "2"]));
    let (fp32, _) = run(d, &data, "fp32", &["--micro-batch-size", "2"]);
    let (bf16, _) = run(d, &data, "bf16", &["--micro-batch-size", "2", "--bf16"]);
    let hetero = plan_file(
        d,
        "hetero",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 2\n\
         [[replica]]\nlayers = [3, 1]\nmicro_batch_size = 1\nnum_micro_batches = 2\n",
    );
    let mut table = EquivalenceTable::default();
    let cases: [(&str, Vec<&str>); 3] = [
        ("fp16 DP 2", vec!["--nproc", "2", "--micro-batch-size", "1"]),
        (
            "fp16 PP 2",
            vec![
                "--nproc",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
            ],
        ),
        (
            "fp16 hetero PP x DP: [4] (mbs 2) + [3, 1] (mbs 1), distributed optimizer",
            vec![
                "--nproc",
                "3",
                "--plan",
                &hetero,
                "--use-distributed-optimizer",
            ],
        ),
    ];
    for (i, (label, flags)) in cases.iter().enumerate() {
        let (losses, _) = run(d, &data, &format!("case{i}"), &with(flags));
        table.check_bf16(&format!("{label} vs one fp16 rank"), &reference, &losses);
    }
    // What each low precision costs against fp32 on one rank (reported, and bounded).
    table.check_bf16("fp16, one rank, vs one fp32 rank", &fp32, &reference);
    table.check_bf16("bf16, one rank, vs one fp32 rank", &fp32, &bf16);
    // A precision per replica and per stage (the plan's), against one fp32 rank: within
    // what the worse of the two precisions alone costs (x 1.5).
    let bound = 1.5 * max_rel_loss_diff(&fp32, &bf16).max(max_rel_loss_diff(&fp32, &reference));
    let replicas = "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 2\nprecision = [\"bf16\"]\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 2\nprecision = [\"fp16\"]\n";
    let pipeline = "[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 6\nprecision = [\"fp16\", \"bf16\"]\n";
    // The distributed optimizer's gather then carries the fp32 masters, each replica
    // casting them to its own dtype.
    let sharded = ["--use-distributed-optimizer", "--overlap-param-gather"];
    let mixed: [(&str, &str, &[&str]); 3] = [
        (
            "a bf16 replica [4] (mbs 2) + an fp16 replica [4] (mbs 1)",
            replicas,
            &[],
        ),
        (
            "the same, distributed optimizer, overlapped parameter gather",
            replicas,
            &sharded,
        ),
        (
            "a pipeline of an fp16 stage and a bf16 stage [2, 2]",
            pipeline,
            &[],
        ),
    ];
    for (i, (label, text, extra)) in mixed.iter().enumerate() {
        let plan = plan_file(d, &format!("mixed{i}"), text);
        // The fp16 ranks make the job scale dynamically, from 4096 here.
        let flags = [
            &[
                "--nproc",
                "2",
                "--plan",
                &plan,
                "--initial-loss-scale",
                "4096",
            ][..],
            extra,
        ]
        .concat();
        let (losses, params) = run(d, &data, &format!("mixed{i}"), &flags);
        let diff = max_rel_loss_diff(&fp32, &losses);
        table.check_bf16(&format!("{label} vs one fp32 rank"), &fp32, &losses);
        assert!(
            diff <= bound,
            "{label}: {diff:e} against fp32, bound {bound:e}"
        );
        assert!(params.values().all(|t| t.kind() == Kind::Float));
    }
    table.print();
}

/// An expert-parallel group of a bf16 replica and an fp16 replica (tokens and their
/// gradients travel in fp32, each member converting what it receives) against one fp32
/// rank, within what the worse of the two precisions alone costs the same MoE model
/// (x 1.5).
#[test]
fn an_expert_group_of_two_precisions_trains_like_fp32() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let experts = [
        "--num-experts",
        "4",
        "--moe-ffn-hidden-size",
        "32",
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "--moe-aux-loss-coeff",
        "0.05",
        "--initial-loss-scale",
        "4096",
    ];
    let with = |extra: &[&'static str]| [&experts[..], extra].concat();
    let (fp32, _) = run(d, &data, "fp32", &with(&["--micro-batch-size", "2"]));
    let (bf16, _) = run(
        d,
        &data,
        "bf16",
        &with(&["--micro-batch-size", "2", "--bf16"]),
    );
    let (fp16, _) = run(
        d,
        &data,
        "fp16",
        &with(&["--micro-batch-size", "2", "--fp16"]),
    );
    let bound = 1.5 * max_rel_loss_diff(&fp32, &bf16).max(max_rel_loss_diff(&fp32, &fp16));
    let plan = plan_file(
        d,
        "ep",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 2\nprecision = [\"bf16\"]\nexperts = [[0, 1, 2]]\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 2\nprecision = [\"fp16\"]\nexperts = [[3]]\n",
    );
    let ep_flags = [&experts[..], &["--nproc", "2", "--plan", &plan]].concat();
    let (losses, _) = run(d, &data, "ep", &ep_flags);
    let mut table = EquivalenceTable::default();
    table.check_bf16("bf16, one rank, vs one fp32 rank", &fp32, &bf16);
    table.check_bf16("fp16, one rank, vs one fp32 rank", &fp32, &fp16);
    let label = "EP 2 experts [3, 1]: a bf16 replica + an fp16 replica, vs one fp32 rank";
    table.check_bf16(label, &fp32, &losses);
    table.print();
    let diff = max_rel_loss_diff(&fp32, &losses);
    assert!(diff <= bound, "{diff:e} against fp32, bound {bound:e}");
}

/// A plan naming a precision synerfuse does not have is refused by file and value.
#[test]
fn an_unknown_precision_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let bad = plan_file(
        d,
        "fp8",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 3\nprecision = [\"fp8\"]\n",
    );
    let mut args = common(d, &data, 1);
    args.extend(strings(&["--plan", &bad]));
    let out = synerfuse(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("fp8") && stderr.contains("fp8.toml"),
        "{stderr}"
    );
}

#[test]
fn fp16_skips_overflowing_steps_as_megatron_does() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    // Megatron's default start, 2^32: the first steps overflow.
    let mut args = common(d, &data, 16);
    args.extend(strings(&["--fp16", "--micro-batch-size", "2"]));
    let log = d.join("dynamic.jsonl");
    args.extend(strings(&["--log-json", log.to_str().unwrap()]));
    ok(&synerfuse(&args), "fp16, dynamic scale");
    let seen = scales(&log);
    let skipped: Vec<bool> = seen.iter().map(|s| s.0).collect();
    assert!(
        skipped[..3].iter().all(|&s| s) && skipped.iter().any(|&s| !s),
        "the first steps overflow at 2^32, later ones do not: {seen:?}"
    );
    // The scale after each step is megatron-core's from the same overflow flags
    // (GradScaler equals DynamicGradScaler: tests/loss_scale.rs).
    let mut scaler = GradScaler::new(LossScaling::Dynamic(DynamicLossScale::default()));
    for (step, &(overflow, scale)) in seen.iter().enumerate() {
        scaler.update(overflow);
        assert_eq!(
            scale,
            f64::from(scaler.scale()),
            "step {}: {seen:?}",
            step + 1
        );
    }
    // The learning rate stands still over skipped steps: the first update takes the
    // first step's rate (warm-up's 0), the second the rate fp32's second step takes.
    let records = iterations(&log);
    let first = skipped.iter().position(|&s| !s).unwrap();
    let lr = |r: &serde_json::Value| r["lr"].as_f64().unwrap();
    assert!(records[..=first].iter().all(|r| lr(r) == lr(&records[0])));
    let fp32_log = d.join("fp32.jsonl");
    let mut args = common(d, &data, 16);
    args.extend(strings(&["--micro-batch-size", "2", "--log-json"]));
    args.push(fp32_log.display().to_string());
    ok(&synerfuse(&args), "fp32");
    let fp32 = iterations(&fp32_log);
    assert_eq!(lr(&records[first]), lr(&fp32[0]));
    if !skipped[first + 1] {
        assert_eq!(lr(&records[first + 1]), lr(&fp32[1]));
    }
    // Skipped steps leave the parameters where they were: one skipped step and two
    // save the same parameters.
    let skips = |n: u64| {
        let mut args = common(d, &data, n);
        args.extend(strings(&["--fp16", "--micro-batch-size", "2"]));
        run_args(d, &format!("skip{n}"), args)
    };
    let (one, two) = (skips(1), skips(2));
    assert_eq!(max_param_diff(&one.1, &two.1), 0.0);
}

#[test]
fn the_loss_scale_resumes_from_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    // From 2^22 the first steps overflow (hysteresis 2, then halved each time): the stop
    // at step 3 falls among them, with the scale and trackers mid-way.
    let flags = [
        "--fp16",
        "--initial-loss-scale",
        "4194304",
        "--micro-batch-size",
        "2",
    ];
    let straight = d.join("straight.jsonl");
    let mut args = common(d, &data, 6);
    args.extend(strings(&flags));
    args.extend(strings(&["--log-json", straight.to_str().unwrap()]));
    ok(&synerfuse(&args), "straight");
    let resumed = stop_and_resume(d, &data, "resumed", &flags, &flags);
    let straight_losses = losses(&straight);
    assert_eq!(resumed, straight_losses[3..], "losses after the resume");
    let seen = scales(&straight);
    assert!(seen[0].0 && seen[2].0, "steps 1 and 3 overflow: {seen:?}");
    assert_eq!(scales(&d.join("resumed.jsonl")), seen[3..]);
    // A constant scale never changes and never skips here.
    let constant = d.join("constant.jsonl");
    let mut args = common(d, &data, 3);
    args.extend(strings(&[
        "--fp16",
        "--loss-scale",
        "1024",
        "--micro-batch-size",
        "2",
    ]));
    args.extend(strings(&["--log-json", constant.to_str().unwrap()]));
    ok(&synerfuse(&args), "constant");
    assert_eq!(scales(&constant), vec![(false, 1024.0); 3]);
}

#[test]
fn bad_loss_scale_flags_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    for (flags, named) in [
        (vec!["--fp16", "--bf16"], "--bf16"),
        (
            vec![
                "--fp16",
                "--initial-loss-scale",
                "4",
                "--min-loss-scale",
                "8",
            ],
            "--min-loss-scale",
        ),
        (
            vec!["--fp16", "--loss-scale-window", "2.5"],
            "--loss-scale-window",
        ),
        (vec!["--fp16", "--hysteresis", "0"], "--hysteresis"),
        (vec!["--fp16", "--loss-scale", "0"], "--loss-scale"),
    ] {
        let mut args = common(d, &data, 1);
        args.extend(strings(&flags));
        args.extend(strings(&["--micro-batch-size", "2"]));
        let out = synerfuse(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} must fail");
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
    }
}

#[test]
fn the_planner_gives_devices_without_bf16_fp16_and_train_runs_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two emulated CPU devices of equal numbers, the second without bf16 (a V100's case).
    let cluster = d.join("cluster.toml");
    std::fs::write(
        &cluster,
        "[[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 4\n\
         [[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_fp16 = 0.05\nbf16 = false\nmemory_gb = 4\n\
         [network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let plan = d.join("plan.toml");
    let mut args = strings(&["plan", "--cluster", cluster.to_str().unwrap()]);
    args.extend(strings(&PLAN_MODEL));
    args.extend(strings(&[
        "--global-batch-size",
        "6",
        "--tensor-model-parallel-sizes",
        "1",
        "--recompute-activations",
        "off",
        "--use-distributed-optimizer",
        "on",
        "--output",
        plan.to_str().unwrap(),
    ]));
    let out = synerfuse(&args);
    ok(&out, "plan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no bf16, so its ranks compute in fp16"),
        "{stderr}"
    );
    let text = std::fs::read_to_string(&plan).unwrap();
    assert!(
        text.contains("\"bf16\"") && text.contains("\"fp16\""),
        "each rank's precision: {text}"
    );
    // Trained as planned: rank by rank in its precision, the job's loss scaled, the
    // optimizer sharded over the two precisions.
    let data = dataset(d);
    let log = d.join("log.jsonl");
    let mut train = common(d, &data, 2);
    train.extend(strings(&["--nproc", "2", "--plan", plan.to_str().unwrap()]));
    train.push("--use-distributed-optimizer".into());
    train.extend(strings(&["--log-json", log.to_str().unwrap()]));
    let out = synerfuse(&train);
    ok(&out, "train --plan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("computes in fp16 (the plan's precision for it)")
            && stderr.contains("computes in bf16 (the plan's precision for it)"),
        "{stderr}"
    );
    assert_eq!(
        scales(&log)[0],
        (true, 4294967296.0),
        "fp16 ranks: the job scales"
    );
    // Kept in bf16, such a device is refused by name.
    let mut args = args.clone();
    args.push("--no-fp16-fallback".into());
    let out = synerfuse(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("cpu has no bf16"),
        "{stderr}"
    );
}
