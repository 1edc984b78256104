//! Runs one rank's pipeline program (from `Plan::schedule`) for one
//! training step: forwards and backwards of its stage chunks, activations and gradients
//! exchanged with neighbouring stages by non-blocking MPI sends.
//!
//! Each rank holds one [`Stage`] per virtual chunk, with its own layer count, and runs as
//! many micro-batches as its replica's plan says; replicas never talk to each other here.

use crate::comm::{GroupCommunicator, MpiCommunicator, PendingSend, PipelineLinks};
use crate::emulation::{ComputeSpan, Emulation};
use crate::loader::MicroBatch;
use crate::param_gather::ParamGathers;
use crate::TrainError;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};
use synerfuse_model::cp::{ContextGroup, Solo};
use synerfuse_model::tch::{Device, Kind, Tensor};
use synerfuse_model::tp::{CollectiveError, TpBackwardFrom, TpCollectives};
use synerfuse_model::{
    BackwardFrom, ExpertGroup, FinalGrads, ForwardPass, OpenGate, PieceGate, Stage, StageHead,
};
use synerfuse_plan::timeline::{Span, SpanKind};
use synerfuse_plan::{Instruction, Message, Pass, Payload, Piece};

pub use crate::error::PipelineFault;

/// Where a rank's time went in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Forward and backward computation (including emulated slowdown).
    pub compute: Duration,
    /// Sending, and collectives (gradient reduction, norms).
    pub communication: Duration,
    /// Of `communication`, the wait for the data-parallel gradient reductions once the
    /// pipeline has run: the part of them the backward did not hide.
    pub reduce_wait: Duration,
    /// Of `communication`, the wait for the distributed optimizer's parameter all-gather:
    /// all of it after the optimizer, or with `--overlap-param-gather` what the next
    /// step's forwards did not hide of it.
    pub param_gather_wait: Duration,
    /// Blocked in receives, waiting for a neighbouring stage (pipeline bubbles).
    pub waiting: Duration,
    /// The forward and backward passes outside their collectives (tensor-, context- and
    /// expert-parallel): the rank's pace, which waiting for its groups' other members
    /// does not inflate.
    pub passes: Duration,
}

/// What the last stage measured in one step, and the MoE layers' load balance.
#[derive(Debug, Clone, Default)]
pub struct StepLoss {
    /// Σ per-token loss over this replica's loss tokens (0 on other stages).
    pub loss_sum: f64,
    /// Loss tokens seen by this rank's last-stage chunk (0 on other stages).
    pub loss_tokens: f64,
    /// This rank's MoE layers' load balance (on tensor-parallel rank 0; empty
    /// elsewhere).
    pub experts: crate::expert_load::ExpertLoad,
}

impl StepLoss {
    /// Adds micro-batches' (loss sum, loss tokens) held on the device, read in one
    /// transfer (one host synchronisation a step, not two a micro-batch).
    fn add_pending(&mut self, pending: Vec<(Tensor, Tensor)>) {
        if pending.is_empty() {
            return;
        }
        let values: Vec<Tensor> = (pending.iter())
            .flat_map(|(sum, count)| [sum.to_kind(Kind::Double), count.to_kind(Kind::Double)])
            .collect();
        let read = Tensor::stack(&values, 0)
            .view([-1, 2])
            .sum_dim_intlist(0, false, Kind::Double);
        let read: Vec<f64> = Vec::try_from(read.to_device(Device::Cpu)).unwrap_or_default();
        if let [sum, tokens] = read[..] {
            self.loss_sum += sum;
            self.loss_tokens += tokens;
        }
    }
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
    /// The stage's tensor-parallel group, when it has one (every chunk of a rank is in
    /// the same stage, so in the same group).
    pub tp: Option<&'a GroupCommunicator>,
    /// Under sequence parallelism, each neighbour's sequence rows: (its index in its
    /// stage's tensor-parallel group, the group's size); empty without.
    pub peer_rows: &'a BTreeMap<usize, (usize, usize)>,
    /// The stage's context-parallel group, when it has one.
    pub context: Option<ContextRank<'a>>,
    /// This rank's expert-parallel group, when its stage holds only some experts.
    pub experts: Option<ExpertRank<'a>>,
    /// This rank's dtype: of the activations and gradients it sends, and of what it
    /// receives once converted.
    pub activation_kind: Kind,
    /// Every world rank's dtype, by world rank: what a peer sends arrives in its own
    /// (a pipeline may mix precisions), and is converted at the receiving end.
    pub rank_kinds: &'a [Kind],
    /// Emulated slowdown, if any.
    pub emulation: Option<Emulation>,
    /// When the step began: the origin of the spans [`PipelineRank::run`] records.
    pub step_start: Instant,
    /// Whether each chunk's last backward of the step runs piece by piece, telling the
    /// caller ([`PipelineEvent::GradsFinal`]) as each piece's gradients are final, so
    /// that their reduction can start inside the backward.
    pub report_final_grads: bool,
    /// The distributed optimizer's parameter gathers still in flight
    /// (`--overlap-param-gather`): each forward waits, before each model piece, for those
    /// holding that piece's parameters.
    pub param_gathers: Option<&'a ParamGathers>,
}

