//! Properties of the GPT indices for any dataset, split, length and seed: samples tile the
//! token stream, every index is in range, the shuffles are permutations, and every sample
//! reads exactly `S + X` tokens.

use proptest::prelude::*;
use synerfuse_data::gpt::{build_gpt_indices, sample_tokens, GptIndexConfig, SampleOptions};
use synerfuse_data::{DType, IndexedDataset, IndexedDatasetBuilder};

fn config_strategy() -> impl Strategy<Value = (Vec<i32>, GptIndexConfig)> {
    (
        prop::collection::vec(0i32..30, 1..25),
        1usize..12,
        any::<u32>(),
        prop::option::of(0u64..120),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_filter_map(
            "split needs more tokens than the extra one",
            |(sizes, s, seed, n, x, drop)| {
                let total: i32 = sizes.iter().sum();
                (total > i32::from(x)).then_some((
                    sizes,
                    GptIndexConfig {
                        sequence_length: s,
                        seed,
                        num_samples: n,
                        add_extra_token: x,
                        drop_last: drop,
                    },
                ))
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn indices_tile_the_stream_and_stay_in_range((sizes, config) in config_strategy()) {
        let split: Vec<i32> = (0..sizes.len() as i32).collect();
        let ix = build_gpt_indices(&sizes, &split, &config).unwrap();
        let (s, x) = (config.sequence_length as i64, i64::from(config.add_extra_token));
        let t: i64 = sizes.iter().map(|&v| i64::from(v)).sum();

        // Document index: E copies of the split, each epoch (or the shuffled runs) a permutation.
        let mut counts = vec![0usize; sizes.len()];
        for &d in ix.document_index.iter() {
            counts[d as usize] += 1;
        }
        prop_assert!(counts.iter().all(|&c| c == ix.num_epochs));

        // Sample index: in range, and consecutive starts S tokens apart in the stream.
        let starts: Vec<i64> = ix.document_index.iter().scan(0i64, |acc, &d| {
            let start = *acc;
            *acc += i64::from(sizes[d as usize]);
            Some(start)
        }).collect();
        let m = ix.sample_index.len() - 1;
        for (j, row) in ix.sample_index.iter().enumerate() {
            let [di, off] = *row;
            prop_assert!(di >= 0 && (di as usize) < ix.document_index.len(), "row {j}: {row:?}");
            let size = i64::from(sizes[ix.document_index[di as usize] as usize]);
            // Megatron's kept last partial sample ends at `size - X` of the last document,
            // -1 when that document is empty; helpers.cpp stores it as is, and so do we.
            let quirk = !config.drop_last && j == m && off == size - x;
            prop_assert!(quirk || (off >= 0 && off <= size), "row {j}: {row:?} in a document of {size}");
        }
        let global = |row: [i64; 2]| starts[row[0] as usize] + row[1];
        for (j, pair) in ix.sample_index.windows(2).enumerate() {
            let step = global(pair[1]) - global(pair[0]);
            let last_partial = !config.drop_last && j + 1 == m;
            if !last_partial {
                prop_assert_eq!(step, s, "sample {}", j);
            } else {
                prop_assert!(step <= s && step >= 0);
            }
        }
        if config.drop_last {
            prop_assert!(global(ix.sample_index[m]) + x <= t * ix.num_epochs as i64);
        }
        if let Some(n) = config.num_samples {
            prop_assert!(m as u64 >= n, "{m} samples for {n} requested");
        }

        // Shuffle index: a permutation of the samples.
        let mut order: Vec<usize> = (0..ix.shuffle_index.len()).map(|i| ix.shuffle_index.get(i).unwrap()).collect();
        order.sort_unstable();
        prop_assert_eq!(order, (0..m).collect::<Vec<_>>());
    }

    #[test]
    fn every_sample_reads_s_plus_x_tokens((sizes, config) in config_strategy()) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("d");
        let mut builder = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
        for (k, &len) in sizes.iter().enumerate() {
            let ids: Vec<u32> = (0..len as u32).map(|i| 100 * k as u32 + i).collect();
            builder.add_document(&ids, &[ids.len()]).unwrap();
        }
        builder.finalize().unwrap();
        let ds = IndexedDataset::open(&prefix).unwrap();
        let split: Vec<i32> = (0..sizes.len() as i32).collect();
        let ix = build_gpt_indices(&sizes, &split, &config).unwrap();
        let options = SampleOptions {
            sequence_length: config.sequence_length,
            add_extra_token: config.add_extra_token,
            eod: 0,
            pad: -1,
            reset_position_ids: false,
            reset_attention_mask: false,
            eod_mask_loss: false,
            create_attention_mask: false,
        };
        let want = config.sequence_length + usize::from(config.add_extra_token);
        for idx in 0..ix.shuffle_index.len() {
            let text = sample_tokens(&ds, &ix, idx, &options).unwrap();
            prop_assert_eq!(text.len(), want);
            let pads = text.iter().filter(|&&t| t == -1).count();
            prop_assert!(pads == 0 || !config.drop_last, "padding only in a kept partial sample");
        }
        prop_assert!(sample_tokens(&ds, &ix, ix.shuffle_index.len(), &options).is_err());
    }
}
