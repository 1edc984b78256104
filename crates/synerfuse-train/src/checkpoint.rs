//! Layout-independent checkpoints.
//!
//! ```text
//! SAVE/
//!   latest                                   the iteration of the newest complete checkpoint
//!   iter_0000100/
//!     model-00001-of-00002.safetensors       fp32 parameters by global name (one file per stage)
//!     optimizer-00001-of-00002.safetensors   `{name}.exp_avg`, `{name}.exp_avg_sq`
//!     state.json                             iteration, consumed samples, optimizer steps,
//!                                            seed and RNG, model config, the plan used
//!     manifest.json                          size and SHA-256 of every file above
//! ```
//!
//! Tensors are found by name, not by file, so a checkpoint loads under any other plan:
//! another pipeline split, other data-parallel sizes and batches. A checkpoint is
//! written into `iter_N.tmp` and renamed when complete; `latest` is replaced last, so a
//! run killed while saving leaves the previous checkpoint in force.

use crate::TrainError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use synerfuse_model::tch::{self, Tensor};
use synerfuse_model::{LlamaConfig, Stage};
use synerfuse_parallel::Plan;

/// The name of the file that points at the newest checkpoint.
pub const LATEST: &str = "latest";

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
}

/// One file of a checkpoint in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Bytes.
    pub bytes: u64,
    /// SHA-256, hex.
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub format: u32,
    /// Every file of the checkpoint directory but the manifest.
    pub files: BTreeMap<String, ManifestEntry>,
}

/// The directory name of iteration `iteration`'s checkpoint (Megatron's spelling).
pub fn iteration_dir(iteration: u64) -> String {
    format!("iter_{iteration:07}")
}

/// What is wrong with a checkpoint file or directory.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointProblem {
    /// It cannot be read or written.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// `latest` holds no iteration number.
    #[error("expected an iteration number, found {0:?}")]
    BadLatest(String),
    /// A JSON file of another shape.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// Neither a `latest` file nor a manifest.
    #[error("no `latest` file and no manifest.json: not a synerfuse checkpoint")]
    NotACheckpoint,
    /// The model configuration stored with the checkpoint.
    #[error(transparent)]
    Config(#[from] synerfuse_model::ConfigError),
    /// Optimizer state that does not fit the model.
    #[error(transparent)]
    OptimState(#[from] crate::optim::OptimStateError),
    /// A tensor of another shape than the model's.
    #[error("tensor {name} has shape {found:?}, the model expects {expected:?}")]
    Shape {
        /// The parameter.
        name: String,
        /// Its shape in the checkpoint.
        found: Vec<i64>,
        /// The model's.
        expected: Vec<i64>,
    },
    /// A tensor no file of the kind holds.
    #[error("no {prefix}* file holds tensor {name:?}")]
    MissingTensor {
        /// `model-` or `optimizer-`.
        prefix: String,
        /// The tensor.
        name: String,
    },
    /// A file the manifest does not list.
    #[error("not listed in manifest.json")]
    Unlisted,
    /// A file whose size or hash differs from the manifest's.
    #[error("corrupt: {found_bytes} bytes with SHA-256 {found_sha256}, the manifest records {bytes} bytes with {sha256}")]
    Corrupt {
        /// Bytes found.
        found_bytes: u64,
        /// SHA-256 found.
        found_sha256: String,
        /// Bytes recorded.
        bytes: u64,
        /// SHA-256 recorded.
        sha256: String,
    },
}

/// The error of `path` for `problem`.
pub(crate) fn problem_at(path: &Path, problem: impl Into<CheckpointProblem>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| problem_at(path, e)
}

fn sha256_file(path: &Path) -> Result<ManifestEntry, TrainError> {
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
    let sha256 = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(ManifestEntry { bytes, sha256 })
}

/// Writes `text` to `path` under a temporary name, then renames it.
fn write_atomically(path: &Path, text: &str) -> Result<(), TrainError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// The temporary directory a checkpoint is assembled in.
pub fn staging_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("{}.tmp", iteration_dir(iteration)))
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

/// Step 2 (each writing rank): this stage's parameters and optimizer moments.
pub fn write_shard(
    staging: &Path,
    stage: usize,
    stages: usize,
    params: &[(String, Tensor)],
    moments: &[(String, Tensor)],
) -> Result<(), TrainError> {
    let model = staging.join(format!("model-{:05}-of-{stages:05}.safetensors", stage + 1));
    let optim = staging.join(format!(
        "optimizer-{:05}-of-{stages:05}.safetensors",
        stage + 1
    ));
    synerfuse_model::hf::write_safetensors(&model, params)?;
    synerfuse_model::hf::write_safetensors(&optim, moments)?;
    Ok(())
}

