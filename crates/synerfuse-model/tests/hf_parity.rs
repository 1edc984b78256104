//! LLaMA and Mixtral parity with transformers (fixtures from `cargo xtask fixtures`, see
//! xtask/fixtures/model_fixtures.py): logits within 1e-4 in fp32 (and Mixtral's auxiliary
//! load-balancing loss), the same model split into three stages gives the same logits,
//! loss and gradients, and checkpoints round-trip in both directions.

use std::path::{Path, PathBuf};
use synerfuse_model::hf::{load_stage, save_pretrained};
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::{load_balancing_loss, BackwardFrom, Stage};

/// libtorch's generator is process-global and every `Stage::new` draws from it: each test
/// holds this lock so that `cargo test`'s parallel threads do not interleave their draws
/// (nextest runs tests in separate processes anyway).
static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn global_rng() -> std::sync::MutexGuard<'static, ()> {
    GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner())
}

const CASES: [&str; 5] = [
    "mha_tied",
    "gqa_untied_theta",
    "gqa_bias_headdim",
    "mixtral_top2_untied",
    "mixtral_top1_tied",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// One tensor of a fixture's expected.safetensors.
fn expected_tensor(name: &str, key: &str) -> Tensor {
    let tensors = Tensor::read_safetensors(fixture(name).join("expected.safetensors")).unwrap();
    tensors.into_iter().find(|(n, _)| n == key).unwrap().1
}

fn expected(name: &str) -> (Tensor, Tensor, f64) {
    let get = |key: &str| expected_tensor(name, key);
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
    let _rng = global_rng();
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
    let _rng = global_rng();
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
        2 * CASES.len(),
        "{stdout}"
    );
}

/// Mixtral's auxiliary load-balancing loss from our router logits equals transformers'
/// `aux_loss` (its top-2 and top-1 routing), whole and over three stages.
#[test]
fn router_aux_loss_matches_transformers() {
    let _rng = global_rng();
    for name in ["mixtral_top2_untied", "mixtral_top1_tied"] {
        let ids = expected_tensor(name, "input_ids");
        let want = expected_tensor(name, "aux_loss").double_value(&[0]);
        let whole = load_stage(&fixture(name), 0..3, Device::Cpu).unwrap();
        let moe = whole.config().moe.unwrap();
        let (_, logits) =
            tch::no_grad(|| whole.forward_with_router_logits(&ids, None, None).unwrap());
        assert_eq!(logits.len(), 3, "{name}: one router per layer");
        let aux = load_balancing_loss(&logits, moe.num_experts, moe.top_k).double_value(&[]);
        assert!(
            (aux - want).abs() < 1e-5,
            "{name}: aux loss {aux} vs {want}"
        );
        let mut x = ids.shallow_clone();
        let mut split = Vec::new();
        for stage in three_stages(&fixture(name)) {
            let (out, logits) =
                tch::no_grad(|| stage.forward_with_router_logits(&x, None, None).unwrap());
            split.extend(logits);
            x = out;
        }
        let aux_split = load_balancing_loss(&split, moe.num_experts, moe.top_k).double_value(&[]);
        assert!(
            (aux_split - aux).abs() < 1e-9,
            "{name}: 3 stages {aux_split} vs {aux}"
        );
    }
}

