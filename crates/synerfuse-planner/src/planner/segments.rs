//! The closed-form price of a per-replica-pipeline plan's reduction and optimizer step:
//! its gradient segments (the parameters between neighbouring cuts of every replica's
//! stage boundaries), each reduced over its holders, and each rank's optimizer step.

use super::{
    buckets::pieces_of,
    context::Ctx,
    memory_fit::Shares,
    outcome::{replicas, PoolLayout},
    reduction::{
        expert_allreduce_s, expert_gather_s, experts_apart, holders_allreduce_s, holders_gather_s,
    },
};

/// Each replica's stage boundaries in pieces (embedding = 0, layer i = i + 1, head =
/// L + 1), per replica the (start, end) piece range of each stage and its device.
pub(super) fn stage_pieces(pools: &[PoolLayout], l: usize) -> Vec<Vec<(usize, usize, usize)>> {
    replicas(pools)
        .map(|(k, r)| {
            let pool = &pools[k];
            (pieces_of(&pool.layers, l).into_iter().enumerate())
                .map(|(i, (from, to))| (from, to, pool.devices[i][r]))
                .collect()
        })
        .collect()
}

/// One gradient segment of a per-replica-pipeline plan: the parameters between two
/// neighbouring cuts of the union of every replica's stage boundaries, held by one
/// (replica, stage) position of each replica.
pub(super) struct PooledSegment {
    /// Its model pieces, `from..to`.
    pub(super) pieces: (usize, usize),
    /// Its parameters, every expert's included.
    pub(super) params: f64,
    /// Its decoder layers (whose experts a holder under expert parallelism holds a
    /// part of).
    pub(super) layers: f64,
    /// Per replica, the holding position (counted replica by replica, stage by stage)
    /// and its unit.
    pub(super) holders: Vec<(usize, usize)>,
}

impl PooledSegment {
    /// Its parameters `unit` holds: under expert parallelism its part of the experts.
    pub(super) fn held(&self, ctx: &Ctx<'_>, unit: usize) -> f64 {
        let others = 1.0 - 1.0 / ctx.expert_parallel(unit) as f64;
        self.params - self.layers * ctx.cost.model.expert_layer_params() * others
    }
}

/// The gradient segments of `pools`' replicas, first to last.
pub(super) fn pooled_segments(ctx: &Ctx<'_>, pools: &[PoolLayout]) -> Vec<PooledSegment> {
    let model = &ctx.cost.model;
    let l = model.num_layers;
    let stages = stage_pieces(pools, l);
    let mut cuts: Vec<usize> = stages.iter().flatten().map(|&(from, _, _)| from).collect();
    cuts.push(l + 2);
    cuts.sort_unstable();
    cuts.dedup();
    let layer = model.stage_params(1, false, false);
    // Parameters and decoder layers.
    let params = |from: usize, to: usize| {
        (from..to)
            .map(|piece| match piece {
                0 => (model.embedding_params(), 0.0),
                // The final norm and the output layer.
                x if x == l + 1 => (model.embedding_params() + model.hidden_size as f64, 0.0),
                _ => (layer, 1.0),
            })
            .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y))
    };
    // Position of (replica, stage): replica by replica, stage by stage.
    let first_position: Vec<usize> = (stages.iter())
        .scan(0, |next, s| {
            let first = *next;
            *next += s.len();
            Some(first)
        })
        .collect();
    (cuts.windows(2))
        .map(|w| {
            let (from, to) = (w[0], w[1]);
            let holders = (stages.iter().enumerate())
                .map(|(r, s)| {
                    let i = (s.iter())
                        .position(|&(a, b, _)| a <= from && to <= b)
                        .expect("a stage holds each segment");
                    (first_position[r] + i, s[i].2)
                })
                .collect();
            let (params, layers) = params(from, to);
            PooledSegment {
                pieces: (from, to),
                params,
                layers,
                holders,
            }
        })
        .collect()
}

/// The (replica, stage) positions the segments' holders count.
fn positions(segments: &[PooledSegment]) -> usize {
    (segments.iter())
        .flat_map(|s| s.holders.iter().map(|&(position, _)| position + 1))
        .max()
        .unwrap_or(0)
}

