//! Starting ranks under `mpirun`, and what they tell each other when they end. The rank a
//! launcher assigned to this process is read by [`synerfuse_plan::launcher`].

/// The `mpirun` command that starts `program args` on `ranks` ranks of this machine:
/// oversubscription allowed, no core binding (ranks share the cores), shared-memory
/// transport without ptrace single-copy (which containers forbid), and OpenMPI's root
/// check waived when running as root (containers, CI).
pub fn mpirun_command(ranks: usize, program: &std::path::Path) -> std::process::Command {
    let mut command = mpirun_options(ranks);
    command.arg(program);
    command
}

/// `mpirun` with [`mpirun_command`]'s options, before the program: callers add options
/// of their own (a `--timeout`, `-x VAR`), then the program and its arguments.
pub fn mpirun_options(ranks: usize) -> std::process::Command {
    let mut command = std::process::Command::new("mpirun");
    command
        .args([
            "-np",
            &ranks.to_string(),
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["--mca", "btl", "self,vader"])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        command
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    command
}

/// `args` without `flag` and its value (`--flag N` or `--flag=N`).
pub fn without_flag(args: impl IntoIterator<Item = String>, flag: &str) -> Vec<String> {
    let with_value = format!("{flag}=");
    let mut kept = Vec::new();
    let mut skip = false;
    for arg in args {
        if skip {
            skip = false;
        } else if arg == flag {
            skip = true;
        } else if !arg.starts_with(&with_value) {
            kept.push(arg);
        }
    }
    kept
}

/// Re-runs this process's own command line under `mpirun -np nproc` on this machine,
/// without its `--nproc` flag (which asked for the re-launch), forwarding stop signals
/// as [`run_forwarding_signals`] does; returns `mpirun`'s status.
pub fn relaunch_under_mpirun(nproc: usize) -> std::io::Result<std::process::ExitStatus> {
    let args = without_flag(std::env::args().skip(1), "--nproc");
    launch_under_mpirun(nproc, &args, Survival::EndWithRank, &[], None)
}

/// The environment variable naming the folder where each rank of a launched job marks
/// its clean end ([`mark_rank_done`]): under [`Survival::Survive`] `mpirun` exits 0 even
/// when a rank failed, so the marks are what says the job succeeded.
pub const DONE_DIR_ENV: &str = "SYNERFUSE_DONE_DIR";

/// Marks this rank's clean end for the launcher that set [`DONE_DIR_ENV`] (a no-op
/// otherwise).
pub fn mark_rank_done(rank: usize) -> std::io::Result<()> {
    match std::env::var_os(DONE_DIR_ENV) {
        Some(dir) => std::fs::write(
            std::path::Path::new(&dir).join(format!("rank-{rank}.done")),
            b"",
        ),
        None => Ok(()),
    }
}

/// How many ranks marked their clean end in `dir`.
pub fn ranks_done(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        (entries.flatten())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".done"))
            .count()
    })
}

/// What `mpirun` does with the other ranks when one dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Survival {
    /// Ends them (OpenMPI's default).
    EndWithRank,
    /// Leaves them running (OpenMPI's `orte_enable_recovery`), so they can end
    /// cleanly, saying which rank was lost ([`crate::lost`]).
    Survive,
}

/// Runs this program with `args` under `mpirun -np nproc` on this machine, forwarding
/// stop signals as [`run_forwarding_signals`] does, without the environment variables
/// `env_remove`, with [`DONE_DIR_ENV`] set to `done_dir` when given; returns `mpirun`'s
/// status.
pub fn launch_under_mpirun(
    nproc: usize,
    args: &[String],
    survival: Survival,
    env_remove: &[&str],
    done_dir: Option<&std::path::Path>,
) -> std::io::Result<std::process::ExitStatus> {
    let exe = std::env::current_exe()?;
    let mut command = mpirun_options(nproc);
    if survival == Survival::Survive {
        command.args(["--mca", "orte_enable_recovery", "1"]);
    }
    command.arg(&exe).args(args);
    for name in env_remove {
        command.env_remove(name);
    }
    if let Some(dir) = done_dir {
        command.env(DONE_DIR_ENV, dir);
    }
    tracing::info!(
        "launching {nproc} ranks: mpirun -np {nproc} {}",
        exe.display()
    );
    run_forwarding_signals(command)
}

/// Stop signals (SIGTERM, SIGINT) the `--nproc` parent has received.
static PARENT_SIGNALS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn count_parent_signal(_: libc::c_int) {
    PARENT_SIGNALS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// Runs `command` (an `mpirun` from [`mpirun_command`]) to completion on behalf of a
/// `--nproc` parent, and returns its status.
///
/// `mpirun` runs in a process group of its own, so a terminal's Ctrl-C reaches this
/// process only, and it receives SIGTERM should this process die. SIGTERM or SIGINT
/// received here is passed on: the first as SIGUSR2, which `mpirun` forwards to every
/// rank (they finish the step, save and exit 0); a second as SIGTERM (`mpirun` kills the
/// ranks); a third as SIGKILL to the whole process group.
pub fn run_forwarding_signals(
    mut command: std::process::Command,
) -> std::io::Result<std::process::ExitStatus> {
    use std::os::unix::process::CommandExt;
    use std::sync::atomic::Ordering;
    command.process_group(0);
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: prctl, getppid and _exit are async-signal-safe and touch only the child
    // being spawned. Should this process already be gone, the child ends at once.
    unsafe {
        command.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    // Installed before the spawn, so no signal is lost in between (exec resets caught
    // handlers in the child).
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only increments an atomic (async-signal-safe).
        unsafe {
            libc::signal(
                signal,
                count_parent_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
    let mut child = command.spawn()?;
    let pid = child.id() as libc::pid_t;
    let mut forwarded = 0;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        let received = PARENT_SIGNALS.load(Ordering::SeqCst);
        while forwarded < received {
            forwarded += 1;
            let (target, signal, what) = match forwarded {
                1 => (pid, libc::SIGUSR2, "asking every rank to save and stop"),
                2 => (pid, libc::SIGTERM, "mpirun ends the ranks"),
                _ => (-pid, libc::SIGKILL, "killing mpirun and every rank"),
            };
            tracing::warn!("stop signal received: {what}");
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(target, signal) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relaunch_drops_nproc_in_both_spellings() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            without_flag(args(&["train", "--nproc", "4", "--lr", "1"]), "--nproc"),
            args(&["train", "--lr", "1"])
        );
        assert_eq!(
            without_flag(args(&["--nproc=4", "--nprocs", "2"]), "--nproc"),
            args(&["--nprocs", "2"])
        );
    }
}
