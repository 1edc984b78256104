//! The overlapped, bucketed gradient reduction: the runtime's bucket size and cut, one
//! bucket as the reduction after the backward, smaller buckets hiding more of it, and
//! the schedule against a brute force stepping through time.

use super::buckets::{
    gather_waits_s, reductions_end_s, BucketedReduction, LaidPiece, PieceWeights, StagePass,
};
use super::context::Ctx;
use super::reduction::{holders_collective, CollectivePrice};
use super::*;
use crate::cost::{bucket_size, CostModel};
use proptest::prelude::*;
use synerfuse_plan::timeline::SpanKind;
use synerfuse_plan::{ModelShape, Plan};

/// The runtime's rule (`ParallelConfig::bucket_size`), and the flags that ask for it.
#[test]
fn buckets_are_sized_and_asked_for_as_the_runtime_sizes_them() {
    assert_eq!(bucket_size(true, None, 8), 40_000_000);
    assert_eq!(bucket_size(true, None, 64), 64_000_000);
    assert_eq!(bucket_size(true, Some(5000), 64), 5000);
    assert_eq!(bucket_size(false, Some(5000), 64), usize::MAX);
    let default = TrainOptions::default();
    assert!(default.overlap_grad_reduce && default.train_flags().is_empty());
    assert_eq!(default.bucket_size(2), 40_000_000);
    let sized = TrainOptions {
        ddp_bucket_size: Some(5000),
        distributed_optimizer: true,
        ..default
    };
    let flags = ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"];
    assert_eq!(sized.train_flags(), flags);
    let after = TrainOptions {
        overlap_grad_reduce: false,
        ..sized
    };
    assert_eq!(
        after.train_flags(),
        ["--use-distributed-optimizer", "--no-overlap-grad-reduce"]
    );
    let cost = after.cost(&a_cost(0.0));
    assert_eq!(
        (cost.overlap_grad_reduce, cost.bucket_size(4)),
        (false, usize::MAX)
    );
    assert_eq!(TrainOptions::of(&cost), after);
}

/// Tensors whole, a bucket closed at the first that brings it to the size: the head's
/// two tensors of 100 fill one each, the second layer's nine of 10 and one of the first
/// layer's the next, the rest of the first layer and the embedding the last.
#[test]
fn a_bucket_closes_at_the_first_tensor_that_fills_it() {
    let reduction = |bucket_size| BucketedReduction {
        pieces: vec![
            piece(3, 200.0, 2),
            piece(2, 90.0, 9),
            piece(1, 90.0, 9),
            piece(0, 150.0, 1),
        ],
        fixed_s: 0.0,
        per_element_s: 1.0,
        bucket_size,
        gather: None,
    };
    let buckets = reduction(100).buckets();
    assert_eq!(buckets, [(100.0, 3), (100.0, 3), (100.0, 1), (230.0, 0)]);
    assert_eq!(reduction(usize::MAX).buckets(), [(530.0, 0)]);
}

fn piece(piece: usize, elements: f64, tensors: usize) -> LaidPiece {
    LaidPiece {
        piece,
        elements,
        tensors,
    }
}

/// A two-layer model's cost on three custom devices of `tflops` (one node), the
/// network's latency `latency_us`.
fn a_cost(latency_us: f64) -> CostModel {
    let mut toml = String::new();
    for tflops in [50.0, 20.0, 35.0] {
        toml.push_str(&format!(
            "[[group]]\nkind = \"custom\"\ncount = 1\nnode = \"n\"\ntflops_bf16 = {tflops}\nmemory_gb = 80\nmem_bw_gbs = 1000\n"
        ));
    }
    toml.push_str(&format!(
        "[network]\nintra_node_gbs = 2\ninter_node_gbs = 1\nlatency_us = {latency_us}\n"
    ));
    let model = ModelShape {
        num_layers: 4,
        hidden_size: 512,
        num_heads: 8,
        num_kv_heads: 8,
        ffn_hidden_size: 1536,
        vocab_size: 8192,
        seq_length: 256,
        tied: false,
        experts: None,
    };
    CostModel::new(
        model,
        crate::cluster::ClusterSpec::from_toml(&toml).unwrap(),
        None,
    )
}

/// Two stages on devices 0 and 1 beside the whole model on device 2.
const PLAN: &str = r#"
[[replica]]
layers = [2, 2]
micro_batch_size = 2
num_micro_batches = 3

