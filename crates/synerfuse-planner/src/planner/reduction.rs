//! The fp32 gradient all-reduce over the units that hold the same parameters: whole
//! tensors, or share by share where the units are split alike; under expert parallelism
//! each part of the experts over the units holding it (Megatron's expert-data-parallel
//! groups).

pub(super) use super::collective::{Collective, CollectivePrice};
use super::context::Ctx;

/// Whether any of `units` holds a part of the experts only: then the experts reduce
/// apart from the rest ([`expert_allreduce_s`]), else with it.
pub(super) fn experts_apart(ctx: &Ctx<'_>, units: &[usize]) -> bool {
    ctx.cost.model.experts.is_some() && units.iter().any(|&u| ctx.expert_parallel(u) > 1)
}

/// The gradient reduction of the experts of `layers` mean layers, each of `units` (one
/// per replica) holding its part, s: each part of the experts over the units holding it
/// (a unit's place in its group of `e` holds the `e`-th part there), parts held by the
/// same units together, the units' reductions one after another and the slowest unit's
/// time; a reduce-scatter under the distributed optimizer ([`Collective`]). 0 where the
/// experts reduce with the rest ([`experts_apart`]).
pub(super) fn expert_allreduce_s(ctx: &Ctx<'_>, units: &[usize], layers: f64) -> f64 {
    expert_collectives_s(ctx, units, layers).0
}

/// The distributed optimizer's gathers of the experts' updated parameters after the
/// step, as [`expert_allreduce_s`] reduces them, s (0 where not sharded).
pub(super) fn expert_gather_s(ctx: &Ctx<'_>, units: &[usize], layers: f64) -> f64 {
    expert_collectives_s(ctx, units, layers).1
}

/// ([`expert_allreduce_s`], [`expert_gather_s`]).
fn expert_collectives_s(ctx: &Ctx<'_>, units: &[usize], layers: f64) -> (f64, f64) {
    if layers <= 0.0 || !experts_apart(ctx, units) {
        return (0.0, 0.0);
    }
    let places: Vec<(usize, usize)> = (units.iter().enumerate())
        .map(|(k, &unit)| ctx.expert_place(k, unit))
        .collect();
    // The experts cut in `slices` equal slices; slice j held by the units whose part
    // covers it.
    let slices = places.iter().fold(1, |l, &(_, e)| lcm(l, e));
    let holders = |j: usize| -> Vec<usize> {
        (0..units.len())
            .filter(|&k| j * places[k].1 / slices == places[k].0)
            .collect()
    };
    let whole = layers * ctx.cost.model.expert_layer_params();
    let mut seconds = vec![(0.0f64, 0.0f64); units.len()];
    let mut j = 0;
    while j < slices {
        let these = holders(j);
        let mut end = j + 1;
        while end < slices && holders(end) == these {
            end += 1;
        }
        let members: Vec<usize> = these.iter().map(|&k| units[k]).collect();
        let elements = whole * (end - j) as f64 / slices as f64;
        let collective = holders_collective(ctx, &members);
        let elements = elements * collective.share;
        let reduce = collective.reduction().seconds(elements);
        let gather = collective.gather().map_or(0.0, |g| g.seconds(elements));
        for &k in &these {
            seconds[k].0 += reduce;
            seconds[k].1 += gather;
        }
        j = end;
    }
    (seconds.iter()).fold((0.0, 0.0), |(r, g), &(a, b)| (r.max(a), g.max(b)))
}

fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x.max(1) * b
}

/// The gradient reduction of `params` parameters over the units that hold them, s
/// ([`holders_collective`]'s: an all-reduce, or a reduce-scatter under the distributed
/// optimizer).
pub(super) fn holders_allreduce_s(ctx: &Ctx<'_>, units: &[usize], params: f64) -> f64 {
    let collective = holders_collective(ctx, units);
    collective.reduction().seconds(params * collective.share)
}

/// The distributed optimizer's all-gather of `params` updated parameters over the units
/// that hold them, in the parameters' dtype, s (0 where their reduction is not sharded).
pub(super) fn holders_gather_s(ctx: &Ctx<'_>, units: &[usize], params: f64) -> f64 {
    let collective = holders_collective(ctx, units);
    (collective.gather()).map_or(0.0, |g| g.seconds(params * collective.share))
}

/// The collective that reduces the gradients of `units` ([`Collective`]), priced once
/// per context.
pub(super) fn holders_collective(ctx: &Ctx<'_>, units: &[usize]) -> Collective {
    if let Some(&known) = ctx.collectives.borrow().get(units) {
        return known;
    }
    let collective = price_holders_collective(ctx, units);
    ctx.collectives
        .borrow_mut()
        .insert(units.to_vec(), collective);
    collective
}

fn price_holders_collective(ctx: &Ctx<'_>, units: &[usize]) -> Collective {
    let alike = (units.iter()).all(|&u| ctx.groups[u].shares == ctx.groups[units[0]].shares);
    let (devices, share): (Vec<usize>, f64) = match alike {
        true => (
            (units.iter())
                .flat_map(|&u| ctx.reducing_members(u))
                .collect(),
            (units.iter())
                .map(|&u| ctx.state_fraction(u))
                .fold(0.0, f64::max),
        ),
        false => (
            (units.iter())
                .flat_map(|&u| ctx.groups[u].members.iter().copied())
                .collect(),
            1.0,
        ),
    };
    let members = devices.len();
    let (fixed_s, per_byte) = ctx.allreduce_price(devices);
    Collective {
        all_reduce: CollectivePrice {
            fixed_s,
            per_element_s: per_byte * 4.0,
        },
        share,
        members,
        whole: !alike,
        sharded: ctx.cost.distributed_optimizer && alike && members > 1,
        param_bytes: ctx.cost.compute_bytes,
    }
}
