//! Context parallelism's split of a sequence over a group of ranks, evenly or in shares.
//!
//! Under causal attention the token at position `p` attends over `p + 1` positions, so
//! cutting a sequence into contiguous blocks gives the last rank the most work. Positions
//! `p` and `S − 1 − p` together cost the same whatever `p` is: two tokens for the linear
//! layers and `S + 1` query-key products for attention. A [`ContextSplit`] therefore
//! deals out these *pairs*, a contiguous block of them per rank, in proportion to the
//! ranks' shares: every rank's work, linear and attention alike, is proportional to its
//! share (up to one pair of rounding), and each rank holds two contiguous chunks, one from
//! the head of the sequence and its mirror from the tail. With equal shares this is
//! exactly Megatron's load-balanced layout (the sequence cut into `2N` chunks, rank `i`
//! holding chunks `i` and `2N − 1 − i`).

use crate::tp::split_units;
use std::ops::Range;

/// Why a sequence cannot be split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContextSplitError {
    /// No ranks, or a share of 0.
    #[error("context-parallel shares {shares:?}: every rank needs a positive share")]
    BadShares {
        /// The shares given.
        shares: Vec<u32>,
    },
    /// An even split whose chunks would not be whole (Megatron's requirement).
    #[error(
        "sequence length {sequence} is not divisible by 2 x the context-parallel size {ranks}"
    )]
    NotDivisible {
        /// Tokens per sample.
        sequence: usize,
        /// Ranks of the group.
        ranks: usize,
    },
    /// A split in shares of an odd sequence (positions are dealt out in pairs).
    #[error("sequence length {sequence} is odd: context parallelism deals out position pairs")]
    OddSequence {
        /// Tokens per sample.
        sequence: usize,
    },
    /// A split in shares of a sequence too short for every rank to get a pair.
    #[error("sequence length {sequence} gives rank {rank} of the context-parallel shares {shares:?} no tokens (at least 2 tokens per share unit)")]
    TooShort {
        /// Tokens per sample.
        sequence: usize,
        /// The shares given.
        shares: Vec<u32>,
        /// A rank left without tokens.
        rank: usize,
    },
}

/// Which positions of a sequence each rank of a context-parallel group holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextSplit {
    sequence: usize,
    /// Each rank's block of position pairs `(p, S − 1 − p)`, `p` in the block.
    pairs: Vec<Range<usize>>,
}

impl ContextSplit {
    /// Megatron's layout for `ranks` equal ranks: `sequence` must divide by `2 × ranks`.
    pub fn even(sequence: usize, ranks: usize) -> Result<Self, ContextSplitError> {
        if ranks == 0 {
            return Err(ContextSplitError::BadShares { shares: Vec::new() });
        }
        if sequence % (2 * ranks) != 0 {
            return Err(ContextSplitError::NotDivisible { sequence, ranks });
        }
        Self::in_shares(sequence, &vec![1; ranks])
    }

    /// Position pairs dealt out in proportion to `shares` (largest remainder), one
    /// contiguous block per rank in rank order; `sequence` must be even and leave every
    /// rank at least one pair.
    pub fn in_shares(sequence: usize, shares: &[u32]) -> Result<Self, ContextSplitError> {
        if shares.is_empty() || shares.contains(&0) {
            return Err(ContextSplitError::BadShares {
                shares: shares.to_vec(),
            });
        }
        if sequence % 2 == 1 {
            return Err(ContextSplitError::OddSequence { sequence });
        }
        let pairs = split_units(shares, sequence / 2);
        if let Some(rank) = pairs.iter().position(|p| p.is_empty()) {
            return Err(ContextSplitError::TooShort {
                sequence,
                shares: shares.to_vec(),
                rank,
            });
        }
        Ok(ContextSplit { sequence, pairs })
    }

    /// Ranks of the group.
    pub fn ranks(&self) -> usize {
        self.pairs.len()
    }

    /// Tokens per sample.
    pub fn sequence(&self) -> usize {
        self.sequence
    }

    /// `rank`'s positions, ascending: a chunk from the head of the sequence and its
    /// mirror from the tail.
    pub fn positions(&self, rank: usize) -> [Range<usize>; 2] {
        let block = &self.pairs[rank];
        let s = self.sequence;
        [block.clone(), s - block.end..s - block.start]
    }