[[replica]]
layers = [4]
micro_batch_size = 2
num_micro_batches = 2
"#;

/// Each rank's reduction span, (start, end), or its finish where it has none.
fn reduce_spans(cost: &CostModel, plan: &Plan) -> (f64, Vec<(f64, f64)>) {
    let (step, rows) = predict_timeline(cost, plan).unwrap();
    let spans = (rows.iter())
        .map(|row| {
            let reduce = row.spans.iter().find(|s| s.kind == SpanKind::Reduce);
            let busy = (row.spans.iter()).filter(|s| s.kind != SpanKind::Reduce);
            let finish = busy.take_while(|s| s.kind != SpanKind::Optimizer).last();
            reduce.map_or((0.0, finish.map_or(0.0, |s| s.end_s)), |s| {
                (s.start_s, s.end_s)
            })
        })
        .collect();
    (step, spans)
}

/// Two replicas of the whole model on devices 0 and 1.
const DATA_PARALLEL: &str = r#"
[[replica]]
layers = [4]
micro_batch_size = 2
num_micro_batches = 3

[[replica]]
layers = [4]
micro_batch_size = 1
num_micro_batches = 2
"#;

/// One bucket per reduction is ready only when its members' backwards have ended: where
/// nothing follows the last backward (replicas of one stage, one reduction each) it is
/// the reduction after the pipeline; otherwise it starts before the last sends (and a
/// rank's later reductions before its holders all finish), never later.
#[test]
fn one_bucket_starts_when_the_last_backward_ends() {
    let whole = CostModel {
        overlap_grad_reduce: false,
        ..a_cost(10.0)
    };
    let one = CostModel {
        ddp_bucket_size: Some(usize::MAX),
        ..a_cost(10.0)
    };
    for (text, alike) in [(DATA_PARALLEL, true), (PLAN, false)] {
        let plan = Plan::from_toml(text, None).unwrap();
        let (after, after_spans) = reduce_spans(&whole, &plan);
        let (overlapped, spans) = reduce_spans(&one, &plan);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * after;
        assert!(
            overlapped <= after * (1.0 + 1e-12),
            "{overlapped} vs {after}"
        );
        // (Where ranks share a member, the reduction after the pipeline prices each
        // rank's own reductions only, not the member's others before them.)
        for (s, a) in spans.iter().zip(&after_spans) {
            assert!(!alike || close(s.1, a.1), "{spans:?} vs {after_spans:?}");
        }
        assert!(
            !alike || close(overlapped, after),
            "{overlapped} vs {after}"
        );
        assert!(alike || overlapped < after, "{overlapped} vs {after}");
    }
}

/// Smaller buckets start sooner: on the plan above, each halving of the bucket size
/// ends the reductions no later (no latency: buckets cost their bytes only), and
/// below the whole reduction's exposure.
#[test]
fn smaller_buckets_hide_more_of_the_reduction() {
    let plan = Plan::from_toml(PLAN, None).unwrap();
    let mut last = f64::INFINITY;
    let whole = reduce_spans(
        &CostModel {
            overlap_grad_reduce: false,
            ..a_cost(0.0)
        },
        &plan,
    )
    .0;
    for size in [
        usize::MAX,
        4_000_000,
        2_000_000,
        1_000_000,
        500_000,
        250_000,
    ] {
        let cost = CostModel {
            ddp_bucket_size: Some(size),
            ..a_cost(0.0)
        };
        let (step, _) = reduce_spans(&cost, &plan);
        assert!(step <= last * (1.0 + 1e-12), "{size}: {step} after {last}");
        last = step;
    }
    assert!(last < whole, "{last} vs {whole}");
}

/// Brute force of a bucket cut: tensor by tensor, closed at the first that reaches
/// `size` (the runtime's `Bucket::cut`).
fn cut_by_tensor(pieces: &[LaidPiece], size: f64) -> Vec<(f64, usize)> {
    let (mut out, mut fill, mut lowest) = (Vec::new(), 0.0, None);
    for p in pieces {
        for _ in 0..p.tensors {
            fill += p.elements / p.tensors as f64;
            lowest = Some(p.piece);
            if fill >= size {
                out.push((fill, p.piece));
                (fill, lowest) = (0.0, None);
            }
        }
    }
    out.extend(lowest.map(|piece| (fill, piece)));
    out
}

