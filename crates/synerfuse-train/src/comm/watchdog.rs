//! Every wait between ranks is bounded (Megatron's `--distributed-timeout-minutes`).
//!
//! A rank that dies or freezes leaves its peers blocked inside MPI or NCCL, where no
//! error ever comes: shared-memory transports detect nothing, and under `srun` without
//! `--kill-on-bad-exit` nobody kills the survivors. So each wait registers itself here
//! (`waiting`), and a watchdog thread ends the job when one outlasts the timeout: it
//! names this rank, the operation and the group or peer, then calls `MPI_Abort`, which
//! makes `mpirun` (and Slurm, through PMIx) kill every rank, frozen ones included.
//!
//! MPI is initialised for calls from one thread, so the waiting thread aborts itself
//! when its polling loop sees the expiry (`abort_if_expired`); only a thread stuck
//! inside a blocking MPI or NCCL call is aborted from the watchdog thread, a moment later.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

/// Megatron's default `--distributed-timeout-minutes`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// The exit status of a rank ended by the watchdog (what `timeout(1)` uses).
pub const TIMEOUT_EXIT_CODE: i32 = 124;
/// How long `MPI_Abort` may take before the watchdog exits the process itself.
const ABORT_GRACE: Duration = Duration::from_secs(10);
/// How often the watchdog looks at the current wait.
const CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// How long a wait goes on after a local peer's process was seen gone before the peer
/// counts as lost (a collective the peer finished just before it exited completes well
/// within it).
const LOST_GRACE: Duration = Duration::from_secs(3);
/// How long a polling thread has to abort itself before the watchdog does.
const HANDOFF: Duration = Duration::from_secs(2);

static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64);
static WORLD_RANK: AtomicUsize = AtomicUsize::new(usize::MAX);
/// The waits in progress, one per waiting thread (the main thread's, and a checkpoint
/// writer's in the background), each known by its guard's number.
static CURRENT: Mutex<Vec<(u64, Wait)>> = Mutex::new(Vec::new());
static NEXT_WAIT: AtomicU64 = AtomicU64::new(0);
/// The message of an expired wait, until a thread prints it.
static EXPIRED: Mutex<Option<String>> = Mutex::new(None);
static EXPIRED_FLAG: AtomicBool = AtomicBool::new(false);
/// Set by the first thread that aborts the job.
static ABORTING: AtomicBool = AtomicBool::new(false);
/// (world rank, pid) of the other ranks on this host.
static LOCAL_PEERS: Mutex<Vec<(usize, u32)>> = Mutex::new(Vec::new());

/// A wait in progress: what the watchdog reports if it lasts too long.
struct Wait {
    started: Instant,
    op: &'static str,
    group: Arc<str>,
    peer: Option<usize>,
    /// A wait on something other than peers (a file, a thread, `MPI_Finalize`): named
    /// as "`op` of `group`", and no sign of a lost peer (peers end at their own pace).
    local: bool,
    /// Time allowed beyond the timeout (a wait that covers others bounded by it).
    grace: Duration,
}

/// Sets the bound on every wait (and starts the watchdog, once per process).
pub fn set_timeout(timeout: Duration) {
    TIMEOUT_MS.store(timeout.as_millis().max(1) as u64, Ordering::SeqCst);
    start();
}

/// The bound on every wait.
pub fn timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS.load(Ordering::SeqCst))
}

/// Records this process's world rank for the watchdog's message and starts it.
pub(crate) fn start_for_rank(rank: usize) {
    WORLD_RANK.store(rank, Ordering::SeqCst);
    start();
}

fn start() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        std::thread::Builder::new()
            .name("synerfuse-watchdog".into())
            .spawn(watch)
            .expect("spawning the watchdog thread");
    });
}

/// Tells the watchdog the (world rank, pid) of the other ranks on this host, so a
/// timeout can name those that have exited or are stopped.
pub(crate) fn set_local_peers(peers: Vec<(usize, u32)>) {
    *LOCAL_PEERS.lock().unwrap_or_else(|e| e.into_inner()) = peers;
}

/// `(rank, pid, "is stopped" or "has exited")` of every local peer that is not running.
fn peer_states() -> Vec<(usize, u32, &'static str)> {
    let peers = LOCAL_PEERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    peers
        .into_iter()
        .filter_map(|(rank, pid)| {
            let state = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                // The state follows the command name, which is in parentheses.
                Ok(stat) => match stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim().chars().next())
                {
                    Some('T') | Some('t') => STOPPED,
                    Some('Z') | Some('X') => EXITED,
                    _ => return None,
                },
                Err(_) => EXITED,
            };
            Some((rank, pid, state))
        })
        .collect()
}

