//! Sharded checkpoints: every rank writes its own pieces, loads read only the ranges
//! they keep under any plan, saving adds one write buffer to a rank's memory, and
//! `--async-save` writes in the background while training goes on.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::*;
use synerfuse_train::checkpoint::{self, Checkpoint, Manifest};

const BIN: &str = env!("CARGO_BIN_EXE_synerfuse");

/// A copy of the newest checkpoint of `save` in the format of earlier versions (format
/// 1: whole tensors in one `model-` and one `optimizer-` file), as `target/latest`.
fn as_format_1(save: &Path, target: &Path) {
    let checkpoint = Checkpoint::open_latest(save).unwrap().unwrap();
    let dir = target.join(checkpoint::iteration_dir(checkpoint.state.iteration));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut model, mut optimizer) = (Vec::new(), Vec::new());
    for name in checkpoint.manifest().tensors.keys() {
        let t = checkpoint.tensor(name).unwrap();
        match name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq") {
            true => optimizer.push((name.clone(), t)),
            false => model.push((name.clone(), t)),
        }
    }
    let files = [
        ("model-00001-of-00001.safetensors", model),
        ("optimizer-00001-of-00001.safetensors", optimizer),
    ];
    for (file, tensors) in &files {
        synerfuse_model::hf::write_safetensors(&dir.join(file), tensors).unwrap();
    }
    std::fs::copy(checkpoint.dir.join("state.json"), dir.join("state.json")).unwrap();
    let mut manifest = Manifest {
        format: 1,
        files: BTreeMap::new(),
        tensors: BTreeMap::new(),
    };
    for file in [
        "model-00001-of-00001.safetensors",
        "optimizer-00001-of-00001.safetensors",
        "state.json",
    ] {
        let entry = checkpoint::sha256_file(&dir.join(file)).unwrap();
        manifest.files.insert(file.into(), entry);
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string(&manifest).unwrap(),
    )
    .unwrap();
    std::fs::write(
        target.join("latest"),
        format!("{}\n", checkpoint.state.iteration),
    )
    .unwrap();
}