/// A rank's expert-parallel group: its stage holds some experts of every MoE layer, the
/// members the rest, and each MoE layer's tokens go to their experts' members and back.
#[derive(Clone, Copy)]
pub struct ExpertRank<'a> {
    /// The group's communicator (member order).
    pub group: &'a GroupCommunicator,
    /// The experts each member holds, in member order.
    pub placement: &'a [Vec<usize>],
    /// fp32 where the members compute in different precisions (what the tokens then
    /// travel in), else `None`.
    pub exchange_kind: Option<Kind>,
}

/// A rank's context-parallel group: it runs its stage on its own token positions of every
/// sequence (the same on every stage of its pipeline), exchanging keys and values.
#[derive(Clone, Copy)]
pub struct ContextRank<'a> {
    /// The group's communicator (member order).
    pub group: &'a GroupCommunicator,
    /// Every member's sequence indices, in member order.
    pub positions: &'a [Vec<i64>],
    /// Per chunk, whether its input comes from a stage that splits sequences otherwise
    /// (whole, gathered by the sender; its gradient goes back whole, gathered here).
    pub whole_input: &'a [bool],
    /// Per chunk, whether its output goes to a stage that splits sequences otherwise.
    pub whole_output: &'a [bool],
}

impl ContextRank<'_> {
    /// This member's part of `micro_batch`.
    fn part(&self, micro_batch: &MicroBatch) -> MicroBatch {
        let mine = &self.positions[self.group.rank()];
        let positions: Vec<usize> = mine.iter().map(|&p| p as usize).collect();
        micro_batch.context_part(&positions)
    }
}

/// Whether a chunk's input and output travel whole (see [`ContextRank`]).
#[derive(Debug, Clone, Copy, Default)]
struct Crossing {
    input: bool,
    output: bool,
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
    /// Inside a chunk's last backward of the step (with
    /// [`PipelineRank::report_final_grads`]): the chunk's parameters of `grads`' pieces
    /// have their gradients of the step.
    GradsFinal {
        /// The chunk.
        chunk: usize,
        /// Which of its pieces.
        grads: FinalGrads,
    },
    /// An instruction other than a backward has ended (a moment to progress
    /// communication in flight).
    Between,
}

/// The pieces whose backward is this rank's next computation after their forward: their
/// loss is kept with its graph from the forward (computed once) at no cost in memory, as
/// nothing runs between (a forward of another micro-batch in between would hold the
/// loss's buffers longer).
fn backward_follows(program: &[Instruction]) -> BTreeSet<Piece> {
    let computes = program.iter().filter_map(|i| match i {
        Instruction::Compute { pass, piece } => Some((*pass, *piece)),
        _ => None,
    });
    let computes: Vec<(Pass, Piece)> = computes.collect();
    (computes.windows(2))
        .filter(|w| w[0].0 == Pass::Forward && w[1] == (Pass::Backward, w[0].1))
        .map(|w| w[0].1)
        .collect()
}

/// The pieces whose backward is their chunk's last of `program`.
fn last_backwards(program: &[Instruction]) -> BTreeSet<Piece> {
    let mut last = BTreeMap::new();
    for instruction in program {
        if let Instruction::Compute {
            pass: Pass::Backward,
            piece,
        } = instruction
        {
            last.insert(piece.chunk, *piece);
        }
    }
    last.into_values().collect()
}

/// What a rank does while it runs `instruction`: a receive blocks until the message
/// arrives.
fn span_kind(instruction: Instruction) -> SpanKind {
    match instruction {
        Instruction::Recv(_) => SpanKind::Wait,
        Instruction::Send(_) => SpanKind::Send,
        Instruction::Compute {
            pass: Pass::Forward,
            ..
        } => SpanKind::Forward,
        Instruction::Compute {
            pass: Pass::Backward,
            ..
        } => SpanKind::Backward,
    }
}

/// The piece an instruction computes or carries.
fn instruction_piece(instruction: Instruction) -> Piece {
    match instruction {
        Instruction::Recv(m) | Instruction::Send(m) => m.piece,
        Instruction::Compute { piece, .. } => piece,
    }
}

/// The tag of a message: its sending piece and what it carries.
fn tag(message: &Message, chunks: usize) -> i32 {
    let Piece { micro_batch, chunk } = message.piece;
    let gradient = message.payload == Payload::Gradient;
    (((micro_batch * chunks + chunk) * 2) + usize::from(gradient)) as i32
}

/// What one step holds between instructions: messages and passes by piece.
#[derive(Default)]
struct StepState {
    /// Received activations and output gradients, by (payload, sending piece).
    received: HashMap<(Payload, Piece), Tensor>,
    /// Forward passes waiting for their backward.
    passes: HashMap<Piece, ForwardPass>,
    /// Input gradients waiting to be sent.
    input_grads: HashMap<Piece, Tensor>,
    /// Outputs gathered whole over the context-parallel group for a stage that splits
    /// sequences otherwise, waiting to be sent.
    whole_outputs: HashMap<Piece, Tensor>,
    /// Sends left of each piece's input gradient (one per receiving rank).
    gradient_sends: HashMap<Piece, usize>,
    /// In evaluation, sends left of each piece's output, whose pass is dropped after
    /// its last send.
    activation_sends: HashMap<Piece, usize>,
    sends: Sends,
    times: StepTimes,
    loss: StepLoss,
    /// What each instruction took, from the step's start.
    spans: Vec<Span>,
    /// The pieces whose backward reports its gradients piece by piece (see
    /// [`PipelineRank::report_final_grads`]).
    reporting: BTreeSet<Piece>,
    /// The pieces whose loss the forward keeps for the backward ([`backward_follows`]).
    keep_loss: BTreeSet<Piece>,
    /// The last stage's (loss sum, loss tokens) of each micro-batch, on the device: read
    /// once, at the step's end.
    pending_losses: Vec<(Tensor, Tensor)>,
}

