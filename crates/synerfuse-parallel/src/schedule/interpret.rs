//! The one interpreter of per-rank programs. Sends are buffered and receives block until
//! the matching send has been posted, so programs are deadlock-free exactly when the
//! interpreter runs every one to its end. The schedule checker and the simulator are two
//! [`Observer`]s of the same run.

use super::{Instruction, Message, Pass, Payload, Piece, ScheduleError, Waiting};
use std::collections::{HashMap, VecDeque};

/// What one run of the programs is watched by.
pub(crate) trait Observer {
    /// What travels with a message from its send to its receive (the simulator's arrival
    /// time; nothing for the checker).
    type Stamp;

    /// Program `program` runs `pass` over `piece`.
    fn compute(&mut self, program: usize, pass: Pass, piece: Piece) -> Result<(), ScheduleError>;

    /// Program `program` posts `message` (its peer exists).
    fn send(&mut self, program: usize, message: Message) -> Result<Self::Stamp, ScheduleError>;

    /// Program `program` receives a message posted with `stamp`.
    fn receive(&mut self, program: usize, stamp: Self::Stamp);
}

/// (from, to, payload, sending piece): the name both ends give a message.
type MessageKey = (usize, usize, Payload, Piece);

/// Runs every program against the others: each round, each program runs until it blocks
/// on a receive. Returns the number of rounds; fails on a deadlock, a peer that is not a
/// program, a message never received, or whatever `observer` rejects.
pub(crate) fn interpret<O: Observer>(
    programs: &[Vec<Instruction>],
    observer: &mut O,
) -> Result<usize, ScheduleError> {
    let n = programs.len();
    let mut next = vec![0usize; n];
    let mut mailbox: HashMap<MessageKey, VecDeque<O::Stamp>> = HashMap::new();
    let mut rounds = 0;
    loop {
        rounds += 1;
        let mut progressed = false;
        for (program, instructions) in programs.iter().enumerate() {
            while let Some(&instruction) = instructions.get(next[program]) {
                let ran = match instruction {
                    Instruction::Compute { pass, piece } => {
                        observer.compute(program, pass, piece)?;
                        true
                    }
                    Instruction::Send(message) => {
                        if message.peer >= n {
                            return Err(ScheduleError::UnknownPeer {
                                program,
                                peer: message.peer,
                            });
                        }
                        let stamp = observer.send(program, message)?;
                        let key = (program, message.peer, message.payload, message.piece);
                        mailbox.entry(key).or_default().push_back(stamp);
                        true
                    }
                    Instruction::Recv(message) => {
                        let key = (message.peer, program, message.payload, message.piece);
                        match mailbox.get_mut(&key).and_then(VecDeque::pop_front) {
                            Some(stamp) => {
                                observer.receive(program, stamp);
                                true
                            }
                            None => false,
                        }
                    }
                };
                if !ran {
                    break;
                }
                next[program] += 1;
                progressed = true;
            }
        }
        if next.iter().zip(programs).all(|(&at, p)| at == p.len()) {
            break;
        }
        if !progressed {
            return Err(ScheduleError::Deadlock {
                waiting: (0..n)
                    .filter(|&p| next[p] < programs[p].len())
                    .take(4)
                    .map(|p| Waiting {
                        program: p,
                        step: next[p],
                        instruction: programs[p][next[p]],
                    })
                    .collect(),
            });
        }
    }
    let mut unreceived: Vec<&MessageKey> = mailbox
        .iter()
        .filter(|(_, stamps)| !stamps.is_empty())
        .map(|(key, _)| key)
        .collect();
    unreceived.sort();
    match unreceived.first() {
        Some(&&(from, to, payload, piece)) => Err(ScheduleError::Unreceived {
            from,
            to,
            payload,
            piece,
        }),
        None => Ok(rounds),
    }
}
