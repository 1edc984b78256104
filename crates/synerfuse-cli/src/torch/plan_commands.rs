//! `synerfuse profile` (measure per-layer costs and links on the ranks it runs on) and
//! `synerfuse plan` (search the best heterogeneous layout for a cluster file).

use crate::files::write_atomically;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use synerfuse_model::tch::{self, Device};
use synerfuse_model::{DeviceRequest, LlamaConfig, MegatronModelArgs, ResolveDevice};
use synerfuse_parallel::cluster::ClusterSpec;
use synerfuse_parallel::cost::{CostModel, ModelShape, Profile};
use synerfuse_parallel::planner::{
    self, BehindBy, Candidate, PlanRequest, PooledCandidate, TpGroup,
};
use synerfuse_parallel::GridFlags;
use synerfuse_train::comm::{launcher_local_rank, launcher_rank, MpiRuntime};
use synerfuse_train::profiler::{self, ProfileConfig, ProfileError};

/// The model to plan or profile: a Hugging Face `config.json`, or Megatron's flags.
#[derive(Args, Debug, Clone)]
pub struct ModelFlags {
    /// A Hugging Face LLaMA config.json
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_parser = crate::values::positive_count)]
    num_layers: Option<usize>,
    #[arg(long, value_parser = crate::values::positive_count)]
    hidden_size: Option<usize>,
    #[arg(long, value_parser = crate::values::positive_count)]
    num_attention_heads: Option<usize>,
    /// Key/value heads (grouped-query attention)
    #[arg(long, value_parser = crate::values::positive_count)]
    num_query_groups: Option<usize>,
    #[arg(long, value_parser = crate::values::positive_count)]
    ffn_hidden_size: Option<usize>,
    /// Tokenizer vocabulary (padded to a multiple of 128 as Megatron does)
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 32000)]
    vocab_size: usize,
    #[arg(long)]
    untie_embeddings_and_output_weights: bool,
    #[arg(long, value_parser = crate::values::positive_count)]
    seq_length: usize,
}

impl ModelFlags {
    fn config(&self) -> Result<LlamaConfig> {
        if let Some(path) = &self.model {
            return Ok(LlamaConfig::from_hf_file(path)?);
        }
        let need = |flag: &str, v: Option<usize>| {
            v.with_context(|| format!("{flag} is required (or --model config.json)"))
        };
        let args = MegatronModelArgs {
            num_layers: need("--num-layers", self.num_layers)?,
            hidden_size: need("--hidden-size", self.hidden_size)?,
            ffn_hidden_size: self.ffn_hidden_size,
            num_attention_heads: need("--num-attention-heads", self.num_attention_heads)?,
            group_query_attention: self.num_query_groups.is_some(),
            num_query_groups: self.num_query_groups,
            seq_length: self.seq_length,
            untie_embeddings_and_output_weights: self.untie_embeddings_and_output_weights,
            ..MegatronModelArgs::default()
        };
        Ok(LlamaConfig::from_megatron(&args, self.vocab_size)?)
    }

    fn shape(&self) -> Result<ModelShape> {
        Ok(profiler::model_shape(&self.config()?, self.seq_length))
    }
}

/// `synerfuse profile`.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: ModelFlags,
    /// Micro-batch sizes to measure
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1,2,4")]
    micro_batch_sizes: Vec<usize>,
    /// cpu, cuda, cuda:N or auto
    #[arg(long, default_value = "auto")]
    device: DeviceRequest,
    /// The device kind the costs are filed under (a cluster file's `kind`) [default: cpu, or
    /// the GPU's catalogue slug (h100-sxm) when the catalogue knows its name, else cuda]
    #[arg(long)]
    device_kind: Option<String>,
    /// Timed repetitions (the median is kept)
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 5)]
    repeats: usize,
    /// Start N ranks here (mpirun) and also measure p2p and all-reduce between them
    #[arg(long, value_parser = crate::values::positive_count)]
    nproc: Option<usize>,
    /// Profile as an emulated device at this speed (as `train` emulates it: CPU time /
    /// speed on CPU ranks) and file the costs at speed 1, so a cluster file's `speed`
    /// scales them. Keep N x speed within the machine's cores.
    #[arg(long, value_parser = crate::values::speed)]
    emulate_device_speed: Option<f64>,
    /// Time bf16 computation (fp32 optimizer masters), as `train --bf16` runs: the
    /// profile of the precision that will train
    #[arg(long)]
    bf16: bool,
    /// Where to write the profile JSON
    #[arg(long)]
    output: PathBuf,
}