impl StepState {
    fn take_received(
        &mut self,
        payload: Payload,
        from: Piece,
        fault: PipelineFault,
    ) -> Result<Tensor, TrainError> {
        self.received
            .remove(&(payload, from))
            .ok_or(TrainError::Pipeline(fault))
    }
}

impl PipelineRank<'_> {
    /// Runs `program` over `micro_batches` (this replica's, in order). The last stage's
    /// loss is divided by `loss_normaliser` (the global number of loss tokens of the
    /// step) before its backward, so gradients summed over replicas are the global-batch
    /// gradient; an MoE layer's load-balancing loss, summed over a micro-batch's
    /// sequences, by `sequences` (the step's). Parameter gradients accumulate in the stages; `on_event` hears of each
    /// backward's end (and of every other instruction's), so the caller can move and
    /// reduce gradients while the pipeline runs on. Returns, with the loss and the
    /// times, each instruction's span from `step_start` (passes, sends, waiting for a
    /// message).
    pub fn run(
        &self,
        program: &[Instruction],
        micro_batches: &[MicroBatch],
        sequence_length: usize,
        (loss_normaliser, sequences): (f64, f64),
        on_event: &mut dyn FnMut(PipelineEvent) -> Result<(), TrainError>,
    ) -> Result<(StepLoss, StepTimes, Vec<Span>), TrainError> {
        let mode = Mode::Train {
            loss_normaliser,
            sequence_weight: 1.0 / sequences,
        };
        self.execute(program, micro_batches, sequence_length, mode, on_event)
    }

    /// Runs a forward-only `program` ([`synerfuse_plan::forward_only`]) over
    /// `micro_batches` without gradients: the last stage's loss sum and tokens, each pass
    /// dropped once its output is sent (evaluation).
    pub fn evaluate(
        &self,
        program: &[Instruction],
        micro_batches: &[MicroBatch],
        sequence_length: usize,
    ) -> Result<(StepLoss, StepTimes), TrainError> {
        synerfuse_model::tch::no_grad(|| {
            let mut on_event = |_| Ok(());
            let (loss, times, _) = self.execute(
                program,
                micro_batches,
                sequence_length,
                Mode::Evaluate,
                &mut on_event,
            )?;
            Ok((loss, times))
        })
    }

    /// Seconds since the step began.
    fn now_s(&self) -> f64 {
        self.step_start.elapsed().as_secs_f64()
    }

    fn execute(
        &self,
        program: &[Instruction],
        micro_batches: &[MicroBatch],
        sequence_length: usize,
        mode: Mode,
        on_event: &mut dyn FnMut(PipelineEvent) -> Result<(), TrainError>,
    ) -> Result<(StepLoss, StepTimes, Vec<Span>), TrainError> {
        let device = self.chunks[0].device();
        // Under context parallelism this member's tokens of every sequence.
        let (parts, sequence_length) = match &self.context {
            Some(context) => (
                micro_batches.iter().map(|mb| context.part(mb)).collect(),
                context.positions[context.group.rank()].len(),
            ),
            None => (Vec::new(), sequence_length),
        };
        let micro_batches = match self.context {
            Some(_) => parts.as_slice(),
            None => micro_batches,
        };
        let inputs: Vec<BatchTensors> = micro_batches
            .iter()
            .map(|mb| BatchTensors::new(mb, sequence_length, device))
            .collect();
        let mut step = StepState::default();
        count_sends(program, &mut step);
        if matches!(mode, Mode::Train { .. }) {
            step.keep_loss = backward_follows(program);
            if self.report_final_grads {
                step.reporting = last_backwards(program);
            }
        }
        for &instruction in program {
            let (start_s, talked) = (self.now_s(), step.times.communication);
            let run = (mode, &inputs[..], sequence_length);
            let event = self.run_instruction(instruction, run, &mut step, on_event)?;
            let end_s = self.now_s();
            if let Instruction::Compute { .. } = instruction {
                let inside = step.times.communication.saturating_sub(talked);
                let pass = Duration::from_secs_f64((end_s - start_s).max(0.0));
                step.times.passes += pass.saturating_sub(inside);
            }
            step.spans.push(Span {
                kind: span_kind(instruction),
                start_s,
                end_s,
                micro_batch: Some(instruction_piece(instruction).micro_batch),
            });
            // Gradient bookkeeping between instructions counts as computation.
            let started = Instant::now();
            on_event(event)?;
            step.times.compute += started.elapsed();
        }
        self.finish_sends(&mut step)?;
        step.loss
            .add_pending(std::mem::take(&mut step.pending_losses));
        if !step.passes.is_empty() {
            return Err(TrainError::Pipeline(PipelineFault::Unfinished(
                step.passes.len(),
            )));
        }
        Ok((step.loss, step.times, step.spans))
    }

    /// Runs one instruction; what happened, for the gradient bookkeeping.
    fn run_instruction(
        &self,
        instruction: Instruction,
        (mode, inputs, sequence_length): (Mode, &[BatchTensors], usize),
        step: &mut StepState,
        on_event: &mut dyn FnMut(PipelineEvent) -> Result<(), TrainError>,
    ) -> Result<PipelineEvent, TrainError> {
        Ok(match (instruction, mode) {
            (Instruction::Recv(message), _) => {
                let rows = inputs[message.piece.micro_batch].rows;
                let buffer = self.receive(rows, sequence_length, &message, step)?;
                step.received
                    .insert((message.payload, message.piece), buffer);
                PipelineEvent::Between
            }
            (
                Instruction::Compute {
                    pass: Pass::Forward,
                    piece,
                },
                _,
            ) => {
                self.forward(piece, &inputs[piece.micro_batch], step)?;
                if mode == Mode::Evaluate && !step.activation_sends.contains_key(&piece) {
                    step.passes.remove(&piece);
                    step.whole_outputs.remove(&piece);
                }
                PipelineEvent::Between
            }
            (
                Instruction::Compute {
                    pass: Pass::Backward,
                    piece,
                },
                Mode::Train {
                    loss_normaliser,
                    sequence_weight,
                },
            ) => {
                let batch = &inputs[piece.micro_batch];
                let weights = (loss_normaliser, sequence_weight);
                self.reporting_backward(piece, batch, weights, step, on_event)?;
                PipelineEvent::BackwardDone { chunk: piece.chunk }
            }
            (
                Instruction::Compute {
                    pass: Pass::Backward,
                    piece,
                },
                Mode::Evaluate,
            ) => {
                return Err(TrainError::Pipeline(PipelineFault::BackwardInEvaluation(
                    piece,
                )));
            }
            (Instruction::Send(message), _) => {
                self.send_result(&message, step)?;
                if mode == Mode::Evaluate && message.payload == Payload::Activation {
                    let left = step.activation_sends.entry(message.piece).or_insert(1);
                    *left -= 1;
                    if *left == 0 {
                        step.passes.remove(&message.piece);
                        step.whole_outputs.remove(&message.piece);
                    }
                }
                PipelineEvent::Between
            }
        })
    }

    /// Waits for every send of the step to complete (NCCL sends exchanged, host-staged
    /// ones waited on), timed as communication.
    fn finish_sends(&self, step: &mut StepState) -> Result<(), TrainError> {
        let (started, start_s) = (Instant::now(), self.now_s());
        let sends = &mut step.sends;
        self.links.exchange(&sends.nccl, None)?;
        sends.in_flight.append(&mut sends.nccl);
        self.links
            .synchronize(sends.in_flight.iter().map(|(peer, _)| *peer))?;
        for send in sends.mpi.drain(..) {
            send.wait();
        }
        step.times.communication += started.elapsed();
        step.spans.push(Span {
            kind: SpanKind::Send,
            start_s,
            end_s: self.now_s(),
            micro_batch: None,
        });
        Ok(())
    }

    /// The forward of `piece`: its input is the batch's tokens on the first stage's
    /// first chunk, else the activation received from the piece before it.
    fn forward(
        &self,
        piece: Piece,
        batch: &BatchTensors,
        step: &mut StepState,
    ) -> Result<(), TrainError> {
        let stage = &self.chunks[piece.chunk];
        let input = if stage.is_first() {
            batch.tokens.shallow_clone()
        } else {
            // Named by the sender: the previous stage's same chunk, or the last stage's
            // previous chunk when this is stage 0.
            let from_chunk = if self.stage_index == 0 {
                piece.chunk - 1
            } else {
                piece.chunk
            };
            let from = Piece::new(piece.micro_batch, from_chunk);
            let fault = PipelineFault::ForwardBeforeInput(piece);
            step.take_received(Payload::Activation, from, fault)?
        };
        let clock = self.clock();
        let tp = self.parallel().then_some(&clock);
        let collectives = clock.context_collectives();
        let cp = self.context_group(collectives.as_ref());
        let expert_collectives = clock.expert_collectives();
        let ep = self.expert_group(expert_collectives.as_ref());
        let crossing = self.crossing(piece.chunk);
        let input = match (&cp, crossing.input) {
            (Some(cp), true) => cp.own_tokens(&input, 1),
            _ => input,
        };
        let (positions, mask) = (Some(&batch.position_ids), batch.attention_mask.as_ref());
        let gate = (self.param_gathers).map(|gathers| GatherGate {
            clock: &clock,
            gathers,
            chunk: piece.chunk,
        });
        // A loss kept for the backward is computed with the output layer, in chunks.
        let ends_with = match step.keep_loss.contains(&piece) {
            true => StageHead::WithLoss,
            false => StageHead::Logits,
        };
        let gated = stage
            .gated(match &gate {
                Some(gate) => gate,
                None => &OpenGate,
            })
            .ending_with(ends_with);
        let pass = match tp {
            Some(tp) => {
                let groups = (cp.as_ref(), ep.as_ref());
                gated.forward_train_parallel(&input, positions, mask, tp, groups)?
            }
            None if step.reporting.contains(&piece) => {
                gated.forward_train_cut(&input, positions, mask)?
            }
            None => gated.forward_train(&input, positions, mask)?,
        };
        if let (Some(cp), true) = (&cp, crossing.output) {
            let whole = cp.gather_sequence(&pass.output, 1)?;
            step.whole_outputs.insert(piece, whole);
        }
        let mut pass = pass;
        if stage.is_last() {
            let (labels, mask) = (&batch.labels, Some(&batch.loss_mask));
            // Every rank of a tensor-parallel group has the loss; its rank 0 reports it.
            let reports = stage.shard().rank == 0;
            match tp {
                Some(tp) if step.keep_loss.contains(&piece) => {
                    let loss = stage.attach_parallel_loss(&mut pass, labels, mask, tp)?;
                    if reports {
                        step.pending_losses.push(loss);
                    }
                }
                Some(tp) => {
                    let (sum, count) = stage.parallel_loss(&pass.output, labels, mask, tp)?;
                    if reports {
                        step.loss.loss_sum += sum;
                        step.loss.loss_tokens += count;
                    }
                }
                None if step.keep_loss.contains(&piece) => {
                    let loss = stage.attach_loss(&mut pass, labels, mask);
                    step.pending_losses.push(loss);
                }
                None => step.pending_losses.push(no_grad_loss(&pass.output, batch)),
            }
        }
        if stage.shard().rank == 0 {
            step.loss.experts.add(pass.load_balance());
        }
        clock.stop(&mut step.times);
        step.passes.insert(piece, pass);
        Ok(())
    }

    /// [`Self::backward`] of `piece`, passing the pieces whose gradients are final to
    /// `on_event` as they are when `piece` is its chunk's last backward of the step
    /// (the first error `on_event` returns ends the step once the backward is done).
    fn reporting_backward(
        &self,
        piece: Piece,
        batch: &BatchTensors,
        weights: (f64, f64),
        step: &mut StepState,
        on_event: &mut dyn FnMut(PipelineEvent) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        if !step.reporting.contains(&piece) {
            return self.backward(piece, batch, weights, step, &mut |_| {});
        }
        let mut failed = None;
        let mut report = |grads: FinalGrads| {
            if failed.is_none() {
                let chunk = piece.chunk;
                failed = on_event(PipelineEvent::GradsFinal { chunk, grads }).err();
            }
        };
        self.backward(piece, batch, weights, step, &mut report)?;
        failed.map_or(Ok(()), Err)
    }

    /// The backward of `piece`: from the loss on the last stage's last chunk, else from
    /// the gradient received from the piece after it; `report` hears of its gradients
    /// as they become final.
    fn backward(
        &self,
        piece: Piece,
        batch: &BatchTensors,
        (loss_normaliser, sequence_weight): (f64, f64),
        step: &mut StepState,
        report: &mut dyn FnMut(FinalGrads),
    ) -> Result<(), TrainError> {
        let stage = &self.chunks[piece.chunk];
        let mut pass = step.passes.remove(&piece).ok_or(TrainError::Pipeline(
            PipelineFault::BackwardWithoutForward(piece),
        ))?;
        pass.set_sequence_weight(sequence_weight);
        let clock = self.clock();
        let report = &mut |grads: FinalGrads| clock.between(|| report(grads));
        let tp = self.parallel().then_some(&clock);
        let collectives = clock.context_collectives();
        let cp = self.context_group(collectives.as_ref());
        let expert_collectives = clock.expert_collectives();
        let ep = self.expert_group(expert_collectives.as_ref());
        let input_grad = if stage.is_last() {
            match tp {
                Some(tp) => {
                    let from = TpBackwardFrom::Loss {
                        labels: &batch.labels,
                        loss_mask: Some(&batch.loss_mask),
                        scale: 1.0 / loss_normaliser,
                    };
                    let groups = (cp.as_ref(), ep.as_ref());
                    stage.backward_parallel_reporting(pass, from, tp, groups, report)?
                }
                None => {
                    // The forward's loss where it kept it, else computed again.
                    let attached = pass.take_attached_loss();
                    let loss_of = |logits: &Tensor| match &attached {
                        Some(sum) => sum / loss_normaliser,
                        None => {
                            let mask = Some(&batch.loss_mask);
                            Stage::loss(logits, &batch.labels, mask).0 / loss_normaliser
                        }
                    };
                    stage.backward_reporting(pass, BackwardFrom::Loss(&loss_of), report)?
                }
            }
        } else {
            // Named by the sender: the next stage's same chunk, or stage 0's next chunk
            // when this is the last stage.
            let last_stage = self.stage_index + 1 == self.num_stages;
            let from_chunk = if last_stage {
                piece.chunk + 1
            } else {
                piece.chunk
            };
            let from = Piece::new(piece.micro_batch, from_chunk);
            let fault = PipelineFault::BackwardBeforeGradient(piece);
            let grad = step.take_received(Payload::Gradient, from, fault)?;
            let grad = match (&cp, self.crossing(piece.chunk).output) {
                (Some(cp), true) => cp.own_tokens(&grad, 1),
                _ => grad,
            };
            let grad = grad.to_kind(pass.output.kind());
            match tp {
                Some(tp) => {
                    let from = TpBackwardFrom::OutputGrad(&grad);
                    let groups = (cp.as_ref(), ep.as_ref());
                    stage.backward_parallel_reporting(pass, from, tp, groups, report)?
                }
                None => stage.backward_reporting(pass, BackwardFrom::OutputGrad(&grad), report)?,
            }
        };
        let input_grad = match (&cp, self.crossing(piece.chunk).input, input_grad) {
            (Some(cp), true, Some(g)) => Some(cp.gather_sequence(&g, 1)?),
            (_, _, g) => g,
        };
        drop(cp);
        step.whole_outputs.remove(&piece);
        clock.stop(&mut step.times);
        if let Some(g) = input_grad {
            step.input_grads.insert(piece, g);
        }
        Ok(())
    }

    /// Sends the result `message` names: a forward's output or a backward's input
    /// gradient, in the wire dtype; under sequence parallelism only the receiver's
    /// sequence rows of it.
    fn send_result(&self, message: &Message, step: &mut StepState) -> Result<(), TrainError> {
        let fault = || TrainError::Pipeline(PipelineFault::SendBeforeCompute(*message));
        let started = Instant::now();
        let chunk = self.chunks.get(message.piece.chunk).ok_or_else(fault)?;
        let (tensor, in_rows) = match message.payload {
            Payload::Activation => match step.whole_outputs.get(&message.piece) {
                Some(whole) => (whole.shallow_clone(), false),
                None => {
                    let pass = step.passes.get(&message.piece).ok_or_else(fault)?;
                    (pass.output.shallow_clone(), chunk.gives_sequence_rows())
                }
            },
            Payload::Gradient => {
                // A stage on fewer tensor-parallel ranks than the one before it sends
                // the same gradient to several of them: kept until its last send.
                let left = step.gradient_sends.entry(message.piece).or_insert(0);
                *left = left.saturating_sub(1);
                let grad = if *left == 0 {
                    step.input_grads.remove(&message.piece)
                } else {
                    step.input_grads
                        .get(&message.piece)
                        .map(Tensor::shallow_clone)
                };
                (grad.ok_or_else(fault)?, chunk.gives_input_grad_rows())
            }
        };
        let tensor = match (in_rows, self.peer_rows.get(&message.peer)) {
            // Whole: cut out the receiver's rows (the sequence divides, checked at launch).
            (false, Some(&(index, size))) if size > 1 => {
                let n = tensor.size()[1] / size as i64;
                tensor.narrow(1, index as i64 * n, n)
            }
            _ => tensor,
        };
        let tensor = tensor.to_kind(self.activation_kind).contiguous();
        self.send(&tensor, message, &mut step.sends)?;
        step.times.communication += started.elapsed();
        Ok(())
    }

    /// Sends `tensor` to `peer`: over MPI at once (non-blocking), over NCCL deferred to
    /// the next receive's group (see [`PipelineLinks`]).
    fn send(
        &self,
        tensor: &Tensor,
        message: &Message,
        sends: &mut Sends,
    ) -> Result<(), TrainError> {
        let peer = message.peer;
        if self.links.is_nccl(peer) {
            sends.nccl.push((peer, tensor.contiguous()));
        } else {
            let tag = tag(message, self.chunks.len());
            let bytes = tensor.numel() * tensor.kind().elt_size_in_bytes();
            if let Some(arrival) = self.links.arrival(peer, bytes) {
                let stamp = Tensor::from_slice(&[arrival]);
                sends.mpi.push(self.world.isend(&stamp, peer, tag)?);
            }
            sends.mpi.push(self.world.isend(tensor, peer, tag)?);
        }
        Ok(())
    }

    /// Blocks until `message` (a `rows` × `sequence_length` × hidden tensor) arrives, on
    /// this rank's device (sends deferred for NCCL go out first, in the same group); the
    /// wait counts as waiting.
    fn receive(
        &self,
        rows: i64,
        sequence_length: usize,
        message: &Message,
        step: &mut StepState,
    ) -> Result<Tensor, TrainError> {
        let hidden = self.chunks[0].config().hidden_size as i64;
        let sequence = self.received_sequence(message, sequence_length)?;
        let shape = [rows, sequence, hidden];
        let (peer, sends) = (message.peer, &mut step.sends);
        let device = self.chunks[0].device();
        let started = Instant::now();
        let deferred = std::mem::take(&mut sends.nccl);
        let wire = self
            .rank_kinds
            .get(peer)
            .copied()
            .unwrap_or(self.activation_kind);
        let buffer = if self.links.is_nccl(peer) {
            let buffer = Tensor::empty(shape, (wire, device));
            self.links.exchange(&deferred, Some((peer, &buffer)))?;
            sends.in_flight.extend(deferred);
            buffer
        } else {
            self.links.exchange(&deferred, None)?;
            sends.in_flight.extend(deferred);
            let mut host = Tensor::empty(shape, (wire, Device::Cpu));
            if device != Device::Cpu {
                host = host.pin_memory(device);
            }
            let tag = tag(message, self.chunks.len());
            let mut arrival = None;
            if self.links.stamped(peer) {
                let mut stamp = Tensor::zeros([1], (Kind::Double, Device::Cpu));
                self.world.recv(&mut stamp, peer, tag)?;
                arrival = Some(stamp.double_value(&[0]));
            }
            self.world.recv(&mut host, peer, tag)?;
            crate::comm::emulated_links::wait_for(arrival);
            host.to_device(device)
        };
        step.times.waiting += started.elapsed();
        Ok(match wire == self.activation_kind {
            true => buffer,
            false => buffer.to_kind(self.activation_kind),
        })
    }
}

