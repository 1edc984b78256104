//! `synerfuse profile` (measure per-layer costs and links on the ranks it runs on) and
//! `synerfuse plan` (search the best heterogeneous layout for a cluster file).

use anyhow::{bail, Context, Result};
use clap::Args;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::{BackwardFrom, DeviceRequest, LlamaConfig, MegatronModelArgs, Stage};
use synerfuse_parallel::cluster::ClusterSpec;
use synerfuse_parallel::cost::{CostModel, MeasuredCosts, MeasuredNetwork, ModelShape, Profile};
use synerfuse_parallel::planner::{self, Candidate, PlanRequest};
use synerfuse_train::comm::{launcher_local_rank, launcher_rank, MpiRuntime};
use synerfuse_train::emulation::{ComputeSpan, Emulation};

/// The model to plan or profile: a Hugging Face `config.json`, or Megatron's flags.
#[derive(Args, Debug, Clone)]
pub struct ModelFlags {
    /// A Hugging Face LLaMA config.json
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    num_layers: Option<usize>,
    #[arg(long)]
    hidden_size: Option<usize>,
    #[arg(long)]
    num_attention_heads: Option<usize>,
    /// Key/value heads (grouped-query attention)
    #[arg(long)]
    num_query_groups: Option<usize>,
    #[arg(long)]
    ffn_hidden_size: Option<usize>,
    /// Tokenizer vocabulary (padded to a multiple of 128 as Megatron does)
    #[arg(long, default_value_t = 32000)]
    vocab_size: usize,
    #[arg(long)]
    untie_embeddings_and_output_weights: bool,
    #[arg(long)]
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
        let c = self.config()?;
        Ok(ModelShape {
            num_layers: c.num_layers,
            hidden_size: c.hidden_size,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            ffn_hidden_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            seq_length: self.seq_length,
            tied: c.tie_word_embeddings,
        })
    }
}

/// `synerfuse profile`.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: ModelFlags,
    /// Micro-batch sizes to measure
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    micro_batch_sizes: Vec<usize>,
    /// cpu, cuda, cuda:N or auto
    #[arg(long, default_value = "auto")]
    device: DeviceRequest,
    /// The device kind the costs are filed under (a cluster file's `kind`) [default: cpu or the GPU's name]
    #[arg(long)]
    device_kind: Option<String>,
    /// Timed repetitions (the median is kept)
    #[arg(long, default_value_t = 5, value_parser = crate::train_command::positive_count)]
    repeats: usize,
    /// Start N ranks here (mpirun) and also measure p2p and all-reduce between them
    #[arg(long, value_parser = crate::train_command::positive_count)]
    nproc: Option<usize>,
    /// Profile as an emulated device at this speed (as `train` emulates it: CPU time /
    /// speed on CPU ranks) and file the costs at speed 1, so a cluster file's `speed`
    /// scales them. Keep N x speed within the machine's cores.
    #[arg(long)]
    emulate_device_speed: Option<f64>,
    /// Where to write the profile JSON
    #[arg(long)]
    output: PathBuf,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds of forward and backward of `stage` on a micro-batch (medians of `repeats`);
