//! Runs one rank's pipeline program (from `synerfuse_parallel::plan_schedule`) for one
//! training step: forwards and backwards of its stage chunks, activations and gradients
//! exchanged with neighbouring stages by non-blocking MPI sends.
//!
//! Each rank holds one [`Stage`] per virtual chunk, with its own layer count, and runs as
//! many micro-batches as its replica's plan says; replicas never talk to each other here.

use crate::comm::{MpiCommunicator, PendingSend, PipelineLinks};
use crate::emulation::{ComputeSpan, Emulation};
use crate::loader::MicroBatch;
use crate::TrainError;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use synerfuse_model::tch::{Device, Kind, Tensor};
use synerfuse_model::{BackwardFrom, ForwardPass, Stage};
use synerfuse_parallel::Instruction;

/// Where a rank's time went in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Forward and backward computation (including emulated slowdown).
    pub compute: Duration,
    /// Sending, and collectives (gradient reduction, norms).
    pub communication: Duration,
    /// Blocked in receives, waiting for a neighbouring stage (pipeline bubbles).
    pub waiting: Duration,
}

/// What the last stage measured in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepLoss {
    /// Σ per-token loss over this replica's loss tokens (0 on other stages).
    pub loss_sum: f64,
    /// Loss tokens seen by this rank's last-stage chunk (0 on other stages).
    pub loss_tokens: f64,
}

/// One rank's stage chunks and how to reach its neighbours.
pub struct PipelineRank<'a> {
    /// The stage of each virtual chunk, in chunk order.
    pub chunks: &'a [Stage],
    /// This rank's pipeline stage.
    pub stage_index: usize,
    /// Stages in the pipeline.
    pub num_stages: usize,
    /// The world communicator (peers in the program are world ranks).
    pub world: &'a MpiCommunicator,
    /// Which neighbours are reached over NCCL (the rest over MPI).
    pub links: &'a PipelineLinks,
    /// Dtype of activations on the wire.
    pub activation_kind: Kind,
    /// Emulated slowdown, if any.
    pub emulation: Option<Emulation>,
}

/// What the pipeline tells its caller as it runs a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineEvent {
    /// A backward of this chunk has ended (its parameter gradients are complete for
    /// that micro-batch).
    BackwardDone {
        /// The chunk.
        chunk: usize,
    },
    /// An instruction other than a backward has ended (a moment to progress
    /// communication in flight).
    Between,
}

/// The tag of a message named by (micro-batch, sending chunk) and its direction.
fn tag(micro_batch: usize, chunk: usize, chunks: usize, gradient: bool) -> i32 {
    (((micro_batch * chunks + chunk) * 2) + usize::from(gradient)) as i32
}

