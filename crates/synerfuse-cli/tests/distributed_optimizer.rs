//! `--use-distributed-optimizer`: each gradient reduction's holders keep their shard of
//! the AdamW state (sized by their memory), and the parameters equal a single rank's.

mod support;

use support::*;

/// Each rank's (total optimizer state bytes, bytes of its distributed-optimizer shards)
/// from the `optimizer state:` log lines.
fn state_bytes(stderr: &str, ranks: usize) -> Vec<(u64, u64)> {
    (0..ranks)
        .map(|r| {
            let line = stderr
                .lines()
                .find(|l| l.contains(&format!("r={r}}}")) && l.contains("optimizer state: "))
                .unwrap_or_else(|| panic!("no optimizer state line of rank {r} in\n{stderr}"));
            let number = |after: &str| -> Option<u64> {
                let rest = &line[line.find(after)? + after.len()..];
                rest.split(' ').next()?.parse().ok()
            };
            (
                number("optimizer state: ").unwrap(),
                number("bytes (").unwrap_or(0),
            )
        })
        .collect()
}

#[test]
fn sharded_optimizer_state_gives_a_single_ranks_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let reference = run(d, &data, "single", &["--micro-batch-size", "1"]);
    // Replica 0 on one 80 GB device, replica 1's two stages on 16 and 24 GB devices: the
    // embedding and layer 0 are sharded 80 : 16, the rest 80 : 24, the tied embedding
    // 80 : 16 : 24.
    let memory = plan_file(
        d,
        "memory",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 2\nmemory_gb = [80]\n\n\
         [[replica]]\nlayers = [1, 3]\nmicro_batch_size = 1\nnum_micro_batches = 2\nmemory_gb = [16, 24]\n",
    );
    let zero = "--use-distributed-optimizer";
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "grid PP 2 x DP 2, mbs 1 x 3",
            vec![
                "--nproc",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
                zero,
            ],
        ),
        (
            "hetero DP 2, mbs [2,1] x counts [2,2], buckets of 5000, overlapped gather",
            vec![
                "--nproc",
                "2",
                "--ddp-bucket-size",
                "5000",
                "--overlap-param-gather",
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
                zero,
            ],
        ),
        (
            "TP 2 x DP 2, mbs 1 x 3",
            vec![
                "--nproc",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
                zero,
            ],
        ),
        (
            "per-replica plan, memory 80 | 16 + 24 GB, buckets of 5000, overlapped gather",
            vec![
                "--nproc",
                "3",
                "--plan",
                &memory,
                zero,
                "--ddp-bucket-size",
                "5000",
                "--overlap-param-gather",
            ],
        ),
    ];
    let mut table = String::from(EQUIVALENCE_TABLE);
    for (i, (label, flags)) in cases.iter().enumerate() {
        let got = run(d, &data, &format!("zero{i}"), flags);
        equivalence_row(&mut table, label, &got, &reference);
    }
    println!("{table}");

    // Each rank holds its share of the state: the shards of the memory plan add up to 12
    // bytes (fp32 master and two moments) per parameter, split by memory.
    let mut args = common(d, &data, 2);
    args.extend(strings(&["--nproc", "3", "--plan", &memory, zero]));
    let out = synerfuse(&args);
    ok(&out, "memory plan");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let bytes = state_bytes(&stderr, 3);
    let parameters: i64 = reference.1.values().map(|t| t.numel() as i64).sum();
    let shards: u64 = bytes.iter().map(|b| b.1).sum();
    println!("optimizer state per rank (total, shards): {bytes:?}; {parameters} parameters");
    assert_eq!(shards, 12 * parameters as u64);
    assert!(
        bytes.iter().all(|b| b.0 == b.1),
        "every reduction has two holders: {bytes:?}"
    );
    assert!(
        bytes[0].1 > bytes[2].1 && bytes[2].1 > bytes[1].1,
        "{bytes:?}"
    );
    // Without it, every rank holds the whole state of its stage.
    let mut args = common(d, &data, 2);
    args.extend(strings(&["--nproc", "3", "--plan", &memory]));
    let out = synerfuse(&args);
    ok(&out, "memory plan, replicated optimizer");
    let whole = state_bytes(&String::from_utf8_lossy(&out.stderr), 3);
    assert_eq!(whole[0], (8 * parameters as u64, 0));
}

