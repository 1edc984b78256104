//! The training loader over a real GPT dataset: each global batch is split among the
//! replicas exactly once, in replica order, and resuming from `consumed_samples` gives
//! the same micro-batches.

use proptest::prelude::*;
use std::sync::Arc;
use synerfuse_data::gpt::{
    GptDataset, GptDatasetConfig, PyValue, SampleOptions, Split, SplitDataset,
};
use synerfuse_data::{DType, IndexedDataset, IndexedDatasetBuilder};
use synerfuse_plan::{ReplicaBatch, ReplicaBatches};
use synerfuse_train::loader::{LoaderError, ReplicaLoader};

const SEQ: usize = 8;
const EOD: i64 = 999;

/// A GPT train split over 60 documents of 3..20 tokens.
fn dataset(dir: &std::path::Path) -> SplitDataset {
    let prefix = dir.join("docs");
    let mut builder = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    for d in 0..60u32 {
        let len = 3 + (d * 7) % 17;
        let mut ids: Vec<u32> = (0..len).map(|i| d * 10 + i % 10).collect();
        ids.push(EOD as u32);
        builder.add_document(&ids, &[ids.len()]).unwrap();
    }
    builder.finalize().unwrap();
    let indexed = Arc::new(IndexedDataset::open(&prefix).unwrap());
    let config = GptDatasetConfig {
        seed: 1234,
        sequence_length: SEQ,
        split: Some("1".into()),
        path_to_cache: Some(dir.join("cache")),
        tokenizer: PyValue::Dict(vec![]),
        add_extra_token: true,
        drop_last_partial_validation: true,
    };
    let n = indexed.len();
    let prefix = prefix.to_string_lossy().into_owned();
    let gpt = GptDataset::build(indexed, &prefix, 0..n, Some(400), Split::Train, &config).unwrap();
    SplitDataset::Gpt(Arc::new(gpt))
}

fn options() -> SampleOptions {
    SampleOptions {
        sequence_length: SEQ,
        add_extra_token: true,
        eod: EOD,
        pad: -1,
        reset_position_ids: true,
        reset_attention_mask: false,
        eod_mask_loss: true,
        create_attention_mask: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every sample of the global batch goes to exactly one replica and micro-batch, replica
    /// d's samples follow replica d-1's, and rows are the dataset's samples.
    #[test]
    fn replicas_partition_each_global_batch(
        shapes in prop::collection::vec((1usize..4, 1usize..4), 1..5),
        step in 0u64..6,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let data = dataset(dir.path());
        let batches = ReplicaBatches::new(shapes.iter().map(|&(m, n)| ReplicaBatch::uniform(m, n)).collect()).unwrap();
        let gbs = batches.global_batch_size() as u64;
        let consumed = step * gbs;
        let mut next = consumed;
        for (d, &(mbs, nmb)) in shapes.iter().enumerate() {
            let loader = ReplicaLoader::new(data.clone(), batches.clone(), d, options()).unwrap();
            let micro_batches = loader.step(consumed).unwrap();
            prop_assert_eq!(micro_batches.len(), nmb);
            for mb in &micro_batches {
                prop_assert_eq!(mb.sample_indices.clone(), next..next + mbs as u64);
                prop_assert_eq!(mb.tokens.len(), mbs * SEQ);
                for (row, idx) in mb.sample_indices.clone().enumerate() {
                    let (_, sample) = data.sample(idx as usize, &options()).unwrap();
                    prop_assert_eq!(&mb.tokens[row * SEQ..(row + 1) * SEQ], &sample.tokens[..]);
                    prop_assert_eq!(&mb.labels[row * SEQ..(row + 1) * SEQ], &sample.labels[..]);
                    prop_assert_eq!(&mb.loss_mask[row * SEQ..(row + 1) * SEQ], &sample.loss_mask[..]);
                }
                next += mbs as u64;
            }
            // A fresh loader resumed at the same count serves the same data.
            let resumed = ReplicaLoader::new(data.clone(), batches.clone(), d, options()).unwrap();
            prop_assert_eq!(resumed.step(consumed).unwrap(), micro_batches);
        }
        prop_assert_eq!(next, consumed + gbs);
    }
}

#[test]
fn running_out_of_samples_is_an_error_naming_the_count() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let batches = ReplicaBatches::uniform(2, 4, 2).unwrap();
    let loader = ReplicaLoader::new(data.clone(), batches.clone(), 1, options()).unwrap();
    let last_full = (data.len() as u64 / 16 - 1) * 16;
    assert!(loader.step(last_full).is_ok());
    let err = loader.step(last_full + 16).unwrap_err();
    assert!(matches!(err, LoaderError::Exhausted { .. }), "{err}");
    assert!(err.to_string().contains(&data.len().to_string()));
    assert!(ReplicaLoader::new(data, batches, 2, options()).is_err());
}

/// Issue 15: a plain causal mask is never materialised (the model attends causally
/// without one, and a mask would keep SDPA off its flash kernel); resetting attention at
/// document ends still gets its masks, and the next step comes from the prefetch thread
/// unchanged.
#[test]
fn no_mask_unless_attention_is_reset_at_document_ends() {
    use synerfuse_train::loader::Prefetcher;
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let batches = ReplicaBatches::new(vec![ReplicaBatch::uniform(2, 2)]).unwrap();
    let causal = SampleOptions {
        create_attention_mask: true,
        ..options()
    };
    let loader = ReplicaLoader::new(data.clone(), batches.clone(), 0, causal).unwrap();
    assert!(loader
        .step(0)
        .unwrap()
        .iter()
        .all(|m| m.attention_mask.is_none()));
    let reset = SampleOptions {
        reset_attention_mask: true,
        ..causal
    };
    let loader = ReplicaLoader::new(data, batches, 0, reset).unwrap();
    let steps: Vec<_> = (0..3).map(|s| loader.step(s * 4).unwrap()).collect();
    assert!(steps[0].iter().all(|m| m
        .attention_mask
        .as_ref()
        .is_some_and(|a| a.len() == 2 * SEQ * SEQ)));
    let mut prefetched = Prefetcher::new(loader, true);
    for (s, expected) in steps.iter().enumerate() {
        assert_eq!(&prefetched.step(s as u64 * 4).unwrap(), expected);
    }
}
