//! Re-planning while training: a rank whose emulated speed drops for good is noticed once,
//! after --replan-window steps, and logged; a shorter slow-down is not. With --replan auto
//! the run switches plans in process, its losses a single rank's; a lost rank restarts
//! the job on the survivors.

mod support;

use support::*;

const WINDOW: &str = "6";

/// Trains 2 emulated data-parallel ranks (speed 0.5 each, 3 micro-batches each per step)
/// with `changes`; the `speed_shift` records of its JSON log and its stderr.
fn shifts(dir: &std::path::Path, name: &str, changes: &[&str]) -> (Vec<serde_json::Value>, String) {
    let data = dataset(dir);
    let log = dir.join(format!("{name}.jsonl"));
    let mut args = common(dir, &data, 26);
    // Steps long enough (~0.1 s at speed 0.5) that the machine's hiccups average out.
    for (flag, value) in [
        ("--hidden-size", "128"),
        ("--ffn-hidden-size", "256"),
        ("--seq-length", "128"),
    ] {
        let at = args.iter().position(|a| a == flag).expect(flag);
        args[at + 1] = value.to_owned();
    }
    args.extend(strings(&[
        "--nproc",
        "2",
        "--micro-batch-size",
        "1",
        "--threads",
        "1",
        "--emulate-device-speed",
        "0.5,0.5",
        "--replan-window",
        WINDOW,
        // A step's time varies by ±10 % here, more when tests run side by side; a fourfold
        // slow-down is far above either.
        "--replan-threshold",
        "0.5",
        "--log-json",
    ]));
    args.push(log.display().to_string());
    for change in changes {
        args.extend(strings(&["--emulate-speed-change", change]));
    }
    let out = synerfuse(&args);
    ok(&out, name);
    let records = json_records(&log);
    assert_eq!(losses(&log).len(), 26, "every iteration logged");
    let shifts = (records.iter())
        .filter_map(|v| v.get("speed_shift").cloned())
        .collect();
    (shifts, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The shifts that say a rank got at least twice slower: (rank, iteration, speed).
fn slowdowns(found: &[serde_json::Value]) -> Vec<(u64, u64, f64)> {
    (found.iter())
        .map(|s| {
            let number = |key: &str| s[key].as_f64().unwrap();
            (
                number("rank") as u64,
                number("iteration") as u64,
                number("relative_speed"),
            )
        })
        .filter(|&(_, _, speed)| speed < 0.5)
        .collect()
}

// Noise on a shared machine can make a rank's pace drift by more than the threshold for a
// window of steps; such reports (either rank, faster or slower by less than 2x) are
// tolerated, the fourfold slow-down must be reported, and the short one must not.
#[test]
fn a_rank_slowing_down_for_good_is_noticed_once_and_a_short_slowdown_is_not() {
    let dir = tempfile::tempdir().unwrap();
    // Iterations 1-6 warm up, 7-12 set the assumed pace; rank 1 four times slower from
    // iteration 16 on is a sustained change after iterations 16 to 21.
    let (found, stderr) = shifts(dir.path(), "slower", &["16:1:0.125"]);
    let slower = slowdowns(&found);
    assert_eq!(slower.len(), 1, "{found:?}\n{stderr}");
    let (rank, iteration, speed) = slower[0];
    // A noisy step just before the change (iteration 15, slower by chance) can complete
    // the window one step early (seen once in CI on a loaded machine).
    assert!(rank == 1 && (20..=21).contains(&iteration), "{found:?}");
    assert!((0.1..0.45).contains(&speed), "about 0.25: {found:?}");
    assert!(
        stderr.contains("from iteration 16 this rank runs at 0.125x"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rank 1: ") && stderr.contains("the speed the plan assumed"),
        "{stderr}"
    );

    // Slower for three iterations (16 to 18), half the window: not reported (five, one
    // short of it, let a single noisy step make it look sustained).
    let (found, stderr) = shifts(dir.path(), "short", &["16:1:0.125", "19:1:0.5"]);
    assert!(slowdowns(&found).is_empty(), "{found:?}\n{stderr}");
}

#[test]
fn a_speed_change_for_a_rank_the_job_lacks_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let mut args = common(dir.path(), &data, 2);
    args.extend(strings(&["--emulate-speed-change", "1:5:0.5"]));
    let out = synerfuse(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--emulate-speed-change 1:5:0.5: the job has ranks 0 to 0"),
        "{stderr}"
    );
    args.extend(strings(&["--emulate-speed-change", "1:0:2"]));
    let out = synerfuse(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("outside (0, 1]"),
        "{stderr}"
    );
}

/// The scenario of re-planning: 4 emulated ranks, `iters` iterations with `extra` (the
/// layout and speeds); its JSON log's records and its stderr.
fn four_ranks(
    dir: &std::path::Path,
    data: &std::path::Path,
    name: &str,
    iters: u64,
    extra: &[&str],
) -> (Vec<serde_json::Value>, String) {
    emulated_ranks(dir, data, (name, "4"), iters, extra)
}

/// [`four_ranks`] on `ranks` ranks.
fn emulated_ranks(
    dir: &std::path::Path,
    data: &std::path::Path,
    (name, ranks): (&str, &str),
    iters: u64,
    extra: &[&str],
) -> (Vec<serde_json::Value>, String) {
    let log = dir.join(format!("{name}.jsonl"));
    let mut args = steady_model(common(dir, data, iters));
    args.extend(strings(&[
        "--nproc",
        ranks,
        "--threads",
        "1",
        "--replan-threshold",
        "0.5",
        "--log-json",
    ]));
    args.push(log.display().to_string());
    args.extend(strings(extra));
    let out = synerfuse(&args);
    ok(&out, name);
    assert_eq!(
        losses(&log).len() as u64,
        iters,
        "{name}: every iteration logged"
    );
    (
        json_records(&log),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `args` with a model whose steps last ~0.25 s at speed 0.25, long enough that the
/// machine's hiccups average out, global batches of 16, and a learning rate under which
/// fp32's reassociation stays small over 60 iterations (at 3e-3 a single rank's losses
/// with micro-batches of 4 and of 1 drift 6e-5 apart by iteration 53; at 3e-4, 1e-7).
fn steady_model(args: Vec<String>) -> Vec<String> {
    with_values(
        args,
        &[
            ("--global-batch-size", "16"),
            ("--lr", "3e-4"),
            ("--min-lr", "1e-5"),
            ("--hidden-size", "128"),
            ("--ffn-hidden-size", "256"),
            ("--seq-length", "64"),
        ],
    )
}

/// `args` with each of `values`' flags given its value instead.
fn with_values(mut args: Vec<String>, values: &[(&str, &str)]) -> Vec<String> {
    for &(flag, value) in values {
        let at = args.iter().position(|a| a == flag).expect(flag);
        args[at + 1] = value.to_owned();
    }
    args
}

/// The records of one kind (`replan`, `replan_outcome`).
fn nested(records: &[serde_json::Value], key: &str) -> Vec<serde_json::Value> {
    records.iter().filter_map(|r| r.get(key).cloned()).collect()
}

/// The re-planning decisions that switched plans.
fn switches(records: &[serde_json::Value]) -> Vec<serde_json::Value> {
    (nested(records, "replan").into_iter())
        .filter(|d| d["switched"].as_bool() == Some(true))
        .collect()
}

/// The median step time of the last `n` iterations, s.
fn last_median_s(records: &[serde_json::Value], n: usize) -> f64 {
    let steps: Vec<f64> = (records.iter())
        .filter_map(|r| r.get("elapsed_ms").and_then(|v| v.as_f64()))
        .collect();
    let mut last = steps[steps.len() - n..].to_vec();
    last.sort_by(f64::total_cmp);
    last[n / 2] / 1e3
}

const SLOWER: [&str; 2] = ["--emulate-speed-change", "20:1:0.0625"];
/// One micro-batch per sample, every rank at speed 0.25: 4 ranks then keep 2 cores half
/// busy, so that a rank's measured pace is its emulated speed and not its share of a
/// saturated machine (at 0.5 each, a CI run measured one of 4 alike ranks 28 % slow
/// after warm-up and switched plans for it).
const SPEEDS: [&str; 4] = [
    "--micro-batch-size",
    "1",
    "--emulate-device-speed",
    "0.25,0.25,0.25,0.25",
];

// Rank 1 drops to a quarter of its speed at iteration 20 of 60. With --replan auto the
// run switches once (after the window of 10 slow steps) to a plan that gives rank 1
// fewer samples; its losses are a single rank's; its last 20 steps are as fast as a
// fresh run of the plan it switched to, at the new speeds from the start. With
// --replan off it stays slow, and says a switch would have paid.
#[test]
fn a_rank_slowing_for_good_makes_the_run_switch_once_without_changing_a_loss() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let auto = [&SPEEDS[..], &SLOWER[..], &["--replan", "auto"]].concat();
    let (records, stderr) = four_ranks(dir.path(), &data, "auto", 60, &auto);
    let decisions = nested(&records, "replan");
    let switched: Vec<_> = (decisions.iter())
        .filter(|d| d["switched"].as_bool() == Some(true))
        .collect();
    assert_eq!(switched.len(), 1, "{decisions:?}\n{stderr}");
    let decision = switched[0];
    assert!(decision["gain_s"].as_f64() > decision["switch_cost_s"].as_f64());
    assert!(stderr.contains("switching now"), "{stderr}");
    let outcomes = nested(&records, "replan_outcome");
    assert_eq!(
        outcomes.len(),
        1,
        "the gain after the switch measured: {records:?}"
    );

    // Continuity: the losses of one rank training the same global batches.
    let reference = single_rank_losses(dir.path(), &data, 60);
    same_losses(&losses(&dir.path().join("auto.jsonl")), &reference);

    // A fresh run of the plan switched to, at the new speeds from its first step.
    let plan = dir.path().join("replanned.json");
    std::fs::write(&plan, decision["proposed_plan"].to_string()).unwrap();
    let fresh_args = [
        "--plan",
        plan.to_str().unwrap(),
        "--emulate-device-speed",
        "0.25,0.0625,0.25,0.25",
    ];
    let (fresh, _) = four_ranks(dir.path(), &data, "fresh", 30, &fresh_args);
    // The 10 % target is `cargo xtask bench replan`'s (performance targets are not timed
    // tests): here a one-sided bound with room for a loaded 2-core machine (medians 9–11 %
    // apart in three of six runs on 2026-11-25) that a switch which did not take effect (the
    // old plan is ~2.7x slower at the new speeds) still fails.
    let (after, fresh) = (last_median_s(&records, 20), last_median_s(&fresh, 20));
    assert!(
        after <= 1.5 * fresh,
        "last 20 steps: {after:.4} s after the switch, {fresh:.4} s fresh"
    );

    // Without switching, every step from the slow-down's on is slow: 40 iterations show
    // the decision (after the window, at iteration 30) and 20 slow steps to time.
    let off = [&SPEEDS[..], &SLOWER[..], &["--replan", "off"]].concat();
    let (records, stderr) = four_ranks(dir.path(), &data, "off", 40, &off);
    let decisions = nested(&records, "replan");
    assert!(
        decisions
            .iter()
            .all(|d| d["switched"].as_bool() == Some(false))
            && !decisions.is_empty(),
        "{decisions:?}"
    );
    assert!(stderr.contains("a switch would have paid"), "{stderr}");
    let slow = last_median_s(&records, 20);
    assert!(
        slow > 1.5 * after,
        "--replan off: {slow:.4} s per step against {after:.4} s"
    );
}

// A plan wrong from the start is judged once, on the paces after warm-up: rank 1 slow
// from the first step (an even plan on unequal devices), or rank 2 slowing 4x at
// iteration 12, inside the window whose paces the watch first assumes. Either run
// switches once, after iteration 20, for the warm-up's paces, and not again.
#[test]
fn a_plan_wrong_from_the_start_is_switched_once_after_warm_up() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let from_the_start = [
        "--micro-batch-size",
        "1",
        "--emulate-device-speed",
        "0.25,0.0625,0.25,0.25",
        "--replan",
        "auto",
    ];
    let inside_the_window = [
        &SPEEDS[..],
        &["--emulate-speed-change", "12:2:0.0625", "--replan", "auto"],
    ]
    .concat();
    let reference = single_rank_losses(dir.path(), &data, 40);
    for (name, args) in [
        ("from-the-start", &from_the_start[..]),
        ("inside-the-window", &inside_the_window[..]),
    ] {
        let (records, stderr) = four_ranks(dir.path(), &data, name, 40, args);
        let switched = switches(&records);
        assert_eq!(switched.len(), 1, "{name}: {stderr}");
        assert_eq!(switched[0]["cause"], "warm_up", "{name}: {}", switched[0]);
        assert_eq!(switched[0]["iteration"], 20, "{name}: {}", switched[0]);
        assert!(
            stderr.contains("(the ranks' paces measured after warm-up)"),
            "{name}: {stderr}"
        );
        // The replica holding the slow rank takes less than an even share.
        let slow = if name == "from-the-start" { 1 } else { 2 };
        let plan: synerfuse_plan::Plan =
            serde_json::from_value(switched[0]["proposed_plan"].clone()).unwrap();
        let (replica, _) = plan.position(slow).unwrap();
        let share = plan.replicas()[replica].batch.samples() * plan.replicas().len();
        assert!(share < plan.global_batch_size(), "{name}: {}", switched[0]);
        same_losses(
            &losses(&dir.path().join(format!("{name}.jsonl"))),
            &reference,
        );
    }
}

// A warm-up that misleads: of two ranks, rank 1 slows 4x at iteration 12, inside the
// window whose paces the watch first assumes, and is back at full speed from iteration 21.
// The warm-up's decision (after iteration 20) moves work off rank 1; the paces measured
// after that switch (one step that allocates, then a window) show rank 1 well again, and
// the run switches back to the even plan it left. The losses stay a single rank's.
#[test]
fn a_switch_made_on_a_misleading_warm_up_is_switched_back() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let misled = [
        "--micro-batch-size",
        "1",
        "--emulate-device-speed",
        "0.5,0.5",
        "--emulate-speed-change",
        "12:1:0.125",
        "--emulate-speed-change",
        "21:1:0.5",
        "--replan",
        "auto",
    ];
    let (records, stderr) = emulated_ranks(dir.path(), &data, ("misled", "2"), 50, &misled);
    let switched = switches(&records);
    assert_eq!(switched.len(), 2, "{stderr}");
    assert_eq!(switched[0]["cause"], "warm_up", "{}", switched[0]);
    assert_eq!(switched[1]["cause"], "after_switch", "{}", switched[1]);
    // One step, then a window of 10 after the switch; one more window if the paces
    // scattered wider than the gain.
    let at = switched[1]["iteration"].as_u64().unwrap();
    assert!(at == 31 || at == 41, "{}", switched[1]);
    let shares = |decision: &serde_json::Value| {
        let plan: synerfuse_plan::Plan =
            serde_json::from_value(decision["proposed_plan"].clone()).unwrap();
        (0..2)
            .map(|rank| {
                let (replica, _) = plan.position(rank).unwrap();
                plan.replicas()[replica].batch.samples()
            })
            .collect::<Vec<_>>()
    };
    assert!(shares(&switched[0])[1] < 8, "{}", switched[0]);
    assert_eq!(shares(&switched[1]), [8, 8], "{}", switched[1]);
    assert!(
        stderr.contains("(the steps measured since the last switch)"),
        "{stderr}"
    );
    let reference = single_rank_losses(dir.path(), &data, 50);
    same_losses(&losses(&dir.path().join("misled.jsonl")), &reference);
}

// Three slow steps are shorter than the window: no change is sustained, nothing is
// re-planned.
#[test]
fn a_short_slowdown_does_not_make_the_run_switch() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let short = [
        &SPEEDS[..],
        &["--emulate-speed-change", "20:1:0.0625"],
        &["--emulate-speed-change", "23:1:0.25"],
        &["--replan", "auto"],
    ]
    .concat();
    let (records, stderr) = four_ranks(dir.path(), &data, "short", 40, &short);
    assert!(
        stderr.contains("from iteration 20 this rank runs at 0.06"),
        "the slow-down happened: {stderr}"
    );
    let switched = (nested(&records, "replan").iter())
        .filter(|d| d["switched"].as_bool() == Some(true))
        .count();
    assert_eq!(switched, 0, "{stderr}");
}