pub fn run_profile(args: ProfileArgs) -> Result<()> {
    if let (Some(n), None) = (args.nproc, launcher_rank()) {
        let status = crate::train_command::relaunch(n)?;
        if !status.success() {
            bail!("the {n}-rank profile failed ({status})");
        }
        return Ok(());
    }
    let runtime = MpiRuntime::init()?;
    let world = runtime.world();
    let (local_rank, local_size) = launcher_local_rank();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tch::set_num_threads((cores / local_size).max(1) as i32);
    let device = args.device.resolve_for_local_rank(local_rank)?;
    let kind = args.device_kind.clone().unwrap_or_else(|| match device {
        Device::Cpu => "cpu".into(),
        // The catalogue slug of this GPU, which a cluster file names as its `kind`.
        Device::Cuda(ordinal) => synerfuse_train::device_info::cuda_device_names()
            .get(ordinal)
            .and_then(|name| synerfuse_parallel::cluster::catalogue_slug_for_device_name(name))
            .unwrap_or("cuda")
            .into(),
        _ => "cuda".into(),
    });
    let config = ProfileConfig {
        model: args.model.config()?,
        sequence_length: args.model.seq_length,
        micro_batch_sizes: args.micro_batch_sizes.clone(),
        repeats: args.repeats,
        emulate_speed: args.emulate_device_speed,
        bf16: args.bf16,
    };
    let table = profiler::profile_device(&world, &config, device).map_err(|e| match e {
        ProfileError::EmulatedSpeed(_) => anyhow::Error::new(e).context("--emulate-device-speed"),
        e => e.into(),
    })?;
    let network = (world.size() > 1)
        .then(|| profiler::measure_network(&world))
        .transpose()?;
    let shape = profiler::model_shape(&config.model, config.sequence_length);
    if world.rank() == 0 {
        let mut devices = BTreeMap::new();
        devices.insert(kind.clone(), table);
        let profile = Profile {
            model: shape,
            devices,
            network,
        };
        let text = serde_json::to_string_pretty(&profile)?;
        let tmp = args.output.with_extension("json.tmp");
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &args.output)?;
        for (b, c) in &profile.devices[&kind] {
            println!(
                "{kind} mbs {b}: layer fwd {:.2} ms, bwd {:.2} ms; embedding {:.2} ms; head {:.2} ms",
                c.layer_fwd_s * 1e3,
                c.layer_bwd_s * 1e3,
                c.embedding_s * 1e3,
                c.head_s * 1e3
            );
        }
        if let Some(n) = &profile.network {
            println!(
                "{} ranks: p2p {:.2} GB/s, all-reduce bus {:.2} GB/s, latency {:.1} us",
                n.ranks,
                n.p2p_bytes_per_s / 1e9,
                n.allreduce_bytes_per_s / 1e9,
                n.latency_s * 1e6
            );
        }
        println!("wrote {}", args.output.display());
    }
    Ok(())
}

