use super::search::combinations;
use super::*;
use crate::cluster::ClusterSpec;
use crate::cost::{CostModel, StageHolding};
use crate::planner::choose::throughput_bound;
use crate::planner::context::Ctx;
use crate::planner::grid::arrange;
use crate::planner::outcome::Grid;
use crate::planner::segments::{pooled_segments, reduce_s};
use crate::planner::simulate::{pooled_timeline, simulate_pools};
use crate::planner::{Arrangement, PoolLayout, PooledCandidate};
use proptest::prelude::*;
use synerfuse_plan::ModelShape;
use synerfuse_plan::ScheduleKind;

/// A request for `g` samples at `sizes`, the `top_k` best grid plans, TP 1, no
/// recomputation, the distributed optimizer on when `sharded`.
fn request(g: usize, sizes: &[usize], top_k: usize, sharded: bool) -> super::super::PlanRequest {
    use super::super::Choice;
    super::super::PlanRequest {
        global_batch_size: g,
        micro_batch_sizes: sizes.to_vec(),
        top_k,
        tensor_parallel_sizes: vec![1],
        context_parallel_sizes: Vec::new(),
        recompute: Choice::Off,
        distributed_optimizer: match sharded {
            true => Choice::On,
            false => Choice::Off,
        },
        expert_parallel_sizes: Vec::new(),
    }
}

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
        experts: None,
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
    let plan = pooled.to_plan(&cost).unwrap();
    assert_eq!(plan.replicas().len(), 2);
    assert_eq!(plan.global_batch_size(), 32);
    assert!(!plan.is_grid(), "no grid expresses it");
    // The planner's outcome carries it beside the grid plans.
    let request = request(32, &[1, 2], 1, false);
    let outcome = super::super::plan(&cost, &request).unwrap();
    let found = outcome.pooled.as_ref().expect("a pooled plan");
    let shapes = |c: &PooledCandidate| -> Vec<(Grid<usize>, Vec<usize>)> {
        (c.pools.iter())
            .map(|p| (p.devices.clone(), p.layers.clone()))
            .collect()
    };
    assert_eq!(shapes(found), shapes(&pooled));
    // Split down to the sample (22 + 10 became 21 + 11 on 2026-11-26): no slower.
    assert!(found.step_time_s <= pooled.step_time_s, "{found:?}");
    assert_eq!(found.to_plan(&cost).unwrap().global_batch_size(), 32);
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
                    short: Vec::new(),
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
    let plan = pooled.to_plan(&cost).unwrap();
    let replica = &plan.replicas()[0];
    assert_eq!(replica.ranks, [[0, 1]]);
    assert_eq!(replica.tp_shares, [Some(shares.clone())]);
    assert_eq!(plan.global_batch_size(), 16);
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
        short: Vec::new(),
    };
    let params = cost.model.stage_params(4, true, true);
    let all: Vec<&crate::cluster::Device> = ctx.all.iter().collect();
    let whole = cost.allreduce_seconds(&all, params * 4.0);
    let reduce = reduce_s(&ctx, &pooled_segments(&ctx, &[layout(0), layout(1)]));
    assert!(
        (reduce[0] - whole).abs() < 1e-12 * whole,
        "{reduce:?} vs {whole}"
    );
    let pair = [&ctx.devices[0], &ctx.devices[0]];
    let alike = reduce_s(&ctx, &pooled_segments(&ctx, &[layout(0), layout(0)]));
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
/// split are exact each for the other fixed, and a local search (a layer or a
/// micro-batch moved, or both together) then stops at a local minimum. Before the
/// moves together, 10,210 random cases in a row found the least, then gaps of 0.95 %,
/// 2.49 % and 3.2 % turned up (the last in [`a_micro_batch_and_a_layer_move_together`]);
/// since, all of 29,180 random cases with a plan found it (2026-11-30). The margin is for a
/// local minimum not seen yet.
const LOCAL_SEARCH_GAP: f64 = 0.01;

/// A 3-device pool at micro-batch size 2 where the least moves a layer and the pool's
/// size together: once 2.49 % short of it, now found.
#[test]
fn a_layer_and_a_pools_size_move_together() {
    let groups = [
        (239.6789178917876, 4.604570232019745, 3),
        (172.92803669059282, 4.278232416842866, 2),
    ];
    let cost = custom_cluster(&groups, 4);
    let found = plan_pooled(&cost, 7, &[1, 2], &[1]).unwrap().unwrap();
    let (best, _) = brute_force(&cost, 7, &[1, 2]).unwrap();
    let step = closed_form_step_s(&mut Ctx::new(&cost), &found.pools).unwrap();
    assert!((step - best).abs() < 1e-12 * best, "{step} vs {best}");
}

