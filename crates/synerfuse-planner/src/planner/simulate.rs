//! Candidates re-timed by simulating their real schedules, rank by rank.

use super::{
    buckets::{
        gather_waits_s, grid_reductions, held_reductions, pieces_of, reductions_end_s,
        BucketedReduction, PieceWeights, StagePass,
    },
    context::Ctx,
    error::PlanningError,
    memory_fit::stage_fits,
    outcome::{Candidate, PoolLayout, PooledCandidate, Prediction},
    plan_context::{candidate_ctx, pool_sizes, stage_sizes},
    pricing::{allreduce_times, max, micro_batch_seconds, optimizer_times, stage_times},
    request::TrainOptions,
    segments::{optimizer_s, pooled_segments, reduce_s, reduce_starts, PooledSegment},
};
use crate::cost::CostModel;
use crate::sim;
use std::collections::HashMap;
use synerfuse_plan::timeline::{RankTimeline, Span, SpanKind, Timeline};
use synerfuse_plan::Plan;
use synerfuse_plan::{Pass, Piece, ScheduleKind};

/// Re-times a candidate by simulating its 1F1B schedule (with p2p times), each stage's
/// gradient reduction (in buckets inside the last backwards where they overlap, else
/// once its last replica finishes), and the optimizer step once every reduction is
/// done (the gradient norm is global).
pub(super) fn simulate_candidate(
    ctx: &mut Ctx<'_>,
    c: &Candidate,
) -> Result<Prediction, PlanningError> {
    Ok(simulate_step(ctx, c, false)?.0)
}

/// The simulated step of `c`, with every rank's spans when `record`.
pub(super) fn simulate_step(
    ctx: &mut Ctx<'_>,
    c: &Candidate,
    record: bool,
) -> Result<(Prediction, Vec<RankTimeline>), PlanningError> {
    // The schedule needs the ranks and batches only: no placement of experts searched.
    let plan = c.to_even_plan(ctx.cost)?;
    let p = c.layers.len();
    let sizes = &c.micro_batch_sizes;
    let (t, _) = stage_times(ctx, &c.devices, &c.layers, sizes, &c.micro_batches)?;
    let fits = stage_fits(ctx, &c.devices, &c.layers, sizes, &c.micro_batches)?;
    let pieces = pieces_of(&c.layers, ctx.cost.model.num_layers);
    // Per rank, its (stage, replica) and pace.
    let coords: Vec<(usize, usize)> = (plan.positions().into_iter())
        .map(|(replica, stage)| (stage, replica))
        .collect();
    // Each rank's device: its unit's member at its tensor-parallel rank.
    let devices = c.rank_devices()?;
    let paces: Vec<RankPace> = (coords.iter().zip(devices))
        .map(|(&(i, r), device)| RankPace {
            device,
            micro_batch_size: sizes[r],
            micro_batch_s: t[i][r],
            forward_fraction: fits[i][r].costs.forward_fraction,
            position: i,
            replica: r,
            last: LastMicroBatch::full(c.micro_batches[r], sizes[r], t[i][r]),
            pieces: pieces[i],
            weights: PieceWeights::new(&fits[i][r].costs, ctx.cost.model.num_layers),
        })
        .collect();
    let report = run_schedule(ctx, &plan, &paces, record)?;
    let reduce = allreduce_times(ctx, &c.devices, &c.layers);
    let optimizer = optimizer_times(ctx, &c.devices, &c.layers);
    let reductions = grid_reductions(ctx, &c.devices, &c.layers);
    let d = c.micro_batches.len();
    let queues = (|rank: usize| coords[rank].0 * d + coords[rank].1, p * d);
    let reduced = grid_reduced(ctx, (&coords, &paces), &report, &reduce, &reductions);
    let gathers = gather_waits(ctx, (&report, &paces), queues, &reductions);
    let all_reduced = reduced.all_s;
    let optimizer_s = max(&optimizer.concat());
    let param_gather_s = max(&gathers);
    let step = all_reduced + optimizer_s + param_gather_s + ctx.cost.step_overhead_s();
    let total_busy: f64 = report.busy_s.iter().sum();
    let prediction = Prediction {
        step_time_s: step,
        pipeline_s: report.makespan_s,
        allreduce_s: max(&reduce),
        optimizer_s,
        param_gather_s,
        bubble_fraction: 1.0 - total_busy / (step * report.busy_s.len() as f64).max(1e-30),
        simulated: true,
        stage_time_s: c.prediction.stage_time_s[..p].to_vec(),
        ..c.prediction.clone()
    };
    let after = |rank: usize| {
        let (i, r) = coords[rank];
        AfterSchedule {
            reduce_start_s: reduced.spans[rank].0,
            reduce_end_s: reduced.spans[rank].1,
            all_reduced_s: all_reduced,
            optimizer_s: optimizer[i][r],
            gather_s: (all_reduced + optimizer_s, gathers[rank]),
        }
    };
    let rows = rank_rows(ctx, &plan, &paces, report, after);
    Ok((prediction, rows))
}

