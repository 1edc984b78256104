//! The documents a GPT dataset cuts samples from: a tokenized `.bin/.idx` dataset, or
//! Megatron's mock documents (`--mock-data`, megatron-core's `MockGPTLowLevelDataset`).

use crate::{DataError, IndexedDataset};
use std::ops::Range;
use std::path::Path;

/// Where a GPT dataset reads its documents.
pub trait DocumentSource: std::fmt::Debug + Send + Sync {
    /// Where the documents come from, for messages.
    fn origin(&self) -> &Path;

    /// Number of documents (sequences).
    fn sequence_count(&self) -> usize;

    /// Every document's length in tokens.
    fn lengths(&self) -> Vec<i32>;

    /// Tokens in the documents `range`.
    fn tokens_in(&self, range: Range<usize>) -> u64;

    /// `length` tokens (all to its end by default) of document `i` from `offset`.
    fn get_i64(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<Vec<i64>, DataError>;

    /// Whether the GPT indices over these documents go to Megatron's cache files (mock
    /// documents are drawn again each run, as Megatron does without `--data-cache-path`).
    fn cached(&self) -> bool {
        true
    }
}

impl DocumentSource for IndexedDataset {
    fn origin(&self) -> &Path {
        self.prefix()
    }

    fn sequence_count(&self) -> usize {
        self.len()
    }

    fn lengths(&self) -> Vec<i32> {
        self.sequence_lengths().to_vec()
    }

    fn tokens_in(&self, range: Range<usize>) -> u64 {
        let lengths = self.sequence_lengths();
        (lengths.iter().skip(range.start).take(range.len()))
            .map(|s| s.max(0) as u64)
            .sum()
    }

    fn get_i64(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<Vec<i64>, DataError> {
        IndexedDataset::get_i64(self, i, offset, length)
    }
}

/// Megatron's mock documents: 100 000 documents whose lengths numpy's
/// `default_rng(seed=0).integers(1, 4096, dtype=int32)` draws; document `i` of length `n`
/// holds `1, 2, ..., n − 1` and then the tokenizer's EOD id.
#[derive(Debug, Clone)]
pub struct MockDocuments {
    lengths: Vec<i32>,
    eod: i64,
}

impl MockDocuments {
    /// Documents (megatron-core's `MockGPTLowLevelDataset.size`).
    pub const SIZE: usize = 100_000;
    /// Lengths are drawn from `1..MAX_SEQUENCE_LENGTH`.
    pub const MAX_SEQUENCE_LENGTH: u32 = 4096;

    /// The documents, ending in `eod`.
    pub fn new(eod: i64) -> Self {
        let mut rng = Pcg64::from_seed_sequence(0);
        let lengths = (0..Self::SIZE)
            .map(|_| 1 + rng.bounded_u32(Self::MAX_SEQUENCE_LENGTH - 2) as i32)
            .collect();
        MockDocuments { lengths, eod }
    }

    /// The largest token id the documents hold: a model's vocabulary must exceed it.
    pub fn max_token(&self) -> i64 {
        let longest = self.lengths.iter().copied().max().unwrap_or(0);
        i64::from(longest - 1).max(self.eod)
    }
}

impl DocumentSource for MockDocuments {
    fn origin(&self) -> &Path {
        Path::new("--mock-data")
    }

    fn sequence_count(&self) -> usize {
        self.lengths.len()
    }

    fn lengths(&self) -> Vec<i32> {
        self.lengths.clone()
    }

    fn tokens_in(&self, range: Range<usize>) -> u64 {
        self.lengths[range].iter().map(|&n| n as u64).sum()
    }

