//! Pipeline schedules as per-rank instruction lists (GPipe, 1F1B, interleaved 1F1B), and
//! a checker that runs every rank's list against the others.
//!
//! Sends are buffered (the runtime posts non-blocking sends) and receives block until the
//! matching send has been issued, so a schedule is deadlock-free exactly when the checker
//! can run every list to its end. Pipelines of different data-parallel replicas never talk
//! to each other, so replicas with different micro-batch counts simply run schedules of
//! different lengths.

mod error;
mod instruction;
mod interpret;
mod kind;

pub use error::{ScheduleError, Waiting};
pub use instruction::{Instruction, Message, Pass, Payload, Piece};
pub use interpret::{interpret, Observer};
pub use kind::{ScheduleKind, UnknownScheduleKind};

use std::collections::{HashMap, HashSet};

/// Per-stage instruction lists of one pipeline of `stages` stages with `chunks` virtual
/// chunks per stage and `micro_batches` micro-batches. Peers are stage indices.
pub fn pipeline_schedule(
    kind: ScheduleKind,
    stages: usize,
    chunks: usize,
    micro_batches: usize,
) -> Result<Vec<Vec<Instruction>>, ScheduleError> {
    if stages == 0 || chunks == 0 || micro_batches == 0 {
        return Err(ScheduleError::Empty {
            stages,
            chunks,
            micro_batches,
        });
    }
    match kind {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB if chunks != 1 => {
            Err(ScheduleError::ChunksNeedInterleaving { kind, chunks })
        }
        ScheduleKind::Interleaved if micro_batches % stages != 0 => {
            Err(ScheduleError::InterleavedMicroBatches {
                micro_batches,
                stages,
            })
        }
        _ => Ok((0..stages)
            .map(|p| stage_program(kind, p, stages, chunks, micro_batches))
            .collect()),
    }
}

/// The order in which stage `p` runs forwards and backwards, as (pass, virtual id).
fn compute_order(
    kind: ScheduleKind,
    p: usize,
    stages: usize,
    chunks: usize,
    m: usize,
) -> Vec<(Pass, usize)> {
    let total = m * chunks;
    let warmup = match kind {
        ScheduleKind::Gpipe => total,
        ScheduleKind::OneFOneB => (stages - p - 1).min(total),
        ScheduleKind::Interleaved => {
            if m == stages {
                total
            } else {
                ((stages - p - 1) * 2 + (chunks - 1) * stages).min(total)
            }
        }
    };
    let mut order: Vec<(Pass, usize)> = (0..warmup).map(|k| (Pass::Forward, k)).collect();
    for k in 0..total - warmup {
        order.push((Pass::Forward, warmup + k));
        order.push((Pass::Backward, k));
    }
    order.extend((total - warmup..total).map(|k| (Pass::Backward, k)));
    order
}

/// Virtual id k → piece: Megatron's groups of `stages` micro-batches per chunk;
/// backwards walk the chunks in reverse.
fn virtual_to_real(k: usize, pass: Pass, stages: usize, chunks: usize) -> Piece {
    let in_group = k % (stages * chunks);
    let mut chunk = in_group / stages;
    if pass == Pass::Backward {
        chunk = chunks - chunk - 1;
    }
    Piece::new((k / (stages * chunks)) * stages + k % stages, chunk)
}

fn stage_program(
    kind: ScheduleKind,
    p: usize,
    stages: usize,
    chunks: usize,
    m: usize,
) -> Vec<Instruction> {
    let last = stages - 1;
    let mut program = Vec::new();
    for (pass, k) in compute_order(kind, p, stages, chunks, m) {
        let piece = if chunks == 1 {
            Piece::new(k, 0)
        } else {
            virtual_to_real(k, pass, stages, chunks)
        };
        let chunk = piece.chunk;
        // The piece before (chunk, p) in model order, and the one after.
        let before = if p > 0 {
            Some((p - 1, chunk))
        } else if chunk > 0 {
            Some((last, chunk - 1))
        } else {
            None
        };
        let after = if p < last {
            Some((p + 1, chunk))
        } else if chunk + 1 < chunks {
            Some((0, chunk + 1))
        } else {
            None
        };
        // Forwards receive from the piece before and send to the one after; backwards
        // the reverse. A received message is named by its sender's chunk.
        let (payload, from, to) = match pass {
            Pass::Forward => (Payload::Activation, before, after),
            Pass::Backward => (Payload::Gradient, after, before),
        };
        if let Some((peer, c)) = from {
            program.push(Instruction::Recv(Message {
                payload,
                peer,
                piece: Piece::new(piece.micro_batch, c),
            }));
        }
        program.push(Instruction::Compute { pass, piece });
        if let Some((peer, _)) = to {
            program.push(Instruction::Send(Message {
                payload,
                peer,
                piece,
            }));
        }
    }
    program
}

