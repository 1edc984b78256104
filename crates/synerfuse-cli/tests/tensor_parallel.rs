//! Tensor parallelism in `synerfuse train`: the equivalence table's tensor-parallel rows
//! (even and uneven shares, per-stage sizes, with pipelines and hetero data parallelism)
//! and resuming a tensor-parallel checkpoint on one rank.

mod support;
use std::path::{Path, PathBuf};
use support::*;

/// A `[[replica]]` plan file `name.toml` in `dir` with the given text; returns its path.
/// Each row trains what one rank trains (losses at every step and final parameters,
/// < 1e-5), against the single-rank run of the same model.
#[test]
fn tensor_parallel_plans_match_a_single_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let untie = "--untie-embeddings-and-output-weights";
    // Single-rank references: the tiny model (GQA, 2 query groups, tied), untied, and
    // with a key/value head per query head (so shares [3, 1] can split 4 groups 3 : 1).
    let mha = |extra: &[&str]| {
        let mut args = common(d, &data, 6);
        let gqa = args
            .iter()
            .position(|a| a == "--group-query-attention")
            .unwrap();
        args.drain(gqa..gqa + 3); // --group-query-attention --num-query-groups 2
        args.extend(strings(extra));
        args
    };
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
            "mha",
            run_args(d, "single-mha", mha(&["--micro-batch-size", "1"])),
        ),
    ];
    let per_stage = plan_file(
        d,
        "per-stage",
        "[[replica]]\nlayers = [1, 3]\ntp = [2, 1]\nmicro_batch_size = 2\nnum_micro_batches = 3\n",
    );
    let widening = plan_file(
        d,
        "widening",
        "[[replica]]\nlayers = [1, 3]\ntp = [1, 2]\nmicro_batch_size = 3\nnum_micro_batches = 2\n",
    );
    // Replica 0 holds the first layers on TP 2, replica 1 on one rank: their gradients,
    // and the tied embedding's, are summed as whole tensors.
    let mixed = plan_file(
        d,
        "mixed",
        "[[replica]]\nlayers = [4]\ntp = [2]\nmicro_batch_size = 2\nnum_micro_batches = 2\n\n\
         [[replica]]\nlayers = [2, 2]\ntp = [1, 2]\nmicro_batch_size = 1\nnum_micro_batches = 2\n",
    );
    let shares = plan_file(
        d,
        "shares",
        "[[replica]]\nlayers = [4]\ntp = [2]\ntp_shares = [[3, 1]]\nmicro_batch_size = 1\nnum_micro_batches = 6\n",
    );
    let per_replica = plan_file(
        d,
        "per-replica",
        "[[replica]]\nlayers = [4]\ntp = [2]\nmicro_batch_size = 2\nnum_micro_batches = 1\n\n\
         [[replica]]\nlayers = [1, 3]\ntp = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 4\n",
    );
    let recompute = plan_file(
        d,
        "recompute",
        "[[replica]]\nlayers = [1, 3]\ntp = [2, 1]\nrecompute = [true, false]\nmicro_batch_size = 2\nnum_micro_batches = 3\n",
    );
    // Ragged micro-batches: replica 0 takes 3 samples as 2 + 1 on TP [2,1], replica 1
    // takes 3 as 1 + 2 on TP 2 with a short first micro-batch.
    let ragged = plan_file(
        d,
        "ragged",
        "[[replica]]\nlayers = [1, 3]\ntp = [2, 1]\nmicro_batch_size = 2\nsamples = 3\n\n\
         [[replica]]\nlayers = [4]\ntp = [2]\nmicro_batch_sizes = [1, 2]\n",
    );
    let cases: Vec<(&str, &str, Vec<&str>)> = vec![
        (
            "TP 2, mbs 1 x 6",
            "tied",
            vec![
                "--nproc",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
            ],
        ),
        (
            "TP 2 + sequence parallelism, mbs 2 x 3",
            "tied",
            vec![
                "--nproc",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--micro-batch-size",
                "2",
            ],
        ),
        (
            "TP 2 x PP 2 [1,3] x DP 2, mbs [2,1] counts [2,2]",
            "tied",
            vec![
                "--nproc",
                "8",
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--hetero-pipeline-stages",
                "2",
                "1",
                "3",
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
            "TP 2 + SP x PP 2 interleaved (2 chunks of 1 layer), mbs 1 x 6",
            "tied",
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
            "per-stage TP [2,1] + SP x DP 2 by --hetero-process-meshes, layers [1,3], untied",
            "untied",
            vec![
                "--nproc",
                "6",
                "--sequence-parallel",
                "--enable-hetero",
                "--hetero-process-meshes",
                "2",
                "1",
                "1",
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
                "--hetero-pipeline-layer-split",
                "1",
                "3",
                "--pipeline-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
                untie,
            ],
        ),
        (
            "TP 2 + SP x PP 2, layers [3,1], mbs 3 x 2, recompute",
            "tied",
            vec![
                "--nproc",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
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
            "per-stage TP [2,1] by plan, layers [1,3], untied",
            "untied",
            vec!["--nproc", "3", "--plan", &per_stage, untie],
        ),
        (
            "per-stage TP [1,2] + SP by plan (rows cut for each receiver), tied across splits",
            "tied",
            vec!["--nproc", "3", "--plan", &widening, "--sequence-parallel"],
        ),
        (
            "per-replica plan: [4] on TP 2 (2 x 1) + [1,3] on TP [2,2] (1 x 4), buckets of 5000",
            "tied",
            vec!["--nproc", "6", "--plan", &per_replica, "--ddp-bucket-size", "5000"],
        ),
        (
            "replicas split alike and differently: [4] on TP 2 (2 x 2) + [2,2] on TP [1,2] (1 x 2)",
            "tied",
            vec!["--nproc", "5", "--plan", &mixed],
        ),
        (
            "recomputation per stage by plan: stage 0 (TP 2) recomputes, stage 1 does not",
            "tied",
            vec!["--nproc", "3", "--plan", &recompute],
        ),
        (
            "ragged micro-batches + SP: [1,3] on TP [2,1] (2 + 1) + [4] on TP 2 (1 + 2), buckets of 5000",
            "tied",
            vec![
                "--nproc",
                "5",
                "--plan",
                &ragged,
                "--sequence-parallel",
                "--ddp-bucket-size",
                "5000",
            ],
        ),
    ];
    let mut table = EquivalenceTable::default();
    for (i, (label, reference, flags)) in cases.iter().enumerate() {
        let reference = &references.iter().find(|r| r.0 == *reference).unwrap().1;
        table.check(
            label,
            reference,
            run(d, &data, &format!("tp-case{i}"), flags),
        );
    }
    // Uneven shares: heads, FFN columns and vocabulary rows split 3 : 1.
    table.check(
        "TP 2 shares [3,1] (query groups, FFN, vocabulary 3 : 1), MHA",
        &references[2].1,
        run_args(d, "tp-shares", mha(&["--nproc", "2", "--plan", &shares])),
    );
    // bf16 compute with fp32 master weights: close, not equal.
    let (losses, _) = run(
        d,
        &data,
        "tp-bf16",
        &[
            "--nproc",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--micro-batch-size",
            "1",
            "--bf16",
        ],
    );
    table.check_bf16("bf16, TP 2 (fp32 masters)", &references[0].1 .0, &losses);
    table.print();
}

/// Issue 38's layout scaled down: `synerfuse plan` on six emulated CPU ranks of two
/// speeds in three nodes writes a pipeline per kind, each stage a tensor-parallel pair
/// within its node (the fast pair holds the model as one stage, the slow pairs only in
/// two), the batch split by pace; `synerfuse train --plan` runs it, equal to one rank.
#[test]
fn planned_per_kind_pipelines_with_tp_2_match_a_single_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let mut cluster = String::from(
        "[[group]]\nkind = \"cpu\"\ncount = 2\nnode = \"fast\"\ntflops_bf16 = 0.05\nmemory_gb = 0.0021\n",
    );
    for node in ["slow-0", "slow-1"] {
        cluster.push_str(&format!(
            "[[group]]\nkind = \"cpu\"\ncount = 2\nnode = \"{node}\"\ntflops_bf16 = 0.05\nmemory_gb = 0.0012\nspeed = 0.5\n"
        ));
    }
    cluster.push_str("[network]\nintra_node_gbs = 5\ninter_node_gbs = 5\n");
    let (j, plan) = plan_on(d, &cluster, &[]);
    assert_eq!(j["written_plan"]["kind"], "per_replica_pipelines", "{j}");
    let pools = j["per_replica_pipelines"]["pools"].as_array().unwrap();
    let shapes: Vec<(u64, u64)> = (pools.iter())
        .map(|p| {
            let n = |key: &str| p[key].as_u64().unwrap();
            (n("tensor_parallel_size"), n("pipeline_parallel_size"))
        })
        .collect();
    assert_eq!(shapes, [(2, 1), (2, 2)], "{j}");
    // The written plan is never slower than the expert's layout, priced alike.
    let expert = &j["expert_layout"];
    assert!(
        j["written_plan"]["predicted_step_time_s"].as_f64().unwrap()
            <= expert["predicted_step_time_s"].as_f64().unwrap(),
        "{j}"
    );
    let (losses, params) = trains_like_one_rank(d, &data, (&j, &plan), 6);
    println!("per-kind pipelines, TP 2: losses {losses:.2e}, parameters {params:.2e}");
}

