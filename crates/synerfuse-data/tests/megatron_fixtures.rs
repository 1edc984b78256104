//! Byte-identity with Megatron: `.bin/.idx` written by megatron-core 0.8.0's own
//! `IndexedDatasetBuilder` from the same JSONL and tokenizer files (regenerate with
//! `cargo xtask fixtures`), for every case of `fixtures/megatron/manifest.json`.

#![cfg(feature = "tokenizers")]

use std::path::{Path, PathBuf};
use synerfuse_data::indexed::{bin_path, idx_path, merge_datasets};
use synerfuse_data::preprocess::{output_prefix_for_key, preprocess, PreprocessConfig};
use synerfuse_data::tokenizer::{build_tokenizer, TokenizerArgs};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("megatron/manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn assert_same_files(ours: &Path, theirs: &Path) {
    for path in [bin_path, idx_path] {
        let (a, b) = (
            std::fs::read(path(ours)).unwrap(),
            std::fs::read(path(theirs)).unwrap(),
        );
        let first_difference = a.iter().zip(&b).position(|(x, y)| x != y);
        assert!(
            a == b,
            "{} differs from Megatron's {} ({} vs {} bytes, first difference at byte {first_difference:?})",
            path(ours).display(),
            path(theirs).display(),
            a.len(),
            b.len()
        );
    }
}

/// Runs every manifest case through our preprocess with `workers` threads.
fn preprocess_all(out: &Path, workers: usize) -> Vec<(PathBuf, PathBuf)> {
    let megatron = fixtures().join("megatron");
    let tokenizers = fixtures().join("tokenizers/shakespeare-bpe");
    let sentencepiece = fixtures().join("tokenizers/sentencepiece");
    let mut pairs = Vec::new();
    for case in manifest()["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let file = |key: &str| case[key].as_str().map(|f| tokenizers.join(f));
        let args = TokenizerArgs {
            vocab_file: file("vocab_file"),
            merge_file: file("merge_file"),
            vocab_size: case["vocab_size"].as_u64().map(|v| v as usize),
            tokenizer_model: case["tokenizer_model"]
                .as_str()
                .map(|f| sentencepiece.join(f)),
        };
        let tokenizer = build_tokenizer(
            case["tokenizer_type"].as_str().unwrap().parse().unwrap(),
            &args,
        )
        .unwrap();
        let keys: Vec<String> = case["json_keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap().to_owned())
            .collect();
        let config = PreprocessConfig {
            input: megatron.join(case["input"].as_str().unwrap()),
            output_prefix: out.join(name),
            json_keys: keys.clone(),
            append_eod: case["append_eod"].as_bool().unwrap(),
            // Megatron needs workers divisible by partitions.
            workers: workers * case["partitions"].as_u64().unwrap() as usize,
            partitions: case["partitions"].as_u64().unwrap() as usize,
            keep_sequential_samples: false,
            skip_bad_lines: false,
        };
        preprocess(&config, tokenizer.as_ref(), |_| {}).unwrap();
        for key in keys {
            pairs.push((
                output_prefix_for_key(&out.join(name), &key),
                output_prefix_for_key(&megatron.join(name), &key),
            ));
        }
    }
    pairs
}

#[test]
fn preprocess_is_byte_identical_to_megatron_for_every_case() {
    let out = tempfile::tempdir().unwrap();
    let pairs = preprocess_all(out.path(), 2);
    assert!(pairs.len() >= 12, "{} datasets compared", pairs.len());
    for (ours, theirs) in pairs {
        assert_same_files(&ours, &theirs);
    }
}

#[test]
fn output_does_not_depend_on_the_worker_count() {
    let (one, three) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for ((a, _), (b, _)) in preprocess_all(one.path(), 1)
        .into_iter()
        .zip(preprocess_all(three.path(), 3))
    {
        assert_same_files(&a, &b);
    }
}

#[test]
fn merge_is_byte_identical_to_megatron() {
    let megatron = fixtures().join("megatron");
    let merge = &manifest()["merge"];
    let dir = tempfile::tempdir().unwrap();
    let inputs = dir.path().join("in");
    std::fs::create_dir(&inputs).unwrap();
    for name in merge["inputs"].as_array().unwrap() {
        let name = name.as_str().unwrap();
        for path in [bin_path, idx_path] {
            std::fs::copy(path(megatron.join(name)), path(inputs.join(name))).unwrap();
        }
    }
    merge_datasets(&inputs, dir.path().join("merged"), false).unwrap();
    assert_same_files(
        &dir.path().join("merged"),
        &megatron.join(merge["output"].as_str().unwrap()),
    );
}

#[test]
fn gzip_input_and_sequential_partitions_keep_the_input_order() {
    use std::io::Write;
    let megatron = fixtures().join("megatron");
    let dir = tempfile::tempdir().unwrap();
    let gz = dir.path().join("null.jsonl.gz");
    let mut encoder = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::default(),
    );
    encoder
        .write_all(&std::fs::read(megatron.join("null.jsonl")).unwrap())
        .unwrap();
    encoder.finish().unwrap();
    let tokenizer = build_tokenizer(
        "NullTokenizer".parse().unwrap(),
        &TokenizerArgs {
            vocab_size: Some(786),
            ..Default::default()
        },
    )
    .unwrap();
    let config = PreprocessConfig {
        input: gz,
        output_prefix: dir.path().join("gz"),
        json_keys: vec!["text".into()],
        append_eod: true,
        workers: 3,
        partitions: 3,
        keep_sequential_samples: true,
        skip_bad_lines: false,
    };
    preprocess(&config, tokenizer.as_ref(), |_| {}).unwrap();
    assert_same_files(
        &dir.path().join("gz_text_document"),
        &megatron.join("null_u16_text_document"),
    );
}