/// Brute force of a backward: each piece from the last walked in turn for its share.
fn final_by_walking(b: &StagePass, piece: usize) -> f64 {
    let (from, to) = b.pieces;
    let w = |q: usize| match q {
        0 => b.weights.embedding,
        q if q == b.weights.layers + 1 => b.weights.head,
        _ => b.weights.layer,
    };
    let whole: f64 = (from..to).map(w).sum();
    let mut at = b.start_s;
    for q in (from.max(piece)..to).rev() {
        at += (b.end_s - b.start_s) * w(q) / whole;
    }
    at
}

/// Brute force of the schedule: time in steps of `dt`; a bucket starts at the first
/// step where it is ready and, on each of its members, next in the global order and
/// the member idle.
fn stepped_ends(
    reductions: &[(Vec<usize>, BucketedReduction)],
    backward: &[StagePass],
    dt: f64,
) -> Vec<f64> {
    // Every bucket: (members, ready, seconds), in the global order.
    let mut buckets = Vec::new();
    for (members, r) in reductions {
        for (elements, lowest) in cut_by_tensor(&r.pieces, r.bucket_size as f64) {
            let ready = (members.iter())
                .map(|&m| final_by_walking(&backward[m], lowest))
                .fold(0.0, f64::max);
            let seconds = r.fixed_s + r.per_element_s * elements;
            buckets.push((members.clone(), ready, seconds, false));
        }
    }
    let queues = backward.len();
    let (mut busy, mut done) = (vec![0.0f64; queues], vec![0usize; queues]);
    let mut t = 0.0;
    while buckets.iter().any(|b| !b.3) {
        for k in 0..buckets.len() {
            let (members, ready, seconds, started) = &buckets[k];
            // Its members' buckets before it, in the global order, all started.
            let next =
                |m: usize| (buckets[..k].iter()).filter(|b| b.0.contains(&m)).count() == done[m];
            if *started || t < *ready || !members.iter().all(|&m| next(m) && busy[m] <= t) {
                continue;
            }
            for &m in members {
                (busy[m], done[m]) = (t + seconds, done[m] + 1);
            }
            buckets[k].3 = true;
        }
        t += dt;
    }
    busy
}

/// A reduction of pieces `from..to` of a `layers`-layer model, integer elements per
/// tensor.
fn random_reduction(
    (from, to): (usize, usize),
    layers: usize,
    tensor: &[u32],
    (fixed_s, per_element_s, bucket_size): (f64, f64, usize),
) -> BucketedReduction {
    let pieces = (from..to)
        .rev()
        .map(|q| {
            let tensors = match q {
                0 => 1,
                q if q == layers + 1 => 2,
                _ => 9,
            };
            piece(
                q,
                f64::from(tensor[q % tensor.len()]) * tensors as f64,
                tensors,
            )
        })
        .collect();
    BucketedReduction {
        pieces,
        fixed_s,
        per_element_s,
        bucket_size,
        gather: None,
    }
}

/// A backward over `pieces` of a `layers`-layer model from `start_s`, pieces weighed
/// `w` (embedding, layer, head).
fn backward_of(
    (start_s, seconds): (f64, f64),
    pieces: (usize, usize),
    layers: usize,
    w: (f64, f64, f64),
) -> StagePass {
    StagePass {
        start_s,
        end_s: start_s + seconds,
        pieces,
        weights: PieceWeights {
            embedding: w.0,
            layer: w.1,
            head: w.2,
            layers,
        },
    }
}

