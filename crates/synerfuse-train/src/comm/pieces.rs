//! Collectives over the uneven pieces of one flat buffer (the distributed optimizer's
//! shards, sized by each member's memory): member `m`'s piece is the `counts[m]` elements
//! after `counts[..m]`. NCCL's reduce-scatter and all-gather take equal pieces only, so
//! the NCCL calls are planned here, apart from NCCL, where a CPU test can check them.

use super::CommError;

/// One NCCL call of a collective over the pieces of a flat buffer, in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceCall {
    /// Every piece has `count` elements: one `ncclReduceScatter` (or `ncclAllGather`)
    /// over the whole buffer, member `m`'s piece at `m * count`.
    Equal {
        /// Elements of each piece.
        count: usize,
    },
    /// Member `root`'s piece, `count` elements at `offset`: `ncclReduce` to `root` (or
    /// `ncclBroadcast` from it).
    Rooted {
        /// The member whose piece it is.
        root: usize,
        /// Its first element.
        offset: usize,
        /// Its elements (never 0).
        count: usize,
    },
}

/// The NCCL calls of a collective over pieces of `counts` elements: one call over the
/// whole buffer when the pieces are equal, otherwise one rooted call per non-empty piece
/// (issued in one NCCL group, so they proceed together), and no call for an empty buffer.
///
/// Rooted calls rather than a reduce-scatter over pieces padded to the longest: a ring
/// `ncclReduce` of `c` elements has every member but the root send `c`, so the grouped
/// calls move `(n - 1) / n` of the buffer per member on average, as a reduce-scatter
/// does, while padding moves `(n - 1) * max(counts)` (more whenever the pieces differ)
/// and needs a padded copy of the whole buffer (for gradients, a second gradient buffer)
/// and copy kernels on either side. Not measured on GPUs yet.
pub(crate) fn piece_calls(counts: &[usize]) -> Vec<PieceCall> {
    match counts.first() {
        _ if counts.iter().all(|&c| c == 0) => Vec::new(),
        Some(&count) if counts.iter().all(|&c| c == count) => vec![PieceCall::Equal { count }],
        _ => {
            let starts = counts
                .iter()
                .scan(0, |at, &c| Some(std::mem::replace(at, *at + c)));
            (counts.iter().zip(starts).enumerate())
                .filter(|(_, (&count, _))| count > 0)
                .map(|(root, (&count, offset))| PieceCall::Rooted {
                    root,
                    offset,
                    count,
                })
                .collect()
        }
    }
}

/// Each piece's first element, when `counts` has one piece per member of a group of
/// `size` and the pieces cover a buffer of `numel` elements exactly; refused otherwise
/// (alike on every member, before any message).
pub(crate) fn piece_starts(
    rank: usize,
    size: usize,
    counts: &[usize],
    numel: usize,
    op: &'static str,
) -> Result<Vec<usize>, CommError> {
    let total = counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
    if counts.len() != size || total != Some(numel) {
        return Err(CommError::ScatterCounts {
            rank,
            op,
            counts: counts.to_vec(),
            size,
            elements: numel,
        });
    }
    Ok(counts
        .iter()
        .scan(0, |at, &c| Some(std::mem::replace(at, *at + c)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Elements of the buffer that `counts`' calls reduce (or carry) in all.
    fn covered(counts: &[usize]) -> usize {
        (piece_calls(counts).iter())
            .map(|call| match *call {
                PieceCall::Equal { count } => count * counts.len(),
                PieceCall::Rooted { count, .. } => count,
            })
            .sum()
    }

    #[test]
    fn equal_pieces_take_one_call_over_the_buffer() {
        assert_eq!(piece_calls(&[4, 4, 4]), vec![PieceCall::Equal { count: 4 }]);
        assert_eq!(covered(&[4, 4, 4]), 12);
    }

    #[test]
    fn uneven_pieces_reduce_each_element_once() {
        let counts = [5, 0, 3, 8];
        assert_eq!(
            piece_calls(&counts),
            vec![
                PieceCall::Rooted {
                    root: 0,
                    offset: 0,
                    count: 5
                },
                PieceCall::Rooted {
                    root: 2,
                    offset: 5,
                    count: 3
                },
                PieceCall::Rooted {
                    root: 3,
                    offset: 8,
                    count: 8
                },
            ]
        );
        // The buffer's length, not members × length (what an all-reduce would sum).
        assert_eq!(covered(&counts), 16);
    }

    #[test]
    fn empty_pieces_issue_no_call() {
        assert!(piece_calls(&[]).is_empty());
        assert!(piece_calls(&[0, 0]).is_empty());
        assert_eq!(
            piece_calls(&[0, 7]),
            vec![PieceCall::Rooted {
                root: 1,
                offset: 0,
                count: 7
            }]
        );
    }

    #[test]
    fn every_plan_covers_the_buffer_once() {
        for counts in [
            vec![1],
            vec![2, 3],
            vec![3, 3],
            vec![0, 1, 0, 2, 9],
            vec![6; 8],
        ] {
            let numel: usize = counts.iter().sum();
            assert_eq!(covered(&counts), numel, "{counts:?}");
            // Each element lies in exactly one call's range.
            let mut seen = vec![0; numel];
            for call in piece_calls(&counts) {
                let ranges: Vec<(usize, usize)> = match call {
                    PieceCall::Equal { count } => {
                        (0..counts.len()).map(|m| (m * count, count)).collect()
                    }
                    PieceCall::Rooted { offset, count, .. } => vec![(offset, count)],
                };
                for (at, n) in ranges {
                    seen[at..at + n].iter_mut().for_each(|s| *s += 1);
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "{counts:?}: {seen:?}");
        }
    }

    #[test]
    fn counts_must_cover_the_buffer_one_per_member() {
        assert_eq!(piece_starts(0, 3, &[2, 0, 5], 7, "op").unwrap(), [0, 2, 2]);
        for (counts, numel) in [
            (vec![2, 5], 7),
            (vec![2, 0, 4], 7),
            (vec![usize::MAX, 1, 0], 0),
        ] {
            let err = piece_starts(1, 3, &counts, numel, "op").unwrap_err();
            assert!(
                matches!(err, CommError::ScatterCounts { rank: 1, .. }),
                "{err}"
            );
        }
    }
}
