//! `GptDataset`: one prefix and one split, with its indices built or loaded from
//! Megatron's cache files (same names, same `.npy` arrays, either side can write them).

use super::describe::{md5_hex, PyValue};
use super::index::{epoch_plan, GptIndexError};
use super::npy::{self, IndexArray, NpyElement};
use super::split::{parse_split, SplitError, SplitMatrix};
use super::DocumentSource;
use super::{build_gpt_indices, sample_tokens, GptIndexConfig, GptIndices, ShuffleIndex};
use super::{build_sample, GptSample, SampleOptions};
use crate::DataError;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Train, validation or test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// `train`.
    Train,
    /// `valid`.
    Valid,
    /// `test`.
    Test,
}

impl Split {
    /// The three splits in Megatron's order.
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    /// Megatron's `Split.name`, used in cache file names.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }

    /// Position in `[train, valid, test]`.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The settings every GPT dataset of a run shares (Megatron's `GPTDatasetConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct GptDatasetConfig {
    /// `--seed`.
    pub seed: u32,
    /// `--seq-length`.
    pub sequence_length: usize,
    /// `--split` as typed (it enters cache names raw); `None` with per-split data paths.
    pub split: Option<String>,
    /// `--data-cache-path`; `None` puts GPT caches in `{prefix}/cache/GPTDataset_indices`
    /// and keeps blends uncached, as Megatron does.
    pub path_to_cache: Option<PathBuf>,
    /// The tokenizer's identifiers (see `tokenizer::megatron_tokenizer_identifiers`).
    pub tokenizer: PyValue,
    /// Samples carry one extra token (Megatron's default, `true`).
    pub add_extra_token: bool,
    /// Drop a partial last validation sample (Megatron's default, `true`).
    pub drop_last_partial_validation: bool,
}

impl GptDatasetConfig {
    /// The split matrix of `split`, or `None` when there is no split string.
    pub fn split_matrix(&self) -> Result<Option<SplitMatrix>, SplitError> {
        self.split.as_deref().map(parse_split).transpose()
    }
}

/// A blend (or a choice of data sources) that Megatron would reject.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BlendError {
    /// An empty list of datasets.
    #[error("no dataset given")]
    Empty,
    /// Both one blend and per-split blends.
    #[error("a blend over all splits and per-split blends cannot be combined")]
    BlendAndPerSplit,
    /// Neither one blend nor per-split blends.
    #[error("no data: give a blend or per-split blends (synerfuse has no mock data)")]
    NoData,
    /// One blend without a split string.
    #[error("a blend over all splits needs a split string")]
    MissingSplit,
    /// Per-split blends with a split string.
    #[error("a split string cannot be combined with per-split blends")]
    SplitWithPerSplit,
    /// Weights and prefixes of different counts.
    #[error("{weights} weights for {prefixes} datasets")]
    WeightCount {
        /// Weights given.
        weights: usize,
        /// Datasets given.
        prefixes: usize,
    },
    /// A weight that is negative or not finite.
    #[error("weight {0} is not a finite number >= 0")]
    BadWeight(f64),
    /// Weights that sum to zero.
    #[error("the weights sum to 0")]
    ZeroWeights,
    /// More datasets than an int16 index holds.
    #[error("{0} datasets; a blend holds at most 32766 (int16 dataset index)")]
    TooMany(usize),
    /// A dataset whose blend weight is not positive.
    #[error("{split} split: dataset {dataset:?} has weight {weight}; every blend weight must be > 0 (an unweighted blend weighs datasets by their sample count, so this dataset has no samples)")]
    NonPositiveWeight {
        /// The split.
        split: &'static str,
        /// The dataset's path prefix.
        dataset: String,
        /// Its weight.
        weight: String,
    },
    /// An exhaustive blend whose weights are not whole sample counts.
    #[error("an exhaustive blend (no size) needs whole-number weights")]
    FractionalExhaustiveWeights,
    /// A blend that takes more samples from a dataset than it holds.
    #[error("{split} split: the blend takes {needed} samples from dataset {index} ({dataset:?}), which has only {available}")]
    DatasetTooSmall {
        /// The split.
        split: &'static str,
        /// Samples taken.
        needed: usize,
        /// The dataset's position in the blend.
        index: usize,
        /// Its path prefix.
        dataset: String,
        /// Samples it holds.
        available: usize,
    },
    /// A weighted blend without a sample count.
    #[error("{split} split: a weighted blend needs a sample count (Megatron raises here)")]
    WeightedWithoutSize {
        /// The split.
        split: &'static str,
    },
}