/// One pass's clock: its computation (emulated when the rank stands in for a slower
/// device) and, on a tensor- or context-parallel stage, the groups' collectives between
/// its computations, timed apart: an emulated device is slowed down in each computation
/// between collectives, as the real one would be, and waiting for a group counts as
/// communication. As [`TpCollectives`] it is the tensor-parallel group's (a group of one
/// without one); [`GroupCollectives`] is the context-parallel group's.
struct PassClock<'a> {
    group: Option<&'a GroupCommunicator>,
    context: Option<&'a GroupCommunicator>,
    experts: Option<&'a GroupCommunicator>,
    emulation: Option<&'a Emulation>,
    span: Cell<ComputeSpan>,
    compute: Cell<Duration>,
    communication: Cell<Duration>,
}

impl<'a> PassClock<'a> {
    /// Ends the computation so far, runs `op` on `group`, starts the next computation.
    fn collective<T>(
        &self,
        group: &GroupCommunicator,
        op: impl FnOnce(&GroupCommunicator) -> Result<T, CollectiveError>,
    ) -> Result<T, CollectiveError> {
        self.communicating(|| op(group))
    }

    /// Ends the computation so far, runs `op` (waiting on communication, counted as
    /// such and not slowed), starts the next computation.
    fn communicating<T>(&self, op: impl FnOnce() -> T) -> T {
        let computed = Emulation::account(self.emulation, self.span.get());
        self.compute.set(self.compute.get() + computed);
        let started = Instant::now();
        let result = op();
        self.communication
            .set(self.communication.get() + started.elapsed());
        self.span.set(ComputeSpan::start());
        result
    }

