//! The cost model's tests: Megatron's FLOPs, memory and communication prices.

use super::*;
use synerfuse_plan::{ExpertShape, MeasuredCosts};

/// A 1.1B LLaMA (TinyLlama's shape, the GPU check's): grouped-query attention, an untied
/// output layer, 2048-token sequences.
fn llama_1b() -> ModelShape {
    ModelShape {
        num_layers: 22,
        hidden_size: 2048,
        num_heads: 32,
        num_kv_heads: 4,
        ffn_hidden_size: 5632,
        vocab_size: 32000,
        seq_length: 2048,
        tied: false,
        experts: None,
    }
}

/// A small multi-head model with a tied output layer.
fn small_tied() -> ModelShape {
    ModelShape {
        num_layers: 4,
        hidden_size: 256,
        num_heads: 8,
        num_kv_heads: 8,
        ffn_hidden_size: 688,
        vocab_size: 2048,
        seq_length: 128,
        tied: true,
        experts: None,
    }
}

/// Megatron's `num_floating_point_operations`, evaluated by its own Python for these
/// shapes: a 1.1B LLaMA with grouped-query attention and an untied output layer,
/// and a small multi-head model with a tied one.
#[test]
fn megatron_flops_match_megatrons_formula() {
    let gqa_untied = llama_1b();
    let mha_tied = small_tied();
    for (shape, kv_channels, batch, megatron) in [
        (&gqa_untied, 64, 1.0, 14978698444800.0),
        (&gqa_untied, 64, 8.0, 119829587558400.0),
        (&mha_tied, 32, 1.0, 3032481792.0),
        (&mha_tied, 32, 6.0, 18194890752.0),
    ] {
        let ours = shape.megatron_flops_per_sample(kv_channels) * batch;
        assert!(
            ((ours - megatron) / megatron).abs() < 1e-12,
            "{ours} vs Megatron's {megatron}"
        );
    }
}

/// With experts: Megatron's count takes each MoE layer's top-k experts' width (so a
/// top-2 model of half-width experts counts as the dense one), the parameters all
/// experts and their routers; dense layers between MoE ones count as dense.
#[test]
fn experts_count_their_active_width_in_flops_and_all_in_parameters() {
    let dense = small_tied();
    let experts = |top_k, layer_freq| ModelShape {
        experts: Some(ExpertShape {
            num_experts: 8,
            top_k,
            ffn_hidden_size: 344,
            layer_freq,
        }),
        ..dense.clone()
    };
    let flops = |m: &ModelShape| m.megatron_flops_per_sample(32);
    assert_eq!(flops(&experts(2, 1)), flops(&dense));
    assert_eq!(
        experts(2, 1).layer_forward_flops(3),
        dense.layer_forward_flops(3)
    );
    // Top 1 in layers 0 and 2: those MLPs at half width, 1 and 3 dense.
    let half_mlp = 12.0 * 128.0 * 4.0 * 256.0 * 256.0 * (344.0 * 2.0 * 1.5) / (4.0 * 256.0);
    assert!((flops(&dense) - flops(&experts(1, 2)) - half_mlp).abs() < 1.0);
    let (h, f) = (256.0, 344.0);
    let added = 4.0 * (8.0 * 3.0 * h * f + 8.0 * h) - 4.0 * 3.0 * h * 688.0;
    let diff = experts(2, 1).stage_params(4, false, false) - dense.stage_params(4, false, false);
    assert!((diff - added).abs() < 1e-6, "{diff} vs {added}");
    assert_eq!(
        ExpertShape {
            layer_freq: 3,
            ..experts(1, 3).experts.unwrap()
        }
        .moe_layers(4),
        2
    );
}

