//! The grid search: every factorization, arrangement and micro-batch size, each grid
//! laid out by alternating exact splits, the front runners re-timed by simulation.

use super::{
    context::{fastest_first, Ctx},
    error::{Infeasibility, PlanningError, Violation},
    memory_fit::{grid_fit, stage_fits, Shares},
    outcome::{Arrangement, Candidate, CandidateOrigin},
    plan_context::candidate_ctx,
    pricing::{evaluate, stage_seconds},
    request::{micro_batch_sizes, PlanRequest, TrainOptions},
    simulate::simulate_candidate,
    split::{even_layers, proportional_split, split_layers, split_samples},
};
use crate::cost::CostModel;
use std::collections::{BTreeSet, HashMap, HashSet};

/// Most assignments of micro-batch sizes to replicas tried one by one per grid; past
/// it, replicas of the same devices share a size, and past that each replica takes the
/// size at which it computes a sample fastest.
pub(super) const SIZE_ASSIGNMENTS: usize = 32;

/// Every grid of every factorization and arrangement (or only those of `only`: stages
/// and arrangement) at every micro-batch size (one for all replicas, or one each), on
/// `ctx`'s costs.
pub(super) fn grid_search(
    ctx: &mut Ctx<'_>,
    request: &PlanRequest,
    only: Option<&HashSet<(usize, Arrangement)>>,
) -> Result<Search, PlanningError> {
    let (n, l, g) = (
        ctx.devices.len(),
        ctx.cost.model.num_layers,
        request.global_batch_size,
    );
    let order = fastest_first(ctx)?;
    let mut search = Search::default();
    let sizes = micro_batch_sizes(request);
    // Expert-parallel groups are consecutive replicas.
    let ep = ctx.cost.expert_parallel;
    for p in (1..=n.min(l)).filter(|p| n % p == 0 && (n / p) % ep == 0) {
        let d = n / p;
        for arrangement in [Arrangement::ByReplica, Arrangement::ByStage] {
            if only.is_some_and(|s| !s.contains(&(p, arrangement))) {
                continue;
            }
            // Expert parallelism keeps Megatron's default rank order (a stage's replicas
            // on neighbouring devices, its expert-parallel groups among them), which
            // `--expert-model-parallel-size` describes; its tp-pp-dp order has no EP.
            if ep > 1 && arrangement == Arrangement::ByReplica {
                continue;
            }
            let devices = arrange(&order, p, d, arrangement);
            let grid = Arranged {
                devices: &devices,
                arrangement,
            };
            for &b in &sizes {
                if g % b == 0 && g / b >= d {
                    search.grid(ctx, grid, b, g / b)?;
                }
            }
            if d > 1 && sizes.len() > 1 {
                search.mixed(ctx, grid, g, &sizes)?;
            }
        }
    }
    Ok(search)
}

/// `found`'s layouts priced again on `ctx`'s costs (those that still fit).
pub(super) fn reprice(ctx: &mut Ctx<'_>, found: &[Candidate]) -> Result<Search, PlanningError> {
    let mut search = Search::default();
    for c in found {
        let grid = Arranged {
            devices: &c.devices,
            arrangement: c.arrangement,
        };
        let layout = (
            c.layers.clone(),
            c.micro_batch_sizes.clone(),
            c.micro_batches.clone(),
        );
        search.consider(ctx, grid, layout, c.origin)?;
    }
    Ok(search)
}

/// Devices arranged as (stage, replica), and how.
#[derive(Clone, Copy)]
pub(super) struct Arranged<'a> {
    pub(super) devices: &'a [Vec<usize>],
    pub(super) arrangement: Arrangement,
}

/// What the search has found so far.
#[derive(Default)]
pub(super) struct Search {
    pub(super) candidates: Vec<Candidate>,
    /// The infeasible candidate closest to fitting.
    pub(super) closest: Option<Violation>,
    pub(super) considered: usize,
}

