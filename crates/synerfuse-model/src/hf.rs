//! Hugging Face checkpoints: `config.json` plus `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), with transformers' tensor names. Each stage reads only
//! its own tensors from the memory-mapped files; saving writes the same layout.

use crate::config::{ConfigError, LlamaConfig};
use crate::error::StageError;
use crate::llama::Stage;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// A checkpoint that cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `config.json` is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The stage does not fit the model.
    #[error(transparent)]
    Stage(#[from] StageError),
    /// A tensor is missing, malformed, or of the wrong shape.
    #[error("{path}: {problem}")]
    Tensor {
        /// The file (or directory).
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Which file holds each tensor of the checkpoint in `dir`.
fn weight_map(dir: &Path) -> Result<HashMap<String, PathBuf>, HfError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        let map = mmap(&single)?;
        let st = SafeTensors::deserialize(&map).map_err(|e| HfError::Tensor {
            path: single.clone(),
            problem: e.to_string(),
        })?;
        return Ok(st
            .names()
            .into_iter()
            .map(|n| (n.clone(), single.clone()))
            .collect());
    }
    let index_path = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index_path).map_err(|source| HfError::Io {
        path: index_path.clone(),
        source: std::io::Error::new(
            source.kind(),
            format!("{source} (neither model.safetensors nor model.safetensors.index.json)"),
        ),
    })?;
    let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| HfError::Tensor {
        path: index_path.clone(),
        problem: e.to_string(),
    })?;
    let map = index["weight_map"]
        .as_object()
        .ok_or_else(|| HfError::Tensor {
            path: index_path.clone(),
            problem: "no weight_map object".into(),
        })?;
    map.iter()
        .map(|(name, file)| {
            let file = file.as_str().ok_or_else(|| HfError::Tensor {
                path: index_path.clone(),
                problem: format!("weight_map[{name:?}] is not a file name"),
            })?;
            Ok((name.clone(), dir.join(file)))
        })
        .collect()
}

fn mmap(path: &Path) -> Result<memmap2::Mmap, HfError> {
    let file = std::fs::File::open(path).map_err(io(path))?;
    // SAFETY: checkpoints are read-only inputs; nothing in this process writes them.
    unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        _ => return None,
    })
}

/// Builds the stage holding global layers `layers` of the checkpoint in `dir` on `device`,
/// reading only its tensors.
pub fn load_stage(dir: &Path, layers: Range<usize>, device: Device) -> Result<Stage, HfError> {
    let config = LlamaConfig::from_hf_file(&dir.join("config.json"))?;
    let mut stage = Stage::new(&config, layers, device)?;
    load_weights(&mut stage, dir)?;
    Ok(stage)
}

/// Overwrites the stage's parameters with the checkpoint's tensors of the same names
/// (the embedding stands in for a tied `lm_head`); a tensor-parallel shard takes its
/// slice of each.
pub fn load_weights(stage: &mut Stage, dir: &Path) -> Result<(), HfError> {
    let files = weight_map(dir)?;
    let mut by_file: BTreeMap<PathBuf, Vec<(String, Tensor)>> = BTreeMap::new();
    for (name, var) in stage.var_store().variables() {
        let file = files.get(&name).ok_or_else(|| HfError::Tensor {
            path: dir.to_path_buf(),
            problem: format!("the checkpoint has no tensor {name:?}"),
        })?;
        by_file.entry(file.clone()).or_default().push((name, var));
    }
    for (file, vars) in by_file {
        let map = mmap(&file)?;
        let st = SafeTensors::deserialize(&map).map_err(|e| HfError::Tensor {
            path: file.clone(),
            problem: e.to_string(),
        })?;
        for (name, mut var) in vars {
            let view = st.tensor(&name).map_err(|e| HfError::Tensor {
                path: file.clone(),
                problem: format!("{name}: {e}"),
            })?;
            let kind = kind_of(view.dtype()).ok_or_else(|| HfError::Tensor {
                path: file.clone(),
                problem: format!("{name}: dtype {:?} is not a float type", view.dtype()),
            })?;
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let expected = stage.whole_shape(&name, &var.size());
            if shape != expected {
                return Err(HfError::Tensor {
                    path: file.clone(),
                    problem: format!("{name}: shape {shape:?}, the model expects {expected:?}"),
                });
            }
            // A tensor-parallel shard takes its slice of the whole tensor.
            let value =
                stage.local_slice(&name, &Tensor::from_data_size(view.data(), &shape, kind));
            tch::no_grad(|| var.copy_(&value.to_kind(var.kind())));
        }
    }
    Ok(())
}

