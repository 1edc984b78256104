//! Layout-independent checkpoints, written by every rank in parallel.
//!
//! ```text
//! SAVE/
//!   latest                                   the iteration of the newest complete checkpoint
//!   iter_0000100/
//!     model-rank00000.safetensors            each rank's pieces of the fp32 parameters
//!     optimizer-rank00000.safetensors        ... and of `{name}.exp_avg`, `{name}.exp_avg_sq`
//!     ...                                    (one pair per rank that holds unique state)
//!     state.json                             iteration, consumed samples, optimizer steps,
//!                                            seed and RNG, model config, the plan used
//!     manifest.json                          size and SHA-256 of every file above, and for
//!                                            every global tensor its shape and pieces:
//!                                            (rank, file, byte offset, TP slice, flat range)
//! ```
//!
//! Each rank writes what it holds and nothing more: its tensor-parallel slice of every
//! parameter (replica 0, for the replicated optimizer's state) and its distributed-
//! optimizer shard of the masters and moments, streamed through one bounded buffer
//! ([`shard::WRITE_CHUNK_ELEMENTS`]). Tensors are found by global name and element
//! range, not by file, so a checkpoint loads under any other plan: another pipeline
//! split, other tensor-parallel sizes or shares, other data-parallel sizes and shards;
//! a rank reads only the ranges it keeps ([`region`]). A checkpoint is written into
//! `iter_N.tmp`, each rank's files acknowledged by a manifest fragment, and renamed when
//! every rank's are in; `latest` is replaced last, so a run killed while saving leaves
//! the previous checkpoint in force. Checkpoints of format 1 (whole tensors, one file
//! pair per stage) still load: their tensors are pieces covering the whole.

mod files;
pub(crate) mod layout;
pub mod region;
pub mod shard;

use crate::error::TrainError;
use region::{CopyOp, Region};
use serde::{Deserialize, Serialize};
use shard::{Fragment, StoredPiece, StoredTensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use synerfuse_model::tch::{self, Tensor};
use synerfuse_model::{LlamaConfig, Stage};
use synerfuse_plan::Plan;

pub use crate::error::CheckpointProblem;
pub(crate) use files::{io_err, problem_at, write_atomically};
pub use files::{sha256_file, ManifestEntry};
pub use layout::{iteration_dir, staging_dir, FORMAT, LATEST};

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    /// Iterations completed.
    pub iteration: u64,
    /// Samples consumed (the data position).
    pub consumed_samples: u64,
    /// AdamW steps taken (bias correction).
    pub optimizer_steps: u64,
    /// `--seed` of the run.
    pub seed: u64,
    /// The libtorch generator seed the run re-seeds with when resuming (training itself
    /// draws no random numbers after initialisation: no dropout).
    pub rng_seed: u64,
    /// The model, as a Hugging Face `config.json`.
    pub model: serde_json::Value,
    /// The plan the checkpoint was written under (older checkpoints stored a grid plan,
    /// which reads as its general form).
    pub plan: Plan,
    /// Whether the run trained in bf16 (parameters are stored in fp32 either way).
    pub bf16: bool,
    /// What the run computed in (absent in checkpoints older than fp16 training).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<synerfuse_plan::Precision>,
    /// The loss scaler's state, where the run scaled its loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::loss_scale::ScalerState>,
    /// Samples of the iterations skipped for an overflow (the learning-rate schedule
    /// stands still over them).
    #[serde(default)]
    pub skipped_samples: u64,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub format: u32,
    /// Every file of the checkpoint directory but the manifest.
    pub files: BTreeMap<String, ManifestEntry>,
    /// Every global tensor: its whole shape and the pieces that cover it (format 2).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensors: BTreeMap<String, StoredTensor>,
}

/// Step 1 (one rank): an empty staging directory for iteration `iteration`.
pub fn prepare(save: &Path, iteration: u64) -> Result<PathBuf, TrainError> {
    let staging = staging_dir(save, iteration);
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(io_err(&staging))?;
    }
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    Ok(staging)
}