// Rank 2 of 4 dies in the middle of iteration 21 (after the checkpoint of iteration 20):
// the survivors end, the lowest leaving which rank was lost and a plan for the three
// of them under --save; the --nproc job starts again on them from iteration 20 and
// finishes, with the losses of an uninterrupted run.
#[test]
fn a_lost_rank_restarts_the_job_on_the_survivors_from_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let save = dir.path().join("ckpt");
    let log = dir.path().join("lost.jsonl");
    let mut args = steady_model(common(dir.path(), &data, 30));
    args.extend(strings(&[
        "--nproc",
        "4",
        "--micro-batch-size",
        "1",
        "--threads",
        "1",
        "--save-interval",
        "5",
        "--save",
        save.to_str().unwrap(),
        "--log-json",
        log.to_str().unwrap(),
    ]));
    let out = synerfuse_with_env(&args, &[("SYNERFUSE_FAULT_INJECT", "exit:2:21")]);
    ok(&out, "a job that lost a rank");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 2 lost (its process is gone)")
            && stderr.contains("exiting with code 75"),
        "{stderr}"
    );
    assert!(
        stderr.contains("restarting on the 3 survivors from the checkpoint of iteration 20"),
        "{stderr}"
    );
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(save.join("lost-ranks.json")).unwrap())
            .unwrap();
    assert_eq!(record["lost"], serde_json::json!([2]), "{record}");
    assert_eq!(
        record["survivors"],
        serde_json::json!([0, 1, 3]),
        "{record}"
    );
    let plan = std::fs::read_to_string(save.join("survivors-plan.toml")).unwrap();
    assert_eq!(plan.matches("[[replica]]").count(), 3, "{plan}");

    // Each iteration logged once (the 21st of the first launch died with rank 2), with
    // the losses of one rank training the same global batches.
    let iterations: Vec<u64> = (json_records(&log).iter())
        .filter(|r| r.get("elapsed_ms").is_some())
        .map(|r| r["iteration"].as_u64().unwrap())
        .collect();
    assert_eq!(iterations, (1..=30).collect::<Vec<_>>());
    same_losses(&losses(&log), &single_rank_losses(dir.path(), &data, 30));
}