const STOPPED: &str = "is stopped";
const EXITED: &str = "has exited";

/// "rank 1 (pid 42, this host) is stopped" for every local peer that is not running.
fn peers_not_running() -> Vec<String> {
    (peer_states().into_iter())
        .map(|(rank, pid, state)| format!("rank {rank} (pid {pid}, this host) {state}"))
        .collect()
}

/// `(rank, pid)` of the local peers whose process is gone.
fn peers_gone() -> Vec<(usize, u32)> {
    (peer_states().into_iter())
        .filter(|&(.., state)| state == EXITED)
        .map(|(rank, pid, _)| (rank, pid))
        .collect()
}

/// Marks the calling thread as waiting in `op` over `group` (for `peer`, in
/// point-to-point transfers) until the guard drops. Threads wait independently: a
/// checkpoint writer's wait on the disk runs beside the main thread's on its peers.
pub(crate) fn waiting(op: &'static str, group: &Arc<str>, peer: Option<usize>) -> WaitGuard {
    let wait = Wait {
        started: Instant::now(),
        op,
        group: Arc::clone(group),
        peer,
        local: false,
        grace: Duration::ZERO,
    };
    register(wait)
}

/// Marks the calling thread as waiting in `op` on `what` (a file being flushed, a
/// thread being joined, `MPI_Finalize`: no peer to name) until the guard drops, for
/// the timeout and `grace` beyond it.
pub(crate) fn waiting_on(op: &'static str, what: &str, grace: Duration) -> WaitGuard {
    register(Wait {
        started: Instant::now(),
        op,
        group: Arc::from(what),
        peer: None,
        local: true,
        grace,
    })
}

fn register(wait: Wait) -> WaitGuard {
    let id = NEXT_WAIT.fetch_add(1, Ordering::SeqCst);
    (CURRENT.lock().unwrap_or_else(|e| e.into_inner())).push((id, wait));
    WaitGuard(id)
}

/// Ends a wait registered by [`waiting`].
pub(crate) struct WaitGuard(u64);

impl Drop for WaitGuard {
    fn drop(&mut self) {
        let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        current.retain(|(id, _)| *id != self.0);
    }
}

/// The message of the oldest wait that outlasted `limit` (and its grace), and the start
/// of the oldest wait on peers (local waits never make a peer's exit a loss).
fn oldest_wait(limit: Duration) -> (Option<String>, Option<Instant>) {
    let current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    let waits = || current.iter().map(|(_, wait)| wait);
    let expired = (waits().filter(|w| w.started.elapsed() > limit + w.grace))
        .min_by_key(|w| w.started)
        .map(describe);
    let on_peers = (waits().filter(|w| !w.local)).min_by_key(|w| w.started);
    (expired, on_peers.map(|w| w.started))
}

/// When a wait (known by its start) first saw local peers' processes gone, and which
/// (`(rank, pid)`): survivors that end later are not lost ranks.
struct GoneSince {
    noticed: Instant,
    wait_started: Instant,
    gone: Vec<(usize, u32)>,
}

fn watch() {
    let mut gone_since: Option<GoneSince> = None;
    loop {
        std::thread::sleep(CHECK_INTERVAL);
        let (expired, wait_started) = oldest_wait(timeout());
        if let Some(message) = expired {
            *EXPIRED.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
            EXPIRED_FLAG.store(true, Ordering::SeqCst);
            std::thread::sleep(HANDOFF);
            abort_job();
        }
        let Some(wait_started) = wait_started else {
            gone_since = None;
            continue;
        };
        let gone = peers_gone();
        if gone.is_empty() {
            gone_since = None;
            continue;
        }
        match &gone_since {
            Some(since) if since.wait_started == wait_started => {
                if since.noticed.elapsed() >= LOST_GRACE {
                    end_lost(since.gone.clone());
                }
            }
            _ => {
                gone_since = Some(GoneSince {
                    noticed: Instant::now(),
                    wait_started,
                    gone,
                })
            }
        }
    }
}

