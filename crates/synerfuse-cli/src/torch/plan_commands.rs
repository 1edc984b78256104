//! `synerfuse profile` (measure per-layer costs and links on the ranks it runs on) and
//! `synerfuse plan` (search the best heterogeneous layout for a cluster file).

use crate::files::write_atomically;
use crate::model_flags::{ModelFlags, PrecisionFlags};
use crate::plan_report::{
    pool_reports, pooled_json, pooled_replicas, pooled_train_flags, print_pooled_replicas,
    ExpertReport, PlanReport, PooledOnlyReport, WrittenPlan,
};
use crate::plan_try::{plans_to_try, print_try_report, try_plans, TryReport, TrySettings};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use synerfuse_model::tch::{self, Device};
use synerfuse_model::{DeviceRequest, LlamaConfig, ResolveDevice};
use synerfuse_plan::RunReduction;
use synerfuse_plan::{ModelShape, Precision};
use synerfuse_planner::cluster::ClusterSpec;
use synerfuse_planner::cost::CostModel;
use synerfuse_planner::planner::{self, Candidate, PlanRequest};
use synerfuse_planner::profile::Profile;
use synerfuse_train::comm::{launcher_local_rank, launcher_rank, MpiRuntime};
use synerfuse_train::profiler::{self, ProfileConfig, ProfileError};

/// The model to plan or profile: a Hugging Face `config.json`, or Megatron's model flags
/// (`train`'s, from the same definition).
#[derive(Args, Debug, Clone)]
pub struct PricedModel {
    /// A Hugging Face LLaMA or Mixtral config.json
    #[arg(long, help_heading = "Model")]
    model: Option<PathBuf>,
    /// Tokenizer vocabulary (padded as Megatron pads it: --make-vocab-size-divisible-by)
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 32000, help_heading = "Model")]
    vocab_size: usize,
    #[command(flatten)]
    flags: ModelFlags,
}

impl PricedModel {
    /// `--seq-length` (required but by `profile --calibrate`, whose model is the
    /// profile's).
    fn seq_length(&self) -> Result<usize> {
        self.flags.seq_length()
    }

    /// Whether any model flag was given (the vocabulary has a default).
    pub(crate) fn given(&self) -> bool {
        self.model.is_some() || self.flags.given()
    }

    fn config(&self) -> Result<LlamaConfig> {
        if launcher_rank().is_none_or(|(rank, _)| rank == 0) {
            self.flags.warn_ignored();
        }
        if let Some(path) = &self.model {
            let config = LlamaConfig::from_hf_file(path)?;
            return (self.flags).with_hf_model(config, &format!("--model {}", path.display()));
        }
        let layers =
            (self.flags.num_layers).context("--num-layers is required (or --model config.json)")?;
        (self.flags).config(layers, self.vocab_size, "--model config.json")
    }

    fn shape(&self) -> Result<ModelShape> {
        Ok(profiler::model_shape(&self.config()?, self.seq_length()?))
    }
}

/// `synerfuse profile`.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: PricedModel,
    /// Micro-batch sizes to measure (by default those `plan` tries; others are
    /// interpolated between the measured sizes around them)
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1,2,4,8")]
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
    /// The precision to time (`--bf16` or `--fp16`, as `train` runs them: the profile of
    /// the precision that will train) [default: fp32]
    #[command(flatten)]
    precision: PrecisionFlags,
    /// Calibrate a profile (--profile) from these `train --log-json` logs instead of
    /// measuring: each run priced again, term by term against its measured spans, and
    /// the fitted terms written into the profile (--output). The model is the profile's.
    #[arg(long, num_args = 1.., conflicts_with_all = ["nproc", "emulate_device_speed", "bf16", "fp16", "device_kind"])]
    calibrate: Vec<PathBuf>,
    /// The profile --calibrate starts from
    #[arg(long, requires = "calibrate")]
    profile: Option<PathBuf>,
    /// With --calibrate: print the fitted terms and each run's prediction as JSON
    #[arg(long, requires = "calibrate")]
    json: bool,
    /// Where to write the profile JSON
    #[arg(long)]
    output: PathBuf,
}

