//! Discrete-event simulation of per-rank pipeline programs: each rank runs its
//! instructions in order; computations take their time, sends are non-blocking and
//! arrive after the link's time, receives wait for arrival.

use crate::schedule::interpret::{interpret, Observer};
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

/// The simulator's view of a run: each program's clock and busy time.
struct Clocks<Op, Link> {
    op_seconds: Op,
    message_seconds: Link,
    clock: Vec<f64>,
    busy: Vec<f64>,
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
        self.clock[rank] += t;
        self.busy[rank] += t;
        Ok(())
    }

    fn send(&mut self, rank: usize, message: Message) -> Result<f64, ScheduleError> {
        Ok(self.clock[rank] + (self.message_seconds)(rank, message.peer))
    }

    fn receive(&mut self, rank: usize, arrival: f64) {
        self.clock[rank] = self.clock[rank].max(arrival);
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
    let mut clocks = Clocks {
        op_seconds,
        message_seconds,
        clock: vec![0.0; programs.len()],
        busy: vec![0.0; programs.len()],
    };
    interpret(programs, &mut clocks)?;
    let makespan_s = clocks.clock.iter().copied().fold(0.0, f64::max);
    Ok(SimReport {
        finish_s: clocks.clock,
        busy_s: clocks.busy,
        makespan_s,
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
                }
            }
        }
    }
}