/// `synerfuse plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The cluster file (TOML)
    #[arg(long)]
    cluster: PathBuf,
    #[command(flatten)]
    model: ModelFlags,
    #[arg(long, value_parser = crate::values::positive_count)]
    global_batch_size: usize,
    /// Micro-batch sizes to consider
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1,2,4,8")]
    micro_batch_sizes: Vec<usize>,
    /// Tensor-parallel sizes to consider for per-replica pipelines (groups of a node's
    /// devices, unequal ones with unequal shares; 1: none)
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1,2,4,8")]
    tensor_model_parallel_sizes: Vec<usize>,
    /// Whether plans recompute activations: auto (each stage that would not fit
    /// otherwise), on (bare flag: every stage) or off
    #[arg(long, value_name = "auto|on|off", default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    recompute_activations: planner::Choice,
    /// Whether plans shard the optimizer over each stage's replicas (in proportion to
    /// memory; priced for every plan): auto, on (bare flag) or off
    #[arg(long, value_name = "auto|on|off", default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    use_distributed_optimizer: planner::Choice,
    /// A `synerfuse profile` output (overrides the catalogue)
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Plans to show
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 3)]
    top_k: usize,
    /// Where to write the best plan (TOML, for `synerfuse train --plan`)
    #[arg(long)]
    output: Option<PathBuf>,
    /// Also write the best grid plan (every replica the same stages) here, even when
    /// per-replica pipelines beat it and go to --output
    #[arg(long)]
    grid_output: Option<PathBuf>,
    /// Also write the even layout (the baseline) as a plan here
    #[arg(long)]
    uniform_output: Option<PathBuf>,
    /// Also write every feasible even layout considered as DIR/uniform-K.toml, K in the
    /// order of --json's uniform_layouts (predicted fastest first)
    #[arg(long, value_name = "DIR")]
    uniform_layouts_dir: Option<PathBuf>,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
    /// Draw the best plan's simulated step per rank here (SVG: forward, backward,
    /// waiting, the data-parallel reduction, the optimizer; FILE.json: the spans, for
    /// `synerfuse timeline --predicted`)
    #[arg(long)]
    timeline: Option<PathBuf>,
}

/// Writes the grid plan `c` in the general plan's file form (`[[replica]]` tables, which
/// keep the grid's rank order and say which stages recompute), under a temporary name
/// first.
fn write_plan(path: &std::path::Path, cost: &CostModel, c: &Candidate) -> Result<()> {
    let text = c.to_plan(cost)?.to_toml()?;
    write_atomically(path, &text)
}

fn describe_devices(cost: &CostModel, c: &Candidate, stage: usize) -> String {
    let devices = cost.cluster.devices();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for &d in &c.devices[stage] {
        let dev = &devices[d];
        let name = if dev.speed < 1.0 {
            format!("{}@{}", dev.kind, dev.speed)
        } else {
            dev.kind.clone()
        };
        *counts.entry(name).or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, n)| format!("{n}x{k}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The profile of `--profile`, if given (a profile of another model shape is used as
/// it is, with a warning).
fn read_profile(path: Option<&std::path::Path>, shape: &ModelShape) -> Result<Option<Profile>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let profile: Profile =
        serde_json::from_str(&text).with_context(|| format!("profile {}", path.display()))?;
    if &profile.model != shape {
        tracing::warn!(
            "the profile {} was measured for another model shape; its times are used as they are",
            path.display()
        );
    }
    Ok(Some(profile))
}

/// What `synerfuse plan` found, with what it needs to print it.
struct PlanReport<'a> {
    cost: &'a CostModel,
    outcome: &'a planner::PlanOutcome,
    /// The best grid plan's flags.
    flags: GridFlags,
    tokens_per_step: f64,
    planning_s: f64,
}