/// Each rank of a grid candidate (at `coords`, (stage, replica), and `paces`): its
/// stage's reduction after its replicas' pipelines (of `reduce` seconds), or in
/// buckets over them inside their last backwards (`reductions`, per stage and replica).
fn grid_reduced(
    ctx: &Ctx<'_>,
    (coords, paces): (&[(usize, usize)], &[RankPace]),
    report: &sim::SimReport,
    reduce: &[f64],
    reductions: &[(Vec<usize>, BucketedReduction)],
) -> Reduced {
    let p = reduce.len();
    let d = paces.iter().map(|pace| pace.replica + 1).max().unwrap_or(0);
    if !ctx.cost.overlap_grad_reduce {
        // Each stage's reduction starts when the last of its replicas finishes.
        let mut stage_done = vec![0.0f64; p];
        for (rank, &(i, _)) in coords.iter().enumerate() {
            stage_done[i] = stage_done[i].max(report.finish_s[rank]);
        }
        return after_pipelines(paces, &stage_done, reduce);
    }
    let queue = |rank: usize| coords[rank].0 * d + coords[rank].1;
    overlapped(report, paces, (queue, p * d), reductions)
}

/// The simulated step of `candidate` on `cost`'s cluster, rank by rank.
pub fn timeline(cost: &CostModel, candidate: &Candidate) -> Result<Timeline, PlanningError> {
    let variant = candidate.options.cost(cost);
    let mut ctx = candidate_ctx(&variant, candidate);
    if !candidate.stage_expert_parallel.is_empty() {
        let sizes = candidate.expert_parallel_sizes();
        stage_sizes(&mut ctx, &candidate.devices, &sizes);
    }
    let (prediction, ranks) = simulate_step(&mut ctx, candidate, true)?;
    let layers: Vec<String> = candidate.layers.iter().map(usize::to_string).collect();
    Ok(Timeline {
        title: format!(
            "predicted: pp {} x dp {} (tp {}), layers [{}], {}, step {:.4} s",
            candidate.layers.len(),
            candidate.micro_batches.len(),
            candidate.tensor_parallel_size(),
            layers.join(", "),
            candidate.micro_batch_size_text(),
            prediction.step_time_s
        ),
        ranks,
    })
}