/// Reads the tensors of one safetensors file whose names `wanted` accepts (mapped, so
/// only those tensors' bytes are touched), as CPU tensors of their stored dtype.
pub fn read_safetensors(
    path: &Path,
    wanted: impl Fn(&str) -> bool,
) -> Result<Vec<(String, Tensor)>, HfError> {
    let map = mmap(path)?;
    let st = SafeTensors::deserialize(&map).map_err(|e| HfError::Tensor {
        path: path.to_path_buf(),
        problem: e.to_string(),
    })?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        if !wanted(&name) {
            continue;
        }
        let kind = kind_of(view.dtype()).ok_or_else(|| HfError::Tensor {
            path: path.to_path_buf(),
            problem: format!("{name}: dtype {:?} is not a float type", view.dtype()),
        })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        out.push((name, Tensor::from_data_size(view.data(), &shape, kind)));
    }
    Ok(out)
}

/// Little-endian bytes of a tensor (moved to the CPU).
fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let numel = t.numel();
    let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut bytes, numel);
    bytes
}

/// Writes `tensors` as one safetensors file (with transformers' `format: pt` metadata),
/// under a temporary name then renamed.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), HfError> {
    let entries: Vec<Entry> = (tensors.iter())
        .map(|(name, t)| (name.clone(), t.kind(), t.size()))
        .collect();
    let values: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_streamed(path, &entries, &mut |name| {
        Ok::<_, HfError>(values[name].shallow_clone())
    })
}

/// Saves the model held by `stages` (together covering every layer, in any layout) as a
/// Hugging Face checkpoint in `dir`: `config.json` and one `model.safetensors`, or one
/// shard per stage plus `model.safetensors.index.json` when there are several stages.
pub fn save_pretrained(stages: &[&Stage], dir: &Path) -> Result<(), HfError> {
    let Some(first) = stages.first() else {
        return Err(HfError::Tensor {
            path: dir.to_path_buf(),
            problem: "no stage to save".into(),
        });
    };
    let config = first.config();
    config.check_hf_exportable()?;
    let mut covered = vec![false; config.num_layers];
    for stage in stages {
        for layer in stage.layers() {
            covered[layer] = true;
        }
    }
    if let Some(missing) = covered.iter().position(|c| !c) {
        return Err(HfError::Tensor {
            path: dir.to_path_buf(),
            problem: format!("no stage holds layer {missing}; a checkpoint needs every layer"),
        });
    }
    let mut seen = std::collections::HashSet::new();
    let mut values = HashMap::new();
    let shards: Vec<Vec<Entry>> = stages
        .iter()
        .map(|stage| {
            let mut vars: Vec<Entry> = Vec::new();
            for (name, t) in stage.var_store().variables() {
                if seen.insert(name.clone()) {
                    vars.push((name.clone(), t.kind(), t.size()));
                    values.insert(name, t);
                }
            }
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            vars
        })
        .collect();
    let mut fetch = |name: &str| Ok::<_, HfError>(values[name].detach());
    write_pretrained(dir, &config.to_hf_json(), &shards, &mut fetch)
}

/// A tensor to write: its name, dtype and shape (its data is fetched when written).
type Entry = (String, Kind, Vec<i64>);

