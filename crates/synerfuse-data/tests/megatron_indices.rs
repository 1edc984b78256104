//! GPT and blended dataset indices against megatron-core 0.8.0 (fixtures written by
//! `cargo xtask fixtures`, see xtask/fixtures/index_fixtures.py): every cache file Megatron
//! wrote is written by us under the same name with the same description and arrays, and
//! each side loads the other's cache instead of rebuilding it.
//!
//! Runs with the crate directory as working directory, so the relative dataset prefixes of
//! the fixtures enter the descriptions exactly as Megatron saw them.

#![cfg(feature = "tokenizers")]

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use synerfuse_data::gpt::{
    build_split_datasets, Blend, GptDataConfig, GptDatasetConfig, SampleOptions, SplitDataset,
};
use synerfuse_data::tokenizer::{megatron_tokenizer_identifiers, TokenizerArgs, TokenizerType};

const FIXTURES: &str = "tests/fixtures/megatron_indices";

fn manifest() -> Value {
    let text = std::fs::read_to_string(Path::new(FIXTURES).join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn blend(value: &Value) -> Option<Blend> {
    if value.is_null() {
        return None;
    }
    let prefixes = value[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_owned())
        .collect();
    let weights = value[1]
        .as_array()
        .map(|w| w.iter().map(|x| x.as_f64().unwrap()).collect());
    Some(Blend { prefixes, weights })
}

fn config(case: &Value, cache: &Path) -> GptDataConfig {
    let tokenizer = &case["tokenizer"];
    let args = &tokenizer["args"];
    let path = |key: &str| args[key].as_str().map(PathBuf::from);
    let kind: TokenizerType = tokenizer["type"].as_str().unwrap().parse().unwrap();
    let identifiers = megatron_tokenizer_identifiers(
        kind,
        &TokenizerArgs {
            tokenizer_model: path("tokenizer_model"),
            vocab_file: path("vocab_file"),
            merge_file: path("merge_file"),
            vocab_size: args["vocab_size"].as_u64().map(|v| v as usize),
        },
    )
    .unwrap();
    let per_split = case.get("per_split").cloned().unwrap_or(Value::Null);
    GptDataConfig {
        blend: blend(&case["blend"]),
        blend_per_split: std::array::from_fn(|i| {
            if per_split.is_null() {
                None
            } else {
                blend(&per_split[i])
            }
        }),
        dataset: GptDatasetConfig {
            seed: case["seed"].as_u64().unwrap() as u32,
            sequence_length: case["seq"].as_u64().unwrap() as usize,
            split: case["split"].as_str().map(str::to_owned),
            path_to_cache: Some(cache.to_path_buf()),
            tokenizer: identifiers,
            add_extra_token: case.get("extra").and_then(Value::as_bool).unwrap_or(true),
            drop_last_partial_validation: case
                .get("drop_last")
                .and_then(Value::as_bool)
                .unwrap_or(true),
        },
    }
}

fn sizes(case: &Value) -> [Option<u64>; 3] {
    std::array::from_fn(|i| case["sizes"][i].as_u64())
}

/// Every file of a cache directory: name → bytes.
fn cache_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// `.npy` payload after the header, plus the header's descr and shape text.
fn npy_parts(bytes: &[u8]) -> (String, &[u8]) {
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + len]).unwrap();
    // Whitespace differs across numpy versions; descr, order and shape must not.
    let compact: String = header.chars().filter(|c| !c.is_whitespace()).collect();
    (compact, &bytes[10 + len..])
}

fn check_case(case: &Value, datasets: &[Option<SplitDataset>; 3], loaded: bool) {
    let name = case["name"].as_str().unwrap();
    let eod = manifest()["eod"].as_i64().unwrap();
    for (i, expected) in case["splits"].as_array().unwrap().iter().enumerate() {
        let got = &datasets[i];
        assert_eq!(got.is_some(), !expected.is_null(), "{name} split {i}");
        let Some(got) = got else { continue };
        assert_eq!(
            got.len() as u64,
            expected["len"].as_u64().unwrap(),
            "{name} split {i} length"
        );
        let class = expected["class"].as_str().unwrap();
        assert_eq!(
            matches!(got, SplitDataset::Blended(_)),
            class == "BlendedDataset",
            "{name} split {i} class"
        );
        for record in got.cache_records() {
            assert_eq!(
                record.loaded, loaded,
                "{name} split {i}: {:?}",
                record.files
            );
        }
        let options = SampleOptions {
            sequence_length: case["seq"].as_u64().unwrap() as usize,
            add_extra_token: case.get("extra").and_then(Value::as_bool).unwrap_or(true),
            eod,
            pad: -1,
            reset_position_ids: false,
            reset_attention_mask: false,
            eod_mask_loss: false,
            create_attention_mask: false,
        };
        for (idx, sample) in expected["samples"].as_object().unwrap() {
            let idx: usize = idx.parse().unwrap();
            let (dataset_id, got) = got.sample(idx, &options).unwrap();
            let ids = |key: &str| -> Vec<i64> {
                sample[key]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_i64().unwrap())
                    .collect()
            };
            assert_eq!(
                got.tokens,
                ids("tokens"),
                "{name} split {i} sample {idx} tokens"
            );
            assert_eq!(
                got.labels,
                ids("labels"),
                "{name} split {i} sample {idx} labels"
            );
            assert_eq!(dataset_id as u64, sample["dataset_id"].as_u64().unwrap());
        }
    }
}