/// 24 iterations of the scenario on `layout` under `--replan auto`, rank 1 four times
/// slower from iteration 10 (a window of 4): its switches of plans, checked to be the one
/// for the slowdown (or the warm-up) and, after it, only switches that looked at the one
/// before (`after_switch`), one per window and step at most.
fn switched_after_a_slowdown(
    dir: &std::path::Path,
    data: &std::path::Path,
    name: &str,
    layout: &[&str],
) -> Vec<serde_json::Value> {
    let slowdown = [
        "--emulate-speed-change",
        "10:1:0.0625",
        "--replan-window",
        "4",
        "--replan",
        "auto",
    ];
    // A plan file gives the micro-batches itself.
    let speeds = match layout.contains(&"--plan") {
        true => &SPEEDS[2..],
        false => &SPEEDS[..],
    };
    let args = [speeds, layout, &slowdown[..]].concat();
    let (records, stderr) = four_ranks(dir, data, name, 24, &args);
    let switched = switches(&records);
    assert!((1..=4).contains(&switched.len()), "{name}: {stderr}");
    for later in &switched[1..] {
        assert_eq!(later["cause"], "after_switch", "{name}: {stderr}");
    }
    switched
}

/// The losses of one rank training the scenario's global batches for `iters` iterations.
fn single_rank_losses(dir: &std::path::Path, data: &std::path::Path, iters: u64) -> Vec<f64> {
    let log = dir.join("single.jsonl");
    let mut single = steady_model(common(dir, data, iters));
    single.extend(strings(&["--micro-batch-size", "4", "--log-json"]));
    single.push(log.display().to_string());
    ok(&synerfuse(&single), "single rank");
    losses(&log)
}

