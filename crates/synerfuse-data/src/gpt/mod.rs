//! Megatron's GPT dataset, piece by piece: numpy's legacy random stream, `--split`
//! strings, the document/sample/shuffle indices of a split, samples with their masks,
//! blends of datasets and the cache files Megatron shares them through. Same data,
//! seeds and flags give the same arrays, samples and cache names as Megatron core 0.8.0.

mod blend;
mod config;
mod dataset;
mod describe;
mod documents;
mod index;
mod npy;
mod random;
mod sample;
mod split;

pub use blend::{
    build_blending_indices, build_exhaustive_blending_indices, build_mock_split_datasets,
    build_split_datasets, normalize, numpy_sum, Blend, BlendWeights, BlendedDataset, GptDataConfig,
    SplitDataset,
};
pub use config::{BudgetError, DataSources, SampleBudget, DEFAULT_SPLIT};
pub use dataset::{BlendError, CacheRecord, GptDataset, GptDatasetConfig, GptDatasetError, Split};
pub use describe::{md5_hex, python_float_repr, PyValue};
pub use documents::{DocumentSource, MockDocuments};
pub use index::{build_gpt_indices, GptIndexConfig, GptIndexError, GptIndices, ShuffleIndex};
pub use npy::{IndexArray, NpyElement};
pub use random::RandomState;
pub use sample::{build_sample, sample_tokens, GptSample, SampleOptions};
pub use split::{parse_split, split_ranges, SplitError, SplitMatrix};
