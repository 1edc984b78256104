//! A global batch split over replicas whose micro-batch sizes differ: the exact min-max
//! split when each replica's pipeline time grows by a fixed step per micro-batch (the
//! 1F1B closed form).

use std::collections::BTreeMap;

/// One replica's pace: its micro-batch size, its pipeline's time with one micro-batch
/// (fill and drain), and the time each further micro-batch adds (its slowest stage).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaPace {
    /// Samples per micro-batch.
    pub micro_batch_size: usize,
    /// Seconds with one micro-batch.
    pub first_s: f64,
    /// Seconds each further micro-batch adds.
    pub each_s: f64,
    /// The most micro-batches the replica holds (memory: a pipeline stage keeps up to
    /// its depth in flight); `usize::MAX` when any count fits.
    pub most_micro_batches: usize,
}

impl ReplicaPace {
    /// Seconds with `m` micro-batches.
    pub fn time(&self, m: usize) -> f64 {
        self.first_s + m.saturating_sub(1) as f64 * self.each_s
    }

    /// The most micro-batches, at most `cap`, that end within `limit_s` (0: not one).
    fn most_within(&self, limit_s: f64, cap: usize) -> usize {
        let cap = cap.min(self.most_micro_batches);
        if cap == 0 || self.time(1) > limit_s {
            return 0;
        }
        if self.each_s <= 0.0 {
            return cap;
        }
        let estimate = 1.0 + ((limit_s - self.first_s) / self.each_s).floor();
        let mut m = (estimate.max(1.0) as usize).min(cap);
        // The estimate is off by one at most through rounding; `time` decides.
        while m < cap && self.time(m + 1) <= limit_s {
            m += 1;
        }
        while m > 1 && self.time(m) > limit_s {
            m -= 1;
        }
        m
    }
}

/// Micro-batch counts, at least one per replica, whose samples add up to `samples`
/// and whose slowest replica is as fast as any such counts allow; `None` when no counts
/// add up (sizes that cannot make `samples`). Times are finite and non-negative.
///
/// Replicas of the same pace are grouped; the least time within which some counts make
/// `samples` is found by bisection, each test a reachability table over sample totals
/// per distinct micro-batch size (whose total counts form an interval).
pub fn min_max_samples(samples: usize, paces: &[ReplicaPace]) -> Option<Vec<usize>> {
    if paces.is_empty() || paces.iter().any(|p| p.micro_batch_size == 0) {
        return None;
    }
    debug_assert!(paces.iter().all(|p| p.first_s >= 0.0 && p.each_s >= 0.0));
    let mut groups: BTreeMap<(usize, u64, u64, usize), Vec<usize>> = BTreeMap::new();
    for (r, p) in paces.iter().enumerate() {
        let key = (
            p.micro_batch_size,
            p.first_s.to_bits(),
            p.each_s.to_bits(),
            p.most_micro_batches,
        );
        groups.entry(key).or_default().push(r);
    }
    let groups: Vec<(ReplicaPace, Vec<usize>)> = groups
        .into_values()
        .map(|members| (paces[members[0]], members))
        .collect();
    let counts_within = |limit: f64| counts_within(samples, &groups, limit, paces.len());
    // Bisection on the bit patterns of non-negative doubles (ordered as the numbers)
    // down to adjacent doubles: the least feasible limit is then a replica's exact time.
    let most = (groups.iter())
        .map(|(p, _)| {
            let m = (samples / p.micro_batch_size).min(p.most_micro_batches);
            p.time(m.max(1))
        })
        .fold(0.0, f64::max);
    let mut best = counts_within(most)?;
    if let Some(counts) = counts_within(0.0) {
        return Some(counts);
    }
    // The least limit at which the counts' sample totals merely span `samples` (cheap:
    // no reachability) bounds the answer from below; it usually is the answer, or one of
    // the next few replica times above it (the counts change only there).
    let spans = |limit: f64| spans(samples, &groups, limit);
    let (mut lo, mut hi) = (0u64, most.to_bits());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match spans(f64::from_bits(mid)) {
            true => hi = mid,
            false => lo = mid,
        }
    }
    let mut limit = f64::from_bits(hi);
    for _ in 0..NEXT_TIMES_TRIED {
        if let Some(counts) = counts_within(limit) {
            return Some(counts);
        }
        lo = limit.to_bits();
        // The next time at which some group's count can grow.
        match next_time(samples, &groups, limit) {
            Some(next) if next < most => limit = next,
            _ => break,
        }
    }
    let mut hi = most.to_bits();
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match counts_within(f64::from_bits(mid)) {
            Some(counts) => {
                best = counts;
                hi = mid;
            }
            None => lo = mid,
        }
    }
    Some(best)
}

