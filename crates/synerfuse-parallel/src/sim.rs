//! Discrete-event simulation of per-rank pipeline programs: each rank runs its
//! instructions in order; computations take their time, sends are non-blocking and
//! arrive after the link's time, receives wait for arrival.

use crate::{Instruction, ScheduleError};
use std::collections::HashMap;

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

/// Runs `programs` (peers are program indices, as `plan_schedule` makes them) with
/// `op_seconds(rank, instruction)` for forwards and backwards and
/// `message_seconds(from, to)` for each transfer.
pub fn simulate(
    programs: &[Vec<Instruction>],
    op_seconds: impl Fn(usize, &Instruction) -> f64,
    message_seconds: impl Fn(usize, usize) -> f64,
) -> Result<SimReport, ScheduleError> {
    let n = programs.len();
    let mut clock = vec![0.0f64; n];
    let mut busy = vec![0.0f64; n];
    let mut next = vec![0usize; n];
    // (from, to, gradient?, micro_batch, chunk) → arrival time.
    let mut inbox: HashMap<(usize, usize, bool, usize, usize), f64> = HashMap::new();
    loop {
        let mut progressed = false;
        for rank in 0..n {
            while let Some(instruction) = programs[rank].get(next[rank]) {
                match *instruction {
                    Instruction::Forward { .. } | Instruction::Backward { .. } => {
                        let t = op_seconds(rank, instruction);
                        clock[rank] += t;
                        busy[rank] += t;
                    }
                    Instruction::SendActivation {
                        peer,
                        micro_batch,
                        chunk,
                    } => {
                        inbox.insert(
                            (rank, peer, false, micro_batch, chunk),
                            clock[rank] + message_seconds(rank, peer),
                        );
                    }
                    Instruction::SendGradient {
                        peer,
                        micro_batch,
                        chunk,
                    } => {
                        inbox.insert(
                            (rank, peer, true, micro_batch, chunk),
                            clock[rank] + message_seconds(rank, peer),
                        );
                    }
                    Instruction::RecvActivation {
                        peer,
                        micro_batch,
                        chunk,
                    }
                    | Instruction::RecvGradient {
                        peer,
                        micro_batch,
                        chunk,
                    } => {
                        let gradient = matches!(instruction, Instruction::RecvGradient { .. });
                        match inbox.remove(&(peer, rank, gradient, micro_batch, chunk)) {
                            Some(arrival) => clock[rank] = clock[rank].max(arrival),
                            None => break,
                        }
                    }
                }
                next[rank] += 1;
                progressed = true;
            }
        }
        if (0..n).all(|r| next[r] == programs[r].len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..n)
                .filter(|&r| next[r] < programs[r].len())
                .map(|r| format!("rank {r} at {:?}", programs[r][next[r]]))
                .collect();
            return Err(ScheduleError::Deadlock(stuck.join("; ")));
        }
    }
    let makespan_s = clock.iter().copied().fold(0.0, f64::max);
    Ok(SimReport {
        finish_s: clock,
        busy_s: busy,
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
                        |_, i| match i {
                            Instruction::Forward { .. } => tf,
                            _ => tb,
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