/// Built from scratch, our cache directory holds the files Megatron's holds, with the
/// same names, descriptions and arrays, and the datasets serve the same samples.
#[test]
fn fresh_builds_write_megatrons_cache_files() {
    let manifest = manifest();
    for case in manifest["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let datasets = build_split_datasets(&config(case, dir.path()), sizes(case))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        check_case(case, &datasets, false);
        let ours = cache_files(dir.path());
        let theirs = cache_files(Path::new(case["cache"].as_str().unwrap()));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{name}: cache file names"
        );
        for (file, their_bytes) in &theirs {
            let our_bytes = &ours[file];
            if file.ends_with(".npy") {
                let (our_header, our_data) = npy_parts(our_bytes);
                let (their_header, their_data) = npy_parts(their_bytes);
                assert_eq!(our_header, their_header, "{name}: {file} header");
                assert!(our_data == their_data, "{name}: {file} arrays differ");
            } else {
                assert_eq!(
                    String::from_utf8_lossy(our_bytes),
                    String::from_utf8_lossy(their_bytes),
                    "{name}: {file}"
                );
            }
        }
    }
}

/// Megatron's cache is loaded (mapped), not rebuilt, and serves the same samples.
#[test]
fn megatron_caches_are_loaded_not_rebuilt() {
    let manifest = manifest();
    for case in manifest["cases"].as_array().unwrap() {
        let dir = tempfile::tempdir().unwrap();
        for (file, bytes) in cache_files(Path::new(case["cache"].as_str().unwrap())) {
            std::fs::write(dir.path().join(file), bytes).unwrap();
        }
        let before = cache_files(dir.path());
        let datasets = build_split_datasets(&config(case, dir.path()), sizes(case)).unwrap();
        check_case(case, &datasets, true);
        assert_eq!(before, cache_files(dir.path()), "loading writes nothing");
    }
}

/// megatron-core loads the caches we write (run with the reference Python packages of
/// `cargo xtask setup --reference`, which `cargo xtask test` installs).
#[test]
fn megatron_loads_our_caches() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = root.join(".venv/bin/python");
    let script = root.join("xtask/fixtures/index_fixtures.py");
    let manifest = manifest();
    let out = tempfile::tempdir().unwrap();
    for case in manifest["cases"].as_array().unwrap() {
        let dir = out.path().join(case["name"].as_str().unwrap());
        build_split_datasets(&config(case, &dir), sizes(case)).unwrap();
    }
    let output = std::process::Command::new(&python)
        .arg(&script)
        .arg(&root)
        .arg("--load")
        .arg(out.path())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `cargo xtask setup --reference`",
                python.display()
            )
        });
    assert!(
        output.status.success(),
        "megatron-core did not load our caches (needs `cargo xtask setup --reference`):\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let loaded = stdout.lines().filter(|l| l.starts_with("loaded ")).count();
    assert_eq!(
        loaded,
        manifest["cases"].as_array().unwrap().len(),
        "{stdout}"
    );
}

/// Where Megatron hangs (a split with no sequences but samples wanted), we stop with an
/// error naming the dataset and split.
#[test]
fn empty_split_with_samples_is_an_error() {
    let manifest = manifest();
    let case = &manifest["cases"][0];
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(case, dir.path());
    // 350 sequences: "969, 30, 1" leaves the test split empty.
    config.blend = Some(Blend {
        prefixes: vec![format!("{FIXTURES}/data/play5")],
        weights: None,
    });
    let err = build_split_datasets(&config, [Some(10), Some(3), Some(3)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("play5") && err.contains("test"), "{err}");
}