impl Search {
    /// Evaluates one layout of `grid` and keeps it, or notes why it does not fit.
    pub(super) fn consider(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        (layers, sizes, micro_batches): (Vec<usize>, Vec<usize>, Vec<usize>),
        origin: CandidateOrigin,
    ) -> Result<(), PlanningError> {
        self.considered += 1;
        let prediction = match evaluate(ctx, grid.devices, &layers, &sizes, &micro_batches)? {
            Ok(prediction) => prediction,
            Err(v) => {
                self.note(v);
                return Ok(());
            }
        };
        let recompute: Vec<Vec<bool>> =
            (stage_fits(ctx, grid.devices, &layers, &sizes, &micro_batches)?)
                .iter()
                .map(|row| row.iter().map(|f| f.recompute).collect())
                .collect();
        // An expert-parallel group's members exchange tokens micro-batch by micro-batch,
        // stage by stage: as many micro-batches each, recomputed alike.
        let sizes_by_stage: Vec<usize> = (grid.devices.iter())
            .map(|row| ctx.expert_parallel(row[0]))
            .collect();
        let alike = (sizes_by_stage.iter().zip(&recompute))
            .all(|(&ep, row)| groups_alike(&micro_batches, ep) && groups_alike(row, ep));
        if !alike {
            return Ok(());
        }
        self.candidates.push(Candidate {
            stage_expert_parallel: match ctx.unit_expert_parallel.is_empty() {
                true => Vec::new(),
                false => sizes_by_stage,
            },
            recompute,
            options: TrainOptions {
                // One replica has nothing to shard over.
                distributed_optimizer: ctx.cost.distributed_optimizer && micro_batches.len() > 1,
                ..TrainOptions::of(ctx.cost)
            },
            arrangement: grid.arrangement,
            devices: grid.devices.to_vec(),
            layers,
            micro_batch_sizes: sizes,
            micro_batches,
            prediction,
            origin,
            // A grid's units are all of one size.
            groups: match ctx.groups.first().is_some_and(|g| g.size() > 1) {
                true => ctx.groups.clone(),
                false => Default::default(),
            },
        });
        Ok(())
    }

    pub(super) fn note(&mut self, v: Violation) {
        if self.closest.as_ref().is_none_or(|c| v.ratio < c.ratio) {
            self.closest = Some(v);
        }
    }

    /// The layouts of one grid at micro-batch size `b` with `total` micro-batches: the
    /// even layout when it exists, then alternating exact splits of layers and
    /// micro-batches, starting from micro-batches in proportion to replica throughput
    /// under even layers.
    pub(super) fn grid(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        b: usize,
        total: usize,
    ) -> Result<(), PlanningError> {
        let devices = grid.devices;
        let (p, d, l) = (devices.len(), devices[0].len(), ctx.cost.model.num_layers);
        if l % p == 0 && total % d == 0 {
            let even = (vec![l / p; p], vec![b; d], vec![total / d; d]);
            self.consider(ctx, grid, even, CandidateOrigin::Uniform)?;
        }
        let m = proportional_split(ctx, devices, b, total)?;
        self.alternate(ctx, grid, &vec![b; d], b * total, m)
    }

    /// The layouts of one grid whose replicas take micro-batch sizes of their own: for
    /// each assignment of [`size_assignments`] in which the sizes differ, the batch split
    /// under even layers, then alternating exact splits.
    pub(super) fn mixed(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        samples: usize,
        sizes: &[usize],
    ) -> Result<(), PlanningError> {
        let devices = grid.devices;
        let even = even_layers(ctx.cost.model.num_layers, devices.len());
        for assigned in size_assignments(ctx, devices, &even, sizes)? {
            if assigned.iter().all(|&b| b == assigned[0]) {
                continue;
            }
            if let Some(m) = split_samples(ctx, devices, &assigned, &even, samples)? {
                self.alternate(ctx, grid, &assigned, samples, m)?;
            }
        }
        Ok(())
    }

    /// From micro-batch counts `m`, alternates the exact layer split for the counts and
    /// the exact batch split for the layers, keeping each new layout, until one repeats
    /// (three rounds at most).
    pub(super) fn alternate(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        sizes: &[usize],
        samples: usize,
        mut m: Vec<usize>,
    ) -> Result<(), PlanningError> {
        let (devices, l) = (grid.devices, ctx.cost.model.num_layers);
        let mut seen = BTreeSet::new();
        for _ in 0..3 {
            let Some(layers) = split_layers(ctx, devices, sizes, &m, l)? else {
                self.note(memory_violation(ctx, devices, sizes, &m, l)?);
                break;
            };
            let Some(split) = split_samples(ctx, devices, sizes, &layers, samples)? else {
                break;
            };
            m = split;
            if !seen.insert((layers.clone(), m.clone())) {
                break;
            }
            let layout = (layers, sizes.to_vec(), m.clone());
            self.consider(ctx, grid, layout, CandidateOrigin::Planned)?;
        }
        Ok(())
    }
}

