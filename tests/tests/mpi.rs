//! Multi-rank tests: real `mpirun` launches of small binaries on this machine.

use std::time::Duration;
use synerfuse_tests::mpirun;

const CHECK: &str = env!("CARGO_BIN_EXE_mpi_comm_check");

#[test]
fn four_ranks_all_reduce_broadcast_and_send_recv_tch_tensors() {
    let out = mpirun(4, CHECK, &[], Duration::from_secs(120))
        .expect("mpirun must be installed (cargo xtask setup)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for rank in 0..4 {
        assert!(
            stdout.contains(&format!("rank {rank} of 4: ok")),
            "rank {rank} did not report ok\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
    }
}

#[test]
fn a_failing_rank_fails_the_job_and_is_named() {
    let out = mpirun(3, CHECK, &["--fail-rank", "2"], Duration::from_secs(120)).expect("mpirun");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a failing rank must make mpirun exit non-zero"
    );
    assert!(stderr.contains("rank 2 of 3: FAILED"), "stderr:\n{stderr}");
}

#[test]
fn a_panicking_rank_aborts_the_job_instead_of_hanging() {
    let started = std::time::Instant::now();
    let out = mpirun(3, CHECK, &["--panic-rank", "1"], Duration::from_secs(120)).expect("mpirun");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a panicking rank must make mpirun exit non-zero"
    );
    assert!(
        stderr.contains("rank 1 panics on purpose"),
        "stderr:\n{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}
