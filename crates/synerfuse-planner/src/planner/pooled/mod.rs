//! Plans whose replicas are pipelines of their own shape (the general plan): the devices
//! pooled by class (group and speed), each pool cut into replicas of one depth with one
//! layer split and micro-batch size, the batch split over every replica of every pool.
//! A pool of small devices can pipeline deep while a pool of large ones keeps whole
//! replicas, which no grid (every replica the same stages) expresses.

use super::{
    error::PlanningError,
    expert::expert_groups,
    grid::arrange,
    outcome::Arrangement,
    outcome::{Grid, PoolLayout, PooledCandidate},
    pricing::{
        max, optimizer_s, pipeline_time, pooled_segments, reduce_s, stage_fit, stage_fits,
        stage_times, Ctx, StageFit,
    },
    samples::{min_max_samples, ReplicaPace},
    simulate::simulate_pools,
    split::split_layers,
    tensor::TpGroup,
    UnitShape,
};
use crate::cost::{CostModel, StageHolding};

/// The most combinations of pool options tried: each pool keeps its fastest options
/// per device, as many as keep the product under this (every option on small clusters).
pub(super) const MOST_COMBINATIONS: usize = 81;

impl PoolLayout {
    /// Per (stage, replica) the seconds of one micro-batch, and of its send to the next stage.
    pub(super) fn stage_times(
        &self,
        ctx: &mut Ctx<'_>,
    ) -> Result<(Grid<f64>, Grid<f64>), PlanningError> {
        let sizes = vec![self.micro_batch_size; self.micro_batches.len()];
        stage_times(
            ctx,
            &self.devices,
            &self.layers,
            &sizes,
            &self.micro_batches,
        )
    }

    /// Per (stage, replica) how it fits: its costs, whether it recomputes, its memory.
    pub(super) fn stage_fits(&self, ctx: &mut Ctx<'_>) -> Result<Grid<StageFit>, PlanningError> {
        let sizes = vec![self.micro_batch_size; self.micro_batches.len()];
        stage_fits(
            ctx,
            &self.devices,
            &self.layers,
            &sizes,
            &self.micro_batches,
        )
    }
}

/// One way to cut a pool: depth, micro-batch size, and the layer split that fits.
#[derive(Clone)]
pub(super) struct PoolOption {
    pub(super) devices: Grid<usize>,
    pub(super) layers: Vec<usize>,
    pub(super) micro_batch_size: usize,
    /// Samples per second per device in the steady state.
    pub(super) rate: f64,
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
    Ok(plan_pooled_noting_memory(&cost, global_batch, sizes, (tp_sizes, &[]), None)?.0)
}

/// What a per-replica plan chose for one pool (pools fastest first): a folded cluster's
/// search chooses it, the whole cluster lays out only it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PoolShape {
    pub(super) tensor_parallel_size: usize,
    pub(super) context_parallel_size: usize,
    pub(super) stages: usize,
    pub(super) micro_batch_size: usize,
}

impl PoolShape {
    /// Each pool's shape in `c`.
    pub(super) fn of(c: &PooledCandidate) -> Vec<PoolShape> {
        (c.pools.iter())
            .map(|pool| PoolShape {
                tensor_parallel_size: c.groups[pool.devices[0][0]].tp_size(),
                context_parallel_size: c.groups[pool.devices[0][0]].cp,
                stages: pool.layers.len(),
                micro_batch_size: pool.micro_batch_size,
            })
            .collect()
    }

    /// The shape of its units: (tensor-, context-parallel size).
    fn unit(&self) -> UnitShape {
        (self.tensor_parallel_size, self.context_parallel_size)
    }

    /// Whether `only` (none: anything) lets pool `k` take units of `shape`.
    fn allows(only: Option<&[PoolShape]>, k: usize, shape: UnitShape) -> bool {
        only.is_none_or(|s| s.get(k).is_some_and(|s| s.unit() == shape))
    }
}

