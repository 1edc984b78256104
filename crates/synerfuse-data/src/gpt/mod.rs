//! Megatron's GPT dataset, piece by piece: numpy's legacy random stream, `--split`
//! strings, the document/sample/shuffle indices of a split, and samples with their
//! masks. Same data, seeds and flags give the same arrays and samples as Megatron.

mod index;
mod random;
mod sample;
mod split;

pub use index::{build_gpt_indices, GptIndexConfig, GptIndexError, GptIndices, ShuffleIndex};
pub use random::RandomState;
pub use sample::{build_sample, sample_tokens, GptSample, SampleOptions};
pub use split::{parse_split, split_ranges, SplitError, SplitMatrix};
