//! Every command that builds or prices the model (`train`, `profile`, `plan`) takes the
//! same model flags, with the same meaning: the model lines of a Megatron `run.sh`, pasted
//! into any of them.

mod support;

use support::*;

/// A Megatron `run.sh`'s model flags (GPT_MODEL_ARGS), for a tiny LLaMA.
const RUN_SH_MODEL: [&str; 41] = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--ffn-hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--no-position-embedding",
    "--use-rotary-position-embeddings",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--init-method-std",
    "0.02",
    "--use-flash-attn",
    "--attention-softmax-in-fp32",
    "--rotary-base",
    "10000",
    "--norm-epsilon",
    "1e-5",
    "--make-vocab-size-divisible-by",
    "128",
    "--transformer-impl",
    "local",
    "--bf16",
];

/// Its MoE flags (MOE_ARGS).
const RUN_SH_EXPERTS: [&str; 13] = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-router-load-balancing-type",
    "aux_loss",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-grouped-gemm",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-z-loss-coeff",
    "1e-3",
];

/// `synerfuse profile` of `model` on this CPU (one micro-batch size, two repeats):
/// the profile's model shape, and what the command said.
fn profiled(dir: &std::path::Path, name: &str, model: &[&str]) -> (serde_json::Value, String) {
    let output = dir.join(format!("{name}.json"));
    let mut args = strings(&["profile", "--device", "cpu", "--device-kind", "cpu"]);
    args.extend(strings(&["--micro-batch-sizes", "1", "--repeats", "2"]));
    args.extend(strings(&["--vocab-size", "1000", "--output"]));
    args.push(output.display().to_string());
    args.extend(strings(model));
    let out = synerfuse(&args);
    ok(&out, name);
    let text = std::fs::read_to_string(&output).unwrap();
    let profile: serde_json::Value = serde_json::from_str(&text).unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    (profile["model"].clone(), said)
}

/// `synerfuse plan --json` of `model` on the A100 + V100 example cluster.
fn planned(model: &[&str]) -> std::process::Output {
    let cluster = root().join("examples/clusters/a100-v100.toml");
    let mut args = strings(&["plan", "--json", "--cluster"]);
    args.push(cluster.display().to_string());
    args.extend(strings(&[
        "--global-batch-size",
        "16",
        "--vocab-size",
        "1000",
    ]));
    args.extend(strings(model));
    synerfuse(&args)
}

/// A `run.sh`'s model and MoE flags (with `--bf16`) go unchanged into `profile`, `plan`
/// and `train`; the model they price is the one train builds (grouped-query attention
/// included); `--num-query-groups` without `--group-query-attention` means what it means
/// to Megatron and `train` (no effect, said), and a model flag synerfuse cannot build is
/// refused by name in `plan` as in `train`.
#[test]
fn a_run_sh_s_model_flags_go_into_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (shape, _) = profiled(d, "gqa", &RUN_SH_MODEL);
    assert_eq!(
        (&shape["num_kv_heads"], &shape["tied"], &shape["num_layers"]),
        (&2.into(), &false.into(), &2.into()),
        "{shape}"
    );
    let moe = [&RUN_SH_MODEL[..], &RUN_SH_EXPERTS[..]].concat();
    let (shape, _) = profiled(d, "moe", &moe);
    assert_eq!(shape["experts"]["num_experts"], 4, "{shape}");
    for model in [&RUN_SH_MODEL[..], &moe[..]] {
        ok(&planned(model), "plan");
    }
    // Without --group-query-attention: every head its own key/value head, said.
    let mha: Vec<&str> = (RUN_SH_MODEL.iter().copied())
        .filter(|f| *f != "--group-query-attention")
        .collect();
    let (shape, said) = profiled(d, "mha", &mha);
    assert_eq!(shape["num_kv_heads"], 4, "{shape}");
    assert!(
        said.contains("--num-query-groups 2 has no effect without --group-query-attention"),
        "{said}"
    );
    // And train takes the same flags (data and optimizer added).
    let data = dataset(d);
    let mut args = common(d, &data, 1);
    let model_end = args.iter().position(|a| a == "--lr").unwrap();
    args.drain(1..model_end);
    args.extend(strings(&moe));
    ok(&synerfuse(&args), "train");
    for (flag, value, named) in [
        ("--normalization", "LayerNorm", "--normalization LayerNorm"),
        ("--hidden-dropout", "0.1", "--hidden-dropout 0.1"),
        (
            "--position-embedding-type",
            "learned_absolute",
            "--position-embedding-type",
        ),
    ] {
        let mut model = RUN_SH_MODEL.to_vec();
        let at = model.iter().position(|f| *f == flag).unwrap();
        model[at + 1] = value;
        let out = planned(&model);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(named),
            "{flag}: {stderr}"
        );
    }
    let capacity = [&moe[..], &["--moe-expert-capacity-factor", "1.0"]].concat();
    let out = planned(&capacity);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--moe-expert-capacity-factor"),
        "{stderr}"
    );
    let out = planned(&[&RUN_SH_MODEL[..], &["--fp16"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--fp16"),
        "{stderr}"
    );
}