/// [`plan_pooled`], and whether memory ruled anything out. Tensor-parallel sizes whose
/// groups each lie within one pool of alike devices are chosen pool by pool (a size per
/// device kind); a size whose groups mix pools (nodes of mixed devices) is tried for the
/// whole cluster. Context-parallel groups of `cp_sizes` (of each tensor-parallel size)
/// are searched where memory ruled plans out without them, with the others, so that a
/// pool of small devices can split sequences beside a pool that does not.
pub(super) fn plan_pooled_noting_memory(
    cost: &CostModel,
    global_batch: usize,
    sizes: &[usize],
    (tp_sizes, cp_sizes): (&[usize], &[usize]),
    only: Option<&[PoolShape]>,
) -> Result<(Option<PooledCandidate>, bool), PlanningError> {
    let tp: Vec<UnitShape> = tp_sizes.iter().map(|&t| (t, 1)).collect();
    let (best, bound) = plan_shapes(cost, global_batch, sizes, &tp, only)?;
    let cp: Vec<UnitShape> = (cp_sizes.iter().filter(|&&c| c > 1))
        .flat_map(|&c| tp_sizes.iter().map(move |&t| (t, c)))
        .collect();
    let chosen = only.is_none_or(|s| s.iter().any(|x| x.context_parallel_size > 1));
    if cp.is_empty() || !chosen || (only.is_none() && !bound) {
        return Ok((best, bound));
    }
    let shapes: Vec<UnitShape> = tp.into_iter().chain(cp).collect();
    let (found, _) = plan_shapes(cost, global_batch, sizes, &shapes, only)?;
    let best = match (best, found) {
        (Some(b), Some(f)) if f.step_time_s >= b.step_time_s => Some(b),
        (b, f) => f.or(b),
    };
    Ok((best, bound))
}

/// The best per-replica plan over units of `shapes`, and whether memory ruled anything
/// out (see [`plan_pooled_noting_memory`]).
fn plan_shapes(
    cost: &CostModel,
    global_batch: usize,
    sizes: &[usize],
    shapes: &[UnitShape],
    only: Option<&[PoolShape]>,
) -> Result<(Option<PooledCandidate>, bool), PlanningError> {
    let (mut best, mut bound): (Option<PooledCandidate>, bool) = (None, false);
    let mut keep = |found: Option<PooledCandidate>| {
        if let Some(c) = found {
            if best.as_ref().is_none_or(|b| c.step_time_s < b.step_time_s) {
                best = Some(c);
            }
        }
    };
    let mut single = Ctx::new(cost);
    let single_pools = pools(&mut single)?;
    let kinds = device_sets(&single, &single_pools);
    let mut aligned: Vec<AlignedSize> = Vec::new();
    let chosen = |shape: UnitShape| only.is_none_or(|s| s.iter().any(|x| x.unit() == shape));
    for &(t, c) in shapes.iter().filter(|&&shape| chosen(shape)) {
        let ctx = match c {
            1 => Ctx::tensor_parallel(cost, t)?,
            _ => Ctx::context_parallel(cost, c, t)?,
        };
        let Some(mut ctx) = ctx else {
            continue;
        };
        let units = pools(&mut ctx)?;
        match align(&device_sets(&ctx, &units), &kinds) {
            Some(order) => {
                let units = order.into_iter().map(|k| units[k].clone()).collect();
                aligned.push(((t, c), std::sync::Arc::unwrap_or_clone(ctx.groups), units));
            }
            None => {
                let found = plan_units(&mut ctx, global_batch, sizes, t * c > 1, only)?;
                bound |= ctx.memory_bound.get();
                keep(found);
            }
        }
    }
    if !aligned.is_empty() {
        let (found, memory_bound) =
            plan_sizes_per_pool(cost, &single.all, aligned, global_batch, sizes, only)?;
        bound |= memory_bound;
        keep(found);
    }
    Ok((best, bound))
}

/// Per unit shape whose groups align with the pools of alike devices: its groups, and
/// each pool's units (pools in one order for every shape).
type AlignedSize = (UnitShape, Vec<TpGroup>, Vec<Vec<usize>>);