/// A profile of `kind` at `sizes`, each layer's forward a fixed 1 s plus 1 s per
/// sample (the rest zero).
fn affine_profile(sizes: &[usize]) -> Profile {
    let at = |b: usize| MeasuredCosts {
        layer_fwd_s: 1.0 + b as f64,
        layer_bwd_s: 0.0,
        embedding_s: 0.0,
        head_s: 0.0,
        layer_activation_bytes: 0.0,
        optimizer_s_per_param: None,
    };
    Profile {
        model: ModelShape {
            num_layers: 1,
            hidden_size: 8,
            num_heads: 1,
            num_kv_heads: 1,
            ffn_hidden_size: 8,
            vocab_size: 8,
            seq_length: 8,
            tied: false,
            experts: None,
        },
        devices: BTreeMap::from([("k".to_owned(), sizes.iter().map(|&b| (b, at(b))).collect())]),
        network: None,
        calibration: None,
    }
}

/// An unmeasured size is interpolated between the measured sizes around it (its
/// fixed cost kept), extrapolated within bounds beyond them, and scaled in
/// proportion where only one size was measured.
#[test]
fn unmeasured_sizes_keep_the_fixed_cost_of_a_micro_batch() {
    let forward = |profile: &Profile, b| profile.costs("k", b).unwrap().layer_fwd_s;
    let two = affine_profile(&[2, 4]);
    for (b, want) in [(2, 3.0), (3, 4.0), (4, 5.0), (1, 2.0), (8, 9.0)] {
        assert!((forward(&two, b) - want).abs() < 1e-12, "size {b}");
    }
    // Bounds beyond the measured sizes: no cheaper than the nearest micro-batch,
    // no dearer per sample (a decreasing pair would give 2 s at size 8).
    let with_forward = |size: usize, seconds: f64| {
        let mut profile = affine_profile(&[2, 4]);
        let costs = profile.devices.get_mut("k").and_then(|t| t.get_mut(&size));
        costs.unwrap().layer_fwd_s = seconds;
        profile
    };
    assert!((forward(&with_forward(4, 2.5), 8) - 2.5).abs() < 1e-12);
    assert!((forward(&with_forward(2, 0.1), 1) - 0.05).abs() < 1e-12);
    let one = affine_profile(&[4]);
    assert!((forward(&one, 2) - 2.5).abs() < 1e-12);
    assert!(one.costs("other", 2).is_none());
}

/// A last stage alone on its device holds a chunk of the logits, not all of them: the
/// memory model prices the two loss forms apart, and a recomputing stage (whose loss
/// runs on the whole logits) alike either way.
#[test]
fn a_chunked_loss_holds_a_chunk_of_the_logits() {
    let model = llama_1b();
    let cluster = crate::cluster::ClusterSpec::from_toml(
        "[[group]]\nkind = \"h100-sxm\"\ncount = 1\n[network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n",
    )
        .unwrap();
    let cost = CostModel::new(model, cluster, None);
    let k = cost.stage_costs(&cost.cluster.devices()[0], 16).unwrap();
    let holding = |loss_in_chunks, recompute| StageHolding {
        layers: 22,
        first: true,
        last: true,
        in_flight: 1,
        micro_batch_size: 16,
        optimizer_share: 1.0,
        recompute,
        loss_in_chunks,
    };
    let bytes = |chunks, recompute| cost.memory_bytes(&k, &holding(chunks, recompute));
    // 32768 tokens: the whole logits' (2 + 12) bytes each, against a chunk of 4 x 2048
    // numbers per token at (2 + 8), the head's gradient in fp32 and bf16 and the hidden
    // states' gradient.
    let (t, h, v) = (32768.0, 2048.0, 32000.0);
    let whole = t * v * 14.0;
    let chunked = 4.0 * t * h * 10.0 + v * h * 6.0 + t * h * 2.0;
    let saved = bytes(false, false) - bytes(true, false);
    assert!(
        (saved - (whole - chunked)).abs() < 1.0,
        "{saved} vs {}",
        whole - chunked
    );
    assert_eq!(bytes(true, true), bytes(false, true));
}