pub fn run_profile(args: ProfileArgs) -> Result<()> {
    if !args.calibrate.is_empty() {
        if args.model.given() {
            bail!("--calibrate takes the model from the profile (--profile): drop the model flags");
        }
        let profile = (args.profile.as_deref())
            .context("--calibrate needs the profile to calibrate (--profile FILE)")?;
        return crate::calibrate_command::run(profile, &args.calibrate, &args.output, args.json);
    }
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
    let gpu_rank = synerfuse_train::comm::one_gpu::cuda_local_rank(local_rank);
    let device = args.device.resolve_for_local_rank(gpu_rank)?;
    let kind = args.device_kind.clone().unwrap_or_else(|| match device {
        Device::Cpu => "cpu".into(),
        // The catalogue slug of this GPU, which a cluster file names as its `kind`.
        Device::Cuda(ordinal) => synerfuse_train::device_info::cuda_device_names()
            .get(ordinal)
            .and_then(|name| synerfuse_planner::cluster::catalogue_slug_for_device_name(name))
            .unwrap_or("cuda")
            .into(),
        _ => "cuda".into(),
    });
    let config = ProfileConfig {
        model: args.model.config()?,
        sequence_length: args.model.seq_length()?,
        micro_batch_sizes: args.micro_batch_sizes.clone(),
        repeats: args.repeats,
        emulate_speed: args.emulate_device_speed,
        precision: args.precision.asked().unwrap_or(Precision::Fp32),
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
            calibration: None,
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
    model: PricedModel,
    #[arg(long, value_parser = crate::values::positive_count)]
    global_batch_size: usize,
    /// Micro-batch sizes to consider
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1,2,4,8")]
    micro_batch_sizes: Vec<usize>,
    /// Tensor-parallel sizes to consider for per-replica pipelines (groups of a node's
    /// devices, unequal ones with unequal shares; 1: none)
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1,2,4,8")]
    tensor_model_parallel_sizes: Vec<usize>,
    /// Context-parallel sizes to consider for grid plans where memory rules out plans
    /// without (groups of a node's devices splitting every sequence, unequal ones in
    /// unequal token shares; 1: none, the default: long sequences ask for `1,2,4,8`)
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1")]
    context_parallel_sizes: Vec<usize>,
    /// Expert-parallel sizes to consider for a mixture of experts, in grid plans and in
    /// the expert layouts of each pool of alike devices (those dividing --num-experts and
    /// the replicas; each stage's experts divided over that many replicas, placed by
    /// their pace, memory and tokens per expert; ignored for a dense model)
    #[arg(long, value_parser = crate::values::positive_count, value_delimiter = ',', default_value = "1,2,4,8")]
    expert_model_parallel_sizes: Vec<usize>,
    /// A `synerfuse train --log-json` log of a run of this model: the tokens each expert
    /// took (moe.tokens_per_expert, summed over its steps) place the experts and price
    /// the most loaded member [default: equal]
    #[arg(long, value_name = "LOG.json")]
    expert_load: Option<PathBuf>,
    /// Whether plans recompute activations: auto (each stage that would not fit
    /// otherwise), on (bare flag: every stage) or off
    #[arg(long, value_name = "auto|on|off", default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    recompute_activations: planner::Choice,
    /// Whether plans shard the optimizer over each stage's replicas (in proportion to
    /// memory; priced for every plan): auto, on (bare flag) or off
    #[arg(long, value_name = "auto|on|off", default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    use_distributed_optimizer: planner::Choice,
    /// Price each gradient reduction in buckets started inside the last backward, as
    /// `train` runs it by default
    #[arg(long)]
    overlap_grad_reduce: bool,
    /// Parameters (elements) per gradient-reduction bucket, as `train
    /// --ddp-bucket-size` (written among the plan's training flags); default max(40M,
    /// 1M x the data-parallel size), as Megatron's
    #[arg(long, value_parser = crate::values::positive_count)]
    ddp_bucket_size: Option<usize>,
    /// Price each gradient reduction after the whole pipeline, whole, as `train
    /// --no-overlap-grad-reduce` runs it (written among the plan's training flags)
    #[arg(long, conflicts_with = "overlap_grad_reduce")]
    no_overlap_grad_reduce: bool,
    /// Price the distributed optimizer's parameter gathers inside the next forward, as
    /// `train --overlap-param-gather` runs them (written among the training flags of
    /// plans that shard their optimizer); without it they follow the optimizer, exposed
    #[arg(long, conflicts_with = "no_overlap_grad_reduce")]
    overlap_param_gather: bool,
    /// The job's precision: `--bf16` (the default here) or `--fp16` (fp16 on every
    /// device, dynamic loss scaling); under bf16, devices without it compute in fp16
    #[command(flatten)]
    precision: PrecisionFlags,
    /// Keep bf16 on every device (plans are for bf16 unless --fp16): refuse a cluster
    /// with devices that have no bf16 (by default they compute in fp16, priced at their
    /// fp16 peak, and the plan says so)
    #[arg(long, conflicts_with = "fp16")]
    no_fp16_fallback: bool,
    /// Price every gradient reduction flat over its members, as `train
    /// --no-hierarchical-reduction` runs it (written among the plan's training flags);
    /// by default one whose members span nodes is priced island by island
    #[arg(long)]
    no_hierarchical_reduction: bool,
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
    /// Train the K best predicted plans for --try-iters steps each (with the training
    /// arguments after `--`, under `--nproc`), report predicted against measured, and
    /// write the measured fastest to --output; each plan, its log and output go to
    /// OUTPUT.try/
    #[arg(long = "try", value_name = "K", value_parser = crate::values::positive_count, requires = "output")]
    try_plans: Option<usize>,
    /// Steps each tried plan trains; the first third are warm-up, not timed
    #[arg(long, default_value_t = 9, requires = "try_plans")]
    try_iters: u64,
    /// `synerfuse train`'s arguments for the tried plans (data, tokenizer, model,
    /// optimizer), after `--`; --try sets --plan, --nproc, --train-iters and --log-json
    #[arg(last = true, value_name = "TRAIN ARGS")]
    train_args: Vec<String>,
}

impl PlanArgs {
    /// How training will reduce gradients: what the plans are priced with.
    fn reduction(&self) -> RunReduction {
        RunReduction {
            overlap_grad_reduce: !self.no_overlap_grad_reduce,
            ddp_bucket_size: self.ddp_bucket_size,
            overlap_param_gather: self.overlap_param_gather,
            hierarchical: !self.no_hierarchical_reduction,
        }
    }

    /// `--try`'s settings, when asked for.
    fn try_settings(&self) -> Option<TrySettings> {
        let (plans, output) = (self.try_plans?, self.output.as_ref()?);
        let mut dir = output.clone().into_os_string();
        dir.push(".try");
        Some(TrySettings {
            plans,
            iters: self.try_iters,
            train_args: self.train_args.clone(),
            dir: dir.into(),
        })
    }
}

/// Writes the grid plan `c` in the general plan's file form (`[[replica]]` tables, which
/// keep the grid's rank order and say which stages recompute), under a temporary name
/// first.
fn write_plan(path: &std::path::Path, cost: &CostModel, c: &Candidate) -> Result<()> {
    let text = c.to_plan(cost)?.to_toml()?;
    write_atomically(path, &text)
}

/// `--expert-load`'s tokens per expert per MoE layer, if given.
fn read_expert_load(
    path: Option<&std::path::Path>,
    shape: &ModelShape,
) -> Result<Option<Vec<Vec<f64>>>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let load = planner::measured_expert_load(&text, shape)
        .with_context(|| format!("--expert-load {}", path.display()))?;
    Ok(Some(load))
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

pub fn run_plan(args: PlanArgs) -> Result<()> {
    if !args.train_args.is_empty() && args.try_plans.is_none() {
        bail!("training arguments after -- are for --try; without it, nothing trains");
    }
    if args.overlap_param_gather && args.use_distributed_optimizer == planner::Choice::Off {
        bail!("--overlap-param-gather overlaps the distributed optimizer's gathers; --use-distributed-optimizer off has none");
    }
    let settings = args.try_settings();
    if let Some(settings) = &settings {
        settings.check()?;
    }
    let text = std::fs::read_to_string(&args.cluster)
        .with_context(|| format!("reading {}", args.cluster.display()))?;
    let cluster =
        ClusterSpec::from_toml(&text).with_context(|| args.cluster.display().to_string())?;
    let shape = args.model.shape()?;
    let profile = read_profile(args.profile.as_deref(), &shape)?;
    if let Some(settings) = &settings {
        check_try_model(settings, &shape)?;
    }
    let cost = CostModel {
        expert_load: read_expert_load(args.expert_load.as_deref(), &shape)?,
        overlap_grad_reduce: args.reduction().overlap_grad_reduce,
        ddp_bucket_size: args.reduction().ddp_bucket_size,
        overlap_param_gather: args.reduction().overlap_param_gather,
        hierarchical_reduction: args.reduction().hierarchical,
        precision: args.precision.asked().unwrap_or(Precision::Bf16),
        fp16_fallback: !args.no_fp16_fallback,
        ..CostModel::new(shape.clone(), cluster, profile)
    };
    cost.check_precisions()?;
    log_precisions(&cost);
    if let Some(e) = shape.experts {
        tracing::info!(
            "{} experts per MoE layer, {} per token: priced with the top-{} experts' compute and each replica's part of the experts; expert-parallel sizes {:?} searched for grid plans (then each stage its own where faster) and per-pool layouts, experts placed by pace, memory and tokens per expert",
            e.num_experts,
            e.top_k,
            e.top_k,
            args.expert_model_parallel_sizes
        );
    }
    let started = Instant::now();
    let outcome = planner::plan(&cost, &plan_request(&args))?;
    let planning_s = started.elapsed().as_secs_f64();
    let tried = match &settings {
        Some(settings) => {
            let plans = plans_to_try(&cost, &outcome)?;
            let tokens_per_step = (args.global_batch_size * shape.seq_length) as f64;
            // Calibrated only where the profile is of this model.
            let profile = cost.profile.as_ref().filter(|p| p.model == shape);
            Some(try_plans(
                settings,
                &plans,
                profile,
                (&outcome.bound, tokens_per_step),
            )?)
        }
        None => None,
    };
    let Some(best) = outcome.plans.first() else {
        return report_pooled_only(&args, &cost, &outcome, planning_s, tried.as_ref());
    };
    // Megatron's flags give even parts of the experts: the plan written may place them
    // by pace.
    let flags = best.to_even_plan(&cost)?.grid_flags();
    if flags.is_none() && best.stage_expert_parallel.is_empty() {
        bail!("the best grid plan has no SynerFuse flags (a planner bug)");
    }
    write_outputs(&args, &cost, &outcome, tried.as_ref())?;
    let report = PlanReport {
        cost: &cost,
        outcome: &outcome,
        flags,
        tokens_per_step: (args.global_batch_size * shape.seq_length) as f64,
        planning_s,
        tried: tried.is_some(),
        experts: best.expert_placement(&cost)?,
    };
    if args.json {
        let json = match &tried {
            Some(t) => report
                .json()
                .written(t.written_plan(&outcome.bound, report.tokens_per_step)),
            None => report.json(),
        };
        return print_json(json, tried.as_ref());
    }
    report.print();
    match &tried {
        Some(tried) => {
            print_try_report(tried);
            print_written(&args, &tried.best().train_flags);
        }
        None => print_written(&args, &report.written_flags()),
    }
    Ok(())
}

/// `--try`'s training arguments must build the model the plans are priced for.
/// Says which kinds compute in another precision than the job's (fp16 for a bf16 job on
/// devices without bf16), once per kind.
fn log_precisions(cost: &CostModel) {
    let mut said = std::collections::BTreeSet::new();
    for device in cost.cluster.devices() {
        let precision = cost.precision_of(&device);
        if precision != cost.precision && said.insert(device.kind.clone()) {
            let peak = device.spec.map_or(0.0, |s| s.peak(precision));
            tracing::info!(
                "{}: no {}, so its ranks compute in {precision}, priced at its {precision} peak ({peak} TFLOP/s); the plan names each rank's precision (--no-fp16-fallback refuses such devices)",
                device.kind,
                cost.precision
            );
        }
    }
}

fn check_try_model(settings: &TrySettings, shape: &ModelShape) -> Result<()> {
    let trained = crate::train_command::trained_model_shape(&settings.train_args, shape.num_layers)
        .context("--try: the training arguments after --")?;
    let (trained, planned) = (
        serde_json::to_value(&trained)?,
        serde_json::to_value(shape)?,
    );
    let differ: Vec<String> = (trained.as_object().into_iter().flatten())
        .filter(|(key, value)| planned.get(key.as_str()) != Some(value))
        .map(|(key, value)| format!("{key} {value} (priced: {})", planned[key.as_str()]))
        .collect();
    if !differ.is_empty() {
        bail!("--try: the training arguments after -- build another model than the plans are priced for: {}; give plan the model that training builds (--vocab-size: the tokenizer's)", differ.join(", "));
    }
    Ok(())
}

/// The planner's request from `synerfuse plan`'s flags.
fn plan_request(args: &PlanArgs) -> PlanRequest {
    PlanRequest {
        global_batch_size: args.global_batch_size,
        micro_batch_sizes: args.micro_batch_sizes.clone(),
        top_k: args.top_k,
        tensor_parallel_sizes: args.tensor_model_parallel_sizes.clone(),
        context_parallel_sizes: args.context_parallel_sizes.clone(),
        recompute: args.recompute_activations,
        distributed_optimizer: args.use_distributed_optimizer,
        expert_parallel_sizes: args.expert_model_parallel_sizes.clone(),
    }
}

/// The files `synerfuse plan` was asked for: the plan to train (`--output`: what `--try`
/// measured fastest, else the per-replica plan where it wins, else the best grid plan),
/// the best grid plan, the even layouts and the predicted timeline.
fn write_outputs(
    args: &PlanArgs,
    cost: &CostModel,
    outcome: &planner::PlanOutcome,
    tried: Option<&TryReport>,
) -> Result<()> {
    let best = &outcome.plans[0];
    // Per-replica pipelines are written when they beat the best grid plan.
    let pooled = outcome.pooled_wins();
    if let Some(out) = &args.output {
        let plan = match (tried, pooled) {
            (Some(tried), _) => tried.best().plan.clone(),
            (None, Some(p)) => p.to_plan(cost)?,
            (None, None) => best.to_plan(cost)?,
        };
        warn_unmeasured(cost, &plan);
        write_atomically(out, &plan.to_toml()?)?;
    }
    if let Some(out) = &args.grid_output {
        write_plan(out, cost, best)?;
    }
    if let Some(out) = &args.uniform_output {
        let uniform = outcome
            .uniform
            .as_ref()
            .context("--uniform-output: no even layout fits this cluster, model and batch")?;
        write_plan(out, cost, uniform)?;
    }
    if let Some(dir) = &args.uniform_layouts_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (k, layout) in outcome.uniform_layouts.iter().enumerate() {
            let path = dir.join(format!("uniform-{k}.toml"));
            write_plan(&path, cost, layout)?;
        }
    }
    if let Some(out) = &args.timeline {
        let timeline = match pooled {
            Some(p) => planner::pooled_timeline(cost, p)?,
            None => planner::timeline(cost, &outcome.plans[0])?,
        };
        let text = match out.extension().is_some_and(|e| e == "json") {
            true => serde_json::to_string_pretty(&timeline)?,
            false => synerfuse_plan::timeline::Timeline::svg(&[timeline]),
        };
        write_atomically(out, &text)?;
    }
    Ok(())
}

