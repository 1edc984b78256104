//! Mixtures of experts in `synerfuse train`: Megatron's MoE flags, the load-balancing loss
//! in the backward and the log, and the equivalence table's MoE rows (data, pipeline,
//! tensor and context parallelism, the distributed optimizer, unequal micro-batches)
//! against one rank.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use support::*;
use synerfuse_model::tch::Tensor;

/// Four experts of width 48 (the dense FFN is 64) in layers 0 and 2, the two best per
/// token, the load-balancing loss weighted 0.05, the router's z-loss 0.01.
const EXPERTS: [&str; 12] = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "48",
    "--moe-layer-freq",
    "2",
    "--moe-aux-loss-coeff",
    "0.05",
    "--moe-z-loss-coeff",
    "0.01",
];

/// `EXPERTS` and `flags`.
fn with<'a>(flags: &[&'a str]) -> Vec<&'a str> {
    EXPERTS
        .iter()
        .copied()
        .chain(flags.iter().copied())
        .collect()
}

/// One iteration's `moe` record.
#[derive(Debug, PartialEq)]
struct ExpertRecord {
    /// Load-balancing loss per MoE layer.
    balance: Vec<f64>,
    /// Router z-loss per MoE layer, where trained.
    z: Option<Vec<f64>>,
    /// Tokens per expert per MoE layer.
    tokens: Vec<Vec<f64>>,
}

/// Each iteration's `moe` record of layers 0 and 2.
fn expert_records(log: &Path) -> Vec<ExpertRecord> {
    let records = expert_records_of(log);
    let layers = (json_records(log).into_iter())
        .filter(|r| r.get("elapsed_ms").is_some())
        .map(|r| r["moe"]["layers"].clone());
    for l in layers {
        assert_eq!(l, serde_json::json!([0, 2]));
    }
    records
}

/// Each iteration's `moe` record.
fn expert_records_of(log: &Path) -> Vec<ExpertRecord> {
    let numbers = |v: &serde_json::Value| -> Vec<f64> {
        (v.as_array().expect("array").iter())
            .map(|x| x.as_f64().expect("number"))
            .collect()
    };
    (json_records(log).iter())
        .filter(|r| r.get("elapsed_ms").is_some())
        .map(|r| {
            let moe = &r["moe"];
            let tokens = (moe["tokens_per_expert"].as_array().expect("layers").iter())
                .map(numbers)
                .collect();
            ExpertRecord {
                balance: numbers(&moe["load_balancing_loss"]),
                z: moe.get("z_loss").map(numbers),
                tokens,
            }
        })
        .collect()
}

/// The same tokens per expert in every iteration's record as `want`'s, and the same
/// load-balancing loss and z-loss of every MoE layer within 1e-5.
fn same_expert_records(label: &str, got: &[ExpertRecord], want: &[ExpertRecord]) {
    assert_eq!(got.len(), want.len(), "{label}: records");
    for (got, want) in got.iter().zip(want) {
        assert_eq!(got.tokens, want.tokens, "{label}: tokens per expert");
        let (z, want_z) = (got.z.as_deref(), want.z.as_deref());
        let (z, want_z) = (z.unwrap_or_default(), want_z.unwrap_or_default());
        let pairs = (got.balance.iter().zip(&want.balance)).chain(z.iter().zip(want_z));
        // A NaN counts as the worst difference (f64::max would drop it).
        let differences = pairs.map(|(a, b)| (a - b).abs() / b);
        let worst = differences.fold(
            0.0,
            |w, d| if d.is_nan() { f64::INFINITY } else { w.max(d) },
        );
        let layers = want.tokens.len();
        assert!(
            (got.balance.len(), z.len()) == (layers, layers) && worst < 1e-5,
            "{label}: {got:?} vs {want:?}"
        );
    }
}

