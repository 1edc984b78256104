//! `--mock-data`: megatron-core 0.8.0's `MockGPTDataset` sample for sample. The expected
//! values come from megatron-core itself (`BlendedMegatronDatasetBuilder(MockGPTDataset,
//! [100, 20, 10], ...)` with seed 1234, sequence length 64 and a tokenizer whose EOD is 7).

use synerfuse_data::gpt::{build_mock_split_datasets, SampleOptions};

struct Expected {
    len: usize,
    tokens0: [i64; 12],
    labels0_tail: [i64; 4],
    sums: [i64; 3],
}

const EXPECTED: [Expected; 3] = [
    Expected {
        len: 1_065_473,
        tokens0: [649, 650, 651, 652, 653, 654, 655, 656, 657, 658, 659, 660],
        labels0_tail: [710, 711, 712, 713],
        sums: [43552, 31264, 224_399],
    },
    Expected {
        len: 1_064_995,
        tokens0: [
            1950, 1951, 1952, 1953, 1954, 1955, 1956, 1957, 1958, 1959, 1960, 1961,
        ],
        labels0_tail: [2011, 2012, 2013, 2014],
        sums: [126_816, 37216, 206_048],
    },
    Expected {
        len: 1_066_985,
        tokens0: [
            1534, 1535, 1536, 1537, 1538, 1539, 1540, 1541, 1542, 1543, 1544, 1545,
        ],
        labels0_tail: [1595, 1596, 1597, 1598],
        sums: [100_192, 25632, 66976],
    },
];

#[test]
fn mock_splits_equal_megatron_core() {
    let splits = build_mock_split_datasets(1234, 64, 7, [Some(100), Some(20), Some(10)]).unwrap();
    let options = SampleOptions {
        sequence_length: 64,
        add_extra_token: true,
        eod: 7,
        pad: -1,
        reset_position_ids: false,
        reset_attention_mask: false,
        eod_mask_loss: false,
        create_attention_mask: false,
    };
    for (split, want) in splits.iter().zip(&EXPECTED) {
        let split = split.as_ref().expect("every split has documents");
        assert_eq!(split.len(), want.len);
        let samples: Vec<_> = (0..3)
            .map(|i| split.sample(i, &options).unwrap().1)
            .collect();
        assert_eq!(samples[0].tokens[..12], want.tokens0);
        assert_eq!(samples[0].labels[60..], want.labels0_tail);
        let sums: Vec<i64> = samples.iter().map(|s| s.tokens.iter().sum()).collect();
        assert_eq!(sums, want.sums);
        assert!(samples
            .iter()
            .all(|s| s.loss_mask.iter().sum::<f32>() == 64.0));
    }
}
