//! Large clusters folded: a cluster of many alike nodes is `factor` copies of a smaller
//! one (each kind of node `factor` times as often, the same links). The per-replica
//! searches choose their shapes (tensor-parallel size, depth, micro-batch size per
//! pool; which expert layout) on one copy with the global batch divided alike, and lay
//! out only those shapes on the whole cluster, priced and simulated there: the search
//! then costs what the kinds cost, the layout what the devices do.

use super::{
    error::PlanningError,
    expert::best_expert,
    grid::retime_front,
    outcome::{ExpertLayout, PooledCandidate},
    request::{micro_batch_sizes, PlanRequest},
    search::{plan_pooled_options, search_grids, variants},
    shapes::{GridShape, PoolShape, PooledShape},
};
use crate::cluster::ClusterSpec;
use crate::cost::CostModel;
use std::collections::{HashMap, HashSet};

/// Clusters of at most this many devices are searched whole.
pub const FOLD_ABOVE: usize = 4096;

/// One copy of a folded cluster, and the request scaled to it.
pub(super) struct Fold {
    /// Copies in the whole cluster.
    pub(super) factor: usize,
    /// The model on one copy.
    pub(super) cost: CostModel,
    /// The request with the global batch divided by `factor`.
    pub(super) request: PlanRequest,
}

/// The largest fold of `cost`'s cluster that keeps every choice the search makes: the
/// same depths divide each pool and the whole cluster (at every tensor-parallel size),
/// the same micro-batch sizes divide the batch; `None` for clusters of at most `above`
/// devices, with named links or sites, or with no such fold.
pub(super) fn fold(cost: &CostModel, request: &PlanRequest, above: usize) -> Option<Fold> {
    let cluster = &cost.cluster;
    let n: usize = cluster.group.iter().map(|g| g.count).sum();
    if n <= above
        || !cluster.network.link.is_empty()
        || cluster.group.iter().any(|g| g.site.is_some())
    {
        return None;
    }
    let nodes = node_kinds(cluster);
    let g = request.global_batch_size;
    let common = nodes.iter().fold(g, |a, kind| gcd(a, kind.len()));
    let mut pools: HashMap<(usize, u64), usize> = HashMap::new();
    for d in cluster.devices() {
        *pools.entry(d.class()).or_default() += 1;
    }
    let mut counts: Vec<usize> = pools.into_values().collect();
    counts.push(n);
    let factor = (2..=common)
        .rev()
        .filter(|f| common % f == 0)
        .find(|&f| keeps_choices(cost, request, &counts, f))?;
    // The first 1/factor of each kind's nodes, their groups in the cluster's order.
    let mut kept: Vec<usize> = (nodes.iter())
        .flat_map(|kind| kind[..kind.len() / factor].iter().flatten().copied())
        .collect();
    kept.sort_unstable();
    let folded = ClusterSpec {
        group: (kept.iter()).map(|&i| cluster.group[i].clone()).collect(),
        ..cluster.clone()
    };
    Some(Fold {
        factor,
        cost: CostModel {
            cluster: folded,
            ..cost.clone()
        },
        request: PlanRequest {
            global_batch_size: g / factor,
            ..request.clone()
        },
    })
}

/// The cluster's nodes (each its groups' indices) by kind of node: the kinds, numbers
/// and counts of its groups in order.
fn node_kinds(cluster: &ClusterSpec) -> Vec<Vec<Vec<usize>>> {
    let mut nodes: Vec<(String, Vec<usize>)> = Vec::new();
    let mut node_of: HashMap<String, usize> = HashMap::new();
    for (i, g) in cluster.group.iter().enumerate() {
        let name = g.node.clone().unwrap_or_else(|| format!("group{i}"));
        let at = *node_of.entry(name.clone()).or_insert_with(|| {
            nodes.push((name, Vec::new()));
            nodes.len() - 1
        });
        nodes[at].1.push(i);
    }
    type GroupKey = (String, usize, [Option<u64>; 7]);
    let key = |i: usize| -> GroupKey {
        let g = &cluster.group[i];
        (g.kind.clone(), g.count, g.numbers())
    };
    let mut kinds: Vec<Vec<Vec<usize>>> = Vec::new();
    let mut kind_of: HashMap<Vec<GroupKey>, usize> = HashMap::new();
    for (_, groups) in nodes {
        let k = *kind_of
            .entry(groups.iter().map(|&i| key(i)).collect())
            .or_insert_with(|| {
                kinds.push(Vec::new());
                kinds.len() - 1
            });
        kinds[k].push(groups);
    }
    kinds
}

