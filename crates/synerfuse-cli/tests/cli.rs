//! The `synerfuse` binary as a user runs it: a new shell, no LD_LIBRARY_PATH.

use std::process::Command;

fn synerfuse(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_synerfuse"))
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LIBTORCH")
        .output()
        .expect("run synerfuse")
}

#[test]
fn help_lists_the_subcommands() {
    let out = synerfuse(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Usage: synerfuse"), "{text}");
    assert!(text.contains("env"), "{text}");
}

#[test]
fn version_is_the_crate_version() {
    let out = synerfuse(&["--version"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("synerfuse {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn env_reports_libtorch_and_mpi_as_json() {
    let out = synerfuse(&["env", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        report["libtorch"]["version"]
            .as_str()
            .map(|v| v.split('+').next().unwrap()),
        Some("2.11.0")
    );
    assert!(
        report["mpi"].as_str().is_some_and(|v| v.contains("MPI")),
        "{report}"
    );
    assert!(
        report["intra_op_threads"].as_i64().is_some_and(|n| n >= 1),
        "{report}"
    );
}

/// Issue 15: `env` says whether libtorch's CUDA backend is loaded (it is, with this
/// workspace's CUDA wheel) and how many GPUs are visible.
#[test]
fn env_reports_libtorch_cuda_support() {
    let out = synerfuse(&["env"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    // Text only: Open MPI's version string ends in its C terminator, which must not
    // reach the output (grep would call it binary).
    assert!(!text.contains('\0'), "{text:?}");
    assert!(
        text.contains("libtorch CUDA support: loaded (") && text.contains("libtorch_cuda.so"),
        "{text}"
    );
    assert!(text.contains("GPUs visible: "), "{text}");
    let json: serde_json::Value =
        serde_json::from_slice(&synerfuse(&["env", "--json"]).stdout).expect("JSON");
    assert_eq!(json["libtorch_cuda"]["loaded"], true, "{json}");
}

/// `synerfuse` loads no libtorch (data commands start at once, on machines without
/// CUDA); the commands that need it run in `synerfuse-torch`, which loads it.
#[test]
fn only_the_libtorch_commands_load_libtorch() {
    let loaded = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_synerfuse"))
            .args(args)
            .env("LD_DEBUG", "libs")
            .output()
            .expect("run synerfuse");
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stderr).contains("libtorch_cpu.so")
    };
    assert!(!loaded(&["--version"]));
    assert!(!loaded(&["topology", "--world-size", "4"]));
    assert!(loaded(&["env", "--json"]));
}

/// Without `synerfuse-torch` beside it, `synerfuse train` says what is missing and where.
#[test]
fn a_missing_torch_binary_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("synerfuse");
    std::fs::copy(env!("CARGO_BIN_EXE_synerfuse"), &alone).unwrap();
    let out = Command::new(&alone)
        .args(["train", "--help"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("synerfuse-torch") && stderr.contains(&dir.path().display().to_string()),
        "{stderr}"
    );
    let data = Command::new(&alone)
        .args(["topology", "--world-size", "2"])
        .output()
        .unwrap();
    assert!(data.status.success(), "{data:?}");
}

/// Counts that must be at least 1 are refused at parse time, by flag, without a panic.
#[test]
fn zero_counts_are_refused_by_flag() {
    for (args, flag) in [
        (vec!["profile", "--repeats", "0"], "--repeats"),
        (vec!["profile", "--nproc", "0"], "--nproc"),
        (vec!["train", "--nproc", "0"], "--nproc"),
        (vec!["train", "--threads", "0"], "--threads"),
        (
            vec!["train", "--distributed-timeout-minutes", "0"],
            "--distributed-timeout-minutes",
        ),
    ] {
        let out = synerfuse(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// An error and its causes are printed on one line, each cause once.
#[test]
fn errors_print_each_cause_once() {
    let out = synerfuse(&["inspect", "/nonexistent/dataset"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("/nonexistent/dataset.idx"), "{stderr}");
}

#[test]
fn an_unknown_subcommand_fails_with_usage() {
    let out = synerfuse(&["trian"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unrecognized subcommand"));
}

/// `synerfuse topology --json` prints SynerFuse's rank table (world 8, TP 2, PP 2, DP 2) for the tp-pp-dp order,
/// and a world that does not divide is an error naming the sizes.
#[test]
fn topology_groups_as_json() {
    let out = synerfuse(&[
        "topology",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--use-tp-pp-dp-mapping",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["groups"]["pp"],
        serde_json::json!([[0, 2], [1, 3], [4, 6], [5, 7]])
    );
    assert_eq!(
        v["groups"]["dp"],
        serde_json::json!([[0, 4], [1, 5], [2, 6], [3, 7]])
    );
    assert_eq!(
        v["groups"]["tp-pp"],
        serde_json::json!([[0, 1, 2, 3], [4, 5, 6, 7]])
    );
    assert_eq!(v["ranks"][5]["dp"], 1);
    let out = synerfuse(&["topology", "--world-size", "12", "--tp", "2", "--pp", "4"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("12") && err.contains("8"), "{err}");
}

/// `synerfuse score` reproduces transformers' loss on the model fixtures, and `generate`
/// its greedy continuation.
#[test]
fn score_and_generate_match_transformers() {
    use synerfuse_model::tch::Tensor;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../synerfuse-model/tests/fixtures/gqa_untied_theta");
    let tensors = Tensor::read_safetensors(dir.join("expected.safetensors")).unwrap();
    let get = |key: &str| {
        tensors
            .iter()
            .find(|(n, _)| n == key)
            .unwrap()
            .1
            .shallow_clone()
    };
    let ids: Vec<Vec<i64>> = (0..2)
        .map(|r| Vec::try_from(get("input_ids").get(r)).unwrap())
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let tokens = tmp.path().join("tokens.json");
    std::fs::write(&tokens, serde_json::to_string(&ids).unwrap()).unwrap();
    let out = synerfuse(&[
        "score",
        "--hf-dir",
        dir.to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let want = get("loss").double_value(&[0]);
    assert!(
        (v["mean_loss"].as_f64().unwrap() - want).abs() < 1e-4,
        "{v} vs {want}"
    );
    assert_eq!(v["sequences"][1]["tokens"], 11);

    let prompt: Vec<String> = ids[0][..4].iter().map(|t| t.to_string()).collect();
    let out = synerfuse(&[
        "generate",
        "--hf-dir",
        dir.to_str().unwrap(),
        "--prompt-tokens",
        &prompt.join(","),
        "--max-new-tokens",
        "8",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let want: Vec<i64> = Vec::try_from(&get("greedy")).unwrap();
    assert_eq!(v["tokens"], serde_json::json!(want));

    std::fs::write(&tokens, "[[1, 2], [3]]").unwrap();
    let out = synerfuse(&[
        "score",
        "--hf-dir",
        dir.to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sequence 1"));
}
