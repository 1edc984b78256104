//! Islands: the members of a reduction that share a fast transport (the ranks of one
//! host, or of one emulated host the plan names), and the hierarchical reduction over
//! them. A flat reduction over a group that spans hosts sends every member's whole
//! gradient over the slowest link; a hierarchical one reduce-scatters inside each island
//! first, so that each member carries only its island piece across (1/g of the bytes for
//! an island of g), between the members of the other islands that hold the same
//! elements, and then all-gathers inside its island (or, for the distributed
//! optimizer, hands each member its own shard instead).
//!
//! This module plans it (pure: which elements each member reduces and exchanges with
//! whom); `comm::hierarchical` runs the plan over MPI.

use std::ops::Range;

/// Which island each member of a group is on, and the islands in order: by their first
/// member, each island's members ascending (group ranks, not world ranks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Islands {
    islands: Vec<Vec<usize>>,
    /// Per member, (its island, its place in it).
    of: Vec<(usize, usize)>,
}

impl Islands {
    /// The islands of a group whose member `m` has island key `keys[m]` (members with
    /// equal keys share an island).
    pub fn from_keys<K: PartialEq>(keys: &[K]) -> Self {
        let mut islands: Vec<Vec<usize>> = Vec::new();
        let mut firsts: Vec<usize> = Vec::new();
        let mut of = Vec::with_capacity(keys.len());
        for (m, key) in keys.iter().enumerate() {
            let island = match firsts.iter().position(|&f| keys[f] == *key) {
                Some(i) => i,
                None => {
                    firsts.push(m);
                    islands.push(Vec::new());
                    islands.len() - 1
                }
            };
            of.push((island, islands[island].len()));
            islands[island].push(m);
        }
        Islands { islands, of }
    }

    /// The islands, each its members (group ranks) ascending.
    pub fn members(&self) -> &[Vec<usize>] {
        &self.islands
    }

    /// Members of the group.
    pub fn size(&self) -> usize {
        self.of.len()
    }

    /// Member `m`'s island and its place in it.
    pub fn of(&self, m: usize) -> (usize, usize) {
        self.of[m]
    }

    /// Whether a hierarchical reduction differs from a flat one: more than one island,
    /// and one of them holds more than one member.
    pub fn hierarchical(&self) -> bool {
        self.islands.len() > 1 && self.islands.iter().any(|i| i.len() > 1)
    }
}

/// Near-equal contiguous pieces of `numel` elements for `parts` members (the first
/// `numel % parts` one longer): each island member's piece of a hierarchical reduction.
pub fn equal_counts(numel: usize, parts: usize) -> Vec<usize> {
    let parts = parts.max(1);
    (0..parts)
        .map(|k| numel / parts + usize::from(k < numel % parts))
        .collect()
}

/// The ranges of pieces of `counts` elements laid end to end.
pub fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    (counts.iter())
        .map(|&c| {
            start += c;
            start - c..start
        })
        .collect()
}

/// Where `a` and `b` overlap, if they do.
fn overlap(a: &Range<usize>, b: &Range<usize>) -> Option<Range<usize>> {
    let range = a.start.max(b.start)..a.end.min(b.end);
    (!range.is_empty()).then_some(range)
}

/// One member's part of a hierarchical reduction of a flat buffer of `numel` elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HierarchicalPlan {
    /// Its island's pieces (one per island member, in its island's order): the
    /// reduce-scatter inside the island gives it the island's partial sum of its own.
    pub island_counts: Vec<usize>,
    /// Its own piece.
    pub piece: Range<usize>,
    /// Its piece cut where the other islands' pieces start and end, each slice with the
    /// member of every island that holds it, in island order (itself among them): the
    /// slice's partial sums go to each of the others, and each holder adds them up in
    /// island order, so every holder ends with the same bits.
    pub slices: Vec<(Range<usize>, Vec<usize>)>,
    /// Under the distributed optimizer: what it sends each island peer (group rank, the
    /// part of its piece in the peer's shard) and receives from each (group rank, the part
    /// of the peer's piece in its own shard), so that each member ends with its shard.
    pub handover: Handover,
}

/// The last step of a hierarchical reduce-scatter: the island members' pieces handed to
/// the members whose shards they hold.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Handover {
    /// (island peer, elements of this member's piece in the peer's shard).
    pub sends: Vec<(usize, Range<usize>)>,
    /// (island peer, elements of the peer's piece in this member's shard).
    pub receives: Vec<(usize, Range<usize>)>,
}

