//! `.bin/.idx` reading and writing: the spec's byte-level examples, round trips,
//! corruption, merge and crash safety.

use proptest::prelude::*;
use std::path::Path;
use synerfuse_data::indexed::{bin_path, idx_path, merge_datasets};
use synerfuse_data::{DType, DataError, IndexedDataset, IndexedDatasetBuilder};

fn le_i32(values: &[i32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn le_i64(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn header(code: u8, sequences: u64, boundaries: u64) -> Vec<u8> {
    let mut h = b"MMIDIDX\x00\x00".to_vec();
    h.extend_from_slice(&1u64.to_le_bytes());
    h.push(code);
    h.extend_from_slice(&sequences.to_le_bytes());
    h.extend_from_slice(&boundaries.to_le_bytes());
    h
}

/// Spec §1.6 (a): three one-sequence documents, uint16.
#[test]
fn spec_example_a_is_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("tiny");
    let mut builder = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    for doc in [vec![1u32, 2, 3], vec![4, 5], vec![6]] {
        builder.add_document(&doc, &[doc.len()]).unwrap();
    }
    builder.finalize().unwrap();
    let bin = std::fs::read(bin_path(&prefix)).unwrap();
    assert_eq!(
        bin,
        [1u16, 2, 3, 4, 5, 6]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
    );
    let mut expected = header(8, 3, 4);
    expected.extend(le_i32(&[3, 2, 1]));
    expected.extend(le_i64(&[0, 6, 10]));
    expected.extend(le_i64(&[0, 1, 2, 3]));
    let idx = std::fs::read(idx_path(&prefix)).unwrap();
    assert_eq!(idx.len(), 102);
    assert_eq!(idx, expected);

    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(
        (ds.len(), ds.num_documents(), ds.dtype()),
        (3, 3, DType::U16)
    );
    assert_eq!(ds.sequence::<u16>(0).unwrap(), &[1, 2, 3]);
    assert_eq!(ds.get::<u16>(0, 1, Some(2)).unwrap(), &[2, 3]);
    assert_eq!(ds.get_i64(1, 1, None).unwrap(), vec![5]);
    assert_eq!(ds.document(2).unwrap(), 2..3);
    assert!(matches!(
        ds.sequence::<i32>(0),
        Err(DataError::DTypeMismatch { .. })
    ));
    assert!(matches!(
        ds.get::<u16>(0, 2, Some(2)),
        Err(DataError::OutOfRange { .. })
    ));
    assert!(matches!(
        ds.sequence::<u16>(3),
        Err(DataError::OutOfRange { .. })
    ));
}

/// Spec §1.6 (b): sentence level, int32, an empty middle document, modes [0,1,0].
#[test]
fn spec_example_b_multimodal_is_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("mm");
    let mut builder = IndexedDatasetBuilder::create_multimodal(&prefix, DType::I32).unwrap();
    builder
        .add_document_with_modes(&[7i64, 8, 9], &[2, 1], &[0, 1])
        .unwrap();
    builder.add_document::<i64>(&[], &[]).unwrap();
    builder.add_item_with_mode(&[10i64, 11, 12], 0).unwrap();
    builder.end_document().unwrap();
    builder.finalize().unwrap();
    let mut expected = header(4, 3, 4);
    expected.extend(le_i32(&[2, 1, 3]));
    expected.extend(le_i64(&[0, 8, 12]));
    expected.extend(le_i64(&[0, 2, 2, 3]));
    expected.extend([0u8, 1, 0]);
    assert_eq!(std::fs::read(idx_path(&prefix)).unwrap(), expected);
    assert_eq!(
        std::fs::read(bin_path(&prefix)).unwrap(),
        le_i32(&[7, 8, 9, 10, 11, 12])
    );

    let ds = IndexedDataset::open_multimodal(&prefix).unwrap();
    assert_eq!(ds.sequence_modes(), Some(&[0i8, 1, 0][..]));
    assert_eq!(ds.document(1).unwrap(), 2..2);
    // Text-only readers ignore the trailing modes, as Megatron's do.
    assert_eq!(
        IndexedDataset::open(&prefix).unwrap().sequence_modes(),
        None
    );
}

/// An output prefix in a directory that does not exist is named, as the prefix given.
#[test]
fn a_missing_output_directory_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("data/shk");
    let err = IndexedDatasetBuilder::create(&prefix, DType::U16)
        .err()
        .expect("no directory, no builder");
    let message = err.to_string();
    assert!(
        message.contains(&*prefix.to_string_lossy()) && message.contains("does not exist"),
        "{message}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn builder_refuses_bad_input_with_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("bad");
    let mut builder = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    let err = builder.add_item(&[70000u32]).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfRange {
                value: 70000,
                dtype: DType::U16,
                ..
            }
        ),
        "{err}"
    );
    assert!(builder.add_document(&[1u32, 2], &[1]).is_err());
    assert!(builder.add_item_with_mode(&[1u32], 1).is_err());
}