pub fn run_plan(args: PlanArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.cluster)
        .with_context(|| format!("reading {}", args.cluster.display()))?;
    let cluster =
        ClusterSpec::from_toml(&text).with_context(|| args.cluster.display().to_string())?;
    let shape = args.model.shape()?;
    let profile = read_profile(args.profile.as_deref(), &shape)?;
    let cost = CostModel::new(shape.clone(), cluster, profile);
    let started = Instant::now();
    let outcome = planner::plan(
        &cost,
        &PlanRequest {
            global_batch_size: args.global_batch_size,
            micro_batch_sizes: args.micro_batch_sizes.clone(),
            top_k: args.top_k,
            tensor_parallel_sizes: args.tensor_model_parallel_sizes.clone(),
            recompute: args.recompute_activations,
            distributed_optimizer: args.use_distributed_optimizer,
        },
    )?;
    let planning_s = started.elapsed().as_secs_f64();
    let Some(best) = outcome.plans.first() else {
        return report_pooled_only(&args, &cost, &outcome, planning_s);
    };
    let flags = (best.to_plan(&cost)?.grid_flags())
        .context("the best grid plan has no SynerFuse flags (a planner bug)")?;
    // Per-replica pipelines are written when they beat the best grid plan.
    let pooled = outcome.pooled_wins();
    if let Some(out) = &args.output {
        match pooled {
            Some(p) => write_atomically(out, &p.to_plan(&cost)?.to_toml()?)?,
            None => write_plan(out, &cost, best)?,
        }
    }
    if let Some(out) = &args.grid_output {
        write_plan(out, &cost, best)?;
    }
    if let Some(out) = &args.uniform_output {
        let uniform = outcome
            .uniform
            .as_ref()
            .context("--uniform-output: no even layout fits this cluster, model and batch")?;
        write_plan(out, &cost, uniform)?;
    }
    if let Some(dir) = &args.uniform_layouts_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (k, layout) in outcome.uniform_layouts.iter().enumerate() {
            let path = dir.join(format!("uniform-{k}.toml"));
            write_plan(&path, &cost, layout)?;
        }
    }
    if let Some(out) = &args.timeline {
        let timeline = match pooled {
            Some(p) => planner::pooled_timeline(&cost, p)?,
            None => planner::timeline(&cost, &outcome.plans[0])?,
        };
        let text = match out.extension().is_some_and(|e| e == "json") {
            true => serde_json::to_string_pretty(&timeline)?,
            false => synerfuse_parallel::timeline::Timeline::svg(&[timeline]),
        };
        write_atomically(out, &text)?;
    }
    let report = PlanReport {
        cost: &cost,
        outcome: &outcome,
        flags,
        tokens_per_step: (args.global_batch_size * shape.seq_length) as f64,
        planning_s,
    };
    if args.json {
        println!("{}", report.json());
        return Ok(());
    }
    report.print();
    print_written(&args, &report.written_flags());
    Ok(())
}

/// The `synerfuse train` flags a per-replica-pipeline plan was priced with: its
/// options, and sequence parallelism with tensor-parallel groups.
fn pooled_train_flags(p: &PooledCandidate) -> Vec<&'static str> {
    let mut flags = p.options.train_flags();
    if p.groups.iter().any(|g| g.size() > 1) {
        flags.push("--sequence-parallel");
    }
    flags
}

/// Where the plan and its timeline went, and how to train it.
fn print_written(args: &PlanArgs, flags: &[&str]) {
    if let Some(out) = &args.output {
        let flags: String = flags.iter().map(|f| format!(" {f}")).collect();
        println!(
            "wrote {} (synerfuse train --plan {}{flags})",
            out.display(),
            out.display()
        );
    }
    if let Some(out) = &args.timeline {
        println!("wrote {} (the best plan's simulated step)", out.display());
    }
}