proptest! {
    /// The cut and the schedule against brute force: tensors one by one, the backward
    /// piece by piece, time step by step; reductions over overlapping member sets.
    #[test]
    fn the_schedule_matches_stepping_through_time(
        layers in 1usize..=4,
        windows in proptest::collection::vec((0.0f64..2.0, 0.1f64..2.0, (0.0f64..1.0, 0.1f64..1.0, 0.0f64..2.0)), 1..=3),
        tensor in proptest::collection::vec(1u32..=40, 1..=4),
        reductions in proptest::collection::vec((0usize..6, 1usize..=6, 0usize..8, 0.0f64..0.2, 1usize..=400), 1..=3),
    ) {
        let q = windows.len();
        let backward: Vec<StagePass> = (windows.iter())
            .map(|&(start, seconds, w)| backward_of((start, seconds), (0, layers + 2), layers, w))
            .collect();
        let reductions: Vec<(Vec<usize>, BucketedReduction)> = (reductions.iter())
            .map(|&(from, len, members, fixed, size)| {
                let from = from.min(layers + 1);
                let to = (from + len).min(layers + 2);
                let members: Vec<usize> = (0..q).filter(|m| (members >> m) & 1 == 1 || *m == members % q).collect();
                (members, random_reduction((from, to), layers, &tensor, (fixed, 1e-3, size)))
            })
            .collect();
        for (_, r) in &reductions {
            prop_assert_eq!(r.buckets(), cut_by_tensor(&r.pieces, r.bucket_size as f64));
        }
        let buckets: usize = reductions.iter().map(|(_, r)| r.buckets().len()).sum();
        let dt = 1e-4;
        let got = reductions_end_s(&reductions, &backward);
        let stepped = stepped_ends(&reductions, &backward, dt);
        for (g, s) in got.iter().zip(&stepped) {
            prop_assert!(*g <= s + 1e-9 && s - g <= dt * (buckets + 1) as f64, "{:?} vs {:?}", got, stepped);
        }
    }

    /// One bucket waits for every member's whole backward; smaller buckets (each
    /// halving a cut of equal tensors, no latency) end no later, never sooner than the
    /// last bucket's own time after the last backward, which it waits for.
    #[test]
    fn smaller_buckets_end_sooner_but_not_before_the_last(
        windows in proptest::collection::vec((0.0f64..2.0, 0.1f64..2.0, (0.0f64..1.0, 0.1f64..1.0, 0.0f64..2.0)), 1..=4),
        layers in 2usize..=6,
        per_element in 1e-4f64..1e-2,
        latency in prop_oneof![Just(0.0f64), 1e-3f64..1e-1],
    ) {
        let backward: Vec<StagePass> = (windows.iter())
            .map(|&(start, seconds, w)| backward_of((start, seconds), (1, layers + 1), layers, w))
            .collect();
        let members: Vec<usize> = (0..backward.len()).collect();
        let last_end = backward.iter().map(|b| b.end_s).fold(0.0, f64::max);
        let mut previous = f64::INFINITY;
        for halvings in 0..=7u32 {
            // 2^(7 - h) tensors a bucket: each cut refines the last.
            let size = match halvings {
                0 => usize::MAX,
                h => 16 << (7 - h),
            };
            // The decoder layers only, tensors of 16 elements.
            let r = random_reduction((1, layers + 1), layers, &[16], (latency, per_element, size));
            let (elements, _) = *r.buckets().last().unwrap();
            let end = reductions_end_s(&[(members.clone(), r.clone())], &backward)[0];
            prop_assert!(end >= last_end + r.seconds(elements) - 1e-12, "{} vs {}", end, last_end);
            if halvings == 0 {
                let whole = r.seconds(16.0 * 9.0 * layers as f64);
                prop_assert!((end - last_end - whole).abs() < 1e-9, "{} vs {} + {}", end, last_end, whole);
            }
            if latency == 0.0 {
                prop_assert!(end <= previous + 1e-12, "{}: {} after {}", size, end, previous);
            }
            previous = end;
        }
    }
}

/// The wiring against brute force on the tiny plan above: each rank's last backward
/// read off its predicted timeline, the segments' parameters counted from the model,
/// their all-reduce priced by the cost model, time stepped through: the segment of the
/// second stage (layers 2 and 3, the head) over ranks 1 and 2 first, then the first's.
#[test]
fn a_tiny_plan_reduces_as_brute_force_steps_it() {
    let size = 1_000_000;
    let cost = CostModel {
        ddp_bucket_size: Some(size),
        ..a_cost(10.0)
    };
    let plan = Plan::from_toml(PLAN, None).unwrap();
    let (_, rows) = predict_timeline(&cost, &plan).unwrap();
    let (model, devices) = (&cost.model, cost.cluster.devices());
    let backward: Vec<StagePass> = (rows.iter().zip([(0, 3), (3, 6), (0, 6)]).enumerate())
        .map(|(rank, (row, pieces))| {
            let last = (row.spans.iter()).rfind(|s| s.kind == SpanKind::Backward);
            let k = cost.stage_costs(&devices[rank], 2).unwrap();
            let w = (k.embedding_s, k.layer_s, k.head_s);
            let last = last.unwrap();
            backward_of((last.start_s, last.end_s - last.start_s), pieces, 4, w)
        })
        .collect();
    let params = |q: usize| match q {
        0 => (model.embedding_params(), 1),
        5 => (model.embedding_params() + model.hidden_size as f64, 2),
        _ => (model.layer_params(), 9),
    };
    let reduction = |(from, to): (usize, usize), [a, b]: [usize; 2]| {
        let pair = [&devices[a], &devices[b]];
        let fixed_s = cost.allreduce_seconds(&pair, 0.0);
        let per_byte = (cost.allreduce_seconds(&pair, 1e9) - fixed_s) / 1e9;
        let pieces = (from..to).rev().map(|q| piece(q, params(q).0, params(q).1));
        let reduction = BucketedReduction {
            pieces: pieces.collect(),
            fixed_s,
            per_element_s: 4.0 * per_byte,
            bucket_size: size,
            gather: None,
        };
        (vec![a, b], reduction)
    };
    let reductions = [reduction((3, 6), [1, 2]), reduction((0, 3), [0, 2])];
    let buckets: usize = reductions.iter().map(|(_, r)| r.buckets().len()).sum();
    assert!(buckets > 6, "{buckets}");
    let dt = 1e-7;
    let stepped = stepped_ends(&reductions, &backward, dt);
    let (_, spans) = reduce_spans(&cost, &plan);
    assert!(
        spans.iter().all(|s| s.0 > 0.0),
        "every rank waits: {spans:?}"
    );
    for (&(_, end), &brute) in spans.iter().zip(&stepped) {
        let close = (end - brute).abs() <= dt * (buckets + 1) as f64;
        assert!(close, "{spans:?} vs {stepped:?}");
    }
}