#[test]
fn unfinished_builder_leaves_nothing_and_finalize_leaves_only_the_pair() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("crash");
    {
        let mut builder = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
        builder.add_document(&[1u32, 2, 3], &[3]).unwrap();
        // Dropped without finalize: an interrupted run.
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    let mut builder = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    builder.add_document(&[1u32, 2, 3], &[3]).unwrap();
    builder.finalize().unwrap();
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["crash.bin", "crash.idx"]);
}

fn build(prefix: &Path, dtype: DType, docs: &[Vec<Vec<u16>>]) {
    let mut builder = IndexedDatasetBuilder::create(prefix, dtype).unwrap();
    for doc in docs {
        for sequence in doc {
            builder.add_item(sequence).unwrap();
        }
        builder.end_document().unwrap();
    }
    builder.finalize().unwrap();
}

fn read_back(ds: &IndexedDataset) -> Vec<Vec<Vec<i64>>> {
    (0..ds.num_documents())
        .map(|k| {
            ds.document(k)
                .unwrap()
                .map(|i| ds.get_i64(i, 0, None).unwrap())
                .collect()
        })
        .collect()
}

fn widen(docs: &[Vec<Vec<u16>>]) -> Vec<Vec<Vec<i64>>> {
    docs.iter()
        .map(|d| {
            d.iter()
                .map(|s| s.iter().map(|&t| t as i64).collect())
                .collect()
        })
        .collect()
}

#[test]
fn merge_concatenates_in_sorted_prefix_order() {
    let dir = tempfile::tempdir().unwrap();
    let parts = dir.path().join("parts");
    std::fs::create_dir(&parts).unwrap();
    let b = vec![vec![vec![5u16, 6]], vec![]];
    let a = vec![vec![vec![1u16], vec![2, 3]]];
    build(&parts.join("b"), DType::I32, &b);
    build(&parts.join("a"), DType::I32, &a);
    let out = dir.path().join("merged");
    let order = merge_datasets(&parts, &out, false).unwrap();
    assert_eq!(order, vec![parts.join("a"), parts.join("b")]);
    let merged = IndexedDataset::open(&out).unwrap();
    let mut expected = widen(&a);
    expected.extend(widen(&b));
    assert_eq!(read_back(&merged), expected);
    assert_eq!(merged.document_indices().to_vec(), vec![0, 2, 3, 3]);

    build(&parts.join("c"), DType::U16, &a);
    let err = merge_datasets(&parts, dir.path().join("again"), false).unwrap_err();
    assert!(matches!(err, DataError::DTypeMismatch { .. }), "{err}");
    std::fs::write(parts.join("stray.txt"), "x").unwrap();
    assert!(merge_datasets(&parts, dir.path().join("again"), false).is_err());
}