/// Every plan trains what one rank trains with the load-balancing loss and the router
/// z-loss in the backward: losses and parameters within 1e-5, the same tokens per
/// expert, load-balancing loss and z-loss in every iteration's record, each of the
/// step's 6 × 32 tokens counted twice (top 2) per MoE layer once over the ranks.
#[test]
fn expert_models_train_alike_on_any_plan() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let reference = run(d, &data, "single", &with(&["--micro-batch-size", "1"]));
    let reference_experts = expert_records(&d.join("single.jsonl"));
    for record in &reference_experts {
        assert!(record.balance.iter().all(|&l| l > 0.9), "{record:?}");
        // At initialisation the router's logits are near 0: logsumexp near ln 4.
        let z = record.z.as_deref().expect("z_loss");
        assert!(z.iter().all(|&z| z > 1.0 && z < 4.0), "{record:?}");
        assert!(
            (record.tokens.iter()).all(|t| t.iter().sum::<f64>() == 384.0),
            "{record:?}"
        );
    }
    // Each loss moves the parameters, or the rows below could not catch it counted
    // wrong.
    let no_balance = [&EXPERTS[..8], &EXPERTS[10..]].concat();
    for (name, flags) in [
        ("no-balance", &no_balance[..]),
        ("no-z-loss", &EXPERTS[..10]),
    ] {
        let without = [flags, &["--micro-batch-size", "1"]].concat();
        let plain = run(d, &data, &format!("single-{name}"), &without);
        let moved = max_rel_param_diff(&plain.1, &reference.1);
        assert!(moved > 1e-4, "{name}: the loss changed too little: {moved}");
    }
    // With one sequence per micro-batch Megatron's aux_loss is the per-sequence
    // seq_aux_loss, which any split of the batch computes alike.
    let seq = "--moe-router-load-balancing-type";
    let pipeline = replica_plan(d, "pipeline", &[("[1, 3]", 1, 6)]);
    let unequal = replica_plan(d, "unequal", &[("[4]", 2, 2), ("[2, 2]", 1, 2)]);
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "DP 2, mbs 1 x 3",
            with(&["--nproc", "2", "--micro-batch-size", "1"]),
        ),
        (
            "PP 2 [1,3], mbs 1 x 6",
            with(&["--nproc", "2", "--plan", &pipeline]),
        ),
        (
            "TP 2 + SP, recompute, mbs 1 x 6",
            with(&[
                "--nproc",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--recompute-activations",
                "--micro-batch-size",
                "1",
            ]),
        ),
        (
            "CP 2, mbs 1 x 6",
            with(&[
                "--nproc",
                "2",
                "--context-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
            ]),
        ),
        (
            "DP 2, recompute, mbs 1 x 3",
            with(&[
                "--nproc",
                "2",
                "--recompute-activations",
                "--micro-batch-size",
                "1",
            ]),
        ),
        (
            "DP 2 distributed optimizer, mbs 1 x 3",
            with(&[
                "--nproc",
                "2",
                "--use-distributed-optimizer",
                "--micro-batch-size",
                "1",
            ]),
        ),
        (
            "hetero DP [4] mbs 2 x 2 + PP [2,2] mbs 1 x 2, seq_aux_loss, buckets of 5000",
            with(&[
                "--nproc",
                "3",
                "--plan",
                &unequal,
                seq,
                "seq_aux_loss",
                "--ddp-bucket-size",
                "5000",
            ]),
        ),
    ];
    let mut table = EquivalenceTable::default();
    for (i, (label, flags)) in cases.into_iter().enumerate() {
        let name = format!("case{i}");
        let outcome = run(d, &data, &name, &flags);
        table.check(label, &reference, outcome);
        let records = expert_records(&d.join(format!("{name}.jsonl")));
        same_expert_records(label, &records, &reference_experts);
    }
    table.print();
}