/// Equal within 1e-5 relative, iteration by iteration, and as many.
fn same_losses(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "iterations");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "iteration {}: {a} vs {b}",
            i + 1
        );
    }
}

// A switch out of a pipeline (pp 2 x dp 2, the tied embedding's copy on each replica's
// last stage) under the distributed optimizer: the state moves by name out of shards and
// stages, and the losses stay a single rank's.
#[test]
fn a_switch_out_of_a_pipeline_under_the_distributed_optimizer_keeps_the_losses() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let layout = [
        "--pipeline-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    let switched = switched_after_a_slowdown(dir.path(), &data, "pipeline", &layout);
    let layers = &switched[0]["proposed_layers"];
    assert_ne!(
        layers,
        &serde_json::json!([[2, 2], [2, 2]]),
        "a new plan: {layers}"
    );
    let reference = single_rank_losses(dir.path(), &data, 24);
    same_losses(&losses(&dir.path().join("pipeline.jsonl")), &reference);
}

// A switch out of context parallelism (CP 2 x DP 2, each member training half of every
// sequence) under the distributed optimizer, sharded over both members of both replicas:
// the state moves by name, and the losses stay a single rank's.
#[test]
fn a_switch_out_of_context_parallelism_keeps_the_losses() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let layout = [
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    let switched = switched_after_a_slowdown(dir.path(), &data, "context", &layout);
    let plan: synerfuse_plan::Plan =
        serde_json::from_value(switched[0]["proposed_plan"].clone()).unwrap();
    assert!(!plan.has_context_parallelism(), "{}", switched[0]);
    let reference = single_rank_losses(dir.path(), &data, 24);
    same_losses(&losses(&dir.path().join("context.jsonl")), &reference);
}