/// Per (replica, stage), replica by replica, the seconds of its gradient reduction: each
/// segment all-reduced over its holders (one per replica; tensor-parallel groups of the
/// same shares each member its share, side by side; groups split otherwise the whole
/// tensors over every member; under expert parallelism its experts over the holders of
/// the same), a stage's segments one after another.
pub(super) fn reduce_s(ctx: &Ctx<'_>, segments: &[PooledSegment]) -> Vec<f64> {
    per_position(ctx, segments, |units, dense, layers| {
        holders_allreduce_s(ctx, units, dense) + expert_allreduce_s(ctx, units, layers)
    })
}

/// Per position, the distributed optimizer's gathers of its segments' updated
/// parameters after the step, s, one after another (0 without it, or where
/// `--overlap-param-gather` hides them behind the next forward: the closed form's
/// estimate; simulated plans price the buckets).
pub(super) fn gather_s(ctx: &Ctx<'_>, segments: &[PooledSegment]) -> Vec<f64> {
    if ctx.cost.overlaps_param_gather() {
        return vec![0.0; positions(segments)];
    }
    per_position(ctx, segments, |units, dense, layers| {
        holders_gather_s(ctx, units, dense) + expert_gather_s(ctx, units, layers)
    })
}

/// Per position, the sum over the segments it holds of `seconds(holders' units, the
/// parameters reduced with the rest (the experts left out where they reduce apart), the
/// segment's layers)`.
fn per_position(
    ctx: &Ctx<'_>,
    segments: &[PooledSegment],
    seconds: impl Fn(&[usize], f64, f64) -> f64,
) -> Vec<f64> {
    let mut total = vec![0.0; positions(segments)];
    for segment in segments {
        let units: Vec<usize> = segment.holders.iter().map(|&(_, u)| u).collect();
        let experts = match experts_apart(ctx, &units) {
            true => segment.layers * ctx.cost.model.expert_layer_params(),
            false => 0.0,
        };
        let t = seconds(&units, segment.params - experts, segment.layers);
        for &(position, _) in &segment.holders {
            total[position] += t;
        }
    }
    total
}

/// Per position, when its reduction starts: once every holder of every segment it
/// holds (itself included) has finished its schedule (`finished`, per position).
pub(super) fn reduce_starts(segments: &[PooledSegment], finished: &[f64]) -> Vec<f64> {
    let mut start = vec![0.0f64; finished.len()];
    for segment in segments {
        let done = (segment.holders.iter())
            .map(|&(q, _)| finished[q])
            .fold(0.0, f64::max);
        for &(position, _) in &segment.holders {
            start[position] = start[position].max(done);
        }
    }
    start
}

/// The slowest rank's optimizer step over its own parameters (0 where not priced):
/// under the distributed optimizer each segment's state sharded over its holders in
/// proportion to their memory, as the trainer shards it (and as grid plans are priced).
pub(super) fn optimizer_s(ctx: &Ctx<'_>, pools: &[PoolLayout], segments: &[PooledSegment]) -> f64 {
    if ctx.cost.distributed_optimizer {
        // Per position, its unit and the parameters whose state it keeps.
        let mut params: Vec<(usize, f64)> = vec![(0, 0.0); positions(segments)];
        for segment in segments {
            let units: Vec<usize> = segment.holders.iter().map(|&(_, u)| u).collect();
            let shares = Shares::of_stage(ctx, &units);
            for &(position, unit) in &segment.holders {
                let held = params[position].1 + segment.held(ctx, unit) * shares.of(ctx, unit);
                params[position] = (unit, held);
            }
        }
        return (params.iter())
            .map(|&(unit, p)| optimizer_once(ctx, unit, p))
            .fold(0.0, f64::max);
    }
    let mut slowest = 0.0f64;
    for pool in pools {
        let p = pool.layers.len();
        for (i, row) in pool.devices.iter().enumerate() {
            for &unit in row {
                let params = ctx
                    .cost_of(unit)
                    .stage_params(pool.layers[i], i == 0, i + 1 == p);
                slowest = slowest.max(optimizer_once(ctx, unit, params));
            }
        }
    }
    slowest
}

/// [`Ctx::optimizer_seconds`] (0 where unpriced), kept per unit class and parameters:
/// alike units of a large pool step alike.
fn optimizer_once(ctx: &Ctx<'_>, unit: usize, params: f64) -> f64 {
    let key = (ctx.classes[unit], params.to_bits());
    if let Some(&s) = ctx.optimizer_prices.borrow().get(&key) {
        return s;
    }
    let s = ctx.optimizer_seconds(unit, params).unwrap_or(0.0);
    ctx.optimizer_prices.borrow_mut().insert(key, s);
    s
}