/// When no grid plan fits but per-replica pipelines do: that plan alone.
fn report_pooled_only(
    args: &PlanArgs,
    cost: &CostModel,
    outcome: &planner::PlanOutcome,
    planning_s: f64,
) -> Result<()> {
    let p = outcome
        .pooled
        .as_ref()
        .context("the planner returned no plan")?;
    if args.grid_output.is_some()
        || args.uniform_output.is_some()
        || args.uniform_layouts_dir.is_some()
    {
        anyhow::bail!(
            "--grid-output / --uniform-output / --uniform-layouts-dir: no grid plan (every replica the same stages) fits this cluster, model and batch; only per-replica pipelines do"
        );
    }
    if let Some(out) = &args.output {
        write_atomically(out, &p.to_plan(cost)?.to_toml()?)?;
    }
    if let Some(out) = &args.timeline {
        let timeline = planner::pooled_timeline(cost, p)?;
        let text = match out.extension().is_some_and(|e| e == "json") {
            true => serde_json::to_string_pretty(&timeline)?,
            false => synerfuse_parallel::timeline::Timeline::svg(&[timeline]),
        };
        write_atomically(out, &text)?;
    }
    let tokens_per_step = (args.global_batch_size * cost.model.seq_length) as f64;
    let replicas = pooled_replicas(cost, p);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "candidates_considered": outcome.considered,
                "planning_time_s": planning_s,
                "bound_tokens_per_s": outcome.bound.tokens_per_s,
                "device_alone_tokens_per_s": outcome.bound.device_tokens_per_s,
                "per_replica_pipelines": pooled_json(outcome, p, replicas, tokens_per_step),
                "written_plan": {
                    "kind": "per_replica_pipelines",
                    "predicted_step_time_s": p.step_time_s,
                    "train_flags": pooled_train_flags(p),
                },
            })
        );
        return Ok(());
    }
    println!(
        "no grid plan (every replica the same stages) fits; per-replica pipelines do ({} candidates considered in {planning_s:.2} s)",
        outcome.considered
    );
    print_pooled_replicas(outcome, p, &replicas, tokens_per_step);
    print_written(args, &pooled_train_flags(p));
    Ok(())
}