// A switch out of expert parallelism (EP 2 x DP 4: each replica half the experts) under
// the distributed optimizer: its slow member alone looks slow, the experts move by global
// name to the plan the re-planner chose, and the losses stay a single rank's.
#[test]
fn a_switch_out_of_expert_parallelism_keeps_the_losses() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let experts = [
        "--num-experts",
        "4",
        "--moe-ffn-hidden-size",
        "128",
        "--moe-aux-loss-coeff",
        "0.01",
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
    ];
    let layout = [
        &experts[..],
        &[
            "--expert-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
        ],
    ]
    .concat();
    let switched = switched_after_a_slowdown(dir.path(), &data, "experts", &layout);
    // A member's pace leaves out its waits at the all-to-alls: rank 0 is not slowed by
    // its group's slow member (it would be ~4x slower if it were).
    let paces: Vec<f64> = serde_json::from_value(switched[0]["paces_s"].clone()).unwrap();
    assert!(paces[0] < 0.5 * paces[1], "paces {paces:?}");
    let log = dir.path().join("single.jsonl");
    let mut single = steady_model(common(dir.path(), &data, 24));
    single.extend(strings(&experts));
    single.extend(strings(&["--micro-batch-size", "4", "--log-json"]));
    single.push(log.display().to_string());
    ok(&synerfuse(&single), "single rank");
    same_losses(&losses(&dir.path().join("experts.jsonl")), &losses(&log));
}

