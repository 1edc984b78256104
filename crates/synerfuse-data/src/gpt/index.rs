//! Megatron core 0.8.0's GPT dataset indices for one split: which sequences each epoch
//! visits (document index), where each sample starts and ends (sample index), and the
//! order samples are served (shuffle index). One `RandomState(seed)` stream feeds the
//! document shuffles first, then the sample shuffles, as in Megatron.

use super::npy::IndexArray;
use super::RandomState;

/// How the indices of one split are built (Megatron's `GPTDatasetConfig` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptIndexConfig {
    /// `--seq-length`: tokens per sample (plus the extra token).
    pub sequence_length: usize,
    /// `--seed`.
    pub seed: u32,
    /// Samples requested, or `None` for exactly one epoch.
    pub num_samples: Option<u64>,
    /// Each sample holds one token more than `sequence_length` (the next-token label);
    /// Megatron's default.
    pub add_extra_token: bool,
    /// Drop a last partial sample (always, except for validation when asked not to).
    pub drop_last: bool,
}

/// The shuffle index, in the dtype Megatron stores it in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShuffleIndex {
    /// `uint32`, when there are fewer than 2^32 − 2 samples.
    U32(IndexArray<u32>),
    /// `int64` otherwise.
    I64(IndexArray<i64>),
}

impl ShuffleIndex {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match self {
            ShuffleIndex::U32(v) => v.len(),
            ShuffleIndex::I64(v) => v.len(),
        }
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entry `i` as an index into the sample index.
    pub fn get(&self, i: usize) -> Option<usize> {
        match self {
            ShuffleIndex::U32(v) => v.get(i).map(|&x| x as usize),
            ShuffleIndex::I64(v) => v.get(i).map(|&x| x as usize),
        }
    }
}

/// The three index arrays of one split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GptIndices {
    /// Sequence ids in visiting order, epoch after epoch (int32).
    pub document_index: IndexArray<i32>,
    /// Row j: (position in `document_index`, token offset) where sample j starts; sample
    /// j ends where row j+1 starts (inclusive, with the extra token).
    pub sample_index: IndexArray<[i64; 2]>,
    /// Order in which samples are served.
    pub shuffle_index: ShuffleIndex,
    /// Epochs the document index spans.
    pub num_epochs: usize,
    /// Whether the last epoch was shuffled on its own (it is needed only in part).
    pub separate_final_epoch: bool,
}

/// A split whose indices cannot be built (where Megatron hangs or aborts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GptIndexError {
    /// No tokens in the split but samples were requested: Megatron loops forever.
    #[error(
        "the split holds {tokens} tokens, fewer than the {needed} one sample needs \
         (Megatron hangs or aborts here; check --split against the number of sequences)"
    )]
    TooFewTokens {
        /// Tokens in the split.
        tokens: u64,
        /// Tokens one sample needs.
        needed: u64,
    },
    /// `--seq-length 0`.
    #[error("the sequence length must be at least 1")]
    ZeroSequenceLength,
    /// A sequence id outside the dataset.
    #[error("sequence id {id} is outside the dataset's {count} sequences")]
    BadSequence {
        /// The id.
        id: i32,
        /// Sequences in the dataset.
        count: usize,
    },
}

/// Builds the indices of one split whose sequences are `split_sequences` (ids into
/// `sizes`, the whole dataset's sequence lengths).
pub fn build_gpt_indices(
    sizes: &[i32],
    split_sequences: &[i32],
    config: &GptIndexConfig,
) -> Result<GptIndices, GptIndexError> {
    let s = config.sequence_length as u64;
    if s == 0 {
        return Err(GptIndexError::ZeroSequenceLength);
    }
    let x = u64::from(config.add_extra_token);
    let mut tokens_per_epoch = 0u64;
    for &id in split_sequences {
        let size = usize::try_from(id).ok().and_then(|i| sizes.get(i)).ok_or(
            GptIndexError::BadSequence {
                id,
                count: sizes.len(),
            },
        )?;
        tokens_per_epoch += u64::try_from(*size).unwrap_or(0);
    }
    let t = tokens_per_epoch;
    let (num_epochs, separate_final_epoch) = epoch_plan(t, config)?;
    let e = num_epochs as u64;
    let mut rng = RandomState::new(config.seed);
    let document_index = if separate_final_epoch {
        let mut index = shuffled_epochs(split_sequences, num_epochs - 1, &mut rng);
        index.extend(shuffled_epochs(split_sequences, 1, &mut rng));
        index
    } else {
        shuffled_epochs(split_sequences, num_epochs, &mut rng)
    };
    let sample_index = build_sample_index(sizes, &document_index, s, e * t, x, config.drop_last);
    let samples = sample_index.len() - 1;
    let first = if separate_final_epoch {
        (((e - 1) * t - x) / s) as usize
    } else {
        samples
    };
    let shuffle_index = build_shuffle_index(first, samples, &mut rng);
    Ok(GptIndices {
        document_index: document_index.into(),
        sample_index: sample_index.into(),
        shuffle_index,
        num_epochs,
        separate_final_epoch,
    })
}