    fn get_i64(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<Vec<i64>, DataError> {
        let out_of_range = |detail: String| DataError::OutOfRange {
            path: self.origin().to_path_buf(),
            what: "sequence",
            detail,
        };
        let n = *self
            .lengths
            .get(i)
            .ok_or_else(|| out_of_range(format!("document {i} of {}", self.lengths.len())))?
            as usize;
        let length = length.unwrap_or(n.saturating_sub(offset));
        if offset + length > n {
            return Err(out_of_range(format!(
                "tokens {offset}..{} of document {i} ({n} tokens)",
                offset + length
            )));
        }
        let token = |k: usize| if k + 1 == n { self.eod } else { k as i64 + 1 };
        Ok((offset..offset + length).map(token).collect())
    }

    fn cached(&self) -> bool {
        false
    }
}

/// numpy's `PCG64` bit generator seeded through its `SeedSequence`, with `Generator`'s
/// 32-bit draws (enough for `integers(..., dtype=int32)`).
#[derive(Debug, Clone)]
struct Pcg64 {
    state: u128,
    increment: u128,
    /// The high half of the last 64-bit output, not yet used as a 32-bit draw.
    buffered: Option<u32>,
}

const PCG_MULTIPLIER: u128 = 0x2360_ED05_1FC6_5DA4_4385_DF64_9FCC_F645;

impl Pcg64 {
    /// `PCG64(SeedSequence(entropy))` for an entropy below 2^32.
    fn from_seed_sequence(entropy: u32) -> Self {
        let words = seed_sequence_state(entropy, 8);
        let word = |i: usize| u64::from(words[2 * i]) | (u64::from(words[2 * i + 1]) << 32);
        let seed = (u128::from(word(0)) << 64) | u128::from(word(1));
        let sequence = (u128::from(word(2)) << 64) | u128::from(word(3));
        let mut rng = Pcg64 {
            state: 0,
            increment: (sequence << 1) | 1,
            buffered: None,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(seed);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self
            .state
            .wrapping_mul(PCG_MULTIPLIER)
            .wrapping_add(self.increment);
    }

    /// The XSL-RR output of the next state.
    fn next_u64(&mut self) -> u64 {
        self.step();
        let folded = ((self.state >> 64) as u64) ^ (self.state as u64);
        folded.rotate_right((self.state >> 122) as u32)
    }

    /// numpy's `next_uint32`: the low half of a 64-bit output, then its high half.
    fn next_u32(&mut self) -> u32 {
        if let Some(high) = self.buffered.take() {
            return high;
        }
        let next = self.next_u64();
        self.buffered = Some((next >> 32) as u32);
        next as u32
    }

    /// A draw from `0..=range` by Lemire's method, as numpy's
    /// `buffered_bounded_lemire_uint32`.
    fn bounded_u32(&mut self, range: u32) -> u32 {
        let exclusive = u64::from(range) + 1;
        let mut m = u64::from(self.next_u32()) * exclusive;
        let mut leftover = m as u32;
        if u64::from(leftover) < exclusive {
            let threshold = ((u64::from(u32::MAX) - u64::from(range)) % exclusive) as u32;
            while leftover < threshold {
                m = u64::from(self.next_u32()) * exclusive;
                leftover = m as u32;
            }
        }
        (m >> 32) as u32
    }
}

/// numpy's `SeedSequence(entropy).generate_state(words, uint32)` (pool of 4 words, no
/// spawn key), for an entropy below 2^32.
fn seed_sequence_state(entropy: u32, words: usize) -> Vec<u32> {
    const INIT_A: u32 = 0x43b0_d7e5;
    const MULT_A: u32 = 0x931e_8875;
    const INIT_B: u32 = 0x8b51_f9dd;
    const MULT_B: u32 = 0x58f3_8ded;
    const MIX_MULT_L: u32 = 0xca01_f9dd;
    const MIX_MULT_R: u32 = 0x4973_f715;
    let mut hash_const = INIT_A;
    let mut hashmix = |value: u32| {
        let mut value = value ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_A);
        value = value.wrapping_mul(hash_const);
        value ^ (value >> 16)
    };
    let mix = |x: u32, y: u32| {
        let result = MIX_MULT_L
            .wrapping_mul(x)
            .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
        result ^ (result >> 16)
    };
    let mut pool = [0u32; 4];
    for (i, slot) in pool.iter_mut().enumerate() {
        *slot = hashmix(if i == 0 { entropy } else { 0 });
    }
    for src in 0..4 {
        for dst in 0..4 {
            if src != dst {
                pool[dst] = mix(pool[dst], hashmix(pool[src]));
            }
        }
    }
    let mut hash_const = INIT_B;
    (0..words)
        .map(|i| {
            let mut value = pool[i % 4] ^ hash_const;
            hash_const = hash_const.wrapping_mul(MULT_B);
            value = value.wrapping_mul(hash_const);
            value ^ (value >> 16)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_token_is_the_largest_id_held() {
        let docs = MockDocuments::new(3);
        let longest = (0..docs.sequence_count())
            .max_by_key(|&i| docs.lengths[i])
            .unwrap();
        let held = docs.get_i64(longest, 0, None).unwrap();
        assert_eq!(docs.max_token(), *held.iter().max().unwrap());
        assert_eq!(MockDocuments::new(50_000).max_token(), 50_000);
    }

    /// Vectors from numpy 2.4: `SeedSequence(0).generate_state(8)`,
    /// `default_rng(0).integers(1, 4096, size=100000, dtype=np.int32)` (head, tail and
    /// sum), and PCG64's raw 64-bit stream.
    #[test]
    fn numpy_streams_are_reproduced() {
        assert_eq!(seed_sequence_state(0, 8), SEED_SEQUENCE_0);
        let mut rng = Pcg64::from_seed_sequence(0);
        let raw: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(raw, PCG64_RAW_0);
        let mock = MockDocuments::new(7);
        assert_eq!(&mock.lengths[..8], MOCK_HEAD);
        assert_eq!(&mock.lengths[MockDocuments::SIZE - 4..], MOCK_TAIL);
        let sum: i64 = mock.lengths.iter().map(|&n| i64::from(n)).sum();
        assert_eq!(sum, MOCK_SUM);
    }

    const SEED_SEQUENCE_0: [u32; 8] = [
        0xb0f4_78be,
        0xdb2c_d7e7,
        0x2c71_ba49,
        0xabf4_641a,
        0x9d7b_8d41,
        0x20c6_ed6d,
        0x223c_39d4,
        0x2c40_99de,
    ];
    const PCG64_RAW_0: [u64; 3] = [
        0xa30f_ebcf_d9c2_825f,
        0x4510_bdf8_82d9_d721,
        0x0a7d_3da9_4ecd_e8b8,
    ];
    const MOCK_HEAD: [i32; 8] = [3484, 2609, 2094, 1105, 1261, 168, 309, 68];
    const MOCK_TAIL: [i32; 4] = [2592, 61, 100, 769];
    const MOCK_SUM: i64 = 204_637_097;

    #[test]
    fn mock_documents_count_up_to_their_eod() {
        let mock = MockDocuments::new(7);
        let n = mock.lengths[0] as usize;
        let doc = mock.get_i64(0, 0, None).unwrap();
        assert_eq!(doc.len(), n);
        assert_eq!(doc[0], 1);
        assert_eq!(doc[n - 1], 7);
        assert_eq!(mock.get_i64(0, 1, Some(2)).unwrap(), [2, 3]);
        assert!(mock.get_i64(0, n, Some(1)).is_err());
        assert!(mock.get_i64(MockDocuments::SIZE, 0, None).is_err());
    }
}