    /// The context-parallel group's collectives, timed by this clock.
    fn context_collectives(&self) -> Option<GroupCollectives<'_, 'a>> {
        let group = self.context?;
        Some(GroupCollectives { clock: self, group })
    }

    /// The expert-parallel group's collectives, timed by this clock.
    fn expert_collectives(&self) -> Option<GroupCollectives<'_, 'a>> {
        let group = self.experts?;
        Some(GroupCollectives { clock: self, group })
    }

    /// Ends the computation so far (an emulated device's share of it slept off, so that
    /// what `f` starts sees the backward as far as the device would have got), runs `f`
    /// (gradient bookkeeping, counted as computation but not slowed), starts the next.
    fn between<T>(&self, f: impl FnOnce() -> T) -> T {
        let computed = Emulation::account(self.emulation, self.span.get());
        let started = Instant::now();
        let result = f();
        self.compute
            .set(self.compute.get() + computed + started.elapsed());
        self.span.set(ComputeSpan::start());
        result
    }

    /// Ends the pass: its times into `times`.
    fn stop(self, times: &mut StepTimes) {
        let last = Emulation::account(self.emulation, self.span.get());
        times.compute += self.compute.get() + last;
        times.communication += self.communication.get();
    }
}

impl TpCollectives for PassClock<'_> {
    fn rank(&self) -> usize {
        self.group.map_or(0, GroupCommunicator::rank)
    }

    fn size(&self) -> usize {
        self.group.map_or(1, GroupCommunicator::size)
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        match self.group {
            Some(g) => self.collective(g, |g| TpCollectives::all_reduce_sum(g, tensor)),
            None => Solo.all_reduce_sum(tensor),
        }
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        match self.group {
            Some(g) => self.collective(g, |g| TpCollectives::all_gather(g, tensor)),
            None => Solo.all_gather(tensor),
        }
    }

    fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        match self.group {
            Some(g) => self.collective(g, |g| TpCollectives::reduce_scatter_sum(g, tensor)),
            None => Solo.reduce_scatter_sum(tensor),
        }
    }

    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError> {
        match self.group {
            Some(g) => self.collective(g, |g| TpCollectives::all_to_all(g, parts)),
            None => Solo.all_to_all(parts),
        }
    }
}