/// A dataset that cannot be built: what Megatron would hang, abort or raise on.
#[derive(Debug, thiserror::Error)]
pub enum GptDatasetError {
    /// Reading or writing a file failed.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A bad `--split`.
    #[error(transparent)]
    Split(#[from] SplitError),
    /// The indices of a split cannot be built.
    #[error("dataset {dataset:?}, {split} split: {problem}")]
    Index {
        /// The prefix.
        dataset: String,
        /// The split.
        split: &'static str,
        /// Why.
        problem: GptIndexError,
    },
    /// A blend Megatron would reject.
    #[error(transparent)]
    Blend(#[from] BlendError),
    /// Samples of no tokens.
    #[error("the sequence length must be at least 1")]
    ZeroSequenceLength,
}

/// Where a dataset's indices came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheRecord {
    /// The cache files (description first).
    pub files: Vec<PathBuf>,
    /// `true` if they were loaded, `false` if built now and written.
    pub loaded: bool,
}

/// One split of one tokenized dataset, ready to serve samples.
#[derive(Debug)]
pub struct GptDataset {
    dataset: Arc<dyn DocumentSource>,
    dataset_path: String,
    split: Split,
    num_samples: Option<u64>,
    indices: GptIndices,
    identifiers: PyValue,
    description: String,
    hash: String,
    cache: Option<CacheRecord>,
}

impl GptDataset {
    /// Builds (or loads from the cache) the indices of `split` over the sequences
    /// `sequences` of `dataset`, whose prefix was typed as `dataset_path`.
    pub fn build(
        dataset: Arc<dyn DocumentSource>,
        dataset_path: &str,
        sequences: Range<usize>,
        num_samples: Option<u64>,
        split: Split,
        config: &GptDatasetConfig,
    ) -> Result<GptDataset, GptDatasetError> {
        let identifiers = gpt_identifiers(dataset_path, num_samples, split, config)?;
        let description = identifiers.to_python_json();
        let hash = md5_hex(&description);
        let index_config = GptIndexConfig {
            sequence_length: config.sequence_length,
            seed: config.seed,
            num_samples,
            add_extra_token: config.add_extra_token,
            drop_last: split != Split::Valid || config.drop_last_partial_validation,
        };
        let index_error = |problem| GptDatasetError::Index {
            dataset: dataset_path.to_owned(),
            split: split.name(),
            problem,
        };
        let count = dataset.sequence_count();
        if sequences.end > count {
            return Err(index_error(GptIndexError::BadSequence {
                id: sequences.end as i32 - 1,
                count,
            }));
        }
        let build = || {
            let sizes: Vec<i32> = dataset.lengths();
            let split_sequences: Vec<i32> = sequences.clone().map(|i| i as i32).collect();
            build_gpt_indices(&sizes, &split_sequences, &index_config).map_err(index_error)
        };
        if !dataset.cached() {
            return Ok(GptDataset {
                indices: build()?,
                dataset,
                dataset_path: dataset_path.to_owned(),
                split,
                num_samples,
                identifiers,
                description,
                hash,
                cache: None,
            });
        }
        let cache_dir = config.path_to_cache.clone().unwrap_or_else(|| {
            Path::new(dataset_path)
                .join("cache")
                .join("GPTDataset_indices")
        });
        let files = CacheFiles::new(
            &cache_dir,
            &hash,
            "GPTDataset",
            split,
            &[
                "document_index.npy",
                "sample_index.npy",
                "shuffle_index.npy",
            ],
        );
        let loaded = files.all_exist();
        let indices = if loaded {
            // Only the epoch count is needed: a sum over the lengths.
            let tokens = dataset.tokens_in(sequences.clone());
            let epochs = epoch_plan(tokens, &index_config).map_err(index_error)?;
            load_indices(&files, epochs)?
        } else {
            let indices = build()?;
            files.write(&description, |path, i| match i {
                0 => npy::write_npy(path, &indices.document_index),
                1 => npy::write_npy(path, &indices.sample_index),
                _ => match &indices.shuffle_index {
                    ShuffleIndex::U32(v) => npy::write_npy(path, v),
                    ShuffleIndex::I64(v) => npy::write_npy(path, v),
                },
            })?;
            indices
        };
        Ok(GptDataset {
            dataset,
            dataset_path: dataset_path.to_owned(),
            split,
            num_samples,
            indices,
            identifiers,
            description,
            hash,
            cache: Some(CacheRecord {
                files: files.all(),
                loaded,
            }),
        })
    }