/// Whether folding by `f` keeps the depths that divide each of `counts` (the whole
/// cluster, each pool of alike devices; as devices and as groups of each
/// tensor-parallel size), and the micro-batch sizes that divide the batch.
fn keeps_choices(cost: &CostModel, request: &PlanRequest, counts: &[usize], f: usize) -> bool {
    let l = cost.model.num_layers;
    let g = request.global_batch_size;
    let sizes_kept =
        (micro_batch_sizes(request).iter()).all(|&b| (g % b == 0) == ((g / f) % b == 0));
    let mut tp = request.tp_sizes();
    tp.push(1);
    let depths_kept = |x: usize| {
        (tp.iter()).filter(|&&t| x % t == 0).all(|&t| {
            let units = x / t;
            units % f == 0 && (1..=l.min(units)).all(|p| (units % p == 0) == ((units / f) % p == 0))
        })
    };
    sizes_kept && counts.iter().all(|&x| depths_kept(x))
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

/// The per-replica search and the expert's layouts of `fold`'s copy, each laid out on
/// the whole cluster (searched whole where the copy has none, or its choice does not
/// lay out on the whole: a fold prices sharded state over fewer holders, and the
/// expert's depth by it).
pub(super) fn per_replica_plans(
    cost: &CostModel,
    request: &PlanRequest,
    fold: &Fold,
) -> Result<(Option<PooledCandidate>, Option<ExpertLayout>), PlanningError> {
    let pooled = match plan_pooled_options(&fold.cost, &fold.request, None)? {
        Some(c) => {
            let shape = PooledShape {
                recompute: c.options.recompute,
                expert_parallel: c.options.expert_parallel,
                pools: PoolShape::of(&c),
            };
            plan_pooled_options(cost, request, Some(&shape))?
        }
        None => None,
    };
    let pooled = match pooled {
        Some(found) => Some(found),
        None => plan_pooled_options(cost, request, None)?,
    };
    let expert = match best_expert(&fold.cost, &fold.request, None)? {
        Some(e) => best_expert(cost, request, Some(&e))?,
        None => None,
    };
    let expert = match expert {
        Some(found) => Some(found),
        None => best_expert(cost, request, None)?,
    };
    Ok((pooled, expert))
}

/// The grids of the best plans on `fold`'s copy (re-timed by simulation, as the whole
/// cluster's are) and of its best even layout; `None` (search every grid) where the
/// copy has none.
pub(super) fn grid_shapes(fold: &Fold) -> Result<Option<HashSet<GridShape>>, PlanningError> {
    let variants = variants(&fold.cost, &fold.request);
    let found = search_grids(&fold.cost, &variants, &fold.request, None)?;
    if found.candidates.is_empty() {
        return Ok(None);
    }
    let keep = fold.request.top_k.max(1);
    let (plans, uniform) = retime_front(&variants, found.candidates, keep)?;
    Ok(Some(
        (plans.iter().chain(uniform.first()))
            .map(|c| GridShape {
                recompute: c.options.recompute,
                tensor_parallel_size: c.tensor_parallel_size(),
                stages: c.layers.len(),
                arrangement: c.arrangement,
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{choose::plan_folding_above, PlanOutcome};
    use synerfuse_plan::ModelShape;

    /// `nodes` nodes of 8 of each of `kinds` (one group per node), a 1.1B model of
    /// `layers` layers.
    fn nodes(kinds: &[&str], nodes: usize, layers: usize, links: &str) -> CostModel {
        let mut toml = String::new();
        for kind in kinds {
            for i in 0..nodes {
                toml.push_str(&format!(
                    "[[group]]\nkind = \"{kind}\"\ncount = 8\nnode = \"{kind}-{i}\"\n"
                ));
            }
        }
        toml.push_str("[network]\nintra_node_gbs = 200\ninter_node_gbs = 25\n");
        toml.push_str(links);
        let model = ModelShape {
            num_layers: layers,
            hidden_size: 2048,
            num_heads: 16,
            num_kv_heads: 16,
            ffn_hidden_size: 5632,
            vocab_size: 32_000,
            seq_length: 2048,
            tied: false,
            experts: None,
        };
        CostModel::new(model, ClusterSpec::from_toml(&toml).unwrap(), None)
    }

    fn request(g: usize, tp: &[usize]) -> PlanRequest {
        PlanRequest {
            global_batch_size: g,
            micro_batch_sizes: vec![1, 2, 4],
            top_k: 3,
            tensor_parallel_sizes: tp.to_vec(),
            context_parallel_sizes: Vec::new(),
            recompute: Default::default(),
            distributed_optimizer: Default::default(),
            expert_parallel_sizes: Vec::new(),
        }
    }

    /// 16 nodes of each of 4 kinds, 24 layers: a pool of 128 devices takes depths 1, 2,
    /// 4, 8 and 16, which 16 devices still do (8 do not): 8 copies of 2 nodes per kind.
    #[test]
    fn alike_copies_fold_by_the_largest_factor_that_keeps_every_choice() {
        let cost = nodes(&["h100-sxm", "a100-80g", "l40s", "a10"], 16, 24, "");
        let copy = fold(&cost, &request(512, &[1]), 0).expect("a fold");
        assert_eq!(copy.factor, 8);
        assert_eq!(copy.request.global_batch_size, 64);
        let devices = copy.cost.cluster.devices();
        assert_eq!(devices.len(), 64);
        for kind in ["h100-sxm", "a100-80g", "l40s", "a10"] {
            let nodes: HashSet<&str> = (devices.iter())
                .filter(|d| d.kind == kind)
                .map(|d| d.node.as_str())
                .collect();
            assert_eq!(
                nodes,
                HashSet::from([&*format!("{kind}-0"), &*format!("{kind}-1")])
            );
        }
        // Groups of 8 leave 16 per kind, of depths 1 to 16: no copy keeps them all.
        assert!(fold(&cost, &request(512, &[1, 8]), 0).is_none());
        // Nor one whose batch no longer divides by a size that divides the whole's: 80
        // samples fold by 4 (20 take sizes 1, 2 and 4), not by 8 (10 do not take 4).
        let copy = fold(&cost, &request(96, &[1]), 0).expect("a fold");
        assert_eq!((copy.factor, copy.request.global_batch_size), (8, 12));
        let copy = fold(&cost, &request(80, &[1]), 0).expect("a fold");
        assert_eq!((copy.factor, copy.request.global_batch_size), (4, 20));
    }

    #[test]
    fn small_clusters_and_named_links_are_searched_whole() {
        let cost = nodes(&["h100-sxm", "a10"], 16, 24, "");
        assert!(fold(&cost, &request(256, &[1]), 0).is_some());
        assert!(fold(&cost, &request(256, &[1]), 256).is_none());
        let link = "[[network.link]]\na = \"a10-0\"\nb = \"a10-1\"\ngbs = 5\n";
        let linked = nodes(&["h100-sxm", "a10"], 16, 24, link);
        assert!(fold(&linked, &request(256, &[1]), 0).is_none());
    }

    /// The step of the plan `synerfuse plan` writes.
    fn written_step_s(o: &PlanOutcome) -> f64 {
        match o.pooled_wins() {
            Some(p) => p.step_time_s,
            None => o.plans[0].prediction.step_time_s,
        }
    }

    /// On copies of a small cluster the folded search writes what the whole search
    /// does (the shapes chosen on one copy, laid out on all of them).
    #[test]
    fn folded_plans_match_the_whole_search() {
        for (kinds, g, tp) in [
            (&["h100-sxm", "a10"][..], 256, &[1, 2][..]),
            (&["a100-80g", "l40s", "a10"][..], 384, &[1][..]),
        ] {
            let cost = nodes(kinds, 8, 24, "");
            let request = request(g, tp);
            let folded = plan_folding_above(&cost, &request, 0).unwrap();
            let whole = plan_folding_above(&cost, &request, usize::MAX).unwrap();
            assert!(folded.folded > 1);
            assert_eq!(whole.folded, 1);
            let (f, w) = (written_step_s(&folded), written_step_s(&whole));
            eprintln!("{kinds:?}: folded by {} {f} s, whole {w} s", folded.folded);
            assert!(f <= w * 1.001, "{kinds:?}: folded {f} s, whole {w} s");
        }
    }
}
