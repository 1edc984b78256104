//! The planner writes the same plans for the same inputs as before it was moved into
//! this crate: a guard while the house is rearranged. With the reductions after the
//! pipeline (`--no-overlap-grad-reduce`) it still writes what it wrote before it priced
//! buckets overlapping the last backward (`same_plans_no_overlap`, never re-blessed:
//! the old pricing, bit for bit); with the runtime's default, `same_plans`.

use synerfuse_plan::{ExpertShape, ModelShape};
use synerfuse_planner::cluster::ClusterSpec;
use synerfuse_planner::cost::CostModel;
use synerfuse_planner::planner::{plan, Choice, PlanRequest};

/// The cases: clusters of one, two and three kinds of device, dense and mixture-of-experts
/// models, long sequences where context parallelism is searched.
fn cases() -> Vec<(&'static str, &'static str, ModelShape, PlanRequest)> {
    let llama7b = ModelShape {
        num_layers: 32,
        hidden_size: 4096,
        num_heads: 32,
        num_kv_heads: 32,
        ffn_hidden_size: 11008,
        vocab_size: 32000,
        seq_length: 4096,
        tied: false,
        experts: None,
    };
    let small = ModelShape {
        num_layers: 24,
        hidden_size: 2048,
        num_heads: 16,
        num_kv_heads: 4,
        ffn_hidden_size: 5632,
        vocab_size: 32000,
        seq_length: 2048,
        tied: true,
        experts: None,
    };
    let moe = ModelShape {
        num_layers: 16,
        hidden_size: 2048,
        num_heads: 16,
        num_kv_heads: 8,
        ffn_hidden_size: 5632,
        vocab_size: 32000,
        seq_length: 2048,
        tied: false,
        experts: Some(ExpertShape {
            num_experts: 8,
            top_k: 2,
            ffn_hidden_size: 2816,
            layer_freq: 1,
        }),
    };
    let long = ModelShape {
        seq_length: 32768,
        ..small.clone()
    };
    let request = |g: usize, tp: Vec<usize>, cp: Vec<usize>, ep: Vec<usize>| PlanRequest {
        global_batch_size: g,
        micro_batch_sizes: vec![1, 2],
        top_k: 3,
        tensor_parallel_sizes: tp,
        context_parallel_sizes: cp,
        recompute: Choice::Auto,
        distributed_optimizer: Choice::Auto,
        expert_parallel_sizes: ep,
    };
    vec![
        (
            "a100_v100_llama7b",
            "[[group]]\nkind = \"a100-80g\"\ncount = 8\nnode = \"n0\"\n\
             [[group]]\nkind = \"v100\"\ncount = 8\nnode = \"n1\"\n\
             [network]\nintra_node_gbs = 300\ninter_node_gbs = 25\n",
            llama7b,
            request(512, vec![1, 2, 4, 8], vec![2, 4, 8], Vec::new()),
        ),
        (
            "h100_a100_t4_small",
            "[[group]]\nkind = \"h100-sxm\"\ncount = 4\nnode = \"n0\"\n\
             [[group]]\nkind = \"a100-40g\"\ncount = 4\nnode = \"n1\"\n\
             [[group]]\nkind = \"t4\"\ncount = 2\nnode = \"n2\"\n\
             [network]\nintra_node_gbs = 200\ninter_node_gbs = 12.5\n",
            small.clone(),
            request(96, vec![1, 2, 4], Vec::new(), Vec::new()),
        ),
        (
            "a100_a10_moe",
            "[[group]]\nkind = \"a100-40g\"\ncount = 4\nnode = \"n0\"\n\
             [[group]]\nkind = \"a10\"\ncount = 4\nnode = \"n1\"\n\
             [network]\nintra_node_gbs = 100\ninter_node_gbs = 12.5\n",
            moe,
            request(64, vec![1, 2], Vec::new(), vec![1, 2, 4]),
        ),
        (
            "a10_long_sequence",
            "[[group]]\nkind = \"a10\"\ncount = 8\nnode = \"n0\"\n\
             [network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n",
            long,
            request(16, vec![1, 2], vec![2, 4, 8], Vec::new()),
        ),
    ]
}

/// What `synerfuse plan` would write for one case: the best grid plan's file, the
/// per-replica plan's where it wins, and their predicted steps.
fn written(cluster: &str, model: ModelShape, request: &PlanRequest, overlap: bool) -> String {
    let cost = CostModel {
        overlap_grad_reduce: overlap,
        ..CostModel::new(model, ClusterSpec::from_toml(cluster).unwrap(), None)
    };
    let outcome = plan(&cost, request).unwrap();
    let best = &outcome.plans[0];
    let mut text = format!(
        "# best grid plan: {:.9e} s per step\n{}",
        best.prediction.step_time_s,
        best.to_plan(&cost).unwrap().to_toml().unwrap()
    );
    if let Some(pooled) = outcome.pooled_wins() {
        text += &format!(
            "\n# per-replica plan: {:.9e} s per step\n{}",
            pooled.step_time_s,
            pooled.to_plan(&cost).unwrap().to_toml().unwrap()
        );
    }
    text
}

/// The planner, moved between crates and modules, writes the plans it wrote before the
/// move (fixtures from the last commit before it; `SYNERFUSE_BLESS=1` writes them anew).
/// Blessed once since, when the distributed optimizer's reduction was priced as the
/// runtime runs it (a reduce-scatter, then the parameters gathered in their dtype):
/// the same layouts, their step times only.
#[test]
fn the_same_inputs_give_the_same_plans() {
    same_plans(
        "same_plans",
        true,
        std::env::var_os("SYNERFUSE_BLESS").is_some(),
    );
}

/// Without overlap the planner prices as it did before it priced buckets: the fixtures
/// it wrote then, blessed anew only for the distributed optimizer's reduce-scatter and
/// gather (the same layouts, their step times only).
#[test]
fn without_overlap_the_same_inputs_give_the_plans_of_the_reduction_after_the_pipeline() {
    same_plans("same_plans_no_overlap", false, false);
}

/// Each case against its fixture in `fixtures/{dir}` (written instead when `bless`).
fn same_plans(dir: &str, overlap: bool, bless: bool) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(dir);
    for (name, cluster, model, request) in cases() {
        let text = written(cluster, model, &request, overlap);
        let path = dir.join(format!("{name}.toml"));
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let expected =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            text,
            expected,
            "{name}: the plan written differs from {}",
            path.display()
        );
    }
}