/// A forward's wait for its chunk's parameters still being gathered, timed by the pass
/// clock as communication.
struct GatherGate<'c, 'a> {
    clock: &'c PassClock<'a>,
    gathers: &'a ParamGathers,
    chunk: usize,
}

impl PieceGate for GatherGate<'_, '_> {
    fn before_piece(&self, piece: usize) -> Result<(), CollectiveError> {
        if !self.gathers.holds(self.chunk, piece) {
            return Ok(());
        }
        (self.clock)
            .communicating(|| self.gathers.wait_for(self.chunk, piece))
            .map_err(Into::into)
    }
}

/// A pass clock's context-parallel group, as the model's collectives.
struct GroupCollectives<'c, 'a> {
    clock: &'c PassClock<'a>,
    group: &'a GroupCommunicator,
}

impl TpCollectives for GroupCollectives<'_, '_> {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        (self.clock).collective(self.group, |g| TpCollectives::all_reduce_sum(g, tensor))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        (self.clock).collective(self.group, |g| TpCollectives::all_gather(g, tensor))
    }

    fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        (self.clock).collective(self.group, |g| TpCollectives::reduce_scatter_sum(g, tensor))
    }

    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError> {
        (self.clock).collective(self.group, |g| TpCollectives::all_to_all(g, parts))
    }
}