/// A run with the distributed optimizer stopped at iteration 3 resumes without it on
/// one rank, and a one-rank run resumes with it on another plan, each with the
/// uninterrupted run's losses: the shards are saved whole by global name.
#[test]
fn distributed_optimizer_checkpoints_resume_under_any_plan() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let (full, _) = run(d, &data, "full", &["--micro-batch-size", "1"]);
    let memory = plan_file(
        d,
        "memory",
        "[[replica]]\nlayers = [4]\nmicro_batch_size = 2\nnum_micro_batches = 2\nmemory_gb = [80]\n\n\
         [[replica]]\nlayers = [1, 3]\nmicro_batch_size = 1\nnum_micro_batches = 2\nmemory_gb = [16, 24]\n",
    );
    let zero = [
        "--nproc",
        "3",
        "--plan",
        memory.as_str(),
        "--use-distributed-optimizer",
        // The gathers in flight end before the checkpoint is written.
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "5000",
    ];
    let single = ["--micro-batch-size", "1"];
    for (name, first, then) in [
        ("sharded-then-single", &zero[..], &single[..]),
        ("single-then-sharded", &single[..], &zero[..]),
    ] {
        let resumed = stop_and_resume(d, &data, name, first, then);
        let diff = max_rel_loss_diff(&full[3..], &resumed);
        println!("{name}: resumed losses within {diff:.2e}");
        assert!(diff < 1e-5, "{name}: {resumed:?} vs {:?}", &full[3..]);
    }
}

/// Each rank's measured state (parameters, gradients, fp32 main gradients, optimizer
/// state) is what the planner's memory model predicts for its stage, within 10 %, in
/// fp32 and bf16; the activation high-water mark is reported once measured.
#[test]
fn measured_state_bytes_match_the_planner_memory_model() {
    use synerfuse_plan::ModelShape;
    use synerfuse_planner::cost::STATE_BYTES_PER_PARAM;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    for (name, extra) in [("fp32", vec![]), ("bf16", vec!["--bf16"])] {
        let mut flags = vec![
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
        ];
        flags.extend(extra);
        let (_, params) = run(d, &data, name, &flags);
        let embedding = &params["model.embed_tokens.weight"];
        let shape = ModelShape {
            num_layers: 4,
            hidden_size: 32,
            num_heads: 4,
            num_kv_heads: 2,
            ffn_hidden_size: 64,
            vocab_size: embedding.size()[0] as usize,
            seq_length: 32,
            tied: true,
            experts: None,
        };
        let records = json_records(&d.join(format!("{name}.jsonl")));
        let step = records.iter().rev().find(|r| r.get("ranks").is_some());
        let ranks = step.unwrap()["ranks"].as_array().unwrap().clone();
        for (rank, (layers, first, last)) in
            [(1, true, false), (3, false, true)].into_iter().enumerate()
        {
            let predicted = shape.stage_params(layers, first, last) * STATE_BYTES_PER_PARAM;
            let measured = ranks[rank]["state_bytes"].as_f64().unwrap();
            let activations = ranks[rank]["activation_peak_bytes"].as_u64();
            println!(
                "{name} rank {rank}: state {measured} B measured, {predicted} B predicted; activations {activations:?} B"
            );
            assert!(
                (measured / predicted - 1.0).abs() < 0.10,
                "{name} rank {rank}"
            );
            assert!(activations.is_some_and(|a| a > 0), "{name} rank {rank}");
        }
    }
}