// A switch out of a plan whose stages divide the experts differently (a pipeline of two
// stages on two replicas: the first stage's experts halved over the pair, the second's
// held whole by each): the re-planner prices it stage by stage (within half of its
// measured step; 0.40 s against 0.51 s when written), switches once (at the warm-up
// verdict, to EP 2 x DP 4 without the pipeline's bubble), and the losses stay a single
// rank's.
#[test]
fn a_switch_out_of_stages_of_different_expert_parallel_sizes_keeps_the_losses() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let experts = ["--num-experts", "4", "--moe-ffn-hidden-size", "128"];
    let replica = |first: &str| {
        format!(
            "[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 8\n\
             experts = [{first}, [0, 1, 2, 3]]\n\n"
        )
    };
    let plan = plan_file(
        dir.path(),
        "mixed",
        &(replica("[0, 1]") + &replica("[2, 3]")),
    );
    let layout = [&experts[..], &["--plan", &plan]].concat();
    let switched = switched_after_a_slowdown(dir.path(), &data, "mixed", &layout);
    let (measured, predicted) = (
        switched[0]["measured_step_s"].as_f64().unwrap(),
        switched[0]["current_step_s"].as_f64().unwrap(),
    );
    assert!(
        (0.5..1.5).contains(&(predicted / measured)),
        "{}",
        switched[0]
    );
    let log = dir.path().join("single.jsonl");
    let mut single = steady_model(common(dir.path(), &data, 24));
    single.extend(strings(&experts));
    single.extend(strings(&["--micro-batch-size", "2", "--log-json"]));
    single.push(log.display().to_string());
    ok(&synerfuse(&single), "single rank");
    same_losses(&losses(&dir.path().join("mixed.jsonl")), &losses(&log));
}

