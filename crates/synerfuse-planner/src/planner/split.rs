//! Exact splits: layers over stages (dynamic programme on the slowest stage, subject
//! to memory) and the batch over replicas (greedy min-max, or a bisection over sample
//! totals when sizes differ).

use super::{
    context::Ctx,
    error::PlanningError,
    memory_fit::Shares,
    pricing::{pipeline_time, stage_seconds, stage_times, PipelineTimes},
    samples::{min_max_samples, ReplicaPace},
};
use crate::cost::{Recompute, StageCosts, StageHolding};
use std::collections::{BTreeSet, BinaryHeap};

/// `l` layers over `p` stages as evenly as they go, the first stages one more.
pub(super) fn even_layers(l: usize, p: usize) -> Vec<usize> {
    (0..p).map(|i| l / p + usize::from(i < l % p)).collect()
}

/// One distinct replica of a stage, as the layer DP sees it.
#[derive(Clone)]
pub(super) struct StageRow {
    pub(super) micro_batches: f64,
    pub(super) usable_bytes: Option<f64>,
    pub(super) costs: StageCosts,
    /// Bytes needed as (fixed, per layer), without and with recomputation.
    pub(super) need: (f64, f64),
    pub(super) recomputed_need: (f64, f64),
}

/// Micro-batches in proportion to each replica's throughput under even layers, at
/// least one each, largest remainders first.
pub(super) fn proportional_split(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    b: usize,
    total: usize,
) -> Result<Vec<usize>, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let even = even_layers(ctx.cost.model.num_layers, p);
    // Every stage with its pipeline's depth in flight, as a long batch keeps it.
    let (t, _) = stage_times(ctx, grid, &even, &vec![b; d], &vec![p; d])?;
    let rate: Vec<f64> = (0..d)
        .map(|r| 1.0 / t.iter().map(|s| s[r]).fold(1e-30, f64::max))
        .collect();
    let sum: f64 = rate.iter().sum();
    let spare = total - d;
    let exact: Vec<f64> = rate.iter().map(|x| spare as f64 * x / sum).collect();
    let mut m: Vec<usize> = exact.iter().map(|x| 1 + x.floor() as usize).collect();
    let mut left = total - m.iter().sum::<usize>();
    let mut by_remainder: Vec<usize> = (0..d).collect();
    by_remainder
        .sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for &r in by_remainder.iter().cycle() {
        if left == 0 {
            break;
        }
        m[r] += 1;
        left -= 1;
    }
    Ok(m)
}

/// Exact min-max split of `total` micro-batches over replicas whose pipeline time is
/// nondecreasing in their count: start at one each, give each next micro-batch to the
/// replica that would finish earliest with it.
pub fn min_max_split(
    total: usize,
    time: impl Fn(usize, usize) -> f64,
    replicas: usize,
) -> Vec<usize> {
    let mut m = vec![1usize; replicas];
    #[derive(PartialEq)]
    struct Next(f64, usize);
    impl Eq for Next {}
    impl PartialOrd for Next {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Next {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            // A min-heap on time, then on replica index.
            o.0.total_cmp(&self.0).then(o.1.cmp(&self.1))
        }
    }
    let mut heap: BinaryHeap<Next> = (0..replicas).map(|r| Next(time(r, 2), r)).collect();
    for _ in replicas..total {
        let Some(Next(_, r)) = heap.pop() else { break };
        m[r] += 1;
        heap.push(Next(time(r, m[r] + 1), r));
    }
    m
}

/// The exact min-max split of `samples` over the replicas at micro-batch sizes
/// `sizes` under `layers`; `None` when no counts make `samples`.
pub(super) fn split_samples(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    sizes: &[usize],
    layers: &[usize],
    samples: usize,
) -> Result<Option<Vec<usize>>, PlanningError> {
    let (t, c) = stage_times(ctx, grid, layers, sizes, &vec![grid.len(); grid[0].len()])?;
    let d = grid[0].len();
    let b = sizes[0];
    if sizes.iter().all(|&s| s == b) {
        let fits = samples % b == 0 && samples / b >= d;
        let times = PipelineTimes::new(&t, &c);
        return Ok(fits.then(|| min_max_split(samples / b, |r, m| times.time(r, m), d)));
    }
    let paces: Vec<ReplicaPace> = (0..d)
        .map(|r| ReplicaPace {
            micro_batch_size: sizes[r],
            first_s: pipeline_time(&t, &c, r, 1),
            each_s: t.iter().map(|s| s[r]).fold(0.0, f64::max),
            most_micro_batches: usize::MAX,
        })
        .collect();
    Ok(min_max_samples(samples, &paces))
}

/// Exact contiguous split of `l` layers over `costs.len()` stages minimising the largest
/// stage cost; `costs[i](ℓ)` is stage i's cost holding ℓ layers, `None` when ℓ does not
/// fit. `None` when no split fits. Of the splits with the least cost, the one whose last
/// stages hold the fewest layers. O(p·L·log L) where each stage's cost is nondecreasing
/// in its layers (as the cost model's are), O(p·L²) where one is not.
pub fn min_max_layers(l: usize, costs: &[&dyn Fn(usize) -> Option<f64>]) -> Option<Vec<usize>> {
    layers_min_max(l, costs, true)
}