/// The best plan taking one of `aligned`'s sizes per pool, and whether memory ruled
/// anything out: one context holds every size's groups (they overlap: a plan takes one
/// size per pool), so that each pool's options are priced once and combined.
fn plan_sizes_per_pool(
    cost: &CostModel,
    all: &[crate::cluster::Device],
    aligned: Vec<AlignedSize>,
    global_batch: usize,
    sizes: &[usize],
    only: Option<&[PoolShape]>,
) -> Result<(Option<PooledCandidate>, bool), PlanningError> {
    let kinds = aligned.first().map_or(0, |(_, _, units)| units.len());
    let mut groups = Vec::new();
    let mut pools_by_size = Vec::new();
    for (shape, size_groups, units) in aligned {
        let offset = groups.len();
        groups.extend(size_groups);
        // One pool of devices and no tensor parallelism: the grid planner's case.
        if shape == (1, 1) && kinds < 2 {
            continue;
        }
        pools_by_size.push((shape, offset, units));
    }
    let mut ctx = Ctx::with_groups(cost, all.to_vec(), groups);
    let mut options: Vec<Vec<PoolOption>> = vec![Vec::new(); kinds];
    for (shape, offset, units) in pools_by_size {
        for (k, pool) in units.iter().enumerate() {
            if !PoolShape::allows(only, k, shape) {
                continue;
            }
            let pool: Vec<usize> = pool.iter().map(|u| u + offset).collect();
            let shape = only.map(|s| s[k]);
            options[k].extend(pool_options(&mut ctx, &pool, sizes, shape)?);
        }
    }
    for pool_options in &mut options {
        pool_options.sort_by(|a, b| b.rate.total_cmp(&a.rate));
    }
    let found = match best_combination(&mut ctx, options, global_batch, sizes)? {
        Some(layouts) => {
            let (groups, layouts) = used_units(&ctx.groups, layouts);
            let mut used = Ctx::with_groups(cost, all.to_vec(), groups);
            used.lockstep = expert_groups(&layouts, cost.expert_parallel);
            Some(simulate_pools(&mut used, layouts, false)?.0)
        }
        None => None,
    };
    Ok((found, ctx.memory_bound.get()))
}

/// Per pool of units, the sorted devices its units cover.
fn device_sets(ctx: &Ctx<'_>, pools: &[Vec<usize>]) -> Vec<Vec<usize>> {
    (pools.iter())
        .map(|units| {
            let mut devices: Vec<usize> = (units.iter())
                .flat_map(|&u| ctx.groups[u].members.iter().copied())
                .collect();
            devices.sort_unstable();
            devices
        })
        .collect()
}

/// For each of `kinds`' device sets, the index of the one of `sets` that covers the
/// same devices; `None` unless they match one to one.
fn align(sets: &[Vec<usize>], kinds: &[Vec<usize>]) -> Option<Vec<usize>> {
    if sets.len() != kinds.len() {
        return None;
    }
    kinds
        .iter()
        .map(|kind| sets.iter().position(|s| s == kind))
        .collect()
}

/// `layouts`' units renumbered by their first device, and the groups they use (a
/// plan of single devices keeps the devices' indices).
fn used_units(groups: &[TpGroup], mut layouts: Vec<PoolLayout>) -> (Vec<TpGroup>, Vec<PoolLayout>) {
    let first = |u: usize| groups[u].members.iter().copied().min().unwrap_or(0);
    let mut used: Vec<usize> = layouts
        .iter()
        .flat_map(|p| p.devices.iter().flatten().copied())
        .collect();
    used.sort_unstable_by_key(|&u| first(u));
    used.dedup();
    let renumbered: std::collections::HashMap<usize, usize> = used
        .iter()
        .enumerate()
        .map(|(new, &old)| (old, new))
        .collect();
    for unit in layouts
        .iter_mut()
        .flat_map(|p| p.devices.iter_mut().flatten())
    {
        *unit = renumbered[unit];
    }
    (used.iter().map(|&u| groups[u].clone()).collect(), layouts)
}

