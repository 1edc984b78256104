//! Why a schedule cannot be built or does not run.

use super::instruction::{Instruction, Message, Pass, Payload, Piece};
use super::kind::ScheduleKind;
use std::fmt;

/// A program blocked on an instruction (part of a deadlock report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// The program (rank or stage).
    pub program: usize,
    /// Index of the instruction it waits at.
    pub step: usize,
    /// That instruction.
    pub instruction: Instruction,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "program {} waits at step {} ({})",
            self.program, self.step, self.instruction
        )
    }
}

fn list(waiting: &[Waiting]) -> String {
    let parts: Vec<String> = waiting.iter().map(Waiting::to_string).collect();
    parts.join("; ")
}

/// A schedule that cannot be built or does not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A pipeline with no stage, chunk or micro-batch.
    #[error(
        "{stages} stages, {chunks} chunks, {micro_batches} micro-batches: all must be at least 1"
    )]
    Empty {
        /// Pipeline stages.
        stages: usize,
        /// Virtual chunks per stage.
        chunks: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// Virtual chunks under a schedule that runs one chunk per stage.
    #[error("the {kind} schedule runs one chunk per stage; {chunks} virtual chunks need the interleaved schedule")]
    ChunksNeedInterleaving {
        /// The schedule asked for.
        kind: ScheduleKind,
        /// Chunks per stage.
        chunks: usize,
    },
    /// Megatron's interleaved schedule with a micro-batch count it rejects.
    #[error("the interleaved schedule needs the micro-batch count ({micro_batches}) to be a multiple of the pipeline size ({stages}), as in Megatron")]
    InterleavedMicroBatches {
        /// Micro-batches per step.
        micro_batches: usize,
        /// Pipeline stages.
        stages: usize,
    },
    /// Some programs wait forever.
    #[error("deadlock: {}", list(.waiting))]
    Deadlock {
        /// The first few programs still waiting.
        waiting: Vec<Waiting>,
    },
    /// A message to a program that does not exist.
    #[error("program {program} sends to {peer}, which does not exist")]
    UnknownPeer {
        /// The sender.
        program: usize,
        /// The missing peer.
        peer: usize,
    },
    /// A send of a result not computed yet.
    #[error("program {program} sends the {} of {} before computing it", .message.payload, .message.piece)]
    SendBeforeCompute {
        /// The sender.
        program: usize,
        /// The message.
        message: Message,
    },
    /// A pass run twice over one piece.
    #[error("program {program} runs the {pass} of {piece} twice")]
    ComputedTwice {
        /// The program.
        program: usize,
        /// The pass.
        pass: Pass,
        /// The piece.
        piece: Piece,
    },
    /// A backward before its forward.
    #[error("program {program} runs the backward of {piece} before its forward")]
    BackwardBeforeForward {
        /// The program.
        program: usize,
        /// The piece.
        piece: Piece,
    },
    /// A message nobody receives.
    #[error(
        "program {from} sends the {payload} of {piece} to program {to}, which never receives it"
    )]
    Unreceived {
        /// The sender.
        from: usize,
        /// The addressee.
        to: usize,
        /// What it carries.
        payload: Payload,
        /// The sending piece.
        piece: Piece,
    },
    /// Forwards whose backward never runs, or the reverse.
    #[error("program {program} ends with {forwards} forwards but {backwards} backwards")]
    Unbalanced {
        /// The program.
        program: usize,
        /// Forwards run.
        forwards: usize,
        /// Backwards run.
        backwards: usize,
    },
    /// A piece of a pipeline a program never computes.
    #[error("program {program} never runs the {pass} of {piece}")]
    NeverComputed {
        /// The program.
        program: usize,
        /// The pass.
        pass: Pass,
        /// The piece.
        piece: Piece,
    },
    /// A micro-batch's passes out of model order along a pipeline.
    #[error(
        "micro-batch {micro_batch}: {pass}s out of pipeline order (sequence numbers {order:?})"
    )]
    OutOfOrder {
        /// The micro-batch.
        micro_batch: usize,
        /// The pass.
        pass: Pass,
        /// When each piece along model order ran.
        order: Vec<usize>,
    },
}