/// `synerfuse plan --json` for the model on `cluster` (written under `d`), global batch 6,
/// neither recomputation nor the distributed optimizer, with `extra` flags: its report
/// and the plan file it wrote.
fn plan_on(d: &Path, cluster: &str, extra: &[&str]) -> (serde_json::Value, PathBuf) {
    let cluster_path = d.join("cluster.toml");
    std::fs::write(&cluster_path, cluster).unwrap();
    let plan = d.join("plan.toml");
    let mut args = vec![
        "--cluster",
        cluster_path.to_str().unwrap(),
        "--global-batch-size",
        "6",
        "--recompute-activations",
        "off",
        "--use-distributed-optimizer",
        "off",
        "--output",
        plan.to_str().unwrap(),
    ];
    args.extend(extra);
    args.extend(PLAN_MODEL);
    (plan_json(&args), plan)
}

/// Trains the written `plan` on `nproc` ranks with the report's `train_flags` and one
/// rank alike; asserts they agree, and returns the largest loss and parameter gaps.
fn trains_like_one_rank(
    d: &Path,
    data: &Path,
    (j, plan): (&serde_json::Value, &Path),
    nproc: usize,
) -> (f64, f64) {
    let flags = j["written_plan"]["train_flags"].as_array().unwrap();
    let (ref_losses, ref_params) = run(d, data, "single", &["--micro-batch-size", "1"]);
    let nproc = nproc.to_string();
    let mut extra = vec!["--nproc", &nproc, "--plan", plan.to_str().unwrap()];
    extra.extend(flags.iter().map(|f| f.as_str().unwrap()));
    let (losses, params) = run(d, data, "planned", &extra);
    let loss_diff = max_rel_loss_diff(&ref_losses, &losses);
    let param_diff = max_param_diff(&ref_params, &params);
    assert!(
        loss_diff < 1e-5 && param_diff < 1e-5,
        "losses {losses:?} vs {ref_losses:?}, parameters {param_diff:e}"
    );
    (loss_diff, param_diff)
}

