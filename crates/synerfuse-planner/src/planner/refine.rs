//! A per-replica-pipeline plan split down to the sample. The searches move whole
//! micro-batches between replicas; here each replica may take any count of samples (its
//! last micro-batch short). First the split that evens the replicas' 1F1B closed forms
//! (samples one at a time to the replica that finishes first with it), checked by the
//! simulation; then single samples from the replica that finishes last to one that
//! finishes first, each move simulated, while the step does not grow and the replicas'
//! finishes, latest first, fall.

use super::{
    context::Ctx,
    error::PlanningError,
    outcome::{Candidate, PoolLayout, PooledCandidate},
    plan_context::candidate_ctx,
    pooled::most_micro_batches,
    pricing::micro_batch_seconds,
    simulate::simulate_pools,
};
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Candidates a sample may go to, earliest finish first, before the moves stop.
const RECEIVERS_TRIED: usize = 3;

/// Single-sample moves at most (each simulates the whole plan up to
/// [`RECEIVERS_TRIED`] times)...
const MOST_MOVES: usize = 48;

/// ... and at most this many ranks' worth of moves (a move on a plan of `n` ranks counts
/// `n`): a large plan's simulation is long, and its closed-form split is what helps it.
const SIMULATED_RANKS: usize = 8192;

/// `found` split down to the sample (see the module documentation); never slower.
pub(super) fn refine_samples(
    ctx: &mut Ctx<'_>,
    found: &PooledCandidate,
    global_batch: usize,
) -> Result<PooledCandidate, PlanningError> {
    let most: Vec<usize> = (found.pools.iter())
        .map(|pool| most_micro_batches(ctx, pool))
        .collect::<Result<_, _>>()?;
    // The searches' candidates come simulated; anything else is simulated here.
    let mut best = match found.replica_finish_s.is_empty() {
        true => simulate_pools(ctx, found.pools.clone(), false)?.0,
        false => found.clone(),
    };
    if let Some(pools) = closed_form_split(ctx, &best.pools, &most, global_batch)? {
        let (split, _) = simulate_pools(ctx, pools, false)?;
        if split.step_time_s < best.step_time_s {
            best = split;
        }
    }
    let slots: Vec<(usize, usize)> = best.replicas().collect();
    let ranks = best.rank_devices().len().max(1);
    let moves = MOST_MOVES.min(SIMULATED_RANKS / ranks).min(global_batch);
    'moves: for _ in 0..moves {
        let finish = best.replica_finish_s.clone();
        let mut order: Vec<usize> = (0..slots.len()).collect();
        order.sort_by(|&a, &b| finish[a].total_cmp(&finish[b]));
        let Some(&slow) = order.last() else {
            break;
        };
        for &fast in order.iter().take(RECEIVERS_TRIED) {
            if fast == slow {
                break;
            }
            let mut pools = best.pools.clone();
            let (from, to) = (slots[slow], slots[fast]);
            if !take_sample(&mut pools[from.0], from.1)
                || !give_sample(&mut pools[to.0], to.1, most[to.0])
            {
                continue;
            }
            let (trial, _) = simulate_pools(ctx, pools, false)?;
            if improves(&trial, &best) {
                best = trial;
                continue 'moves;
            }
        }
        break;
    }
    Ok(best)
}

/// One replica's 1F1B closed form by its samples: fill and drain with a full
/// micro-batch, then its slowest stage per further micro-batch, the last at its own size.
struct ReplicaForm {
    size: usize,
    most: usize,
    /// Σ stage times and transfers (there and back) of a full micro-batch.
    fill_s: f64,
    /// The slowest stage's time of a full micro-batch.
    each_s: f64,
    /// Per last size l (index l − 1): its slowest stage's time, and its fill and drain.
    last_each_s: Vec<f64>,
    last_fill_s: Vec<f64>,
}

impl ReplicaForm {
    /// Seconds with `samples` samples (at least one).
    fn time(&self, samples: usize) -> f64 {
        let m = samples.div_ceil(self.size);
        let last = samples - (m - 1) * self.size;
        match m {
            1 => self.last_fill_s[last - 1],
            _ => self.fill_s + (m - 2) as f64 * self.each_s + self.last_each_s[last - 1],
        }
    }

    /// Whether `samples` fit its most micro-batches.
    fn fits(&self, samples: usize) -> bool {
        samples.div_ceil(self.size) <= self.most
    }
}

/// The closed form of every replica of `pools`, in the plan's order.
fn replica_forms(
    ctx: &mut Ctx<'_>,
    pools: &[PoolLayout],
    most: &[usize],
) -> Result<Vec<ReplicaForm>, PlanningError> {
    let mut forms = Vec::new();
    for (pool, &most) in pools.iter().zip(most) {
        let (t, c) = pool.stage_times(ctx)?;
        let (b, p) = (pool.micro_batch_size, pool.layers.len());
        let fits = pool.stage_fits(ctx)?;
        for r in 0..pool.micro_batches.len() {
            let comm: f64 = c.iter().map(|row| 2.0 * row[r]).sum();
            let (mut last_each_s, mut last_fill_s) = (Vec::with_capacity(b), Vec::with_capacity(b));
            for l in 1..=b {
                let mut times = Vec::with_capacity(p);
                for (i, (row, fit)) in pool.devices.iter().zip(&fits).enumerate() {
                    let at = (pool.layers[i], i, p);
                    times.push(micro_batch_seconds(ctx, row[r], l, fit[r].recompute, at)?);
                }
                last_each_s.push(times.iter().copied().fold(0.0, f64::max));
                last_fill_s.push(times.iter().sum::<f64>() + comm);
            }
            forms.push(ReplicaForm {
                size: b,
                most,
                fill_s: t.iter().map(|row| row[r]).sum::<f64>() + comm,
                each_s: t.iter().map(|row| row[r]).fold(0.0, f64::max),
                last_each_s,
                last_fill_s,
            });
        }
    }
    Ok(forms)
}