/// under emulation, the emulated durations scaled back to speed 1.
fn time_stage(
    stage: &Stage,
    b: usize,
    s: usize,
    repeats: usize,
    emulation: Option<&Emulation>,
) -> Result<(f64, f64)> {
    let c = stage.config();
    let device = stage.device();
    let input = if stage.is_first() {
        Tensor::randint(
            c.vocab_size as i64,
            [b as i64, s as i64],
            (Kind::Int64, device),
        )
    } else {
        Tensor::randn(
            [b as i64, s as i64, c.hidden_size as i64],
            (Kind::Float, device),
        )
    };
    let labels = Tensor::randint(
        c.vocab_size as i64,
        [b as i64, s as i64],
        (Kind::Int64, device),
    );
    let scale = emulation.map_or(1.0, |e| e.speed);
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    for round in 0..repeats + 1 {
        let span = ComputeSpan::start();
        let pass = stage.forward_train(&input, None, None)?;
        let _ = pass.output.sum(Kind::Float).double_value(&[]);
        let f = Emulation::account(emulation, span).as_secs_f64() * scale;
        let span = ComputeSpan::start();
        if stage.is_last() {
            let loss = |logits: &Tensor| Stage::loss(logits, &labels, None).0;
            stage.backward(pass, BackwardFrom::Loss(&loss))?;
        } else {
            let grad = pass.output.ones_like();
            stage.backward(pass, BackwardFrom::OutputGrad(&grad))?;
        }
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        let bk = Emulation::account(emulation, span).as_secs_f64() * scale;
        stage.var_store().variables().values().for_each(|v| {
            let mut v = v.shallow_clone();
            v.zero_grad()
        });
        if round > 0 {
            fwd.push(f);
            bwd.push(bk);
        }
    }
    Ok((median(fwd), median(bwd)))
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
    let request = args.device;
    let device = match request {
        DeviceRequest::Auto | DeviceRequest::Cuda(None) if tch::Cuda::is_available() => {
            Device::Cuda(local_rank % tch::Cuda::device_count().max(1) as usize)
        }
        other => other.resolve()?,
    };
    let kind = args.device_kind.clone().unwrap_or_else(|| match device {
        Device::Cpu => "cpu".into(),
        _ => "cuda".into(),
    });
    let emulation = match args.emulate_device_speed {
        Some(speed) if !(speed > 0.0 && speed <= 1.0) => {
            bail!("--emulate-device-speed {speed}: must be in (0, 1]")
        }
        Some(speed) => Some(Emulation { speed, device }),
        None => None,
    };
    let shape = args.model.shape()?;
    let mut base = args.model.config()?;
    base.num_layers = 3;
    let s = args.model.seq_length;
    let mut table = BTreeMap::new();
    for &b in &args.micro_batch_sizes {
        // A middle layer alone, then the first and last stages with one layer each: the
        // differences are the embedding and the head (with loss).
        let middle = Stage::new(&base, 1..2, device)?;
        let (lf, lb) = time_stage(&middle, b, s, args.repeats, emulation.as_ref())?;
        let first = Stage::new(&base, 0..1, device)?;
        let (ff, fb) = time_stage(&first, b, s, args.repeats, emulation.as_ref())?;
        let last = Stage::new(&base, 2..3, device)?;
        let (hf, hb) = time_stage(&last, b, s, args.repeats, emulation.as_ref())?;
        let costs = [
            lf,
            lb,
            (ff + fb - lf - lb).max(0.0),
            (hf + hb - lf - lb).max(0.0),
        ];
        // Mean over ranks (they ran at the same time, sharing the machine as training will).
        let mut t = Tensor::from_slice(&costs);
        world.all_reduce_sum(&mut t)?;
        let mean: Vec<f64> = Vec::<f64>::try_from(&t)?
            .into_iter()
            .map(|x| x / world.size() as f64)
            .collect();
        table.insert(
            b,
            MeasuredCosts {
                layer_fwd_s: mean[0],
                layer_bwd_s: mean[1],
                embedding_s: mean[2],
                head_s: mean[3],
                layer_activation_bytes: shape.layer_activation_bytes(b, 4.0, device != Device::Cpu),
            },
        );
    }
    let network = (world.size() > 1)
        .then(|| measure_network(&world))
        .transpose()?;
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

/// p2p bandwidth (rank 0 → 1, 16 MB), latency (8 bytes) and all-reduce bus bandwidth.
fn measure_network(world: &synerfuse_train::comm::MpiCommunicator) -> Result<MeasuredNetwork> {
    let big = Tensor::ones([4 << 20], (Kind::Float, Device::Cpu));
    let small = Tensor::ones([2], (Kind::Float, Device::Cpu));
    let mut p2p = Vec::new();
    let mut latency = Vec::new();
    for (tensor, out) in [(&big, &mut p2p), (&small, &mut latency)] {
        for _ in 0..5 {
            world.barrier();
            let started = Instant::now();
            if world.rank() == 0 {
                world.send(tensor, 1, 3)?;
                let mut ack = small.zeros_like();
                world.recv(&mut ack, 1, 4)?;
            } else if world.rank() == 1 {
                let mut inbox = tensor.zeros_like();
                world.recv(&mut inbox, 0, 3)?;
                world.send(&small, 0, 4)?;
            }
            out.push(started.elapsed().as_secs_f64());
        }
    }
    let lat = median(latency) / 2.0;
    let p2p_s = (median(p2p) - lat).max(1e-9);
    let mut times = Vec::new();
    for _ in 0..5 {
        let mut t = big.shallow_clone().copy();
        world.barrier();
        let started = Instant::now();
        world.all_reduce_sum(&mut t)?;
        times.push(started.elapsed().as_secs_f64());
    }
    let n = world.size() as f64;
    let bytes = (big.numel() * 4) as f64;
    // Broadcast rank 0's figures so every rank agrees.
    let mut figures = Tensor::from_slice(&[
        bytes / p2p_s,
        2.0 * (n - 1.0) / n * bytes / median(times),
        lat,
    ]);
    world.broadcast(&mut figures, 0)?;
    let f: Vec<f64> = Vec::try_from(&figures)?;
    Ok(MeasuredNetwork {
        p2p_bytes_per_s: f[0],
        allreduce_bytes_per_s: f[1],
        latency_s: f[2],
        ranks: world.size(),
    })
}

/// `synerfuse plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The cluster file (TOML)
    #[arg(long)]
    cluster: PathBuf,
    #[command(flatten)]
    model: ModelFlags,
    #[arg(long)]
    global_batch_size: usize,
    /// Micro-batch sizes to consider
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    micro_batch_sizes: Vec<usize>,
    /// A `synerfuse profile` output (overrides the catalogue)
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Plans to show
    #[arg(long, default_value_t = 3)]
    top_k: usize,
    /// Where to write the best plan (TOML, for `synerfuse train --plan`)
    #[arg(long)]
    output: Option<PathBuf>,
    /// Also write the even layout (the baseline) as a plan here
    #[arg(long)]
    uniform_output: Option<PathBuf>,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
}

