//! Islands: a plan whose ranks sit on several (emulated) hosts reduces each gradient
//! hierarchically (inside each host, across the hosts piece by piece, inside again), and
//! trains what one rank trains.

mod support;

use support::*;

/// Trains `flags` as `name` and returns what [`run`] does, with the ranks' log.
fn run_logged(
    dir: &std::path::Path,
    data: &std::path::Path,
    name: &str,
    flags: &[&str],
) -> (Outcome, String) {
    let log = dir.join(format!("{name}.jsonl"));
    let save = dir.join(name);
    let mut args = common(dir, data, 6);
    args.extend(strings(flags));
    args.extend(strings(&[
        "--log-json",
        &log.display().to_string(),
        "--save",
        &save.display().to_string(),
    ]));
    let out = synerfuse(&args);
    ok(&out, name);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    ((losses(&log), parameters(&save)), stderr)
}

#[test]
fn hierarchical_reductions_give_a_single_ranks_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let reference = run(d, &data, "single", &["--micro-batch-size", "1"]);
    let one = |node: &str, memory: u32, count: usize| {
        format!("[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = {count}\nmemory_gb = [{memory}]\nnodes = [\"{node}\"]\n\n")
    };
    // Four replicas of one rank, two on each of hosts a and b.
    let equal = plan_file(
        d,
        "equal",
        &[
            one("a", 80, 2),
            one("a", 80, 2),
            one("b", 80, 1),
            one("b", 80, 1),
        ]
        .concat(),
    );
    // Three replicas, two on host a and one on b, sharded by memory 80 : 16 : 24.
    let unequal = plan_file(
        d,
        "unequal",
        &[one("a", 80, 2), one("a", 16, 2), one("b", 24, 2)].concat(),
    );
    // Replica 1's pipeline spans the hosts: the first stage's pieces reduce over
    // ranks 0 and 1 (host a) and 3 (host b), the rest over rank 0 (a) and 2 and 3 (b).
    let pipeline = plan_file(
        d,
        "pipeline",
        &[
            one("a", 80, 2),
            "[[replica]]\nlayers = [1, 3]\nmicro_batch_size = 1\nnum_micro_batches = 2\nmemory_gb = [80, 80]\nnodes = [\"a\", \"b\"]\n\n".to_owned(),
            one("b", 80, 2),
        ]
        .concat(),
    );
    let buckets = ["--ddp-bucket-size", "5000"];
    let zero = ["--use-distributed-optimizer", "--overlap-param-gather"];
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "DP 4, islands [2, 2], buckets of 5000",
            [&["--nproc", "4", "--plan", &equal][..], &buckets].concat(),
            "islands [[0, 1], [2, 3]]",
        ),
        (
            "DP 3, islands [2, 1], distributed optimizer 80 : 16 : 24, overlapped gather",
            [&["--nproc", "3", "--plan", &unequal][..], &buckets, &zero].concat(),
            "islands [[0, 1], [2]]",
        ),
        (
            "PP [4] + [1, 3] + [4] over hosts a, a+b, b",
            [&["--nproc", "4", "--plan", &pipeline][..], &buckets].concat(),
            "islands [[0], [2, 3]]",
        ),
        (
            "the same, distributed optimizer",
            [
                &["--nproc", "4", "--plan", &pipeline][..],
                &buckets,
                &zero[..1],
            ]
            .concat(),
            "islands [[0, 1], [3]]",
        ),
    ];
    let mut table = String::from(EQUIVALENCE_TABLE);
    for (i, (label, flags, islands)) in cases.iter().enumerate() {
        let (got, stderr) = run_logged(d, &data, &format!("islands{i}"), flags);
        assert!(
            stderr.contains(islands),
            "{label}: no \"{islands}\" in\n{stderr}"
        );
        equivalence_row(&mut table, label, &got, &reference);
    }
    println!("{table}");
}
