//! What the `synerfuse train` tests share: running the binary (mpirun ranks included)
//! with a deadlock limit, the Shakespeare fixture dataset, the tiny model's flags, and
//! reading losses and checkpoints back.

// Each test file uses its own subset of these helpers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};
use synerfuse_model::tch::{Kind, Tensor};

pub const BIN: &str = env!("CARGO_BIN_EXE_synerfuse");

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn tokenizer_dir() -> PathBuf {
    root().join("crates/synerfuse-data/tests/fixtures/tokenizers/shakespeare-bpe")
}

/// Runs synerfuse to completion in its own process group; a run that outlives
/// `LIMIT` (a deadlock) is killed with its mpirun and ranks, and the test fails.
pub fn synerfuse(args: &[String]) -> Output {
    synerfuse_with_env(args, &[])
}

pub const LIMIT: Duration = Duration::from_secs(240);

/// The watchdog's bound in multi-rank training runs, well under [`LIMIT`]: a hang fails
/// with its rank, operation and group named, not as a killed test.
pub const WATCHDOG_MINUTES: &str = "1";

pub fn synerfuse_with_env(args: &[String], env: &[(&str, &str)]) -> Output {
    let args = with_watchdog(args);
    run_command_with_limit(Command::new(BIN).args(&args).envs(env.iter().copied()))
}

/// `args`, and for a multi-rank `train` that sets no bound of its own,
/// `--distributed-timeout-minutes` [`WATCHDOG_MINUTES`].
pub fn with_watchdog(args: &[String]) -> Vec<String> {
    let mut args = args.to_vec();
    let train = args.first().is_some_and(|a| a == "train");
    let ranks = args
        .iter()
        .any(|a| a == "--nproc" || a.starts_with("--nproc="));
    let bounded = (args.iter()).any(|a| a.starts_with("--distributed-timeout-minutes"));
    if train && ranks && !bounded {
        args.extend([
            "--distributed-timeout-minutes".into(),
            WATCHDOG_MINUTES.into(),
        ]);
    }
    args
}

/// Runs `command` (without `LD_LIBRARY_PATH`, one OpenMP thread) to completion in its own
/// process group; one that outlives `LIMIT` (a deadlock) is killed with everything it
/// started, and the test fails.
pub fn run_command_with_limit(command: &mut Command) -> Output {
    use std::os::unix::process::CommandExt;
    let logs = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (logs.path().join("out"), logs.path().join("err"));
    let mut child = command
        .env_remove("LD_LIBRARY_PATH")
        .env("OMP_NUM_THREADS", "1")
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .process_group(0)
        .spawn()
        .expect("run the command");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            panic!(
                "{command:?} did not finish in {LIMIT:?} (deadlock?)\nstderr:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: std::fs::read(&out_path).unwrap(),
        stderr: std::fs::read(&err_path).unwrap(),
    }
}

pub fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Shakespeare (the fixture corpus of 32 play excerpts) preprocessed with the
/// Shakespeare BPE tokenizer into `dir`.
pub fn dataset(dir: &Path) -> PathBuf {
    let tok = tokenizer_dir();
    let prefix = dir.join("shk");
    let out = synerfuse(&strings(&[
        "preprocess",
        "--input",
        root()
            .join("crates/synerfuse-data/tests/fixtures/megatron/corpus.jsonl")
            .to_str()
            .unwrap(),
        "--output-prefix",
        prefix.to_str().unwrap(),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        tok.join("vocab.json").to_str().unwrap(),
        "--merge-file",
        tok.join("merges.txt").to_str().unwrap(),
        "--append-eod",
        "--workers",
        "1",
    ]));
    ok(&out, "preprocess");
    dir.join("shk_text_document")
}

/// A tiny LLaMA (4 layers, GQA, tied embeddings), fp32, global batch 6, 6 iterations
/// with warm-up and cosine decay over 6 iterations.
pub fn common(dir: &Path, data: &Path, iters: u64) -> Vec<String> {
    let tok = tokenizer_dir();
    let mut args = strings(&[
        "train",
        "--num-layers",
        "4",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--ffn-hidden-size",
        "64",
        "--seq-length",
        "32",
        "--disable-bias-linear",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--lr",
        "3e-3",
        "--min-lr",
        "1e-4",
        "--lr-warmup-iters",
        "1",
        "--lr-decay-style",
        "cosine",
        "--weight-decay",
        "0.1",
        "--adam-beta2",
        "0.95",
        "--clip-grad",
        "1.0",
        "--global-batch-size",
        "6",
        "--split",
        "100,0,0",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--seed",
        "7",
        "--device",
        "cpu",
        "--log-interval",
        "1",
    ]);
    args.extend([
        "--train-iters".into(),
        iters.to_string(),
        "--lr-decay-iters".into(),
        iters.to_string(),
        "--data-path".into(),
        data.display().to_string(),
        "--data-cache-path".into(),
        dir.join("cache").display().to_string(),
        "--vocab-file".into(),
        tok.join("vocab.json").display().to_string(),
        "--merge-file".into(),
        tok.join("merges.txt").display().to_string(),
    ]);
    args
}