/// Epochs needed for the requested samples over `t` tokens per epoch, and whether the
/// last epoch is shuffled separately (Megatron's `_get_num_epochs` and the 80% rule).
pub(crate) fn epoch_plan(t: u64, config: &GptIndexConfig) -> Result<(usize, bool), GptIndexError> {
    let s = config.sequence_length as u64;
    if s == 0 {
        return Err(GptIndexError::ZeroSequenceLength);
    }
    let x = u64::from(config.add_extra_token);
    // Megatron loops forever on an empty split and aborts on a single token with the
    // extra token; more tokens are enough, the epochs repeat as often as needed.
    if t == 0 || t <= x {
        return Err(GptIndexError::TooFewTokens {
            tokens: t,
            needed: x + 1,
        });
    }
    let num_epochs = match config.num_samples {
        None => 1,
        Some(n) => {
            let requested = n * s + x;
            requested.div_ceil(t).max(1) as usize
        }
    };
    let e = num_epochs as u64;
    let separate_final_epoch = match config.num_samples {
        Some(n) if num_epochs > 1 => {
            let samples_before_last = ((e - 1) * t - x) / s;
            let from_last = n.saturating_sub(samples_before_last);
            let per_epoch = (t - x) / s;
            // Python: `int(0.80 * per_epoch)`, a float product truncated.
            from_last < (0.80 * per_epoch as f64) as u64
        }
        _ => false,
    };
    Ok((num_epochs, separate_final_epoch))
}

/// The configuration of the worked example (a 3-document dataset, sequence length 4,
/// seed 1234), whose arrays were taken from megatron-core 0.8.0.
#[cfg(test)]
pub(crate) const WORKED_EXAMPLE: GptIndexConfig = GptIndexConfig {
    sequence_length: 4,
    seed: 1234,
    num_samples: Some(6),
    add_extra_token: true,
    drop_last: true,
};

/// `epochs` copies of the split, epoch-major, shuffled as one array.
fn shuffled_epochs(split_sequences: &[i32], epochs: usize, rng: &mut RandomState) -> Vec<i32> {
    let mut index: Vec<i32> = std::iter::repeat_n(split_sequences, epochs)
        .flatten()
        .copied()
        .collect();
    rng.shuffle(&mut index);
    index
}

/// `helpers.cpp::build_sample_idx`: walks the document index cutting samples of
/// `s + x` tokens that overlap by `x`.
fn build_sample_index(
    sizes: &[i32],
    document_index: &[i32],
    s: u64,
    total_tokens: u64,
    x: u64,
    drop_last: bool,
) -> Vec<[i64; 2]> {
    let samples = if drop_last {
        (total_tokens - x) / s
    } else {
        // Megatron computes this ceiling in single precision.
        ((total_tokens - x) as f32 / s as f32).ceil() as u64
    };
    let size_of = |position: usize| i64::from(sizes[document_index[position] as usize]);
    let mut out = Vec::with_capacity(samples as usize + 1);
    out.push([0, 0]);
    let (s, x) = (s as i64, x as i64);
    let mut position = 0usize;
    let mut offset = 0i64;
    for _ in 0..samples {
        let mut remaining = s + x;
        while remaining != 0 {
            let left_in_document = size_of(position) - offset;
            remaining -= left_in_document;
            if remaining <= 0 {
                offset += remaining + left_in_document - x;
                remaining = 0;
            } else if position == document_index.len() - 1 {
                // Out of tokens: only when the last partial sample is kept.
                offset = size_of(position) - x;
                break;
            } else {
                position += 1;
                offset = 0;
            }
        }
        out.push([position as i64, offset]);
    }
    out
}

