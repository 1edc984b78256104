//! `synerfuse train --nproc N`: the job under `mpirun` on this machine, restarted on the
//! survivors when ranks are lost. Under `--save`, `mpirun` leaves the other ranks
//! running when one dies; they end with `synerfuse_train::lost`'s exit code after the
//! lowest of them wrote which ranks were lost and a plan for the survivors; the job
//! then starts again on the survivors, from the last checkpoint, with that plan.

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::time::SystemTime;
use synerfuse_train::comm::{launch_under_mpirun, without_flag, Survival};
use synerfuse_train::lost::{LostRanks, LOST_RANKS_FILE};

/// The flags that set a layout: a restart replaces them with the survivors' plan.
const LAYOUT_FLAGS: [&str; 15] = [
    "--plan",
    "--load",
    "--tensor-model-parallel-size",
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
    loop {
        let launched = SystemTime::now();
        let hidden: &[&str] = if launches > 0 { &[FAULT_INJECT] } else { &[] };
        let status = launch_under_mpirun(ranks, &args, survival, hidden)
            .context("could not start mpirun (install OpenMPI: `cargo xtask setup`)")?;
        launches += 1;
        let lost = save.and_then(|save| written_since(save, launched));
        let Some(lost) = lost else {
            if status.success() {
                return Ok(());
            }
            bail!("the {ranks}-rank job failed ({status}); see the ranks' messages above");
        };
        let save = save.expect("a lost-rank record lies under --save");
        if lost.survivors.is_empty() || lost.world_size != ranks {
            bail!(
                "the {ranks}-rank job lost ranks {:?} and left no survivors to restart on ({})",
                lost.lost,
                save.join(LOST_RANKS_FILE).display()
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

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
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
/// plan and `--load` of `save`; the emulation flags of lost ranks dropped and the
/// others' ranks renumbered.
pub fn survivor_args(args: Vec<String>, lost: &LostRanks, save: &Path) -> Vec<String> {
    let mut args = LAYOUT_FLAGS
        .iter()
        .fold(args, |args, flag| without_values(args, flag));
    let new_rank = |old: usize| lost.survivors.iter().position(|&r| r == old);
    args = map_values(args, "--emulate-device-speed", |speeds| {
        let speeds: Vec<&str> = speeds.split(',').collect();
        let kept: Vec<&str> = (lost.survivors.iter())
            .filter_map(|&r| speeds.get(r).copied())
            .collect();
        Some(kept.join(","))
    });
    args = map_values(args, "--emulate-speed-change", |change| {
        let [iteration, rank, speed] = change.split(':').collect::<Vec<_>>()[..] else {
            return Some(change.to_owned());
        };
        let rank = new_rank(rank.parse().ok()?)?;
        Some(format!("{iteration}:{rank}:{speed}"))
    });
    args.extend([
        "--plan".to_owned(),
        lost.plan.display().to_string(),
        "--load".to_owned(),
        save.display().to_string(),
    ]);
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
fn map_values(args: Vec<String>, flag: &str, f: impl Fn(&str) -> Option<String>) -> Vec<String> {
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
        if let Some(mapped) = value.as_deref().and_then(&f) {
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
            "0.5,0.25,1",
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
                "--emulate-device-speed",
                "0.5,1",
                "--emulate-speed-change",
                "6:1:0.5",
                "--plan",
                "/s/survivors-plan.toml",
                "--load",
                "/s",
            ])
        );
    }
}