/// A tensor-parallel run stopped at iteration 3 resumes on one rank, and a one-rank run
/// resumes on uneven tensor-parallel shares, with the uninterrupted run's losses: shards
/// are saved whole by global name.
#[test]
fn tensor_parallel_checkpoints_resume_under_another_split() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let (full, _) = run(d, &data, "full", &["--micro-batch-size", "1"]);
    let shares = plan_file(
        d,
        "shares",
        "[[replica]]\nlayers = [4]\ntp = [2]\ntp_shares = [[2, 1]]\nmicro_batch_size = 1\nnum_micro_batches = 6\n",
    );
    let tp2 = [
        "--nproc",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
    ];
    let single = ["--micro-batch-size", "1"];
    let shares_flags = ["--nproc", "2", "--plan", shares.as_str()];
    for (name, first, then) in [
        ("TP 2 then one rank", &tp2[..], &single[..]),
        (
            "one rank then TP 2 shares [2,1]",
            &single[..],
            &shares_flags[..],
        ),
    ] {
        let resumed = stop_and_resume(d, &data, &name.replace(' ', "-"), first, then);
        let diff = max_rel_loss_diff(&full[3..], &resumed);
        assert!(diff < 1e-5, "{name}: {resumed:?} vs {:?}", &full[3..]);
    }
    // A checkpoint of another model (a wider FFN) is refused by name on TP shards, not
    // cut into slices that happen to fit.
    let mut args = common(d, &data, 6);
    let ffn = args.iter().position(|a| a == "--ffn-hidden-size").unwrap();
    args[ffn + 1] = "48".into();
    args.extend(strings(&tp2));
    args.extend([
        "--load".into(),
        d.join("TP-2-then-one-rank").display().to_string(),
    ]);
    let out = synerfuse(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("has shape")
            && stderr.contains("the model expects")
            && !stderr.contains("panicked"),
        "{stderr}"
    );
}

