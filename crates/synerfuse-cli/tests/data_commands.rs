//! `synerfuse preprocess`, `merge` and `inspect` as a user runs them, bad input included.

use std::path::Path;
use std::process::{Command, Output};
use synerfuse_data::IndexedDataset;

fn synerfuse(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_synerfuse"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run synerfuse")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

const NULL: [&str; 4] = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "786"];

#[test]
fn preprocess_writes_every_key_and_inspect_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("in.jsonl"),
        "{\"text\": \"1 2 3\", \"title\": [\"4 5\", \"6\"]}\n{\"text\": \"7\", \"title\": []}\n",
    )
    .unwrap();
    let mut args = vec![
        "preprocess",
        "--input",
        "in.jsonl",
        "--output-prefix",
        "out",
        "--json-keys",
        "text",
        "title",
        "--append-eod",
        "--workers",
        "2",
    ];
    args.extend(NULL);
    let out = synerfuse(dir.path(), &args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        files(dir.path()),
        [
            "in.jsonl",
            "out_text_document.bin",
            "out_text_document.idx",
            "out_title_document.bin",
            "out_title_document.idx"
        ]
    );
    let title = IndexedDataset::open(dir.path().join("out_title_document")).unwrap();
    assert_eq!(title.sequence_lengths().to_vec(), vec![2, 2]);
    assert_eq!(title.document_indices().to_vec(), vec![0, 2, 2]);
    assert_eq!(title.get_i64(1, 0, None).unwrap(), vec![6, 786]);

    let mut inspect = vec!["inspect", "out_text_document", "--json"];
    inspect.extend(NULL);
    let out = synerfuse(dir.path(), &inspect);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["documents"], 2);
    assert_eq!(report["tokens"], 6);
    assert_eq!(report["first_documents"][0]["text"], "1 2 3 786");
}

/// Each failure: non-zero exit, a message naming the file/line or flag, and no output
/// pair left behind that opens as complete.
#[test]
fn bad_input_fails_loudly_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("bad.jsonl"),
        "{\"text\": \"1\"}\n{\"text\": \"2\"\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("nokey.jsonl"),
        "{\"text\": \"1\"}\n{\"body\": \"2\"}\n",
    )
    .unwrap();
    let run = |input: &str, prefix: &str, extra: &[&str]| {
        let mut args = vec![
            "preprocess",
            "--input",
            input,
            "--output-prefix",
            prefix,
            "--workers",
            "1",
        ];
        args.extend(extra);
        synerfuse(dir.path(), &args)
    };
    let out = run("bad.jsonl", "bad", &NULL);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("bad.jsonl:2: invalid JSON"),
        "{}",
        stderr(&out)
    );

    let out = run("nokey.jsonl", "nokey", &NULL);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("nokey.jsonl:2: missing key \"text\""),
        "{}",
        stderr(&out)
    );

    let out = run(
        "nokey.jsonl",
        "gpt",
        &[
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "missing.json",
            "--merge-file",
            "m.txt",
        ],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("missing.json"), "{}", stderr(&out));

    let out = run("nokey.jsonl", "no/such/dir/out", &NULL);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no/such/dir/out"), "{}", stderr(&out));

    let out = synerfuse(
        dir.path(),
        &[
            "preprocess",
            "--input",
            "bad.jsonl",
            "--output-prefix",
            "s",
            "--workers",
            "1",
            "--split-sentences",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "9",
        ],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--split-sentences is not supported"),
        "{}",
        stderr(&out)
    );

    assert_eq!(files(dir.path()), ["bad.jsonl", "nokey.jsonl"]);

    let mut skip = NULL.to_vec();
    skip.push("--skip-bad-lines");
    let out = run("bad.jsonl", "skipped", &skip);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("skipped 1 malformed line"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        IndexedDataset::open(dir.path().join("skipped_text_document"))
            .unwrap()
            .num_documents(),
        1
    );
}

