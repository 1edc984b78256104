//! The pricing context: per unit (a device, or a tensor- or context-parallel group) its
//! costs, memory and expert-parallel size (a running plan may give each stage its own),
//! and the all-reduce and optimizer prices the search asks for many times.

use super::{collective::Collective, error::PlanningError, tensor::TpGroup};
use crate::cluster::Device;
use crate::cost::{CostModel, StageCosts};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

pub(super) struct Ctx<'a> {
    pub(super) cost: &'a CostModel,
    /// Per unit (a device, or a tensor-parallel group), the device that stands for it in
    /// sends and reports: its first member.
    pub(super) devices: Vec<Device>,
    /// Per unit, its devices and shares (shared with the candidates priced on them).
    pub(super) groups: Arc<Vec<TpGroup>>,
    /// Per unit, an id shared by the units of the same member classes and shares.
    pub(super) classes: Vec<usize>,
    /// The cluster's devices.
    pub(super) all: Vec<Device>,
    /// (unit class, b) → costs.
    pub(super) costs: HashMap<(usize, usize), StageCosts>,
    /// (unit class, b) → under expert parallelism, the part of a mean layer's
    /// `layer_s` that is its experts' compute (stretched by the imbalance).
    pub(super) expert_s: HashMap<(usize, usize), f64>,
    /// Per unit, its own expert-parallel size where a priced plan gives its stages their
    /// own ([`Ctx::set_expert_parallel`]; empty: every unit the cost's).
    pub(super) unit_expert_parallel: Vec<usize>,
    /// Per expert-parallel size of `unit_expert_parallel`, the cost model at that size
    /// and its [`CostModel::expert_imbalance`].
    pub(super) expert_costs: Vec<(usize, CostModel, f64)>,
    /// Per unit, the usable bytes of a whole stage's state (a group's: as its most
    /// loaded member holds its share).
    pub(super) memory: Vec<Option<f64>>,
    /// Whether memory has ruled anything out: options that only save memory are
    /// searched only where it has.
    pub(super) memory_bound: Cell<bool>,
    /// All-reduce prices over a list of devices, (seconds at 0 bytes, seconds per byte):
    /// the search prices the same holders many times.
    pub(super) allreduce_prices: RefCell<HashMap<Vec<usize>, (f64, f64)>>,
    /// The gradient reduction of a segment's holder units ([`super::reduction::holders_collective`]):
    /// the per-replica search prices the same holders after every move it tries.
    pub(super) collectives: RefCell<HashMap<Vec<usize>, Collective>>,
    /// (unit class, parameters) → optimizer step, s.
    pub(super) optimizer_prices: RefCell<HashMap<(usize, u64), f64>>,
    /// Under expert parallelism, how much the most loaded member's expert compute
    /// stretches a layer ([`CostModel::expert_imbalance`]; 1: even).
    pub(super) expert_imbalance: f64,
    /// Units that meet at every MoE layer's all-to-all (a priced plan's expert-parallel
    /// groups, one unit per member): each micro-batch at the slowest one's pace. Grid
    /// searches say it by the cost's `expert_parallel` instead.
    pub(super) lockstep: Vec<Vec<usize>>,
}

impl<'a> Ctx<'a> {
    /// Every device a unit of its own, in the cluster's order.
    pub(super) fn new(cost: &'a CostModel) -> Self {
        let devices = cost.cluster.devices();
        let groups: Vec<TpGroup> = (0..devices.len()).map(TpGroup::single).collect();
        Self::with_groups(cost, devices, groups)
    }

    /// Units of `size` devices of one node (fastest first within the node), each a
    /// tensor-parallel group with its best shares; `None` when the cluster does not cut
    /// into such groups.
    pub(super) fn tensor_parallel(
        cost: &'a CostModel,
        size: usize,
    ) -> Result<Option<Self>, PlanningError> {
        Self::grouped(cost, size, |model, devices, order, layer_s| {
            super::tensor::tp_groups(model, devices, order, layer_s, size)
        })
    }