/// Step 3 (one rank, after every shard is written): state and manifest, then the
/// directory is renamed into place and `latest` is updated.
pub fn commit(save: &Path, state: &CheckpointState) -> Result<PathBuf, TrainError> {
    let staging = staging_dir(save, state.iteration);
    let state_path = staging.join("state.json");
    write_atomically(
        &state_path,
        &serde_json::to_string_pretty(state).expect("state serialises"),
    )?;
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(&staging).map_err(io_err(&staging))? {
        let entry = entry.map_err(io_err(&staging))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "manifest.json" || name.ends_with(".tmp") {
            continue;
        }
        files.insert(name, sha256_file(&entry.path())?);
    }
    let manifest = Manifest { format: 1, files };
    write_atomically(
        &staging.join("manifest.json"),
        &serde_json::to_string_pretty(&manifest).expect("manifest serialises"),
    )?;
    let target = save.join(iteration_dir(state.iteration));
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(io_err(&target))?;
    }
    std::fs::rename(&staging, &target).map_err(io_err(&target))?;
    write_atomically(&save.join(LATEST), &format!("{}\n", state.iteration))?;
    Ok(target)
}

/// A checkpoint opened for loading, its files verified against the manifest.
#[derive(Debug)]
pub struct Checkpoint {
    /// `iter_N` directory.
    pub dir: PathBuf,
    /// Its state.
    pub state: CheckpointState,
    manifest: Manifest,
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
        let state_path = verified(dir, &manifest, "state.json")?;
        let text = std::fs::read_to_string(&state_path).map_err(io_err(&state_path))?;
        let state = serde_json::from_str(&text).map_err(|e| problem_at(&state_path, e))?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            state,
            manifest,
        })
    }

    /// The checkpoint at `path`: one `iter_N` directory (it has a `manifest.json`), or
    /// the latest of a `--save` directory.
    pub fn open_any(path: &Path) -> Result<Checkpoint, TrainError> {
        if path.join("manifest.json").exists() {
            return Self::open(path);
        }
        Self::open_latest(path)?.ok_or_else(|| problem_at(path, CheckpointProblem::NotACheckpoint))
    }

    /// The whole model of this checkpoint on `device`, whatever plan wrote it
    /// (parameters are stored by global name).
    pub fn load_model(&self, device: tch::Device) -> Result<Stage, TrainError> {
        let source = self.dir.join("state.json");
        let config =
            LlamaConfig::from_hf_json(&self.state.model.to_string(), &source.display().to_string())
                .map_err(|e| problem_at(&source, e))?;
        let stage = Stage::new(&config, 0..config.num_layers, device)?;
        let variables = stage.var_store().variables();
        let names: Vec<String> = variables.keys().cloned().collect();
        let values = self.tensors("model-", &names)?;
        for (name, mut var) in variables {
            let value = &values[&name];
            if value.size() != var.size() {
                let shape = CheckpointProblem::Shape {
                    name,
                    found: value.size(),
                    expected: var.size(),
                };
                return Err(problem_at(&self.dir, shape));
            }
            tch::no_grad(|| var.copy_(&value.to_kind(var.kind()).to_device(device)));
        }
        Ok(stage)
    }

    /// The tensors named in `names` from the files whose names start with `prefix`
    /// (`model-` or `optimizer-`), every file read verified first. Missing names are
    /// an error naming the first.
    pub fn tensors(
        &self,
        prefix: &str,
        names: &[String],
    ) -> Result<HashMap<String, Tensor>, TrainError> {
        let wanted: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
        let mut found = HashMap::new();
        for file in self.manifest.files.keys().filter(|f| f.starts_with(prefix)) {
            let path = verified(&self.dir, &self.manifest, file)?;
            for (name, tensor) in
                synerfuse_model::hf::read_safetensors(&path, |n| wanted.contains(n))?
            {
                found.insert(name, tensor);
            }
        }
        if let Some(missing) = names.iter().find(|n| !found.contains_key(*n)) {
            let missing = CheckpointProblem::MissingTensor {
                prefix: prefix.to_owned(),
                name: missing.clone(),
            };
            return Err(problem_at(&self.dir, missing));
        }
        Ok(found)
    }
}

/// Whole tensors by global name and the run's state: what a rank restores from (a
/// checkpoint on disk, or the state moved between ranks when a run switches plans).
pub trait StateSource {
    /// The tensors named in `names` of the `model-` or `optimizer-` part; a missing
    /// name is an error naming it.
    fn tensors(
        &self,
        prefix: &str,
        names: &[String],
    ) -> Result<HashMap<String, Tensor>, TrainError>;
    /// The run's state.
    fn state(&self) -> &CheckpointState;
    /// Where problems are reported.
    fn origin(&self) -> &Path;
}

impl StateSource for Checkpoint {
    fn tensors(
        &self,
        prefix: &str,
        names: &[String],
    ) -> Result<HashMap<String, Tensor>, TrainError> {
        Checkpoint::tensors(self, prefix, names)
    }

    fn state(&self) -> &CheckpointState {
        &self.state
    }

    fn origin(&self) -> &Path {
        &self.dir
    }
}

/// The path of `name` in `dir`, after checking its size and SHA-256 against `manifest`.
fn verified(dir: &Path, manifest: &Manifest, name: &str) -> Result<PathBuf, TrainError> {
    let path = dir.join(name);
    let want = manifest
        .files
        .get(name)
        .ok_or_else(|| problem_at(&path, CheckpointProblem::Unlisted))?;
    let got = sha256_file(&path)?;
    if &got != want {
        let corrupt = CheckpointProblem::Corrupt {
            found_bytes: got.bytes,
            found_sha256: got.sha256,
            bytes: want.bytes,
            sha256: want.sha256.clone(),
        };
        return Err(problem_at(&path, corrupt));
    }
    Ok(path)
}