#[test]
fn merge_then_inspect() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("parts")).unwrap();
    for (name, body) in [
        ("a", "{\"text\": \"1 2\"}\n"),
        ("b", "{\"text\": \"3\"}\n{\"text\": \"4 5 6\"}\n"),
    ] {
        std::fs::write(dir.path().join(format!("{name}.jsonl")), body).unwrap();
        let prefix = format!("parts/{name}");
        let mut args = vec![
            "preprocess",
            "--input",
            &format!("{name}.jsonl"),
            "--output-prefix",
            &prefix,
            "--workers",
            "1",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        args.extend(NULL.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert!(synerfuse(dir.path(), &args).status.success());
    }
    let out = synerfuse(
        dir.path(),
        &["merge", "--input", "parts", "--output-prefix", "merged"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let merged = IndexedDataset::open(dir.path().join("merged")).unwrap();
    assert_eq!(merged.sequence_lengths().to_vec(), vec![2, 1, 3]);
    let out = synerfuse(
        dir.path(),
        &["merge", "--input", "nowhere", "--output-prefix", "m"],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--input nowhere"), "{}", stderr(&out));
}

#[test]
fn trained_tokenizer_preprocesses_the_same_as_hf_and_gpt2_files() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../synerfuse-data/tests/fixtures/megatron/corpus.jsonl");
    let corpus = corpus.to_str().unwrap();
    let out = synerfuse(
        dir.path(),
        &[
            "tokenizer",
            "train",
            "--input",
            corpus,
            "--vocab-size",
            "500",
            "--output",
            "tok.json",
            "--gpt2-files",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = synerfuse(
        dir.path(),
        &[
            "tokenizer",
            "train",
            "--input",
            corpus,
            "--vocab-size",
            "100",
            "--output",
            "x.json",
        ],
    );
    assert!(
        !out.status.success() && stderr(&out).contains("--vocab-size 100"),
        "{}",
        stderr(&out)
    );

    // Texts without special-token strings: the two loaders must agree byte for byte.
    let plain: String = std::fs::read_to_string(corpus)
        .unwrap()
        .lines()
        .filter(|l| !l.contains("<|endoftext|>"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(dir.path().join("plain.jsonl"), plain).unwrap();
    let common = [
        "preprocess",
        "--input",
        "plain.jsonl",
        "--workers",
        "2",
        "--append-eod",
    ];
    let mut hf = common.to_vec();
    hf.extend([
        "--output-prefix",
        "hf",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        "tok.json",
    ]);
    let mut gpt2 = common.to_vec();
    gpt2.extend([
        "--output-prefix",
        "gpt2",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        "vocab.json",
        "--merge-file",
        "merges.txt",
    ]);
    for args in [hf, gpt2] {
        let out = synerfuse(dir.path(), &args);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    for ext in ["bin", "idx"] {
        let a = std::fs::read(dir.path().join(format!("hf_text_document.{ext}"))).unwrap();
        let b = std::fs::read(dir.path().join(format!("gpt2_text_document.{ext}"))).unwrap();
        assert!(a == b, "hf and gpt2 .{ext} differ");
    }
}

/// `synerfuse index` writes Megatron's cache files for a weighted blend (the names
/// megatron-core 0.8.0 wrote for the same flags, in synerfuse-data's fixtures), loads
/// them on the second run, and names the dataset and split when a split is empty.
#[test]
fn index_builds_then_loads_megatron_named_caches() {
    let data_crate = Path::new(env!("CARGO_MANIFEST_DIR")).join("../synerfuse-data");
    let cache = tempfile::tempdir().unwrap();
    let cache_arg = cache.path().to_str().unwrap();
    let play = |k: u32| format!("tests/fixtures/megatron_indices/data/play{k}");
    let (p0, p1, p2) = (play(0), play(1), play(2));
    let mut args = vec![
        "index",
        "--data-path",
        "0.3",
        &p0,
        "0.5",
        &p1,
        "0.2",
        &p2,
        "--split",
        "90,8,2",
        "--train-samples",
        "400",
        "--valid-samples",
        "30",
        "--test-samples",
        "9",
        "--seq-length",
        "16",
        "--data-cache-path",
        cache_arg,
        "--json",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "30000",
    ];
    let report = |out: &Output| -> serde_json::Value {
        assert!(out.status.success(), "{}", stderr(out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let first = report(&synerfuse(&data_crate, &args));
    let samples: Vec<u64> = (0..3)
        .map(|i| first["splits"][i]["samples"].as_u64().unwrap())
        .collect();
    assert_eq!(samples, [403, 33, 10]);
    assert_eq!(
        files(cache.path()),
        files(&data_crate.join("tests/fixtures/megatron_indices/cache/weighted_blend3"))
    );
    let second = report(&synerfuse(&data_crate, &args));
    for split in second["splits"].as_array().unwrap() {
        for cache in split["caches"].as_array().unwrap() {
            assert_eq!(cache["loaded"], true, "{cache}");
        }
    }

    // 350 sequences: the default split "969, 30, 1" leaves the test split empty.
    let p5 = play(5);
    args = vec![
        "index",
        "--data-path",
        &p5,
        "--train-samples",
        "10",
        "--test-samples",
        "2",
        "--seq-length",
        "8",
        "--data-cache-path",
        cache_arg,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "30000",
    ];
    let out = synerfuse(&data_crate, &args);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("play5") && err.contains("test split"), "{err}");
}
