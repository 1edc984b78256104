//! Plans whose replicas are pipelines of their own shape (the general plan): the devices
//! pooled by class (group and speed), each pool cut into replicas of one depth with one
//! layer split and micro-batch size, the batch split over every replica of every pool.
//! A pool of small devices can pipeline deep while a pool of large ones keeps whole
//! replicas, which no grid (every replica the same stages) expresses.

use super::samples::{min_max_samples, ReplicaPace};
use super::{
    arrange, max, pipeline_time, placement, split_layers, stage_fit, stage_fits, stage_times,
    Arrangement, Ctx, Grid, PlanningError, TpGroup, TrainOptions,
};
use crate::cost::{CostModel, StageHolding};
use crate::general::{GeneralPlan, GeneralPlanError, ReplicaPipeline};
use crate::timeline::{RankTimeline, Span, SpanKind};
use crate::{sim, Pass, ReplicaBatch, ScheduleKind, StageLayout};

/// The most combinations of pool options tried: each pool keeps its fastest options
/// per device, as many as keep the product under this (every option on small clusters).
const MOST_COMBINATIONS: usize = 81;

/// One pool's part of a plan: its replicas, each `layers.len()` stages deep.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolLayout {
    /// Unit of (stage, replica): an index into the candidate's `groups`.
    pub devices: Grid<usize>,
    /// Layers per stage, the same for each of its replicas.
    pub layers: Vec<usize>,
    /// Micro-batch size of its replicas.
    pub micro_batch_size: usize,
    /// Micro-batches of each of its replicas.
    pub micro_batches: Vec<usize>,
}

/// A plan of pools with its predicted step.
#[derive(Debug, Clone, PartialEq)]
pub struct PooledCandidate {
    /// The pools, fastest first; their replicas in this order are the plan's.
    pub pools: Vec<PoolLayout>,
    /// What each unit of the pools is: one device, or a tensor-parallel group.
    pub groups: Vec<TpGroup>,
    /// What it trains with beside its layout.
    pub options: TrainOptions,
    /// Whether each stage of each replica (in the plan's order) recomputes its
    /// activations.
    pub recompute: Vec<Vec<bool>>,
    /// One training step, s (simulated schedule, the reduction, the optimizer).
    pub step_time_s: f64,
    /// The slowest replica's pipeline, s.
    pub pipeline_s: f64,
    /// The gradient reduction of the busiest rank, s.
    pub reduce_s: f64,
    /// The slowest rank's optimizer step, s.
    pub optimizer_s: f64,
}

impl PoolLayout {
    /// Per (stage, replica) the seconds of one micro-batch, and of its send to the next stage.
    fn stage_times(&self, ctx: &mut Ctx<'_>) -> Result<(Grid<f64>, Grid<f64>), PlanningError> {
        let sizes = vec![self.micro_batch_size; self.micro_batches.len()];
        stage_times(
            ctx,
            &self.devices,
            &self.layers,
            &sizes,
            &self.micro_batches,
        )
    }
}

impl PooledCandidate {
    /// Every replica: (pool, index in the pool).
    fn replicas(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        replicas(&self.pools)
    }

    /// The device index of each rank of [`to_general_plan`]'s plan, in rank order.
    pub fn rank_devices(&self) -> Vec<usize> {
        (self.replicas())
            .flat_map(|(k, r)| {
                let pool = &self.pools[k];
                (pool.devices.iter())
                    .flat_map(move |row| self.groups[row[r]].members.iter().copied())
            })
            .collect()
    }
}

/// Every replica of `pools`: (pool, index in the pool).
fn replicas(pools: &[PoolLayout]) -> impl Iterator<Item = (usize, usize)> + '_ {
    (pools.iter().enumerate())
        .flat_map(|(k, pool)| (0..pool.micro_batches.len()).map(move |r| (k, r)))
}

/// One way to cut a pool: depth, micro-batch size, and the layer split that fits.
#[derive(Clone)]
struct PoolOption {
    devices: Grid<usize>,
    layers: Vec<usize>,
    micro_batch_size: usize,
    /// Samples per second per device in the steady state.
    rate: f64,
}

/// The best plan whose replicas are pipelines of their own shape, over every
/// tensor-parallel size of `tp_sizes` the cluster's nodes cut into; `None` when none
/// fits, or when the cluster is one pool of devices and no tensor-parallel size above 1
/// is asked for (the grid planner covers that).
pub fn plan_pooled(
    cost: &CostModel,
    global_batch: usize,
    sizes: &[usize],
    tp_sizes: &[usize],
) -> Result<Option<PooledCandidate>, PlanningError> {
    // The distributed optimizer's shards are not priced for per-replica pipelines.
    let cost = CostModel {
        distributed_optimizer: false,
        ..cost.clone()
    };
    Ok(plan_pooled_noting_memory(&cost, global_batch, sizes, tp_sizes)?.0)
}

/// [`plan_pooled`], and whether memory ruled anything out.
pub(super) fn plan_pooled_noting_memory(
    cost: &CostModel,
    global_batch: usize,
    sizes: &[usize],
    tp_sizes: &[usize],
) -> Result<(Option<PooledCandidate>, bool), PlanningError> {
    let (mut best, mut bound): (Option<PooledCandidate>, bool) = (None, false);
    for &t in tp_sizes {
        let Some(mut ctx) = Ctx::tensor_parallel(cost, t)? else {
            continue;
        };
        let found = plan_units(&mut ctx, global_batch, sizes, t > 1)?;
        bound |= ctx.memory_bound.get();
        if let Some(c) = found {
            if best.as_ref().is_none_or(|b| c.step_time_s < b.step_time_s) {
                best = Some(c);
            }
        }
    }
    Ok((best, bound))
}

