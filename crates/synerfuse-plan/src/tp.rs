//! How the ranks of one tensor-parallel group divide a stage: attention in units of query
//! groups (a key/value head and the query heads that share it), FFN columns and
//! vocabulary rows, each in proportion to the ranks' shares and rounded to whole units.
//!
//! Even shares follow Megatron: query groups and FFN columns must divide evenly (its
//! `--num-query-groups` and `--ffn-hidden-size` checks). Uneven shares (unequal devices in
//! one group) round by largest remainder, ties to the lower rank, and refuse a rank left
//! with nothing. The vocabulary always rounds: unlike Megatron we need no padding rows.

use std::ops::Range;

/// Shares that cannot divide a stage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TpSplitError {
    /// No ranks.
    #[error("a tensor-parallel group needs at least one rank")]
    NoRanks,
    /// A share of zero.
    #[error("tensor-parallel rank {rank} has share 0; every share must be at least 1")]
    ZeroShare {
        /// The rank within the group.
        rank: usize,
    },
    /// Even shares over units that do not divide.
    #[error("{units} {what} do not divide over tensor-parallel size {size}")]
    NotDivisible {
        /// `query groups (--num-query-groups)` or `FFN columns (--ffn-hidden-size)`.
        what: &'static str,
        /// Units to divide.
        units: usize,
        /// Ranks.
        size: usize,
    },
    /// Shares that leave a rank without any unit.
    #[error("tensor-parallel shares {shares:?} leave rank {rank} with no {what} (of {units}; each rank needs at least one)")]
    EmptyShard {
        /// The shares.
        shares: Vec<u32>,
        /// The rank left empty.
        rank: usize,
        /// What it gets none of.
        what: &'static str,
        /// Units to divide.
        units: usize,
    },
}

/// `units` split into contiguous ranges, one per share, proportional to the shares and
/// rounded by largest remainder (ties to the lower rank).
pub fn split_units(shares: &[u32], units: usize) -> Vec<Range<usize>> {
    let total: u64 = shares.iter().map(|&s| u64::from(s)).sum();
    if total == 0 {
        return vec![0..0; shares.len()];
    }
    let exact: Vec<(u64, u64)> = shares
        .iter()
        .map(|&s| {
            let scaled = u64::from(s) * units as u64;
            (scaled / total, scaled % total)
        })
        .collect();
    let mut counts: Vec<u64> = exact.iter().map(|&(q, _)| q).collect();
    let left = units as u64 - counts.iter().sum::<u64>();
    let mut order: Vec<usize> = (0..shares.len()).collect();
    order.sort_by(|&a, &b| exact[b].1.cmp(&exact[a].1).then(a.cmp(&b)));
    for &rank in order.iter().take(left as usize) {
        counts[rank] += 1;
    }
    let mut start = 0;
    counts
        .into_iter()
        .map(|n| {
            let range = start..start + n as usize;
            start = range.end;
            range
        })
        .collect()
}

/// `units` split by `shares`: even shares must divide them (but the vocabulary, which
/// always rounds), and no rank may be left empty.
fn split_shares(
    shares: &[u32],
    units: usize,
    what: &'static str,
) -> Result<Vec<Range<usize>>, TpSplitError> {
    let uneven = shares.iter().any(|&s| s != shares[0]);
    if !uneven && what != "vocabulary rows" && units % shares.len() != 0 {
        return Err(TpSplitError::NotDivisible {
            what,
            units,
            size: shares.len(),
        });
    }
    let ranges = split_units(shares, units);
    match ranges.iter().position(Range::is_empty) {
        Some(rank) => Err(TpSplitError::EmptyShard {
            shares: shares.to_vec(),
            rank,
            what,
            units,
        }),
        None => Ok(ranges),
    }
}

/// What each rank of a tensor-parallel group holds of a stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpLayout {
    /// The shares (all equal when none were given).
    pub shares: Vec<u32>,
    /// Query groups (key/value heads) per rank.
    pub query_groups: Vec<Range<usize>>,
    /// FFN columns per rank.
    pub ffn_columns: Vec<Range<usize>>,
    /// Each expert's FFN columns per rank (an MoE layer's).
    pub expert_columns: Vec<Range<usize>>,
    /// Vocabulary rows per rank (embedding and output layer).
    pub vocab_rows: Vec<Range<usize>>,
}

impl TpLayout {
    /// The split of a model with `query_groups` key/value heads, `ffn` FFN columns and
    /// `vocab` rows over ranks with `shares` (`None`: `size` equal shares, as Megatron).
    pub fn new(
        shares: Option<&[u32]>,
        size: usize,
        query_groups: usize,
        ffn: usize,
        vocab: usize,
    ) -> Result<Self, TpSplitError> {
        let even = vec![1; size];
        let shares = shares.unwrap_or(&even);
        if shares.is_empty() {
            return Err(TpSplitError::NoRanks);
        }
        if let Some(rank) = shares.iter().position(|&s| s == 0) {
            return Err(TpSplitError::ZeroShare { rank });
        }
        let shares = shares.to_vec();
        // In this order: an error names the query groups before the FFN columns.
        let query_groups =
            split_shares(&shares, query_groups, "query groups (--num-query-groups)")?;
        let ffn_columns = split_shares(&shares, ffn, "FFN columns (--ffn-hidden-size)")?;
        Ok(TpLayout {
            query_groups,
            expert_columns: ffn_columns.clone(),
            ffn_columns,
            vocab_rows: split_shares(&shares, vocab, "vocabulary rows")?,
            shares,
        })
    }

