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

/// The bytes all ranks sent across sites in the run's last step.
fn bytes_across_sites(log: &std::path::Path) -> f64 {
    let records = json_records(log);
    let last = records.iter().rev().find(|v| v.get("elapsed_ms").is_some());
    let ranks = last
        .and_then(|v| v["ranks"].as_array().cloned())
        .unwrap_or_default();
    (ranks.iter())
        .filter_map(|r| r["bytes_across_sites"].as_f64())
        .sum()
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
    // Replica 1's pipeline spans the hosts, over an emulated link (its activations and
    // gradients carry their arrival times): the first stage's pieces reduce over ranks
    // 0 and 1 (host a) and 3 (host b), the rest over rank 0 (a) and 2 and 3 (b).
    let pipeline = plan_file(
        d,
        "pipeline",
        &[
            "[network]\nintra_node_gbs = 100\ninter_node_gbs = 0.5\n\n".to_owned(),
            one("a", 80, 2),
            "[[replica]]\nlayers = [1, 3]\nmicro_batch_size = 1\nnum_micro_batches = 2\nmemory_gb = [80, 80]\nnodes = [\"a\", \"b\"]\n\n".to_owned(),
            one("b", 80, 2),
        ]
        .concat(),
    );
    // Two emulated sites of one host each, a slow link between them: the reductions'
    // pieces and every byte of a flat reduction are delayed as the link carries them.
    let site = |node: &str, site: &str, count: usize| {
        format!("[[replica]]\nlayers = [4]\nmicro_batch_size = 1\nnum_micro_batches = {count}\nmemory_gb = [80]\nnodes = [\"{node}\"]\nsites = [\"{site}\"]\n\n")
    };
    let network = "[network]\nintra_node_gbs = 100\ninter_node_gbs = 1\ninter_site_gbs = 0.05\ninter_site_latency_us = 500\n\n";
    let sites = plan_file(
        d,
        "sites",
        &[
            network.to_owned(),
            site("a", "east", 2),
            site("a", "east", 2),
            site("b", "west", 1),
            site("b", "west", 1),
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
        (
            "DP 4 across two emulated sites, islands [2, 2], distributed optimizer, overlap",
            [&["--nproc", "4", "--plan", &sites][..], &buckets, &zero].concat(),
            "islands [[0, 1], [2, 3]]",
        ),
        (
            "the same, flat (--no-hierarchical-reduction)",
            [
                &["--nproc", "4", "--plan", &sites][..],
                &buckets,
                &["--no-hierarchical-reduction"],
            ]
            .concat(),
            "transfers across emulated nodes are delayed",
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
        if label.contains("sites") || label.contains("flat") {
            let across = bytes_across_sites(&d.join(format!("islands{i}.jsonl")));
            assert!(across > 0.0, "{label}: nothing crossed the sites");
        }
    }
    println!("{table}");
}