/// The best plan over `ctx`'s units (devices, or tensor-parallel groups), when more
/// than one pool of them (or `one_pool`) and one fits.
pub(super) fn plan_units(
    ctx: &mut Ctx<'_>,
    global_batch: usize,
    sizes: &[usize],
    one_pool: bool,
    only: Option<&[PoolShape]>,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let pools = pools(ctx)?;
    if pools.len() < 2 && !one_pool {
        return Ok(None);
    }
    let shape = ctx.groups.first().map_or((1, 1), |g| (g.tp_size(), g.cp));
    let mut options = Vec::with_capacity(pools.len());
    for (k, pool) in pools.iter().enumerate() {
        if !PoolShape::allows(only, k, shape) {
            return Ok(None);
        }
        options.push(pool_options(ctx, pool, sizes, only.map(|s| s[k]))?);
    }
    match best_combination(ctx, options, global_batch, sizes)? {
        Some(layouts) => {
            ctx.lockstep = expert_groups(&layouts, ctx.cost.expert_parallel);
            Ok(Some(simulate_pools(ctx, layouts, false)?.0))
        }
        None => Ok(None),
    }
}

/// Balanced combinations polished on large clusters, best balanced first (on small ones,
/// every one: the local search from a worse start can end lower, 7 % in one case found).
const POLISHED: usize = 3;

/// Units up to which every balanced combination is polished.
const POLISH_ALL_UP_TO: usize = 512;

/// The best layouts taking one of each pool's `options` (fastest first): every
/// combination of the fastest few balanced, then polished (on clusters of more than
/// [`POLISH_ALL_UP_TO`] units, the best [`POLISHED`] of them).
fn best_combination(
    ctx: &mut Ctx<'_>,
    mut options: Vec<Vec<PoolOption>>,
    global_batch: usize,
    sizes: &[usize],
) -> Result<Option<Vec<PoolLayout>>, PlanningError> {
    // Each other pool takes at least one micro-batch of the smallest size: an option
    // whose replicas need more than the rest of the batch cannot be part of a plan.
    let smallest = sizes.iter().copied().min().unwrap_or(1);
    let room = global_batch.saturating_sub((options.len().max(1) - 1) * smallest);
    for pool_options in &mut options {
        pool_options.retain(|o| o.devices[0].len() * o.micro_batch_size <= room);
    }
    if options.is_empty() || options.iter().any(Vec::is_empty) {
        return Ok(None);
    }
    let keep = options_kept(&options.iter().map(Vec::len).collect::<Vec<_>>());
    let limits: Vec<usize> = options.iter().map(|o| o.len().min(keep)).collect();
    let mut balanced: Vec<(f64, Vec<PoolLayout>)> = Vec::new();
    for choice in combinations(&limits) {
        let chosen: Vec<&PoolOption> = (choice.iter().enumerate())
            .map(|(k, &i)| &options[k][i])
            .collect();
        if let Some(found) = balance(ctx, &chosen, global_batch)? {
            balanced.push(found);
        }
    }
    balanced.sort_by(|a, b| a.0.total_cmp(&b.0));
    let polished = match ctx.devices.len() <= POLISH_ALL_UP_TO {
        true => balanced.len(),
        false => POLISHED,
    };
    let mut best: Option<(f64, Vec<PoolLayout>)> = None;
    for (step, layouts) in balanced.into_iter().take(polished) {
        let (step, layouts) = polish(ctx, layouts, step)?;
        if best.as_ref().is_none_or(|(s, _)| step < *s) {
            best = Some((step, layouts));
        }
    }
    Ok(best.map(|(_, layouts)| layouts))
}

/// Options kept per pool: the most k with every pool's min(k, options) multiplying to at
/// most [`MOST_COMBINATIONS`] (at least 1).
pub(super) fn options_kept(counts: &[usize]) -> usize {
    // Saturating: a cluster of many pools would overflow the product.
    let product = |k: usize| (counts.iter()).fold(1usize, |a, &n| a.saturating_mul(n.min(k)));
    let most = counts.iter().copied().max().unwrap_or(1);
    (1..=most)
        .take_while(|&k| product(k) <= MOST_COMBINATIONS)
        .last()
        .unwrap_or(1)
}