/// Step 2 (every rank): this rank's pieces of the parameters (`model`) and of the
/// optimizer state (`optimizer`) into its own files, then its manifest fragment, which
/// says they are complete. A rank without pieces writes only an empty fragment.
pub fn write_rank(
    staging: &Path,
    rank: usize,
    model: &[shard::PieceToWrite],
    optimizer: &[shard::PieceToWrite],
) -> Result<(), TrainError> {
    let mut fragment = Fragment {
        rank,
        ..Fragment::default()
    };
    for (prefix, pieces) in [("model", model), ("optimizer", optimizer)] {
        if !pieces.is_empty() {
            shard::write_pieces(
                staging,
                &shard::rank_file(prefix, rank),
                pieces,
                &mut fragment,
            )?;
        }
    }
    shard::write_fragment(staging, &fragment)?;
    Ok(())
}

/// Waits (polling, at most `timeout`) until every rank of `ranks` has written its
/// fragment into `staging`: how the rank that commits an asynchronous save knows the
/// others' background writes are complete, without a collective off the main thread.
pub fn wait_for_fragments(
    staging: &Path,
    ranks: usize,
    timeout: std::time::Duration,
) -> Result<(), TrainError> {
    let started = std::time::Instant::now();
    let mut next = 0;
    while next < ranks {
        if staging.join(shard::fragment_file(next)).exists() {
            next += 1;
            continue;
        }
        if staging.join(shard::failure_file(next)).exists() {
            let failed = CheckpointProblem::RankFailed { rank: next };
            return Err(problem_at(staging, failed));
        }
        if started.elapsed() > timeout {
            let missing = CheckpointProblem::MissingFragment { rank: next };
            return Err(problem_at(staging, missing));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// Step 3 (one rank, after every rank of `ranks` wrote its fragment): the fragments
/// merged into the manifest (every tensor's pieces checked to hold as many elements as
/// it has; the writers' pieces are disjoint by construction), the state
/// written, then the directory is renamed into place and `latest` is updated.
pub fn commit(save: &Path, state: &CheckpointState, ranks: usize) -> Result<PathBuf, TrainError> {
    let staging = staging_dir(save, state.iteration);
    let mut manifest = Manifest {
        format: FORMAT,
        files: BTreeMap::new(),
        tensors: BTreeMap::new(),
    };
    for rank in 0..ranks {
        let path = staging.join(shard::fragment_file(rank));
        if !path.exists() {
            return Err(problem_at(
                &staging,
                CheckpointProblem::MissingFragment { rank },
            ));
        }
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let fragment: Fragment = serde_json::from_str(&text).map_err(|e| problem_at(&path, e))?;
        manifest.files.extend(fragment.files);
        for (name, stored) in fragment.tensors {
            let merged = manifest.tensors.entry(name).or_default();
            merged.shape = stored.shape;
            merged.pieces.extend(stored.pieces);
        }
    }
    for (name, stored) in &manifest.tensors {
        let covered: i64 = stored.pieces.iter().map(|p| p.region.len()).sum();
        let wanted = stored.shape.iter().product::<i64>();
        if covered != wanted {
            let name = name.clone();
            let coverage = CheckpointProblem::Coverage {
                name,
                covered,
                wanted,
            };
            return Err(problem_at(&staging, coverage));
        }
    }
    let state_path = staging.join("state.json");
    write_atomically(
        &state_path,
        &serde_json::to_string_pretty(state).expect("state serialises"),
    )?;
    manifest
        .files
        .insert("state.json".into(), sha256_file(&state_path)?);
    write_atomically(
        &staging.join("manifest.json"),
        &serde_json::to_string(&manifest).expect("manifest serialises"),
    )?;
    for rank in 0..ranks {
        let path = staging.join(shard::fragment_file(rank));
        std::fs::remove_file(&path).map_err(io_err(&path))?;
    }
    let target = save.join(iteration_dir(state.iteration));
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(io_err(&target))?;
    }
    std::fs::rename(&staging, &target).map_err(io_err(&target))?;
    write_atomically(&save.join(LATEST), &format!("{}\n", state.iteration))?;
    Ok(target)
}

/// A checkpoint opened for loading. Files are verified against the manifest (size and
/// SHA-256) the first time one is read, and mapped, not read whole.
#[derive(Debug)]
pub struct Checkpoint {
    /// `iter_N` directory.
    pub dir: PathBuf,
    /// Its state.
    pub state: CheckpointState,
    manifest: Manifest,
    /// Files verified and mapped so far.
    mapped: Mutex<HashMap<String, Arc<memmap2::Mmap>>>,
}

impl Checkpoint {
    /// The newest checkpoint of `load` (as `latest` names it), or `None` when `load`
    /// has no `latest` file (Megatron starts from scratch then).
    pub fn open_latest(load: &Path) -> Result<Option<Checkpoint>, TrainError> {
        let latest = load.join(LATEST);
        if !latest.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&latest).map_err(io_err(&latest))?;
        let iteration: u64 = text
            .trim()
            .parse()
            .map_err(|_| problem_at(&latest, CheckpointProblem::BadLatest(text.trim().into())))?;
        Self::open(&load.join(iteration_dir(iteration))).map(Some)
    }

    /// The checkpoint in directory `dir`; the manifest and state must be readable.
    pub fn open(dir: &Path) -> Result<Checkpoint, TrainError> {
        let manifest_path = dir.join("manifest.json");
        let text = std::fs::read_to_string(&manifest_path).map_err(io_err(&manifest_path))?;
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| problem_at(&manifest_path, e))?;
        let state_path = dir.join("state.json");
        verify_file(&manifest, &state_path, "state.json")?;
        let text = std::fs::read_to_string(&state_path).map_err(io_err(&state_path))?;
        let state = serde_json::from_str(&text).map_err(|e| problem_at(&state_path, e))?;
        let mut checkpoint = Checkpoint {
            dir: dir.to_path_buf(),
            state,
            manifest,
            mapped: Mutex::new(HashMap::new()),
        };
        match checkpoint.manifest.format {
            1 => checkpoint.index_whole_tensors()?,
            FORMAT => checkpoint.check_pieces()?,
            other => {
                let format = CheckpointProblem::UnknownFormat(other);
                return Err(problem_at(&manifest_path, format));
            }
        }
        Ok(checkpoint)
    }

    /// The checkpoint at `path`: one `iter_N` directory (it has a `manifest.json`), or
    /// the latest of a `--save` directory.
    pub fn open_any(path: &Path) -> Result<Checkpoint, TrainError> {
        if path.join("manifest.json").exists() {
            return Self::open(path);
        }
        Self::open_latest(path)?.ok_or_else(|| problem_at(path, CheckpointProblem::NotACheckpoint))
    }

    /// The manifest: files, and every tensor's shape and pieces.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The names of the model's parameters it holds (the `model-` files' tensors).
    pub fn parameter_names(&self) -> Vec<String> {
        (self.manifest.tensors.iter())
            .filter(|(_, t)| t.pieces.iter().all(|p| p.file.starts_with("model-")))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The whole model of this checkpoint on `device`, whatever plan wrote it, filled
    /// one tensor at a time (the peak beyond the model is about one tensor).
    pub fn load_model(&self, device: tch::Device) -> Result<Stage, TrainError> {
        let config = self.model_config()?;
        let stage = Stage::new(&config, 0..config.num_layers, device)?;
        for (name, mut var) in stage.var_store().variables() {
            let shape = var.size();
            let value = self.read(&name, &shape, &Region::whole(&shape))?;
            let value = value.view(shape.as_slice()).to_kind(var.kind());
            tch::no_grad(|| var.copy_(&value.to_device(device)));
        }
        Ok(stage)
    }

    /// The model it was written for (its `state.json`'s Hugging Face config).
    pub fn model_config(&self) -> Result<LlamaConfig, TrainError> {
        let source = self.dir.join("state.json");
        LlamaConfig::from_hf_json(&self.state.model.to_string(), &source.display().to_string())
            .map_err(|e| problem_at(&source, e))
    }

    /// Refuses to resume it into `model` where the two route their experts otherwise
    /// (pre-softmax or renormalised top-k weights: the same tensors either way).
    pub fn check_routing(&self, model: &LlamaConfig) -> Result<(), TrainError> {
        let pre_softmax = |c: &LlamaConfig| c.moe.is_some_and(|m| m.router_pre_softmax);
        let stored = pre_softmax(&self.model_config()?);
        match stored == pre_softmax(model) {
            true => Ok(()),
            false => Err(problem_at(
                &self.dir.join("state.json"),
                CheckpointProblem::OtherRouting {
                    stored: if stored { "with" } else { "without" },
                },
            )),
        }
    }

    /// Every parameter of its model with its whole shape (what an export writes), each
    /// checked to be held with that shape before anything is read.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<i64>)>, TrainError> {
        let expected = self.model_config()?.parameter_shapes();
        for (name, shape) in &expected {
            let stored = self.stored(name)?;
            if &stored.shape != shape {
                let problem = CheckpointProblem::Shape {
                    name: name.clone(),
                    found: stored.shape.clone(),
                    expected: shape.clone(),
                };
                return Err(problem_at(&self.dir, problem));
            }
        }
        Ok(expected)
    }

    /// The whole tensor `name` as stored (fp32, on the CPU).
    pub fn tensor(&self, name: &str) -> Result<Tensor, TrainError> {
        let shape = self.stored(name)?.shape.clone();
        Ok(self
            .read(name, &shape, &Region::whole(&shape))?
            .view(shape.as_slice()))
    }

    /// Every file verified against the manifest (what `synerfuse checkpoint inspect`
    /// reports); the first bad file is the error.
    pub fn verify_all(&self) -> Result<(), TrainError> {
        for file in self.manifest.files.keys() {
            self.verify(file)?;
        }
        Ok(())
    }

    /// Checks file `file` of the manifest (size and SHA-256); loads check each file they
    /// read this way, once.
    pub fn verify(&self, file: &str) -> Result<(), TrainError> {
        self.mapped(file).map(drop)
    }

    fn stored(&self, name: &str) -> Result<&StoredTensor, TrainError> {
        self.manifest.tensors.get(name).ok_or_else(|| {
            let prefix = match name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq") {
                true => "optimizer-",
                false => "model-",
            };
            let missing = CheckpointProblem::MissingTensor {
                prefix: prefix.to_owned(),
                name: name.to_owned(),
            };
            problem_at(&self.dir, missing)
        })
    }

    /// The elements `region` of tensor `name`, whose whole shape must be `shape`, read
    /// from the pieces that hold them (only the rows they share), as flat fp32 on the CPU.
    pub fn read(&self, name: &str, shape: &[i64], region: &Region) -> Result<Tensor, TrainError> {
        let stored = self.stored(name)?;
        if stored.shape != shape {
            let problem = CheckpointProblem::Shape {
                name: name.to_owned(),
                found: stored.shape.clone(),
                expected: shape.to_vec(),
            };
            return Err(problem_at(&self.dir, problem));
        }
        let mut target = vec![0f32; region.len().max(0) as usize];
        let mut covered = 0;
        for piece in &stored.pieces {
            let ops = piece.region.copies_into(region, shape);
            if ops.is_empty() {
                continue;
            }
            let map = self.mapped(&piece.file)?;
            for op in &ops {
                self.read_rows(&map, piece, name, op, &mut target)?;
                covered += op.len();
            }
        }
        check_coverage(name, covered, region.len(), &self.dir)?;
        Ok(Tensor::from_slice(&target))
    }

    /// `op`'s rows of `piece` from the mapped file into `target` (the wanted region's
    /// elements): only the bytes of those rows are read.
    fn read_rows(
        &self,
        map: &memmap2::Mmap,
        piece: &StoredPiece,
        name: &str,
        op: &CopyOp,
        target: &mut [f32],
    ) -> Result<(), TrainError> {
        let size = match piece.dtype.as_str() {
            "F32" => 4,
            "BF16" | "F16" => 2,
            _ => 0,
        };
        let bad = |why: String| {
            let bad = CheckpointProblem::BadPiece {
                name: name.to_owned(),
                file: piece.file.clone(),
                why,
            };
            problem_at(&self.dir, bad)
        };
        if size == 0 {
            return Err(bad(format!("dtype {}", piece.dtype)));
        }
        let cols = op.cols as usize;
        for r in 0..op.rows {
            let element = (op.source.0 + r * op.source.1) as usize;
            let at = (piece.offset as usize).checked_add(size * element);
            let span = at.and_then(|at| Some(at..at.checked_add(size * cols)?));
            let bytes = (span.and_then(|span| map.get(span))).ok_or_else(|| {
                bad(format!(
                    "offset {} past the end ({})",
                    piece.offset,
                    map.len()
                ))
            })?;
            let start = (op.target.0 + r * op.target.1) as usize;
            decode(&piece.dtype, bytes, &mut target[start..start + cols]);
        }
        Ok(())
    }

    /// `file` mapped, verified against the manifest the first time.
    fn mapped(&self, file: &str) -> Result<Arc<memmap2::Mmap>, TrainError> {
        if let Some(map) = self.mapped.lock().expect("not poisoned").get(file) {
            return Ok(map.clone());
        }
        let path = self.dir.join(file);
        verify_file(&self.manifest, &path, file)?;
        let handle = std::fs::File::open(&path).map_err(io_err(&path))?;
        // SAFETY: a committed checkpoint is not written again; it was just verified.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&handle) }.map_err(io_err(&path))?);
        let mut mapped = self.mapped.lock().expect("not poisoned");
        mapped.insert(file.to_owned(), map.clone());
        Ok(map)
    }

    /// Format 1: every tensor of the `model-` and `optimizer-` files is one piece of the
    /// whole, found from the files' headers.
    fn index_whole_tensors(&mut self) -> Result<(), TrainError> {
        let files: Vec<String> = (self.manifest.files.keys())
            .filter(|f| f.starts_with("model-") || f.starts_with("optimizer-"))
            .cloned()
            .collect();
        for file in files {
            let path = self.dir.join(&file);
            let handle = std::fs::File::open(&path).map_err(io_err(&path))?;
            // SAFETY: read-only input; only the header is parsed here.
            let map = unsafe { memmap2::Mmap::map(&handle) }.map_err(io_err(&path))?;
            let (header, metadata) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| problem_at(&path, CheckpointProblem::Header(format!("{e:?}"))))?;
            for (name, info) in metadata.tensors() {
                let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
                let piece = StoredPiece {
                    file: file.clone(),
                    rank: 0,
                    offset: (8 + header + info.data_offsets.0) as u64,
                    dtype: format!("{:?}", info.dtype),
                    region: Region::whole(&shape),
                };
                let stored = self.manifest.tensors.entry(name).or_default();
                stored.shape = shape;
                stored.pieces.push(piece);
            }
        }
        Ok(())
    }

    /// Format 2: every piece fits its tensor and names a listed file.
    fn check_pieces(&self) -> Result<(), TrainError> {
        for (name, stored) in &self.manifest.tensors {
            for piece in &stored.pieces {
                let numel = (stored.shape.iter()).try_fold(1i64, |n, &d| match d >= 0 {
                    true => n.checked_mul(d).filter(|&n| n <= i64::MAX / 8),
                    false => None,
                });
                let why = match () {
                    _ if numel.is_none() => "a negative or too large shape",
                    _ if !self.manifest.files.contains_key(&piece.file) => "file not listed",
                    _ if !piece.region.fits(&stored.shape) => "region outside the tensor",
                    _ => continue,
                };
                let bad = CheckpointProblem::BadPiece {
                    name: name.clone(),
                    file: piece.file.clone(),
                    why: why.to_owned(),
                };
                return Err(problem_at(&self.dir.join("manifest.json"), bad));
            }
        }
        Ok(())
    }
}

