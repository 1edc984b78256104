//! The pricing context (per-unit costs, memory, optimizer shares) and the closed-form
//! price of a grid layout: stage times, memory fits, the 1F1B formula, the reduction
//! and the optimizer step.

use super::{
    error::{Infeasibility, MemoryShortfall, PlanningError, Violation},
    expert_pricing::{expert_allreduce_s, experts_apart},
    outcome::{replicas, Grid, PoolLayout, Prediction},
    tensor::TpGroup,
};
use crate::cluster::Device;
use crate::cost::{CostModel, Recompute, StageCosts, StageHolding};
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

    /// [`CostModel::allreduce_seconds`] of `bytes` over the cluster's devices `devices`,
    /// whose price (linear in the bytes) is kept per device list.
    pub(super) fn allreduce_seconds(&self, devices: Vec<usize>, bytes: f64) -> f64 {
        if let Some((fixed, per_byte)) = self.allreduce_prices.borrow().get(&devices) {
            return fixed + per_byte * bytes;
        }
        let members: Vec<&Device> = devices.iter().map(|&i| &self.all[i]).collect();
        let fixed = self.cost.allreduce_seconds(&members, 0.0);
        let per_byte = (self.cost.allreduce_seconds(&members, 1e9) - fixed) / 1e9;
        self.allreduce_prices
            .borrow_mut()
            .insert(devices, (fixed, per_byte));
        fixed + per_byte * bytes
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

/// Per (stage, replica): per-micro-batch time (at the replica's micro-batch size in
/// `sizes`, recomputing where [`stage_fit`] says with `m` micro-batches), and p2p
/// seconds to the next stage.
pub(super) fn stage_times(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<(Grid<f64>, Grid<f64>), PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let fits = stage_fits(ctx, grid, layers, sizes, m)?;
    let mut t = vec![vec![0.0; d]; p];
    let mut c = vec![vec![0.0; d]; p];
    for i in 0..p {
        for r in 0..d {
            let b = sizes[r];
            t[i][r] = stage_seconds(&fits[i][r].costs, layers[i], i, p);
            if i + 1 < p {
                c[i][r] =
                    ctx.cost
                        .p2p_seconds(&ctx.devices[grid[i][r]], &ctx.devices[grid[i + 1][r]], b);
            }
        }
        expert_group_times(ctx, (&grid[i], layers[i]), sizes, &fits[i], &mut t[i])?;
    }
    Ok((t, c))
}

/// A stage's micro-batch times `t` (per replica) under expert parallelism: each member's
/// experts compute the group's mean tokens (an even part of every member's; its own
/// micro-batch's in `t`), and the members meet at every MoE layer's all-to-all, so each
/// micro-batch takes the group's slowest member's time.
fn expert_group_times(
    ctx: &mut Ctx<'_>,
    (units, layers): (&[usize], usize),
    sizes: &[usize],
    fits: &[StageFit],
    t: &mut [f64],
) -> Result<(), PlanningError> {
    let ep = ctx.expert_parallel(units[0]);
    if ep == 1 {
        return Ok(());
    }
    for (start, group) in (0..t.len()).step_by(ep).zip(t.chunks_mut(ep)) {
        let members = start..start + group.len();
        let mean = sizes[members.clone()].iter().sum::<usize>() as f64 / group.len() as f64;
        for (r, time) in members.zip(group.iter_mut()) {
            let (unit, b) = (units[r], sizes[r]);
            // As recomputation stretches the layer (its forward twice), so its experts.
            let again = fits[r].costs.layer_s / ctx.costs(unit, b)?.layer_s.max(1e-30);
            let experts = layers as f64 * ctx.expert_seconds(unit, b)? * again;
            *time += experts * (mean / b as f64 - 1.0);
        }
        let slowest = group.iter().copied().fold(0.0, f64::max);
        group.fill(slowest);
    }
    Ok(())
}

/// One micro-batch of `size` samples through stage `i` of `p` holding `layers` layers on
/// `unit`, recomputed where `recompute` (a short micro-batch priced at its own size).
pub(super) fn micro_batch_seconds(
    ctx: &mut Ctx<'_>,
    unit: usize,
    size: usize,
    recompute: bool,
    (layers, i, p): (usize, usize, usize),
) -> Result<f64, PlanningError> {
    let mut costs = ctx.costs(unit, size)?;
    if recompute {
        costs = costs.recomputed();
    }
    Ok(stage_seconds(&costs, layers, i, p))
}

/// One micro-batch's forward and backward through stage `i` of `p` holding `layers`
/// layers (and the embedding or head at the ends).
pub(super) fn stage_seconds(k: &StageCosts, layers: usize, i: usize, p: usize) -> f64 {
    layers as f64 * k.layer_s
        + if i == 0 { k.embedding_s } else { 0.0 }
        + if i + 1 == p { k.head_s } else { 0.0 }
}

/// The 1F1B time of a replica: fill and drain plus (m − 1) of its slowest stage.
pub(super) fn pipeline_time(t: &[Vec<f64>], c: &[Vec<f64>], r: usize, m: usize) -> f64 {
    let sum: f64 = t.iter().map(|s| s[r]).sum();
    let comm: f64 = c.iter().map(|s| 2.0 * s[r]).sum();
    let max = t.iter().map(|s| s[r]).fold(0.0, f64::max);
    sum + comm + (m.saturating_sub(1)) as f64 * max
}

/// Memory check of one (stage, replica) of `grid`, whose stages' optimizer shares are
/// `shares`: (need, usable).
pub(super) fn memory_need(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    shares: &[Shares],
    (i, r): (usize, usize),
    layers: usize,
    b: usize,
    m: usize,
) -> Result<(f64, Option<f64>), PlanningError> {
    let fit = grid_fit(ctx, grid, shares, (i, r), layers, b, m)?;
    Ok((fit.need, ctx.memory[grid[i][r]]))
}

/// [`stage_fit`] of (stage, replica) of `grid` holding `layers` layers with `m`
/// micro-batches of `b` samples (1F1B keeps min(p − i, m) in flight).
pub(super) fn grid_fit(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    shares: &[Shares],
    (i, r): (usize, usize),
    layers: usize,
    b: usize,
    m: usize,
) -> Result<StageFit, PlanningError> {
    let p = grid.len();
    let holding = StageHolding {
        layers,
        first: i == 0,
        last: i + 1 == p,
        in_flight: (p - i).min(m),
        micro_batch_size: b,
        optimizer_share: shares[i].of(ctx, grid[i][r]),
        recompute: false,
    };
    stage_fit(ctx, grid[i][r], holding)
}

/// A unit holding a stage: the costs it runs at, whether it recomputes (by the
/// context's [`Recompute`]: where needed, when it would not fit otherwise), and the
/// bytes it needs so.
#[derive(Debug, Clone, Copy)]
pub(super) struct StageFit {
    pub(super) costs: StageCosts,
    pub(super) recompute: bool,
    pub(super) need: f64,
}

pub(super) fn stage_fit(
    ctx: &mut Ctx<'_>,
    unit: usize,
    holding: StageHolding,
) -> Result<StageFit, PlanningError> {
    let plain = ctx.costs(unit, holding.micro_batch_size)?;
    let group = &ctx.groups[unit];
    let need = |recompute: bool| {
        let holding = StageHolding {
            recompute,
            ..holding
        };
        let cost = ctx.cost_of(unit);
        let (all, state) = (
            cost.memory_bytes(&plain, &holding),
            cost.state_bytes(&holding),
        );
        if group.cp == 1 {
            return all;
        }
        // A context-parallel member holds the whole stage's state, its tokens'
        // activations, and the whole sequence's keys and values of each layer kept for
        // its backward (of its share with tensor parallelism, as the rest): priced device
        // by device against its own memory, as the bytes of the whole stage that bind
        // the unit's memory (`ctx.memory`) where a device is short.
        let kept = match recompute {
            true => 1,
            false => holding.in_flight,
        };
        let kv = (kept * holding.layers) as f64
            * (ctx.cost.model).kv_message_bytes(holding.micro_batch_size, ctx.cost.compute_bytes);
        let device_need = |d: usize| state + group.tokens[d] * (all - state) + kv;
        let Some(have) = ctx.memory[unit] else {
            return (0..group.size()).map(device_need).fold(0.0, f64::max);
        };
        (group.members.iter().enumerate())
            .filter_map(|(d, &i)| {
                let usable = ctx.cost.usable_memory(&ctx.all[i])? / group.state[d];
                Some(device_need(d) * have / usable)
            })
            .fold(0.0, f64::max)
    };
    let recompute = match ctx.cost.recompute {
        Recompute::Never => false,
        Recompute::Always => true,
        Recompute::WhereNeeded => ctx.memory[unit].is_some_and(|have| need(false) > have),
    };
    Ok(StageFit {
        costs: match recompute {
            true => plain.recomputed(),
            false => plain,
        },
        recompute,
        need: need(recompute),
    })
}

/// [`stage_fit`] of every (stage, replica) of `grid` with `layers`, micro-batch sizes
/// `sizes` and counts `m`.
pub(super) fn stage_fits(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<Grid<StageFit>, PlanningError> {
    let p = grid.len();
    let shares = Shares::of_grid(ctx, grid);
    let mut fits = Vec::with_capacity(p);
    for i in 0..p {
        let mut row: Vec<StageFit> = Vec::with_capacity(grid[i].len());
        // A replica like the one before (alike unit, size, count, optimizer share) fits
        // alike: large pools are runs of alike replicas.
        let mut previous: Option<FitKey> = None;
        for r in 0..grid[i].len() {
            let unit = grid[i][r];
            let key = (
                ctx.classes[unit],
                ctx.memory[unit].map(f64::to_bits),
                sizes[r],
                (p - i).min(m[r]),
                shares[i].of(ctx, unit).to_bits(),
            );
            if let (Some(last), Some(fit)) = (previous, row.last()) {
                if last == key {
                    row.push(*fit);
                    continue;
                }
            }
            previous = Some(key);
            row.push(grid_fit(
                ctx,
                grid,
                &shares,
                (i, r),
                layers[i],
                sizes[r],
                m[r],
            )?);
        }
        fits.push(row);
    }
    Ok(fits)
}

/// What a stage's fit depends on beside its layers: unit class, usable memory, micro-batch
/// size, micro-batches in flight, optimizer share.
type FitKey = (usize, Option<u64>, usize, usize, u64);

/// How a stage's optimizer state divides over its replicas: under the distributed
/// optimizer in proportion to their devices' memory, as the trainer divides it (equally
/// where memory is not known), else not at all.
#[derive(Clone, Copy)]
pub(super) struct Shares {
    pub(super) sharded: bool,
    pub(super) replicas: usize,
    /// Their memory together, when every one's is known.
    pub(super) memory: Option<f64>,
}

impl Shares {
    pub(super) fn of_stage(ctx: &Ctx<'_>, stage: &[usize]) -> Self {
        // Every context-parallel member holds the stage: the trainer shards over each.
        let holders = |u: usize| ctx.groups[u].cp;
        let replicas: usize = stage.iter().map(|&u| holders(u)).sum();
        let sharded = ctx.cost.distributed_optimizer && replicas > 1;
        Shares {
            sharded,
            replicas,
            memory: match sharded {
                true => (stage.iter())
                    .map(|&u| Some(Self::weight(ctx, u)? * holders(u) as f64))
                    .sum(),
                false => None,
            },
        }
    }

    /// A unit's weight as the trainer shards by it (`Plan::memory_shares`): its
    /// device's memory in tenths of a GB, as the plan file gives it.
    pub(super) fn weight(ctx: &Ctx<'_>, unit: usize) -> Option<f64> {
        let gb = ctx.devices[unit].spec?.memory_gb;
        Some(f64::from(synerfuse_plan::memory_share_weight(gb)))
    }

    pub(super) fn of_grid(ctx: &Ctx<'_>, grid: &[Vec<usize>]) -> Vec<Self> {
        grid.iter()
            .map(|stage| Self::of_stage(ctx, stage))
            .collect()
    }

    /// `unit`'s share.
    pub(super) fn of(&self, ctx: &Ctx<'_>, unit: usize) -> f64 {
        match (self.sharded, self.memory, Self::weight(ctx, unit)) {
            (false, ..) => 1.0,
            (true, Some(all), Some(mine)) => mine / all.max(1.0),
            _ => 1.0 / self.replicas as f64,
        }
    }
}

/// Scores a layout by the closed form; `Err(violation)` when a rank runs out of memory.
pub(super) fn evaluate(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<Result<Prediction, Violation>, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let shares = Shares::of_grid(ctx, grid);
    let mut stage_memory = vec![0.0f64; p];
    for i in 0..p {
        for r in 0..d {
            let (need, have) = memory_need(ctx, grid, &shares, (i, r), layers[i], sizes[r], m[r])?;
            // A group's need is its whole stage's: its most loaded member holds its share.
            stage_memory[i] = stage_memory[i].max(need * ctx.state_fraction(grid[i][r]));
            if let Some(have) = have {
                if ctx.exceeds(need, Some(have)) {
                    let dev = &ctx.devices[grid[i][r]];
                    return Ok(Err(Violation {
                        ratio: need / have.max(1.0),
                        reason: Infeasibility::OutOfMemory(MemoryShortfall {
                            stage: i,
                            layers: layers[i],
                            pp: p,
                            dp: d,
                            kind: dev.kind.clone(),
                            device: dev.index,
                            need_bytes: need,
                            usable_bytes: have,
                            micro_batch_size: sizes[r],
                            in_flight: (p - i).min(m[r]),
                        }),
                    }));
                }
            }
        }
    }
    let (t, c) = stage_times(ctx, grid, layers, sizes, m)?;
    let pipeline_s = (0..d)
        .map(|r| pipeline_time(&t, &c, r, m[r]))
        .fold(0.0, f64::max);
    let allreduce_s = max(&allreduce_times(ctx, grid, layers));
    let optimizer_s = max(&optimizer_times(ctx, grid, layers).concat());
    let step = pipeline_s + allreduce_s + optimizer_s + ctx.cost.step_overhead_s();
    let busy: Vec<Vec<f64>> = (0..p)
        .map(|i| (0..d).map(|r| t[i][r] * m[r] as f64).collect())
        .collect();
    let total_busy: f64 = busy.iter().flatten().sum();
    Ok(Ok(Prediction {
        step_time_s: step,
        pipeline_s,
        allreduce_s,
        optimizer_s,
        bubble_fraction: 1.0 - total_busy / (step * (p * d) as f64).max(1e-30),
        stage_time_s: t
            .iter()
            .map(|s| s.iter().copied().fold(0.0, f64::max))
            .collect(),
        stage_memory_bytes: stage_memory,
        busy_s: busy,
        simulated: false,
    }))
}

/// The largest of `values` (0 for none).
pub(super) fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(0.0, f64::max)
}

/// Per stage, the fp32 gradient all-reduce over its replicas, s: under expert
/// parallelism the experts each member holds over the replicas holding the same
/// ([`expert_allreduce_s`]), the rest over all.
pub(super) fn allreduce_times(ctx: &Ctx<'_>, grid: &[Vec<usize>], layers: &[usize]) -> Vec<f64> {
    let p = grid.len();
    let model = &ctx.cost.model;
    (0..p)
        .map(|i| {
            let whole = model.stage_params(layers[i], i == 0, i + 1 == p);
            let experts = match experts_apart(ctx, &grid[i]) {
                true => layers[i] as f64 * model.expert_layer_params(),
                false => 0.0,
            };
            holders_allreduce_s(ctx, &grid[i], whole - experts)
                + expert_allreduce_s(ctx, &grid[i], layers[i] as f64)
        })
        .collect()
}

/// The fp32 gradient all-reduce of `params` parameters over the units that hold them:
/// units split alike reduce share by share, side by side (priced over each unit's first
/// member); otherwise the trainer reduces whole tensors over every member of every unit.
pub(super) fn holders_allreduce_s(ctx: &Ctx<'_>, units: &[usize], params: f64) -> f64 {
    let alike = (units.iter()).all(|&u| ctx.groups[u].shares == ctx.groups[units[0]].shares);
    match alike {
        true => {
            let share = (units.iter())
                .map(|&u| ctx.state_fraction(u))
                .fold(0.0, f64::max);
            let devices = units
                .iter()
                .flat_map(|&u| ctx.reducing_members(u))
                .collect();
            ctx.allreduce_seconds(devices, params * 4.0 * share)
        }
        false => {
            let members = (units.iter())
                .flat_map(|&u| ctx.groups[u].members.iter().copied())
                .collect();
            ctx.allreduce_seconds(members, params * 4.0)
        }
    }
}

/// Per (stage, replica), the optimizer step over the stage's parameters, s (0 where
/// not priced).
pub(super) fn optimizer_times(ctx: &Ctx<'_>, grid: &[Vec<usize>], layers: &[usize]) -> Grid<f64> {
    let p = grid.len();
    (0..p)
        .map(|i| {
            let shares = Shares::of_stage(ctx, &grid[i]);
            (grid[i].iter())
                .map(|&k| {
                    let params = ctx.cost_of(k).stage_params(layers[i], i == 0, i + 1 == p);
                    let share = shares.of(ctx, k);
                    ctx.optimizer_seconds(k, params * share).unwrap_or(0.0)
                })
                .collect()
        })
        .collect()
}

/// Each replica's stage boundaries in pieces (embedding = 0, layer i = i + 1, head =
/// L + 1), per replica the (start, end) piece range of each stage and its device.
pub(super) fn stage_pieces(pools: &[PoolLayout], l: usize) -> Vec<Vec<(usize, usize, usize)>> {
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

/// One gradient segment of a per-replica-pipeline plan: the parameters between two
/// neighbouring cuts of the union of every replica's stage boundaries, held by one
/// (replica, stage) position of each replica.
pub(super) struct PooledSegment {
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
    let mut seconds = vec![0.0; positions(segments)];
    for segment in segments {
        let units: Vec<usize> = segment.holders.iter().map(|&(_, u)| u).collect();
        let experts = match experts_apart(ctx, &units) {
            true => segment.layers * ctx.cost.model.expert_layer_params(),
            false => 0.0,
        };
        let t = holders_allreduce_s(ctx, &units, segment.params - experts)
            + expert_allreduce_s(ctx, &units, segment.layers);
        for &(position, _) in &segment.holders {
            seconds[position] += t;
        }
    }
    seconds
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