fn documents() -> impl Strategy<Value = Vec<Vec<Vec<u16>>>> {
    prop::collection::vec(
        prop::collection::vec(prop::collection::vec(any::<u16>(), 0..12), 0..4),
        0..12,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn builder_reader_round_trip(docs in documents(), wide in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rt");
        let dtype = if wide { DType::I64 } else { DType::U16 };
        build(&prefix, dtype, &docs);
        let ds = IndexedDataset::open(&prefix).unwrap();
        prop_assert_eq!(ds.num_documents(), docs.len());
        prop_assert_eq!(read_back(&ds), widen(&docs));
    }

    /// Arbitrary bytes as an `.idx` (after the magic, or not) and a `.bin`: opening
    /// either errs or yields a dataset whose every access stays in bounds.
    #[test]
    fn random_index_bytes_never_panic(
        body in prop::collection::vec(any::<u8>(), 0..256),
        bin in prop::collection::vec(any::<u8>(), 0..64),
        with_magic in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("r");
        // With the magic, version 1 and a valid dtype code, so the counts and arrays
        // behind them are what is random.
        let mut idx = if with_magic {
            [b"MMIDIDX\x00\x00".as_slice(), &1u64.to_le_bytes(), &[8u8]].concat()
        } else {
            Vec::new()
        };
        idx.extend_from_slice(&body);
        std::fs::write(idx_path(&prefix), &idx).unwrap();
        std::fs::write(bin_path(&prefix), &bin).unwrap();
        for multimodal in [false, true] {
            let opened = if multimodal { IndexedDataset::open_multimodal(&prefix) } else { IndexedDataset::open(&prefix) };
            if let Ok(ds) = opened {
                for i in 0..ds.len() {
                    prop_assert!(ds.get_i64(i, 0, None).is_ok());
                }
            }
        }
    }

    #[test]
    fn corrupt_index_never_panics(
        docs in documents(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        extend in prop::collection::vec(any::<u8>(), 0..24),
        mode in 0u8..3,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("c");
        build(&prefix, DType::U16, &docs);
        let mut idx = std::fs::read(idx_path(&prefix)).unwrap();
        match mode {
            0 => idx.truncate(cut.index(idx.len() + 1)),
            1 => for (at, byte) in &flips { let i = at.index(idx.len()); idx[i] ^= byte; },
            _ => idx.extend_from_slice(&extend),
        }
        std::fs::write(idx_path(&prefix), &idx).unwrap();
        for multimodal in [false, true] {
            let opened = if multimodal { IndexedDataset::open_multimodal(&prefix) } else { IndexedDataset::open(&prefix) };
            if let Ok(ds) = opened {
                // Whatever opened satisfies its invariants: every access stays in bounds.
                for i in 0..ds.len() {
                    let bytes = ds.sequence_bytes(i).unwrap();
                    let tokens = ds.get_i64(i, 0, None).unwrap();
                    prop_assert_eq!(bytes.len(), tokens.len() * ds.dtype().size());
                }
                for k in 0..ds.num_documents() {
                    let r = ds.document(k).unwrap();
                    prop_assert!(r.start <= r.end && r.end <= ds.len());
                }
            }
        }
    }
}

#[test]
fn corrupt_headers_name_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("h");
    build(&prefix, DType::U16, &[vec![vec![1, 2, 3]]]);
    let good = std::fs::read(idx_path(&prefix)).unwrap();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (good[..20].to_vec(), "header"),
        ([b"NOTMAGIC\x00".as_slice(), &good[9..]].concat(), "magic"),
        (
            [&good[..9], &2u64.to_le_bytes(), &good[17..]].concat(),
            "version",
        ),
        ([&good[..17], &[9u8], &good[18..]].concat(), "dtype"),
        (
            good[..good.len() - 1].to_vec(),
            "sequence_count/document_count",
        ),
    ];
    for (bytes, field) in cases {
        std::fs::write(idx_path(&prefix), &bytes).unwrap();
        let err = IndexedDataset::open(&prefix).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("h.idx") && text.contains(field),
            "{field}: {text}"
        );
    }
    std::fs::write(idx_path(&prefix), &good).unwrap();
    std::fs::write(bin_path(&prefix), [0u8; 4]).unwrap();
    let text = IndexedDataset::open(&prefix).unwrap_err().to_string();
    assert!(
        text.contains("h.bin") && text.contains("past the end"),
        "{text}"
    );
}
