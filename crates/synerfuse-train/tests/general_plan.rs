//! Random general plans (each replica its own pipeline, some interleaved), checked the
//! way the trainer runs them: every parameter of every rank's real stage chunks is
//! reduced by exactly the ranks that hold it, every sample of the global batch is used
//! once, and every replica's schedule runs without deadlock.

use proptest::prelude::*;
use std::collections::BTreeMap;
use synerfuse_model::tch::Device;
use synerfuse_model::{LlamaConfig, Stage};
use synerfuse_plan::{
    check_forward_only, check_schedule, forward_only, Plan, ReplicaBatch, ReplicaPipeline,
    ScheduleKind, StageLayout,
};
use synerfuse_train::grads::reduction_of;
use synerfuse_train::loader::replica_sample_ranges;

fn tiny(num_layers: usize, tie_word_embeddings: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 8,
        hidden_size: 4,
        intermediate_size: 8,
        num_layers,
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 4,
        max_position_embeddings: 8,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings,
        attention_bias: false,
        mlp_bias: false,
        init_std: 0.02,
        moe: None,
    }
}

/// One replica: (chunks, cut points, micro-batch size, micro-batch count factor, samples
/// the last micro-batch lacks).
type ReplicaDraw = (usize, Vec<prop::sample::Index>, usize, usize, usize);

/// A replica of `layers` layers cut into `stages × chunks` non-empty pieces at `cuts`.
fn replica(layers: usize, draw: &ReplicaDraw, first_rank: usize) -> ReplicaPipeline {
    let (chunks, cuts, mbs, factor, short) = draw;
    let mut points: Vec<usize> = cuts.iter().map(|i| 1 + i.index(layers - 1)).collect();
    points.sort_unstable();
    points.dedup();
    let bounds: Vec<usize> = std::iter::once(0)
        .chain(points)
        .chain(std::iter::once(layers))
        .collect();
    let pieces: Vec<usize> = bounds.windows(2).map(|w| w[1] - w[0]).collect();
    // Interleave only when the pieces split evenly into at least two stages.
    let chunks = if *chunks > 1 && pieces.len() % chunks == 0 && pieces.len() / chunks >= 2 {
        *chunks
    } else {
        1
    };
    let stages = pieces.len() / chunks;
    let num_micro_batches = if chunks > 1 { stages * factor } else { *factor };
    ReplicaPipeline::single_ranks(
        StageLayout::interleaved(pieces, stages, layers).unwrap(),
        ReplicaBatch::from_samples(num_micro_batches * mbs - (*short).min(mbs - 1), *mbs),
        (first_rank..first_rank + stages).collect(),
        Vec::new(),
    )
}

fn plan(layers: usize, draws: &[ReplicaDraw]) -> Plan {
    let mut next = 0;
    let replicas = draws
        .iter()
        .map(|d| {
            let r = replica(layers, d, next);
            next += r.stages.num_stages();
            r
        })
        .collect();
    Plan::new(replicas).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_parameter_is_reduced_by_its_holders_and_every_sample_used_once(
        layers in 2usize..7,
        tied in any::<bool>(),
        draws in prop::collection::vec(
            (1usize..3, prop::collection::vec(any::<prop::sample::Index>(), 0..4), 1usize..4, 1usize..3, 0usize..3),
            1..4,
        ),
        consumed in 0u64..100,
    ) {
        let plan = plan(layers, &draws);
        let config = tiny(layers, tied);
        let reductions = plan.gradient_reductions(tied);
        // parameter name → (holding ranks, members of the reduction each holder uses).
        let mut holders: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let mut used: BTreeMap<String, Vec<Vec<usize>>> = BTreeMap::new();
        for rank in 0..plan.world_size() {
            let (r, stage) = plan.position(rank).unwrap();
            let stages = &plan.replicas()[r].stages;
            let mine: Vec<_> = reductions.iter().filter(|g| g.members.contains(&rank)).cloned().collect();
            let pieces = plan.chunk_pieces(rank);
            prop_assert_eq!(pieces.len(), stages.num_chunks());
            for (chunk, chunk_pieces) in pieces.iter().enumerate() {
                let layer_range = stages.chunk_range(stage, chunk).unwrap();
                let built = Stage::new(&config, layer_range, Device::Cpu).unwrap();
                for (name, _) in built.var_store().variables() {
                    let index = reduction_of(&name, chunk_pieces, layers, &mine);
                    prop_assert!(index.is_some(), "rank {} chunk {}: {} unreduced", rank, chunk, name);
                    let members = mine[index.unwrap()].members.clone();
                    holders.entry(name.clone()).or_default().push(rank);
                    used.entry(name).or_default().push(members);
                }
            }
        }
        for (name, ranks) in &holders {
            let mut ranks = ranks.clone();
            ranks.sort_unstable();
            let before = ranks.len();
            ranks.dedup();
            prop_assert_eq!(before, ranks.len(), "{} held twice by one rank", name);
            for members in &used[name] {
                prop_assert_eq!(members, &ranks, "{}: reduced over other ranks than its holders", name);
            }
        }
        // Every sample of the step exactly once, whatever the replicas' shapes.
        let batches = plan.batches();
        let mut samples: Vec<u64> = (0..batches.dp_size())
            .flat_map(|r| replica_sample_ranges(&batches, r, consumed).unwrap())
            .flatten()
            .collect();
        samples.sort_unstable();
        let expected: Vec<u64> = (consumed..consumed + batches.global_batch_size() as u64).collect();
        prop_assert_eq!(samples, expected);
        // Each replica's schedule runs to the end (no deadlock, every message received),
        // and so does its forward-only (evaluation) program.
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::Interleaved] {
            let kind = if plan.has_chunks() { ScheduleKind::Interleaved } else { kind };
            let programs = plan.schedule(kind).unwrap();
            check_schedule(&programs).unwrap();
            let forward: Vec<_> = programs.iter().map(|p| forward_only(p)).collect();
            check_forward_only(&forward).unwrap();
        }
    }
}