/// The model of `common`'s runs as `synerfuse plan` takes it (the vocabulary: the test
/// tokenizer's).
pub const PLAN_MODEL: [&str; 16] = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "64",
    "--vocab-size",
    "1024",
    "--seq-length",
    "32",
    "--disable-bias-linear",
];

/// `synerfuse plan --json` with `args`: its one JSON object.
pub fn plan_json(args: &[&str]) -> serde_json::Value {
    let mut all = strings(&["plan", "--json"]);
    all.extend(strings(args));
    let out = synerfuse(&all);
    ok(&out, "plan");
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// The records of a `--log-json` file.
pub fn json_records(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

/// The iterations' losses of a `--log-json` file (evaluation and speed-change records
/// left out).
pub fn losses(path: &Path) -> Vec<f64> {
    json_records(path)
        .iter()
        .filter(|v| v.get("elapsed_ms").is_some())
        .map(|v| v["loss"].as_f64().expect("loss"))
        .collect()
}

/// Every parameter of the newest checkpoint in `save`, by name, assembled from
/// whichever ranks' pieces hold it.
pub fn parameters(save: &Path) -> BTreeMap<String, Tensor> {
    let checkpoint = synerfuse_train::checkpoint::Checkpoint::open_latest(save)
        .expect("readable checkpoint")
        .expect("a checkpoint");
    (checkpoint.parameter_names().into_iter())
        .map(|name| {
            let t = checkpoint.tensor(&name).expect("stored");
            (name, t)
        })
        .collect()
}

pub fn max_param_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "checkpoints hold different parameters"
    );
    a.iter()
        .map(|(n, t)| {
            (t.to_kind(Kind::Double) - b[n].to_kind(Kind::Double))
                .abs()
                .max()
                .double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// The largest relative difference of a parameter tensor, ‖a − b‖ / ‖b‖: the
/// issue's "relative" for parameters. Adam makes single elements whose gradient sits
/// near `--adam-eps` sensitive to summation order (one embedding element of the tiny
/// model moves by 6e-6 between single-rank runs of micro-batch size 1 and 3), which a
/// per-element absolute bound would read as a parallelism error.
pub fn max_rel_param_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    max_param_diff(a, b); // the same names
    a.iter()
        .map(|(n, t)| {
            let reference = b[n].to_kind(Kind::Double);
            let diff = (t.to_kind(Kind::Double) - &reference)
                .norm()
                .double_value(&[]);
            diff / reference.norm().double_value(&[]).max(f64::MIN_POSITIVE)
        })
        .fold(0.0, f64::max)
}

pub fn max_rel_loss_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs())
        .fold(0.0, f64::max)
}

/// A run's losses and final parameters.
pub type Outcome = (Vec<f64>, BTreeMap<String, Tensor>);

/// The header of an equivalence table ([`equivalence_row`]).
pub const EQUIVALENCE_TABLE: &str =
    "| plan | max rel. loss diff | max rel. param diff |\n|---|---|---|\n";

/// Adds `label`'s row to `table` (relative loss and parameter differences of `got`
/// against `reference`) and asserts both are under 1e-5.
#[allow(dead_code)] // not every test binary that includes `support` has a table
pub fn equivalence_row(table: &mut String, label: &str, got: &Outcome, reference: &Outcome) {
    let loss_diff = max_rel_loss_diff(&reference.0, &got.0);
    let param_diff = max_rel_param_diff(&got.1, &reference.1);
    table.push_str(&format!(
        "| {label} | {loss_diff:.2e} | {param_diff:.2e} |\n"
    ));
    assert!(
        loss_diff < 1e-5 && param_diff < 1e-5,
        "{label}: {loss_diff:e} {param_diff:e}"
    );
}