/// `examples/run.sh` itself (SynerFuse's flags: TP 2 x PP 2 with stages of 2 and 6
/// layers, DP 2, sequence parallelism, bf16, untied embeddings) trains a scaled-down
/// model on 8 CPU ranks: only sizes, paths and the device come from the environment.
#[test]
fn the_ported_run_sh_trains_scaled_down() {
    let dir = tempfile::tempdir().unwrap();
    let d = |p: &str| dir.path().join(p).display().to_string();
    let tokenizer = root()
        .join("crates/synerfuse-data/tests/fixtures/tokenizers/sentencepiece/llama-bpe.model");
    let corpus = root().join("crates/synerfuse-data/tests/fixtures/megatron/corpus.jsonl");
    let out = synerfuse(&strings(&[
        "preprocess",
        "--input",
        corpus.to_str().unwrap(),
        "--output-prefix",
        &d("shk"),
        "--tokenizer-type",
        "Llama2Tokenizer",
        "--tokenizer-model",
        tokenizer.to_str().unwrap(),
        "--append-eod",
        "--workers",
        "1",
    ]));
    ok(&out, "preprocess");
    let env = [
        ("SYNERFUSE", BIN.to_owned()),
        ("DEVICE", "cpu".into()),
        ("HIDDEN_SIZE", "32".into()),
        ("FFN_HIDDEN_SIZE", "64".into()),
        ("NUM_HEADS", "4".into()),
        ("SEQ_LENGTH", "32".into()),
        ("GBS", "16".into()),
        ("TRAIN_STEPS", "3".into()),
        ("DISTRIBUTED_TIMEOUT_MINUTES", WATCHDOG_MINUTES.into()),
        ("TOKENIZER_PATH", tokenizer.display().to_string()),
        ("DATA_PATH", d("shk_text_document")),
        ("CHECKPOINT_PATH", d("ckpt")),
        ("TENSORBOARD_LOGS_PATH", d("tb")),
        // Eight ranks on this machine's cores, over shared memory.
        ("OMPI_MCA_rmaps_base_oversubscribe", "1".into()),
        ("OMPI_MCA_hwloc_base_binding_policy", "none".into()),
        ("OMPI_MCA_btl", "self,vader".into()),
        ("OMPI_MCA_btl_vader_single_copy_mechanism", "none".into()),
        ("OMPI_ALLOW_RUN_AS_ROOT", "1".into()),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1".into()),
        ("OMP_NUM_THREADS", "1".into()),
    ];
    let script = root().join("examples/run.sh");
    let out = run_command_with_limit(
        std::process::Command::new("bash")
            .arg(&script)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str()))),
    );
    ok(&out, "examples/run.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("--tensor-model-parallel-size 2"),
        "{stdout}"
    );
    assert!(
        stdout.contains("iteration        3/       3 | consumed samples:           48 |"),
        "{stdout}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("sequence parallel"), "{stderr}");
    assert!(dir.path().join("ckpt/latest").exists());
}

/// A grid of tensor-parallel pairs from the grid search: `synerfuse plan` on four
/// emulated CPU ranks in two nodes, asked for TP 2, writes the grid (Megatron's flags,
/// `--tensor-model-parallel-size 2`) with each pair inside a node; `synerfuse train
/// --plan` runs it, equal to one rank.
#[test]
fn a_planned_tensor_parallel_grid_matches_a_single_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let mut cluster = String::new();
    for node in ["a", "b"] {
        cluster.push_str(&format!(
            "[[group]]\nkind = \"cpu\"\ncount = 2\nnode = \"{node}\"\ntflops_bf16 = 0.05\nmemory_gb = 0.0021\n"
        ));
    }
    cluster.push_str("[network]\nintra_node_gbs = 5\ninter_node_gbs = 1\n");
    let (j, plan) = plan_on(d, &cluster, &["--tensor-model-parallel-sizes", "2"]);
    assert_eq!(j["written_plan"]["kind"], "grid", "{j}");
    assert_eq!(j["tensor_parallel_size"], 2, "{j}");
    let flags = j["synerfuse_flags"].as_str().unwrap();
    assert!(flags.contains("--tensor-model-parallel-size 2"), "{flags}");
    let written = std::fs::read_to_string(&plan).unwrap();
    assert!(written.contains("tp = [2"), "{written}");
    let (losses, params) = trains_like_one_rank(d, &data, (&j, &plan), 4);
    println!("planned grid, TP 2: losses {losses:.2e}, parameters {params:.2e}");
}
