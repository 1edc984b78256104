//! SIGTERM as a request to stop: the current step finishes, a checkpoint is saved when
//! `--save` is set, and the run exits cleanly (what schedulers expect before a kill).
//!
//! SIGUSR1 and SIGUSR2 mean the same: `mpirun` forwards them to every rank without
//! killing the job (it answers SIGTERM by killing the ranks a second later), so the
//! `--nproc` parent passes a SIGTERM on as SIGUSR2, and Slurm's `--signal=USR1@…`
//! warning before a time limit stops the run cleanly too.

use std::sync::atomic::{AtomicI32, Ordering};

/// The first stop signal received (0: none).
static STOP: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    let _ = STOP.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
}

/// Installs the stop handler for SIGTERM, SIGUSR1 and SIGUSR2 (idempotent).
pub fn install_sigterm_handler() {
    for signal in [libc::SIGTERM, libc::SIGUSR1, libc::SIGUSR2] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(
                signal,
                on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// Whether a stop signal arrived.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst) != 0
}

/// The name of the stop signal received, for the log.
pub fn stop_signal_name() -> &'static str {
    match STOP.load(Ordering::SeqCst) {
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGTERM (forwarded by the --nproc launcher as SIGUSR2)",
        _ => "SIGTERM",
    }
}