    /// Number of samples (Megatron's `len(dataset)`; usually more than requested).
    pub fn len(&self) -> usize {
        self.indices.shuffle_index.len()
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The split.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The prefix as given.
    pub fn dataset_path(&self) -> &str {
        &self.dataset_path
    }

    /// Samples requested (`None`: one epoch).
    pub fn num_samples(&self) -> Option<u64> {
        self.num_samples
    }

    /// The documents it cuts samples from.
    pub fn documents(&self) -> &dyn DocumentSource {
        self.dataset.as_ref()
    }

    /// The document, sample and shuffle indices.
    pub fn indices(&self) -> &GptIndices {
        &self.indices
    }

    /// Megatron's `unique_identifiers`.
    pub fn identifiers(&self) -> &PyValue {
        &self.identifiers
    }

    /// The cache description (`json.dumps(unique_identifiers, indent=4)`).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// md5 of the description: the cache file name prefix.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The cache files and whether they were loaded.
    pub fn cache(&self) -> Option<&CacheRecord> {
        self.cache.as_ref()
    }

    /// Sample `idx` as model inputs.
    pub fn sample(&self, idx: usize, options: &SampleOptions) -> Result<GptSample, DataError> {
        let text = sample_tokens(self.dataset.as_ref(), &self.indices, idx, options)?;
        Ok(build_sample(&text, options))
    }
}

/// `GPTDataset.unique_identifiers`, in Megatron's key order.
fn gpt_identifiers(
    dataset_path: &str,
    num_samples: Option<u64>,
    split: Split,
    config: &GptDatasetConfig,
) -> Result<PyValue, SplitError> {
    let matrix = match config.split_matrix()? {
        None => PyValue::None,
        Some(matrix) => PyValue::List(
            matrix
                .iter()
                .enumerate()
                .map(|(i, bounds)| match bounds {
                    None => PyValue::None,
                    Some((lo, hi)) => PyValue::List(vec![
                        // Megatron's cumulation starts from the int 0.
                        if i == 0 && *lo == 0.0 {
                            PyValue::Int(0)
                        } else {
                            PyValue::Float(*lo)
                        },
                        PyValue::Float(*hi),
                    ]),
                })
                .collect(),
        ),
    };
    Ok(PyValue::Dict(vec![
        ("class".into(), PyValue::str("GPTDataset")),
        ("dataset_path".into(), PyValue::str(dataset_path)),
        (
            "num_samples".into(),
            num_samples.map_or(PyValue::None, |n| PyValue::Int(n as i64)),
        ),
        ("index_split".into(), PyValue::str(split.name())),
        ("random_seed".into(), PyValue::Int(i64::from(config.seed))),
        (
            "sequence_length".into(),
            PyValue::Int(config.sequence_length as i64),
        ),
        (
            "split".into(),
            config.split.as_deref().map_or(PyValue::None, PyValue::str),
        ),
        ("split_matrix".into(), matrix),
        ("tokenizer".into(), config.tokenizer.clone()),
    ]))
}

/// The cached document, sample and shuffle indices, checked against each other;
/// `(num_epochs, separate_final_epoch)` come from the split's token count.
fn load_indices(
    files: &CacheFiles,
    (num_epochs, separate_final_epoch): (usize, bool),
) -> Result<GptIndices, GptDatasetError> {
    let document_index: IndexArray<i32> = npy::read_npy(&files.arrays[0])?;
    let sample_index: IndexArray<[i64; 2]> = npy::read_npy(&files.arrays[1])?;
    let shuffle_index = read_shuffle_index(&files.arrays[2])?;
    if sample_index.is_empty() || shuffle_index.len() != sample_index.len() - 1 {
        return Err(DataError::corrupt(
            &files.arrays[2],
            "shape",
            format!(
                "{} samples, but the sample index has {} rows",
                shuffle_index.len(),
                sample_index.len()
            ),
        )
        .into());
    }
    Ok(GptIndices {
        document_index,
        sample_index,
        shuffle_index,
        num_epochs,
        separate_final_epoch,
    })
}

fn read_shuffle_index(path: &Path) -> Result<ShuffleIndex, DataError> {
    let map = npy::open_map(path)?;
    let header = npy::parse_npy_header(path, &map)?;
    if header.descr == <i64 as NpyElement>::DESCR {
        Ok(ShuffleIndex::I64(npy::array_from_map(path, map, &header)?))
    } else {
        Ok(ShuffleIndex::U32(npy::array_from_map(path, map, &header)?))
    }
}

/// The files of one cached dataset: `{dir}/{hash}-{class}-{split}-{suffix}`.
pub(crate) struct CacheFiles {
    pub dir: PathBuf,
    pub description: PathBuf,
    pub arrays: Vec<PathBuf>,
}

impl CacheFiles {
    pub fn new(dir: &Path, hash: &str, class: &str, split: Split, arrays: &[&str]) -> CacheFiles {
        let path = |suffix: &str| dir.join(format!("{hash}-{class}-{}-{suffix}", split.name()));
        CacheFiles {
            dir: dir.to_path_buf(),
            description: path("description.txt"),
            arrays: arrays.iter().map(|suffix| path(suffix)).collect(),
        }
    }

    /// Megatron's cache-hit test: every file exists.
    pub fn all_exist(&self) -> bool {
        self.description.is_file() && self.arrays.iter().all(|p| p.is_file())
    }

    pub fn all(&self) -> Vec<PathBuf> {
        std::iter::once(self.description.clone())
            .chain(self.arrays.iter().cloned())
            .collect()
    }

    /// Writes each file under a temporary name in the cache directory and renames it
    /// into place, arrays first and the description last: a killed run or a
    /// concurrent rank never leaves a file that looks complete but is not.
    pub fn write(
        &self,
        description: &str,
        mut write_array: impl FnMut(&Path, usize) -> Result<(), DataError>,
    ) -> Result<(), DataError> {
        std::fs::create_dir_all(&self.dir).map_err(DataError::io(&self.dir))?;
        for (i, path) in self.arrays.iter().enumerate() {
            atomic_write(path, |tmp| write_array(tmp, i))?;
        }
        atomic_write(&self.description, |tmp| {
            std::fs::write(tmp, description).map_err(DataError::io(tmp))
        })
    }
}

fn atomic_write(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), DataError>,
) -> Result<(), DataError> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = write(&tmp).and_then(|_| std::fs::rename(&tmp, path).map_err(DataError::io(path)));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