/// The log line carries Megatron's `z_loss` and `load_balancing_loss`, TensorBoard their
/// scalars;
/// Megatron's dispatcher flags are accepted; bad MoE flags and token dropping are refused
/// by name.
#[test]
fn expert_flags_log_and_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let mut args = common(d, &data, 2);
    args.extend(strings(&EXPERTS));
    args.extend(strings(&[
        "--micro-batch-size",
        "3",
        "--moe-per-layer-logging",
        // Megatron's dispatcher and kernel choices: the same results here.
        "--moe-token-dispatcher-type",
        "alltoall",
        "--moe-grouped-gemm",
        "--moe-token-drop-policy",
        "probs",
        "--tensorboard-dir",
    ]));
    args.push(d.join("tb").display().to_string());
    let out = synerfuse(&args);
    ok(&out, "per-layer logging");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = (stdout.lines())
        .find(|l| l.contains("iteration        2/"))
        .unwrap_or_else(|| panic!("no log line:\n{stdout}"));
    assert!(
        line.contains("| lm loss: ")
            && line.contains(" | z_loss: ")
            && line.contains(" | load_balancing_loss: "),
        "{line}"
    );
    let event_file = (std::fs::read_dir(d.join("tb")).unwrap())
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("tfevents"))
        .expect("an event file");
    let events = std::fs::read(&event_file).unwrap();
    // A summary value's tag: protobuf field 1, length-delimited (0x0a, its length).
    let has_tag = |tag: &str| {
        let field = [&[0x0a, tag.len() as u8][..], tag.as_bytes()].concat();
        events.windows(field.len()).any(|w| w == field)
    };
    for tag in [
        "load_balancing_loss",
        "moe/load_balancing_loss_layer_2",
        "z_loss",
        "moe/z_loss_layer_0",
        "moe/tokens_per_expert_layer_0_expert_3",
    ] {
        assert!(has_tag(tag), "no {tag} in {}", event_file.display());
    }
    for (flags, expected) in [
        (
            vec!["--num-experts", "4", "--moe-router-topk", "5"],
            "5 experts per token of 4 experts",
        ),
        (
            vec![
                "--num-experts",
                "4",
                "--moe-router-load-balancing-type",
                "sinkhorn",
            ],
            "use aux_loss, seq_aux_loss or none",
        ),
        (
            vec!["--num-experts", "4", "--moe-aux-loss-coeff=-1"],
            "--moe-aux-loss-coeff",
        ),
        (
            vec!["--nproc", "2", "--expert-model-parallel-size", "2"],
            "the model has none",
        ),
        (
            vec![
                "--nproc",
                "2",
                "--num-experts",
                "3",
                "--expert-model-parallel-size",
                "2",
            ],
            "--expert-model-parallel-size 2 does not divide the 3 experts",
        ),
        (
            vec!["--moe-router-topk", "2"],
            "--moe-router-topk: the model has no experts",
        ),
        (
            vec!["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"],
            "--moe-expert-capacity-factor 1: synerfuse routes dropless only",
        ),
        (
            vec!["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
            "--moe-pad-expert-input-to-capacity: synerfuse routes dropless only",
        ),
        (
            vec!["--num-experts", "4", "--moe-z-loss-coeff=-0.001"],
            "--moe-z-loss-coeff",
        ),
        (
            vec!["--moe-z-loss-coeff", "0.001"],
            "--moe-z-loss-coeff: the model has no experts",
        ),
        (
            vec!["--num-experts", "4", "--moe-input-jitter-eps", "0.01"],
            "--moe-input-jitter-eps 0.01: synerfuse adds no noise",
        ),
        (
            vec!["--moe-router-pre-softmax"],
            "--moe-router-pre-softmax: the model has no experts",
        ),
    ] {
        let mut args = common(d, &data, 1);
        args.extend(strings(&flags));
        let out = synerfuse(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} accepted");
        assert!(stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

/// Megatron's pre-softmax routing (top 1 here, where the router then learns from the
/// language model's loss too) trains alike under expert parallelism, and differently
/// from Mixtral's, and resumes only so routed. Checkpoints of models without a Hugging
/// Face form keep their model: `score --load` builds it (every tensor found by name and
/// shape), and `export` refuses it by flag, writing nothing.
#[test]
fn models_without_a_hugging_face_form_train_score_and_refuse_export() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let top_1 = [
        "--num-experts",
        "4",
        "--moe-router-topk",
        "1",
        "--moe-ffn-hidden-size",
        "48",
        "--moe-aux-loss-coeff",
        "0.01",
        "--micro-batch-size",
        "1",
    ];
    let pre = [&top_1[..], &["--moe-router-pre-softmax"]].concat();
    let reference = run(d, &data, "pre", &pre);
    let ep = [
        &pre[..],
        &["--nproc", "2", "--expert-model-parallel-size", "2"],
    ]
    .concat();
    let mut table = EquivalenceTable::default();
    table.check(
        "pre-softmax top 1, EP 2",
        &reference,
        run(d, &data, "pre-ep", &ep),
    );
    table.print();
    let mixtral = run(d, &data, "renormalised", &top_1);
    let moved = max_rel_param_diff(&mixtral.1, &reference.1);
    assert!(
        moved > 1e-4,
        "pre-softmax routing changed too little: {moved}"
    );
    // Its checkpoint resumes as it was trained, and only so (the tensors are the same).
    for (flags, resumes) in [(&pre, true), (&top_1.to_vec(), false)] {
        let mut args = common(d, &data, 8);
        args.extend(strings(flags));
        args.extend(strings(&["--load", d.join("pre").to_str().unwrap()]));
        let out = synerfuse(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), resumes, "{flags:?}: {stderr}");
        let refusal = "its model was trained with --moe-router-pre-softmax; resume with it";
        assert!(resumes || stderr.contains(refusal), "{stderr}");
    }

    run(d, &data, "freq2", &with(&["--micro-batch-size", "3"]));
    let tokens = d.join("tokens.json");
    std::fs::write(&tokens, "[[1, 5, 9, 13, 17], [2, 4, 6]]").unwrap();
    for (name, flag) in [
        ("freq2", "--moe-layer-freq"),
        ("pre", "--moe-router-pre-softmax"),
    ] {
        let save = d.join(name);
        let scored = synerfuse(&strings(&[
            "score",
            "--load",
            save.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
        ]));
        ok(&scored, name);
        let output = d.join(format!("hf-{name}"));
        let export = synerfuse(&strings(&[
            "export",
            "--load",
            save.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ]));
        let stderr = String::from_utf8_lossy(&export.stderr);
        assert!(!export.status.success(), "{name} exported");
        assert!(stderr.contains(flag), "{name}: {stderr}");
        assert!(
            !output.exists(),
            "{name}: a refused export wrote {}",
            output.display()
        );
    }
}

/// Eight experts of width 32 in every layer, the two best per token, the load-balancing
/// loss per sequence (so micro-batches of any size compute it alike) weighted 0.05, the
/// router's z-loss 0.01.
const EIGHT_EXPERTS: [&str; 12] = [
    "--num-experts",
    "8",
    "--moe-ffn-hidden-size",
    "32",
    "--moe-aux-loss-coeff",
    "0.05",
    "--moe-z-loss-coeff",
    "0.01",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-router-topk",
    "2",
];

fn eight<'a>(flags: &[&'a str]) -> Vec<&'a str> {
    EIGHT_EXPERTS
        .iter()
        .copied()
        .chain(flags.iter().copied())
        .collect()
}