/// Without overlap the bucket size changes nothing: every plan, grid or per-replica,
/// priced bit for bit alike (what the reduction after the pipeline always cost; the
/// fixtures of `tests/same_plans.rs` hold it to the pricing before buckets).
#[test]
fn without_overlap_the_bucket_size_changes_nothing() {
    let request = PlanRequest {
        global_batch_size: 12,
        micro_batch_sizes: vec![1, 2],
        top_k: 3,
        tensor_parallel_sizes: vec![1],
        context_parallel_sizes: Vec::new(),
        recompute: Choice::Off,
        distributed_optimizer: Choice::Auto,
        expert_parallel_sizes: Vec::new(),
    };
    let steps = |ddp_bucket_size| {
        let cost = CostModel {
            overlap_grad_reduce: false,
            ddp_bucket_size,
            ..a_cost(10.0)
        };
        let outcome = plan(&cost, &request).unwrap();
        let grid = outcome
            .plans
            .iter()
            .map(|c| c.prediction.step_time_s.to_bits());
        let pooled = outcome.pooled.iter().map(|p| p.step_time_s.to_bits());
        let predicted = predict_step_s(&cost, &Plan::from_toml(PLAN, None).unwrap()).unwrap();
        (
            grid.chain(pooled).collect::<Vec<u64>>(),
            predicted.to_bits(),
        )
    };
    assert_eq!(steps(None), steps(Some(1000)));
}

/// The distributed optimizer's parameter gathers, after the step: four buckets of 100
/// elements at a second per 100, gathered from the first piece's. Without
/// `--overlap-param-gather` a member waits for all of them; with it the next forward
/// (equal pieces) waits at each bucket until it has arrived: for the first only when it
/// is slow, for most of them when it outruns the gathers.
#[test]
fn the_next_forward_waits_for_each_bucket_only_until_it_arrives() {
    let reduction = BucketedReduction {
        pieces: (0..4).rev().map(|q| piece(q, 100.0, 1)).collect(),
        fixed_s: 0.0,
        per_element_s: 0.0,
        bucket_size: 100,
        gather: Some(CollectivePrice {
            fixed_s: 0.0,
            per_element_s: 0.01,
        }),
    };
    let reductions = [(vec![0, 1], reduction)];
    let forward = |seconds: f64| backward_of((0.0, seconds), (0, 4), 2, (1.0, 1.0, 1.0));
    let waits = |seconds: Option<f64>| {
        let forwards = seconds.map(|s| [forward(s), forward(s)]);
        gather_waits_s(&reductions, 2, forwards.as_ref().map(|f| &f[..]))
    };
    let close = |a: Vec<f64>, b: f64| a.iter().all(|x| (x - b).abs() < 1e-9);
    assert!(close(waits(None), 4.0), "{:?}", waits(None));
    // Reaching piece q at q·s/4: bucket q ends at q + 1.
    assert!(close(waits(Some(40.0)), 1.0), "{:?}", waits(Some(40.0)));
    assert!(close(waits(Some(4.0)), 1.0), "{:?}", waits(Some(4.0)));
    assert!(close(waits(Some(0.4)), 4.0 - 0.3), "{:?}", waits(Some(0.4)));
    // Unsharded reductions gather nothing.
    let mut unsharded = reductions.clone();
    unsharded[0].1.gather = None;
    assert_eq!(gather_waits_s(&unsharded, 2, None), [0.0, 0.0]);
}