/// Ends this survivor of the local peers `gone` (see [`crate::lost`]): the survivors'
/// plan written (by the host's lowest survivor), a message,
/// [`crate::lost::LOST_RANK_EXIT_CODE`]. No MPI call: the lost rank would never answer.
fn end_lost(gone: Vec<(usize, u32)>) -> ! {
    let code = crate::lost::LOST_RANK_EXIT_CODE;
    if ABORTING.swap(true, Ordering::SeqCst) {
        std::thread::sleep(ABORT_GRACE);
        // SAFETY: _exit has no preconditions and does not return.
        unsafe { libc::_exit(code) }
    }
    let rank = WORLD_RANK.load(Ordering::SeqCst);
    let local = LOCAL_PEERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let ended = std::panic::catch_unwind(|| crate::lost::end_as_survivor(rank, &gone, &local));
    let (lost, what) = ended.unwrap_or_else(|_| {
        let lost = gone.iter().map(|&(r, _)| r).collect();
        (lost, "writing the survivors' plan failed".to_owned())
    });
    let who = match lost.as_slice() {
        [one] => format!("rank {one} lost (its process is gone) while this rank waited for it"),
        many => format!(
            "ranks {} lost (their processes are gone) while this rank waited for them",
            many.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    eprintln!("error: rank {rank}: {who}; {what}; exiting with code {code} (a lost rank)");
    // SAFETY: as above.
    unsafe { libc::_exit(code) }
}

fn describe(wait: &Wait) -> String {
    let rank = match WORLD_RANK.load(Ordering::SeqCst) {
        usize::MAX => "this rank".to_owned(),
        r => format!("rank {r}"),
    };
    let with = match (wait.peer, wait.local) {
        (_, true) => format!("of {}", wait.group),
        (Some(peer), false) => format!("with rank {peer} of {}", wait.group),
        (None, false) => format!("over {}", wait.group),
    };
    let suspects = peers_not_running();
    let cause = match (wait.local, suspects.is_empty()) {
        (true, true) => "the file system or the ranks it waits for did not respond".to_owned(),
        (false, true) => "a rank died or froze".to_owned(),
        (_, false) => suspects.join(", "),
    };
    format!(
        "{rank}: {} {with} did not complete within --distributed-timeout-minutes ({:.2} min): \
         {cause}; ending the job",
        wait.op,
        timeout().as_secs_f64() / 60.0
    )
}

/// Ends the job from the calling thread if the current wait has expired; polling
/// loops call it on every turn.
pub(crate) fn abort_if_expired() {
    if EXPIRED_FLAG.load(Ordering::Relaxed) {
        abort_job();
    }
}

fn abort_job() -> ! {
    if ABORTING.swap(true, Ordering::SeqCst) {
        // Another thread is already aborting; it exits the process.
        std::thread::sleep(ABORT_GRACE);
        // SAFETY: _exit has no preconditions and does not return.
        unsafe { libc::_exit(TIMEOUT_EXIT_CODE) }
    }
    if let Some(message) = EXPIRED.lock().unwrap_or_else(|e| e.into_inner()).take() {
        eprintln!("error: {message}");
    }
    // MPI_Abort normally ends every rank; should it hang, this process ends anyway.
    std::thread::spawn(|| {
        std::thread::sleep(ABORT_GRACE);
        // SAFETY: _exit has no preconditions and does not return.
        unsafe { libc::_exit(TIMEOUT_EXIT_CODE) }
    });
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, TIMEOUT_EXIT_CODE) };
    }
    // SAFETY: as above.
    unsafe { libc::_exit(TIMEOUT_EXIT_CODE) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The oldest expired wait is the one reported, whichever thread's; only waits on
    /// peers say when a peer's exit would count as a loss.
    #[test]
    fn local_waits_expire_but_never_stand_for_peers() {
        let flushing = waiting_on("fsync", "shard-0.safetensors", Duration::ZERO);
        std::thread::sleep(Duration::from_millis(5));
        let receiving = waiting("recv", &Arc::from("the pipeline"), Some(1));
        let receiving_started = Instant::now();
        let (expired, on_peers) = oldest_wait(Duration::ZERO);
        let expired = expired.expect("both waits outlasted a zero bound");
        assert!(
            expired.contains("fsync of shard-0.safetensors"),
            "{expired}"
        );
        let on_peers = on_peers.expect("a wait on a peer is in progress");
        assert!(on_peers <= receiving_started && on_peers.elapsed() < Duration::from_secs(5));
        drop(flushing);
        let (expired, _) = oldest_wait(Duration::ZERO);
        let expired = expired.expect("the receive outlasted a zero bound");
        assert!(
            expired.contains("recv with rank 1 of the pipeline"),
            "{expired}"
        );
        // A grace beyond the bound keeps a wait from expiring.
        let joining = waiting_on("join", "the writer", Duration::from_secs(3600));
        drop(receiving);
        assert_eq!(oldest_wait(Duration::ZERO).0, None);
        assert_eq!(
            oldest_wait(Duration::ZERO).1,
            None,
            "a local wait is not one on peers"
        );
        drop(joining);
    }
}