/// Simulates the plan's 1F1B programs (every replica at once, each message at its
/// link's cost), then each reduction (in buckets inside the last backwards where they
/// overlap, else once its holders have finished), and the optimizer; the candidate
/// with its times, and each rank's spans when `record`.
pub(super) fn simulate_pools(
    ctx: &mut Ctx<'_>,
    pools: Vec<PoolLayout>,
    record: bool,
) -> Result<(PooledCandidate, Vec<RankTimeline>), PlanningError> {
    let mut candidate = PooledCandidate {
        pools,
        groups: ctx.groups.to_vec(),
        pool_expert_parallel: Vec::new(),
        recompute: Vec::new(),
        options: TrainOptions::of(ctx.cost),
        step_time_s: 0.0,
        pipeline_s: 0.0,
        reduce_s: 0.0,
        optimizer_s: 0.0,
        param_gather_s: 0.0,
        replica_finish_s: Vec::new(),
    };
    let plan = candidate.to_plan(ctx.cost)?;
    let paces = pooled_ranks(ctx, &mut candidate)?;
    let report = run_schedule(ctx, &plan, &paces, record)?;
    let segments = pooled_segments(ctx, &candidate.pools);
    let reduce = reduce_s(ctx, &segments);
    let optimizer = optimizer_s(ctx, &candidate.pools, &segments);
    let reductions = pooled_reductions(ctx, &segments);
    let reduced = pooled_reduced(ctx, (&segments, &reductions), &paces, &report, &reduce);
    let queues = (|rank: usize| paces[rank].position, reduce.len());
    let gathers = gather_waits(ctx, (&report, &paces), queues, &reductions);
    let all_reduced = reduced.all_s;
    let replicas = paces.last().map_or(0, |pace| pace.replica + 1);
    candidate.replica_finish_s = vec![0.0; replicas];
    for (pace, &finish) in paces.iter().zip(&report.finish_s) {
        let slot = &mut candidate.replica_finish_s[pace.replica];
        *slot = slot.max(finish);
    }
    candidate.pipeline_s = report.makespan_s;
    candidate.reduce_s = max(&reduce);
    candidate.optimizer_s = optimizer;
    candidate.param_gather_s = max(&gathers);
    candidate.step_time_s =
        all_reduced + optimizer + candidate.param_gather_s + ctx.cost.step_overhead_s();
    let after = |rank: usize| AfterSchedule {
        reduce_start_s: reduced.spans[rank].0,
        reduce_end_s: reduced.spans[rank].1,
        all_reduced_s: all_reduced,
        optimizer_s: optimizer,
        gather_s: (all_reduced + optimizer, gathers[rank]),
    };
    let rows = rank_rows(ctx, &plan, &paces, report, after);
    Ok((candidate, rows))
}

/// Every reduction of a per-replica-pipeline plan's `segments`, each over its holders'
/// positions, in the plan's global order (the segments from the last to the first).
fn pooled_reductions(
    ctx: &Ctx<'_>,
    segments: &[PooledSegment],
) -> Vec<(Vec<usize>, BucketedReduction)> {
    (segments.iter().rev())
        .flat_map(|s| {
            let (positions, units): (Vec<usize>, Vec<usize>) = s.holders.iter().copied().unzip();
            let held = held_reductions(ctx, &units, s.pieces, s.layers);
            held.into_iter().map(move |b| (positions.clone(), b))
        })
        .collect()
}

/// Each rank of a per-replica-pipeline plan (at `paces`): its position's reductions
/// (of `reduce` seconds) after every holder of its `segments` has finished, or in
/// buckets (`reductions`) inside the holders' last backwards.
fn pooled_reduced(
    ctx: &Ctx<'_>,
    (segments, reductions): (&[PooledSegment], &[(Vec<usize>, BucketedReduction)]),
    paces: &[RankPace],
    report: &sim::SimReport,
    reduce: &[f64],
) -> Reduced {
    if !ctx.cost.overlap_grad_reduce {
        // Each position's reduction starts when every holder of its segments has
        // finished (as a grid stage's starts when its last replica does).
        let mut finished = vec![0.0f64; reduce.len()];
        for (rank, pace) in paces.iter().enumerate() {
            finished[pace.position] = finished[pace.position].max(report.finish_s[rank]);
        }
        return after_pipelines(paces, &reduce_starts(segments, &finished), reduce);
    }
    let queue = |rank: usize| paces[rank].position;
    overlapped(report, paces, (queue, reduce.len()), reductions)
}

/// Runs `plan`'s 1F1B programs (every replica at once) with each rank at its pace and
/// each message at its link's cost: every rank's finish and busy time, and its spans
/// when `record`. The one simulation behind every prediction of the planner.
fn run_schedule(
    ctx: &Ctx<'_>,
    plan: &Plan,
    paces: &[RankPace],
    record: bool,
) -> Result<sim::SimReport, PlanningError> {
    if !record {
        return run_distinct_replicas(ctx, plan, paces);
    }
    let programs = plan.schedule(ScheduleKind::OneFOneB)?;
    let (op_seconds, message_seconds) = pace_prices(ctx, paces, |rank| rank);
    Ok(sim::simulate_spans(&programs, op_seconds, message_seconds)?)
}