// A switch into expert parallelism where memory binds: two ranks of 120 MB each run a
// pipeline of two stages (a mixture of 8 experts whose state, ~130 MB, fits no rank
// whole; one query group, so no tensor parallelism). The re-planner's other plan
// divides the experts, half per rank, and runs without the pipeline's bubble: after warm-up the run switches into it, its experts
// moving by global name, and its losses stay a single rank's.
#[test]
fn a_switch_into_expert_parallelism_where_memory_binds_keeps_the_losses() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let experts = [
        "--num-experts",
        "8",
        "--moe-ffn-hidden-size",
        "512",
        "--moe-router-topk",
        "2",
    ];
    let plan = plan_file(
        dir.path(),
        "pipeline",
        "[[replica]]\nlayers = [2, 2]\nmicro_batch_size = 1\nnum_micro_batches = 2\nmemory_gb = [0.12, 0.12]\n",
    );
    let iters = 40;
    let log = dir.path().join("into.jsonl");
    let mut args = small_batches(steady_model(common(dir.path(), &data, iters)));
    args.extend(strings(&experts));
    args.extend(strings(&[
        "--nproc",
        "2",
        "--threads",
        "1",
        "--plan",
        &plan,
        "--emulate-device-speed",
        "0.25,0.25",
        "--replan-threshold",
        "0.5",
        "--replan-window",
        "4",
        "--replan",
        "auto",
        "--log-json",
    ]));
    args.push(log.display().to_string());
    let out = synerfuse(&args);
    ok(&out, "into");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let records = json_records(&log);
    let switched = switches(&records);
    assert_eq!(switched.len(), 1, "{stderr}");
    let plan: synerfuse_plan::Plan =
        serde_json::from_value(switched[0]["proposed_plan"].clone()).unwrap();
    let groups = plan.expert_groups(8).unwrap();
    assert!(!groups.is_empty(), "{}", switched[0]);

    let single_log = dir.path().join("single.jsonl");
    let mut single = small_batches(steady_model(common(dir.path(), &data, iters)));
    single.extend(strings(&experts));
    single.extend(strings(&["--micro-batch-size", "2", "--log-json"]));
    single.push(single_log.display().to_string());
    ok(&synerfuse(&single), "single rank");
    same_losses(&losses(&log), &losses(&single_log));
}

/// `args` with global batches of 2 (a pipeline of two stages then idles a third of its
/// step) and one query group (no tensor parallelism).
fn small_batches(args: Vec<String>) -> Vec<String> {
    with_values(
        args,
        &[("--global-batch-size", "2"), ("--num-query-groups", "1")],
    )
}