impl PipelineRank<'_> {
    /// A clock for one pass over this rank's groups.
    fn clock(&self) -> PassClock<'_> {
        PassClock {
            group: self.tp,
            context: self.context.map(|c| c.group),
            experts: self.experts.map(|e| e.group),
            emulation: self.emulation.as_ref(),
            span: Cell::new(ComputeSpan::start()),
            compute: Cell::new(Duration::ZERO),
            communication: Cell::new(Duration::ZERO),
        }
    }

    /// Whether `chunk`'s input and output cross to a stage that splits sequences
    /// otherwise (they then travel whole).
    fn crossing(&self, chunk: usize) -> Crossing {
        let at = |flags: &[bool]| flags.get(chunk).copied().unwrap_or(false);
        match &self.context {
            Some(c) => Crossing {
                input: at(c.whole_input),
                output: at(c.whole_output),
            },
            None => Crossing::default(),
        }
    }

    /// Whether the stage runs the model's parallel passes (a tensor- or
    /// context-parallel group).
    fn parallel(&self) -> bool {
        self.tp.is_some() || self.context.is_some() || self.experts.is_some()
    }

    /// The expert-parallel group of a pass, over `collectives`.
    fn expert_group<'c>(
        &self,
        collectives: Option<&'c GroupCollectives<'c, '_>>,
    ) -> Option<ExpertGroup<'c>> {
        let experts = self.experts?;
        Some(ExpertGroup {
            collectives: collectives?,
            placement: experts.placement.to_vec(),
            exchange_kind: experts.exchange_kind,
        })
    }

    /// The context-parallel group of a pass over `collectives` (`clock`'s, when the
    /// stage has one).
    fn context_group<'c>(
        &self,
        collectives: Option<&'c GroupCollectives<'c, '_>>,
    ) -> Option<ContextGroup<'c>> {
        let positions = self.context?.positions.to_vec();
        Some(ContextGroup {
            collectives: collectives?,
            positions,
        })
    }
}

