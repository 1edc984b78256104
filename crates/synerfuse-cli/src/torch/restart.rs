//! `synerfuse train --nproc N`: the job under `mpirun` on this machine, restarted on the
//! survivors when ranks are lost. Under `--save`, `mpirun` leaves the other ranks
//! running when one dies; they end with `synerfuse_train::lost`'s exit code after the
//! lowest of them wrote which ranks were lost and a plan for the survivors; the job
//! then starts again on the survivors, from the last checkpoint, with that plan.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::SystemTime;
use synerfuse_train::comm::{launch_under_mpirun, ranks_done, without_flag, Survival};
use synerfuse_train::lost::{LostRanks, LOST_RANKS_FILE, SURVIVOR_MARKER_PREFIX};

/// The flags that set a layout: a restart replaces them with the survivors' plan.
const LAYOUT_FLAGS: [&str; 15] = [
    "--plan",
    "--tensor-model-parallel-size",
    "--context-parallel-size",
    "--pipeline-model-parallel-size",
    "--hetero-process-meshes",
    "--hetero-pipeline-layer-split",
    "--hetero-pipeline-stages",
    "--hetero-device-types",
    "--hetero-current-device-type",
    "--enable-hetero",
    "--micro-batch-size",
    "--micro-batch-size-per-dp",
    "--num-micro-batches-per-dp",
    "--num-layers-per-virtual-pipeline-stage",
    "--use-tp-pp-dp-mapping",
];

/// The test hook that kills a rank; it fires in the first launch only.
const FAULT_INJECT: &str = "SYNERFUSE_FAULT_INJECT";

/// Runs this command on `nproc` ranks, and again on the survivors each time ranks are
/// lost (only under `--save`: a restart resumes from its checkpoint).
pub fn run_restarting(nproc: usize, save: Option<&Path>) -> Result<()> {
    let mut args = without_flag(std::env::args().skip(1), "--nproc");
    let (mut ranks, mut launches) = (nproc, 0);
    let survival = match save {
        Some(_) => Survival::Survive,
        None => Survival::EndWithRank,
    };
    let done = DoneDir::new()?;
    loop {
        let launched = SystemTime::now();
        let hidden: &[&str] = if launches > 0 { &[FAULT_INJECT] } else { &[] };
        done.clear();
        let status = launch_under_mpirun(ranks, &args, survival, hidden, Some(&done.0))
            .context("could not start mpirun (install OpenMPI: `cargo xtask setup`)")?;
        launches += 1;
        // Every rank ended cleanly, whatever `mpirun` says (it exits 0 when it kept
        // survivors alive), or not, whatever it says.
        let succeeded = ranks_done(&done.0) == ranks;
        if let Some(save) = save {
            remove_survivor_markers(save);
        }
        let lost = save.and_then(|save| written_since(save, launched));
        let Some(lost) = lost else {
            if succeeded {
                return Ok(());
            }
            bail!(
                "the {ranks}-rank job failed (mpirun: {status}; {} of {ranks} ranks ended cleanly); see the ranks' messages above",
                ranks_done(&done.0)
            );
        };
        let save = save.expect("a lost-rank record lies under --save");
        let record = save.join(LOST_RANKS_FILE);
        if lost.world_size != ranks {
            bail!(
                "{} describes a job of {} ranks, not this {ranks}-rank one",
                record.display(),
                lost.world_size
            );
        }
        if lost.survivors.is_empty() {
            bail!(
                "the {ranks}-rank job lost every rank ({})",
                record.display()
            );
        }
        tracing::warn!(
            "rank {} of {ranks} lost: restarting on the {} survivors from {} with the plan {} (predicted {:.4} s per step)",
            list(&lost.lost),
            lost.survivors.len(),
            match lost.checkpoint_iteration {
                Some(i) => format!("the checkpoint of iteration {i}"),
                None => "the start (no checkpoint was saved)".to_owned(),
            },
            lost.plan.display(),
            lost.predicted_step_s
        );
        args = survivor_args(args, &lost, save);
        ranks = lost.survivors.len();
    }
}

/// A folder of its own where the ranks of each launch mark their clean end, removed
/// with it.
struct DoneDir(PathBuf);

impl DoneDir {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("synerfuse-done-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
        Ok(DoneDir(dir))
    }

    /// Forgets the marks of the last launch.
    fn clear(&self) {
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = std::fs::create_dir_all(&self.0);
    }
}

