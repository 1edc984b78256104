//! Discrete-event simulation of per-rank pipeline programs: each rank runs its
//! instructions in order; computations take their time, a send occupies its sender
//! while it posts the message (then the bytes travel on their own), receives wait for
//! arrival.

use synerfuse_plan::timeline::{Span, SpanKind};
use synerfuse_plan::{interpret, Observer};
use synerfuse_plan::{Instruction, Message, Pass, Piece, ScheduleError};

/// One message's cost: the time its sender is occupied posting it (per-message
/// overhead, a staging copy), and the time the bytes then take to arrive.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Transfer {
    /// Seconds the sender spends on the send.
    pub sender_s: f64,
    /// Seconds from the send's end to the message's arrival.
    pub transit_s: f64,
}

/// What a simulated step looks like.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// When each rank finishes its program, s.
    pub finish_s: Vec<f64>,
    /// Time each rank computes, s.
    pub busy_s: Vec<f64>,
    /// The last finish.
    pub makespan_s: f64,
    /// Each rank's last backward computation, (start, end) s ((0, 0) for none): where a
    /// chunk's last backward makes its gradients final, which overlapped reductions
    /// start inside.
    pub last_backward_s: Vec<(f64, f64)>,
    /// Each rank's first forward computation, (start, end) s ((0, 0) for none): where
    /// the step reads its parameters first, which overlapped parameter gathers are
    /// waited for inside (in the next step, at the same offsets).
    pub first_forward_s: Vec<(f64, f64)>,
    /// Each rank's spans, when asked for ([`simulate_spans`]); empty otherwise.
    pub spans: Vec<Vec<Span>>,
}

impl SimReport {
    /// Fraction of rank-time spent not computing until the makespan.
    pub fn bubble_fraction(&self) -> f64 {
        let total = self.makespan_s * self.busy_s.len() as f64;
        if total <= 0.0 {
            return 0.0;
        }
        1.0 - self.busy_s.iter().sum::<f64>() / total
    }
}

/// The simulator's view of a run: each program's clock and busy time (and its spans,
/// when recorded).
struct Clocks<Op, Link> {
    op_seconds: Op,
    message_seconds: Link,
    clock: Vec<f64>,
    busy: Vec<f64>,
    last_backward: Vec<(f64, f64)>,
    first_forward: Vec<Option<(f64, f64)>>,
    spans: Option<Vec<Vec<Span>>>,
}

impl<Op, Link> Clocks<Op, Link> {
    fn record(&mut self, rank: usize, kind: SpanKind, start_s: f64, micro_batch: Option<usize>) {
        let end_s = self.clock[rank];
        if let Some(spans) = self.spans.as_mut().filter(|_| end_s > start_s) {
            spans[rank].push(Span {
                kind,
                start_s,
                end_s,
                micro_batch,
            });
        }
    }
}

impl<Op, Link> Observer for Clocks<Op, Link>
where
    Op: Fn(usize, Pass, Piece) -> f64,
    Link: Fn(usize, usize, Piece) -> Transfer,
{
    /// Arrival time.
    type Stamp = f64;

    fn compute(&mut self, rank: usize, pass: Pass, piece: Piece) -> Result<(), ScheduleError> {
        let t = (self.op_seconds)(rank, pass, piece);
        let start = self.clock[rank];
        self.clock[rank] += t;
        self.busy[rank] += t;
        let kind = match pass {
            Pass::Forward => {
                let first = &mut self.first_forward[rank];
                first.get_or_insert((start, self.clock[rank]));
                SpanKind::Forward
            }
            Pass::Backward => {
                self.last_backward[rank] = (start, self.clock[rank]);
                SpanKind::Backward
            }
        };
        self.record(rank, kind, start, Some(piece.micro_batch));
        Ok(())
    }

    fn send(&mut self, rank: usize, message: Message) -> Result<f64, ScheduleError> {
        let transfer = (self.message_seconds)(rank, message.peer, message.piece);
        let start = self.clock[rank];
        self.clock[rank] += transfer.sender_s;
        self.record(rank, SpanKind::Send, start, Some(message.piece.micro_batch));
        Ok(self.clock[rank] + transfer.transit_s)
    }

    fn receive(&mut self, rank: usize, arrival: f64) {
        let start = self.clock[rank];
        self.clock[rank] = start.max(arrival);
        self.record(rank, SpanKind::Wait, start, None);
    }
}

/// Runs `programs` (peers are program indices, as `Plan::schedule` makes them) with
/// `op_seconds(rank, pass, piece)` for each computation and
/// `message_seconds(from, to, piece)` for each transfer.
pub fn simulate(
    programs: &[Vec<Instruction>],
    op_seconds: impl Fn(usize, Pass, Piece) -> f64,
    message_seconds: impl Fn(usize, usize, Piece) -> Transfer,
) -> Result<SimReport, ScheduleError> {
    run(programs, op_seconds, message_seconds, false)
}