/// `[0, first)` shuffled, then `[first, total)` shuffled, in Megatron's dtype.
fn build_shuffle_index(first: usize, total: usize, rng: &mut RandomState) -> ShuffleIndex {
    fn two_runs<T: Copy>(
        first: usize,
        total: usize,
        rng: &mut RandomState,
        of: impl Fn(usize) -> T,
    ) -> Vec<T> {
        let mut head: Vec<T> = (0..first).map(&of).collect();
        rng.shuffle(&mut head);
        if first == total {
            return head;
        }
        let mut tail: Vec<T> = (first..total).map(&of).collect();
        rng.shuffle(&mut tail);
        head.extend(tail);
        head
    }
    if (total as u64) < (1u64 << 32) - 2 {
        ShuffleIndex::U32(two_runs(first, total, rng, |i| i as u32).into())
    } else {
        ShuffleIndex::I64(two_runs(first, total, rng, |i| i as i64).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example's arrays, as megatron-core 0.8.0 builds them.
    #[test]
    fn worked_example() {
        let sizes = [5, 3, 7, 4];
        let indices = build_gpt_indices(&sizes, &[0, 1, 2, 3], &WORKED_EXAMPLE).unwrap();
        assert_eq!(
            (indices.num_epochs, indices.separate_final_epoch),
            (2, true)
        );
        assert_eq!(indices.document_index, [0, 1, 2, 3, 1, 2, 3, 0]);
        assert_eq!(
            indices.sample_index,
            [
                [0, 0],
                [0, 4],
                [2, 0],
                [2, 4],
                [3, 1],
                [4, 1],
                [5, 2],
                [5, 6],
                [6, 3],
                [7, 3]
            ]
        );
        assert_eq!(
            indices.shuffle_index,
            ShuffleIndex::U32(vec![0, 2, 3, 1, 4, 8, 7, 6, 5].into())
        );
    }

    /// Samples tile the token stream: each ends where the next starts, one token
    /// shared (the extra token), and every sample holds `sequence_length + 1` tokens.
    #[test]
    fn samples_tile_the_stream() {
        let sizes = [9, 1, 4, 12, 0, 7, 3];
        let config = GptIndexConfig {
            sequence_length: 5,
            seed: 7,
            num_samples: Some(20),
            add_extra_token: true,
            drop_last: true,
        };
        let ix = build_gpt_indices(&sizes, &[0, 1, 2, 3, 4, 5, 6], &config).unwrap();
        let starts: Vec<i64> = ix
            .document_index
            .iter()
            .scan(0i64, |acc, &d| {
                let start = *acc;
                *acc += i64::from(sizes[d as usize]);
                Some(start)
            })
            .collect();
        let global = |row: [i64; 2]| starts[row[0] as usize] + row[1];
        for pair in ix.sample_index.windows(2) {
            assert_eq!(global(pair[1]) - global(pair[0]), 5, "{pair:?}");
        }
        assert!(
            ix.sample_index.len() > 20,
            "at least the 20 samples asked for"
        );
    }

    #[test]
    fn float32_sample_count_quirk() {
        // (2^24 + 1) tokens to cut into samples of 16: single precision rounds first.
        let sizes = [(1 << 24) + 2];
        let config = GptIndexConfig {
            sequence_length: 16,
            seed: 1,
            num_samples: None,
            add_extra_token: true,
            drop_last: false,
        };
        let ix = build_gpt_indices(&sizes, &[0], &config).unwrap();
        assert_eq!(ix.sample_index.len() - 1, 1_048_576);
    }

    #[test]
    fn empty_split_is_an_error_not_a_hang() {
        let config = GptIndexConfig {
            sequence_length: 4,
            seed: 1,
            num_samples: Some(10),
            add_extra_token: true,
            drop_last: true,
        };
        assert!(matches!(
            build_gpt_indices(&[3, 4], &[], &config),
            Err(GptIndexError::TooFewTokens { .. })
        ));
        assert!(matches!(
            build_gpt_indices(&[3, 4], &[5], &config),
            Err(GptIndexError::BadSequence { .. })
        ));
    }
}