/// The best plan over `ctx`'s units (devices, or tensor-parallel groups), when more
/// than one pool of them (or `one_pool`) and one fits.
fn plan_units(
    ctx: &mut Ctx<'_>,
    global_batch: usize,
    sizes: &[usize],
    one_pool: bool,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let pools = pools(ctx)?;
    if pools.len() < 2 && !one_pool {
        return Ok(None);
    }
    let mut options = Vec::with_capacity(pools.len());
    for pool in &pools {
        options.push(pool_options(ctx, pool, sizes)?);
    }
    // Each other pool takes at least one micro-batch of the smallest size: an option
    // whose replicas need more than the rest of the batch cannot be part of a plan.
    let smallest = sizes.iter().copied().min().unwrap_or(1);
    let room = global_batch.saturating_sub((pools.len() - 1) * smallest);
    for pool_options in &mut options {
        pool_options.retain(|o| o.devices[0].len() * o.micro_batch_size <= room);
    }
    if options.iter().any(Vec::is_empty) {
        return Ok(None);
    }
    let keep = options_kept(&options.iter().map(Vec::len).collect::<Vec<_>>());
    let mut best: Option<(f64, Vec<PoolLayout>)> = None;
    for choice in combinations(
        &options
            .iter()
            .map(|o| o.len().min(keep))
            .collect::<Vec<_>>(),
    ) {
        let chosen: Vec<&PoolOption> = choice
            .iter()
            .enumerate()
            .map(|(k, &i)| &options[k][i])
            .collect();
        if let Some((step, layouts)) = balance(ctx, &chosen, global_batch)? {
            if best.as_ref().is_none_or(|(s, _)| step < *s) {
                best = Some((step, layouts));
            }
        }
    }
    let Some((_, layouts)) = best else {
        return Ok(None);
    };
    let (candidate, _) = simulate(ctx, layouts, false)?;
    Ok(Some(candidate))
}

/// Options kept per pool: the most k with every pool's min(k, options) multiplying to at
/// most [`MOST_COMBINATIONS`] (at least 1).
fn options_kept(counts: &[usize]) -> usize {
    // Saturating: a cluster of many pools would overflow the product.
    let product = |k: usize| (counts.iter()).fold(1usize, |a, &n| a.saturating_mul(n.min(k)));
    let most = counts.iter().copied().max().unwrap_or(1);
    (1..=most)
        .take_while(|&k| product(k) <= MOST_COMBINATIONS)
        .last()
        .unwrap_or(1)
}

/// What pools devices: their class (group, speed) and usable memory's bits.
type PoolKey = (usize, Option<u64>);

/// Unit indices (devices, or tensor-parallel groups) pooled by unit class and usable
/// memory, fastest pool first (per-layer time at micro-batch size 1).
fn pools(ctx: &mut Ctx<'_>) -> Result<Vec<Vec<usize>>, PlanningError> {
    let mut pools: Vec<(PoolKey, Vec<usize>)> = Vec::new();
    for i in 0..ctx.devices.len() {
        let key = (ctx.classes[i], ctx.memory[i].map(f64::to_bits));
        match pools.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => pools.push((key, vec![i])),
        }
    }
    let mut speed = Vec::with_capacity(pools.len());
    for (_, members) in &pools {
        speed.push(ctx.costs(members[0], 1)?.layer_s);
    }
    let mut order: Vec<usize> = (0..pools.len()).collect();
    order.sort_by(|&a, &b| speed[a].total_cmp(&speed[b]));
    Ok(order.into_iter().map(|k| pools[k].1.clone()).collect())
}

/// A pool's feasible cuts (every depth dividing it and size), its fastest per device
/// first: the layer split that fits with every 1F1B micro-batch in flight.
fn pool_options(
    ctx: &mut Ctx<'_>,
    pool: &[usize],
    sizes: &[usize],
) -> Result<Vec<PoolOption>, PlanningError> {
    let (n, l) = (pool.len(), ctx.cost.model.num_layers);
    let mut options = Vec::new();
    for p in (1..=n.min(l)).filter(|p| n % p == 0) {
        let d = n / p;
        let devices = arrange(pool, p, d, Arrangement::ByReplica);
        for &b in sizes {
            let bs = vec![b; d];
            // Split for a full pipeline; a pool that only fits with fewer micro-batches in
            // flight is tried with one per replica (the batch split decides).
            let layers = match split_layers(ctx, &devices, &bs, &vec![p; d], l)? {
                Some(layers) => Some(layers),
                None => split_layers(ctx, &devices, &bs, &vec![1; d], l)?,
            };
            let Some(layers) = layers else {
                continue;
            };
            let (t, _) = stage_times(ctx, &devices, &layers, &bs, &vec![p; d])?;
            let slowest = t.iter().map(|s| s[0]).fold(0.0, f64::max);
            options.push(PoolOption {
                rate: (d * b) as f64 / slowest.max(1e-30) / n as f64,
                devices: devices.clone(),
                layers,
                micro_batch_size: b,
            });
        }
    }
    options.sort_by(|a, b| b.rate.total_cmp(&a.rate));
    Ok(options)
}

/// Every index vector below `limits`, the first index fastest.
fn combinations(limits: &[usize]) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new()];
    for &limit in limits {
        out = (out.into_iter())
            .flat_map(|prefix| {
                (0..limit).map(move |i| {
                    let mut next = prefix.clone();
                    next.push(i);
                    next
                })
            })
            .collect();
    }
    out
}