/// The seconds of each pass and message of the ranks `rank_of` maps a program's
/// ranks to.
#[allow(clippy::type_complexity)]
fn pace_prices<'a>(
    ctx: &'a Ctx<'_>,
    paces: &'a [RankPace],
    rank_of: impl Fn(usize) -> usize + Copy + 'a,
) -> (
    impl Fn(usize, Pass, Piece) -> f64 + 'a,
    impl Fn(usize, usize, Piece) -> sim::Transfer + 'a,
) {
    let (devices, cost) = (&ctx.all, ctx.cost);
    let op_seconds = move |rank: usize, pass: Pass, piece: Piece| {
        let pace = &paces[rank_of(rank)];
        let (t, f) = match piece.micro_batch == pace.last.index {
            true => (pace.last.seconds, pace.forward_fraction),
            false => (pace.micro_batch_s, pace.forward_fraction),
        };
        match pass {
            Pass::Forward => t * f,
            Pass::Backward => t * (1.0 - f),
        }
    };
    let message_seconds = move |from: usize, to: usize, piece: Piece| {
        let pace = &paces[rank_of(from)];
        let b = match piece.micro_batch == pace.last.index {
            true => pace.last.size,
            false => pace.micro_batch_size,
        };
        cost.transfer(
            &devices[pace.device],
            &devices[paces[rank_of(to)].device],
            b,
        )
    };
    (op_seconds, message_seconds)
}

/// The schedule simulated once per distinct replica (pipelines run side by side and
/// meet only in the reduction after them): replicas whose ranks run at the same paces
/// and send over the same links finish alike, so a plan of thousands of alike replicas
/// costs what a few do.
fn run_distinct_replicas(
    ctx: &Ctx<'_>,
    plan: &Plan,
    paces: &[RankPace],
) -> Result<sim::SimReport, PlanningError> {
    // Per replica, what its schedule depends on: its micro-batches, and per rank (stage
    // by stage) its pace and its sends' prices at both sizes.
    let mut firsts: HashMap<Vec<u64>, usize> = HashMap::new();
    let mut representative = Vec::with_capacity(plan.replicas().len());
    for replica in plan.replicas() {
        let mut key = vec![replica.batch.num_micro_batches() as u64];
        for (stage, ranks) in replica.ranks.iter().enumerate() {
            key.push(ranks.len() as u64);
            for (tp, &rank) in ranks.iter().enumerate() {
                let pace = &paces[rank];
                key.extend([
                    pace.micro_batch_size as u64,
                    pace.micro_batch_s.to_bits(),
                    pace.forward_fraction.to_bits(),
                    pace.last.index as u64,
                    pace.last.size as u64,
                    pace.last.seconds.to_bits(),
                ]);
                // Its sends: activations down, gradients up, each to the neighbouring
                // stage's members its tensor-parallel rank sends to (as `tp_program`).
                let neighbours = [stage.checked_sub(1), Some(stage + 1)];
                let peers = (neighbours.into_iter().flatten())
                    .filter_map(|s| replica.ranks.get(s))
                    .flat_map(|next| {
                        (next.iter().enumerate())
                            .filter(|(j, _)| j % ranks.len() == tp)
                            .map(|(_, &peer)| peer)
                    });
                for peer in peers {
                    let to = &ctx.all[paces[peer].device];
                    for b in [pace.micro_batch_size, pace.last.size] {
                        let t = ctx.cost.transfer(&ctx.all[pace.device], to, b);
                        key.extend([t.sender_s.to_bits(), t.transit_s.to_bits()]);
                    }
                }
            }
        }
        let next = firsts.len();
        representative.push(*firsts.entry(key).or_insert(next));
    }
    let mut distinct: Vec<usize> = vec![0; firsts.len()];
    for (r, &k) in representative.iter().enumerate().rev() {
        distinct[k] = r;
    }
    let (programs, ranks_in_plan) = plan.schedule_of(ScheduleKind::OneFOneB, &distinct)?;
    let (op_seconds, message_seconds) = pace_prices(ctx, paces, |rank| ranks_in_plan[rank]);
    let simulated = sim::simulate(&programs, op_seconds, message_seconds)?;
    // Each rank as its representative's rank at the same place: `schedule_of` numbers
    // the representatives' ranks replica by replica, stage by stage (alike replicas have
    // the same stage widths).
    let first: Vec<usize> = (distinct.iter())
        .scan(0, |next, &r| {
            let at = *next;
            *next += plan.replicas()[r].ranks.iter().map(Vec::len).sum::<usize>();
            Some(at)
        })
        .collect();
    let world = plan.world_size();
    let (mut finish_s, mut busy_s) = (vec![0.0; world], vec![0.0; world]);
    let mut last_backward_s = vec![(0.0, 0.0); world];
    let mut first_forward_s = vec![(0.0, 0.0); world];
    for (r, replica) in plan.replicas().iter().enumerate() {
        for (place, &rank) in replica.ranks.iter().flatten().enumerate() {
            let i = first[representative[r]] + place;
            finish_s[rank] = simulated.finish_s[i];
            busy_s[rank] = simulated.busy_s[i];
            last_backward_s[rank] = simulated.last_backward_s[i];
            first_forward_s[rank] = simulated.first_forward_s[i];
        }
    }
    Ok(sim::SimReport {
        finish_s,
        busy_s,
        makespan_s: simulated.makespan_s,
        last_backward_s,
        first_forward_s,
        spans: Vec::new(),
    })
}