/// A micro-batch from the two-device pipeline to the three-device one pays only with a
/// layer moved in the three-device pipeline too ([1, 1, 2] to [1, 2, 1]): neither move
/// alone does. The polish tries them together (the property test found it 3.2 %
/// short of the least before).
#[test]
fn a_micro_batch_and_a_layer_move_together() {
    let groups = [(393.58, 21.84, 3), (394.83, 27.79, 2)];
    let cost = custom_cluster(&groups, 4);
    let found = plan_pooled(&cost, 3, &[1, 2], &[1]).unwrap().unwrap();
    let (best, _) = brute_force(&cost, 3, &[1, 2]).unwrap();
    let step = closed_form_step_s(&mut Ctx::new(&cost), &found.pools).unwrap();
    assert!((step - best).abs() < 1e-12 * best, "{step} vs {best}");
}

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
        let plan = pooled.to_plan(&cost).unwrap();
        prop_assert_eq!(plan.global_batch_size(), g);
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
                    let holding = StageHolding { layers: pool.layers[i], first: i == 0, last: i + 1 == p, in_flight, micro_batch_size: b, optimizer_share: 1.0, recompute: false, loss_in_chunks: group.members.len() == 1 && group.cp == 1 };
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
        let request = request(g, &[1, 2], 1, false);
        let bound = throughput_bound(&mut Ctx::new(&cost), &request).unwrap();
        let fraction = bound.fraction((g * 2048) as f64, pooled.step_time_s);
        prop_assert!(fraction > 0.0 && fraction <= 1.0 + 1e-9, "{}", fraction);
    }
}

