//! Blends of several datasets (`--data-path w1 p1 w2 p2 ...`) and the builder that turns
//! Megatron's data flags into one dataset per split, as `BlendedMegatronDatasetBuilder`
//! does in Megatron core 0.8.0: the same mid-level datasets, the 1.005 margin, the
//! weights normalized twice, both blending kernels and the same cache files.

use super::dataset::{
    BlendError, CacheFiles, CacheRecord, GptDataset, GptDatasetConfig, GptDatasetError, Split,
};
use super::describe::{md5_hex, PyValue};
use super::npy::{self, IndexArray};
use super::split::{split_ranges, SplitMatrix};
use super::{DocumentSource, GptSample, MockDocuments, SampleOptions};
use crate::{DataError, IndexedDataset};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

/// Dataset prefixes, optionally weighted (Megatron's `blend` tuple).
#[derive(Debug, Clone, PartialEq)]
pub struct Blend {
    /// Prefixes, stripped of surrounding whitespace, otherwise as typed.
    pub prefixes: Vec<String>,
    /// One weight per prefix, or `None` (weights are then the datasets' lengths).
    pub weights: Option<Vec<f64>>,
}

impl Blend {
    /// Megatron's `get_blend_from_list`: an even-length list whose every other entry is a
    /// number is `w1 p1 w2 p2 ...`; anything else is a list of prefixes.
    pub fn from_list<S: AsRef<str>>(list: &[S]) -> Result<Blend, GptDatasetError> {
        if list.is_empty() {
            return Err(BlendError::Empty.into());
        }
        let list: Vec<&str> = list.iter().map(|s| s.as_ref()).collect();
        let weights: Option<Vec<f64>> = if list.len() % 2 == 0 {
            list.iter()
                .step_by(2)
                .map(|w| python_float(w))
                .collect::<Option<Vec<f64>>>()
        } else {
            None
        };
        let prefixes: Vec<String> = match weights {
            Some(_) => list
                .iter()
                .skip(1)
                .step_by(2)
                .map(|p| p.trim().to_owned())
                .collect(),
            None => list.iter().map(|p| p.trim().to_owned()).collect(),
        };
        Ok(Blend { prefixes, weights })
    }
}

/// Python's `float(text)`: surrounding whitespace and `_` digit separators allowed.
fn python_float(text: &str) -> Option<f64> {
    let t = text.trim();
    if t.is_empty() || t.starts_with('_') || t.ends_with('_') || t.contains("__") {
        return None;
    }
    t.replace('_', "").parse().ok()
}

/// numpy's `sum` of a float64 vector: pairwise, 8 accumulators per block of up to 128.
pub fn numpy_sum(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 8 {
        let mut total = 0.0;
        for v in values {
            total += v;
        }
        total
    } else if n <= 128 {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&values[..8]);
        let mut i = 8;
        while i < n - n % 8 {
            for (j, acc) in r.iter_mut().enumerate() {
                *acc += values[i + j];
            }
            i += 8;
        }
        let mut total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for v in &values[i..] {
            total += v;
        }
        total
    } else {
        let half = n / 2;
        let half = half - half % 8;
        numpy_sum(&values[..half]) + numpy_sum(&values[half..])
    }
}

/// Megatron's `normalize`: divide by the numpy sum.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let total = numpy_sum(weights);
    weights.iter().map(|w| w / total).collect()
}

/// The candidate whose count lags its target share `w·max(s, 1)` the most; the first
/// one on ties (both C++ kernels compare with a strict `>` in ascending order).
fn furthest_behind(
    weights: &[f64],
    counts: &[i64],
    s: usize,
    candidates: impl Iterator<Item = usize>,
) -> usize {
    let x = (s as f64).max(1.0);
    let mut best = (usize::MAX, f64::MIN);
    for d in candidates {
        let error = weights[d] * x - counts[d] as f64;
        if best.0 == usize::MAX || error > best.1 {
            best = (d, error);
        }
    }
    best.0
}

