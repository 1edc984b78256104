//! Measures what the planner needs on the ranks it runs on: the forward and backward
//! time of a decoder layer, the embedding and the head per micro-batch size, the bytes a
//! layer keeps for its backward, and the optimizer step per parameter (with the
//! trainer's own stage and optimizer code, so what is profiled is what trains), and the
//! links between the ranks.

use crate::comm::{CommError, MpiCommunicator};
use crate::emulation::{ComputeSpan, Emulation};
use crate::memory::MemoryProbe;
use crate::optim::{AdamW, AdamWConfig};
use std::collections::BTreeMap;
use std::time::Instant;
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::{BackwardFrom, LlamaConfig, Stage, StageError};
use synerfuse_plan::{ExpertShape, MeasuredCosts, MeasuredNetwork, ModelShape};

/// What to profile.
#[derive(Debug, Clone)]
pub struct ProfileConfig {
    /// The model (its layer count does not matter: one layer of each kind is timed).
    pub model: LlamaConfig,
    /// Tokens per sample.
    pub sequence_length: usize,
    /// Micro-batch sizes to time.
    pub micro_batch_sizes: Vec<usize>,
    /// Timed repetitions per measurement (the median is kept; one warm-up runs first).
    pub repeats: usize,
    /// Profile as an emulated device at this speed and file the costs at speed 1.
    pub emulate_speed: Option<f64>,
    /// What to time the layers in (`--bf16`, `--fp16`, else fp32; fp32 masters in the
    /// optimizer), as `train` computes: the planner's costs are of the precision that
    /// will train.
    pub precision: synerfuse_plan::Precision,
}

/// A stage of `layers` of `model` on `device`, computing in `precision`.
fn profiled_stage(
    model: &LlamaConfig,
    layers: std::ops::Range<usize>,
    device: Device,
    precision: synerfuse_plan::Precision,
) -> Result<Stage, ProfileError> {
    let mut stage = Stage::new(model, layers, device)?;
    let kind = crate::precision::compute_kind(precision);
    if kind != Kind::Float {
        stage.set_kind(kind);
    }
    Ok(stage)
}

