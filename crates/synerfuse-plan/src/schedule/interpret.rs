//! The one interpreter of per-rank programs. Sends are buffered and receives block until
//! the matching send has been posted, so programs are deadlock-free exactly when the
//! interpreter runs every one to its end. The schedule checker and the simulator are two
//! [`Observer`]s of the same run.

use super::error::{ScheduleError, Waiting};
use super::instruction::{Instruction, Message, Pass, Payload, Piece};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

/// What one run of the programs is watched by.
pub trait Observer {
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

/// Messages in flight, in send order per name. Schedules send each name once, so the
/// common case is one map entry, removed on receipt (no queue allocated): the planner
/// simulates programs of thousands of ranks through this.
struct Mailbox<S> {
    first: HashMap<MessageKey, S>,
    later: HashMap<MessageKey, VecDeque<S>>,
}

impl<S> Mailbox<S> {
    fn new() -> Self {
        Mailbox {
            first: HashMap::new(),
            later: HashMap::new(),
        }
    }

    fn post(&mut self, key: MessageKey, stamp: S) {
        match self.first.entry(key) {
            Entry::Vacant(slot) => {
                slot.insert(stamp);
            }
            Entry::Occupied(_) => self.later.entry(key).or_default().push_back(stamp),
        }
    }

    fn take(&mut self, key: &MessageKey) -> Option<S> {
        let stamp = self.first.remove(key)?;
        if let Some(queue) = self.later.get_mut(key) {
            if let Some(next) = queue.pop_front() {
                self.first.insert(*key, next);
            }
            if queue.is_empty() {
                self.later.remove(key);
            }
        }
        Some(stamp)
    }

    /// The first (in key order) message not received.
    fn first_unreceived(&self) -> Option<MessageKey> {
        self.first.keys().min().copied()
    }
}

/// Runs every program against the others: each round, each program runs until it blocks
/// on a receive. Returns the number of rounds; fails on a deadlock, a peer that is not a
/// program, a message never received, or whatever `observer` rejects.
pub fn interpret<O: Observer>(
    programs: &[Vec<Instruction>],
    observer: &mut O,
) -> Result<usize, ScheduleError> {
    let mut run = Run {
        programs,
        next: vec![0; programs.len()],
        mailbox: Mailbox::new(),
        observer,
    };
    let mut rounds = 0;
    loop {
        rounds += 1;
        let mut progressed = false;
        for program in 0..programs.len() {
            progressed |= run.until_blocked(program)?;
        }
        if run.finished() {
            return run.all_received().map(|()| rounds);
        }
        if !progressed {
            return Err(run.deadlock());
        }
    }
}

/// The state of one run: where each program is, and the messages in flight.
struct Run<'a, O: Observer> {
    programs: &'a [Vec<Instruction>],
    next: Vec<usize>,
    mailbox: Mailbox<O::Stamp>,
    observer: &'a mut O,
}

impl<O: Observer> Run<'_, O> {
    /// Runs `program` until it ends or waits for a message; whether it moved.
    fn until_blocked(&mut self, program: usize) -> Result<bool, ScheduleError> {
        let mut moved = false;
        while let Some(&instruction) = self.programs[program].get(self.next[program]) {
            if !self.step(program, instruction)? {
                break;
            }
            self.next[program] += 1;
            moved = true;
        }
        Ok(moved)
    }

    /// Runs one instruction; `false` when it is a receive whose message is not there.
    fn step(&mut self, program: usize, instruction: Instruction) -> Result<bool, ScheduleError> {
        match instruction {
            Instruction::Compute { pass, piece } => self.observer.compute(program, pass, piece)?,
            Instruction::Send(message) => {
                if message.peer >= self.programs.len() {
                    return Err(ScheduleError::UnknownPeer {
                        program,
                        peer: message.peer,
                    });
                }
                let stamp = self.observer.send(program, message)?;
                let key = (program, message.peer, message.payload, message.piece);
                self.mailbox.post(key, stamp);
            }
            Instruction::Recv(message) => {
                let key = (message.peer, program, message.payload, message.piece);
                match self.mailbox.take(&key) {
                    Some(stamp) => self.observer.receive(program, stamp),
                    None => return Ok(false),
                }
            }
        }
        Ok(true)
    }

    fn finished(&self) -> bool {
        self.next
            .iter()
            .zip(self.programs)
            .all(|(&at, p)| at == p.len())
    }

    /// The first few programs still waiting, and where.
    fn deadlock(&self) -> ScheduleError {
        let waiting = (0..self.programs.len())
            .filter(|&p| self.next[p] < self.programs[p].len())
            .take(4)
            .map(|p| Waiting {
                program: p,
                step: self.next[p],
                instruction: self.programs[p][self.next[p]],
            })
            .collect();
        ScheduleError::Deadlock { waiting }
    }

    /// Fails on the first (in key order) message sent but never received.
    fn all_received(&self) -> Result<(), ScheduleError> {
        match self.mailbox.first_unreceived() {
            Some((from, to, payload, piece)) => Err(ScheduleError::Unreceived {
                from,
                to,
                payload,
                piece,
            }),
            None => Ok(()),
        }
    }
}