impl PlanReport<'_> {
    fn best(&self) -> &Candidate {
        &self.outcome.plans[0]
    }

    /// `--json`: one object.
    fn json(&self) -> serde_json::Value {
        let best = self.best();
        let p = &best.prediction;
        serde_json::json!({
            "pipeline_parallel_size": best.layers.len(),
            "data_parallel_size": best.micro_batches.len(),
            "tensor_parallel_size": 1,
            "layers_per_stage": best.layers,
            "micro_batch_size_per_replica": best.micro_batch_sizes,
            "num_micro_batches_per_replica": best.micro_batches,
            "predicted_step_time_s": p.step_time_s,
            "predicted_tokens_per_s": self.tokens_per_step / p.step_time_s,
            "bubble_fraction": p.bubble_fraction,
            "peak_memory_gb_per_stage": p.stage_memory_bytes.iter().map(|b| b / 1e9).collect::<Vec<_>>(),
            "uniform_step_time_s": self.outcome.uniform.as_ref().map(|u| u.prediction.step_time_s),
            "uniform_layouts": self.outcome.uniform_layouts.iter().map(|u| serde_json::json!({
                "pipeline_parallel_size": u.layers.len(),
                "data_parallel_size": u.micro_batches.len(),
                "micro_batch_size": u.micro_batch_sizes[0],
                "num_micro_batches": u.micro_batches[0],
                "arrangement": format!("{:?}", u.arrangement),
                "predicted_step_time_s": u.prediction.step_time_s,
                "train_flags": u.options.train_flags(),
            })).collect::<Vec<_>>(),
            "synerfuse_flags": self.synerfuse_flags(),
            "train_flags": best.options.train_flags(),
            "recompute_per_stage_and_replica": best.recompute,
            "use_distributed_optimizer": best.options.distributed_optimizer,
            "rank_order": self.flags.rank_order,
            "candidates_considered": self.outcome.considered,
            "planning_time_s": self.planning_s,
            "bound_tokens_per_s": self.outcome.bound.tokens_per_s,
            "device_alone_tokens_per_s": self.outcome.bound.device_tokens_per_s,
            "fraction_of_bound": self.fraction_of_bound(best),
            "optimizer_unpriced_kinds": self.outcome.unpriced_optimizer,
            "runner_ups": self.outcome.plans[1..].iter().map(|c| self.runner_up_json(c)).collect::<Vec<_>>(),
            "per_replica_pipelines": self.outcome.pooled.as_ref().map(|p| self.pooled_json(p)),
            "written_plan": match self.outcome.pooled_wins() {
                Some(p) => serde_json::json!({
                    "kind": "per_replica_pipelines",
                    "predicted_step_time_s": p.step_time_s,
                    "train_flags": pooled_train_flags(p),
                }),
                None => serde_json::json!({
                    "kind": "grid",
                    "predicted_step_time_s": p.step_time_s,
                    "train_flags": best.options.train_flags(),
                }),
            },
        })
    }

    /// SynerFuse's flags for the best grid plan, with its options (its flags recompute
    /// every stage or none: `--recompute-activations` when any stage recomputes).
    fn synerfuse_flags(&self) -> String {
        let best = self.best();
        let mut flags = self.flags.args.clone();
        if best.recompute.iter().flatten().any(|&x| x) {
            flags.push("--recompute-activations".into());
        }
        flags.extend(best.options.train_flags().iter().map(|f| f.to_string()));
        flags.join(" ")
    }

    /// The `synerfuse train` flags beside `--plan` of the plan written.
    fn written_flags(&self) -> Vec<&'static str> {
        match self.outcome.pooled_wins() {
            Some(p) => pooled_train_flags(p),
            None => self.best().options.train_flags(),
        }
    }

    fn pooled_json(&self, p: &PooledCandidate) -> serde_json::Value {
        let replicas = pooled_replicas(self.cost, p);
        pooled_json(self.outcome, p, replicas, self.tokens_per_step)
    }

    fn fraction_of_bound(&self, c: &Candidate) -> f64 {
        (self.outcome.bound).fraction(self.tokens_per_step, c.prediction.step_time_s)
    }

    fn runner_up_json(&self, c: &Candidate) -> serde_json::Value {
        let behind = BehindBy::of(&c.prediction, &self.best().prediction);
        let (part, extra_s) = match behind {
            BehindBy::Compute { extra_s } => ("compute", extra_s),
            BehindBy::Waiting { extra_s } => ("waiting", extra_s),
            BehindBy::AfterPipeline { extra_s } => ("after_pipeline", extra_s),
        };
        serde_json::json!({
            "pipeline_parallel_size": c.layers.len(),
            "data_parallel_size": c.micro_batches.len(),
            "layers_per_stage": c.layers,
            "micro_batch_size_per_replica": c.micro_batch_sizes,
            "num_micro_batches_per_replica": c.micro_batches,
            "origin": c.origin.to_string(),
            "predicted_step_time_s": c.prediction.step_time_s,
            "fraction_of_bound": self.fraction_of_bound(c),
            "behind_by": { "part": part, "extra_s": extra_s, "reason": behind.to_string() },
        })
    }

    /// The human-readable report: the best plan's stages, its prediction against the
    /// even layout, its flags, and the runners-up.
    fn print(&self) {
        let best = self.best();
        let p = &best.prediction;
        println!(
            "best plan: pp {} x dp {} (tp 1), {}{}, {} candidates in {:.3}s",
            best.layers.len(),
            best.micro_batches.len(),
            best.micro_batch_size_text(),
            options_text(best.options),
            self.outcome.considered,
            self.planning_s
        );
        println!(
            "| stage | devices | layers | time/micro-batch (ms) | memory (GB) |\n|---|---|---|---|---|"
        );
        for i in 0..best.layers.len() {
            println!(
                "| {i} | {} | {} | {:.2} | {:.2} |",
                describe_devices(self.cost, best, i),
                best.layers[i],
                p.stage_time_s[i] * 1e3,
                p.stage_memory_bytes[i] / 1e9
            );
        }
        println!(
            "replicas: micro-batches {:?} of size {:?}",
            best.micro_batches, best.micro_batch_sizes
        );
        if best.recompute.iter().flatten().any(|&x| x) {
            println!(
                "recomputes its activations (per stage, per replica; in the plan file): {:?}",
                best.recompute
            );
        }
        println!(
            "predicted: {:.4} s per step ({:.0} tokens/s), bubble {:.1}%, DP all-reduce {:.4} s, optimizer {:.4} s",
            p.step_time_s,
            self.tokens_per_step / p.step_time_s,
            p.bubble_fraction * 100.0,
            p.allreduce_s,
            p.optimizer_s
        );
        println!(
            "bound: {:.0} tokens/s (each device training the model alone, added up); the plan reaches {:.1}% of it",
            self.outcome.bound.tokens_per_s,
            self.fraction_of_bound(best) * 100.0
        );
        if !self.outcome.unpriced_optimizer.is_empty() {
            println!(
                "the optimizer step is not priced on {} (profile them with synerfuse profile)",
                self.outcome.unpriced_optimizer.join(", ")
            );
        }
        if let Some(u) = &self.outcome.uniform {
            println!(
                "uniform layout (even layers and batches, pp {} x dp {}): {:.4} s per step; the plan is {:.2}x faster",
                u.layers.len(),
                u.micro_batches.len(),
                u.prediction.step_time_s,
                u.prediction.step_time_s / p.step_time_s
            );
        }
        println!("flags: {}", self.synerfuse_flags());
        if let Some(pooled) = &self.outcome.pooled {
            self.print_pooled(pooled);
        }
        for (k, c) in self.outcome.plans.iter().enumerate().skip(1) {
            self.print_runner_up(k, c);
        }
    }

    /// The per-replica-pipeline plan: each replica, its step against the grid plan's.
    fn print_pooled(&self, p: &PooledCandidate) {
        let grid = self.best().prediction.step_time_s;
        let verdict = match self.outcome.pooled_wins() {
            Some(_) => {
                "faster than the grid plan: written instead of it (no SynerFuse flags express it)"
            }
            None => "slower than the grid plan",
        };
        println!(
            "per-replica pipelines (devices pooled by group, speed and memory): {:.4} s per step, {:.2}x the grid plan's speed, {:.1}% of the bound; {verdict}",
            p.step_time_s,
            grid / p.step_time_s,
            self.outcome.bound.fraction(self.tokens_per_step, p.step_time_s) * 100.0
        );
        for (r, replica) in pooled_replicas(self.cost, p).iter().enumerate() {
            replica.print(r);
        }
    }

    fn print_runner_up(&self, k: usize, c: &Candidate) {
        let p = &c.prediction;
        let slowest = p
            .stage_time_s
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i);
        println!(
            "runner-up {k}: pp {} x dp {}, layers {:?}, micro-batches {:?}, {}{}: {:.4} s (+{:.1}%, {:.1}% of the bound): {}; bubble {:.1}%, all-reduce {:.4} s, slowest stage {slowest} ({})",
            c.layers.len(),
            c.micro_batches.len(),
            c.layers,
            c.micro_batches,
            c.micro_batch_size_text(),
            options_text(c.options),
            p.step_time_s,
            (p.step_time_s / self.best().prediction.step_time_s - 1.0) * 100.0,
            self.fraction_of_bound(c) * 100.0,
            BehindBy::of(p, &self.best().prediction),
            p.bubble_fraction * 100.0,
            p.allreduce_s,
            describe_devices(self.cost, c, slowest)
        );
    }
}