impl PipelineRank<'_> {
    /// Runs `program` over `micro_batches` (this replica's, in order). The last stage's
    /// loss is divided by `loss_normaliser` (the global number of loss tokens of the
    /// step) before its backward, so gradients summed over replicas are the global-batch
    /// gradient. Parameter gradients accumulate in the stages; `on_event` hears of each
    /// backward's end (and of every other instruction's), so the caller can move and
    /// reduce gradients while the pipeline runs on.
    pub fn run(
        &self,
        program: &[Instruction],
        micro_batches: &[MicroBatch],
        sequence_length: usize,
        loss_normaliser: f64,
        on_event: &mut dyn FnMut(PipelineEvent) -> Result<(), TrainError>,
    ) -> Result<(StepLoss, StepTimes), TrainError> {
        let chunks = self.chunks.len();
        let device = self.chunks[0].device();
        let hidden = self.chunks[0].config().hidden_size as i64;
        let last_stage = self.stage_index + 1 == self.num_stages;
        let mut times = StepTimes::default();
        let mut loss = StepLoss::default();
        let inputs: Vec<BatchTensors> = micro_batches
            .iter()
            .map(|mb| BatchTensors::new(mb, sequence_length, device))
            .collect();
        // Messages by (micro-batch, sending chunk).
        let mut activations: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut gradients: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut passes: HashMap<(usize, usize), ForwardPass> = HashMap::new();
        let mut input_grads: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut sends = Sends::default();
        for &instruction in program {
            let event = match instruction {
                Instruction::Backward { chunk, .. } => PipelineEvent::BackwardDone { chunk },
                _ => PipelineEvent::Between,
            };
            match instruction {
                Instruction::RecvActivation {
                    peer,
                    micro_batch,
                    chunk,
                } => {
                    let shape = [inputs[micro_batch].rows, sequence_length as i64, hidden];
                    let message = tag(micro_batch, chunk, chunks, false);
                    let buffer = self.receive(shape, peer, message, &mut sends, &mut times)?;
                    activations.insert((micro_batch, chunk), buffer);
                }
                Instruction::Forward { micro_batch, chunk } => {
                    let stage = &self.chunks[chunk];
                    let batch = &inputs[micro_batch];
                    let input = if stage.is_first() {
                        batch.tokens.shallow_clone()
                    } else {
                        // Named by the sender: the previous stage's same chunk, or the
                        // last stage's previous chunk when this is stage 0.
                        let from = if self.stage_index == 0 {
                            chunk - 1
                        } else {
                            chunk
                        };
                        activations.remove(&(micro_batch, from)).ok_or_else(|| {
                            TrainError::Pipeline(format!(
                                "forward of micro-batch {micro_batch} chunk {chunk} before its input arrived"
                            ))
                        })?
                    };
                    let span = ComputeSpan::start();
                    let pass = stage.forward_train(
                        &input,
                        Some(&batch.position_ids),
                        batch.attention_mask.as_ref(),
                    )?;
                    if stage.is_last() {
                        let (sum, count) = tch_no_grad_loss(&pass.output, batch);
                        loss.loss_sum += sum;
                        loss.loss_tokens += count;
                    }
                    times.compute += Emulation::account(self.emulation.as_ref(), span);
                    passes.insert((micro_batch, chunk), pass);
                }
                Instruction::SendActivation {
                    peer,
                    micro_batch,
                    chunk,
                } => {
                    let pass = passes.get(&(micro_batch, chunk)).ok_or_else(|| {
                        TrainError::Pipeline(format!(
                            "send of micro-batch {micro_batch} chunk {chunk} before its forward"
                        ))
                    })?;
                    let started = Instant::now();
                    let out = pass.output.to_kind(self.activation_kind);
                    self.send(
                        &out,
                        peer,
                        tag(micro_batch, chunk, chunks, false),
                        &mut sends,
                    )?;
                    times.communication += started.elapsed();
                }
                Instruction::RecvGradient {
                    peer,
                    micro_batch,
                    chunk,
                } => {
                    // `chunk` names the sender's piece, as on the sending side.
                    let shape = [inputs[micro_batch].rows, sequence_length as i64, hidden];
                    let message = tag(micro_batch, chunk, chunks, true);
                    let buffer = self.receive(shape, peer, message, &mut sends, &mut times)?;
                    gradients.insert((micro_batch, chunk), buffer);
                }
                Instruction::Backward { micro_batch, chunk } => {
                    let stage = &self.chunks[chunk];
                    let pass = passes.remove(&(micro_batch, chunk)).ok_or_else(|| {
                        TrainError::Pipeline(format!(
                            "backward of micro-batch {micro_batch} chunk {chunk} without its forward"
                        ))
                    })?;
                    let batch = &inputs[micro_batch];
                    let span = ComputeSpan::start();
                    let input_grad = if stage.is_last() {
                        let loss_of = |logits: &Tensor| {
                            let (sum, _) =
                                Stage::loss(logits, &batch.labels, Some(&batch.loss_mask));
                            sum / loss_normaliser
                        };
                        stage.backward(pass, BackwardFrom::Loss(&loss_of))?
                    } else {
                        // Named by the sender: the next stage's same chunk, or stage 0's
                        // next chunk when this is the last stage.
                        let from = if last_stage { chunk + 1 } else { chunk };
                        let grad = gradients.remove(&(micro_batch, from)).ok_or_else(|| {
                            TrainError::Pipeline(format!(
                                "backward of micro-batch {micro_batch} chunk {chunk} before its output gradient arrived"
                            ))
                        })?;
                        let grad = grad.to_kind(pass.output.kind());
                        stage.backward(pass, BackwardFrom::OutputGrad(&grad))?
                    };
                    times.compute += Emulation::account(self.emulation.as_ref(), span);
                    if let Some(g) = input_grad {
                        input_grads.insert((micro_batch, chunk), g);
                    }
                }
                Instruction::SendGradient {
                    peer,
                    micro_batch,
                    chunk,
                } => {
                    let grad = input_grads.remove(&(micro_batch, chunk)).ok_or_else(|| {
                        TrainError::Pipeline(format!(
                            "gradient send of micro-batch {micro_batch} chunk {chunk} before its backward"
                        ))
                    })?;
                    let started = Instant::now();
                    let grad = grad.to_kind(self.activation_kind);
                    self.send(
                        &grad,
                        peer,
                        tag(micro_batch, chunk, chunks, true),
                        &mut sends,
                    )?;
                    times.communication += started.elapsed();
                }
            }
            // Gradient bookkeeping between instructions counts as computation.
            let started = Instant::now();
            on_event(event)?;
            times.compute += started.elapsed();
        }
        let started = Instant::now();
        self.links.exchange(&sends.nccl, None)?;
        sends.in_flight.append(&mut sends.nccl);
        self.links
            .synchronize(sends.in_flight.iter().map(|(peer, _)| *peer))?;
        for send in sends.mpi {
            send.wait();
        }
        times.communication += started.elapsed();
        if !passes.is_empty() {
            return Err(TrainError::Pipeline(format!(
                "{} forward passes had no backward",
                passes.len()
            )));
        }
        Ok((loss, times))
    }

    /// Sends `tensor` to `peer`: over MPI at once (non-blocking), over NCCL deferred to
    /// the next receive's group (see [`PipelineLinks`]).
    fn send(
        &self,
        tensor: &Tensor,
        peer: usize,
        tag: i32,
        sends: &mut Sends,
    ) -> Result<(), TrainError> {
        if self.links.is_nccl(peer) {
            sends.nccl.push((peer, tensor.contiguous()));
        } else {
            sends.mpi.push(self.world.isend(tensor, peer, tag)?);
        }
        Ok(())
    }

    /// Blocks until the message `tag` from `peer` arrives, on this rank's device (sends
    /// deferred for NCCL go out first, in the same group); the wait counts as waiting.
    fn receive(
        &self,
        shape: [i64; 3],
        peer: usize,
        tag: i32,
        sends: &mut Sends,
        times: &mut StepTimes,
    ) -> Result<Tensor, TrainError> {
        let device = self.chunks[0].device();
        let started = Instant::now();
        let deferred = std::mem::take(&mut sends.nccl);
        let buffer = if self.links.is_nccl(peer) {
            let buffer = Tensor::empty(shape, (self.activation_kind, device));
            self.links.exchange(&deferred, Some((peer, &buffer)))?;
            sends.in_flight.extend(deferred);
            buffer
        } else {
            self.links.exchange(&deferred, None)?;
            sends.in_flight.extend(deferred);
            let mut host = Tensor::empty(shape, (self.activation_kind, Device::Cpu));
            if device != Device::Cpu {
                host = host.pin_memory(device);
            }
            self.world.recv(&mut host, peer, tag)?;
            host.to_device(device)
        };
        times.waiting += started.elapsed();
        Ok(buffer)
    }
}