/// What a schedule run found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleReport {
    /// Per program: the most forwards whose backward had not run yet (activations held).
    pub peak_in_flight: Vec<usize>,
    /// Rounds of the run until every program finished (a rough makespan in steps).
    pub rounds: usize,
    /// Global order in which computations ran: (program, pass, piece) → sequence number.
    pub computed_at: HashMap<(usize, Pass, Piece), usize>,
}

impl ScheduleReport {
    /// Checks one pipeline's causal order: along model order (`pipeline[p]` is the
    /// program of stage p; chunk c of the last stage feeds chunk c + 1 of the first),
    /// each micro-batch's forward runs stage after stage, and its backward in reverse.
    pub fn check_pipeline_order(
        &self,
        pipeline: &[usize],
        chunks: usize,
        micro_batches: usize,
    ) -> Result<(), ScheduleError> {
        for micro_batch in 0..micro_batches {
            let pieces: Vec<(usize, Piece)> = (0..chunks)
                .flat_map(|c| {
                    pipeline
                        .iter()
                        .map(move |&program| (program, Piece::new(micro_batch, c)))
                })
                .collect();
            for pass in [Pass::Forward, Pass::Backward] {
                let order: Vec<usize> = pieces
                    .iter()
                    .map(|&(program, piece)| {
                        self.computed_at
                            .get(&(program, pass, piece))
                            .copied()
                            .ok_or(ScheduleError::NeverComputed {
                                program,
                                pass,
                                piece,
                            })
                    })
                    .collect::<Result<_, _>>()?;
                let in_order = match pass {
                    Pass::Forward => order.windows(2).all(|w| w[0] < w[1]),
                    Pass::Backward => order.windows(2).all(|w| w[0] > w[1]),
                };
                if !in_order {
                    return Err(ScheduleError::OutOfOrder {
                        micro_batch,
                        pass,
                        order,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Whether the messages from rank `from` to rank `to` are received in the order they are
/// sent. Transports without tags (NCCL point-to-point) match sends to receives by order
/// alone, so they may carry the link only when this holds.
pub fn link_in_order(programs: &[Vec<Instruction>], from: usize, to: usize) -> bool {
    let messages = |rank: usize, sending: bool, peer: usize| -> Vec<(Payload, Piece)> {
        programs
            .get(rank)
            .into_iter()
            .flatten()
            .filter_map(|&i| i.transfer())
            .filter(|&(sends, m)| sends == sending && m.peer == peer)
            .map(|(_, m)| (m.payload, m.piece))
            .collect()
    };
    messages(from, true, to) == messages(to, false, from)
}

/// The checker's view of a run: what each program computed, and in which order.
struct Checker {
    done: Vec<[HashSet<Piece>; 2]>,
    in_flight: Vec<usize>,
    peak: Vec<usize>,
    computed_at: HashMap<(usize, Pass, Piece), usize>,
}

impl Checker {
    fn new(programs: usize) -> Self {
        Checker {
            done: vec![Default::default(); programs],
            in_flight: vec![0; programs],
            peak: vec![0; programs],
            computed_at: HashMap::new(),
        }
    }

    fn computed(&self, program: usize, pass: Pass) -> &HashSet<Piece> {
        &self.done[program][pass as usize]
    }
}

impl Observer for Checker {
    type Stamp = ();

    fn compute(&mut self, program: usize, pass: Pass, piece: Piece) -> Result<(), ScheduleError> {
        if pass == Pass::Backward && !self.computed(program, Pass::Forward).contains(&piece) {
            return Err(ScheduleError::BackwardBeforeForward { program, piece });
        }
        if !self.done[program][pass as usize].insert(piece) {
            return Err(ScheduleError::ComputedTwice {
                program,
                pass,
                piece,
            });
        }
        match pass {
            Pass::Forward => {
                self.in_flight[program] += 1;
                self.peak[program] = self.peak[program].max(self.in_flight[program]);
            }
            Pass::Backward => self.in_flight[program] -= 1,
        }
        let sequence = self.computed_at.len();
        self.computed_at.insert((program, pass, piece), sequence);
        Ok(())
    }

    fn send(&mut self, program: usize, message: Message) -> Result<(), ScheduleError> {
        if self
            .computed(program, message.payload.produced_by())
            .contains(&message.piece)
        {
            Ok(())
        } else {
            Err(ScheduleError::SendBeforeCompute { program, message })
        }
    }

    fn receive(&mut self, _program: usize, _stamp: ()) {}
}

/// Runs every program against the others (sends buffered, receives wait for their send)
/// and checks that all finish, that every send is received, that each piece is forwarded
/// then backwarded exactly once per program, and that nothing is sent before it is
/// computed. `programs[i]` names its peers by index into `programs`.
pub fn check_schedule(programs: &[Vec<Instruction>]) -> Result<ScheduleReport, ScheduleError> {
    let mut checker = Checker::new(programs.len());
    let rounds = interpret(programs, &mut checker)?;
    for (program, [forwards, backwards]) in checker.done.iter().enumerate() {
        if forwards.len() != backwards.len() {
            return Err(ScheduleError::Unbalanced {
                program,
                forwards: forwards.len(),
                backwards: backwards.len(),
            });
        }
    }
    Ok(ScheduleReport {
        peak_in_flight: checker.peak,
        rounds,
        computed_at: checker.computed_at,
    })
}

/// The forward-only program of a training `program` (evaluation): its forwards and the
/// activations they send and receive, in the same order; backwards and gradients
/// dropped. Dropping matched sends and receives cannot make ranks wait on each other
/// that did not in the training programs, so forward-only programs of a valid schedule
/// finish too (checked by [`check_forward_only`]).
pub fn forward_only(program: &[Instruction]) -> Vec<Instruction> {
    program
        .iter()
        .copied()
        .filter(|i| match i {
            Instruction::Compute { pass, .. } => *pass == Pass::Forward,
            Instruction::Send(m) | Instruction::Recv(m) => m.payload == Payload::Activation,
        })
        .collect()
}

/// [`check_schedule`] for forward-only programs: every program finishes, every send is
/// received, each piece is forwarded once and sent only after it is computed.
pub fn check_forward_only(programs: &[Vec<Instruction>]) -> Result<ScheduleReport, ScheduleError> {
    let mut checker = Checker::new(programs.len());
    let rounds = interpret(programs, &mut checker)?;
    if let Some((program, [_, backwards])) = checker
        .done
        .iter()
        .enumerate()
        .find(|(_, [_, backwards])| !backwards.is_empty())
    {
        return Err(ScheduleError::Unbalanced {
            program,
            forwards: checker.done[program][0].len(),
            backwards: backwards.len(),
        });
    }
    Ok(ScheduleReport {
        peak_in_flight: checker.peak,
        rounds,
        computed_at: checker.computed_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_f_one_b_matches_megatron_warmup() {
        // Stage 0 of 4 with 8 micro-batches: 3 warmup forwards, then F/B pairs.
        let s = pipeline_schedule(ScheduleKind::OneFOneB, 4, 1, 8).unwrap();
        let computes: Vec<String> = s[0]
            .iter()
            .filter_map(|i| match i {
                Instruction::Compute {
                    pass: Pass::Forward,
                    piece,
                } => Some(format!("F{}", piece.micro_batch)),
                Instruction::Compute {
                    pass: Pass::Backward,
                    piece,
                } => Some(format!("B{}", piece.micro_batch)),
                _ => None,
            })
            .collect();
        assert_eq!(computes[..6], ["F0", "F1", "F2", "F3", "B0", "F4"]);
        let report = check_schedule(&s).unwrap();
        assert_eq!(report.peak_in_flight, [4, 3, 2, 1]);
        let gpipe =
            check_schedule(&pipeline_schedule(ScheduleKind::Gpipe, 4, 1, 8).unwrap()).unwrap();
        assert_eq!(gpipe.peak_in_flight, [8, 8, 8, 8]);
    }

    #[test]
    fn schedule_names_round_trip() {
        for kind in [
            ScheduleKind::Gpipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved,
        ] {
            assert_eq!(kind.to_string().parse::<ScheduleKind>(), Ok(kind));
        }
        assert!("zero-bubble".parse::<ScheduleKind>().is_err());
    }

    #[test]
    fn checker_catches_broken_programs() {
        let mut s = pipeline_schedule(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
        // Stage 1 forgets a receive: stage 0's send is never received.
        s[1].retain(|i| !matches!(i, Instruction::Recv(m) if m.piece.micro_batch == 1));
        assert_eq!(
            check_schedule(&s),
            Err(ScheduleError::Unreceived {
                from: 0,
                to: 1,
                payload: Payload::Activation,
                piece: Piece::new(1, 0)
            })
        );
        // Out-of-order receives: tags save MPI, but NCCL would mismatch them.
        let mut swapped = pipeline_schedule(ScheduleKind::Gpipe, 2, 1, 2).unwrap();
        assert!(link_in_order(&swapped, 0, 1));
        let recvs: Vec<usize> = swapped[1]
            .iter()
            .enumerate()
            .filter(|(_, i)| matches!(i, Instruction::Recv(m) if m.payload == Payload::Activation))
            .map(|(n, _)| n)
            .collect();
        swapped[1].swap(recvs[0], recvs[1]);
        assert!(!link_in_order(&swapped, 0, 1));
        assert!(link_in_order(&swapped, 1, 0));
        // Two stages that both receive first: deadlock.
        let recv = |payload, peer| {
            Instruction::Recv(Message {
                payload,
                peer,
                piece: Piece::new(0, 0),
            })
        };
        let s = vec![
            vec![recv(Payload::Gradient, 1)],
            vec![recv(Payload::Activation, 0)],
        ];
        let deadlock = check_schedule(&s).unwrap_err();
        assert!(matches!(&deadlock, ScheduleError::Deadlock { waiting } if waiting.len() == 2));
        assert_eq!(
            deadlock.to_string(),
            "deadlock: program 0 waits at step 0 (receive gradient of micro-batch 0 chunk 0 from 1); \
             program 1 waits at step 0 (receive activation of micro-batch 0 chunk 0 from 0)"
        );
        // A send before its compute, a backward before its forward.
        let s = vec![
            vec![Instruction::Send(Message {
                payload: Payload::Activation,
                peer: 1,
                piece: Piece::new(0, 0),
            })],
            vec![recv(Payload::Activation, 0)],
        ];
        assert!(matches!(
            check_schedule(&s),
            Err(ScheduleError::SendBeforeCompute { program: 0, .. })
        ));
        let s = vec![vec![Instruction::backward(Piece::new(0, 0))]];
        assert!(matches!(
            check_schedule(&s),
            Err(ScheduleError::BackwardBeforeForward { program: 0, .. })
        ));
        assert!(matches!(
            pipeline_schedule(ScheduleKind::Interleaved, 4, 2, 6),
            Err(ScheduleError::InterleavedMicroBatches { .. })
        ));
        assert!(matches!(
            pipeline_schedule(ScheduleKind::OneFOneB, 4, 2, 8),
            Err(ScheduleError::ChunksNeedInterleaving { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whole grids whose replicas run different micro-batch counts: every rank's
        /// program runs, pipelines stay in order.
        #[test]
        fn mixed_replica_counts(
            tp in 1usize..3,
            pp in 1usize..6,
            shapes in prop::collection::vec((1usize..4, 1usize..9), 1..4),
            gpipe in any::<bool>(),
        ) {
            let batches = crate::ReplicaBatches::new(shapes.iter().map(|&(m, n)| crate::ReplicaBatch::uniform(m, n)).collect()).unwrap();
            let world = tp * pp * shapes.len();
            let plan = crate::GridPlan::new(
                crate::flags::TopologySpec { world_size: world, tp, pp, cp: 1, ep: 1, order: crate::TP_PP_DP_ORDER.into() },
                crate::StageLayout::uniform(pp * 2, pp).unwrap(),
                batches,
                Vec::new(),
            ).unwrap();
            let kind = if gpipe { ScheduleKind::Gpipe } else { ScheduleKind::OneFOneB };
            let programs = crate::Plan::from_grid(&plan).unwrap().schedule(kind).unwrap();
            let report = check_schedule(&programs).unwrap();
            let topology = plan.topology().unwrap();
            for pipeline in topology.groups(crate::GroupKind::Pp) {
                let dp = topology.coordinates(pipeline[0]).unwrap().dp;
                report.check_pipeline_order(&pipeline, 1, shapes[dp].1).unwrap();
            }
        }

        #[test]
        fn schedules_run_to_completion(p in 1usize..=16, m in 1usize..=64, v in 1usize..=4, kind in 0..3u8) {
            let kind = [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved][kind as usize];
            let (v, m) = match kind {
                ScheduleKind::Interleaved => (v, (m / p).max(1) * p),
                _ => (1, m),
            };
            let programs = pipeline_schedule(kind, p, v, m).unwrap();
            let report = check_schedule(&programs).unwrap();
            let stages: Vec<usize> = (0..p).collect();
            report.check_pipeline_order(&stages, v, m).unwrap();
            // Neighbours receive in send order (NCCL point-to-point can carry every link).
            for a in 0..p {
                for b in [(a + 1) % p, (a + p - 1) % p] {
                    prop_assert!(link_in_order(&programs, a, b), "{:?} link {} -> {}", kind, a, b);
                }
            }
            for (stage, &peak) in report.peak_in_flight.iter().enumerate() {
                let expected = match kind {
                    ScheduleKind::Gpipe => m,
                    ScheduleKind::OneFOneB => (p - stage).min(m),
                    ScheduleKind::Interleaved => if m == p { m * v } else {
                        ((p - stage - 1) * 2 + (v - 1) * p + 1).min(m * v)
                    },
                };
                prop_assert_eq!(peak, expected, "stage {}", stage);
            }
            // Every stage forwards and backwards every (micro-batch, chunk) once.
            for program in &programs {
                let forwards = program.iter().filter(|i| matches!(i, Instruction::Compute { pass: Pass::Forward, .. })).count();
                prop_assert_eq!(forwards, m * v);
            }
        }
    }
}