/// Micro-batch sizes per replica to try: every assignment of `sizes` when there are at
/// most [`SIZE_ASSIGNMENTS`]; else every assignment per kind of replica (replicas on
/// the same device classes and memory take the same size) when those are few enough;
/// else each kind the size at which it computes a sample fastest among those that fit
/// its memory under `layers` (the smallest when none fits).
pub(super) fn size_assignments(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
) -> Result<Vec<Vec<usize>>, PlanningError> {
    let d = grid[0].len();
    // A replica's kind: its devices' classes and memory, stage by stage.
    type ReplicaKind = Vec<(usize, Option<u64>)>;
    let mut kinds: Vec<ReplicaKind> = Vec::new();
    let kind_of: Vec<usize> = (0..d)
        .map(|r| {
            let key: ReplicaKind = (grid.iter())
                .map(|stage| {
                    (
                        ctx.classes[stage[r]],
                        ctx.memory[stage[r]].map(f64::to_bits),
                    )
                })
                .collect();
            kinds.iter().position(|k| *k == key).unwrap_or_else(|| {
                kinds.push(key);
                kinds.len() - 1
            })
        })
        .collect();
    let assignments = |units: usize| {
        (sizes.len().checked_pow(u32::try_from(units).ok()?)).filter(|&n| n <= SIZE_ASSIGNMENTS)
    };
    // The `k`-th assignment of sizes to `units` units, in base |sizes|.
    let nth = |mut k: usize, units: usize| -> Vec<usize> {
        (0..units)
            .map(|_| {
                let size = sizes[k % sizes.len()];
                k /= sizes.len();
                size
            })
            .collect()
    };
    if let Some(n) = assignments(d) {
        return Ok((0..n).map(|k| nth(k, d)).collect());
    }
    let per_kind: Vec<Vec<usize>> = match assignments(kinds.len()) {
        Some(n) => (0..n).map(|k| nth(k, kinds.len())).collect(),
        None => {
            let mut fastest = Vec::with_capacity(kinds.len());
            for kind in 0..kinds.len() {
                let r = kind_of
                    .iter()
                    .position(|&k| k == kind)
                    .expect("a replica per kind");
                fastest.push(fastest_size(ctx, grid, layers, r, sizes)?);
            }
            vec![fastest]
        }
    };
    Ok(per_kind
        .into_iter()
        .map(|of_kind| kind_of.iter().map(|&k| of_kind[k]).collect())
        .collect())
}

/// The size at which replica `r` computes a sample fastest (its slowest stage's time per
/// sample) among those that fit its memory with every micro-batch of 1F1B in flight.
pub(super) fn fastest_size(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    r: usize,
    sizes: &[usize],
) -> Result<usize, PlanningError> {
    let p = grid.len();
    let shares = Shares::of_grid(ctx, grid);
    let mut best: Option<(f64, usize)> = None;
    for &b in sizes {
        let (mut fits, mut slowest) = (true, 0.0f64);
        for (i, &own) in layers.iter().enumerate() {
            let fit = grid_fit(ctx, grid, &shares, (i, r), own, b, p)?;
            fits &= !ctx.exceeds(fit.need, ctx.memory[grid[i][r]]);
            slowest = slowest.max(stage_seconds(&fit.costs, own, i, p));
        }
        let per_sample = slowest / b as f64;
        if fits && best.is_none_or(|(s, _)| per_sample < s) {
            best = Some((per_sample, b));
        }
    }
    Ok(best.map_or(sizes[0], |(_, b)| b))
}

