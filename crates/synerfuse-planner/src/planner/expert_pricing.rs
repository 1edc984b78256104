//! Expert parallelism in the pricing context: each unit's expert-parallel size (a
//! running plan may give each stage its own) and the expert gradients' reduction over
//! the units holding the same experts (Megatron's expert-data-parallel groups).

use super::pricing::{holders_allreduce_s, Ctx};
use crate::cost::CostModel;
use std::collections::HashMap;

impl Ctx<'_> {
    /// Gives each unit its own expert-parallel size (a running plan whose stages or
    /// meshes each have theirs); units alike but for it are priced apart.
    pub(super) fn set_expert_parallel(&mut self, per_unit: Vec<usize>) {
        let mut sizes = per_unit.clone();
        sizes.sort_unstable();
        sizes.dedup();
        self.expert_costs = (sizes.into_iter())
            .map(|ep| {
                let cost = CostModel {
                    expert_parallel: ep,
                    ..self.cost.clone()
                };
                let imbalance = cost.expert_imbalance();
                (ep, cost, imbalance)
            })
            .collect();
        let mut ids: HashMap<(usize, usize), usize> = HashMap::new();
        self.classes = (self.classes.iter().zip(&per_unit))
            .map(|(&class, &ep)| {
                let next = ids.len();
                *ids.entry((class, ep)).or_insert(next)
            })
            .collect();
        self.unit_expert_parallel = per_unit;
        self.costs.clear();
        self.expert_s.clear();
        self.optimizer_prices.borrow_mut().clear();
    }

    /// The unit's expert-parallel size (1: it holds every expert).
    pub(super) fn expert_parallel(&self, unit: usize) -> usize {
        (self.unit_expert_parallel.get(unit))
            .copied()
            .unwrap_or(self.cost.expert_parallel)
            .max(1)
    }

    /// The cost model at the unit's expert-parallel size: what it holds and needs.
    pub(super) fn cost_of(&self, unit: usize) -> &CostModel {
        let ep = self.expert_parallel(unit);
        (self.expert_costs.iter())
            .find(|(size, ..)| *size == ep)
            .map_or(self.cost, |(_, cost, _)| cost)
    }

    /// [`CostModel::expert_imbalance`] at the unit's expert-parallel size.
    pub(super) fn imbalance_of(&self, unit: usize) -> f64 {
        let ep = self.expert_parallel(unit);
        (self.expert_costs.iter())
            .find(|(size, ..)| *size == ep)
            .map_or(self.expert_imbalance, |&(_, _, imbalance)| imbalance)
    }

    /// The `k`-th holder `unit`'s place in its expert-parallel group and the group's
    /// size: a priced plan's [`Ctx::lockstep`] group (a unit in none holds every
    /// expert), else consecutive holders of the unit's size.
    fn expert_place(&self, k: usize, unit: usize) -> (usize, usize) {
        if self.lockstep.is_empty() {
            let ep = self.expert_parallel(unit);
            return (k % ep, ep);
        }
        (self.lockstep.iter())
            .find_map(|g| Some((g.iter().position(|&u| u == unit)?, g.len())))
            .unwrap_or((0, 1))
    }
}

/// Whether any of `units` holds a part of the experts only: then the experts reduce
/// apart from the rest ([`expert_allreduce_s`]), else with it.
pub(super) fn experts_apart(ctx: &Ctx<'_>, units: &[usize]) -> bool {
    ctx.cost.model.experts.is_some() && units.iter().any(|&u| ctx.expert_parallel(u) > 1)
}

/// The fp32 gradient all-reduce of the experts of `layers` mean layers, each of `units`
/// (one per replica) holding its part, s: each part of the experts over the units
/// holding it (a unit's place in its group of `e` holds the `e`-th part there), parts
/// held by the same units together, the units' reductions one after another and the
/// slowest unit's time. 0 where the experts reduce with the rest ([`experts_apart`]).
pub(super) fn expert_allreduce_s(ctx: &Ctx<'_>, units: &[usize], layers: f64) -> f64 {
    if layers <= 0.0 || !experts_apart(ctx, units) {
        return 0.0;
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
    let mut seconds = vec![0.0f64; units.len()];
    let mut j = 0;
    while j < slices {
        let these = holders(j);
        let mut end = j + 1;
        while end < slices && holders(end) == these {
            end += 1;
        }
        let members: Vec<usize> = these.iter().map(|&k| units[k]).collect();
        let params = whole * (end - j) as f64 / slices as f64;
        let t = holders_allreduce_s(ctx, &members, params);
        for &k in &these {
            seconds[k] += t;
        }
        j = end;
    }
    seconds.into_iter().fold(0.0, f64::max)
}

fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x.max(1) * b
}