    /// The layout with each expert's `ffn` columns (`--moe-ffn-hidden-size`) split by
    /// the same shares (by default the experts are as wide as the dense FFN).
    pub fn with_expert_ffn(mut self, ffn: usize) -> Result<Self, TpSplitError> {
        self.expert_columns = split_shares(
            &self.shares,
            ffn,
            "expert FFN columns (--moe-ffn-hidden-size)",
        )?;
        Ok(self)
    }

    /// What each rank holds, for the log: the shares and each split with its rounding
    /// (`shares [3, 1]: query groups 3 + 1 of 4, FFN columns 48 + 16 of 64, ...`).
    pub fn describe(&self) -> String {
        let split = |ranges: &[Range<usize>], what: &str| {
            let counts: Vec<String> = ranges.iter().map(|r| r.len().to_string()).collect();
            let total = ranges.last().map_or(0, |r| r.end);
            format!("{what} {} of {total}", counts.join(" + "))
        };
        format!(
            "shares {:?}: {}, {}, {}",
            self.shares,
            split(&self.query_groups, "query groups"),
            split(&self.ffn_columns, "FFN columns"),
            split(&self.vocab_rows, "vocabulary rows")
        )
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.shares.len()
    }

    /// What `rank` holds.
    pub fn shard(&self, rank: usize) -> Option<TpShard> {
        Some(TpShard {
            rank,
            size: self.size(),
            query_groups: self.query_groups.get(rank)?.clone(),
            ffn_columns: self.ffn_columns.get(rank)?.clone(),
            expert_columns: self.expert_columns.get(rank)?.clone(),
            vocab_rows: self.vocab_rows.get(rank)?.clone(),
            experts: None,
        })
    }
}

/// One rank's part of a stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpShard {
    /// Its rank in the tensor-parallel group.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
    /// Its query groups (key/value heads).
    pub query_groups: Range<usize>,
    /// Its FFN columns.
    pub ffn_columns: Range<usize>,
    /// Its FFN columns of each expert.
    pub expert_columns: Range<usize>,
    /// Its vocabulary rows.
    pub vocab_rows: Range<usize>,
    /// The experts of each of its MoE layers it holds, in order (expert parallelism:
    /// the rest are its expert-parallel group's other members'); `None`: all.
    pub experts: Option<Vec<usize>>,
}

impl TpShard {
    /// The whole stage on one rank (experts as wide as the dense FFN; see
    /// [`TpLayout::with_expert_ffn`]).
    pub fn whole(query_groups: usize, ffn: usize, vocab: usize) -> Self {
        TpShard {
            rank: 0,
            size: 1,
            query_groups: 0..query_groups,
            ffn_columns: 0..ffn,
            expert_columns: 0..ffn,
            vocab_rows: 0..vocab,
            experts: None,
        }
    }

    /// Whether it is the whole stage.
    pub fn is_whole(&self) -> bool {
        self.size == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn even_shares_follow_megatron() {
        let layout = TpLayout::new(None, 2, 4, 64, 101).unwrap();
        assert_eq!(layout.query_groups, [0..2, 2..4]);
        assert_eq!(layout.ffn_columns, [0..32, 32..64]);
        // The vocabulary rounds instead of padding.
        assert_eq!(layout.vocab_rows, [0..51, 51..101]);
        assert_eq!(
            layout.describe(),
            "shares [1, 1]: query groups 2 + 2 of 4, FFN columns 32 + 32 of 64, vocabulary rows 51 + 50 of 101"
        );
        assert_eq!(
            TpLayout::new(None, 2, 3, 64, 100),
            Err(TpSplitError::NotDivisible {
                what: "query groups (--num-query-groups)",
                units: 3,
                size: 2
            })
        );
    }

    #[test]
    fn uneven_shares_round_to_whole_units_and_refuse_empty_ranks() {
        let layout = TpLayout::new(Some(&[3, 1]), 2, 4, 64, 100).unwrap();
        assert_eq!(layout.query_groups, [0..3, 3..4]);
        assert_eq!(layout.ffn_columns, [0..48, 48..64]);
        assert_eq!(layout.vocab_rows, [0..75, 75..100]);
        // 2 query groups in 3 : 1 are 1.5 : 0.5; the tie goes to rank 0, leaving rank 1 none.
        let err = TpLayout::new(Some(&[3, 1]), 2, 2, 64, 100).unwrap_err();
        assert!(
            matches!(err, TpSplitError::EmptyShard { rank: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("no query groups"), "{err}");
        assert_eq!(
            TpLayout::new(Some(&[1, 0]), 2, 2, 64, 100),
            Err(TpSplitError::ZeroShare { rank: 1 })
        );
    }

    proptest! {
        /// The ranges tile 0..units in order, and each is within one unit of its exact share.
        #[test]
        fn splits_tile_and_stay_within_one_unit(
            shares in prop::collection::vec(1u32..8, 1..6),
            units in 0usize..500,
        ) {
            let ranges = split_units(&shares, units);
            prop_assert_eq!(ranges.len(), shares.len());
            prop_assert_eq!(ranges.first().map(|r| r.start), Some(0));
            prop_assert_eq!(ranges.last().map(|r| r.end), Some(units));
            for w in ranges.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            let total: u32 = shares.iter().sum();
            for (r, s) in ranges.iter().zip(&shares) {
                let exact = f64::from(*s) * units as f64 / f64::from(total);
                prop_assert!((r.len() as f64 - exact).abs() < 1.0, "{:?} for exact {}", r, exact);
            }
        }
    }
}