/// Re-times the front runners (up to `keep` × 3 planned ones) and the even layouts (the
/// best `keep`, the rest up to [`UNIFORM_RANKS_SIMULATED`] ranks) by simulating their
/// schedules under their options' costs (`variants`); returns the best `keep` and every
/// distinct even layout, fastest first.
pub(super) fn retime_front(
    variants: &[(TrainOptions, CostModel)],
    mut candidates: Vec<Candidate>,
    keep: usize,
) -> Result<(Vec<Candidate>, Vec<Candidate>), PlanningError> {
    let by_time = |a: &Candidate, b: &Candidate| {
        a.prediction
            .step_time_s
            .total_cmp(&b.prediction.step_time_s)
    };
    // Fastest first; on ties the options searched first (off before on). A layout found
    // under several options keeps its fastest.
    candidates.sort_by(by_time);
    let mut front: Vec<Candidate> = Vec::new();
    let mut planned = 0;
    for c in candidates {
        let is_uniform = c.origin == CandidateOrigin::Uniform;
        let duplicate = front.iter().any(|f| {
            f.layers == c.layers
                && f.micro_batches == c.micro_batches
                && f.micro_batch_sizes == c.micro_batch_sizes
                && f.devices == c.devices
                && f.groups == c.groups
        });
        if duplicate || (!is_uniform && planned >= keep * 3) {
            continue;
        }
        planned += usize::from(!is_uniform);
        front.push(c);
    }
    let mut ctxs: HashMap<(TrainOptions, usize, usize), Ctx<'_>> = HashMap::new();
    let (mut uniform_seen, mut uniform_ranks) = (0, 0);
    for c in &mut front {
        if c.origin == CandidateOrigin::Uniform {
            // The best `keep` even layouts simulated, the rest while their ranks last.
            let unit = c.tensor_parallel_size() * c.context_parallel_size();
            let ranks = c.layers.len() * c.micro_batches.len() * unit;
            uniform_seen += 1;
            uniform_ranks += ranks;
            if uniform_seen > keep && uniform_ranks > UNIFORM_RANKS_SIMULATED {
                continue;
            }
        }
        // A single replica's candidate carries no sharding: priced alike either way.
        let (options, variant) = (variants.iter())
            .find(|(o, _)| *o == c.options)
            .or_else(|| {
                variants.iter().find(|(o, _)| {
                    TrainOptions {
                        distributed_optimizer: false,
                        ..*o
                    } == c.options
                })
            })
            .expect("a variant for each option searched");
        let shape = (c.tensor_parallel_size(), c.context_parallel_size());
        let ctx =
            (ctxs.entry((*options, shape.0, shape.1))).or_insert_with(|| candidate_ctx(variant, c));
        c.prediction = simulate_candidate(ctx, c)?;
    }
    // Simulated first: a closed form may be optimistic.
    front.sort_by(|a, b| {
        (!a.prediction.simulated)
            .cmp(&!b.prediction.simulated)
            .then_with(|| by_time(a, b))
    });
    let uniform: Vec<Candidate> = (front.iter())
        .filter(|c| c.origin == CandidateOrigin::Uniform)
        .cloned()
        .collect();
    front.truncate(keep);
    Ok((front, uniform))
}

/// Ranks of even layouts simulated beyond the best few: past it they keep their closed
/// form ([`crate::planner::Prediction::simulated`] says which).
const UNIFORM_RANKS_SIMULATED: usize = 16_384;

/// Whether each run of `size` consecutive values holds one value.
fn groups_alike<T: PartialEq>(values: &[T], size: usize) -> bool {
    (values.chunks(size.max(1))).all(|g| g.iter().all(|x| *x == g[0]))
}

/// Device of (stage, replica).
pub(super) fn arrange(
    order: &[usize],
    p: usize,
    d: usize,
    arrangement: Arrangement,
) -> Vec<Vec<usize>> {
    let mut grid = vec![vec![0; d]; p];
    for (k, &device) in order.iter().enumerate() {
        let (stage, replica) = match arrangement {
            Arrangement::ByReplica => (k % p, k / p),
            Arrangement::ByStage => (k / d, k % d),
        };
        grid[stage][replica] = device;
    }
    grid
}

/// The memory constraint that blocks every layer split of this arrangement: the least
/// over-committed rank of the even split.
pub(super) fn memory_violation(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    sizes: &[usize],
    m: &[usize],
    l: usize,
) -> Result<Violation, PlanningError> {
    let p = grid.len();
    let even = even_layers(l, p);
    match evaluate(ctx, grid, &even, sizes, m)? {
        Err(v) => Ok(v),
        Ok(_) => Ok(Violation {
            ratio: 1.0,
            reason: Infeasibility::NoLayerSplit {
                layers: l,
                stages: p,
            },
        }),
    }
}