/// What a rank does after its schedule, s from the step's start: waits for its
/// reduction's holders, reduces (overlapped: waits for its buckets still in flight),
/// waits for the slowest reduction (the gradient norm is global), and steps its
/// optimizer.
struct AfterSchedule {
    reduce_start_s: f64,
    reduce_end_s: f64,
    all_reduced_s: f64,
    optimizer_s: f64,
    /// When the parameter gathers start (every optimizer step done) and what it waits
    /// for its own after that (with `--overlap-param-gather`, what the next forward
    /// waits, drawn here).
    gather_s: (f64, f64),
}

/// Every rank's spans: its schedule's, then what [`AfterSchedule`] says.
fn rank_rows(
    ctx: &Ctx<'_>,
    plan: &Plan,
    paces: &[RankPace],
    report: sim::SimReport,
    after: impl Fn(usize) -> AfterSchedule,
) -> Vec<RankTimeline> {
    let mut rows = Vec::with_capacity(report.spans.len());
    let positions = plan.positions();
    for (rank, mut spans) in report.spans.into_iter().enumerate() {
        let a = after(rank);
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
        span(SpanKind::Wait, report.finish_s[rank], a.reduce_start_s);
        span(SpanKind::Reduce, a.reduce_start_s, a.reduce_end_s);
        span(SpanKind::Wait, a.reduce_end_s, a.all_reduced_s);
        let done = a.all_reduced_s + a.optimizer_s;
        span(SpanKind::Optimizer, a.all_reduced_s, done);
        let (gathers_s, gather_s) = a.gather_s;
        if gather_s > 0.0 {
            span(SpanKind::Wait, done, gathers_s);
            span(SpanKind::Gather, gathers_s, gathers_s + gather_s);
        }
        let (replica, stage) = positions.get(rank).copied().unwrap_or_default();
        rows.push(RankTimeline {
            label: format!(
                "rank {rank}: replica {replica}, stage {stage}, {}",
                ctx.all[paces[rank].device].kind
            ),
            spans,
        });
    }
    rows
}

/// One rank as the simulation sees it.
#[derive(Clone, Copy)]
struct RankPace {
    device: usize,
    micro_batch_size: usize,
    /// One micro-batch's forward and backward, s.
    micro_batch_s: f64,
    forward_fraction: f64,
    /// Which reduction it waits for: its stage (a grid), or its (replica, stage)
    /// position counted over every replica's stages (per-replica pipelines).
    position: usize,
    /// Its replica, in the plan's order.
    replica: usize,
    /// Its replica's last micro-batch, which may be short.
    last: LastMicroBatch,
    /// Its stage's model pieces, `from..to`, and their shares of its backward.
    pieces: (usize, usize),
    weights: PieceWeights,
}

/// Each rank's reduction span and when the last reduction ends.
struct Reduced {
    /// Per rank, its reduction span, (start, end) s.
    spans: Vec<(f64, f64)>,
    /// When every reduction has ended, s.
    all_s: f64,
}