/// Each replica of a per-replica-pipeline plan: its devices (a tensor-parallel group's
/// kinds joined by `+`), layers, shares and batch.
/// One replica of a per-replica-pipeline plan, as `synerfuse plan` reports it.
#[derive(serde::Serialize)]
struct ReplicaReport {
    /// Per stage, its devices' kinds (`a100+v100` for a tensor-parallel group).
    devices: Vec<String>,
    /// Layers per stage.
    layers: Vec<usize>,
    /// Per stage, whether it recomputes its activations.
    recompute: Option<Vec<bool>>,
    /// Per stage, its tensor-parallel group's shares.
    tensor_parallel_shares: Vec<Vec<u32>>,
    micro_batch_size: usize,
    num_micro_batches: usize,
}

impl ReplicaReport {
    /// `  replica 0: ["a100+v100"] layers [36] (tensor-parallel shares [[5,2]]) micro-batches 8 x 2`.
    fn print(&self, r: usize) {
        let recompute = match &self.recompute {
            Some(flags) if flags.iter().any(|&x| x) => format!(" (recomputes {})", compact(flags)),
            _ => String::new(),
        };
        let shares = match self.tensor_parallel_shares.iter().any(|g| g.len() > 1) {
            true => format!(
                " (tensor-parallel shares {})",
                compact(&self.tensor_parallel_shares)
            ),
            false => String::new(),
        };
        println!(
            "  replica {r}: {} layers {}{shares}{recompute} micro-batches {} x {}",
            compact(&self.devices),
            compact(&self.layers),
            self.num_micro_batches,
            self.micro_batch_size
        );
    }
}

