//! Context parallelism in `synerfuse train`: the equivalence table's context-parallel rows
//! (even and uneven shares, with tensor and sequence parallelism, inside heterogeneous
//! pipelines and data parallelism), resuming a context-parallel checkpoint on one rank,
//! and the flags it refuses.

mod support;
use support::*;

/// Each row trains what one rank trains (losses at every step and final parameters,
/// < 1e-5), against the single-rank run of the same model (GQA with 2 query groups,
/// tied embeddings unless a row unties them; sequence length 32).
#[test]
fn context_parallel_plans_match_a_single_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let untie = "--untie-embeddings-and-output-weights";
    // Document masks: each token attends within its document, positions restart at
    // each document, the end-of-document token's loss is masked.
    let documents = [
        "--reset-attention-mask",
        "--reset-position-ids",
        "--eod-mask-loss",
    ];
    let references = [
        (
            "tied",
            run(d, &data, "single", &["--micro-batch-size", "1"]),
        ),
        (
            "untied",
            run(
                d,
                &data,
                "single-untied",
                &[untie, "--micro-batch-size", "1"],
            ),
        ),
        (
            "documents",
            run(
                d,
                &data,
                "single-documents",
                &[&documents[..], &["--micro-batch-size", "1"]].concat(),
            ),
        ),
    ];
    // The masks change what is trained (1.2e-4 here, twelve times the rows' tolerance),
    // or the rows below could not fail.
    let diff = max_rel_loss_diff(&references[0].1 .0, &references[2].1 .0);
    assert!(diff > 5e-5, "document masks changed too little: {diff}");
    let shares = plan_file(
        d,
        "shares",
        "[[replica]]\nlayers = [4]\ncp = [2]\ncp_shares = [[3, 1]]\nmicro_batch_size = 2\nnum_micro_batches = 3\n",
    );
    // Replica 0: layers [3, 1] on CP 2 [3, 1] (two pipelines of members), 1 x 4;
    // replica 1: the whole model on one rank, 2 x 1.
    let hetero = plan_file(
        d,
        "hetero",
        "[[replica]]\nlayers = [3, 1]\ncp = [2, 2]\ncp_shares = [[3, 1], [3, 1]]\nmicro_batch_size = 1\nnum_micro_batches = 4\n\n\
         [[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 1\n",
    );
    let recompute = plan_file(
        d,
        "recompute",
        "[[replica]]\nlayers = [1, 3]\ncp = [2, 2]\nrecompute = [true, false]\nmicro_batch_size = 3\nnum_micro_batches = 2\n",
    );
    // Stage 0 on CP 2 in shares [3, 1], stage 1 on TP 2 without CP: activations and
    // gradients cross gathered whole.
    let per_stage = plan_file(
        d,
        "per-stage",
        "[[replica]]\nlayers = [2, 2]\ntp = [1, 2]\ncp = [2, 1]\ncp_shares = [[3, 1], [1]]\nmicro_batch_size = 2\nnum_micro_batches = 3\n",
    );
    // Interleaved: every chunk boundary crosses between CP 1 and CP 2, the last stage's
    // first chunk back to stage 0's second too.
    let interleaved = plan_file(
        d,
        "interleaved",
        "[[replica]]\nlayers = [[1, 1], [1, 1]]\ncp = [1, 2]\nmicro_batch_size = 1\nnum_micro_batches = 6\n",
    );
    let with_documents = |flags: &[&'static str]| [flags, &documents[..]].concat();
    let cp2_tp2_sp = [
        "--nproc",
        "4",
        "--context-parallel-size",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--micro-batch-size",
        "2",
    ];
    let cases: Vec<(&str, &str, Vec<&str>)> = vec![
        (
            "CP 2 even, mbs 1 x 6",
            "tied",
            vec![
                "--nproc",
                "2",
                "--context-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
            ],
        ),
        (
            "CP 2 shares [3,1] by plan, mbs 2 x 3",
            "tied",
            vec!["--nproc", "2", "--plan", &shares],
        ),
        ("CP 2 x TP 2 + SP, mbs 2 x 3", "tied", cp2_tp2_sp.to_vec()),
        (
            "CP 2 [3,1] in PP [3,1] (1 x 4) + a single-rank replica (2 x 1), buckets of 5000",
            "tied",
            vec![
                "--nproc",
                "5",
                "--plan",
                &hetero,
                "--ddp-bucket-size",
                "5000",
            ],
        ),
        (
            "CP 2 x PP 2 x DP 2 by flags, untied, distributed optimizer",
            "untied",
            vec![
                "--nproc",
                "8",
                "--context-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
                "--use-distributed-optimizer",
                untie,
            ],
        ),
        (
            "CP 2 x PP 2 by meshes (TP 1 CP 2 on both), layers [1,3], mbs 2 x 3",
            "tied",
            vec![
                "--nproc",
                "4",
                "--enable-hetero",
                "--hetero-process-meshes",
                "1",
                "2",
                "1",
                "1",
                "1",
                "1",
                "2",
                "1",
                "1",
                "1",
                "--hetero-device-types",
                "cpu-a",
                "cpu-b",
                "--hetero-pipeline-layer-split",
                "1",
                "3",
                "--micro-batch-size",
                "2",
            ],
        ),
        (
            "per-stage CP [2,1] by meshes (TP 1 CP 2, then TP 1 CP 1), layers [1,3], untied",
            "untied",
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
                "cpu-a",
                "cpu-b",
                "--hetero-pipeline-layer-split",
                "1",
                "3",
                "--micro-batch-size",
                "1",
                untie,
            ],
        ),
        (
            "per-stage CP [2,1] shares [[3,1],[1]] x TP [1,2] + SP by plan, mbs 2 x 3",
            "tied",
            vec!["--nproc", "4", "--plan", &per_stage, "--sequence-parallel"],
        ),
        (
            "per-stage CP [1,2], interleaved (2 chunks of 1 layer per stage), mbs 1 x 6",
            "tied",
            vec!["--nproc", "3", "--plan", &interleaved],
        ),
        (
            "CP 2 x PP 2, stage 0 recomputes, mbs 3 x 2",
            "tied",
            vec!["--nproc", "4", "--plan", &recompute],
        ),
        (
            "CP 2 shares [3,1] by plan, mbs 2 x 3, document masks",
            "documents",
            [
                &["--nproc", "2", "--plan", shares.as_str()][..],
                &documents[..],
            ]
            .concat(),
        ),
        (
            "CP 2 x TP 2 + SP, mbs 2 x 3, document masks",
            "documents",
            with_documents(&cp2_tp2_sp),
        ),
    ];
    let mut table = EquivalenceTable::default();
    for (i, (label, reference, flags)) in cases.iter().enumerate() {
        let reference = &references.iter().find(|r| r.0 == *reference).unwrap().1;
        table.check(
            label,
            reference,
            run(d, &data, &format!("cp-case{i}"), flags),
        );
    }
    // bf16 compute with fp32 master weights: close, not equal.
    let bf16 = [
        "--nproc",
        "2",
        "--context-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
        "--bf16",
    ];
    let (losses, _) = run(d, &data, "cp-bf16", &bf16);
    table.check_bf16("bf16, CP 2 (fp32 masters)", &references[0].1 .0, &losses);
    table.print();
}