    /// Units of `size` members on one node (fastest first within the node), each member
    /// a tensor-parallel group of `tp` devices (even shares), each unit a
    /// context-parallel group with its best token shares; `None` when the cluster does
    /// not cut into such groups, the model into such shares or the sequence so.
    pub(super) fn context_parallel(
        cost: &'a CostModel,
        size: usize,
        tp: usize,
    ) -> Result<Option<Self>, PlanningError> {
        Self::grouped(cost, size * tp, |model, devices, order, layer_s| {
            super::tensor::context_groups(model, devices, order, layer_s, (size, tp))
        })
    }

    /// Units of `size` devices of one node as `groups` cuts them.
    fn grouped(
        cost: &'a CostModel,
        size: usize,
        groups: impl Fn(
            &synerfuse_plan::ModelShape,
            &[Device],
            &[usize],
            &[f64],
        ) -> Option<Vec<TpGroup>>,
    ) -> Result<Option<Self>, PlanningError> {
        if size <= 1 {
            return Ok(Some(Self::new(cost)));
        }
        let mut single = Self::new(cost);
        let order = fastest_first(&mut single)?;
        let layer_s: Vec<f64> = (0..single.devices.len())
            .map(|i| single.costs(i, 1).map(|c| c.layer_s))
            .collect::<Result<_, _>>()?;
        let devices = single.all;
        Ok(groups(&cost.model, &devices, &order, &layer_s)
            .map(|groups| Self::with_groups(cost, devices, groups)))
    }

    pub(super) fn with_groups(
        cost: &'a CostModel,
        all: Vec<Device>,
        groups: impl Into<Arc<Vec<TpGroup>>>,
    ) -> Self {
        let groups: Arc<Vec<TpGroup>> = groups.into();
        // A unit's class: its members' classes, its context-parallel size (a pair of
        // devices may be a tensor- or a context-parallel group), its shares and each
        // member's work under them (a context-parallel member's tensor-parallel shares).
        type UnitClass = (Vec<(usize, u64)>, usize, Vec<u32>, Vec<u64>);
        let mut ids: HashMap<UnitClass, usize> = HashMap::new();
        let classes = (groups.iter())
            .map(|g| {
                let key = (
                    g.members.iter().map(|&i| all[i].class()).collect(),
                    g.cp,
                    g.shares.clone(),
                    g.work.iter().map(|w| w.to_bits()).collect(),
                );
                let next = ids.len();
                *ids.entry(key).or_insert(next)
            })
            .collect();
        let memory = (groups.iter())
            .map(|g| {
                (g.members.iter().zip(&g.state))
                    .filter_map(|(&i, share)| Some(cost.usable_memory(&all[i])? / share))
                    .reduce(f64::min)
            })
            .collect();
        Ctx {
            cost,
            devices: groups.iter().map(|g| all[g.members[0]].clone()).collect(),
            groups,
            classes,
            all,
            costs: HashMap::new(),
            expert_s: HashMap::new(),
            unit_expert_parallel: Vec::new(),
            expert_costs: Vec::new(),
            memory,
            memory_bound: Cell::new(false),
            allreduce_prices: RefCell::new(HashMap::new()),
            collectives: RefCell::new(HashMap::new()),
            optimizer_prices: RefCell::new(HashMap::new()),
            expert_imbalance: cost.expert_imbalance(),
            lockstep: Vec::new(),
        }
    }

    /// Whether `need` bytes exceed `have` (none: no limit), noted.
    pub(super) fn exceeds(&self, need: f64, have: Option<f64>) -> bool {
        let over = have.is_some_and(|have| need > have);
        if over {
            self.memory_bound.set(true);
        }
        over
    }

