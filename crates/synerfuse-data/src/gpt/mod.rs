//! The pieces of Megatron's GPT dataset indices: numpy's legacy random stream and
//! `--split` strings. Same seeds and strings give the same arrays as Megatron.

mod random;
mod split;

pub use random::RandomState;
pub use split::{parse_split, split_ranges, SplitError, SplitMatrix};