/// `config.json` and the safetensors of `shards` in `dir`: one `model.safetensors`, or
/// `model-0000i-of-0000n.safetensors` files and `model.safetensors.index.json`;
/// `config.json` last. Each tensor is fetched when its turn comes and dropped once
/// written, so the peak is about one tensor beyond what `fetch` itself holds.
fn write_pretrained<E: From<HfError>>(
    dir: &Path,
    config_json: &str,
    shards: &[Vec<Entry>],
    fetch: &mut dyn FnMut(&str) -> Result<Tensor, E>,
) -> Result<(), E> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let config_tmp = dir.join("config.json.tmp");
    std::fs::write(&config_tmp, config_json).map_err(io(&config_tmp))?;
    if shards.len() == 1 {
        write_streamed(&dir.join("model.safetensors"), &shards[0], fetch)?;
    } else {
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        let mut total = 0usize;
        for (i, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            for (tensor, kind, shape) in shard {
                weight_map.insert(tensor.clone(), serde_json::Value::String(name.clone()));
                total += entry_bytes(*kind, shape);
            }
            write_streamed(&dir.join(&name), shard, fetch)?;
        }
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = dir.join("model.safetensors.index.json");
        std::fs::write(&path, serde_json::to_string_pretty(&index).expect("json"))
            .map_err(io(&path))?;
    }
    let config_path = dir.join("config.json");
    std::fs::rename(&config_tmp, &config_path).map_err(io(&config_path))?;
    Ok(())
}

fn entry_bytes(kind: Kind, shape: &[i64]) -> usize {
    shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes()
}

/// One safetensors file of `entries` (with transformers' `format: pt` metadata): the
/// header from their shapes, then each tensor fetched, converted and written in turn;
/// under a temporary name, then renamed.
fn write_streamed<E: From<HfError>>(
    path: &Path,
    entries: &[Entry],
    fetch: &mut dyn FnMut(&str) -> Result<Tensor, E>,
) -> Result<(), E> {
    use std::io::Write;
    let bad = |problem: String| HfError::Tensor {
        path: path.to_path_buf(),
        problem,
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0usize;
    for (name, kind, shape) in entries {
        let dtype =
            dtype_of(*kind).ok_or_else(|| bad(format!("{name}: {kind:?} cannot be saved")))?;
        let bytes = entry_bytes(*kind, shape);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": format!("{dtype:?}"), "shape": shape, "data_offsets": [at, at + bytes]}),
        );
        at += bytes;
    }
    let mut text = serde_json::to_vec(&header).expect("header serialises");
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let tmp = path.with_extension("safetensors.tmp");
    let file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    let mut out = std::io::BufWriter::new(file);
    out.write_all(&(text.len() as u64).to_le_bytes())
        .and_then(|_| out.write_all(&text))
        .map_err(io(&tmp))?;
    for (name, kind, shape) in entries {
        let t = fetch(name)?;
        if t.size() != *shape {
            return Err(bad(format!("{name}: shape {:?}, expected {shape:?}", t.size())).into());
        }
        out.write_all(&tensor_bytes(&t.to_kind(*kind)))
            .map_err(io(&tmp))?;
    }
    out.into_inner()
        .map_err(|e| e.into_error())
        .map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

/// How [`export_pretrained`] writes a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExportOptions {
    /// The largest shard in bytes (transformers' `max_shard_size`); one
    /// `model.safetensors` when everything fits, and a tensor larger than it alone in its
    /// shard.
    pub max_shard_bytes: u64,
    /// The dtype written, `Kind::Float` or `Kind::BFloat16` (`config.json`'s
    /// `torch_dtype` says which).
    pub kind: Kind,
}

impl Default for ExportOptions {
    /// transformers' default shard size (5 GB), fp32.
    fn default() -> Self {
        ExportOptions {
            max_shard_bytes: 5_000_000_000,
            kind: Kind::Float,
        }
    }
}

