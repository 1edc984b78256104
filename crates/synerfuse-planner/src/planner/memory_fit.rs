//! How a stage fits a unit's memory: the bytes it needs with its micro-batches in
//! flight and its share of the optimizer state, and whether it recomputes to fit.

use super::{context::Ctx, error::PlanningError, outcome::Grid};
use crate::cost::{Recompute, StageCosts, StageHolding};

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
        loss_in_chunks: ctx.loss_in_chunks(grid[i][r]),
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