/// The batch split over the pools' replicas (exact min-max over samples), then each
/// pool's layers re-split for its counts, twice; the closed-form step and the layouts,
/// or `None` when the sizes cannot make the batch or a split stops fitting.
fn balance(
    ctx: &mut Ctx<'_>,
    chosen: &[&PoolOption],
    global_batch: usize,
) -> Result<Option<(f64, Vec<PoolLayout>)>, PlanningError> {
    let mut layouts: Vec<PoolLayout> = (chosen.iter())
        .map(|o| PoolLayout {
            devices: o.devices.clone(),
            layers: o.layers.clone(),
            micro_batch_size: o.micro_batch_size,
            micro_batches: vec![1; o.devices[0].len()],
        })
        .collect();
    for _ in 0..2 {
        let mut paces = Vec::new();
        for pool in &layouts {
            let d = pool.micro_batches.len();
            let (t, c) = pool.stage_times(ctx)?;
            let most = most_micro_batches(ctx, pool)?;
            for r in 0..d {
                paces.push(ReplicaPace {
                    micro_batch_size: pool.micro_batch_size,
                    first_s: pipeline_time(&t, &c, r, 1),
                    each_s: t.iter().map(|s| s[r]).fold(0.0, f64::max),
                    most_micro_batches: most,
                });
            }
        }
        let Some(counts) = min_max_samples(global_batch, &paces) else {
            return Ok(None);
        };
        let mut counts = counts.into_iter();
        for pool in &mut layouts {
            let d = pool.micro_batches.len();
            pool.micro_batches = counts.by_ref().take(d).collect();
            let bs = vec![pool.micro_batch_size; d];
            let l = ctx.cost.model.num_layers;
            match split_layers(ctx, &pool.devices, &bs, &pool.micro_batches, l)? {
                Some(layers) => pool.layers = layers,
                None => return Ok(None),
            }
        }
    }
    let step = closed_form_step_s(ctx, &layouts)?;
    Ok(Some(polish(ctx, layouts, step)?))
}