/// `--json`'s one object: the report, and what `--try` measured.
fn print_json(report: impl serde::Serialize, tried: Option<&TryReport>) -> Result<()> {
    #[derive(serde::Serialize)]
    struct WithTried<'a, T> {
        #[serde(flatten)]
        report: T,
        #[serde(skip_serializing_if = "Option::is_none")]
        tried: Option<&'a TryReport>,
    }
    println!("{}", serde_json::to_string(&WithTried { report, tried })?);
    Ok(())
}

/// Warns of the micro-batch sizes `plan` runs (a short last micro-batch included) that
/// the profile did not measure on a device kind it measured: those are interpolated
/// between measured sizes, or extrapolated.
fn warn_unmeasured(cost: &CostModel, plan: &synerfuse_plan::Plan) {
    let Some(profile) = &cost.profile else {
        return;
    };
    let mut missing: BTreeMap<&str, std::collections::BTreeSet<usize>> = BTreeMap::new();
    for replica in plan.replicas() {
        let kinds = (replica.placements.iter()).filter_map(|p| p.kind.as_deref());
        for kind in kinds {
            let Some(measured) = profile.devices.get(kind) else {
                continue;
            };
            let unmeasured = (replica.batch.sizes().iter()).filter(|b| !measured.contains_key(b));
            missing.entry(kind).or_default().extend(unmeasured);
        }
    }
    for (kind, sizes) in missing.into_iter().filter(|(_, s)| !s.is_empty()) {
        let sizes: Vec<usize> = sizes.into_iter().collect();
        tracing::warn!(
            "the profile has no {kind} measurement at micro-batch sizes {sizes:?}, which the written plan runs: they are interpolated between the measured sizes around them, or extrapolated (synerfuse profile --micro-batch-sizes measures them)"
        );
    }
}