impl Drop for DoneDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Removes the markers the survivors of a lost rank leave (`synerfuse_train::lost`).
fn remove_survivor_markers(save: &Path) {
    let Ok(entries) = std::fs::read_dir(save) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with(SURVIVOR_MARKER_PREFIX) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The lost-rank record of `save`, if written since `launched`.
fn written_since(save: &Path, launched: SystemTime) -> Option<LostRanks> {
    let modified = std::fs::metadata(save.join(LOST_RANKS_FILE))
        .and_then(|m| m.modified())
        .ok()?;
    (modified >= launched)
        .then(|| LostRanks::read(save))
        .flatten()
}

/// `args` for the survivors: the layout flags replaced by `--plan` of the survivors'
/// plan, and `--load` by `save` when a checkpoint was saved there; the emulation flags of
/// lost ranks dropped and the others' ranks renumbered.
pub fn survivor_args(args: Vec<String>, lost: &LostRanks, save: &Path) -> Vec<String> {
    let resume = lost.checkpoint_iteration.is_some();
    let replaced = LAYOUT_FLAGS.iter().chain(resume.then_some(&"--load"));
    let mut args = replaced.fold(args, |args, flag| without_values(args, flag));
    let new_rank = |old: usize| lost.survivors.iter().position(|&r| r == old);
    // Every occurrence's speeds, in rank order, then the survivors' in one flag.
    let speed_flag = "--emulate-device-speed";
    let mut speeds = Vec::new();
    args = map_values(args, speed_flag, |list| {
        speeds.extend(list.split(',').map(str::to_owned));
        None
    });
    let kept: Vec<&str> = (lost.survivors.iter())
        .filter_map(|&r| speeds.get(r).map(String::as_str))
        .collect();
    if !kept.is_empty() {
        args.extend([speed_flag.to_owned(), kept.join(",")]);
    }
    args = map_values(args, "--emulate-speed-change", |change| {
        let [iteration, rank, speed] = change.split(':').collect::<Vec<_>>()[..] else {
            return Some(change.to_owned());
        };
        let rank = new_rank(rank.parse().ok()?)?;
        Some(format!("{iteration}:{rank}:{speed}"))
    });
    args.extend(["--plan".to_owned(), lost.plan.display().to_string()]);
    if resume {
        args.extend(["--load".to_owned(), save.display().to_string()]);
    }
    args
}

/// `args` without `flag` (`--flag V...` up to the next `--` argument, or `--flag=V`).
fn without_values(args: Vec<String>, flag: &str) -> Vec<String> {
    let with_value = format!("{flag}=");
    let mut kept = Vec::with_capacity(args.len());
    let mut skipping = false;
    for arg in args {
        if arg == flag {
            skipping = true;
        } else if skipping && !arg.starts_with("--") {
            continue;
        } else if !arg.starts_with(&with_value) {
            skipping = false;
            kept.push(arg);
        }
    }
    kept
}

/// `args` with each value of `flag` (`--flag V` or `--flag=V`) mapped by `f`; a value
/// mapped to `None` is dropped with its flag.
fn map_values(
    args: Vec<String>,
    flag: &str,
    mut f: impl FnMut(&str) -> Option<String>,
) -> Vec<String> {
    let with_value = format!("{flag}=");
    let mut out = Vec::with_capacity(args.len());
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let value = match arg.strip_prefix(&with_value) {
            Some(value) => Some(value.to_owned()),
            None if arg == flag => args.next(),
            None => {
                out.push(arg);
                continue;
            }
        };
        if let Some(mapped) = value.as_deref().and_then(&mut f) {
            out.extend([flag.to_owned(), mapped]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn without_a_checkpoint_the_restart_keeps_the_users_load() {
        let lost = LostRanks {
            lost: vec![0],
            world_size: 2,
            survivors: vec![1],
            checkpoint_iteration: None,
            plan: "/s/survivors-plan.toml".into(),
            predicted_step_s: 1.0,
        };
        let args = strings(&["train", "--load", "/old", "--emulate-device-speed", "0.5,1"]);
        let got = survivor_args(args, &lost, Path::new("/s"));
        assert_eq!(
            got,
            strings(&[
                "train",
                "--load",
                "/old",
                "--emulate-device-speed",
                "1",
                "--plan",
                "/s/survivors-plan.toml"
            ])
        );
    }

    #[test]
    fn survivors_run_their_plan_with_their_own_emulation() {
        let lost = LostRanks {
            lost: vec![1],
            world_size: 3,
            survivors: vec![0, 2],
            checkpoint_iteration: Some(20),
            plan: "/s/survivors-plan.toml".into(),
            predicted_step_s: 1.0,
        };
        let args = strings(&[
            "train",
            "--pipeline-model-parallel-size",
            "1",
            "--hetero-pipeline-layer-split",
            "2",
            "2",
            "--lr",
            "1",
            "--micro-batch-size=2",
            "--emulate-device-speed",
            "0.5,0.25",
            "--emulate-device-speed=1",
            "--emulate-speed-change",
            "5:1:0.5",
            "--emulate-speed-change=6:2:0.5",
            "--use-tp-pp-dp-mapping",
            "--load",
            "/old",
        ]);
        let got = survivor_args(args, &lost, Path::new("/s"));
        assert_eq!(
            got,
            strings(&[
                "train",
                "--lr",
                "1",
                "--emulate-speed-change",
                "6:1:0.5",
                "--emulate-device-speed",
                "0.5,1",
                "--plan",
                "/s/survivors-plan.toml",
                "--load",
                "/s",
            ])
        );
    }
}
