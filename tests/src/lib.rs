//! Helpers shared by synerfuse's cross-crate and multi-rank integration tests.

use std::process::{Command, Output};
use std::time::Duration;

/// Runs `program` with `args` on `ranks` MPI ranks of this machine, one intra-op thread
/// each, and returns the launcher's output.
///
/// Works as root (containers, CI): OpenMPI refuses root unless told otherwise. The
/// run is killed after `timeout`, so a deadlock fails the test instead of hanging it.
pub fn mpirun(
    ranks: usize,
    program: &str,
    args: &[&str],
    timeout: Duration,
) -> std::io::Result<Output> {
    Command::new("mpirun")
        .args([
            "-np",
            &ranks.to_string(),
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["--timeout", &timeout.as_secs().max(1).to_string()])
        // Shared-memory transport without ptrace-based single copy, which containers forbid.
        .args([
            "--mca",
            "btl",
            "self,vader",
            "--mca",
            "btl_vader_single_copy_mechanism",
            "none",
        ])
        .args(["-x", "OMP_NUM_THREADS=1"])
        .arg(program)
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMP_NUM_THREADS", "1")
        .env_remove("LD_LIBRARY_PATH")
        .output()
}