/// [`min_max_layers`], bisecting where the costs allow it (`bisect`) or scanning every
/// layer count (the reference the bisection is tested against).
fn layers_min_max(
    l: usize,
    costs: &[&dyn Fn(usize) -> Option<f64>],
    bisect: bool,
) -> Option<Vec<usize>> {
    let p = costs.len();
    if p == 0 || l < p {
        return None;
    }
    // best[i][k]: min over splits of the first k layers into stages 0..=i of the max cost.
    let mut best = vec![vec![f64::INFINITY; l + 1]; p];
    let mut choice = vec![vec![0usize; l + 1]; p];
    for k in 1..=l {
        if let Some(c) = costs[0](k) {
            best[0][k] = c;
            choice[0][k] = k;
        }
    }
    for i in 1..p {
        let (done, rest) = best.split_at_mut(i);
        let before = &done[i - 1];
        // Stage i is asked about 1 ..= l - fewest layers (the fewest that stages 0..i
        // hold), each count once (asking may note that memory ruled it out).
        let Some(fewest) = (i..=l).find(|&x| before[x].is_finite()) else {
            break;
        };
        let cost: Vec<f64> = (0..=l - fewest)
            .map(|own| match own {
                0 => f64::INFINITY,
                _ => costs[i](own).unwrap_or(f64::INFINITY),
            })
            .collect();
        let nondecreasing = |v: &[f64]| v.windows(2).all(|w| w[0] <= w[1]);
        let monotone = bisect && nondecreasing(&cost[1..]) && nondecreasing(&before[fewest..]);
        for k in (i + 1)..=l {
            // Stage i's own layers: at most k - fewest.
            let most = k.saturating_sub(fewest);
            let at = |own: usize| (before[k - own], cost[own]);
            let found = match monotone {
                true => least_at_crossing(most, at),
                false => least_by_scan(most, at),
            };
            if let Some((own, v)) = found {
                rest[0][k] = v;
                choice[i][k] = own;
            }
        }
    }
    if !best[p - 1][l].is_finite() {
        return None;
    }
    let mut out = vec![0; p];
    let mut k = l;
    for i in (0..p).rev() {
        out[i] = choice[i][k];
        k -= out[i];
    }
    Some(out)
}

/// The fewest own layers in `1..=most` with the least `max(before, own cost)` (`at` gives
/// both), and that least; `None` when none is finite. Every count tried.
fn least_by_scan(most: usize, at: impl Fn(usize) -> (f64, f64)) -> Option<(usize, f64)> {
    let mut found: Option<(usize, f64)> = None;
    for own in 1..=most {
        let (before, cost) = at(own);
        if !before.is_finite() {
            continue;
        }
        let v = before.max(cost);
        if v < found.map_or(f64::INFINITY, |(_, least)| least) {
            found = Some((own, v));
        }
    }
    found
}

/// [`least_by_scan`] where `before` does not grow with the own layers and the own cost
/// does not shrink: the least lies where they cross, found by bisection.
fn least_at_crossing(most: usize, at: impl Fn(usize) -> (f64, f64)) -> Option<(usize, f64)> {
    let partition = |lo: usize, hi: usize, holds: &dyn Fn(usize) -> bool| {
        // The first own in lo..hi where `holds` (which, once true, stays true), else hi.
        let (mut lo, mut hi) = (lo, hi);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match holds(mid) {
                true => hi = mid,
                false => lo = mid + 1,
            }
        }
        lo
    };
    // The first count whose own cost reaches what the stages before it take.
    let cross = partition(1, most + 1, &|own| {
        let (before, cost) = at(own);
        before <= cost
    });
    // Below it the stages before are the slowest, least at cross - 1 (and first reached
    // at the fewest counts that equal it); from it on the own stage, least at cross.
    let left = (cross > 1).then(|| {
        let v = at(cross - 1).0;
        (partition(1, cross - 1, &|own| at(own).0 <= v), v)
    });
    let right = (cross <= most).then(|| (cross, at(cross).1));
    let least = match (left, right) {
        (Some(l), Some(r)) => match l.1 <= r.1 {
            true => l,
            false => r,
        },
        (l, r) => l.or(r)?,
    };
    (least.1 < f64::INFINITY).then_some(least)
}