/// Reductions after the pipelines, whole (`--no-overlap-grad-reduce`): each position's
/// from `start` for its `reduce` seconds.
fn after_pipelines(paces: &[RankPace], start: &[f64], reduce: &[f64]) -> Reduced {
    let reduced: Vec<f64> = start.iter().zip(reduce).map(|(s, r)| s + r).collect();
    Reduced {
        spans: (paces.iter())
            .map(|pace| (start[pace.position], reduced[pace.position]))
            .collect(),
        all_s: max(&reduced),
    }
}

/// Reductions in buckets inside the last backwards, on `queues` queues (`queue` of a
/// rank: the unit holding its stage), each queue at its latest rank's last backward:
/// each rank's span is what it waits for after its pipeline (the runtime's measured
/// `Reduce`), from its finish to its queue's last bucket's end.
fn overlapped(
    report: &sim::SimReport,
    paces: &[RankPace],
    (queue, queues): (impl Fn(usize) -> usize, usize),
    reductions: &[(Vec<usize>, BucketedReduction)],
) -> Reduced {
    // Each queue at its latest rank's last backward.
    let later = |new: &StagePass, old: &StagePass| old.end_s < new.end_s;
    let backward = queue_passes(paces, &report.last_backward_s, (&queue, queues), later);
    let ends = reductions_end_s(reductions, &backward);
    let spans: Vec<(f64, f64)> = (report.finish_s.iter().enumerate())
        .map(|(rank, &finish)| (finish, finish.max(ends[queue(rank)])))
        .collect();
    let all_s = spans.iter().map(|s| s.1).fold(0.0, f64::max);
    Reduced { spans, all_s }
}

/// Each rank's wait for its parameter gathers after the optimizer ([`gather_waits_s`]):
/// its queue's (`queue` of a rank, of `queues`), each queue's first forward its
/// earliest rank's in this step's schedule (the next step's starts alike).
fn gather_waits(
    ctx: &Ctx<'_>,
    (report, paces): (&sim::SimReport, &[RankPace]),
    (queue, queues): (impl Fn(usize) -> usize, usize),
    reductions: &[(Vec<usize>, BucketedReduction)],
) -> Vec<f64> {
    if !ctx.cost.distributed_optimizer {
        return vec![0.0; paces.len()];
    }
    let earlier = |new: &StagePass, old: &StagePass| new.start_s < old.start_s;
    let forwards = queue_passes(paces, &report.first_forward_s, (&queue, queues), earlier);
    let overlapped = ctx.cost.overlaps_param_gather().then_some(&forwards[..]);
    let waits = gather_waits_s(reductions, queues, overlapped);
    (0..paces.len()).map(|rank| waits[queue(rank)]).collect()
}

/// Per queue (`queue` of a rank, of `queues`), one of its ranks' passes (`spans`, per
/// rank: (start, end) s) over the rank's stage: the first, replaced by each later one
/// that `replaces` it.
fn queue_passes(
    paces: &[RankPace],
    spans: &[(f64, f64)],
    (queue, queues): (&impl Fn(usize) -> usize, usize),
    replaces: impl Fn(&StagePass, &StagePass) -> bool,
) -> Vec<StagePass> {
    let mut passes: Vec<Option<StagePass>> = vec![None; queues];
    for (rank, (pace, &(start_s, end_s))) in paces.iter().zip(spans).enumerate() {
        let pass = StagePass {
            start_s,
            end_s,
            pieces: pace.pieces,
            weights: pace.weights,
        };
        let slot = &mut passes[queue(rank)];
        if slot.is_none_or(|old| replaces(&pass, &old)) {
            *slot = Some(pass);
        }
    }
    (passes.into_iter())
        .map(|p| p.expect("a rank in every queue"))
        .collect()
}

/// A replica's last micro-batch on one rank: which it is, its samples, its seconds.
#[derive(Clone, Copy)]
struct LastMicroBatch {
    index: usize,
    size: usize,
    seconds: f64,
}