/// `helpers.cpp::build_blending_indices`: sample `s` goes to the dataset furthest behind
/// its target share `w·max(s, 1)` (lowest index on ties).
pub fn build_blending_indices(weights: &[f64], size: usize) -> (Vec<i16>, Vec<i64>) {
    let mut current = vec![0i64; weights.len()];
    let mut dataset_index = Vec::with_capacity(size);
    let mut dataset_sample_index = Vec::with_capacity(size);
    for s in 0..size {
        let best = furthest_behind(weights, &current, s, 0..weights.len());
        dataset_index.push(best as i16);
        dataset_sample_index.push(current[best]);
        current[best] += 1;
    }
    (dataset_index, dataset_sample_index)
}

/// `helpers.cpp::build_exhaustive_blending_indices`: every sample of every dataset
/// exactly once, interleaved in proportion to the sizes.
pub fn build_exhaustive_blending_indices(sizes: &[i64]) -> (Vec<i16>, Vec<i64>) {
    let total: i64 = sizes.iter().sum();
    let weights: Vec<f64> = sizes.iter().map(|&s| s as f64 / total as f64).collect();
    let mut counts = vec![0i64; sizes.len()];
    let mut unspent: Vec<usize> = (0..sizes.len()).filter(|&d| sizes[d] > 0).collect();
    let mut dataset_index = Vec::with_capacity(total.max(0) as usize);
    let mut dataset_sample_index = Vec::with_capacity(total.max(0) as usize);
    let mut s = 0usize;
    while !unspent.is_empty() {
        let best = furthest_behind(&weights, &counts, s, unspent.iter().copied());
        dataset_index.push(best as i16);
        dataset_sample_index.push(counts[best]);
        counts[best] += 1;
        if counts[best] == sizes[best] {
            unspent.retain(|&d| d != best);
        }
        s += 1;
    }
    (dataset_index, dataset_sample_index)
}

/// Blend weights as Megatron keeps them: floats, or the datasets' lengths (ints) when
/// the blend is exhaustive.
#[derive(Debug, Clone, PartialEq)]
pub enum BlendWeights {
    /// Normalized floats.
    Float(Vec<f64>),
    /// Sample counts (exhaustive blend).
    Int(Vec<i64>),
}

/// Several GPT datasets of one split served as one, by the blending indices.
#[derive(Debug)]
pub struct BlendedDataset {
    datasets: Vec<Arc<GptDataset>>,
    split: Split,
    weights: BlendWeights,
    size: Option<u64>,
    dataset_index: IndexArray<i16>,
    dataset_sample_index: IndexArray<i64>,
    description: String,
    hash: String,
    cache: Option<CacheRecord>,
}

/// Megatron's checks of a blend: one weight per dataset, at most 32766 datasets (int16
/// indices), every weight positive.
fn check_blend(
    datasets: &[Arc<GptDataset>],
    weights: &BlendWeights,
) -> Result<(), GptDatasetError> {
    let count = match weights {
        BlendWeights::Float(w) => w.len(),
        BlendWeights::Int(w) => w.len(),
    };
    if datasets.is_empty() || datasets.len() != count {
        return Err(BlendError::WeightCount {
            weights: count,
            prefixes: datasets.len(),
        }
        .into());
    }
    if datasets.len() > 32766 {
        return Err(BlendError::TooMany(datasets.len()).into());
    }
    let not_positive = match weights {
        BlendWeights::Float(w) => w.iter().position(|&w| w.is_nan() || w <= 0.0),
        BlendWeights::Int(w) => w.iter().position(|&w| w <= 0),
    };
    match not_positive {
        Some(k) => Err(BlendError::NonPositiveWeight {
            split: datasets[0].split().name(),
            dataset: datasets[k].dataset_path().to_owned(),
            weight: match weights {
                BlendWeights::Float(w) => w[k].to_string(),
                BlendWeights::Int(w) => w[k].to_string(),
            },
        }
        .into()),
        None => Ok(()),
    }
}