/// Whether every rank of every pool holds its stage with its 1F1B micro-batches in
/// flight.
fn fits_all(ctx: &mut Ctx<'_>, layouts: &[PoolLayout]) -> Result<bool, PlanningError> {
    for pool in layouts {
        let (p, b) = (pool.layers.len(), pool.micro_batch_size);
        for (i, row) in pool.devices.iter().enumerate() {
            for (&dev, &m) in row.iter().zip(&pool.micro_batches) {
                let holding = StageHolding {
                    layers: pool.layers[i],
                    first: i == 0,
                    last: i + 1 == p,
                    in_flight: (p - i).min(m),
                    micro_batch_size: b,
                    optimizer_share: 1.0,
                    recompute: false,
                };
                let fit = stage_fit(ctx, dev, holding)?;
                if ctx.exceeds(fit.need, ctx.memory[dev]) {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

/// The most micro-batches per replica the pool's ranks hold with its layers (a stage
/// keeps at most its depth in flight, so fitting that many fits any count).
fn most_micro_batches(ctx: &mut Ctx<'_>, pool: &PoolLayout) -> Result<usize, PlanningError> {
    let p = pool.layers.len();
    let mut most = 0;
    for m in 1..=p {
        let trial = PoolLayout {
            micro_batches: vec![m; pool.micro_batches.len()],
            ..pool.clone()
        };
        if !fits_all(ctx, std::slice::from_ref(&trial))? {
            return Ok(most);
        }
        most = m;
    }
    Ok(usize::MAX)
}

/// Local moves the min-max splits do not see (they balance compute, not the reduction
/// and optimizer a stage's parameters cost, nor a short pipeline's sum of stages): a
/// layer to a neighbouring stage, a micro-batch to another replica of the same size;
/// each kept while the closed-form step falls and every rank fits.
fn polish(
    ctx: &mut Ctx<'_>,
    mut layouts: Vec<PoolLayout>,
    mut step: f64,
) -> Result<(f64, Vec<PoolLayout>), PlanningError> {
    loop {
        let moves = moves(ctx, &layouts)?;
        let mut improved = false;
        for m in moves {
            let Some(next) = m.apply(&layouts) else {
                continue;
            };
            if !fits_all(ctx, &next)? {
                continue;
            }
            let s = closed_form_step_s(ctx, &next)?;
            if s < step * (1.0 - 1e-12) {
                (step, layouts, improved) = (s, next, true);
            }
        }
        if !improved {
            return Ok((step, layouts));
        }
    }
}

/// The moves [`polish`] tries: each layer move in one pool and in every pool at once,
/// and a micro-batch from the slowest replica to each other of its size (moving counts
/// moves no parameters, so only the slowest replica's can shorten the step).
fn moves(ctx: &mut Ctx<'_>, layouts: &[PoolLayout]) -> Result<Vec<Move>, PlanningError> {
    let mut moves = Vec::new();
    let pairs = |p: usize| (1..p).flat_map(|i| [(i - 1, i), (i, i - 1)]);
    for (k, pool) in layouts.iter().enumerate() {
        for (from, to) in pairs(pool.layers.len()) {
            let pool = Some(k);
            moves.push(Move::Layer { pool, from, to });
        }
    }
    let deepest = layouts.iter().map(|p| p.layers.len()).max().unwrap_or(1);
    for (from, to) in pairs(deepest) {
        moves.push(Move::Layer {
            pool: None,
            from,
            to,
        });
    }
    let mut slowest = ((0, 0), f64::MIN);
    for (k, pool) in layouts.iter().enumerate() {
        let (t, c) = pool.stage_times(ctx)?;
        for (r, &m) in pool.micro_batches.iter().enumerate() {
            let time = pipeline_time(&t, &c, r, m);
            if time > slowest.1 {
                slowest = ((k, r), time);
            }
        }
    }
    let from = slowest.0;
    for (k, pool) in layouts.iter().enumerate() {
        for r in 0..pool.micro_batches.len() {
            if (k, r) != from && pool.micro_batch_size == layouts[from.0].micro_batch_size {
                moves.push(Move::MicroBatch { from, to: (k, r) });
            }
        }
    }
    Ok(moves)
}

/// One step of [`polish`].
#[derive(Clone, Copy)]
enum Move {
    /// A layer from one stage of a pool's replicas to a neighbouring one; with no pool,
    /// in every pool deep enough.
    Layer {
        pool: Option<usize>,
        from: usize,
        to: usize,
    },
    /// A micro-batch from one replica (pool, index) to another of the same size.
    MicroBatch {
        from: (usize, usize),
        to: (usize, usize),
    },
}

impl Move {
    /// The layouts after the move, `None` when it empties a stage or a replica.
    fn apply(self, layouts: &[PoolLayout]) -> Option<Vec<PoolLayout>> {
        let mut next = layouts.to_vec();
        match self {
            Move::Layer { pool, from, to } => {
                for (k, layout) in next.iter_mut().enumerate() {
                    let moved = pool.map_or(layout.layers.len() > from.max(to), |p| p == k);
                    if moved {
                        let layers = &mut layout.layers;
                        layers[from] = layers[from].checked_sub(1).filter(|&n| n > 0)?;
                        layers[to] += 1;
                    }
                }
            }
            Move::MicroBatch { from, to } => {
                let m = &mut next[from.0].micro_batches[from.1];
                *m = m.checked_sub(1).filter(|&n| n > 0)?;
                next[to.0].micro_batches[to.1] += 1;
            }
        }
        Some(next)
    }
}

/// The step in closed form: the slowest replica's 1F1B, the busiest rank's reduction,
/// the slowest optimizer step.
fn closed_form_step_s(ctx: &mut Ctx<'_>, layouts: &[PoolLayout]) -> Result<f64, PlanningError> {
    let reduce = max(&reduce_s(ctx, layouts));
    Ok(pipelines_s(ctx, layouts)? + reduce + optimizer_s(ctx, layouts))
}

/// The slowest replica's 1F1B closed form.
fn pipelines_s(ctx: &mut Ctx<'_>, layouts: &[PoolLayout]) -> Result<f64, PlanningError> {
    let mut slowest = 0.0f64;
    for pool in layouts {
        let (t, c) = pool.stage_times(ctx)?;
        for (r, &m) in pool.micro_batches.iter().enumerate() {
            slowest = slowest.max(pipeline_time(&t, &c, r, m));
        }
    }
    Ok(slowest)
}

/// Each replica's stage boundaries in pieces (embedding = 0, layer i = i + 1, head =
/// L + 1), per replica the (start, end) piece range of each stage and its device.
fn stage_pieces(pools: &[PoolLayout], l: usize) -> Vec<Vec<(usize, usize, usize)>> {
    replicas(pools)
        .map(|(k, r)| {
            let pool = &pools[k];
            let p = pool.layers.len();
            let mut start = 1;
            (0..p)
                .map(|i| {
                    let from = if i == 0 { 0 } else { start };
                    start += pool.layers[i];
                    let to = if i + 1 == p { l + 2 } else { start };
                    (from, to, pool.devices[i][r])
                })
                .collect()
        })
        .collect()
}

/// Per (replica, stage), replica by replica, the seconds of its gradient reduction: each
/// segment between the union of every replica's boundaries all-reduced over its
/// holders (one per replica; tensor-parallel groups of the same shares each member its
/// share, side by side; groups split otherwise the whole tensors over every member), a
/// stage's segments one after another.
fn reduce_s(ctx: &Ctx<'_>, pools: &[PoolLayout]) -> Vec<f64> {
    let model = &ctx.cost.model;
    let l = model.num_layers;
    let stages = stage_pieces(pools, l);
    let mut cuts: Vec<usize> = stages.iter().flatten().map(|&(from, _, _)| from).collect();
    cuts.push(l + 2);
    cuts.sort_unstable();
    cuts.dedup();
    let params = |from: usize, to: usize| {
        (from..to)
            .map(|piece| match piece {
                0 => model.embedding_params(),
                x if x == l + 1 => model.embedding_params(),
                _ => model.layer_params(),
            })
            .sum::<f64>()
    };
    // Rank of (replica, stage): replica by replica, stage by stage.
    let first_rank: Vec<usize> = (stages.iter())
        .scan(0, |next, s| {
            let first = *next;
            *next += s.len();
            Some(first)
        })
        .collect();
    let mut seconds = vec![0.0; stages.iter().map(Vec::len).sum()];
    for w in cuts.windows(2) {
        let (from, to) = (w[0], w[1]);
        let holders: Vec<(usize, usize)> = (stages.iter().enumerate())
            .map(|(r, s)| {
                (
                    r,
                    s.iter()
                        .position(|&(a, b, _)| a <= from && to <= b)
                        .expect("a stage holds each segment"),
                )
            })
            .collect();
        let devices: Vec<&crate::cluster::Device> = holders
            .iter()
            .map(|&(r, i)| &ctx.devices[stages[r][i].2])
            .collect();
        // Holders split alike reduce share by share, side by side; otherwise the trainer
        // reduces whole tensors over every member of every holder.
        let units: Vec<usize> = holders.iter().map(|&(r, i)| stages[r][i].2).collect();
        let alike = (units.iter()).all(|&u| ctx.groups[u].shares == ctx.groups[units[0]].shares);
        let t = match alike {
            true => {
                let share = units
                    .iter()
                    .map(|&u| ctx.state_fraction(u))
                    .fold(0.0, f64::max);
                (ctx.cost).allreduce_seconds(&devices, params(from, to) * 4.0 * share)
            }
            false => {
                let members: Vec<&crate::cluster::Device> = (units.iter())
                    .flat_map(|&u| ctx.groups[u].members.iter().map(|&m| &ctx.all[m]))
                    .collect();
                (ctx.cost).allreduce_seconds(&members, params(from, to) * 4.0)
            }
        };
        for (r, i) in holders {
            seconds[first_rank[r] + i] += t;
        }
    }
    seconds
}

/// The slowest rank's optimizer step over its own parameters (0 where not priced).
fn optimizer_s(ctx: &Ctx<'_>, pools: &[PoolLayout]) -> f64 {
    let mut slowest = 0.0f64;
    for pool in pools {
        let p = pool.layers.len();
        for (i, row) in pool.devices.iter().enumerate() {
            let params = ctx
                .cost
                .model
                .stage_params(pool.layers[i], i == 0, i + 1 == p);
            for &unit in row {
                let s = ctx.optimizer_seconds(unit, params);
                slowest = slowest.max(s.unwrap_or(0.0));
            }
        }
    }
    slowest
}

/// The plan `synerfuse train --plan` runs: the pools' replicas in order, ranks replica
/// by replica, stage by stage, a tensor-parallel group's members together.
pub fn to_general_plan(
    cost: &CostModel,
    candidate: &PooledCandidate,
) -> Result<GeneralPlan, GeneralPlanError> {
    let devices = cost.cluster.devices();
    let mut next_rank = 0;
    let mut replicas = Vec::new();
    for (k, r) in candidate.replicas() {
        let pool = &candidate.pools[k];
        let stages =
            StageLayout::new(pool.layers.clone(), cost.model.num_layers).map_err(|source| {
                GeneralPlanError::Layout {
                    replica: replicas.len(),
                    source,
                }
            })?;
        let groups: Vec<&TpGroup> = (pool.devices.iter())
            .map(|row| &candidate.groups[row[r]])
            .collect();
        let mut ranks = Vec::with_capacity(groups.len());
        for group in &groups {
            ranks.push((next_rank..next_rank + group.size()).collect());
            next_rank += group.size();
        }
        let even = |g: &TpGroup| g.shares.iter().all(|&s| s == g.shares[0]);
        replicas.push(ReplicaPipeline {
            stages,
            batch: ReplicaBatch {
                micro_batch_size: pool.micro_batch_size,
                num_micro_batches: pool.micro_batches[r],
            },
            ranks,
            recompute: match candidate.recompute.get(replicas.len()) {
                Some(flags) if flags.iter().any(|&x| x) => flags.clone(),
                _ => Vec::new(),
            },
            tp_shares: match groups.iter().all(|g| even(g)) {
                true => Vec::new(),
                false => (groups.iter())
                    .map(|g| (!even(g)).then(|| g.shares.clone()))
                    .collect(),
            },
            placements: (groups.iter())
                .flat_map(|g| g.members.iter().map(|&i| placement(&devices[i])))
                .collect(),
        });
    }
    GeneralPlan::new(replicas)
}

/// Simulates the plan's 1F1B programs (every replica at once, each message at its
/// link's cost), then the reduction once every replica has finished and the optimizer;
/// the candidate with its times, and each rank's spans when `record`.
pub(super) fn simulate(
    ctx: &mut Ctx<'_>,
    pools: Vec<PoolLayout>,
    record: bool,
) -> Result<(PooledCandidate, Vec<RankTimeline>), PlanningError> {
    let mut candidate = PooledCandidate {
        pools,
        groups: ctx.groups.clone(),
        recompute: Vec::new(),
        options: TrainOptions {
            recompute: ctx.cost.recompute,
            distributed_optimizer: ctx.cost.distributed_optimizer,
        },
        step_time_s: 0.0,
        pipeline_s: 0.0,
        reduce_s: 0.0,
        optimizer_s: 0.0,
    };
    let plan = to_general_plan(ctx.cost, &candidate)?;
    let programs = plan.schedule(ScheduleKind::OneFOneB)?;
    // Per rank: its device, micro-batch size, per-micro-batch time, forward fraction,
    // and its (replica, stage) position.
    let mut ranks: Vec<(usize, usize, f64, f64, usize)> = Vec::new();
    for pool in &candidate.pools {
        let d = pool.micro_batches.len();
        let (t, _) = pool.stage_times(ctx)?;
        let sizes = vec![pool.micro_batch_size; d];
        let fits = stage_fits(
            ctx,
            &pool.devices,
            &pool.layers,
            &sizes,
            &pool.micro_batches,
        )?;
        for r in 0..d {
            candidate
                .recompute
                .push(fits.iter().map(|row| row[r].recompute).collect());
            for (i, row) in t.iter().enumerate() {
                let unit = pool.devices[i][r];
                let f = fits[i][r].costs.forward_fraction;
                let position = ranks.last().map_or(0, |&(.., p)| p + 1);
                for &dev in &ctx.groups[unit].members {
                    ranks.push((dev, pool.micro_batch_size, row[r], f, position));
                }
            }
        }
    }
    let (devices, cost) = (&ctx.all, ctx.cost);
    let op_seconds = |rank: usize, pass: Pass, _| {
        let (_, _, t, f, _) = ranks[rank];
        match pass {
            Pass::Forward => t * f,
            Pass::Backward => t * (1.0 - f),
        }
    };
    let message_seconds = |from: usize, to: usize| {
        let b = ranks[from].1;
        cost.transfer(&devices[ranks[from].0], &devices[ranks[to].0], b)
    };
    let report = match record {
        true => sim::simulate_spans(&programs, op_seconds, message_seconds),
        false => sim::simulate(&programs, op_seconds, message_seconds),
    }
    .map_err(crate::PlanError::from)?;
    let reduce = reduce_s(ctx, &candidate.pools);
    let optimizer = optimizer_s(ctx, &candidate.pools);
    let done = report.makespan_s;
    candidate.pipeline_s = done;
    candidate.reduce_s = max(&reduce);
    candidate.optimizer_s = optimizer;
    candidate.step_time_s = done + candidate.reduce_s + optimizer;
    let mut rows = Vec::new();
    for (rank, mut spans) in report.spans.into_iter().enumerate() {
        let mut span = |kind, start_s: f64, end_s: f64| {
            if end_s > start_s {
                spans.push(Span {
                    kind,
                    start_s,
                    end_s,
                    micro_batch: None,
                });
            }
        };
        span(SpanKind::Wait, report.finish_s[rank], done);
        let reduce = reduce[ranks[rank].4];
        span(SpanKind::Reduce, done, done + reduce);
        span(SpanKind::Wait, done + reduce, done + candidate.reduce_s);
        let after = done + candidate.reduce_s;
        span(SpanKind::Optimizer, after, after + optimizer);
        let (replica, stage) = plan.position(rank).unwrap_or_default();
        rows.push(RankTimeline {
            label: format!(
                "rank {rank}: replica {replica}, stage {stage}, {}",
                devices[ranks[rank].0].kind
            ),
            spans,
        });
    }
    Ok((candidate, rows))
}

/// The simulated step of a per-replica-pipeline plan, rank by rank.
pub fn pooled_timeline(
    cost: &CostModel,
    candidate: &PooledCandidate,
) -> Result<crate::timeline::Timeline, PlanningError> {
    let variant = TrainOptions {
        distributed_optimizer: false,
        ..candidate.options
    }
    .cost(cost);
    let mut ctx = Ctx::with_groups(&variant, cost.cluster.devices(), candidate.groups.clone());
    let (simulated, ranks) = simulate(&mut ctx, candidate.pools.clone(), true)?;
    Ok(crate::timeline::Timeline {
        title: format!(
            "predicted: {} replicas of their own pipelines, step {:.4} s",
            candidate.replicas().count(),
            simulated.step_time_s
        ),
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterSpec;
    use crate::cost::ModelShape;
    use proptest::prelude::*;

    fn cost(toml: &str, layers: usize, hidden: usize) -> CostModel {
        let cluster = ClusterSpec::from_toml(toml).unwrap();
        let model = ModelShape {
            num_layers: layers,
            hidden_size: hidden,
            num_heads: 32,
            num_kv_heads: 32,
            ffn_hidden_size: hidden * 8 / 3,
            vocab_size: 32_000,
            seq_length: 2048,
            tied: false,
        };
        CostModel::new(model, cluster, None)
    }

    /// One 80 GB device holds a 1.3B-parameter model's training state (27 GB) whole;
    /// 16 GB T4s need four stages for it. The pooled plan keeps the A100 a replica of its
    /// own and pipelines the T4s four deep, which no grid expresses (a grid's replicas
    /// all have the same stages).
    #[test]
    fn small_devices_pipeline_while_a_large_one_stays_whole() {
        let cost = cost(
            "[[group]]\nkind = \"a100-80g\"\ncount = 1\nnode = \"a\"\n\
             [[group]]\nkind = \"t4\"\ncount = 4\nnode = \"a\"\n\
             [network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n",
            24,
            2048,
        );
        let pooled = plan_pooled(&cost, 32, &[1, 2], &[1])
            .unwrap()
            .expect("a pooled plan");
        let depths: Vec<usize> = pooled.pools.iter().map(|p| p.layers.len()).collect();
        assert_eq!(depths, [1, 4], "{pooled:?}");
        let plan = to_general_plan(&cost, &pooled).unwrap();
        assert_eq!(plan.replicas().len(), 2);
        assert_eq!(plan.batches().global_batch_size(), 32);
        assert!(plan.to_grid().is_none(), "no grid expresses it");
        // The planner's outcome carries it beside the grid plans.
        let request = super::super::PlanRequest {
            global_batch_size: 32,
            micro_batch_sizes: vec![1, 2],
            top_k: 1,
            tensor_parallel_sizes: vec![1],
            recompute: super::super::Choice::Off,
            distributed_optimizer: super::super::Choice::Off,
        };
        let outcome = super::super::plan(&cost, &request).unwrap();
        assert_eq!(outcome.pooled.as_ref(), Some(&pooled));
    }

    /// Every way to write `total` as `parts` positive summands.
    fn compositions(total: usize, parts: usize) -> Vec<Vec<usize>> {
        if parts == 1 {
            return vec![vec![total]];
        }
        (1..total.saturating_sub(parts - 2))
            .flat_map(|first| {
                compositions(total - first, parts - 1)
                    .into_iter()
                    .map(move |rest| [vec![first], rest].concat())
            })
            .collect()
    }

    /// Every count per replica (each at least 1) whose samples make `g`.
    fn every_count(sizes: &[usize], g: usize) -> Vec<Vec<usize>> {
        let Some((&b, rest)) = sizes.split_first() else {
            return if g == 0 { vec![Vec::new()] } else { Vec::new() };
        };
        (1..=g / b)
            .flat_map(|m| {
                every_count(rest, g - m * b)
                    .into_iter()
                    .map(move |tail| [vec![m], tail].concat())
            })
            .collect()
    }

    /// The least closed-form step over every plan of the planner's pools: per pool every
    /// depth dividing it, micro-batch size and layer split, per replica every count,
    /// every rank within its memory.
    fn brute_force(cost: &CostModel, g: usize, sizes: &[usize]) -> Option<(f64, Vec<PoolLayout>)> {
        let mut ctx = Ctx::new(cost);
        let l = cost.model.num_layers;
        let mut cuts_per_pool = Vec::new();
        for pool in pools(&mut ctx).unwrap() {
            let n = pool.len();
            let mut cuts = Vec::new();
            for p in (1..=n.min(l)).filter(|p| n % p == 0) {
                for &b in sizes {
                    for layers in compositions(l, p) {
                        cuts.push((arrange(&pool, p, n / p, Arrangement::ByReplica), layers, b));
                    }
                }
            }
            cuts_per_pool.push(cuts);
        }
        let limits: Vec<usize> = cuts_per_pool.iter().map(Vec::len).collect();
        let mut best: Option<(f64, Vec<PoolLayout>)> = None;
        for choice in combinations(&limits) {
            let cuts: Vec<_> = (choice.iter().enumerate())
                .map(|(k, &i)| cuts_per_pool[k][i].clone())
                .collect();
            let replica_sizes: Vec<usize> = (cuts.iter())
                .flat_map(|(devices, _, b)| vec![*b; devices[0].len()])
                .collect();
            for counts in every_count(&replica_sizes, g) {
                let mut counts = counts.into_iter();
                let layouts: Vec<PoolLayout> = (cuts.iter())
                    .map(|(devices, layers, b)| PoolLayout {
                        devices: devices.clone(),
                        layers: layers.clone(),
                        micro_batch_size: *b,
                        micro_batches: counts.by_ref().take(devices[0].len()).collect(),
                    })
                    .collect();
                if !fits_all(&mut ctx, &layouts).unwrap() {
                    continue;
                }
                let step = closed_form_step_s(&mut ctx, &layouts).unwrap();
                if best.as_ref().is_none_or(|(s, _)| step < *s) {
                    best = Some((step, layouts));
                }
            }
        }
        best
    }

    /// A 32 GB V100 cannot hold a 2.4B-parameter model's 48 GB of state, nor give its
    /// node's A100 a replica of its own; as a tensor-parallel group the two hold it
    /// together, the A100 the larger share (312 vs 125 TFLOPS).
    #[test]
    fn unequal_devices_of_a_node_share_a_stage() {
        let cost = cost(
            "[[group]]\nkind = \"a100-80g\"\ncount = 1\nnode = \"a\"\n\
             [[group]]\nkind = \"v100\"\ncount = 1\nnode = \"a\"\n\
             [network]\nintra_node_gbs = 300\ninter_node_gbs = 12\n",
            36,
            2304,
        );
        assert_eq!(plan_pooled(&cost, 16, &[1, 2], &[1]).unwrap(), None);
        let pooled = plan_pooled(&cost, 16, &[1, 2], &[1, 2])
            .unwrap()
            .expect("a tensor-parallel plan");
        assert_eq!(pooled.groups.len(), 1);
        let shares = &pooled.groups[0].shares;
        assert!(shares[0] > 2 * shares[1], "{shares:?}");
        let plan = to_general_plan(&cost, &pooled).unwrap();
        let replica = &plan.replicas()[0];
        assert_eq!(replica.ranks, [[0, 1]]);
        assert_eq!(replica.tp_shares, [Some(shares.clone())]);
        assert_eq!(plan.batches().global_batch_size(), 16);
        let timeline = pooled_timeline(&cost, &pooled).unwrap();
        assert_eq!(timeline.ranks.len(), 2);
    }

    /// Two tensor-parallel replicas split unlike ([1, 1] on two A100s, [5, 2] on an A100
    /// and a V100) reduce whole tensors over all four ranks, as the trainer does; split
    /// alike, each rank its share beside its peer.
    #[test]
    fn groups_split_unlike_reduce_whole_tensors() {
        let cost = cost(
            "[[group]]\nkind = \"a100-80g\"\ncount = 3\nnode = \"a\"\n\
             [[group]]\nkind = \"v100\"\ncount = 1\nnode = \"a\"\n\
             [network]\nintra_node_gbs = 300\ninter_node_gbs = 12\n",
            4,
            1024,
        );
        let ctx = Ctx::tensor_parallel(&cost, 2).unwrap().unwrap();
        assert_ne!(ctx.groups[0].shares, ctx.groups[1].shares);
        let layout = |unit| PoolLayout {
            devices: vec![vec![unit]],
            layers: vec![4],
            micro_batch_size: 1,
            micro_batches: vec![1],
        };
        let params = cost.model.stage_params(4, true, true) - cost.model.hidden_size as f64;
        let all: Vec<&crate::cluster::Device> = ctx.all.iter().collect();
        let whole = cost.allreduce_seconds(&all, params * 4.0);
        let reduce = reduce_s(&ctx, &[layout(0), layout(1)]);
        assert!(
            (reduce[0] - whole).abs() < 1e-12 * whole,
            "{reduce:?} vs {whole}"
        );
        let pair = [&ctx.devices[0], &ctx.devices[0]];
        let alike = reduce_s(&ctx, &[layout(0), layout(0)]);
        let half = cost.allreduce_seconds(&pair, params * 4.0 * ctx.state_fraction(0));
        assert!(
            (alike[0] - half).abs() < 1e-12 * half,
            "{alike:?} vs {half}"
        );
    }

    /// A cluster of custom groups (TFLOPS, memory GB, count), each on a node of its own,
    /// and a model of `layers` layers.
    fn custom_cluster(groups: &[(f64, f64, usize)], layers: usize) -> CostModel {
        let mut toml = String::new();
        for (i, (tflops, mem, count)) in groups.iter().enumerate() {
            toml.push_str(&format!(
                "[[group]]\nkind = \"custom\"\ncount = {count}\nnode = \"n{i}\"\ntflops_bf16 = {tflops}\nmemory_gb = {mem}\nmem_bw_gbs = 1000\n"
            ));
        }
        toml.push_str("[network]\nintra_node_gbs = 100\ninter_node_gbs = 10\n");
        cost(&toml, layers, 1024)
    }

    /// How far the planner's step may be above the least: its layer splits and batch
    /// split are exact each for the other fixed, and a local search (one layer or one
    /// micro-batch moved at a time) then stops at a local minimum. Measured: 10,210
    /// random cases in a row found the least; the next stopped 0.95 % short (a layer and
    /// a micro-batch had to move together); 20,000 more stayed within this gap.
    const LOCAL_SEARCH_GAP: f64 = 0.02;

    proptest! {
        /// On clusters small enough to try every per-replica-pipeline plan, the planner's
        /// finds one exactly when one exists, and its step (closed form) is the least but
        /// for the local search's gap.
        #[test]
        fn pooled_plans_match_brute_force(
            groups in proptest::collection::vec((10.0f64..400.0, 2.0f64..40.0, 1usize..=3), 2..=2),
            layers in 2usize..=4,
            g in 1usize..=8,
        ) {
            let cost = custom_cluster(&groups, layers);
            let found = plan_pooled(&cost, g, &[1, 2], &[1]).unwrap();
            let best = brute_force(&cost, g, &[1, 2]);
            prop_assert_eq!(found.is_some(), best.is_some(), "{:?} vs {:?}", found, best);
            if let (Some(found), Some((best, layouts))) = (found, best) {
                let step = closed_form_step_s(&mut Ctx::new(&cost), &found.pools).unwrap();
                prop_assert!(step <= best * (1.0 + LOCAL_SEARCH_GAP), "planner {} s: {:?}, brute force {} s: {:?}", step, found.pools, best, layouts);
            }
        }

        /// Every pooled plan is a valid general plan: the global batch, each rank's
        /// memory (a tensor-parallel member its share), the schedule; its step is the
        /// drawn one and within the bound.
        #[test]
        fn pooled_plans_are_valid(
            groups in proptest::collection::vec((10.0f64..400.0, 4.0f64..80.0, 1usize..=3), 2..=3),
            layers in 2usize..=8,
            g in 1usize..=16,
            one_node in any::<bool>(),
        ) {
            let mut cost = custom_cluster(&groups, layers);
            if one_node {
                cost.cluster.group.iter_mut().for_each(|x| x.node = Some("n".into()));
            }
            let Some(pooled) = plan_pooled(&cost, g, &[1, 2], &[1, 2]).unwrap() else {
                return Ok(());
            };
            let plan = to_general_plan(&cost, &pooled).unwrap();
            prop_assert_eq!(plan.batches().global_batch_size(), g);
            prop_assert_eq!(plan.world_size(), cost.cluster.devices().len());
            prop_assert!(plan.schedule(ScheduleKind::OneFOneB).is_ok());
            let devices = cost.cluster.devices();
            for pool in &pooled.pools {
                let p = pool.layers.len();
                prop_assert_eq!(pool.layers.iter().sum::<usize>(), layers);
                for (i, row) in pool.devices.iter().enumerate() {
                    for (r, &unit) in row.iter().enumerate() {
                        let group = &pooled.groups[unit];
                        let b = pool.micro_batch_size;
                        let k = cost.stage_costs(&devices[group.members[0]], b).unwrap();
                        let in_flight = (p - i).min(pool.micro_batches[r]);
                        let holding = StageHolding { layers: pool.layers[i], first: i == 0, last: i + 1 == p, in_flight, micro_batch_size: b, optimizer_share: 1.0, recompute: false };
                        let need = cost.memory_bytes(&k, &holding);
                        for (&dev, share) in group.members.iter().zip(&group.state) {
                            prop_assert_eq!(&devices[dev].node, &devices[group.members[0]].node);
                            prop_assert!(need * share <= cost.usable_memory(&devices[dev]).unwrap() + 1.0);
                        }
                    }
                }
            }
            let drawn = pooled_timeline(&cost, &pooled).unwrap();
            prop_assert!((drawn.step_s() - pooled.step_time_s).abs() < 1e-9 * pooled.step_time_s);
            let request = super::super::PlanRequest { global_batch_size: g, micro_batch_sizes: vec![1, 2], top_k: 1, tensor_parallel_sizes: vec![1], recompute: super::super::Choice::Off, distributed_optimizer: super::super::Choice::Off };
            let bound = super::super::throughput_bound(&mut Ctx::new(&cost), &request).unwrap();
            let fraction = bound.fraction((g * 2048) as f64, pooled.step_time_s);
            prop_assert!(fraction > 0.0 && fraction <= 1.0 + 1e-9, "{}", fraction);
        }
    }
}