/// Runs `synerfuse train` with `extra` flags, logging to `name.jsonl` and saving to
/// `name/`; returns (losses, final parameters).
pub fn run(dir: &Path, data: &Path, name: &str, extra: &[&str]) -> Outcome {
    let mut args = common(dir, data, 6);
    args.extend(strings(extra));
    run_args(dir, name, args)
}

/// [`run`] with every argument given (`common`'s, changed, and more).
pub fn run_args(dir: &Path, name: &str, mut args: Vec<String>) -> Outcome {
    let log = dir.join(format!("{name}.jsonl"));
    let save = dir.join(name);
    args.extend([
        "--log-json".into(),
        log.display().to_string(),
        "--save".into(),
        save.display().to_string(),
    ]);
    let out = synerfuse(&args);
    ok(&out, name);
    (losses(&log), parameters(&save))
}

/// Trains `common`'s 6 iterations with `first`'s flags, stopping (and saving) at
/// iteration 3, then resumes with `then`'s flags; returns the resumed iterations' losses.
pub fn stop_and_resume(
    dir: &Path,
    data: &Path,
    name: &str,
    first: &[&str],
    then: &[&str],
) -> Vec<f64> {
    let save = dir.join(name);
    let mut args = common(dir, data, 6);
    args.extend(strings(first));
    args.extend(strings(&[
        "--exit-interval",
        "3",
        "--save-interval",
        "3",
        "--save",
    ]));
    args.push(save.display().to_string());
    ok(&synerfuse(&args), &format!("{name}: stopped at 3"));
    let log = dir.join(format!("{name}.jsonl"));
    let mut args = common(dir, data, 6);
    args.extend(strings(then));
    args.extend([
        "--load".into(),
        save.display().to_string(),
        "--log-json".into(),
    ]);
    args.push(log.display().to_string());
    ok(&synerfuse(&args), &format!("{name}: resumed"));
    losses(&log)
}

/// A plan file `name.toml` in `dir` holding `text`; returns its path.
pub fn plan_file(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// A `[[replica]]` plan file `name.toml` in `dir` of (layers, micro-batch size, count)
/// per replica; returns its path.
pub fn replica_plan(dir: &Path, name: &str, replicas: &[(&str, usize, usize)]) -> String {
    let path = dir.join(format!("{name}.toml"));
    let text: String = replicas
        .iter()
        .map(|(layers, mbs, count)| {
            format!("[[replica]]\nlayers = {layers}\nmicro_batch_size = {mbs}\nnum_micro_batches = {count}\n")
        })
        .collect();
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// The equivalence table's rows of one test: each plan's run against its single-rank
/// reference (losses and final parameters within 1e-5 relative), printed at the end.
pub struct EquivalenceTable {
    rows: String,
}

impl Default for EquivalenceTable {
    fn default() -> Self {
        EquivalenceTable {
            rows: String::from(
                "| plan | max rel. loss diff | max rel. param diff | max abs. param diff |\n|---|---|---|---|\n",
            ),
        }
    }
}

impl EquivalenceTable {
    /// Adds `label`'s row; asserts it equals `reference` within 1e-5.
    pub fn check(&mut self, label: &str, reference: &Outcome, (losses, params): Outcome) {
        let (ref_losses, ref_params) = reference;
        let loss_diff = max_rel_loss_diff(ref_losses, &losses);
        let param_diff = max_rel_param_diff(&params, ref_params);
        let abs_diff = max_param_diff(ref_params, &params);
        self.rows.push_str(&format!(
            "| {label} | {loss_diff:.2e} | {param_diff:.2e} | {abs_diff:.2e} |\n"
        ));
        assert!(
            loss_diff < 1e-5 && param_diff < 1e-5,
            "{label}: losses {losses:?} vs {ref_losses:?} (rel {loss_diff:e}), params {param_diff:e}"
        );
    }

    /// Adds a bf16 row (fp32 master weights): its losses within 1e-3 of `reference`'s.
    pub fn check_bf16(&mut self, label: &str, reference: &[f64], losses: &[f64]) {
        let loss_diff = max_rel_loss_diff(reference, losses);
        self.rows
            .push_str(&format!("| {label} | {loss_diff:.2e} | - | - |\n"));
        assert!(loss_diff < 1e-3, "{label}: losses {losses:?}");
    }

    /// Prints the table.
    pub fn print(&self) {
        println!("{}", self.rows);
    }
}
