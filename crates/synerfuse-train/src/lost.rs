//! A rank lost while training (its process gone: a failed device, a preemption, a
//! crash). The survivors on its host notice it while they wait for it (the watchdog sees
//! its process gone), and end cleanly: each leaves a marker under `--save` (so a survivor
//! that notices later does not count it lost), the lowest survivor of the host writes
//! which ranks were lost ([`LOST_RANKS_FILE`]) and a plan for the survivors
//! ([`SURVIVORS_PLAN_FILE`], planned as re-planning plans, at the ranks' last measured
//! paces), and every survivor exits with [`LOST_RANK_EXIT_CODE`]. A `--nproc` job
//! restarts itself on the survivors from the last checkpoint with that plan; a script
//! under `mpirun` or `srun` does the same from the exit code and the files.
//!
//! Ranks on other hosts do not see the process go: they end when their wait outlasts
//! `--distributed-timeout-minutes`, as before.

use crate::checkpoint::layout::LATEST;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use synerfuse_plan::Plan;
use synerfuse_plan::RunRecord;
use synerfuse_planner::planner;

/// The exit status of a survivor of a lost rank (`EX_TEMPFAIL`: try again, on the
/// survivors).
pub const LOST_RANK_EXIT_CODE: i32 = 75;
/// Which ranks were lost, in the `--save` directory.
pub const LOST_RANKS_FILE: &str = "lost-ranks.json";
/// The survivors' plan, in the `--save` directory.
pub const SURVIVORS_PLAN_FILE: &str = "survivors-plan.toml";

/// What [`LOST_RANKS_FILE`] says.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LostRanks {
    /// The world ranks lost.
    pub lost: Vec<usize>,
    /// The job's ranks before.
    pub world_size: usize,
    /// The ranks that survived, in the order the survivors' plan numbers them (survivor
    /// `i` of the plan was rank `survivors[i]`).
    pub survivors: Vec<usize>,
    /// The checkpoint the restart resumes from (`None`: none was saved yet).
    pub checkpoint_iteration: Option<u64>,
    /// The survivors' plan file.
    pub plan: PathBuf,
    /// The survivors' plan's predicted step, s.
    pub predicted_step_s: f64,
}