/// Expert parallelism trains what one rank trains: replicas hold some experts each and
/// exchange tokens (even parts by flag, [6, 2] by plan with unequal micro-batches,
/// per-stage placements in heterogeneous pipelines, a mesh of EP 2 before one of EP 1
/// (each stage its own groups), tensor and sequence parallelism
/// inside the members, the distributed optimizer, bf16), a checkpoint of EP 2 resumes on
/// one rank, and every step's tokens per expert, load-balancing loss and z-loss are the single rank's.
#[test]
fn expert_parallel_plans_match_a_single_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let reference = run(d, &data, "single", &eight(&["--micro-batch-size", "1"]));
    let reference_records = expert_records_of(&d.join("single.jsonl"));
    let uneven = plan_file(
        d,
        "uneven",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 2\nexperts = [[0, 1, 2, 3, 4, 5]]\n\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 2\nexperts = [[6, 7]]\n",
    );
    // Stage 0 of replica 0 holds experts 0..6, of replica 1 the other two; stage 1 the
    // other way round.
    let pipelines = plan_file(
        d,
        "pipelines",
        "[[replica]]\nlayers = [1, 3]\nmicro_batch_size = 1\nnum_micro_batches = 3\nexperts = [[0, 1, 2, 3, 4, 5], [0, 1]]\n\n\
         [[replica]]\nlayers = [1, 3]\nmicro_batch_size = 1\nnum_micro_batches = 3\nexperts = [[6, 7], [2, 3, 4, 5, 6, 7]]\n",
    );
    // Two groups of EP 2: each expert on two replicas (expert-data-parallel 2).
    let groups = plan_file(
        d,
        "groups",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 1\nexperts = [[0, 1, 2, 3]]\n\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 1\nexperts = [[4, 5, 6, 7]]\n\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 1\nexperts = [[7, 6, 5]]\n\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 1\nexperts = [[4, 3, 2, 1, 0]]\n",
    );
    let ep2 = ["--expert-model-parallel-size", "2"];
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "EP 2 even by flag, mbs 1 x 3",
            eight(&[&ep2[..], &["--nproc", "2", "--micro-batch-size", "1"]].concat()),
        ),
        (
            "EP 2 experts [6, 2] by plan, mbs 2 x 2 and 1 x 2",
            eight(&["--nproc", "2", "--plan", &uneven]),
        ),
        (
            "EP 2 x hetero PP 2 [1,3] x DP 2, placements per stage, buckets of 5000",
            eight(&[
                "--nproc",
                "4",
                "--plan",
                &pipelines,
                "--ddp-bucket-size",
                "5000",
            ]),
        ),
        (
            "meshes of EP 2 then EP 1 (TP 1 CP 1 DP 2 PP 1 each), mbs 1 x 3",
            eight(&[
                "--nproc",
                "4",
                "--enable-hetero",
                "--hetero-process-meshes",
                "1",
                "1",
                "2",
                "2",
                "1",
                "1",
                "1",
                "1",
                "2",
                "1",
                "--hetero-device-types",
                "cpu-a",
                "cpu-b",
                "--micro-batch-size",
                "1",
            ]),
        ),
        (
            "EP 2 x TP 2 + SP, mbs 1 x 3",
            eight(
                &[
                    &ep2[..],
                    &[
                        "--nproc",
                        "4",
                        "--tensor-model-parallel-size",
                        "2",
                        "--sequence-parallel",
                        "--micro-batch-size",
                        "1",
                    ],
                ]
                .concat(),
            ),
        ),
        (
            "2 groups of EP 2 [4,4] and [3,5], DP 4, distributed optimizer",
            eight(&[
                "--nproc",
                "4",
                "--plan",
                &groups,
                "--use-distributed-optimizer",
            ]),
        ),
        (
            "EP 2 distributed optimizer, mbs 1 x 3",
            eight(
                &[
                    &ep2[..],
                    &[
                        "--nproc",
                        "2",
                        "--use-distributed-optimizer",
                        "--micro-batch-size",
                        "1",
                    ],
                ]
                .concat(),
            ),
        ),
    ];
    let mut table = EquivalenceTable::default();
    for (i, (label, flags)) in cases.into_iter().enumerate() {
        let name = format!("ep{i}");
        table.check(label, &reference, run(d, &data, &name, &flags));
        let records = expert_records_of(&d.join(format!("{name}.jsonl")));
        same_expert_records(label, &records, &reference_records);
    }
    let bf16 = run(
        d,
        &data,
        "ep-bf16",
        &eight(
            &[
                &ep2[..],
                &["--nproc", "2", "--micro-batch-size", "1", "--bf16"],
            ]
            .concat(),
        ),
    );
    table.check_bf16("EP 2 bf16 (fp32 masters)", &reference.0, &bf16.0);
    // A checkpoint of EP 2 (each expert saved by its one holder) resumes on one rank.
    let resumed = stop_and_resume(
        d,
        &data,
        "ep-resume",
        &eight(&[&ep2[..], &["--nproc", "2", "--micro-batch-size", "1"]].concat()),
        &eight(&["--micro-batch-size", "1"]),
    );
    // Evaluation exchanges tokens too (the same validation loss as one rank's), and
    // what each rank holds and reduces is said in the log.
    let evaluated = |name: &str, flags: Vec<&str>| {
        let mut args = common(d, &data, 2);
        let split = args.iter().position(|a| a == "100,0,0").unwrap();
        args[split] = "80,20,0".into();
        args.extend(strings(&flags));
        let log = d.join(format!("{name}.jsonl"));
        args.extend(strings(&[
            "--eval-iters",
            "1",
            "--eval-interval",
            "2",
            "--log-json",
        ]));
        args.push(log.display().to_string());
        let out = synerfuse(&args);
        ok(&out, name);
        let validation: Vec<f64> = (json_records(&log).iter())
            .filter(|r| r.get("evaluation").is_some())
            .map(|r| r["lm_loss"].as_f64().expect("lm_loss"))
            .collect();
        (
            validation,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (one, _) = evaluated("eval-single", eight(&["--micro-batch-size", "1"]));
    let (two, stderr) = evaluated(
        "eval-ep2",
        eight(&[&ep2[..], &["--nproc", "2", "--micro-batch-size", "1"]].concat()),
    );
    assert!(
        !one.is_empty() && max_rel_loss_diff(&one, &two) < 1e-5,
        "{one:?} vs {two:?}"
    );
    for said in [
        "expert-parallel group [0, 1]: this rank holds experts [4, 5, 6, 7]",
        "gradient reduction: experts [0, 1, 2, 3] of layers 0..4 over ranks [0]",
    ] {
        assert!(stderr.contains(said), "no {said:?} in\n{stderr}");
    }
    let diff = max_rel_loss_diff(&reference.0[3..], &resumed);
    table.check_bf16(
        "EP 2 saved at 3, resumed on 1 rank (losses)",
        &reference.0[3..],
        &resumed,
    );
    assert!(
        diff < 1e-5,
        "resumed {resumed:?} vs {:?}",
        &reference.0[3..]
    );
    table.print();
}

/// Megatron's experts have biases unless `--disable-bias-linear` (a MoE `run.sh` without
/// it trains): every plan trains what one rank trains with them (data, pipeline, tensor +
/// sequence and expert parallelism, the distributed optimizer), the biases are in the
/// checkpoint and move from their zero start, and an export (a Mixtral's experts have no
/// biases) is refused by that flag, writing nothing.
#[test]
fn expert_biases_train_alike_on_any_plan() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let biased = |name: &str, flags: &[&str]| {
        let mut args = common(d, &data, 6);
        args.retain(|a| a != "--disable-bias-linear");
        args.extend(strings(&eight(flags)));
        run_args(d, name, args)
    };
    let reference = biased("single", &["--micro-batch-size", "1"]);
    let plain = run(d, &data, "plain", &eight(&["--micro-batch-size", "1"]));
    for proj in ["w1", "w2", "w3"] {
        let name = format!("model.layers.2.block_sparse_moe.experts.6.{proj}.bias");
        let bias = reference
            .1
            .get(&name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert!(
            bias.abs().max().double_value(&[]) > 1e-6,
            "{name} did not move"
        );
        assert!(!plain.1.contains_key(&name), "{name} without biases");
    }
    let pipeline = replica_plan(d, "pipeline", &[("[1, 3]", 1, 6)]);
    let uneven = plan_file(
        d,
        "uneven",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 2\nexperts = [[0, 1, 2, 3, 4, 5]]\n\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 2\nexperts = [[6, 7]]\n",
    );
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "biases, one rank, mbs 3 x 2",
            vec!["--micro-batch-size", "3"],
        ),
        (
            "biases, DP 2, mbs 1 x 3",
            vec!["--nproc", "2", "--micro-batch-size", "1"],
        ),
        (
            "biases, PP 2 [1,3], mbs 1 x 6",
            vec!["--nproc", "2", "--plan", &pipeline],
        ),
        (
            "biases, TP 2 + SP, mbs 1 x 6",
            vec![
                "--nproc",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--micro-batch-size",
                "1",
            ],
        ),
        (
            "biases, EP 2 experts [6, 2] by plan, distributed optimizer",
            vec![
                "--nproc",
                "2",
                "--plan",
                &uneven,
                "--use-distributed-optimizer",
            ],
        ),
    ];
    // The attention's key biases are left to their own bound: their gradient nearly
    // cancels (a softmax is blind to what a query adds to every score alike; only the
    // rotary embedding leaves a residue), so their Adam steps follow rounding: one
    // rank's runs of micro-batches of 1 and of 3 differ in them by 2e-5 (every other
    // tensor by under 1e-6).
    let mut reference = reference;
    let reference_keys = key_biases(&mut reference.1);
    let mut table = EquivalenceTable::default();
    for (i, (label, flags)) in cases.into_iter().enumerate() {
        let (losses, mut params) = biased(&format!("bias{i}"), &flags);
        let keys = max_rel_param_diff(&key_biases(&mut params), &reference_keys);
        assert!(keys < 1e-3, "{label}: key biases {keys:e}");
        table.check(
            &format!("{label} (key biases {keys:.1e})"),
            &reference,
            (losses, params),
        );
    }
    table.print();
    let output = d.join("hf-biased");
    let export = synerfuse(&strings(&[
        "export",
        "--load",
        d.join("single").to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]));
    let stderr = String::from_utf8_lossy(&export.stderr);
    assert!(!export.status.success(), "exported: {stderr}");
    assert!(stderr.contains("--disable-bias-linear"), "{stderr}");
    assert!(
        !output.exists(),
        "a refused export wrote {}",
        output.display()
    );
}