impl LastMicroBatch {
    /// The last of `count` micro-batches, full.
    fn full(count: usize, size: usize, seconds: f64) -> Self {
        LastMicroBatch {
            index: count.saturating_sub(1),
            size,
            seconds,
        }
    }
}

/// Every rank's pace, in the plan's rank order; notes each replica's recomputing stages
/// in `candidate`.
fn pooled_ranks(
    ctx: &mut Ctx<'_>,
    candidate: &mut PooledCandidate,
) -> Result<Vec<RankPace>, PlanningError> {
    let mut ranks: Vec<RankPace> = Vec::new();
    // Each rank's unit.
    let mut units: Vec<usize> = Vec::new();
    let mut replica = 0;
    let l = ctx.cost.model.num_layers;
    for pool in &candidate.pools {
        let d = pool.micro_batches.len();
        let (t, _) = pool.stage_times(ctx)?;
        let fits = pool.stage_fits(ctx)?;
        let pieces = pieces_of(&pool.layers, l);
        for r in 0..d {
            candidate
                .recompute
                .push(fits.iter().map(|row| row[r].recompute).collect());
            let p = t.len();
            for (i, row) in t.iter().enumerate() {
                let unit = pool.devices[i][r];
                let position = ranks.last().map_or(0, |x| x.position + 1);
                let mut last =
                    LastMicroBatch::full(pool.micro_batches[r], pool.micro_batch_size, row[r]);
                if pool.short_of(r) > 0 {
                    // The short micro-batch at its own size's costs, recomputed alike.
                    last.size -= pool.short_of(r);
                    let at = (pool.layers[i], i, p);
                    let recompute = fits[i][r].recompute;
                    last.seconds = micro_batch_seconds(ctx, unit, last.size, recompute, at)?;
                }
                for &device in &ctx.groups[unit].members {
                    units.push(unit);
                    ranks.push(RankPace {
                        device,
                        micro_batch_size: pool.micro_batch_size,
                        micro_batch_s: row[r],
                        forward_fraction: fits[i][r].costs.forward_fraction,
                        position,
                        replica,
                        last,
                        pieces: pieces[i],
                        weights: PieceWeights::new(&fits[i][r].costs, l),
                    });
                }
            }
            replica += 1;
        }
    }
    in_lockstep(&mut ranks, &units, &ctx.lockstep);
    Ok(ranks)
}

/// Each micro-batch of the ranks of units that meet at every MoE layer (`lockstep`) at
/// the slowest one's pace.
fn in_lockstep(ranks: &mut [RankPace], units: &[usize], lockstep: &[Vec<usize>]) {
    for group in lockstep {
        let members: Vec<usize> = (0..ranks.len())
            .filter(|&k| group.contains(&units[k]))
            .collect();
        let slowest = |part: fn(&RankPace) -> f64| {
            (members.iter())
                .map(|&k| part(&ranks[k]))
                .fold(0.0, f64::max)
        };
        let (each, last) = (slowest(|r| r.micro_batch_s), slowest(|r| r.last.seconds));
        for &k in &members {
            ranks[k].micro_batch_s = each;
            ranks[k].last.seconds = last;
        }
    }
}

/// The simulated step of a per-replica-pipeline plan, rank by rank.
pub fn pooled_timeline(
    cost: &CostModel,
    candidate: &PooledCandidate,
) -> Result<synerfuse_plan::timeline::Timeline, PlanningError> {
    // Each pool at its own size, its groups in lockstep (the base holds every expert).
    let variant = TrainOptions {
        distributed_optimizer: false,
        expert_parallel: 1,
        ..candidate.options
    }
    .cost(cost);
    let mut ctx = Ctx::with_groups(&variant, cost.cluster.devices(), candidate.groups.clone());
    let sizes: Vec<usize> = (0..candidate.pools.len())
        .map(|k| candidate.expert_parallel_of(k))
        .collect();
    pool_sizes(&mut ctx, &candidate.pools, &sizes);
    let (simulated, ranks) = simulate_pools(&mut ctx, candidate.pools.clone(), true)?;
    Ok(synerfuse_plan::timeline::Timeline {
        title: format!(
            "predicted: {} replicas of their own pipelines, step {:.4} s",
            candidate.replicas().count(),
            simulated.step_time_s
        ),
        ranks,
    })
}