/// The weights the indices are built from: normalised floats for a sized blend, whole
/// sample counts for an exhaustive one.
fn blend_weights(
    weights: BlendWeights,
    size: Option<u64>,
) -> Result<BlendWeights, GptDatasetError> {
    Ok(match (weights, size) {
        (BlendWeights::Float(w), Some(_)) => BlendWeights::Float(normalize(&w)),
        (BlendWeights::Int(w), Some(_)) => {
            BlendWeights::Float(normalize(&w.iter().map(|&x| x as f64).collect::<Vec<_>>()))
        }
        (BlendWeights::Float(w), None) => {
            if w.iter().any(|x| x.fract() != 0.0) {
                return Err(BlendError::FractionalExhaustiveWeights.into());
            }
            BlendWeights::Int(w.iter().map(|&x| x as i64).collect())
        }
        (w @ BlendWeights::Int(_), None) => w,
    })
}

/// Megatron's description of a blend (its md5 names the cache files).
fn describe_blend(
    datasets: &[Arc<GptDataset>],
    split: Split,
    weights: &BlendWeights,
    size: Option<u64>,
) -> String {
    let weights_value = match weights {
        BlendWeights::Float(w) => PyValue::List(w.iter().map(|&x| PyValue::Float(x)).collect()),
        BlendWeights::Int(w) => PyValue::List(w.iter().map(|&x| PyValue::Int(x)).collect()),
    };
    PyValue::Dict(vec![
        ("class".into(), PyValue::str("BlendedDataset")),
        (
            "datasets".into(),
            PyValue::List(datasets.iter().map(|d| d.identifiers().clone()).collect()),
        ),
        ("split".into(), PyValue::str(split.name())),
        ("weights".into(), weights_value),
        (
            "size".into(),
            size.map_or(PyValue::None, |s| PyValue::Int(s as i64)),
        ),
    ])
    .to_python_json()
}

/// The cached dataset and sample indices, checked against each other.
fn load_blending_indices(
    files: &CacheFiles,
) -> Result<(IndexArray<i16>, IndexArray<i64>), GptDatasetError> {
    let index: IndexArray<i16> = npy::read_npy(&files.arrays[0])?;
    let sample: IndexArray<i64> = npy::read_npy(&files.arrays[1])?;
    if index.len() != sample.len() {
        return Err(DataError::corrupt(
            &files.arrays[1],
            "shape",
            format!(
                "{} entries, the dataset index has {}",
                sample.len(),
                index.len()
            ),
        )
        .into());
    }
    Ok((index, sample))
}

/// Megatron's post-build check: no dataset is asked for more samples than it has.
fn check_dataset_sizes(
    datasets: &[Arc<GptDataset>],
    split: Split,
    index: &[i16],
) -> Result<(), GptDatasetError> {
    let mut counts = vec![0usize; datasets.len()];
    for &d in index {
        counts[d as usize] += 1;
    }
    for (d, (dataset, &needed)) in datasets.iter().zip(&counts).enumerate() {
        if needed > dataset.len() {
            return Err(BlendError::DatasetTooSmall {
                split: split.name(),
                needed,
                index: d,
                dataset: dataset.dataset_path().to_owned(),
                available: dataset.len(),
            }
            .into());
        }
    }
    Ok(())
}