/// [`simulate`], recording each rank's passes, sends and waits as [`Span`]s (for a
/// timeline).
pub fn simulate_spans(
    programs: &[Vec<Instruction>],
    op_seconds: impl Fn(usize, Pass, Piece) -> f64,
    message_seconds: impl Fn(usize, usize, Piece) -> Transfer,
) -> Result<SimReport, ScheduleError> {
    run(programs, op_seconds, message_seconds, true)
}

fn run(
    programs: &[Vec<Instruction>],
    op_seconds: impl Fn(usize, Pass, Piece) -> f64,
    message_seconds: impl Fn(usize, usize, Piece) -> Transfer,
    record: bool,
) -> Result<SimReport, ScheduleError> {
    let mut clocks = Clocks {
        op_seconds,
        message_seconds,
        clock: vec![0.0; programs.len()],
        busy: vec![0.0; programs.len()],
        last_backward: vec![(0.0, 0.0); programs.len()],
        first_forward: vec![None; programs.len()],
        spans: record.then(|| vec![Vec::new(); programs.len()]),
    };
    interpret(programs, &mut clocks)?;
    let makespan_s = clocks.clock.iter().copied().fold(0.0, f64::max);
    Ok(SimReport {
        finish_s: clocks.clock,
        busy_s: clocks.busy,
        makespan_s,
        last_backward_s: clocks.last_backward,
        first_forward_s: (clocks.first_forward.into_iter())
            .map(Option::unwrap_or_default)
            .collect(),
        spans: clocks.spans.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use synerfuse_plan::{pipeline_schedule, ScheduleKind};

    /// Homogeneous stages without communication: 1F1B and GPipe take
    /// (m + p − 1)(t_f + t_b), the closed form the planner uses.
    #[test]
    fn homogeneous_pipelines_match_the_closed_form() {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::Gpipe] {
            for p in 1..=5 {
                for m in 1..=9 {
                    let programs = pipeline_schedule(kind, p, 1, m).unwrap();
                    let (tf, tb) = (1.0, 2.0);
                    let report = simulate(
                        &programs,
                        |_, pass, _| match pass {
                            Pass::Forward => tf,
                            Pass::Backward => tb,
                        },
                        |_, _, _| Transfer::default(),
                    )
                    .unwrap();
                    let want = (m + p - 1) as f64 * (tf + tb);
                    assert!(
                        (report.makespan_s - want).abs() < 1e-9,
                        "{kind:?} p {p} m {m}: {} vs {want}",
                        report.makespan_s
                    );
                    let bubble = (p - 1) as f64 / (m + p - 1) as f64;
                    assert!((report.bubble_fraction() - bubble).abs() < 1e-9);
                    let spans = simulate_spans(
                        &programs,
                        |_, pass, _| match pass {
                            Pass::Forward => tf,
                            Pass::Backward => tb,
                        },
                        |_, _, _| Transfer::default(),
                    )
                    .unwrap()
                    .spans;
                    // Every rank: m forwards and m backwards, the rest waiting.
                    for rank in &spans {
                        let passes = rank.iter().filter(|s| s.kind != SpanKind::Wait);
                        assert_eq!(passes.count(), 2 * m);
                        let end = rank.last().map_or(0.0, |s| s.end_s);
                        let covered: f64 = rank.iter().map(|s| s.end_s - s.start_s).sum();
                        assert!((end - covered).abs() < 1e-9, "spans tile the rank's time");
                    }
                }
            }
        }
    }

    /// A send holds its sender for `sender_s`; the message arrives `transit_s` later.
    /// Two stages, one micro-batch: F0 | send | … ; stage 1 waits for the arrival.
    #[test]
    fn sends_occupy_their_sender() {
        let programs = pipeline_schedule(ScheduleKind::OneFOneB, 2, 1, 1).unwrap();
        let transfer = Transfer {
            sender_s: 0.25,
            transit_s: 0.5,
        };
        let report = simulate_spans(&programs, |_, _, _| 1.0, |_, _, _| transfer).unwrap();
        // Stage 0: F (1) + send (0.25); arrival at 1.75; stage 1: F, B (2) and its send of
        // the gradient (0.25) end at 4.0; arrival at 4.5; stage 0's B ends at 5.5.
        assert!((report.finish_s[1] - 4.0).abs() < 1e-12, "{report:?}");
        assert!((report.finish_s[0] - 5.5).abs() < 1e-12, "{report:?}");
        let sends: f64 = report.spans[0]
            .iter()
            .filter(|s| s.kind == SpanKind::Send)
            .map(|s| s.end_s - s.start_s)
            .sum();
        assert!((sends - 0.25).abs() < 1e-12);
        assert_eq!(report.busy_s, vec![2.0, 2.0]);
    }
}
