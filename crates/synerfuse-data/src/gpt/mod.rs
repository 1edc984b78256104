//! The pieces of Megatron's GPT dataset indices: numpy's legacy random stream and
//! `--split` strings. Same seeds and strings give the same arrays as Megatron.

mod index;
mod random;
mod split;

pub use index::{build_gpt_indices, GptIndexConfig, GptIndexError, GptIndices, ShuffleIndex};
pub use random::RandomState;
pub use split::{parse_split, split_ranges, SplitError, SplitMatrix};
