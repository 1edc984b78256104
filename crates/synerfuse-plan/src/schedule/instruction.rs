//! The instructions of a rank's pipeline program: compute a piece, send or receive a
//! message. A message is named by the *sending* piece on both ends.

use std::fmt;

/// One micro-batch through one virtual chunk of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Piece {
    /// Micro-batch index within the replica's step.
    pub micro_batch: usize,
    /// Virtual chunk of the stage (0 without interleaving).
    pub chunk: usize,
}

impl Piece {
    /// The piece of `micro_batch` through `chunk`.
    pub fn new(micro_batch: usize, chunk: usize) -> Self {
        Piece { micro_batch, chunk }
    }
}

impl fmt::Display for Piece {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "micro-batch {} chunk {}", self.micro_batch, self.chunk)
    }
}

/// Which pass over a piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pass {
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        })
    }
}

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Payload {
    /// A forward's output activation, sent down the pipeline.
    Activation,
    /// A backward's input gradient, sent up the pipeline.
    Gradient,
}

impl Payload {
    /// The pass whose result the message carries.
    pub fn produced_by(self) -> Pass {
        match self {
            Payload::Activation => Pass::Forward,
            Payload::Gradient => Pass::Backward,
        }
    }
}

impl fmt::Display for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Payload::Activation => "activation",
            Payload::Gradient => "gradient",
        })
    }
}

/// One transfer as one end sees it. `peer` is a pipeline stage in per-pipeline schedules
/// and a global rank in per-rank schedules; `piece` is the sending piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Message {
    /// What it carries.
    pub payload: Payload,
    /// The other end.
    pub peer: usize,
    /// The sender's (micro-batch, chunk).
    pub piece: Piece,
}

/// One step of a rank's program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Instruction {
    /// Run a pass over a piece.
    Compute {
        /// Forward or backward.
        pass: Pass,
        /// The piece.
        piece: Piece,
    },
    /// Post a message (non-blocking).
    Send(Message),
    /// Wait for a message.
    Recv(Message),
}

impl Instruction {
    /// The forward of `piece`.
    pub fn forward(piece: Piece) -> Self {
        Instruction::Compute {
            pass: Pass::Forward,
            piece,
        }
    }

    /// The backward of `piece`.
    pub fn backward(piece: Piece) -> Self {
        Instruction::Compute {
            pass: Pass::Backward,
            piece,
        }
    }

    /// The same instruction with its peer renamed by `rename` (stage → global rank).
    pub fn map_peer(self, rename: impl Fn(usize) -> usize) -> Self {
        let renamed = |m: Message| Message {
            peer: rename(m.peer),
            ..m
        };
        match self {
            Instruction::Send(m) => Instruction::Send(renamed(m)),
            Instruction::Recv(m) => Instruction::Recv(renamed(m)),
            compute => compute,
        }
    }

    /// `Some((true, m))` for a send, `Some((false, m))` for a receive.
    pub fn transfer(self) -> Option<(bool, Message)> {
        match self {
            Instruction::Send(m) => Some((true, m)),
            Instruction::Recv(m) => Some((false, m)),
            Instruction::Compute { .. } => None,
        }
    }
}

impl fmt::Display for Instruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Instruction::Compute { pass, piece } => write!(f, "{pass} of {piece}"),
            Instruction::Send(m) => write!(f, "send {} of {} to {}", m.payload, m.piece, m.peer),
            Instruction::Recv(m) => {
                write!(f, "receive {} of {} from {}", m.payload, m.piece, m.peer)
            }
        }
    }
}