proptest! {
    /// A plan is priced the same whichever search produced it: a grid candidate (one
    /// micro-batch size) simulated as a pool of per-replica pipelines takes the step the
    /// grid search predicted, with and without the distributed optimizer.
    #[test]
    fn a_grid_is_priced_alike_as_per_replica_pipelines(
        groups in proptest::collection::vec((10.0f64..400.0, 8.0f64..80.0, 1usize..=3), 2..=3),
        layers in 2usize..=8,
        g in 2usize..=16,
        sharded in any::<bool>(),
    ) {
        let cost = custom_cluster(&groups, layers);
        let request = request(g, &[1], 3, sharded);
        let Ok(outcome) = super::super::plan(&cost, &request) else { return Ok(()) };
        for c in &outcome.plans {
            let variant = c.options.cost(&cost);
            let pool = PoolLayout {
                devices: c.devices.clone(),
                layers: c.layers.clone(),
                micro_batch_size: c.micro_batch_sizes[0],
                micro_batches: c.micro_batches.clone(),
                short: Vec::new(),
            };
            let (pooled, _) = simulate_pools(&mut Ctx::new(&variant), vec![pool], false).unwrap();
            let (grid, pooled_s) = (c.prediction.step_time_s, pooled.step_time_s);
            prop_assert!((grid - pooled_s).abs() <= 1e-9 * grid, "grid {} s, as pools {} s: {:?}", grid, pooled_s, c);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A grid plan split down to the sample keeps its global batch, its stages and its
    /// devices, and is never slower than the grid.
    #[test]
    fn splitting_to_the_sample_keeps_the_batch_and_never_slows_a_plan(
        groups in proptest::collection::vec((10.0f64..400.0, 8.0f64..80.0, 1usize..=3), 2..=3),
        layers in 2usize..=6,
        g in 2usize..=24,
    ) {
        let cost = custom_cluster(&groups, layers);
        let request = request(g, &[1, 2, 4], 1, false);
        let Ok(outcome) = super::super::plan(&cost, &request) else { return Ok(()) };
        let Some(best) = outcome.plans.first() else { return Ok(()) };
        let Some(refined) = super::super::refine::refine_grid(&cost, best, g).unwrap() else {
            return Ok(());
        };
        prop_assert!(refined.step_time_s < best.prediction.step_time_s * (1.0 + 1e-9));
        let plan = refined.to_plan(&cost).unwrap();
        prop_assert_eq!(plan.global_batch_size(), g);
        let grid = best.to_plan(&cost).unwrap();
        for (a, b) in plan.replicas().iter().zip(grid.replicas()) {
            prop_assert_eq!(&a.stages, &b.stages);
        }
        let sorted = |mut v: Vec<usize>| { v.sort_unstable(); v };
        prop_assert_eq!(sorted(refined.rank_devices()), sorted(best.rank_devices().unwrap()));
    }
}

/// Two nodes of two A100s and four of two T4s, each node a group of its own.
fn two_a100_and_four_t4_nodes() -> String {
    let mut toml = String::new();
    for (kind, nodes) in [("a100-80g", 2), ("t4", 4)] {
        for n in 0..nodes {
            toml.push_str(&format!(
                "[[group]]\nkind = \"{kind}\"\ncount = 2\nnode = \"{kind}-{n}\"\n"
            ));
        }
    }
    toml.push_str("[network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n");
    toml
}

/// A cluster file lists a node per group; nodes of one kind and numbers are one pool,
/// so a model no single node holds pipelines over several of them (before, each node
/// was a pool of its own and no plan of per-kind pipelines was found).
#[test]
fn alike_nodes_in_groups_of_their_own_pool_together() {
    let toml = two_a100_and_four_t4_nodes();
    // 1.3B parameters (27 GB of state): two T4s (32 GB) do not hold it.
    let cost = cost(&toml, 24, 2048);
    let classes: Vec<(usize, u64)> = (cost.cluster.devices().iter()).map(|d| d.class()).collect();
    assert_eq!(classes[0], classes[3]);
    assert_eq!(classes[4], classes[11]);
    assert_ne!(classes[0], classes[4]);
    let pooled = plan_pooled(&cost, 64, &[1, 2], &[1])
        .unwrap()
        .expect("a pooled plan");
    let t4_depth = (pooled.pools.iter()).map(|p| p.layers.len()).max().unwrap();
    assert!(t4_depth > 2, "{pooled:?}");
}

/// Each pool of alike devices takes its own tensor-parallel size: large devices hold
/// whole stages alone while small ones split theirs in pairs; the search over sizes per
/// pool is at least as fast as any one size for the whole cluster.
#[test]
fn each_pool_takes_its_own_tensor_parallel_size() {
    let toml = two_a100_and_four_t4_nodes();
    let cost = cost(&toml, 24, 2048);
    let step = |sizes: &[usize]| {
        (plan_pooled(&cost, 64, &[1, 2], sizes).unwrap()).map_or(f64::INFINITY, |c| c.step_time_s)
    };
    let found = plan_pooled(&cost, 64, &[1, 2], &[1, 2]).unwrap().unwrap();
    let tp: Vec<usize> = (found.pools.iter())
        .map(|p| found.groups[p.devices[0][0]].size())
        .collect();
    // Measured: 2.54 s against 2.69 s (TP 1 everywhere) and 2.90 s (TP 2).
    assert_eq!(tp, [1, 2], "{found:?}");
    assert!(found.step_time_s < step(&[1]).min(step(&[2])), "{found:?}");
    let plan = found.to_plan(&cost).unwrap();
    assert_eq!(plan.world_size(), 12);
    assert_eq!(plan.global_batch_size(), 64);
}

/// Two large devices and two of 2.7 GB, a sequence of 32768 tokens, recomputation
/// where needed: per-replica plans without context parallelism pay for recomputation
/// or pipelines; with it, one pool's devices split sequences in pairs while the other
/// pool's do not (each pool its own unit), faster, and the plan writes that replica's
/// stage with `cp`.
#[test]
fn one_pool_splits_sequences_beside_one_that_does_not() {
    let toml = "[[group]]\nkind = \"a100-80g\"\ncount = 2\nnode = \"a\"\n\
                [[group]]\nkind = \"a10\"\ncount = 2\nnode = \"b\"\nmemory_gb = 2.7\n";
    let mut cost = super::super::tests::long_sequence(toml, 1000);
    cost.recompute = crate::cost::Recompute::WhereNeeded;
    let (without, bound) = plan_pooled_noting_memory(&cost, 8, &[1], (&[1], &[]), None).unwrap();
    let without = without.expect("a plan without context parallelism");
    assert!(bound);
    let (found, _) = plan_pooled_noting_memory(&cost, 8, &[1], (&[1], &[2]), None).unwrap();
    let found = found.expect("a per-replica plan");
    let mut units: Vec<(usize, usize)> = (found.pools.iter())
        .map(|p| &found.groups[p.devices[0][0]])
        .map(|g| (g.tp_size(), g.cp))
        .collect();
    units.sort_unstable();
    assert_eq!(units, [(1, 1), (1, 2)], "{found:?}");
    // 0.558 s against 0.603 s.
    assert!(
        found.step_time_s < without.step_time_s,
        "{found:?}\n{without:?}"
    );
    let plan = found.to_plan(&cost).unwrap();
    let cp: Vec<usize> = plan.replicas().iter().map(|r| r.cp_size(0)).collect();
    assert_eq!(cp.iter().filter(|&&c| c == 2).count(), 1, "{plan:?}");
    assert_eq!(plan.world_size(), 4);
    assert_eq!(plan.check(&cost.model, false), Ok(()));
}