/// Writes the whole model `stage` as transformers' `save_pretrained` does (`config.json`,
/// safetensors shards of at most `options.max_shard_bytes` in model order, and their
/// index) into the new directory `dir` (see [`export_streaming`]).
pub fn export_pretrained(stage: &Stage, dir: &Path, options: ExportOptions) -> Result<(), HfError> {
    let config = stage.config();
    if stage.layers() != (0..config.num_layers) || !stage.shard().is_whole() {
        return Err(HfError::Tensor {
            path: dir.to_path_buf(),
            problem: "an export needs the whole model on one stage".into(),
        });
    }
    let variables = stage.var_store().variables();
    let tensors: Vec<(String, Vec<i64>)> = variables
        .iter()
        .map(|(n, t)| (n.clone(), t.size()))
        .collect();
    export_streaming(config, &tensors, dir, options, |name| {
        Ok::<_, HfError>(variables[name].detach())
    })
}

/// Writes a model as transformers' `save_pretrained` does, `tensors` (global name and
/// whole shape) fetched one at a time from `fetch` and written in model order: the peak
/// memory is about one tensor, whatever the model's size. It is built under a temporary
/// name beside `dir` and renamed, so `dir` is either absent or complete; an existing
/// `dir` is refused.
pub fn export_streaming<E: From<HfError>>(
    config: &LlamaConfig,
    tensors: &[(String, Vec<i64>)],
    dir: &Path,
    options: ExportOptions,
    mut fetch: impl FnMut(&str) -> Result<Tensor, E>,
) -> Result<(), E> {
    let torch_dtype = match options.kind {
        Kind::Float => "float32",
        Kind::BFloat16 => "bfloat16",
        other => {
            return Err(HfError::Tensor {
                path: dir.to_path_buf(),
                problem: format!("{other:?}: export writes float32 or bfloat16"),
            }
            .into())
        }
    };
    if dir.exists() {
        return Err(HfError::Tensor {
            path: dir.to_path_buf(),
            problem: "already exists; export writes a new directory".into(),
        }
        .into());
    }
    config.check_hf_exportable().map_err(HfError::from)?;
    let mut config_json: serde_json::Value =
        serde_json::from_str(&config.to_hf_json()).expect("our own json");
    config_json["torch_dtype"] = torch_dtype.into();
    let mut ordered: Vec<&(String, Vec<i64>)> = tensors.iter().collect();
    ordered.sort_by_key(|(name, _)| model_order(name, config.num_layers));
    let mut shards: Vec<Vec<Entry>> = vec![Vec::new()];
    let mut bytes = 0u64;
    for (name, shape) in ordered {
        let size = entry_bytes(options.kind, shape) as u64;
        let current = shards.last_mut().expect("one shard at least");
        if !current.is_empty() && bytes + size > options.max_shard_bytes {
            shards.push(Vec::new());
            bytes = 0;
        }
        let entry = (name.clone(), options.kind, shape.clone());
        shards.last_mut().expect("one shard at least").push(entry);
        bytes += size;
    }
    let file_name = dir
        .file_name()
        .map_or_else(|| "export".into(), |n| n.to_string_lossy().into_owned());
    let partial = dir.with_file_name(format!(".{file_name}.partial"));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    let config_text = serde_json::to_string_pretty(&config_json).expect("json");
    write_pretrained(&partial, &config_text, &shards, &mut fetch)?;
    std::fs::rename(&partial, dir).map_err(io(dir))?;
    Ok(())
}

/// A tensor's place in the model (embedding, layers in order, norm and head), then its
/// name: the order shards are filled in.
fn model_order(name: &str, num_layers: usize) -> (usize, String) {
    let piece = match name.strip_prefix("model.layers.") {
        Some(rest) => rest
            .split('.')
            .next()
            .and_then(|i| i.parse::<usize>().ok())
            .map_or(num_layers + 1, |i| i + 1),
        None if name.starts_with("model.embed_tokens") => 0,
        None => num_layers + 1,
    };
    (piece, name.to_owned())
}
