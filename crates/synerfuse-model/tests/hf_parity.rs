//! LLaMA parity with transformers (fixtures from `cargo xtask fixtures`, see
//! xtask/fixtures/model_fixtures.py): logits within 1e-4 in fp32, the same model split into
//! three stages gives the same logits, loss and gradients, and checkpoints round-trip in
//! both directions.

use std::path::{Path, PathBuf};
use synerfuse_model::hf::{load_stage, save_pretrained};
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::{BackwardFrom, Stage};

const CASES: [&str; 3] = ["mha_tied", "gqa_untied_theta", "gqa_bias_headdim"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn expected(name: &str) -> (Tensor, Tensor, f64) {
    let tensors = Tensor::read_safetensors(fixture(name).join("expected.safetensors")).unwrap();
    let get = |key: &str| {
        tensors
            .iter()
            .find(|(n, _)| n == key)
            .unwrap()
            .1
            .shallow_clone()
    };
    (
        get("input_ids"),
        get("logits"),
        get("loss").double_value(&[0]),
    )
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// transformers' causal-LM loss: mean over positions 0..s-1 predicting the next token.
fn causal_lm_loss(logits: &Tensor, ids: &Tensor) -> f64 {
    let s = ids.size()[1];
    let (sum, count) = Stage::loss(&logits.narrow(1, 0, s - 1), &ids.narrow(1, 1, s - 1), None);
    (sum / count).double_value(&[])
}

fn three_stages(dir: &Path) -> Vec<Stage> {
    [0..1, 1..2, 2..3]
        .into_iter()
        .map(|r| load_stage(dir, r, Device::Cpu).unwrap())
        .collect()
}

fn run_stages(stages: &[Stage], ids: &Tensor) -> Tensor {
    let mut x = ids.shallow_clone();
    for s in stages {
        x = s.forward(&x, None, None).unwrap();
    }
    x
}

#[test]
fn logits_match_transformers_whole_and_split() {
    tch::manual_seed(0);
    for name in CASES {
        let (ids, want, want_loss) = expected(name);
        let whole = load_stage(&fixture(name), 0..3, Device::Cpu).unwrap();
        let logits = tch::no_grad(|| whole.forward(&ids, None, None).unwrap());
        let diff = max_diff(&logits, &want);
        assert!(
            diff < 1e-4,
            "{name}: logits differ from transformers by {diff}"
        );
        let loss = causal_lm_loss(&logits, &ids);
        assert!(
            (loss - want_loss).abs() < 1e-4,
            "{name}: loss {loss} vs {want_loss}"
        );

        let stages = three_stages(&fixture(name));
        let split = tch::no_grad(|| run_stages(&stages, &ids));
        assert!(
            max_diff(&split, &logits) < 1e-6,
            "{name}: 3 stages differ from one"
        );
    }
}

/// Our checkpoint (saved from three stages, as shards) loads back equal, and transformers
/// loads it and computes the fixture's logits.
#[test]
fn checkpoints_round_trip_and_load_in_transformers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let keep = tempfile::tempdir().unwrap();
    let mut checks: Vec<std::ffi::OsString> = Vec::new();
    for name in CASES {
        let (ids, want, _) = expected(name);
        let stages = three_stages(&fixture(name));
        let dir = keep.path().join(format!("{name}-sharded"));
        let refs: Vec<&Stage> = stages.iter().collect();
        save_pretrained(&refs, &dir).unwrap();
        let whole = load_stage(&dir, 0..3, Device::Cpu).unwrap();
        let original = load_stage(&fixture(name), 0..3, Device::Cpu).unwrap();
        for (n, t) in original.var_store().variables() {
            let back = &whole.var_store().variables()[&n];
            assert!(t.equal(back), "{name}: {n} changed in the round trip");
        }
        let logits = tch::no_grad(|| whole.forward(&ids, None, None).unwrap());
        assert!(max_diff(&logits, &want) < 1e-4);

        let single = keep.path().join(format!("{name}-single"));
        save_pretrained(&[&whole], &single).unwrap();
        for d in [dir, single] {
            checks.push(d.into());
            checks.push(name.into());
        }
    }
    let out = std::process::Command::new(root.join(".venv/bin/python"))
        .arg(root.join("xtask/fixtures/model_fixtures.py"))
        .arg(&root)
        .arg("--check")
        .args(&checks)
        .output()
        .expect("run .venv/bin/python (cargo xtask setup --reference)");
    assert!(
        out.status.success(),
        "transformers could not load our checkpoints:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        6,
        "{stdout}"
    );
}

/// Backward through three stages (gradients passed stage to stage, with and without
/// recomputation) gives the whole model's parameter gradients.
#[test]
fn stagewise_backward_equals_whole_model_backward() {
    for name in CASES {
        let (ids, _, _) = expected(name);
        let s = ids.size()[1];
        let (inputs, labels) = (ids.narrow(1, 0, s - 1), ids.narrow(1, 1, s - 1));
        let loss_of = |logits: &Tensor| {
            let (sum, count) = Stage::loss(logits, &labels, None);
            sum / count
        };
        let whole = load_stage(&fixture(name), 0..3, Device::Cpu).unwrap();
        let pass = whole.forward_train(&inputs, None, None).unwrap();
        whole.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap();
        let reference = whole.var_store().variables();

        for recompute in [false, true] {
            let mut stages = three_stages(&fixture(name));
            for st in &mut stages {
                st.set_recompute(recompute);
            }
            let mut passes = Vec::new();
            let mut x = inputs.shallow_clone();
            for st in &stages {
                let pass = st.forward_train(&x, None, None).unwrap();
                x = pass.output.shallow_clone();
                passes.push(pass);
            }
            let mut grad: Option<Tensor> = None;
            for (st, pass) in stages.iter().zip(passes).rev() {
                grad = match &grad {
                    None => st.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap(),
                    Some(g) => st.backward(pass, BackwardFrom::OutputGrad(g)).unwrap(),
                };
            }
            assert!(grad.is_none(), "the first stage has no input gradient");
            for st in &stages {
                for (n, p) in st.var_store().variables() {
                    let want = reference[&n].grad();
                    // A tied embedding lives on the first and the last stage: Megatron
                    // all-reduces the two gradients, so compare their sum.
                    let copies: Vec<Tensor> = [&stages[0], stages.last().unwrap()]
                        .iter()
                        .filter(|other| {
                            n == "model.embed_tokens.weight" && other.layers() != st.layers()
                        })
                        .filter_map(|other| other.var_store().variables().get(&n).map(Tensor::grad))
                        .collect();
                    let got = copies.iter().fold(p.grad(), |acc, g| &acc + g);
                    let diff = max_diff(&got, &want);
                    assert!(
                        diff < 1e-5,
                        "{name} recompute={recompute}: grad of {n} differs by {diff}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_checkpoints_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_stage(dir.path(), 0..1, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::copy(
        fixture("mha_tied").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let err = load_stage(dir.path(), 0..1, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    let err = load_stage(&fixture("mha_tied"), 2..5, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("2..5") || err.contains("layers 2..5"), "{err}");
    let _ = Kind::Float;
}
