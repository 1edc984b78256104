//! A checkpoint's files as the manifest records them (size and SHA-256), written under a
//! temporary name and renamed, and the errors that name them: what the checkpoint's
//! writers ([`super::shard`]) and readers share.

use crate::error::{CheckpointProblem, TrainError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// One file of a checkpoint in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Bytes.
    pub bytes: u64,
    /// SHA-256, hex.
    pub sha256: String,
}

/// The error of `path` for `problem`.
pub(crate) fn problem_at(path: &Path, problem: impl Into<CheckpointProblem>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// `path`'s error for an I/O failure, for `map_err`.
pub(crate) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| problem_at(path, e)
}

/// The size and SHA-256 of the file at `path`, as a manifest records them.
pub fn sha256_file(path: &Path) -> Result<ManifestEntry, TrainError> {
    let mut file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        hasher.update(&buf[..n]);
    }
    Ok(ManifestEntry {
        bytes,
        sha256: hex(hasher),
    })
}

/// A finished hash in lower-case hex, as manifests record it.
pub(crate) fn hex(hasher: Sha256) -> String {
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `text` to `path` under a temporary name, then renames it.
pub(crate) fn write_atomically(path: &Path, text: &str) -> Result<(), TrainError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}