/// Sends in flight during a step.
#[derive(Default)]
struct Sends {
    /// Non-blocking MPI sends.
    mpi: Vec<PendingSend>,
    /// NCCL sends not yet issued: (peer, tensor).
    nccl: Vec<(usize, Tensor)>,
    /// NCCL sends issued, kept alive until the step's end synchronises their links.
    in_flight: Vec<(usize, Tensor)>,
}

/// The loss of a forward's logits, for the log (no graph).
fn tch_no_grad_loss(logits: &Tensor, batch: &BatchTensors) -> (f64, f64) {
    synerfuse_model::tch::no_grad(|| {
        let (sum, count) = Stage::loss(logits, &batch.labels, Some(&batch.loss_mask));
        (sum.double_value(&[]), count.double_value(&[]))
    })
}

/// A micro-batch as tensors on the stage's device.
struct BatchTensors {
    rows: i64,
    tokens: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    position_ids: Tensor,
    attention_mask: Option<Tensor>,
}

impl BatchTensors {
    fn new(mb: &MicroBatch, s: usize, device: Device) -> Self {
        let rows = mb.len() as i64;
        let s = s as i64;
        let shape = [rows, s];
        BatchTensors {
            rows,
            tokens: Tensor::from_slice(&mb.tokens).view(shape).to_device(device),
            labels: Tensor::from_slice(&mb.labels).view(shape).to_device(device),
            loss_mask: Tensor::from_slice(&mb.loss_mask)
                .view(shape)
                .to_device(device),
            position_ids: Tensor::from_slice(&mb.position_ids)
                .view(shape)
                .to_device(device),
            attention_mask: mb.attention_mask.as_ref().map(|m| {
                Tensor::from_slice(m)
                    .view([rows, 1, s, s])
                    .to_device(device)
            }),
        }
    }
}