fn write_plan(path: &std::path::Path, plan: &synerfuse_parallel::ParallelPlan) -> Result<()> {
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, plan.to_toml()?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
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

pub fn run_plan(args: PlanArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.cluster)
        .with_context(|| format!("reading {}", args.cluster.display()))?;
    let cluster =
        ClusterSpec::from_toml(&text).with_context(|| args.cluster.display().to_string())?;
    let shape = args.model.shape()?;
    let profile = match &args.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let p: Profile = serde_json::from_str(&text)
                .with_context(|| format!("profile {}", path.display()))?;
            if p.model != shape {
                tracing::warn!(
                    "the profile {} was measured for another model shape; its times are used as they are",
                    path.display()
                );
            }
            Some(p)
        }
        None => None,
    };
    let cost = CostModel::new(shape.clone(), cluster, profile);
    let started = Instant::now();
    let outcome = planner::plan(
        &cost,
        &PlanRequest {
            global_batch_size: args.global_batch_size,
            micro_batch_sizes: args.micro_batch_sizes.clone(),
            top_k: args.top_k,
        },
    )?;
    let planning_s = started.elapsed().as_secs_f64();
    let best = &outcome.plans[0];
    let plan = planner::to_parallel_plan(&cost, best)?;
    let flags = plan.to_synerfuse_args().join(" ");
    let tokens = (args.global_batch_size * shape.seq_length) as f64;
    if let Some(out) = &args.output {
        write_plan(out, &plan)?;
    }
    if let Some(out) = &args.uniform_output {
        let uniform = outcome
            .uniform
            .as_ref()
            .context("--uniform-output: no even layout fits this cluster, model and batch")?;
        write_plan(out, &planner::to_parallel_plan(&cost, uniform)?)?;
    }
    if args.json {
        let j = serde_json::json!({
            "pipeline_parallel_size": best.layers.len(),
            "data_parallel_size": best.micro_batches.len(),
            "tensor_parallel_size": 1,
            "layers_per_stage": best.layers,
            "micro_batch_size_per_replica": best.micro_batch_sizes,
            "num_micro_batches_per_replica": best.micro_batches,
            "predicted_step_time_s": best.prediction.step_time_s,
            "predicted_tokens_per_s": tokens / best.prediction.step_time_s,
            "bubble_fraction": best.prediction.bubble_fraction,
            "peak_memory_gb_per_stage": best.prediction.stage_memory_bytes.iter().map(|b| b / 1e9).collect::<Vec<_>>(),
            "uniform_step_time_s": outcome.uniform.as_ref().map(|u| u.prediction.step_time_s),
            "synerfuse_flags": flags,
            "rank_order": plan.topology.order,
            "candidates_considered": outcome.considered,
            "planning_time_s": planning_s,
        });
        println!("{j}");
        return Ok(());
    }
    println!(
        "best plan: pp {} x dp {} (tp 1), micro-batch size {}, {} candidates in {:.3}s",
        best.layers.len(),
        best.micro_batches.len(),
        best.micro_batch_sizes[0],
        outcome.considered,
        planning_s
    );
    println!(
        "| stage | devices | layers | time/micro-batch (ms) | memory (GB) |\n|---|---|---|---|---|"
    );
    for i in 0..best.layers.len() {
        println!(
            "| {i} | {} | {} | {:.2} | {:.2} |",
            describe_devices(&cost, best, i),
            best.layers[i],
            best.prediction.stage_time_s[i] * 1e3,
            best.prediction.stage_memory_bytes[i] / 1e9
        );
    }
    println!(
        "replicas: micro-batches {:?} of size {:?}",
        best.micro_batches, best.micro_batch_sizes
    );
    println!(
        "predicted: {:.4} s per step ({:.0} tokens/s), bubble {:.1}%, DP all-reduce {:.4} s",
        best.prediction.step_time_s,
        tokens / best.prediction.step_time_s,
        best.prediction.bubble_fraction * 100.0,
        best.prediction.allreduce_s
    );
    if let Some(u) = &outcome.uniform {
        println!(
            "uniform layout (even layers and batches, pp {} x dp {}): {:.4} s per step; the plan is {:.2}x faster",
            u.layers.len(),
            u.micro_batches.len(),
            u.prediction.step_time_s,
            u.prediction.step_time_s / best.prediction.step_time_s
        );
    }
    println!("flags: {flags}");
    for (k, c) in outcome.plans.iter().enumerate().skip(1) {
        let p = &c.prediction;
        let slowest = p
            .stage_time_s
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i);
        println!(
            "runner-up {k}: pp {} x dp {}, layers {:?}, micro-batches {:?} x {}: {:.4} s (+{:.1}%): bubble {:.1}%, all-reduce {:.4} s, slowest stage {slowest} ({})",
            c.layers.len(),
            c.micro_batches.len(),
            c.layers,
            c.micro_batches,
            c.micro_batch_sizes[0],
            p.step_time_s,
            (p.step_time_s / best.prediction.step_time_s - 1.0) * 100.0,
            p.bubble_fraction * 100.0,
            p.allreduce_s,
            describe_devices(&cost, c, slowest)
        );
    }
    if let Some(out) = &args.output {
        println!(
            "wrote {} (synerfuse train --plan {})",
            out.display(),
            out.display()
        );
    }
    Ok(())
}