/// Why profiling stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// No timed repetition asked for.
    #[error("at least one timed repetition is needed")]
    NoRepeats,
    /// An emulated speed outside (0, 1].
    #[error("emulated device speed {0} must be in (0, 1]")]
    EmulatedSpeed(f64),
    /// A stage could not be built or run.
    #[error(transparent)]
    Stage(#[from] StageError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] tch::TchError),
    /// A transfer between ranks failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The optimizer step failed.
    #[error(transparent)]
    FusedAdam(#[from] crate::optim::FusedAdamError),
}

/// The planner's view of `config` at `sequence_length`.
pub fn model_shape(config: &LlamaConfig, sequence_length: usize) -> ModelShape {
    ModelShape {
        num_layers: config.num_layers,
        hidden_size: config.hidden_size,
        num_heads: config.num_heads,
        num_kv_heads: config.num_kv_heads,
        ffn_hidden_size: config.intermediate_size,
        vocab_size: config.vocab_size,
        seq_length: sequence_length,
        tied: config.tie_word_embeddings,
        experts: config.moe.map(|m| ExpertShape {
            num_experts: m.num_experts,
            top_k: m.top_k,
            ffn_hidden_size: m.ffn_hidden_size,
            layer_freq: m.layer_freq,
        }),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds of forward and of backward of `stage` on a random micro-batch of `b` samples
/// (medians of `repeats` after one warm-up); under emulation, the emulated durations
/// scaled back to speed 1.
pub fn time_stage(
    stage: &Stage,
    b: usize,
    sequence_length: usize,
    repeats: usize,
    emulation: Option<&Emulation>,
) -> Result<(f64, f64), ProfileError> {
    if repeats == 0 {
        return Err(ProfileError::NoRepeats);
    }
    let c = stage.config();
    let device = stage.device();
    let (b, s) = (b as i64, sequence_length as i64);
    let hidden_kind = stage
        .var_store()
        .variables()
        .values()
        .next()
        .map_or(Kind::Float, Tensor::kind);
    let input = if stage.is_first() {
        Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, device))
    } else {
        Tensor::randn([b, s, c.hidden_size as i64], (hidden_kind, device))
    };
    let labels = Tensor::randint(c.vocab_size as i64, [b, s], (Kind::Int64, device));
    let scale = emulation.map_or(1.0, |e| e.speed);
    let (mut forwards, mut backwards) = (Vec::new(), Vec::new());
    for round in 0..repeats + 1 {
        let span = ComputeSpan::start();
        let pass = stage.forward_train(&input, None, None)?;
        let _ = pass.output.sum(Kind::Float).double_value(&[]);
        let forward = Emulation::account(emulation, span).as_secs_f64() * scale;
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
        let backward = Emulation::account(emulation, span).as_secs_f64() * scale;
        for mut v in stage.var_store().variables().into_values() {
            v.zero_grad();
        }
        if round > 0 {
            forwards.push(forward);
            backwards.push(backward);
        }
    }
    Ok((median(forwards), median(backwards)))
}

/// Seconds per parameter of the trainer's AdamW step over `stage`'s parameters (median
/// of `repeats` after one warm-up); under emulation, scaled back to speed 1.
fn time_optimizer(
    stage: &Stage,
    repeats: usize,
    emulation: Option<&Emulation>,
) -> Result<f64, ProfileError> {
    if repeats == 0 {
        return Err(ProfileError::NoRepeats);
    }
    let params: Vec<(String, Tensor)> = stage.var_store().variables().into_iter().collect();
    let count: i64 = params.iter().map(|(_, t)| t.numel() as i64).sum();
    for (_, t) in &params {
        let mut grad = t.grad();
        if !grad.defined() {
            // One backward's worth of gradient, so that the step does its full work.
            (t * 1.0).sum(Kind::Float).backward();
            grad = t.grad();
        }
        let _ = tch::no_grad(|| grad.fill_(1e-3));
    }
    let mut optimizer = AdamW::new(AdamWConfig::default(), params);
    let scale = emulation.map_or(1.0, |e| e.speed);
    let mut seconds = Vec::with_capacity(repeats);
    for round in 0..repeats + 1 {
        let span = ComputeSpan::start();
        optimizer.step(1e-4)?;
        if let Device::Cuda(i) = stage.device() {
            tch::Cuda::synchronize(i as i64);
        }
        let elapsed = Emulation::account(emulation, span).as_secs_f64() * scale;
        if round > 0 {
            seconds.push(elapsed);
        }
    }
    Ok(median(seconds) / count.max(1) as f64)
}

/// Costs per micro-batch size on `device`, the mean over the ranks of `world` (which run
/// at the same time, sharing the machine as training will). Collective over `world`.
pub fn profile_device(
    world: &MpiCommunicator,
    config: &ProfileConfig,
    device: Device,
) -> Result<BTreeMap<usize, MeasuredCosts>, ProfileError> {
    let emulation = match config.emulate_speed {
        Some(speed) if !(speed > 0.0 && speed <= 1.0) => {
            return Err(ProfileError::EmulatedSpeed(speed))
        }
        Some(speed) => Some(Emulation { speed, device }),
        None => None,
    };
    let shape = model_shape(&config.model, config.sequence_length);
    let mut base = config.model.clone();
    base.num_layers = 3;
    let (s, repeats) = (config.sequence_length, config.repeats);
    let optimizer_s_per_param = {
        let stage = profiled_stage(&base, 1..2, device, config.precision)?;
        time_optimizer(&stage, repeats, emulation.as_ref())?
    };
    let mut table = BTreeMap::new();
    for &b in &config.micro_batch_sizes {
        // A middle layer alone, then the first and last stages with one layer each: the
        // differences are the embedding and the head (with loss).
        let time = |layers| -> Result<(f64, f64), ProfileError> {
            let stage = profiled_stage(&base, layers, device, config.precision)?;
            time_stage(&stage, b, s, repeats, emulation.as_ref())
        };
        let (lf, lb) = time(1..2)?;
        let (ff, fb) = time(0..1)?;
        let (hf, hb) = time(2..3)?;
        let activation_bytes =
            match layer_activation_bytes(&config.model, b, s, device, config.precision)? {
                Some(measured) => measured,
                None => {
                    let bytes = config.precision.bytes() as f64;
                    shape.layer_activation_bytes(b, bytes, device != Device::Cpu)
                }
            };
        let costs = [
            lf,
            lb,
            (ff + fb - lf - lb).max(0.0),
            (hf + hb - lf - lb).max(0.0),
            optimizer_s_per_param,
            activation_bytes,
        ];
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
                layer_activation_bytes: mean[5],
                optimizer_s_per_param: Some(mean[4]),
            },
        );
    }
    Ok(table)
}