/// Checks `path`'s size and SHA-256 against `manifest`'s entry for `file`.
fn verify_file(manifest: &Manifest, path: &Path, file: &str) -> Result<(), TrainError> {
    let want =
        (manifest.files.get(file)).ok_or_else(|| problem_at(path, CheckpointProblem::Unlisted))?;
    let got = sha256_file(path)?;
    if &got != want {
        let corrupt = CheckpointProblem::Corrupt {
            found_bytes: got.bytes,
            found_sha256: got.sha256,
            bytes: want.bytes,
            sha256: want.sha256.clone(),
        };
        return Err(problem_at(path, corrupt));
    }
    Ok(())
}

/// Little-endian `F32`, `BF16` or `F16` values as fp32.
fn decode(dtype: &str, bytes: &[u8], to: &mut [f32]) {
    match dtype {
        "F32" => {
            for (t, b) in to.iter_mut().zip(bytes.chunks_exact(4)) {
                *t = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        "BF16" => {
            for (t, b) in to.iter_mut().zip(bytes.chunks_exact(2)) {
                *t = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        _ => {
            for (t, b) in to.iter_mut().zip(bytes.chunks_exact(2)) {
                *t = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
    }
}

/// IEEE half precision to single (subnormals, infinities and NaN included).
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((h >> 10) & 0x1f);
    let mantissa = f32::from(h & 0x3ff);
    sign * match exponent {
        0 => mantissa * 2f32.powi(-24),
        31 if mantissa == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        e => (1.0 + mantissa / 1024.0) * 2f32.powi(e - 15),
    }
}

/// Refuses a read whose pieces did not cover the elements wanted exactly.
pub(crate) fn check_coverage(
    name: &str,
    covered: i64,
    wanted: i64,
    origin: &Path,
) -> Result<(), TrainError> {
    if covered == wanted {
        return Ok(());
    }
    let coverage = CheckpointProblem::Coverage {
        name: name.to_owned(),
        covered,
        wanted,
    };
    Err(problem_at(origin, coverage))
}

/// The elements `region` of whole tensors, and the run's state: what a rank restores
/// from (a checkpoint on disk, or the state moved between ranks when a run switches
/// plans).
pub trait StateSource {
    /// The elements `region` of the global tensor `name` (parameters by their names,
    /// moments as `NAME.exp_avg` and `NAME.exp_avg_sq`), whose whole shape must be
    /// `shape`, flat fp32 on the CPU; a missing name or element is an error naming it.
    fn read(&self, name: &str, shape: &[i64], region: &Region) -> Result<Tensor, TrainError>;
    /// The run's state.
    fn state(&self) -> &CheckpointState;
    /// Where problems are reported.
    fn origin(&self) -> &Path;
}

impl StateSource for Checkpoint {
    fn read(&self, name: &str, shape: &[i64], region: &Region) -> Result<Tensor, TrainError> {
        Checkpoint::read(self, name, shape, region)
    }

    fn state(&self) -> &CheckpointState {
        &self.state
    }

    fn origin(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_dtypes_decode_to_fp32() {
        let mut out = [0f32; 4];
        decode(
            "F16",
            &[0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00, 0x00, 0x7c],
            &mut out,
        );
        assert_eq!(out, [1.0, -2.0, 2f32.powi(-24), f32::INFINITY]);
        decode("BF16", &[0x80, 0x3f, 0x40, 0xc0], &mut out[..2]);
        assert_eq!(out[..2], [1.0, -3.0]);
        decode("F32", &1.5f32.to_le_bytes(), &mut out[..1]);
        assert_eq!(out[0], 1.5);
    }
}