/// The collectives a sharded reduction runs: half a ring all-reduce to reduce-scatter
/// the fp32 gradients, half again to gather bf16 parameters; the planner asks for the
/// gathers to overlap only where the runtime can.
#[test]
fn a_sharded_reduction_scatters_in_fp32_and_gathers_in_the_parameters_dtype() {
    let mut cost = a_cost(10.0);
    cost.distributed_optimizer = true;
    let ctx = Ctx::new(&cost);
    let collective = holders_collective(&ctx, &[0, 1, 2]);
    let all = collective.all_reduce;
    let (scatter, gather) = (collective.reduction(), collective.gather().unwrap());
    assert!((scatter.per_element_s - all.per_element_s / 2.0).abs() < 1e-18);
    assert!((gather.per_element_s - all.per_element_s / 4.0).abs() < 1e-18);
    assert!((gather.fixed_s - all.fixed_s / 2.0).abs() < 1e-15 && all.fixed_s > 0.0);
    cost.distributed_optimizer = false;
    let replicated = holders_collective(&Ctx::new(&cost), &[0, 1, 2]);
    assert_eq!((replicated.reduction(), replicated.gather()), (all, None));
    let options = TrainOptions {
        distributed_optimizer: true,
        overlap_param_gather: true,
        ..TrainOptions::default()
    };
    let flags = ["--use-distributed-optimizer", "--overlap-param-gather"];
    assert_eq!(options.train_flags(), flags);
    assert!(options.cost(&cost).overlaps_param_gather());
    // Without the distributed optimizer nothing is gathered; without the overlapped
    // reduction the runtime refuses the flag, and the gathers follow the optimizer.
    let replicated = TrainOptions {
        distributed_optimizer: false,
        ..options
    };
    assert_eq!(replicated.train_flags(), Vec::<String>::new());
    assert!(!replicated.cost(&cost).distributed_optimizer);
    let after = TrainOptions {
        overlap_grad_reduce: false,
        ..options
    };
    assert!(!after.train_flags().contains(&flags[1].to_owned()));
    assert!(!after.cost(&cost).overlaps_param_gather());
}

proptest! {
    /// Overlapped, a member waits no longer than for all its gathers, and at least for
    /// its first bucket's (which the forward needs first); without overlap, for the sum
    /// of its buckets when it takes part in one reduction.
    #[test]
    fn overlapped_gathers_wait_between_the_first_bucket_and_all(
        layers in 1usize..=4,
        forwards in proptest::collection::vec((0.0f64..2.0, 0.0f64..2.0, (0.0f64..1.0, 0.1f64..1.0, 0.0f64..2.0)), 2..=3),
        tensor in proptest::collection::vec(1u32..=40, 1..=4),
        (fixed, size) in (0.0f64..0.2, 1usize..=400),
    ) {
        let q = forwards.len();
        let forwards: Vec<StagePass> = (forwards.iter())
            .map(|&(start, seconds, w)| backward_of((start, seconds), (0, layers + 2), layers, w))
            .collect();
        let mut r = random_reduction((0, layers + 2), layers, &tensor, (0.0, 0.0, size));
        r.gather = Some(CollectivePrice { fixed_s: fixed, per_element_s: 1e-3 });
        let gather = r.gather.unwrap();
        let first = gather.seconds(r.buckets().last().unwrap().0);
        let all: f64 = r.buckets().iter().map(|&(e, _)| gather.seconds(e)).sum();
        let reductions = [((0..q).collect::<Vec<_>>(), r)];
        let after = gather_waits_s(&reductions, q, None);
        let overlapped = gather_waits_s(&reductions, q, Some(&forwards));
        for m in 0..q {
            prop_assert!((after[m] - all).abs() < 1e-9, "{} vs {}", after[m], all);
            let lower = first - forwards[m].start_s;
            prop_assert!(overlapped[m] <= all + 1e-9 && overlapped[m] >= lower - 1e-9,
                "{}: {} not in [{}, {}]", m, overlapped[m], lower, all);
        }
    }
}