/// `value` as compact JSON (`[4,2]`), as the report prints lists.
fn compact<T: serde::Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// Each replica of a per-replica-pipeline plan, pool by pool.
fn pooled_replicas(cost: &CostModel, p: &PooledCandidate) -> Vec<ReplicaReport> {
    let devices = cost.cluster.devices();
    let mut out = Vec::new();
    for pool in &p.pools {
        for (r, &m) in pool.micro_batches.iter().enumerate() {
            let groups: Vec<_> = pool.devices.iter().map(|row| &p.groups[row[r]]).collect();
            let kind_of = |g: &&TpGroup| {
                let kinds: Vec<&str> = (g.members.iter())
                    .map(|&i| devices[i].kind.as_str())
                    .collect();
                kinds.join("+")
            };
            out.push(ReplicaReport {
                devices: groups.iter().map(kind_of).collect(),
                layers: pool.layers.clone(),
                recompute: p.recompute.get(out.len()).cloned(),
                tensor_parallel_shares: groups.iter().map(|g| g.shares.clone()).collect(),
                micro_batch_size: pool.micro_batch_size,
                num_micro_batches: m,
            });
        }
    }
    out
}
fn pooled_json(
    outcome: &planner::PlanOutcome,
    p: &PooledCandidate,
    replicas: Vec<ReplicaReport>,
    tokens_per_step: f64,
) -> serde_json::Value {
    serde_json::json!({
        "predicted_step_time_s": p.step_time_s,
        "predicted_tokens_per_s": tokens_per_step / p.step_time_s,
        "fraction_of_bound": outcome.bound.fraction(tokens_per_step, p.step_time_s),
        "tensor_parallel_size": p.groups.iter().map(|g| g.size()).max().unwrap_or(1),
        "train_flags": pooled_train_flags(p),
        "reduce_s": p.reduce_s,
        "optimizer_s": p.optimizer_s,
        "replicas": replicas,
    })
}

/// The per-replica-pipeline plan's step and replicas.
fn print_pooled_replicas(
    outcome: &planner::PlanOutcome,
    p: &PooledCandidate,
    replicas: &[ReplicaReport],
    tokens_per_step: f64,
) {
    println!(
        "per-replica pipelines: {:.4} s per step ({:.0} tokens/s), {:.1}% of the bound ({:.0} tokens/s: each device training the model alone, added up)",
        p.step_time_s,
        tokens_per_step / p.step_time_s,
        outcome.bound.fraction(tokens_per_step, p.step_time_s) * 100.0,
        outcome.bound.tokens_per_s
    );
    for (r, replica) in replicas.iter().enumerate() {
        replica.print(r);
    }
}

/// `, --recompute-activations` and the like, or nothing.
fn options_text(options: planner::TrainOptions) -> String {
    options
        .train_flags()
        .iter()
        .map(|f| format!(", {f}"))
        .collect()
}