impl BlendedDataset {
    /// Blends `datasets` with `weights`: `size` samples drawn in proportion to them, or
    /// with `size = None`, every sample of each dataset once (weights are then lengths).
    pub fn build(
        datasets: Vec<Arc<GptDataset>>,
        weights: BlendWeights,
        size: Option<u64>,
        config: &GptDatasetConfig,
    ) -> Result<BlendedDataset, GptDatasetError> {
        check_blend(&datasets, &weights)?;
        let split = datasets[0].split();
        let weights = blend_weights(weights, size)?;
        let description = describe_blend(&datasets, split, &weights, size);
        let hash = md5_hex(&description);
        let files = config.path_to_cache.as_ref().map(|dir| {
            CacheFiles::new(
                dir,
                &hash,
                "BlendedDataset",
                split,
                &["dataset_index.npy", "dataset_sample_index.npy"],
            )
        });
        let cached = files.as_ref().filter(|f| f.all_exist());
        let (dataset_index, dataset_sample_index) = match cached {
            Some(files) => load_blending_indices(files)?,
            None => {
                let (index, sample) = match &weights {
                    BlendWeights::Float(w) => build_blending_indices(w, size.unwrap_or(0) as usize),
                    BlendWeights::Int(w) => build_exhaustive_blending_indices(w),
                };
                check_dataset_sizes(&datasets, split, &index)?;
                if let Some(files) = &files {
                    files.write(&description, |path, i| match i {
                        0 => npy::write_npy(path, &index),
                        _ => npy::write_npy(path, &sample),
                    })?;
                }
                (index.into(), sample.into())
            }
        };
        let loaded = cached.is_some();
        Ok(BlendedDataset {
            datasets,
            split,
            weights,
            size,
            dataset_index,
            dataset_sample_index,
            description,
            hash,
            cache: files.map(|f| CacheRecord {
                files: f.all(),
                loaded,
            }),
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.dataset_index.len()
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The split.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The blended datasets.
    pub fn datasets(&self) -> &[Arc<GptDataset>] {
        &self.datasets
    }

    /// The weights after Megatron's normalization.
    pub fn weights(&self) -> &BlendWeights {
        &self.weights
    }

    /// The requested size, or `None` for an exhaustive blend.
    pub fn size(&self) -> Option<u64> {
        self.size
    }

    /// Which dataset serves each sample.
    pub fn dataset_index(&self) -> &[i16] {
        &self.dataset_index
    }

    /// Which sample of that dataset.
    pub fn dataset_sample_index(&self) -> &[i64] {
        &self.dataset_sample_index
    }

    /// The cache description.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// md5 of the description.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The cache files (only with a cache directory) and whether they were loaded.
    pub fn cache(&self) -> Option<&CacheRecord> {
        self.cache.as_ref()
    }

    /// (dataset, sample within it) of blended sample `idx`.
    pub fn locate(&self, idx: usize) -> Result<(usize, usize), DataError> {
        let out_of_range = |what: String| DataError::OutOfRange {
            path: self.datasets[0].documents().origin().to_path_buf(),
            what: "sequence",
            detail: what,
        };
        let (Some(&d), Some(&s)) = (
            self.dataset_index.get(idx),
            self.dataset_sample_index.get(idx),
        ) else {
            return Err(out_of_range(format!(
                "blended sample {idx} of {}",
                self.len()
            )));
        };
        if d < 0 || d as usize >= self.datasets.len() || s < 0 {
            return Err(out_of_range(format!(
                "blended sample {idx} names dataset {d}, sample {s}"
            )));
        }
        Ok((d as usize, s as usize))
    }
}

/// The dataset of one split: one GPT dataset, or a blend of several.
#[derive(Debug, Clone)]
pub enum SplitDataset {
    /// A single prefix without weights.
    Gpt(Arc<GptDataset>),
    /// Several prefixes, or weights.
    Blended(Arc<BlendedDataset>),
}

impl SplitDataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match self {
            SplitDataset::Gpt(d) => d.len(),
            SplitDataset::Blended(d) => d.len(),
        }
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (dataset id within the blend, or 0, and the dataset) serving sample `idx`.
    pub fn locate(&self, idx: usize) -> Result<(usize, &GptDataset, usize), DataError> {
        match self {
            SplitDataset::Gpt(d) => Ok((0, d, idx)),
            SplitDataset::Blended(b) => {
                let (d, s) = b.locate(idx)?;
                Ok((d, &b.datasets[d], s))
            }
        }
    }

    /// Sample `idx` as model inputs, and the id of the dataset it came from.
    pub fn sample(
        &self,
        idx: usize,
        options: &SampleOptions,
    ) -> Result<(usize, GptSample), DataError> {
        let (d, dataset, s) = self.locate(idx)?;
        Ok((d, dataset.sample(s, options)?))
    }

    /// Every cache record: the blend's (if any) first, then each GPT dataset's.
    pub fn cache_records(&self) -> Vec<&CacheRecord> {
        match self {
            SplitDataset::Gpt(d) => d.cache().into_iter().collect(),
            SplitDataset::Blended(b) => b
                .cache()
                .into_iter()
                .chain(b.datasets.iter().filter_map(|d| d.cache()))
                .collect(),
        }
    }
}

/// All data flags of a run (Megatron's `--data-path`, `--{train,valid,test}-data-path`,
/// `--split` and the dataset settings).
#[derive(Debug, Clone, PartialEq)]
pub struct GptDataConfig {
    /// `--data-path`.
    pub blend: Option<Blend>,
    /// `--train-data-path`, `--valid-data-path`, `--test-data-path`.
    pub blend_per_split: [Option<Blend>; 3],
    /// Seed, sequence length, split string, cache directory, tokenizer.
    pub dataset: GptDatasetConfig,
}

/// Builds (or loads) the dataset of every split, as Megatron's
/// `BlendedMegatronDatasetBuilder(GPTDataset, sizes, ...).build()`. `sizes` are the
/// samples wanted per split (`None`: one epoch). A split without data is `None`.
pub fn build_split_datasets(
    config: &GptDataConfig,
    sizes: [Option<u64>; 3],
) -> Result<[Option<SplitDataset>; 3], GptDatasetError> {
    let per_split = config.blend_per_split.iter().any(Option::is_some);
    match (&config.blend, per_split) {
        (Some(_), true) => Err(BlendError::BlendAndPerSplit.into()),
        (None, false) => Err(BlendError::NoData.into()),
        (Some(blend), false) => {
            if config.dataset.split.is_none() {
                return Err(BlendError::MissingSplit.into());
            }
            let matrix = config.dataset.split_matrix()?.expect("split checked above");
            build_blend(blend, &matrix, sizes, &config.dataset)
        }
        (None, true) => {
            if config.dataset.split.is_some() {
                return Err(BlendError::SplitWithPerSplit.into());
            }
            let mut out: [Option<SplitDataset>; 3] = [None, None, None];
            for split in Split::ALL {
                let i = split.index();
                let Some(blend) = &config.blend_per_split[i] else {
                    continue;
                };
                let mut matrix: SplitMatrix = [None, None, None];
                matrix[i] = Some((0.0, 1.0));
                let mut spoofed = [Some(0), Some(0), Some(0)];
                spoofed[i] = sizes[i];
                let blend = match &blend.weights {
                    Some(_) if blend.prefixes.len() == 1 => Blend {
                        prefixes: blend.prefixes.clone(),
                        weights: None,
                    },
                    _ => blend.clone(),
                };
                let [a, b, c] = build_blend(&blend, &matrix, spoofed, &config.dataset)?;
                out[i] = [a, b, c].into_iter().nth(i).flatten();
            }
            Ok(out)
        }
    }
}

/// Megatron's `--mock-data` splits: [`MockDocuments`] ending in `eod`, split `1,1,1`
/// whatever `--split` says (megatron-core sets it so when no data path is given), each
/// sized by `sizes` (`None`: one epoch), with `seed` and `sequence_length` as for real
/// data. Nothing is cached.
pub fn build_mock_split_datasets(
    seed: u32,
    sequence_length: usize,
    eod: i64,
    sizes: [Option<u64>; 3],
) -> Result<[Option<SplitDataset>; 3], GptDatasetError> {
    if sequence_length == 0 {
        return Err(GptDatasetError::ZeroSequenceLength);
    }
    let config = GptDatasetConfig {
        seed,
        sequence_length,
        split: Some("1,1,1".to_owned()),
        path_to_cache: None,
        tokenizer: PyValue::None,
        add_extra_token: true,
        drop_last_partial_validation: true,
    };
    let matrix = config.split_matrix()?.expect("split set above");
    let documents: Arc<dyn DocumentSource> = Arc::new(MockDocuments::new(eod));
    let ranges = split_ranges(&matrix, documents.sequence_count());
    let mut out: [Option<SplitDataset>; 3] = [None, None, None];
    for split in Split::ALL {
        let i = split.index();
        if let Some(range) = ranges[i].clone() {
            let built =
                GptDataset::build(documents.clone(), "mock", range, sizes[i], split, &config)?;
            out[i] = Some(SplitDataset::Gpt(Arc::new(built)));
        }
    }
    Ok(out)
}

fn build_blend(
    blend: &Blend,
    matrix: &SplitMatrix,
    sizes: [Option<u64>; 3],
    config: &GptDatasetConfig,
) -> Result<[Option<SplitDataset>; 3], GptDatasetError> {
    let weights = checked_weights(blend)?;
    // Open each prefix once, even if it appears several times.
    let mut opened: HashMap<&str, Arc<IndexedDataset>> = HashMap::new();
    for prefix in &blend.prefixes {
        if !opened.contains_key(prefix.as_str()) {
            opened.insert(prefix, Arc::new(IndexedDataset::open(prefix)?));
        }
    }
    let mid_level = |prefix: &str, wanted: [Option<u64>; 3]| {
        split_datasets(&opened[prefix], prefix, matrix, wanted, config)
    };
    if blend.prefixes.len() == 1 && weights.is_none() {
        let [a, b, c] = mid_level(&blend.prefixes[0], sizes)?;
        return Ok([a, b, c].map(|d| d.map(SplitDataset::Gpt)));
    }
    // Samples per dataset and split: ceil(size · w · 1.005), or one epoch each.
    let per_dataset: Vec<[Option<u64>; 3]> = match &weights {
        Some(w) => w
            .iter()
            .map(|&w| sizes.map(|size| size.map(|size| (size as f64 * w * 1.005).ceil() as u64)))
            .collect(),
        None => vec![[None; 3]; blend.prefixes.len()],
    };
    let built: Vec<[Option<Arc<GptDataset>>; 3]> = blend
        .prefixes
        .par_iter()
        .zip(per_dataset.par_iter())
        .map(|(prefix, wanted)| mid_level(prefix, *wanted))
        .collect::<Result<_, _>>()?;
    let mut out: [Option<SplitDataset>; 3] = [None, None, None];
    for split in Split::ALL
        .into_iter()
        .filter(|s| matrix[s.index()].is_some())
    {
        let i = split.index();
        let datasets: Vec<Arc<GptDataset>> = built
            .iter()
            .map(|d| d[i].clone().expect("split present in the matrix"))
            .collect();
        let (weights_i, size_i) = match &weights {
            Some(_) if sizes[i].is_none() => {
                return Err(BlendError::WeightedWithoutSize {
                    split: split.name(),
                }
                .into())
            }
            Some(w) => {
                let size: u64 = per_dataset.iter().map(|p| p[i].unwrap_or(0)).sum();
                (BlendWeights::Float(w.clone()), Some(size))
            }
            None => {
                let lengths: Vec<i64> = datasets.iter().map(|d| d.len() as i64).collect();
                let total: u64 = lengths.iter().map(|&l| l as u64).sum();
                (BlendWeights::Int(lengths), sizes[i].map(|s| s.min(total)))
            }
        };
        let blended = BlendedDataset::build(datasets, weights_i, size_i, config)?;
        out[i] = Some(SplitDataset::Blended(Arc::new(blended)));
    }
    Ok(out)
}

/// The blend's weights, normalised, after Megatron's checks (one per prefix, finite,
/// ≥ 0, not all 0); `None` for an unweighted blend.
fn checked_weights(blend: &Blend) -> Result<Option<Vec<f64>>, GptDatasetError> {
    let Some(w) = &blend.weights else {
        return Ok(None);
    };
    if w.len() != blend.prefixes.len() {
        return Err(BlendError::WeightCount {
            weights: w.len(),
            prefixes: blend.prefixes.len(),
        }
        .into());
    }
    if let Some(bad) = w.iter().find(|w| !w.is_finite() || **w < 0.0) {
        return Err(BlendError::BadWeight(*bad).into());
    }
    if numpy_sum(w) <= 0.0 {
        return Err(BlendError::ZeroWeights.into());
    }
    Ok(Some(normalize(w)))
}

/// The GPT dataset of each split of `dataset` (Megatron's mid-level datasets), with
/// `wanted` samples each (`None`: one epoch).
fn split_datasets(
    dataset: &Arc<IndexedDataset>,
    prefix: &str,
    matrix: &SplitMatrix,
    wanted: [Option<u64>; 3],
    config: &GptDatasetConfig,
) -> Result<[Option<Arc<GptDataset>>; 3], GptDatasetError> {
    let ranges = split_ranges(matrix, dataset.len());
    let mut out: [Option<Arc<GptDataset>>; 3] = [None, None, None];
    for split in Split::ALL {
        let i = split.index();
        if let Some(range) = ranges[i].clone() {
            let built =
                GptDataset::build(dataset.clone(), prefix, range, wanted[i], split, config)?;
            out[i] = Some(Arc::new(built));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blend_lists_parse_as_megatron() {
        let b = Blend::from_list(&["30", " a ", "70", "b"]).unwrap();
        assert_eq!(b.prefixes, ["a", "b"]);
        assert_eq!(b.weights, Some(vec![30.0, 70.0]));
        let b = Blend::from_list(&["a", "b"]).unwrap();
        assert_eq!((b.prefixes.len(), b.weights), (2, None));
        let b = Blend::from_list(&["x", "b", "0.5", "c"]).unwrap();
        assert_eq!(b.prefixes, ["x", "b", "0.5", "c"]);
        assert_eq!(Blend::from_list(&["p"]).unwrap().weights, None);
        assert_eq!(
            Blend::from_list(&["1_0", "p"]).unwrap().weights,
            Some(vec![10.0])
        );
    }

    #[test]
    fn numpy_sum_is_pairwise() {
        // 0.1 ten times: numpy.sum gives 1.0 (pairwise); a left-to-right sum does not.
        let v = [0.1f64; 10];
        assert_eq!(numpy_sum(&v), 1.0);
        assert_ne!(v.iter().sum::<f64>(), 1.0);
        assert_eq!(numpy_sum(&[0.1, 0.2, 0.3]), 0.1 + 0.2 + 0.3);
    }

    #[test]
    fn blending_follows_weights_and_exhaustive_takes_everything() {
        let (d, s) = build_blending_indices(&[0.5, 0.25, 0.25], 8);
        assert_eq!(d, [0, 1, 2, 0, 0, 1, 2, 0]);
        assert_eq!(s, [0, 0, 0, 1, 2, 1, 1, 3]);
        let (d, s) = build_exhaustive_blending_indices(&[3, 1, 2]);
        assert_eq!(d.len(), 6);
        for k in 0..3i16 {
            let mine: Vec<i64> = d
                .iter()
                .zip(&s)
                .filter(|(x, _)| **x == k)
                .map(|(_, y)| *y)
                .collect();
            assert_eq!(mine, (0..[3, 1, 2][k as usize]).collect::<Vec<_>>());
        }
    }
}