pub(super) fn split_layers(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    sizes: &[usize],
    m: &[usize],
    l: usize,
) -> Result<Option<Vec<usize>>, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    // Per stage, the distinct (per-layer time, extra time, micro-batches, memory terms)
    // of its replicas: a few device kinds make a few distinct rows.
    let mut rows: Vec<Vec<StageRow>> = Vec::new();
    for (i, stage_devices) in grid.iter().enumerate() {
        let mut stage_rows = Vec::new();
        let mut seen = BTreeSet::new();
        let shares = Shares::of_stage(ctx, stage_devices);
        for r in 0..d {
            let (dev, b) = (stage_devices[r], sizes[r]);
            let k = ctx.costs(dev, b)?;
            let share = shares.of(ctx, dev);
            let key = (
                k.layer_s.to_bits(),
                (k.embedding_s.to_bits(), k.head_s.to_bits()),
                (k.activation_bytes.to_bits(), k.forward_fraction.to_bits()),
                m[r],
                ctx.memory[dev].map(f64::to_bits),
                (b, ctx.expert_parallel(dev)),
                share.to_bits(),
            );
            if seen.insert(key) {
                // A rank's need is affine in its layers: two points give it.
                let need = |recompute, layers| {
                    let holding = StageHolding {
                        layers,
                        first: i == 0,
                        last: i + 1 == p,
                        in_flight: (p - i).min(m[r]),
                        micro_batch_size: b,
                        optimizer_share: share,
                        recompute,
                        loss_in_chunks: ctx.loss_in_chunks(dev),
                    };
                    ctx.cost_of(dev).memory_bytes(&k, &holding)
                };
                let affine = |recompute| {
                    let base = need(recompute, 0);
                    (base, need(recompute, 1) - base)
                };
                stage_rows.push(StageRow {
                    micro_batches: m[r] as f64,
                    usable_bytes: ctx.memory[dev],
                    costs: k,
                    need: affine(false),
                    recomputed_need: affine(true),
                });
            }
        }
        rows.push(stage_rows);
    }
    let (cost, bound) = (ctx.cost, &ctx.memory_bound);
    let closures: Vec<Box<dyn Fn(usize) -> Option<f64> + '_>> = (0..p)
        .map(|i| {
            let stage_rows = rows[i].clone();
            let f: Box<dyn Fn(usize) -> Option<f64>> = Box::new(move |layers: usize| {
                let mut worst = 0.0f64;
                for row in &stage_rows {
                    let over = |recompute| {
                        let (fixed, per_layer) = match recompute {
                            true => row.recomputed_need,
                            false => row.need,
                        };
                        let need = fixed + per_layer * layers as f64;
                        row.usable_bytes.is_some_and(|have| need > have)
                    };
                    // As stage_fit decides, for this many layers.
                    let recompute = match cost.recompute {
                        Recompute::Never => false,
                        Recompute::Always => true,
                        Recompute::WhereNeeded => over(false),
                    };
                    if over(recompute) {
                        bound.set(true);
                        return None;
                    }
                    let k = match recompute {
                        true => row.costs.recomputed(),
                        false => row.costs,
                    };
                    worst = worst.max(row.micro_batches * stage_seconds(&k, layers, i, p));
                }
                Some(worst)
            });
            f
        })
        .collect();
    let refs: Vec<&dyn Fn(usize) -> Option<f64>> = closures.iter().map(|f| f.as_ref()).collect();
    Ok(min_max_layers(l, &refs))
}

#[cfg(test)]
mod tests {
    use super::layers_min_max;
    use proptest::prelude::*;
    use std::cell::RefCell;
    use std::collections::BTreeSet;

    /// Per stage, a cost for each layer count from 1 (`None`: does not fit): growing in
    /// small integer steps (many ties) up to a memory cap, or, where `shuffled`, in any
    /// order (the scan's case).
    fn stage_costs() -> impl Strategy<Value = Vec<Option<u32>>> {
        (
            proptest::collection::vec(0u32..3, 40),
            0u32..4,
            1usize..=40,
            any::<bool>(),
        )
            .prop_map(|(steps, base, cap, shuffled)| {
                let mut total = base;
                let mut costs: Vec<Option<u32>> = (steps.iter().enumerate())
                    .map(|(i, s)| {
                        total += s;
                        (i < cap).then_some(total)
                    })
                    .collect();
                if shuffled {
                    costs.reverse();
                    costs.rotate_left(cap % 7);
                }
                costs
            })
    }

    proptest! {
        /// Bisecting at the crossing finds the scan's split, its cost to the bit and the
        /// same layer counts asked of each stage (what memory ruled out noted alike).
        #[test]
        fn bisection_finds_the_scans_split(
            l in 1usize..=40,
            stages in proptest::collection::vec(stage_costs(), 1..=5),
        ) {
            let run = |bisect: bool| {
                let asked = RefCell::new(BTreeSet::new());
                let closures: Vec<Box<dyn Fn(usize) -> Option<f64> + '_>> = (stages.iter().enumerate())
                    .map(|(i, costs)| {
                        let asked = &asked;
                        let f: Box<dyn Fn(usize) -> Option<f64>> = Box::new(move |k: usize| {
                            asked.borrow_mut().insert((i, k));
                            costs[k - 1].map(f64::from)
                        });
                        f
                    })
                    .collect();
                let refs: Vec<&dyn Fn(usize) -> Option<f64>> =
                    closures.iter().map(|f| f.as_ref()).collect();
                let split = layers_min_max(l, &refs, bisect);
                let asked = asked.borrow().clone();
                (split, asked)
            };
            prop_assert_eq!(run(true), run(false));
        }
    }
}