/// Takes the attention's key biases out of `params`.
fn key_biases(params: &mut BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    let names: Vec<String> = (params.keys())
        .filter(|n| n.ends_with("self_attn.k_proj.bias"))
        .cloned()
        .collect();
    (names.into_iter())
        .filter_map(|n| params.remove(&n).map(|t| (n, t)))
        .collect()
}

/// `synerfuse plan` searches expert parallelism for a mixture of experts and places the
/// experts by each device's pace and memory on the tokens per expert a run logged
/// (`--expert-load`); the plan it writes trains what one rank trains. A log of another
/// model, or a dense model, is refused by flag.
#[test]
fn planned_expert_placement_trains_like_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let reference = run(d, &data, "single", &eight(&["--micro-batch-size", "1"]));
    let cluster = plan_file(
        d,
        "pair",
        "[[group]]\nkind = \"a100-80g\"\ncount = 1\nnode = \"a\"\n\n\
         [[group]]\nkind = \"a10\"\ncount = 1\nnode = \"a\"\n\n\
         [network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n",
    );
    let log = d.join("single.jsonl").display().to_string();
    let written = d.join("planned.toml").display().to_string();
    let experts = ["--num-experts", "8", "--moe-ffn-hidden-size", "32"];
    let planning = |model: &[&str], load: &str| -> Vec<String> {
        let rest = [
            "--cluster",
            &cluster,
            "--global-batch-size",
            "6",
            "--expert-model-parallel-sizes",
            "2",
            "--expert-load",
            load,
            "--output",
            &written,
        ];
        strings(&[&PLAN_MODEL[..], model, &rest[..]].concat())
    };
    let args = planning(&experts, &log);
    let report = plan_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(report["expert_parallel_size"], 2, "{report}");
    let stages = report["experts_per_stage_and_replica"]
        .as_array()
        .expect("experts per stage");
    for stage in stages {
        let mut held: Vec<u64> = (stage.as_array().unwrap().iter())
            .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()))
            .collect();
        held.sort_unstable();
        assert_eq!(held, (0..8).collect::<Vec<u64>>(), "{report}");
    }
    // The faster device holds more of the experts (the load is near even).
    let text = std::fs::read_to_string(&written).unwrap();
    let held = |kind: &str| {
        let block = (text.split("[[replica]]"))
            .find(|b| b.contains(&format!("kinds = [\"{kind}\"]")))
            .unwrap_or_else(|| panic!("no {kind} replica: {text}"));
        let experts = (block.lines())
            .find_map(|l| l.strip_prefix("experts = "))
            .unwrap_or_else(|| panic!("no experts: {text}"));
        experts.matches(',').count() + 1
    };
    assert!(held("a100-80g") > held("a10"), "{text}");
    // The plan on CPU ranks (its devices are the cluster's GPUs).
    let on_cpu: String = (text.lines())
        .filter(|l| !l.starts_with("devices = "))
        .map(|l| format!("{l}\n"))
        .collect();
    let plan = plan_file(d, "planned-cpu", &on_cpu);
    let mut flags = vec!["--nproc", "2", "--plan", &plan];
    if report["use_distributed_optimizer"] == true {
        flags.push("--use-distributed-optimizer");
    }
    let planned = run(d, &data, "planned", &eight(&flags));
    let mut table = EquivalenceTable::default();
    table.check(
        "planned EP 2, experts by pace and load",
        &reference,
        planned,
    );
    table.print();
    // Refusals name the flag and the reason.
    let refused = |args: Vec<String>, says: &[&str]| {
        let out = synerfuse(&[strings(&["plan"]), args].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        for s in says {
            assert!(stderr.contains(s), "{s}: {stderr}");
        }
    };
    refused(planning(&[], &log), &["--expert-load", "dense"]);
    refused(
        planning(&["--moe-layer-freq", "2"], &log),
        &["--moe-layer-freq: the model has no experts"],
    );
    let four = ["--num-experts", "4", "--moe-ffn-hidden-size", "32"];
    refused(
        planning(&four, &log),
        &["--expert-load", "line ", "another model"],
    );
}