/// Replica times above the spanning bound tried one by one before bisecting.
const NEXT_TIMES_TRIED: usize = 8;

/// Whether counts within `limit` seconds (at least one each) span `samples`: the least
/// samples they take at most `samples`, the most at least (what any counts making
/// `samples` within the limit need).
fn spans(samples: usize, groups: &[(ReplicaPace, Vec<usize>)], limit: f64) -> bool {
    let (mut least, mut most) = (0usize, 0usize);
    for (p, members) in groups {
        let m = p.most_within(limit, samples / p.micro_batch_size);
        if m == 0 {
            return false;
        }
        least += members.len() * p.micro_batch_size;
        most += members.len() * m * p.micro_batch_size;
    }
    least <= samples && samples <= most
}

/// The least time above `limit` at which some group takes one more micro-batch.
fn next_time(samples: usize, groups: &[(ReplicaPace, Vec<usize>)], limit: f64) -> Option<f64> {
    (groups.iter())
        .filter_map(|(p, _)| {
            let cap = (samples / p.micro_batch_size).min(p.most_micro_batches);
            let m = p.most_within(limit, cap);
            (m < cap).then(|| p.time(m + 1)).filter(|&t| t > limit)
        })
        .reduce(f64::min)
}

/// Counts within `limit` seconds per replica that make `samples`, if any.
fn counts_within(
    samples: usize,
    groups: &[(ReplicaPace, Vec<usize>)],
    limit: f64,
    replicas: usize,
) -> Option<Vec<usize>> {
    // Each group's most micro-batches per replica within the limit.
    let most: Vec<usize> = groups
        .iter()
        .map(|(p, _)| p.most_within(limit, samples / p.micro_batch_size))
        .collect();
    if most.contains(&0) {
        return None;
    }
    // Per distinct size, the interval of total micro-batch counts its groups can take.
    let mut sizes: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for ((p, members), &most) in groups.iter().zip(&most) {
        let range = sizes.entry(p.micro_batch_size).or_insert((0, 0));
        range.0 += members.len();
        range.1 += members.len() * most;
    }
    let sizes: Vec<(usize, (usize, usize))> = sizes.into_iter().collect();
    let totals = size_totals(samples, &sizes)?;
    let mut counts = vec![0usize; replicas];
    for ((size, _), total) in sizes.iter().zip(totals) {
        let mut left = total;
        let members = groups
            .iter()
            .zip(&most)
            .filter(|((p, _), _)| p.micro_batch_size == *size);
        // Every replica its one micro-batch, then the rest as evenly as each group allows.
        let members: Vec<(&Vec<usize>, usize)> = members.map(|((_, m), &k)| (m, k)).collect();
        left -= members.iter().map(|(m, _)| m.len()).sum::<usize>();
        for (group, most) in members {
            let take = left.min(group.len() * (most - 1));
            left -= take;
            let (each, extra) = (take / group.len(), take % group.len());
            for (j, &r) in group.iter().enumerate() {
                counts[r] = 1 + each + usize::from(j < extra);
            }
        }
        debug_assert_eq!(left, 0);
    }
    Some(counts)
}

