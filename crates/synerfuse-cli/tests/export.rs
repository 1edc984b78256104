//! `synerfuse export`: a training checkpoint (LLaMA, or Mixtral trained under expert
//! parallelism) as a Hugging Face directory that transformers loads with the same loss,
//! and that `--finetune-from-hf` continues from.

mod support;

use std::path::Path;
use support::*;

/// `synerfuse score`'s per-sequence losses of `tokens` under `source` (`--load DIR` or
/// `--hf-dir DIR`).
fn score(source: &[&str], tokens: &Path) -> Vec<f64> {
    let mut args = strings(&["score", "--tokens", tokens.to_str().unwrap()]);
    args.extend(strings(source));
    let out = synerfuse(&args);
    ok(&out, "score");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("score json");
    v["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect()
}

/// transformers' loss (`LlamaForCausalLM`, `MixtralForCausalLM`) of each sequence of `tokens` (the `--reference`
/// oracle).
fn transformers_losses(dir: &Path, tokens: &Path) -> Vec<f64> {
    let script = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
model.eval()
losses = []
with torch.no_grad():
    for seq in json.load(open(sys.argv[2])):
        ids = torch.tensor([seq])
        losses.append(model(input_ids=ids, labels=ids).loss.item())
print(json.dumps(losses))
"#;
    let out = std::process::Command::new(root().join(".venv/bin/python"))
        .args([
            "-c",
            script,
            dir.to_str().unwrap(),
            tokens.to_str().unwrap(),
        ])
        .output()
        .expect("run .venv/bin/python (cargo xtask setup --reference)");
    assert!(
        out.status.success(),
        "transformers could not load the export:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap()).expect("losses")
}

#[test]
fn an_export_loads_in_transformers_and_finetunes_from_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = dataset(d);
    let tokens = d.join("tokens.json");
    let sequences: Vec<Vec<u64>> = (0..3u64)
        .map(|s| (0..17u64).map(|i| (s * 97 + i * 31 + 5) % 1000).collect())
        .collect();
    std::fs::write(&tokens, serde_json::to_string(&sequences).unwrap()).unwrap();
    let untie = "--untie-embeddings-and-output-weights";
    let experts = ["--num-experts", "4", "--moe-ffn-hidden-size", "32"];
    // (what, its layout, the model flags beside the export's config.json)
    let layouts: [(&str, Vec<&str>, Vec<&str>); 3] = [
        (
            "tied, PP 2",
            vec![
                "--nproc",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--micro-batch-size",
                "1",
            ],
            Vec::new(),
        ),
        (
            "untied, TP 2",
            vec!["--nproc", "2", "--tensor-model-parallel-size", "2", untie],
            vec![untie],
        ),
        (
            "Mixtral, EP 2",
            [
                &["--nproc", "2", "--expert-model-parallel-size", "2"][..],
                &experts,
            ]
            .concat(),
            experts.to_vec(),
        ),
    ];
    for (i, (label, layout, model)) in layouts.iter().enumerate() {
        let name = format!("run{i}");
        let (_, trained) = run(d, &data, &name, layout);
        let save = d.join(&name);
        let export = d.join(format!("hf{i}"));
        let export_args = |output: &Path| {
            strings(&[
                "export",
                "--load",
                save.to_str().unwrap(),
                "--output",
                output.to_str().unwrap(),
                "--max-shard-size",
                "40KB",
            ])
        };
        ok(&synerfuse(&export_args(&export)), label);
        // Sharded as transformers shards: every tensor in the index, files within the size.
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(export.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let weight_map = index["weight_map"].as_object().unwrap();
        let names: Vec<&String> = weight_map.keys().collect();
        assert_eq!(names, trained.keys().collect::<Vec<_>>(), "{label}");
        let shards: std::collections::BTreeSet<&str> =
            weight_map.values().map(|v| v.as_str().unwrap()).collect();
        assert!(shards.len() > 2, "{label}: {shards:?}");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["tie_word_embeddings"], serde_json::json!(i != 1));
        let architecture = match i {
            2 => "MixtralForCausalLM",
            _ => "LlamaForCausalLM",
        };
        assert_eq!(config["architectures"][0], architecture, "{label}");
        // An existing directory is refused, and left as it was.
        let again = synerfuse(&export_args(&export));
        assert!(!again.status.success());
        assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));

        let ours = score(&["--load", save.to_str().unwrap()], &tokens);
        assert_eq!(
            score(&["--hf-dir", export.to_str().unwrap()], &tokens),
            ours
        );
        let theirs = transformers_losses(&export, &tokens);
        let worst = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        println!("{label}: synerfuse {ours:?}, transformers {theirs:?}, max diff {worst:e}");
        assert!(worst < 1e-4, "{label}: {ours:?} vs {theirs:?}");

        // --finetune-from-hf of the export starts from the trained weights exactly.
        let mut args = common(d, &data, 1);
        let lr = args.iter().position(|a| a == "--lr").unwrap();
        args[lr + 1] = "0".into();
        let min_lr = args.iter().position(|a| a == "--min-lr").unwrap();
        args[min_lr + 1] = "0".into();
        args.extend(strings(&["--finetune-from-hf", export.to_str().unwrap()]));
        args.extend(strings(&[
            "--nproc",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ]));
        args.extend(strings(model));
        let (_, continued) = run_args(d, &format!("finetune{i}"), args);
        assert_eq!(max_param_diff(&trained, &continued), 0.0, "{label}");
    }
}