impl LostRanks {
    /// The record of `save`, if there is one.
    pub fn read(save: &Path) -> Option<LostRanks> {
        let text = std::fs::read_to_string(save.join(LOST_RANKS_FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }
}

/// What a survivors' plan is made from, kept up to date by the trainer.
#[derive(Debug, Clone)]
pub(crate) struct JobSnapshot {
    /// `--save`.
    pub save: PathBuf,
    /// What runs (the plan, the model, the hosts, the options).
    pub run: RunRecord,
    /// Each rank's latest forward and backward seconds per step.
    pub paces_s: Vec<f64>,
}

static SNAPSHOT: Mutex<Option<JobSnapshot>> = Mutex::new(None);

/// Keeps `snapshot` for the survivors' plan, should a rank be lost.
pub(crate) fn remember(snapshot: JobSnapshot) {
    *SNAPSHOT.lock().unwrap_or_else(|e| e.into_inner()) = Some(snapshot);
}

/// Updates the ranks' latest paces.
pub(crate) fn remember_paces(paces_s: &[f64]) {
    if let Some(s) = SNAPSHOT.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        if paces_s.len() == s.paces_s.len() && paces_s.iter().all(|&p| p > 0.0) {
            s.paces_s = paces_s.to_vec();
        }
    }
}

/// The marker a survivor leaves under `--save` before it exits, so that survivors who
/// notice the loss later do not count it among the lost.
pub fn survivor_marker(save: &Path, rank: usize, pid: u32) -> PathBuf {
    save.join(format!("{SURVIVOR_MARKER_PREFIX}{rank}-{pid}"))
}

/// The start of [`survivor_marker`]'s file names.
pub const SURVIVOR_MARKER_PREFIX: &str = ".survivor-rank-";

/// This rank (`rank`, on a host with the other ranks `local`, `(rank, pid)`) ends as a
/// survivor of the peers `gone`: it leaves its marker, counts as lost the gone peers
/// that left none, and, when it is the lowest survivor on this host, writes the
/// survivors' plan and [`LOST_RANKS_FILE`] into `--save`. Returns the lost ranks and
/// what happened, for its message. Runs on the watchdog thread while the main thread
/// is stuck waiting for the lost rank.
pub(crate) fn end_as_survivor(
    rank: usize,
    gone: &[(usize, u32)],
    local: &[(usize, u32)],
) -> (Vec<usize>, String) {
    let snapshot = SNAPSHOT.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let Some(snapshot) = snapshot else {
        let lost = gone.iter().map(|&(r, _)| r).collect();
        return (lost, "no --save, so no plan for the survivors".to_owned());
    };
    let save = &snapshot.save;
    let _ = std::fs::create_dir_all(save);
    let _ = std::fs::write(survivor_marker(save, rank, std::process::id()), b"");
    let lost: Vec<usize> = (gone.iter())
        .filter(|&&(r, pid)| !survivor_marker(save, r, pid).exists())
        .map(|&(r, _)| r)
        .collect();
    let writer = (local.iter().map(|&(r, _)| r))
        .filter(|r| !lost.contains(r))
        .chain([rank])
        .min()
        .unwrap_or(rank);
    let world_size = snapshot.run.plan.world_size();
    let survivors: Vec<usize> = (0..world_size).filter(|r| !lost.contains(r)).collect();
    if writer != rank {
        let what = format!(
            "rank {writer} writes the survivors' plan to {}",
            save.display()
        );
        return (lost, what);
    }
    let what = match plan_for_survivors(&snapshot, &survivors) {
        Ok((plan, predicted_step_s)) => {
            match write(&snapshot, &lost, &survivors, &plan, predicted_step_s) {
                Ok(path) => format!(
                    "wrote {} and the survivors' plan {} ({} ranks, predicted {predicted_step_s:.4} s per step)",
                    save.join(LOST_RANKS_FILE).display(),
                    path.display(),
                    survivors.len()
                ),
                Err(e) => format!("could not write the survivors' plan into {}: {e}", save.display()),
            }
        }
        Err(e) => format!("no plan for the survivors: {e}"),
    };
    (lost, what)
}

/// The best plan for `survivors` at their last paces.
fn plan_for_survivors(
    snapshot: &JobSnapshot,
    survivors: &[usize],
) -> Result<(Plan, f64), planner::ReplanError> {
    let run = &snapshot.run;
    let cost = planner::fitted_cost_of(
        &planner::RunningJob::of_run(run, &snapshot.paces_s, None),
        survivors,
    )?;
    let request = planner::running_job_request(
        run.plan.global_batch_size(),
        run.recompute,
        run.distributed_optimizer,
    );
    let placements: Vec<_> = (survivors.iter())
        .map(|&r| run.plan.placement(r).cloned())
        .collect();
    planner::best_plan_for(&cost, &request, &placements)
}

/// Writes the plan, then the record naming it (each under a temporary name, renamed).
fn write(
    snapshot: &JobSnapshot,
    lost: &[usize],
    survivors: &[usize],
    plan: &Plan,
    predicted_step_s: f64,
) -> Result<PathBuf, String> {
    let save = &snapshot.save;
    std::fs::create_dir_all(save).map_err(|e| e.to_string())?;
    let path = save.join(SURVIVORS_PLAN_FILE);
    let text = plan.to_toml().map_err(|e| e.to_string())?;
    let checkpoint_iteration = std::fs::read_to_string(save.join(LATEST))
        .ok()
        .and_then(|t| t.trim().parse().ok());
    let record = LostRanks {
        lost: lost.to_vec(),
        world_size: snapshot.run.plan.world_size(),
        survivors: survivors.to_vec(),
        checkpoint_iteration,
        plan: path.clone(),
        predicted_step_s,
    };
    let json = serde_json::to_string_pretty(&record).map_err(|e| e.to_string())?;
    atomically(&path, &text)?;
    atomically(&save.join(LOST_RANKS_FILE), &json)?;
    Ok(path)
}

/// Writes `text` to a temporary name of this process, flushed to disk, then renames it.
fn atomically(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    let temp = path.with_extension(format!("tmp{}", std::process::id()));
    let at = |e: std::io::Error| format!("{}: {e}", temp.display());
    let mut file = std::fs::File::create(&temp).map_err(at)?;
    file.write_all(text.as_bytes()).map_err(at)?;
    file.sync_all().map_err(at)?;
    std::fs::rename(&temp, path).map_err(|e| format!("{}: {e}", path.display()))
}