    /// A unit's costs at micro-batch size `b`: a group's slowest member on its share,
    /// plus the group's collectives (with sequence parallelism, per layer two
    /// all-gathers and two reduce-scatters forward and as many backward, together four
    /// all-reduces of the activation; one each for the embedding and the head).
    pub(super) fn costs(&mut self, unit: usize, b: usize) -> Result<StageCosts, PlanningError> {
        let key = (self.classes[unit], b);
        if let Some(c) = self.costs.get(&key) {
            return Ok(*c);
        }
        let group = &self.groups[unit];
        let each: Vec<StageCosts> = (group.members.iter())
            .map(|&i| self.cost.stage_costs(&self.all[i], b))
            .collect::<Result<_, _>>()?;
        let mut c = each[0];
        if group.cp > 1 {
            // Each device on its member's tokens (of its tensor-parallel share); per layer
            // the keys and values of its query groups all-gathered over the members in the
            // forward and their gradients reduce-scattered in the backward (about an
            // all-reduce of the whole sequence's), and within a member the
            // tensor-parallel collectives on its tokens.
            let t = group.tp_size();
            let devices = |ids: &mut dyn Iterator<Item = &usize>| -> Vec<&Device> {
                ids.map(|&i| &self.all[i]).collect()
            };
            let model = &self.cost.model;
            let kv = model.kv_message_bytes(b, self.cost.compute_bytes) / t as f64;
            let exchange =
                (self.cost).allreduce_seconds(&devices(&mut group.members.iter().step_by(t)), kv);
            let collective = match t {
                1 => 0.0,
                _ => self.cost.allreduce_seconds(
                    &devices(&mut group.members[..t].iter()),
                    model.activation_message_bytes(b, self.cost.compute_bytes)
                        * group.token_fraction(),
                ),
            };
            let slowest = |part: &dyn Fn(&StageCosts) -> f64, by: &[f64]| {
                (each.iter().zip(by))
                    .map(|(k, f)| part(k) * f)
                    .fold(0.0, f64::max)
            };
            c.layer_s = slowest(&|k| k.layer_s, &group.work) + exchange + 4.0 * collective;
            c.embedding_s = slowest(&|k| k.embedding_s, &group.tokens) + collective;
            c.head_s = slowest(&|k| k.head_s, &group.vocab) + collective;
        } else if group.size() > 1 {
            let members: Vec<&Device> = group.members.iter().map(|&i| &self.all[i]).collect();
            let bytes = (self.cost.model).activation_message_bytes(b, self.cost.compute_bytes);
            let collective = self.cost.allreduce_seconds(&members, bytes);
            let layer_s: Vec<f64> = each.iter().map(|k| k.layer_s).collect();
            c.layer_s = group.layer_s(&layer_s) + 4.0 * collective;
            c.embedding_s = each.iter().map(|k| k.embedding_s).fold(0.0, f64::max) + collective;
            c.head_s = (each.iter().zip(&group.vocab))
                .map(|(k, v)| k.head_s * v)
                .fold(0.0, f64::max)
                + collective;
        }
        if self.expert_parallel(unit) > 1 && self.cost.model.experts.is_some() {
            let (layer_s, expert_s) = self.expert_exchange(unit, b, c.layer_s);
            c.layer_s = layer_s;
            self.expert_s.insert(key, expert_s);
        }
        self.costs.insert(key, c);
        Ok(c)
    }

    /// Under expert parallelism, the seconds of a mean layer's `layer_s` (at micro-batch
    /// size `b` on `unit`) that its experts compute; 0 without.
    pub(super) fn expert_seconds(&mut self, unit: usize, b: usize) -> Result<f64, PlanningError> {
        self.costs(unit, b)?;
        Ok(self
            .expert_s
            .get(&(self.classes[unit], b))
            .copied()
            .unwrap_or(0.0))
    }

    /// A mean layer's `layer_s` under expert parallelism: the experts' compute stretched
    /// by the most loaded member's share, plus per MoE layer two all-to-alls forward
    /// (tokens to their experts' members and back) and two backward, over `ep` members
    /// like the unit (on its node where it holds that many, as Megatron's consecutive
    /// data-parallel ranks are); and the experts' stretched compute in it.
    fn expert_exchange(&self, unit: usize, b: usize, layer_s: f64) -> (f64, f64) {
        let model = &self.cost.model;
        let group = &self.groups[unit];
        let first = &self.all[group.members[0]];
        let ep = self.expert_parallel(unit);
        let alike = |d: &&Device| d.class() == first.class();
        let near = (self.all.iter().filter(|d| d.node == first.node))
            .filter(alike)
            .count()
            / group.size();
        let mut peers: Vec<&Device> = vec![first; ep.min(near.max(1))];
        let far = (self.all.iter()).filter(|d| d.node != first.node);
        peers.extend(far.take(ep - peers.len()));
        // Fewer devices than members (a priced shape only): the rest alike.
        peers.resize(ep, first);
        let moe = model.moe_layers_in(0, model.num_layers) as f64 / model.num_layers.max(1) as f64;
        // A context-parallel member sends its own tokens' rows.
        let tokens = match group.cp {
            1 => 1.0,
            _ => group.token_fraction(),
        };
        let bytes = model.expert_message_bytes(b, self.cost.compute_bytes) * tokens;
        let exchange = 4.0 * moe * self.cost.alltoall_seconds(&peers, bytes);
        let experts = layer_s * model.expert_compute_fraction(b);
        let stretched = experts * self.imbalance_of(unit);
        (layer_s - experts + stretched + exchange, stretched)
    }