/// What pools devices: their class (group, speed) and usable memory's bits.
pub(super) type PoolKey = (usize, Option<u64>);

/// Unit indices (devices, or tensor-parallel groups) pooled by unit class and usable
/// memory, fastest pool first (per-layer time at micro-batch size 1).
pub(super) fn pools(ctx: &mut Ctx<'_>) -> Result<Vec<Vec<usize>>, PlanningError> {
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

/// A pool's feasible cuts (every depth dividing it and size, or only `shape`'s), its
/// fastest per device first: the layer split that fits with every 1F1B micro-batch in
/// flight.
pub(super) fn pool_options(
    ctx: &mut Ctx<'_>,
    pool: &[usize],
    sizes: &[usize],
    shape: Option<PoolShape>,
) -> Result<Vec<PoolOption>, PlanningError> {
    let (n, l, ep) = (
        pool.len(),
        ctx.cost.model.num_layers,
        ctx.cost.expert_parallel,
    );
    let mut options = Vec::new();
    let depths = (1..=n.min(l)).filter(|&p| whole_groups(n, p, ep));
    for p in depths.filter(|&p| shape.is_none_or(|s| s.stages == p)) {
        let d = n / p;
        let devices = arrange(pool, p, d, Arrangement::ByReplica);
        for &b in sizes
            .iter()
            .filter(|&&b| shape.is_none_or(|s| s.micro_batch_size == b))
        {
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
pub(super) fn combinations(limits: &[usize]) -> Vec<Vec<usize>> {
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
/// pool's layers re-split for its counts, twice; the closed-form step and the layouts
/// (to polish),
/// or `None` when the sizes cannot make the batch or a split stops fitting.
pub(super) fn balance(
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
            short: Vec::new(),
        })
        .collect();
    for _ in 0..2 {
        let mut paces = Vec::new();
        for pool in &layouts {
            let most = most_micro_batches(ctx, pool)?;
            paces.extend(group_paces(ctx, pool, most)?);
        }
        let Some(counts) = min_max_samples(global_batch, &paces) else {
            return Ok(None);
        };
        let mut counts = counts.into_iter();
        for pool in &mut layouts {
            let d = pool.micro_batches.len();
            let ep = ctx.expert_parallel(pool.devices[0][0]);
            pool.micro_batches = per_member(counts.by_ref().take(d / ep).collect(), ep).collect();
            let bs = vec![pool.micro_batch_size; d];
            let l = ctx.cost.model.num_layers;
            match split_layers(ctx, &pool.devices, &bs, &pool.micro_batches, l)? {
                Some(layers) => pool.layers = layers,
                None => return Ok(None),
            }
        }
    }
    Ok(Some((closed_form_step_s(ctx, &layouts)?, layouts)))
}

/// The paces the batch is split by: one per replica, or under expert parallelism one
/// per group of `ep` consecutive replicas (alike members taking the same micro-batches:
/// the group takes `ep` micro-batches at a time), each holding at most `most`.
pub(super) fn group_paces(
    ctx: &mut Ctx<'_>,
    pool: &PoolLayout,
    most: usize,
) -> Result<Vec<ReplicaPace>, PlanningError> {
    let ep = ctx.expert_parallel(pool.devices[0][0]);
    let (t, c) = pool.stage_times(ctx)?;
    Ok((0..pool.micro_batches.len())
        .step_by(ep)
        .map(|r| ReplicaPace {
            micro_batch_size: pool.micro_batch_size * ep,
            first_s: pipeline_time(&t, &c, r, 1),
            each_s: t.iter().map(|s| s[r]).fold(0.0, f64::max),
            most_micro_batches: most,
        })
        .collect())
}

/// Each group's count of [`group_paces`]' split for each of its `ep` members.
pub(super) fn per_member(counts: Vec<usize>, ep: usize) -> impl Iterator<Item = usize> {
    counts.into_iter().flat_map(move |m| vec![m; ep.max(1)])
}

/// Whether a pool of `n` units cuts into replicas of `p` stages in whole groups of `ep`.
pub(super) fn whole_groups(n: usize, p: usize, ep: usize) -> bool {
    n % p == 0 && (n / p) % ep.max(1) == 0
}

/// Whether every rank of every pool holds its stage with its 1F1B micro-batches in
/// flight.
pub(super) fn fits_all(ctx: &mut Ctx<'_>, layouts: &[PoolLayout]) -> Result<bool, PlanningError> {
    for pool in layouts {
        let (p, b) = (pool.layers.len(), pool.micro_batch_size);
        for (i, row) in pool.devices.iter().enumerate() {
            // Alike units with the same micro-batches in flight fit alike: checked once.
            let mut checked = std::collections::HashSet::new();
            for (&dev, &m) in row.iter().zip(&pool.micro_batches) {
                let key = (
                    ctx.classes[dev],
                    ctx.memory[dev].map(f64::to_bits),
                    (p - i).min(m),
                );
                if !checked.insert(key) {
                    continue;
                }
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
pub(super) fn most_micro_batches(
    ctx: &mut Ctx<'_>,
    pool: &PoolLayout,
) -> Result<usize, PlanningError> {
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
pub(super) fn polish(
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
pub(super) fn moves(ctx: &mut Ctx<'_>, layouts: &[PoolLayout]) -> Result<Vec<Move>, PlanningError> {
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
    let mut times = Vec::with_capacity(layouts.len());
    for (k, pool) in layouts.iter().enumerate() {
        let (t, c) = pool.stage_times(ctx)?;
        for (r, &m) in pool.micro_batches.iter().enumerate() {
            let time = pipeline_time(&t, &c, r, m);
            if time > slowest.1 {
                slowest = ((k, r), time);
            }
        }
        times.push((t, c));
    }
    let from = slowest.0;
    if (layouts.iter()).any(|pool| ctx.expert_parallel(pool.devices[0][0]) > 1) {
        // A group's members move micro-batches together: left to the batch split.
        return Ok(moves);
    }
    // Receivers of one pool with the same count whose pipelines take the same time
    // before and after the micro-batch are the same move (counts move no parameters):
    // tried once.
    let mut seen = std::collections::HashSet::new();
    for (k, pool) in layouts.iter().enumerate() {
        if pool.micro_batch_size != layouts[from.0].micro_batch_size {
            continue;
        }
        let (t, c) = &times[k];
        for (r, &m) in pool.micro_batches.iter().enumerate() {
            let key = (
                (k, m),
                pipeline_time(t, c, r, m).to_bits(),
                pipeline_time(t, c, r, m + 1).to_bits(),
            );
            if (k, r) != from && seen.insert(key) {
                moves.push(Move::MicroBatch { from, to: (k, r) });
            }
        }
    }
    Ok(moves)
}

/// One step of [`polish`].
#[derive(Clone, Copy)]
pub(super) enum Move {
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
    pub(super) fn apply(self, layouts: &[PoolLayout]) -> Option<Vec<PoolLayout>> {
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
pub(super) fn closed_form_step_s(
    ctx: &mut Ctx<'_>,
    layouts: &[PoolLayout],
) -> Result<f64, PlanningError> {
    let segments = pooled_segments(ctx, layouts);
    let reduce = max(&reduce_s(ctx, &segments));
    Ok(pipelines_s(ctx, layouts)? + reduce + optimizer_s(ctx, layouts, &segments))
}

/// The slowest replica's 1F1B closed form.
pub(super) fn pipelines_s(ctx: &mut Ctx<'_>, layouts: &[PoolLayout]) -> Result<f64, PlanningError> {
    let mut slowest = 0.0f64;
    for pool in layouts {
        let (t, c) = pool.stage_times(ctx)?;
        for (r, &m) in pool.micro_batches.iter().enumerate() {
            slowest = slowest.max(pipeline_time(&t, &c, r, m));
        }
    }
    Ok(slowest)
}

#[cfg(test)]
mod tests;