/// Backward through three stages (gradients passed stage to stage, with and without
/// recomputation) gives the whole model's parameter gradients.
#[test]
fn stagewise_backward_equals_whole_model_backward() {
    let _rng = global_rng();
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
    let _rng = global_rng();
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

/// Greedy generation with the key/value cache continues a prompt exactly as
/// transformers' `generate(do_sample=False)` does, and cached logits equal a full forward.
#[test]
fn greedy_generation_matches_transformers() {
    let _rng = global_rng();
    use synerfuse_model::{generate, GenerateOptions, KvCache};
    for name in CASES {
        let get = |key: &str| expected_tensor(name, key);
        let (ids, greedy) = (get("input_ids"), get("greedy"));
        let prompt: Vec<i64> = Vec::try_from(ids.get(0).narrow(0, 0, 4)).unwrap();
        let want: Vec<i64> = Vec::try_from(&greedy).unwrap();
        let model = load_stage(&fixture(name), 0..3, Device::Cpu).unwrap();
        let options = GenerateOptions {
            max_new_tokens: 8,
            ..Default::default()
        };
        assert_eq!(generate(&model, &prompt, &options).unwrap(), want, "{name}");

        let row = ids.narrow(0, 0, 1);
        let full = tch::no_grad(|| model.forward(&row, None, None).unwrap());
        let mut cache = KvCache::new();
        let head = tch::no_grad(|| {
            model
                .forward_cached(&row.narrow(1, 0, 5), &mut cache)
                .unwrap()
        });
        let tail = tch::no_grad(|| {
            model
                .forward_cached(&row.narrow(1, 5, 7), &mut cache)
                .unwrap()
        });
        assert_eq!(cache.len(), 12);
        assert!(
            max_diff(&Tensor::cat(&[head, tail], 1), &full) < 1e-5,
            "{name}: cached logits"
        );
        assert!(generate(&model, &[1000], &options).is_err());
    }
}

/// bf16 weights and activations stay close to fp32 (the norms and the loss run in fp32).
#[test]
fn bf16_forward_is_close_to_fp32() {
    let _rng = global_rng();
    let (ids, want, _) = expected("gqa_untied_theta");
    let mut model = load_stage(&fixture("gqa_untied_theta"), 0..3, Device::Cpu).unwrap();
    model.set_kind(Kind::BFloat16);
    let logits = tch::no_grad(|| model.forward(&ids, None, None).unwrap());
    assert_eq!(logits.kind(), Kind::BFloat16);
    let diff = max_diff(&logits.to_kind(Kind::Float), &want);
    let scale = want.abs().max().double_value(&[]);
    assert!(
        diff < 0.05 * scale,
        "bf16 logits differ by {diff} (scale {scale})"
    );
}

/// Megatron's initialisation: weights ~ N(0, std), the two output projections
/// N(0, std / sqrt(2 · layers)), norms 1; the same seed gives the same weights.
#[test]
fn megatron_initialisation() {
    let _rng = global_rng();
    let config = synerfuse_model::LlamaConfig {
        vocab_size: 512,
        hidden_size: 128,
        intermediate_size: 256,
        num_layers: 8,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 32,
        max_position_embeddings: 64,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        init_std: 0.02,
        moe: None,
    };
    tch::manual_seed(3);
    let stage = Stage::new(&config, 0..8, Device::Cpu).unwrap();
    let vars = stage.var_store().variables();
    let std_of = |n: &str| vars[n].std(true).double_value(&[]);
    assert!((std_of("model.layers.0.mlp.up_proj.weight") - 0.02).abs() < 0.001);
    let scaled = 0.02 / 16f64.sqrt();
    assert!((std_of("model.layers.3.self_attn.o_proj.weight") - scaled).abs() < 0.0005);
    assert!((std_of("model.layers.7.mlp.down_proj.weight") - scaled).abs() < 0.0005);
    assert_eq!(
        vars["model.norm.weight"]
            .mean(Kind::Float)
            .double_value(&[]),
        1.0
    );
    let total: i64 = vars.values().map(|t| t.numel() as i64).sum();
    assert_eq!(total as usize, config.num_parameters());
    tch::manual_seed(3);
    let again = Stage::new(&config, 0..8, Device::Cpu).unwrap();
    assert!(again.var_store().variables()["lm_head.weight"].equal(&vars["lm_head.weight"]));
}

/// The data loader's mask and positions: an explicit causal mask equals the default, and
/// with a document boundary masked and positions restarted, the second document's logits
/// are those of the document run alone.
#[test]
fn loader_masks_and_positions_are_honoured() {
    let _rng = global_rng();
    let (ids, _, _) = expected("gqa_bias_headdim");
    let model = load_stage(&fixture("gqa_bias_headdim"), 0..3, Device::Cpu).unwrap();
    let row = ids.narrow(0, 0, 1);
    let s = 12;
    let causal_masked = Tensor::ones([s, s], (Kind::Bool, Device::Cpu))
        .triu(1)
        .view([1, 1, s, s]);
    let (plain, masked) = tch::no_grad(|| {
        (
            model.forward(&row, None, None).unwrap(),
            model.forward(&row, None, Some(&causal_masked)).unwrap(),
        )
    });
    assert!(max_diff(&plain, &masked) < 1e-6);

    // Documents [0, 5) and [5, 12): keys of the first are masked for queries of the second.
    let mut mask = Vec::new();
    for q in 0..s {
        for k in 0..s {
            mask.push(k > q || (q >= 5 && k < 5));
        }
    }
    let mask = Tensor::from_slice(&mask).view([1, 1, s, s]);
    let positions: Vec<i64> = (0..5).chain(0..7).collect();
    let positions = Tensor::from_slice(&positions).view([1, s]);
    let (packed, alone) = tch::no_grad(|| {
        (
            model.forward(&row, Some(&positions), Some(&mask)).unwrap(),
            model.forward(&row.narrow(1, 5, 7), None, None).unwrap(),
        )
    });
    assert!(max_diff(&packed.narrow(1, 5, 7), &alone) < 1e-5);
}

/// Deterministic mode: two fresh models and training steps give bit-identical results.
#[test]
fn deterministic_mode_repeats_exactly() {
    let _rng = global_rng();
    let run = || {
        synerfuse_model::set_deterministic(42, 2);
        let (ids, _, _) = expected("gqa_untied_theta");
        let config = synerfuse_model::LlamaConfig::from_hf_file(
            &fixture("gqa_untied_theta").join("config.json"),
        )
        .unwrap();
        let stage = Stage::new(&config, 0..3, Device::Cpu).unwrap();
        let loss_of = |logits: &Tensor| {
            let (sum, count) = Stage::loss(logits, &ids, None);
            sum / count
        };
        let pass = stage.forward_train(&ids, None, None).unwrap();
        stage.backward(pass, BackwardFrom::Loss(&loss_of)).unwrap();
        stage.var_store().variables()["model.layers.1.mlp.up_proj.weight"].grad()
    };
    assert!(run().equal(&run()));
}
