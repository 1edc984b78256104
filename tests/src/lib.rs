//! Helpers shared by synerfuse's cross-crate and multi-rank integration tests.

use std::process::Output;
use std::time::Duration;

/// Runs `program` with `args` on `ranks` MPI ranks of this machine, one intra-op thread
/// each, and returns the launcher's output.
///
/// The options are `synerfuse_train::comm::mpirun_options`' (root allowed, shared-memory
/// transport, no core binding). The run is killed after `timeout`, so a deadlock fails the test instead of hanging it.
pub fn mpirun(
    ranks: usize,
    program: &str,
    args: &[&str],
    timeout: Duration,
) -> std::io::Result<Output> {
    synerfuse_train::comm::mpirun_options(ranks)
        .args(["--timeout", &timeout.as_secs().max(1).to_string()])
        .args(["-x", "OMP_NUM_THREADS=1"])
        .arg(program)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .env_remove("LD_LIBRARY_PATH")
        .output()
}