/// `synerfuse plan` gives each stage its own expert-parallel size where that is faster
/// (the case of the planner's unit test: three layers on two A100s dividing their
/// experts, one on two A10s holding every expert), says so, writes it to the plan file,
/// and prints no SynerFuse flags (Megatron's one `--expert-model-parallel-size` cannot
/// say it).
#[test]
fn stages_of_their_own_expert_parallel_sizes_are_planned_and_written() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cluster = plan_file(
        d,
        "mixed",
        "[[group]]\nkind = \"a100-80g\"\ncount = 2\nnode = \"a\"\n\n\
         [[group]]\nkind = \"a10\"\ncount = 2\nnode = \"b\"\n\n\
         [network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n",
    );
    let written = d.join("planned.toml").display().to_string();
    let args = [
        "--num-layers",
        "4",
        "--hidden-size",
        "1024",
        "--num-attention-heads",
        "8",
        "--ffn-hidden-size",
        "2816",
        "--vocab-size",
        "32000",
        "--seq-length",
        "2048",
        "--untie-embeddings-and-output-weights",
        "--num-experts",
        "8",
        "--moe-ffn-hidden-size",
        "16384",
        "--cluster",
        &cluster,
        "--global-batch-size",
        "64",
        "--micro-batch-sizes",
        "1,2",
        "--tensor-model-parallel-sizes",
        "1",
        "--expert-model-parallel-sizes",
        "1,2",
        // As the unit test, the optimizer replicated: sharded, the A10 stage's whole
        // experts would be gathered after every step, exposed, which tips that stage to
        // dividing them too.
        "--use-distributed-optimizer",
        "off",
        "--output",
        &written,
    ];
    let report = plan_json(&args);
    assert_eq!(
        report["expert_parallel_size_per_stage"],
        serde_json::json!([2, 1]),
        "{report}"
    );
    assert!(report["synerfuse_flags"].is_null(), "{report}");
    let plan =
        synerfuse_plan::Plan::from_toml(&std::fs::read_to_string(&written).unwrap(), None).unwrap();
    let groups = plan.expert_groups(8).unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!((groups[0].stage, groups[0].replicas.len()), (0, 2));
    let mut all = strings(&["plan"]);
    all.extend(strings(&args));
    let out = synerfuse(&all);
    ok(&out, "plan");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ep by stage [2, 1]"), "{text}");
    assert!(text.contains("flags: none"), "{text}");
}