/// Per distinct micro-batch size, a total count in its interval, the sizes times the
/// counts adding up to `samples`; `None` when no choice does.
fn size_totals(samples: usize, sizes: &[(usize, (usize, usize))]) -> Option<Vec<usize>> {
    // reach[k][s]: the first k sizes can make s samples.
    let mut reach = vec![vec![false; samples + 1]];
    reach[0][0] = true;
    for &(size, (lo, hi)) in sizes {
        let before = reach.last().expect("a row per size");
        // prefix[s]: how many of before[s], before[s - size], ... are reachable.
        let mut prefix = vec![0usize; samples + 1];
        for s in 0..=samples {
            prefix[s] = usize::from(before[s]) + if s >= size { prefix[s - size] } else { 0 };
        }
        let row: Vec<bool> = (0..=samples)
            .map(|s| {
                // Any before[s - size·c] for c in lo..=hi.
                let Some(top) = s.checked_sub(size * lo) else {
                    return false;
                };
                let below = s.checked_sub(size * (hi + 1)).map_or(0, |k| prefix[k]);
                prefix[top] > below
            })
            .collect();
        reach.push(row);
    }
    if !reach[sizes.len()][samples] {
        return None;
    }
    let mut totals = vec![0; sizes.len()];
    let mut s = samples;
    for k in (0..sizes.len()).rev() {
        let (size, (lo, hi)) = sizes[k];
        let c = (lo..=hi)
            .find(|&c| size * c <= s && reach[k][s - size * c])
            .expect("a reachable total has a count");
        totals[k] = c;
        s -= size * c;
    }
    Some(totals)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every count vector (each ≥ 1) whose samples add up, by enumeration.
    fn all_counts(samples: usize, sizes: &[usize]) -> Vec<Vec<usize>> {
        let Some((&first, rest)) = sizes.split_first() else {
            return if samples == 0 { vec![vec![]] } else { vec![] };
        };
        let mut out = Vec::new();
        for m in 1..=samples / first {
            for mut tail in all_counts(samples - m * first, rest) {
                tail.insert(0, m);
                out.push(tail);
            }
        }
        out
    }

    proptest! {
        /// The split equals brute force over every count vector, and says `None`
        /// exactly when no counts make the samples.
        #[test]
        fn sample_split_matches_brute_force(
            replicas in proptest::collection::vec((1usize..=4, 0.0f64..5.0, 0.0f64..4.0, 1usize..=6), 1..=4),
            samples in 1usize..=20,
        ) {
            // A cap of 6 stands for none.
            let paces: Vec<ReplicaPace> = replicas
                .iter()
                .map(|&(b, first_s, each_s, most)| ReplicaPace {
                    micro_batch_size: b,
                    first_s,
                    each_s,
                    most_micro_batches: if most == 6 { usize::MAX } else { most },
                })
                .collect();
            let sizes: Vec<usize> = paces.iter().map(|p| p.micro_batch_size).collect();
            let worst = |m: &[usize]| (0..m.len()).map(|r| paces[r].time(m[r])).fold(0.0, f64::max);
            let brute = all_counts(samples, &sizes)
                .into_iter()
                .filter(|m| m.iter().zip(&paces).all(|(&c, p)| c <= p.most_micro_batches))
                .map(|m| worst(&m))
                .min_by(f64::total_cmp);
            match (min_max_samples(samples, &paces), brute) {
                (None, None) => {}
                (Some(m), Some(best)) => {
                    prop_assert!(m.iter().all(|&c| c >= 1));
                    prop_assert_eq!(m.iter().zip(&sizes).map(|(c, b)| c * b).sum::<usize>(), samples);
                    prop_assert!((worst(&m) - best).abs() < 1e-12, "{:?}: {} vs {}", m, worst(&m), best);
                }
                (got, brute) => prop_assert!(false, "{:?} vs brute force {:?}", got, brute),
            }
        }
    }

    #[test]
    fn identical_replicas_share_evenly() {
        let pace = ReplicaPace {
            micro_batch_size: 2,
            first_s: 1.0,
            each_s: 1.0,
            most_micro_batches: usize::MAX,
        };
        assert_eq!(min_max_samples(12, &[pace; 3]), Some(vec![2, 2, 2]));
        assert_eq!(min_max_samples(7, &[pace; 3]), None);
    }
}
