//! The names in a `--save` directory (`latest`, `iter_N`, each rank's files) and the
//! format version: what the writers, the readers and a lost rank's survivors
//! ([`crate::lost`]) share, with nothing of the crate beneath them.

use std::path::{Path, PathBuf};

/// The name of the file that points at the newest checkpoint.
pub const LATEST: &str = "latest";

/// The format this version writes (1: whole tensors per stage, without `tensors`).
pub const FORMAT: u32 = 2;

/// The directory name of iteration `iteration`'s checkpoint (Megatron's spelling).
pub fn iteration_dir(iteration: u64) -> String {
    format!("iter_{iteration:07}")
}

/// The temporary directory a checkpoint is assembled in.
pub fn staging_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("{}.tmp", iteration_dir(iteration)))
}

/// The file name of `rank`'s `prefix` file (`model` or `optimizer`).
pub fn rank_file(prefix: &str, rank: usize) -> String {
    format!("{prefix}-rank{rank:05}.safetensors")
}

/// The file name of `rank`'s manifest fragment.
pub fn fragment_file(rank: usize) -> String {
    format!("fragment-rank{rank:05}.json")
}

/// The file a rank whose background write failed leaves, so the committing rank stops
/// waiting for its fragment.
pub fn failure_file(rank: usize) -> String {
    format!("failed-rank{rank:05}")
}
