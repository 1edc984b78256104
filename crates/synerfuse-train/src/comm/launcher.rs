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
    let ends = done_dir.map(|dir| RankEnds {
        dir: dir.to_path_buf(),
        ranks: nproc,
    });
    run_watching(command, ends)
}

/// How long past `--distributed-timeout-minutes` after the first rank's clean end the
/// launcher waits for the others (their own watchdogs end them first).
const LAUNCHER_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Where the ranks of a launch mark their clean ends, and how many there are: once one
/// has ended, the others must end within the watchdog's bound.
struct RankEnds {
    dir: std::path::PathBuf,
    ranks: usize,
}

impl RankEnds {
    /// The ranks without a clean-end mark.
    fn not_ended(&self) -> Vec<usize> {
        (0..self.ranks)
            .filter(|r| !self.dir.join(format!("rank-{r}.done")).exists())
            .collect()
    }

    /// Whether the launch has outlived its bound: some rank ended cleanly more than
    /// the watchdog's timeout (and a grace) ago, others have not ended.
    fn overdue(&self, first_end: &mut Option<std::time::Instant>) -> Option<Vec<usize>> {
        let missing = self.not_ended();
        if missing.is_empty() || missing.len() == self.ranks {
            return None;
        }
        let since = *first_end.get_or_insert_with(std::time::Instant::now);
        (since.elapsed() > super::watchdog::timeout() + LAUNCHER_GRACE).then_some(missing)
    }
}

/// Ends `mpirun` and every rank (its process group) when ranks outlive the others'
/// clean end by more than the bound: a rank frozen where no watchdog looks would
/// otherwise hold the launcher for ever.
fn end_overdue_launch(
    child: &mut std::process::Child,
    missing: &[usize],
) -> std::io::Result<std::process::ExitStatus> {
    let pid = child.id() as libc::pid_t;
    let ranks: Vec<String> = missing.iter().map(usize::to_string).collect();
    tracing::error!(
        "rank(s) {} did not end within --distributed-timeout-minutes ({:.2} min) of the \
         other ranks' clean end: ending mpirun and every rank",
        ranks.join(", "),
        super::watchdog::timeout().as_secs_f64() / 60.0
    );
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(-pid, libc::SIGTERM) };
    let asked = std::time::Instant::now();
    while asked.elapsed() < std::time::Duration::from_secs(10) {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    child.wait()
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
    command: std::process::Command,
) -> std::io::Result<std::process::ExitStatus> {
    run_watching(command, None)
}

/// [`run_forwarding_signals`], and with `ends` a bound on how long ranks may outlive the
/// first clean end among them.
fn run_watching(
    mut command: std::process::Command,
    ends: Option<RankEnds>,
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
    let (mut first_end, mut looked) = (None, std::time::Instant::now());
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if let Some(ends) = ends
            .as_ref()
            .filter(|_| looked.elapsed().as_millis() >= 500)
        {
            looked = std::time::Instant::now();
            if let Some(missing) = ends.overdue(&mut first_end) {
                return end_overdue_launch(&mut child, &missing);
            }
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

    /// A launch is overdue only once some ranks have ended cleanly and others have not
    /// for longer than the watchdog's bound and the grace; it names the others.
    #[test]
    fn ranks_outliving_the_first_clean_end_by_the_bound_are_overdue() {
        let dir = std::env::temp_dir().join(format!("synerfuse-ends-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ends = RankEnds {
            dir: dir.clone(),
            ranks: 3,
        };
        let mut first_end = None;
        assert_eq!(ends.overdue(&mut first_end), None, "no rank has ended");
        assert_eq!(first_end, None);
        mark(&dir, 1);
        assert_eq!(ends.overdue(&mut first_end), None, "just ended");
        assert!(first_end.is_some(), "the first end is noted");
        let long_ago =
            super::super::watchdog::timeout() + LAUNCHER_GRACE + std::time::Duration::from_secs(1);
        if let Some(then) = std::time::Instant::now().checked_sub(long_ago) {
            first_end = Some(then);
            assert_eq!(ends.overdue(&mut first_end), Some(vec![0, 2]));
            mark(&dir, 0);
            mark(&dir, 2);
            assert_eq!(ends.overdue(&mut first_end), None, "every rank ended");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn mark(dir: &std::path::Path, rank: usize) {
        std::fs::write(dir.join(format!("rank-{rank}.done")), b"").unwrap();
    }
}
