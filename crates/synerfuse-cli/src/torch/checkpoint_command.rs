//! `synerfuse checkpoint inspect`: what a training checkpoint holds and whether its
//! files are intact.

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use std::collections::BTreeSet;
use std::path::PathBuf;
use synerfuse_train::checkpoint::Checkpoint;

/// The `checkpoint` subcommands.
#[derive(Subcommand)]
pub enum CheckpointCommand {
    /// List every tensor (shape, the ranks that wrote its pieces, bytes) and every file
    /// (bytes, SHA-256 verified); exits non-zero if a file is corrupt or missing
    Inspect(InspectArgs),
}

#[derive(Args)]
pub struct InspectArgs {
    /// An `iter_N` directory, or a `--save` directory (its latest checkpoint)
    dir: PathBuf,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
}

impl CheckpointCommand {
    pub fn run(self) -> Result<()> {
        match self {
            CheckpointCommand::Inspect(args) => inspect(args),
        }
    }
}

/// Ranks as runs: `0-3, 6`.
fn ranks_text(ranks: &BTreeSet<usize>) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == r => *end = r,
            _ => runs.push((r, r)),
        }
    }
    let text: Vec<String> = (runs.iter())
        .map(|&(a, b)| match a == b {
            true => a.to_string(),
            false => format!("{a}-{b}"),
        })
        .collect();
    text.join(", ")
}

fn inspect(args: InspectArgs) -> Result<()> {
    let checkpoint = Checkpoint::open_any(&args.dir)?;
    let manifest = checkpoint.manifest();
    let files: Vec<serde_json::Value> = (manifest.files.iter())
        .map(|(name, entry)| {
            let problem = checkpoint.verify(name).err().map(|e| e.to_string());
            json!({"file": name, "bytes": entry.bytes, "sha256": entry.sha256, "verified": problem.is_none(), "problem": problem})
        })
        .collect();
    let tensors: Vec<serde_json::Value> = (manifest.tensors.iter())
        .map(|(name, stored)| {
            let ranks: BTreeSet<usize> = stored.pieces.iter().map(|p| p.rank).collect();
            let bytes = 4 * stored.shape.iter().product::<i64>();
            json!({"name": name, "shape": stored.shape, "ranks": ranks, "pieces": stored.pieces.len(), "bytes": bytes})
        })
        .collect();
    let bad: Vec<&serde_json::Value> = files.iter().filter(|f| f["verified"] == false).collect();
    let state = &checkpoint.state;
    if args.json {
        let report = json!({
            "dir": checkpoint.dir.display().to_string(),
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "format": manifest.format,
            "files": files,
            "tensors": tensors,
        });
        println!("{report}");
    } else {
        let total: u64 = manifest.files.values().map(|e| e.bytes).sum();
        println!(
            "checkpoint {}: iteration {}, {} consumed samples, format {}, {} files ({total} B), {} tensors",
            checkpoint.dir.display(),
            state.iteration,
            state.consumed_samples,
            manifest.format,
            files.len(),
            tensors.len()
        );
        for f in &files {
            let verdict = match &f["problem"] {
                serde_json::Value::String(problem) => problem.clone(),
                _ => "SHA-256 verified".into(),
            };
            println!(
                "  {:<40} {:>12} B  {verdict}",
                f["file"].as_str().unwrap_or(""),
                f["bytes"]
            );
        }
        for (t, (_, stored)) in tensors.iter().zip(&manifest.tensors) {
            let ranks: BTreeSet<usize> = stored.pieces.iter().map(|p| p.rank).collect();
            let pieces = match stored.pieces.len() {
                1 => "1 piece".to_owned(),
                n => format!("{n} pieces"),
            };
            println!(
                "  {:<56} {:<14} {:>12} B  {pieces} from ranks {}",
                t["name"].as_str().unwrap_or(""),
                format!("{:?}", stored.shape),
                t["bytes"],
                ranks_text(&ranks),
            );
        }
    }
    if let Some(first) = bad.first() {
        bail!(
            "{} of {} files fail verification, first {}",
            bad.len(),
            files.len(),
            first["problem"].as_str().unwrap_or("")
        );
    }
    Ok(())
}