    /// [`CostModel::allreduce_seconds`] of `bytes` over the cluster's devices `devices`.
    #[cfg(test)]
    pub(super) fn allreduce_seconds(&self, devices: Vec<usize>, bytes: f64) -> f64 {
        let (fixed, per_byte) = self.allreduce_price(devices);
        fixed + per_byte * bytes
    }

    /// [`CostModel::allreduce_seconds`]'s price over the cluster's devices `devices`
    /// (linear in the bytes, kept per device list): (seconds at 0 bytes, its latency;
    /// seconds per byte).
    pub(super) fn allreduce_price(&self, devices: Vec<usize>) -> (f64, f64) {
        if let Some(&price) = self.allreduce_prices.borrow().get(&devices) {
            return price;
        }
        let members: Vec<&Device> = devices.iter().map(|&i| &self.all[i]).collect();
        let fixed = self.cost.allreduce_seconds(&members, 0.0);
        let per_byte = (self.cost.allreduce_seconds(&members, 1e9) - fixed) / 1e9;
        self.allreduce_prices
            .borrow_mut()
            .insert(devices, (fixed, per_byte));
        (fixed, per_byte)
    }

    /// The optimizer step of a unit holding `params` parameters, s: its slowest member
    /// on its share (`None` where no member is priced).
    pub(super) fn optimizer_seconds(&self, unit: usize, params: f64) -> Option<f64> {
        let group = &self.groups[unit];
        (group.members.iter().zip(&group.state))
            .filter_map(|(&i, share)| self.cost.optimizer_seconds(&self.all[i], params * share))
            .reduce(f64::max)
    }

    /// The largest fraction of a stage's parameters a member of the unit holds: what its
    /// gradient reduction carries.
    pub(super) fn state_fraction(&self, unit: usize) -> f64 {
        self.groups[unit].state.iter().copied().fold(0.0, f64::max)
    }

    /// The unit's members that take part in a gradient reduction alike split holders
    /// run side by side: one per tensor-parallel shard (its first member), or every
    /// context-parallel member (each holds the whole stage).
    pub(super) fn reducing_members(&self, unit: usize) -> Vec<usize> {
        let group = &self.groups[unit];
        group
            .members
            .iter()
            .step_by(group.tp_size())
            .copied()
            .collect()
    }

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
    /// Whether `unit`'s last stage runs its loss in chunks
    /// ([`crate::cost::StageHolding::loss_in_chunks`]): a lone device without expert
    /// parallelism (the whole stage's forward; under 1F1B, as planned), where the cost
    /// model says the runtime does.
    pub(super) fn loss_in_chunks(&self, unit: usize) -> bool {
        let lone = self
            .groups
            .get(unit)
            .is_none_or(|g| g.members.len() == 1 && g.cp == 1);
        lone && self.expert_parallel(unit) == 1 && self.cost_of(unit).loss_in_chunks
    }

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
    pub(super) fn expert_place(&self, k: usize, unit: usize) -> (usize, usize) {
        if self.lockstep.is_empty() {
            let ep = self.expert_parallel(unit);
            return (k % ep, ep);
        }
        (self.lockstep.iter())
            .find_map(|g| Some((g.iter().position(|&u| u == unit)?, g.len())))
            .unwrap_or((0, 1))
    }
}

/// Device indices, fastest first (per-layer time at micro-batch size 1), ties by index.
pub(super) fn fastest_first(ctx: &mut Ctx<'_>) -> Result<Vec<usize>, PlanningError> {
    let n = ctx.devices.len();
    let speed: Vec<f64> = (0..n)
        .map(|i| ctx.costs(i, 1).map(|c| c.layer_s))
        .collect::<Result<_, _>>()?;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| speed[a].total_cmp(&speed[b]).then(a.cmp(&b)));
    Ok(order)
}