/// A CP 2 run stopped at iteration 3 resumes on one rank with the uninterrupted run's
/// losses (parameters are saved by global name); a sequence that does not split is
/// refused by name.
#[test]
fn context_parallel_checkpoints_resume_on_one_rank_and_bad_flags_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let (full, _) = run(d, &data, "full", &["--micro-batch-size", "1"]);
    let cp2 = [
        "--nproc",
        "2",
        "--context-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
    ];
    let single = ["--micro-batch-size", "1"];
    let resumed = stop_and_resume(d, &data, "cp2-then-one", &cp2, &single);
    let diff = max_rel_loss_diff(&full[3..], &resumed);
    assert!(diff < 1e-5, "{resumed:?} vs {:?}", &full[3..]);
    let refused = |extra: &[&str], expected: &[&str]| {
        let mut args = common(d, &data, 2);
        args.extend(strings(extra));
        let out = synerfuse(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} ran");
        assert!(
            expected.iter().all(|e| stderr.contains(e)) && !stderr.contains("panicked"),
            "{extra:?}: {stderr}"
        );
    };
    // 32 tokens do not cut into 2 x 3 chunks.
    refused(
        &[
            "--nproc",
            "3",
            "--context-parallel-size",
            "3",
            "--micro-batch-size",
            "1",
        ],
        &[
            "--seq-length / --context-parallel-size",
            "sequence length 32",
            "size 3",
        ],
    );
}
