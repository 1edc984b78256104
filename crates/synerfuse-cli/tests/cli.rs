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
        Some("2.13.0")
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

#[test]
fn an_unknown_subcommand_fails_with_usage() {
    let out = synerfuse(&["trian"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unrecognized subcommand"));
}

/// `synerfuse topology --json` prints spec/synerfuse.md §3's table for the tp-pp-dp order,
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