/// `pools` with the global batch split so that the replicas' closed forms end as evenly
/// as whole samples allow: one sample each, then each further sample to the replica that
/// ends first with it (optimal for times that grow with the samples). `None` when the
/// replicas' most micro-batches cannot hold the batch.
fn closed_form_split(
    ctx: &mut Ctx<'_>,
    pools: &[PoolLayout],
    most: &[usize],
    global_batch: usize,
) -> Result<Option<Vec<PoolLayout>>, PlanningError> {
    let forms = replica_forms(ctx, pools, most)?;
    if forms.len() > global_batch {
        return Ok(None);
    }
    let mut samples = vec![1usize; forms.len()];
    // Max-heap on the negated finish: the earliest next finish first.
    let mut next: BinaryHeap<(std::cmp::Reverse<u64>, usize)> = BinaryHeap::new();
    let key = |t: f64| std::cmp::Reverse(t.max(0.0).to_bits());
    for (r, form) in forms.iter().enumerate() {
        if form.fits(2) {
            next.push((key(form.time(2)), r));
        }
    }
    for _ in forms.len()..global_batch {
        let Some((_, r)) = next.pop() else {
            return Ok(None);
        };
        samples[r] += 1;
        if forms[r].fits(samples[r] + 1) {
            next.push((key(forms[r].time(samples[r] + 1)), r));
        }
    }
    let mut split = pools.to_vec();
    let mut at = 0;
    for pool in &mut split {
        let b = pool.micro_batch_size;
        pool.short = vec![0; pool.micro_batches.len()];
        for r in 0..pool.micro_batches.len() {
            let m = samples[at].div_ceil(b);
            pool.micro_batches[r] = m;
            pool.short[r] = m * b - samples[at];
            at += 1;
        }
    }
    Ok(Some(split))
}

/// Whether `trial` is no slower than `best` and its replicas' finishes, latest first,
/// are earlier (the order a min-max split falls in).
fn improves(trial: &PooledCandidate, best: &PooledCandidate) -> bool {
    if trial.step_time_s > best.step_time_s * (1.0 + 1e-12) {
        return false;
    }
    let latest_first = |c: &PooledCandidate| {
        let mut f = c.replica_finish_s.clone();
        f.sort_by(|a, b| b.total_cmp(a));
        f
    };
    let (t, b) = (latest_first(trial), latest_first(best));
    let order = (t.iter().zip(&b))
        .map(|(x, y)| x.total_cmp(y))
        .find(|o| o.is_ne())
        .unwrap_or(Ordering::Equal);
    trial.step_time_s < best.step_time_s * (1.0 - 1e-12) || order == Ordering::Less
}

/// One sample fewer for replica `r` (its last micro-batch shorter, or gone when it held
/// one sample); false when the replica has one sample left.
fn take_sample(pool: &mut PoolLayout, r: usize) -> bool {
    if pool.samples(r) <= 1 {
        return false;
    }
    pool.short.resize(pool.micro_batches.len(), 0);
    if pool.short[r] + 1 == pool.micro_batch_size {
        pool.micro_batches[r] -= 1;
        pool.short[r] = 0;
    } else {
        pool.short[r] += 1;
    }
    true
}

/// One sample more for replica `r` (its short micro-batch longer, or a new micro-batch
/// of one sample); false when a new one would exceed `most` micro-batches.
fn give_sample(pool: &mut PoolLayout, r: usize, most: usize) -> bool {
    pool.short.resize(pool.micro_batches.len(), 0);
    if pool.short[r] > 0 {
        pool.short[r] -= 1;
        return true;
    }
    if pool.micro_batches[r] >= most {
        return false;
    }
    pool.micro_batches[r] += 1;
    pool.short[r] = pool.micro_batch_size - 1;
    true
}

/// The grid plan `c` split down to the sample: each replica a pipeline of its own (the
/// same stages), refined as [`refine_samples`] does; `None` unless that is faster.
pub(super) fn refine_grid(
    cost: &crate::cost::CostModel,
    c: &Candidate,
    global_batch: usize,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let variant = c.options.cost(cost);
    let mut ctx = candidate_ctx(&variant, c);
    // Consecutive replicas of one micro-batch size make one pool (a grid of one size is
    // one pool, priced as the grid is).
    let mut pools: Vec<PoolLayout> = Vec::new();
    for r in 0..c.micro_batches.len() {
        let size = c.micro_batch_sizes[r];
        match pools
            .last_mut()
            .filter(|pool| pool.micro_batch_size == size)
        {
            Some(pool) => {
                for (row, grid_row) in pool.devices.iter_mut().zip(&c.devices) {
                    row.push(grid_row[r]);
                }
                pool.micro_batches.push(c.micro_batches[r]);
            }
            None => pools.push(PoolLayout {
                devices: c.devices.iter().map(|row| vec![row[r]]).collect(),
                layers: c.layers.clone(),
                micro_batch_size: size,
                micro_batches: vec![c.micro_batches[r]],
                short: Vec::new(),
            }),
        }
    }
    let (as_pools, _) = simulate_pools(&mut ctx, pools, false)?;
    let mut refined = refine_samples(&mut ctx, &as_pools, global_batch)?;
    refined.options = c.options;
    Ok((refined.step_time_s < as_pools.step_time_s * (1.0 - 1e-9)).then_some(refined))
}
