//! Discrete-event simulation of per-rank pipeline programs: each rank runs its
//! instructions in order; computations take their time, sends are non-blocking and
//! arrive after the link's time, receives wait for arrival.

use crate::schedule::interpret::{interpret, Observer};
use crate::timeline::{Span, SpanKind};
use crate::{Instruction, Message, Pass, Piece, ScheduleError};

/// What a simulated step looks like.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// When each rank finishes its program, s.
    pub finish_s: Vec<f64>,
    /// Time each rank computes, s.
    pub busy_s: Vec<f64>,
    /// The last finish.
    pub makespan_s: f64,
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
    Link: Fn(usize, usize) -> f64,
{
    /// Arrival time.
    type Stamp = f64;

    fn compute(&mut self, rank: usize, pass: Pass, piece: Piece) -> Result<(), ScheduleError> {
        let t = (self.op_seconds)(rank, pass, piece);
        let start = self.clock[rank];
        self.clock[rank] += t;
        self.busy[rank] += t;
        let kind = match pass {
            Pass::Forward => SpanKind::Forward,
            Pass::Backward => SpanKind::Backward,
        };
        self.record(rank, kind, start, Some(piece.micro_batch));
        Ok(())
    }

    fn send(&mut self, rank: usize, message: Message) -> Result<f64, ScheduleError> {
        Ok(self.clock[rank] + (self.message_seconds)(rank, message.peer))
    }

    fn receive(&mut self, rank: usize, arrival: f64) {
        let start = self.clock[rank];
        self.clock[rank] = start.max(arrival);
        self.record(rank, SpanKind::Wait, start, None);
    }
}

/// Runs `programs` (peers are program indices, as `plan_schedule` makes them) with
/// `op_seconds(rank, pass, piece)` for each computation and `message_seconds(from, to)`
/// for each transfer.
pub fn simulate(
    programs: &[Vec<Instruction>],
    op_seconds: impl Fn(usize, Pass, Piece) -> f64,
    message_seconds: impl Fn(usize, usize) -> f64,
) -> Result<SimReport, ScheduleError> {
    run(programs, op_seconds, message_seconds, false)
}

/// [`simulate`], recording each rank's passes and waits as [`Span`]s (for a timeline).
pub fn simulate_spans(
    programs: &[Vec<Instruction>],
    op_seconds: impl Fn(usize, Pass, Piece) -> f64,
    message_seconds: impl Fn(usize, usize) -> f64,
) -> Result<SimReport, ScheduleError> {
    run(programs, op_seconds, message_seconds, true)
}

fn run(
    programs: &[Vec<Instruction>],
    op_seconds: impl Fn(usize, Pass, Piece) -> f64,
    message_seconds: impl Fn(usize, usize) -> f64,
    record: bool,
) -> Result<SimReport, ScheduleError> {
    let mut clocks = Clocks {
        op_seconds,
        message_seconds,
        clock: vec![0.0; programs.len()],
        busy: vec![0.0; programs.len()],
        spans: record.then(|| vec![Vec::new(); programs.len()]),
    };
    interpret(programs, &mut clocks)?;
    let makespan_s = clocks.clock.iter().copied().fold(0.0, f64::max);
    Ok(SimReport {
        finish_s: clocks.clock,
        busy_s: clocks.busy,
        makespan_s,
        spans: clocks.spans.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{pipeline_schedule, ScheduleKind};

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
                        |_, _| 0.0,
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
                        |_, _| 0.0,
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
}