impl PipelineRank<'_> {
    /// The sequence length of what `message` brings: the whole sequence, or under
    /// sequence parallelism this rank's rows of it (every sender cuts them out).
    fn received_sequence(
        &self,
        message: &Message,
        sequence_length: usize,
    ) -> Result<i64, TrainError> {
        let Piece { chunk, .. } = message.piece;
        let last_stage = self.stage_index + 1 == self.num_stages;
        // The chunk the message is for: named by the sender (see forward and backward).
        let receiver = match message.payload {
            Payload::Activation if self.stage_index == 0 => chunk.checked_add(1),
            Payload::Gradient if last_stage => chunk.checked_sub(1),
            _ => Some(chunk),
        };
        let fault = || TrainError::Pipeline(PipelineFault::NoChunkFor(*message));
        let stage = self
            .chunks
            .get(receiver.ok_or_else(fault)?)
            .ok_or_else(fault)?;
        let crossing = self.crossing(receiver.ok_or_else(fault)?);
        let whole = match message.payload {
            Payload::Activation => crossing.input,
            Payload::Gradient => crossing.output,
        };
        if let (true, Some(context)) = (whole, &self.context) {
            return Ok(context.positions.iter().map(Vec::len).sum::<usize>() as i64);
        }
        let rows = match message.payload {
            Payload::Activation => stage.takes_sequence_rows(),
            Payload::Gradient => stage.takes_output_grad_rows(),
        };
        let size = self.tp.map_or(1, GroupCommunicator::size);
        Ok(match rows {
            true => (sequence_length / size) as i64,
            false => sequence_length as i64,
        })
    }
}

/// What a program is run for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Forwards and backwards; the loss divided by the step's global loss tokens, each
    /// sequence's load-balancing loss weighed by 1 / the step's sequences.
    Train {
        loss_normaliser: f64,
        sequence_weight: f64,
    },
    /// Forwards only, without gradients.
    Evaluate,
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

/// The loss of a forward's logits, for the log (no graph, not read here).
fn no_grad_loss(logits: &Tensor, batch: &BatchTensors) -> (Tensor, Tensor) {
    synerfuse_model::tch::no_grad(|| Stage::loss(logits, &batch.labels, Some(&batch.loss_mask)))
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
                // Each query's row over the whole sequence (a context-parallel member
                // holds its own queries' rows).
                Tensor::from_slice(m)
                    .view([rows, 1, s, -1])
                    .to_device(device)
            }),
        }
    }
}

/// Counts the sends of each piece (an evaluation frees a piece's pass after its last).
fn count_sends(program: &[Instruction], step: &mut StepState) {
    for instruction in program {
        if let Instruction::Send(m) = instruction {
            let sends = match m.payload {
                Payload::Gradient => &mut step.gradient_sends,
                Payload::Activation => &mut step.activation_sends,
            };
            *sends.entry(m.piece).or_insert(0) += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compute(pass: Pass, micro_batch: usize) -> Instruction {
        Instruction::Compute {
            pass,
            piece: Piece::new(micro_batch, 0),
        }
    }

    /// The last stage of 1F1B runs each backward right after its forward (sends and
    /// receives between do not count); GPipe's forwards all come first but the last one.
    #[test]
    fn a_loss_is_kept_where_its_backward_comes_next() {
        use Pass::{Backward as B, Forward as F};
        let one_f_one_b = [compute(F, 0), compute(B, 0), compute(F, 1), compute(B, 1)];
        let kept: Vec<usize> = (backward_follows(&one_f_one_b).iter())
            .map(|p| p.micro_batch)
            .collect();
        assert_eq!(kept, [0, 1]);
        let gpipe = [compute(F, 0), compute(F, 1), compute(B, 1), compute(B, 0)];
        let kept: Vec<usize> = (backward_follows(&gpipe).iter())
            .map(|p| p.micro_batch)
            .collect();
        assert_eq!(kept, [1]);
    }
}