impl HierarchicalPlan {
    /// Member `me`'s part of reducing `numel` elements over `islands`; with
    /// `shards` (one count per group member, the distributed optimizer's), ending with
    /// each member's shard rather than the whole sum.
    pub fn new(islands: &Islands, me: usize, numel: usize, shards: Option<&[usize]>) -> Self {
        let piece_of = |island: &[usize]| ranges(&equal_counts(numel, island.len()));
        let (mine, place) = islands.of(me);
        let island_counts = equal_counts(numel, islands.members()[mine].len());
        let pieces: Vec<Vec<Range<usize>>> =
            islands.members().iter().map(|i| piece_of(i)).collect();
        let piece = pieces[mine][place].clone();
        // Every boundary of every island's pieces inside this piece.
        let mut cuts: Vec<usize> = (pieces.iter().flatten())
            .flat_map(|r| [r.start, r.end])
            .filter(|&c| c > piece.start && c < piece.end)
            .chain([piece.start, piece.end])
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let slices = (cuts.windows(2))
            .map(|w| w[0]..w[1])
            .filter(|s| !s.is_empty())
            .map(|slice| {
                let holders = (islands.members().iter().zip(&pieces))
                    .map(|(members, pieces)| {
                        let k = pieces.iter().position(|p| p.contains(&slice.start));
                        members[k.expect("an island's pieces cover the buffer")]
                    })
                    .collect();
                (slice, holders)
            })
            .collect();
        let handover = match shards {
            None => Handover::default(),
            Some(shards) => {
                let shards = ranges(shards);
                let members = &islands.members()[mine];
                let peers = || members.iter().enumerate().filter(|&(_, &m)| m != me);
                Handover {
                    sends: peers()
                        .filter_map(|(_, &m)| Some((m, overlap(&piece, &shards[m])?)))
                        .collect(),
                    receives: peers()
                        .filter_map(|(k, &m)| Some((m, overlap(&pieces[mine][k], &shards[me])?)))
                        .collect(),
                }
            }
        };
        HierarchicalPlan {
            island_counts,
            piece,
            slices,
            handover,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn members_with_equal_keys_share_an_island_in_order_of_first_member() {
        let islands = Islands::from_keys(&["b", "a", "b", "c", "a"]);
        assert_eq!(islands.members(), [vec![0, 2], vec![1, 4], vec![3]]);
        assert_eq!((islands.of(4), islands.of(3)), ((1, 1), (2, 0)));
        assert!(islands.hierarchical());
        assert!(!Islands::from_keys(&[1, 1, 1]).hierarchical());
        assert!(!Islands::from_keys(&[1, 2, 3]).hierarchical());
    }

    /// Islands of 2 and 3 over 12 elements: pieces [0,6) [6,12) and [0,4) [4,8) [8,12);
    /// member 0 (island 0's first) reduces [0,4) with member 1 and [4,6) with member 3.
    #[test]
    fn a_piece_is_sliced_where_the_other_islands_pieces_end() {
        let islands = Islands::from_keys(&[0, 1, 0, 1, 1]);
        let plan = HierarchicalPlan::new(&islands, 0, 12, None);
        assert_eq!(plan.island_counts, [6, 6]);
        assert_eq!(plan.piece, 0..6);
        assert_eq!(plan.slices, [(0..4, vec![0, 1]), (4..6, vec![0, 3])]);
        let plan = HierarchicalPlan::new(&islands, 3, 12, None);
        assert_eq!(plan.slices, [(4..6, vec![0, 3]), (6..8, vec![2, 3])]);
        // Shards 5, 1, 2, 2, 2: member 0's piece [0,6) holds its shard [0,5) and member
        // 1's [5,6), which is in the other island: nothing to hand over; member 2's shard
        // [6,8) comes from its own piece.
        let shards = [5, 1, 2, 2, 2];
        let plan = HierarchicalPlan::new(&islands, 0, 12, Some(&shards));
        assert_eq!(plan.handover, Handover::default());
        // Member 1 (island 1's first, piece [0,4)) receives its shard [5,6) from member 3
        // (piece [4,8)) and sends nothing to its peers' shards [8,10), [10,12).
        let plan = HierarchicalPlan::new(&islands, 1, 12, Some(&shards));
        assert_eq!(plan.handover.receives, [(3, 5..6)]);
        assert!(plan.handover.sends.is_empty());
        let plan = HierarchicalPlan::new(&islands, 3, 12, Some(&shards));
        assert_eq!(plan.handover.sends, [(1, 5..6)]);
    }

    proptest! {
        /// Every element of the buffer is reduced across islands by exactly one holder per
        /// island, the holders of a slice agree on it, and under the distributed optimizer
        /// each member receives every element of its shard exactly once (from its own
        /// piece or a peer's), every send matching a receive.
        #[test]
        fn the_plans_of_every_member_fit_together(
            keys in proptest::collection::vec(0u8..3, 1..=7),
            numel in 0usize..60,
            weights in proptest::collection::vec(0usize..5, 7),
        ) {
            let islands = Islands::from_keys(&keys);
            let n = keys.len();
            let total: usize = weights[..n].iter().sum::<usize>().max(1);
            let mut shards: Vec<usize> = weights[..n].iter().map(|w| w * numel / total).collect();
            shards[0] += numel - shards.iter().sum::<usize>();
            let plans: Vec<HierarchicalPlan> = (0..n)
                .map(|m| HierarchicalPlan::new(&islands, m, numel, Some(&shards)))
                .collect();
            for e in 0..numel {
                for (i, members) in islands.members().iter().enumerate() {
                    let holders: Vec<usize> = members.iter().copied()
                        .filter(|&m| plans[m].piece.contains(&e)).collect();
                    prop_assert_eq!(holders.len(), 1, "element {} in island {}", e, i);
                    let h = holders[0];
                    let slice = plans[h].slices.iter().find(|(s, _)| s.contains(&e)).unwrap();
                    for &other in &slice.1 {
                        let theirs = plans[other].slices.iter().find(|(s, _)| s.contains(&e)).unwrap();
                        prop_assert_eq!(theirs, slice);
                    }
                }
            }
            let shard_ranges = ranges(&shards);
            for (m, plan) in plans.iter().enumerate() {
                let mut got: Vec<usize> = (plan.handover.receives.iter())
                    .flat_map(|(_, r)| r.clone())
                    .chain(overlap(&plan.piece, &shard_ranges[m]).unwrap_or(0..0))
                    .collect();
                got.sort_unstable();
                prop_assert_eq!(got, shard_ranges[m].clone().collect::<Vec<_>>());
                for (peer, range) in &plan.handover.sends {
                    prop_assert!(plans[*peer].handover.receives.contains(&(m, range.clone())));
                }
            }
        }
    }
}