/// Stopped at iteration 3 under one plan and resumed under another, the losses of
/// iterations 4..6 are the uninterrupted run's; each rank wrote only its own pieces;
/// a checkpoint of format 1 still loads.
#[test]
fn sharded_checkpoints_resume_exactly_under_other_plans() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let (full, _) = run(d, &data, "full", &["--micro-batch-size", "1"]);
    let zero = "--use-distributed-optimizer";
    let tp2_dp2 = [
        "--nproc",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
        zero,
    ];
    let dp3 = ["--nproc", "3", "--micro-batch-size", "1", zero];
    let pp2 = [
        "--nproc",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
    ];
    let pp3 = [
        "--nproc",
        "3",
        "--pipeline-model-parallel-size",
        "3",
        "--hetero-pipeline-stages",
        "3",
        "2",
        "1",
        "1",
        "--micro-batch-size",
        "1",
    ];
    let asymmetric = replica_plan(d, "asymmetric", &[("[4]", 2, 1), ("[3, 1]", 1, 4)]);
    let replicas = ["--nproc", "3", "--plan", &asymmetric, zero];
    for (name, first, then) in [
        (
            "TP 2 x DP 2 distributed optimizer, then DP 3",
            &tp2_dp2[..],
            &dp3[..],
        ),
        ("PP 2, then PP 3", &pp2[..], &pp3[..]),
        (
            "per-replica pipelines, then TP 2 x DP 2",
            &replicas[..],
            &tp2_dp2[..],
        ),
    ] {
        let resumed = stop_and_resume(d, &data, &name.replace([' ', ','], "-"), first, then);
        let diff = max_rel_loss_diff(&full[3..], &resumed);
        println!("{name}: resumed losses within {diff:.2e}");
        assert!(diff < 1e-6, "{name}: {resumed:?} vs {:?}", &full[3..]);
    }
    // bf16 with the distributed optimizer: fp32 masters saved and restored, the bf16
    // parameters taken from them, so a resume under the same plan continues exactly.
    let bf16 = ["--nproc", "2", "--micro-batch-size", "1", "--bf16", zero];
    let (bf16_full, _) = run(d, &data, "bf16-full", &bf16);
    let resumed = stop_and_resume(d, &data, "bf16-stopped", &bf16, &bf16);
    let diff = max_rel_loss_diff(&bf16_full[3..], &resumed);
    println!("bf16, DP 2 distributed optimizer, same plan: resumed losses within {diff:.2e}");
    assert!(diff < 1e-6, "bf16: {resumed:?} vs {:?}", &bf16_full[3..]);
    // Under TP 2 x DP 2 with the distributed optimizer every rank wrote its own files,
    // and a sharded matrix is covered by pieces of several ranks: TP slices cut into
    // distributed-optimizer ranges.
    let save = d.join("TP-2-x-DP-2-distributed-optimizer--then-DP-3");
    let checkpoint = Checkpoint::open_latest(&save).unwrap().unwrap();
    let manifest = checkpoint.manifest();
    for rank in 0..4 {
        let file = format!("optimizer-rank{rank:05}.safetensors");
        assert!(
            manifest.files.contains_key(&file),
            "{file}: {:?}",
            manifest.files.keys()
        );
    }
    let embedding = &manifest.tensors["model.embed_tokens.weight.exp_avg"];
    let ranks: std::collections::BTreeSet<usize> =
        embedding.pieces.iter().map(|p| p.rank).collect();
    assert_eq!(ranks.len(), 4, "{embedding:?}");
    let (slices, ranges) = (embedding.pieces.iter()).fold((0, 0), |(s, r), p| {
        let slice = p.region.slice.clone().expect("a TP slice");
        let whole = (slice.end - slice.start) * 32;
        (s + 1, r + usize::from(p.region.len() < whole))
    });
    assert!(slices == 4 && ranges == 4, "{embedding:?}");
    checkpoint.verify_all().unwrap();
    // `checkpoint inspect` lists the tensors with the ranks that wrote them.
    let out = synerfuse(&strings(&[
        "checkpoint",
        "inspect",
        save.to_str().unwrap(),
        "--json",
    ]));
    ok(&out, "inspect");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tensors = report["tensors"].as_array().unwrap();
    let listed = (tensors.iter()).find(|t| t["name"] == "model.embed_tokens.weight.exp_avg");
    assert_eq!(
        listed.unwrap()["ranks"],
        serde_json::json!([0, 1, 2, 3]),
        "{report}"
    );
    assert!(report["files"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["verified"] == true));
    // An export streams the tensors from the ranks' pieces: the parameters saved.
    let hf = d.join("exported");
    ok(
        &synerfuse(&strings(&[
            "export",
            "--load",
            save.to_str().unwrap(),
            "--output",
            hf.to_str().unwrap(),
        ])),
        "export",
    );
    let exported: BTreeMap<String, synerfuse_model::tch::Tensor> =
        synerfuse_model::hf::read_safetensors(&hf.join("model.safetensors"), |_| true)
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(max_param_diff(&exported, &parameters(&save)), 0.0);
    // The same state in format 1 resumes alike on one rank.
    let old = d.join("format-1");
    as_format_1(&save, &old);
    let log = d.join("format-1.jsonl");
    let mut args = common(d, &data, 6);
    args.extend(strings(&["--micro-batch-size", "1", "--log-json"]));
    args.push(log.display().to_string());
    args.extend(["--load".into(), old.display().to_string()]);
    ok(&synerfuse(&args), "resumed from format 1");
    let diff = max_rel_loss_diff(&full[3..], &losses(&log));
    assert!(diff < 1e-6, "format 1: {diff:e}");
    // A missing piece file: the resume names it.
    let missing = checkpoint.dir.join("model-rank00003.safetensors");
    let kept = std::fs::read(&missing).unwrap();
    std::fs::remove_file(&missing).unwrap();
    let mut args = common(d, &data, 6);
    args.extend(strings(&tp2_dp2));
    args.extend(["--load".into(), save.display().to_string()]);
    let out = synerfuse(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("model-rank00003.safetensors"),
        "{stderr}"
    );
    std::fs::write(&missing, kept).unwrap();
    // A corrupt piece file: inspect names it and fails.
    let file = checkpoint.dir.join("optimizer-rank00002.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x10;
    std::fs::write(&file, bytes).unwrap();
    let out = synerfuse(&strings(&["checkpoint", "inspect", save.to_str().unwrap()]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("optimizer-rank00002.safetensors")
            && stderr.contains("corrupt"),
        "{stderr}"
    );
    // A checkpoint that lacks a parameter is refused by export before it writes, by name.
    let path = checkpoint.dir.join("manifest.json");
    let mut manifest: Manifest =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    manifest.tensors.remove("model.norm.weight");
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let partial = d.join("partial-export");
    let out = synerfuse(&strings(&[
        "export",
        "--load",
        save.to_str().unwrap(),
        "--output",
        partial.to_str().unwrap(),
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("model.norm.weight") && !partial.exists(),
        "{stderr}"
    );
}

/// Each rank's numbers after `marker` on its log lines (in order), by rank.
fn numbers_after(stderr: &str, ranks: usize, marker: &str) -> Vec<Vec<u64>> {
    (0..ranks)
        .map(|r| {
            (stderr.lines())
                .filter(|l| l.contains(&format!("r={r}}}")) && l.contains(marker))
                .map(|l| {
                    let tail = l.split(marker).nth(1).unwrap();
                    tail.split_whitespace().next().unwrap().parse().unwrap()
                })
                .collect()
        })
        .collect()
}

/// On 4 ranks with the distributed optimizer, saving raises a rank's resident memory
/// at most one write buffer (plus allocator slack) above what it was when the save
/// began, read from `/proc/self/status`: nothing is gathered whole (which would add the
/// whole model's state, here about 110 MB, twice over). The whole runs' peaks, with
/// and without saving, are printed beside (they differ by more from run to run).
#[test]
fn saving_adds_at_most_one_write_buffer_to_peak_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let mut base = common(d, &data, 2);
    for (flag, value) in [
        ("--num-layers", "8"),
        ("--hidden-size", "256"),
        ("--ffn-hidden-size", "1024"),
        ("--global-batch-size", "4"),
        ("--seq-length", "16"),
    ] {
        let at = base.iter().position(|a| a == flag).unwrap();
        base[at + 1] = value.into();
    }
    base.extend(strings(&[
        "--nproc",
        "4",
        "--micro-batch-size",
        "1",
        "--use-distributed-optimizer",
    ]));
    let mut saving = base.clone();
    saving.extend(strings(&["--save-interval", "1", "--save"]));
    saving.push(d.join("saved").display().to_string());
    let without = synerfuse(&base);
    ok(&without, "without a save");
    let log = |name: &str| d.join(format!("{name}.jsonl")).display().to_string();
    let with = synerfuse(&[&saving[..], &["--log-json".into(), log("sync")]].concat());
    ok(&with, "saving every iteration");
    // The same saves in the background, for the record: how long training stops.
    let mut in_background = base.clone();
    in_background.extend(strings(&["--save-interval", "1", "--async-save", "--save"]));
    in_background.extend([
        d.join("async").display().to_string(),
        "--log-json".into(),
        log("async"),
    ]);
    ok(&synerfuse(&in_background), "saving in the background");
    for mode in ["sync", "async"] {
        for save in save_records(Path::new(&log(mode))) {
            println!(
                "{mode} save of iteration {}: training stopped {:.1} ms (and waited {:.1} ms later), complete after {:.1} ms",
                save["iteration"], save["blocked_ms"].as_f64().unwrap(), save["waited_ms"].as_f64().unwrap(), save["write_ms"].as_f64().unwrap()
            );
        }
    }
    let (without, with) = (
        String::from_utf8_lossy(&without.stderr),
        String::from_utf8_lossy(&with.stderr),
    );
    let peak = "peak resident memory ";
    println!(
        "peak resident memory by rank: without a save {:?} B, saving {:?} B",
        numbers_after(&without, 4, peak),
        numbers_after(&with, 4, peak)
    );
    let at_start = numbers_after(&with, 4, "checkpoint save: resident ");
    let during = numbers_after(&with, 4, "B at its start, peak ");
    let buffer = 4 * checkpoint::shard::WRITE_CHUNK_ELEMENTS as u64;
    let margin = 8 << 20;
    for rank in 0..4 {
        assert_eq!(at_start[rank].len(), 2, "two saves on rank {rank}:\n{with}");
        for (start, peak) in at_start[rank].iter().zip(&during[rank]) {
            println!(
                "rank {rank}: save from {start} B, peak {peak} B (+{} B)",
                peak - start
            );
            assert!(
                *peak <= start + buffer + margin,
                "rank {rank}: saving peaked {} B above its start",
                peak - start
            );
        }
    }
    Checkpoint::open_latest(&d.join("saved"))
        .unwrap()
        .unwrap()
        .verify_all()
        .unwrap();
}

/// The `save` records of a JSON log.
fn save_records(log: &Path) -> Vec<serde_json::Value> {
    (json_records(log).into_iter())
        .filter_map(|r| r.get("save").cloned())
        .collect()
}

/// With `--async-save` the steps after a save run while it is written (slowed down
/// here by the test hook), the checkpoint is complete and verified at the end, and
/// the losses are the synchronous run's; a SIGTERM during a background write leaves
/// that checkpoint and the stop's complete.
#[test]
fn async_saves_overlap_training_and_a_stop_signal_waits_for_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let delay = [("SYNERFUSE_TEST_SAVE_DELAY_MS", "1500")];
    let mut blocked = Vec::new();
    let mut all_losses = Vec::new();
    for mode in ["sync", "async"] {
        let log = d.join(format!("{mode}.jsonl"));
        let save = d.join(mode);
        let mut args = common(d, &data, 6);
        args.extend(strings(&[
            "--nproc",
            "2",
            "--micro-batch-size",
            "1",
            "--save-interval",
            "3",
        ]));
        args.extend([
            "--save".into(),
            save.display().to_string(),
            "--log-json".into(),
            log.display().to_string(),
        ]);
        if mode == "async" {
            args.push("--async-save".into());
        }
        ok(&synerfuse_with_env(&args, &delay), mode);
        let saves = save_records(&log);
        assert_eq!(saves.len(), 2, "{saves:?}");
        let first = &saves[0];
        let blocked_ms = first["blocked_ms"].as_f64().unwrap();
        let waited_ms = first["waited_ms"].as_f64().unwrap();
        let during: Vec<u64> = (first["steps_during_write"].as_array().unwrap().iter())
            .map(|i| i.as_u64().unwrap())
            .collect();
        println!("{mode}: save of iteration 3 blocked training {blocked_ms:.0} ms (and {waited_ms:.0} ms at the next save), written in {:.0} ms, steps during the write {during:?}", first["write_ms"].as_f64().unwrap());
        match mode {
            "async" => assert!(during.first() == Some(&4) && blocked_ms < 750.0, "{first}"),
            _ => assert!(during.is_empty() && blocked_ms >= 1500.0, "{first}"),
        }
        let checkpoint = Checkpoint::open_latest(&save).unwrap().unwrap();
        assert_eq!(checkpoint.state.iteration, 6);
        checkpoint.verify_all().unwrap();
        Checkpoint::open(&save.join("iter_0000003"))
            .unwrap()
            .verify_all()
            .unwrap();
        blocked.push(blocked_ms);
        all_losses.push(losses(&log));
    }
    assert_eq!(all_losses[0], all_losses[1]);
    // SIGTERM while the save of iteration 2 is written in the background.
    let save = d.join("stopped");
    let log = d.join("stopped.jsonl");
    let mut args = common(d, &data, 100_000);
    args.extend(strings(&[
        "--micro-batch-size",
        "1",
        "--save-interval",
        "2",
        "--async-save",
    ]));
    args.extend([
        "--save".into(),
        save.display().to_string(),
        "--log-json".into(),
        log.display().to_string(),
    ]);
    let mut child = Command::new(BIN)
        .args(with_watchdog(&args))
        .env("SYNERFUSE_TEST_SAVE_DELAY_MS", "3000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let lines = std::fs::read_to_string(&log).map_or(0, |t| {
            t.lines().filter(|l| l.contains("elapsed_ms")).count()
        });
        if lines >= 3 || child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !save.join("iter_0000002").exists(),
        "the write of iteration 2 is still in flight"
    );
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    ok(&out, "SIGTERM during a background save");
    Checkpoint::open(&save.join("iter_0000002"))
        .unwrap()
        .verify_all()
        .unwrap();
    let latest = Checkpoint::open_latest(&save).unwrap().unwrap();
    latest.verify_all().unwrap();
    assert_eq!(latest.state.iteration, losses(&log).len() as u64);
    assert!(std::fs::read_dir(&save).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .ends_with(".tmp")));
}