    /// `rank`'s positions, one by one, in its local order (head chunk, then tail chunk).
    pub fn position_list(&self, rank: usize) -> Vec<usize> {
        self.positions(rank).into_iter().flatten().collect()
    }

    /// Tokens `rank` holds.
    pub fn tokens(&self, rank: usize) -> usize {
        2 * self.pairs[rank].len()
    }

    /// Query-key products of causal attention over `rank`'s tokens: Σ (p + 1).
    pub fn attention_products(&self, rank: usize) -> u64 {
        (self.position_list(rank).iter())
            .map(|&p| p as u64 + 1)
            .sum()
    }

    /// For every position of the sequence, its index in the ranks' tokens laid end to
    /// end in rank order (what an all-gather of every rank's tokens gives): gathering
    /// by these indices puts gathered keys and values back in position order.
    pub fn gather_order(&self) -> Vec<usize> {
        let mut order = vec![0; self.sequence];
        let mut at = 0;
        for rank in 0..self.ranks() {
            for p in self.position_list(rank) {
                order[p] = at;
                at += 1;
            }
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn equal_shares_are_megatrons_load_balanced_chunks() {
        for ranks in 1..=4 {
            let sequence = 2 * ranks * 3;
            let split = ContextSplit::even(sequence, ranks).unwrap();
            let chunk = sequence / (2 * ranks);
            for i in 0..ranks {
                let j = 2 * ranks - 1 - i;
                assert_eq!(
                    split.positions(i),
                    [i * chunk..(i + 1) * chunk, j * chunk..(j + 1) * chunk]
                );
            }
        }
        assert_eq!(
            ContextSplit::even(10, 3),
            Err(ContextSplitError::NotDivisible {
                sequence: 10,
                ranks: 3
            })
        );
    }

    #[test]
    fn too_short_or_odd_sequences_and_zero_shares_are_refused() {
        assert!(matches!(
            ContextSplit::in_shares(4, &[3, 1, 1]),
            Err(ContextSplitError::TooShort { rank: 2, .. })
        ));
        assert_eq!(
            ContextSplit::in_shares(9, &[1, 1]),
            Err(ContextSplitError::OddSequence { sequence: 9 })
        );
        assert!(matches!(
            ContextSplit::in_shares(8, &[1, 0]),
            Err(ContextSplitError::BadShares { .. })
        ));
    }

    proptest! {
        /// Every position is held once; each rank's tokens and attention products are
        /// its share of the whole, up to one pair; the gather order inverts the layout.
        #[test]
        fn shares_split_tokens_and_attention_work_alike(
            shares in proptest::collection::vec(1u32..5, 1..5),
            per_unit in 1usize..20,
            extra in 0usize..10,
        ) {
            // Enough pairs for every share unit to get one: no rank is left empty.
            let units = shares.iter().sum::<u32>() as usize;
            let sequence = 2 * (units * per_unit + extra);
            let split = ContextSplit::in_shares(sequence, &shares).unwrap();
            let mut seen = vec![0; sequence];
            for rank in 0..split.ranks() {
                for p in split.position_list(rank) {
                    seen[p] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
            let total: u32 = shares.iter().sum();
            let pair_products = sequence as f64 + 1.0;
            let all_products = (sequence * (sequence + 1) / 2) as f64;
            for (rank, &share) in shares.iter().enumerate() {
                let fair = f64::from(share) / f64::from(total);
                let tokens = split.tokens(rank) as f64;
                prop_assert!((tokens - fair * sequence as f64).abs() <= 2.0);
                let products = split.attention_products(rank) as f64;
                prop_assert!((products - fair * all_products).abs() <= pair_products);
            }
            let order = split.gather_order();
            let mut laid: Vec<usize> = (0..split.ranks()).flat_map(|r| split.position_list(r)).collect();
            let placed: Vec<usize> = (0..sequence).map(|p| laid[order[p]]).collect();
            prop_assert_eq!(placed, (0..sequence).collect::<Vec<_>>());
            laid.sort_unstable();
            prop_assert_eq!(laid, (0..sequence).collect::<Vec<_>>());
        }
    }
}