/// Where the plan and its timeline went, and how to train it.
fn print_written(args: &PlanArgs, flags: &[String]) {
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
    tried: Option<&TryReport>,
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
        let plan = match tried {
            Some(tried) => tried.best().plan.clone(),
            None => p.to_plan(cost)?,
        };
        warn_unmeasured(cost, &plan);
        write_atomically(out, &plan.to_toml()?)?;
    }
    if let Some(out) = &args.timeline {
        let timeline = planner::pooled_timeline(cost, p)?;
        let text = match out.extension().is_some_and(|e| e == "json") {
            true => serde_json::to_string_pretty(&timeline)?,
            false => synerfuse_plan::timeline::Timeline::svg(&[timeline]),
        };
        write_atomically(out, &text)?;
    }
    let tokens_per_step = (args.global_batch_size * cost.model.seq_length) as f64;
    let replicas = pooled_replicas(cost, p);
    let pools = pool_reports(cost, p);
    if args.json {
        let report = PooledOnlyReport {
            candidates_considered: outcome.considered,
            folded: outcome.folded,
            planning_time_s: planning_s,
            bound_tokens_per_s: outcome.bound.tokens_per_s,
            device_alone_tokens_per_s: outcome.bound.device_tokens_per_s.clone(),
            per_replica_pipelines: pooled_json(outcome, p, (pools, replicas), tokens_per_step),
            expert_layout: ExpertReport::new(outcome, tokens_per_step),
            integer_split_tokens_per_s: outcome.bound.integer_split_tokens_per_s,
            written_plan: match tried {
                Some(t) => t.written_plan(&outcome.bound, tokens_per_step),
                None => WrittenPlan::pooled(outcome, p, tokens_per_step),
            },
        };
        return print_json(report, tried);
    }
    println!(
        "no grid plan (every replica the same stages) fits; per-replica pipelines do ({} candidates considered in {planning_s:.2} s)",
        outcome.considered
    );
    crate::plan_report::print_fold(outcome);
    print_pooled_replicas(outcome, p, (&pools, &replicas), tokens_per_step);
    if let Some(expert) = ExpertReport::new(outcome, tokens_per_step) {
        expert.print();
    }
    if let Some(tried) = tried {
        print_try_report(tried);
    }
    let flags = tried.map_or_else(|| pooled_train_flags(p), |t| t.best().train_flags.clone());
    print_written(args, &flags);
    Ok(())
}