/// Bytes one middle layer keeps for its backward per micro-batch of `b`, measured as
/// the training loop measures a rank's activations (the C allocator's bytes in use,
/// [`MemoryProbe`]): what a two-layer stage's forward keeps less a one-layer stage's,
/// the median of three. `None` where the probe cannot tell: off glibc, or on a CUDA
/// device (libtorch's caching allocator keeps freed blocks in the driver's count and
/// tch exposes no allocator statistics), where the analytical estimate stands.
fn layer_activation_bytes(
    model: &LlamaConfig,
    b: usize,
    s: usize,
    device: Device,
    precision: synerfuse_plan::Precision,
) -> Result<Option<f64>, ProfileError> {
    let probe = match device {
        Device::Cpu => MemoryProbe::for_device(device, 0),
        _ => None,
    };
    let Some(probe) = probe else {
        return Ok(None);
    };
    let mut base = model.clone();
    base.num_layers = 4;
    let kind = crate::precision::compute_kind(precision);
    let input = Tensor::randn(
        [b as i64, s as i64, model.hidden_size as i64],
        (kind, device),
    );
    let stages = [
        profiled_stage(&base, 1..2, device, precision)?,
        profiled_stage(&base, 1..3, device, precision)?,
    ];
    // One forward and backward each first: what is built lazily is not counted.
    for stage in &stages {
        let pass = stage.forward_train(&input, None, None)?;
        let grad = pass.output.ones_like();
        stage.backward(pass, BackwardFrom::OutputGrad(&grad))?;
    }
    let mut differences = Vec::new();
    for _ in 0..3 {
        let mut kept = Vec::new();
        for stage in &stages {
            let before = probe.in_use();
            let pass = stage.forward_train(&input, None, None)?;
            kept.push(before.zip(probe.in_use()).map(|(a, z)| z.saturating_sub(a)));
            drop(pass);
        }
        if let [Some(one), Some(two)] = kept[..] {
            differences.push(two.saturating_sub(one) as f64);
        }
    }
    Ok((!differences.is_empty()).then(|| median(differences)))
}

/// Median seconds of `repeats` round trips of `tensor` from rank 0 to rank 1 (rank 1
/// answers with `ack`).
fn round_trips(
    world: &MpiCommunicator,
    tensor: &Tensor,
    ack: &Tensor,
    repeats: usize,
) -> Result<f64, CommError> {
    let mut seconds = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        world.barrier();
        let started = Instant::now();
        if world.rank() == 0 {
            world.send(tensor, 1, 3)?;
            let mut reply = ack.zeros_like();
            world.recv(&mut reply, 1, 4)?;
        } else if world.rank() == 1 {
            let mut inbox = tensor.zeros_like();
            world.recv(&mut inbox, 0, 3)?;
            world.send(ack, 0, 4)?;
        }
        seconds.push(started.elapsed().as_secs_f64());
    }
    Ok(median(seconds))
}

/// p2p bandwidth (rank 0 → 1, 16 MB), latency (8 bytes) and all-reduce bus bandwidth,
/// as rank 0 measured them (every rank gets the same figures). Needs two ranks or more.
pub fn measure_network(world: &MpiCommunicator) -> Result<MeasuredNetwork, ProfileError> {
    const REPEATS: usize = 5;
    let big = Tensor::ones([4 << 20], (Kind::Float, Device::Cpu));
    let small = Tensor::ones([2], (Kind::Float, Device::Cpu));
    let big_trip = round_trips(world, &big, &small, REPEATS)?;
    let latency = round_trips(world, &small, &small, REPEATS)? / 2.0;
    let p2p_s = (big_trip - latency).max(1e-9);
    let mut times = Vec::new();
    for _ in 0..REPEATS {
        let mut t = big.copy();
        world.barrier();
        let started = Instant::now();
        world.all_reduce_sum(&mut t)?;
        times.push(started.elapsed().as_secs_f64());
    }
    let n = world.size() as f64;
    let bytes = (big.numel() * 4) as f64;
    let mut figures = Tensor::from_slice(&[
        bytes / p2p_s,
        2.0 * (n - 1.0) / n * bytes / median(times),
        latency,
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
