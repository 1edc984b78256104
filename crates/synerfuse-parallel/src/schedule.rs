//! Pipeline schedules as per-rank instruction lists (GPipe, 1F1B, interleaved 1F1B), and
//! a checker that runs every rank's list against the others.
//!
//! Sends are buffered (the runtime posts non-blocking sends) and receives block until the
//! matching send has been issued, so a schedule is deadlock-free exactly when the checker
//! can run every list to its end. Pipelines of different data-parallel replicas never talk
//! to each other, so replicas with different micro-batch counts simply run schedules of
//! different lengths.

use crate::{ParallelPlan, PlanError};
use std::collections::HashMap;

/// Which pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward (Megatron's non-interleaved schedule).
    OneFOneB,
    /// 1F1B over virtual chunks (Megatron's interleaved schedule).
    Interleaved,
}

/// A schedule name that is none of `1f1b`, `gpipe`, `interleaved`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a pipeline schedule: expected 1f1b, gpipe or interleaved")]
pub struct UnknownScheduleKind(pub String);

impl std::str::FromStr for ScheduleKind {
    type Err = UnknownScheduleKind;

    /// Megatron's and the CLI's names: `1f1b`, `gpipe`, `interleaved`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "gpipe" => Ok(ScheduleKind::Gpipe),
            "interleaved" => Ok(ScheduleKind::Interleaved),
            other => Err(UnknownScheduleKind(other.to_owned())),
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::Interleaved => "interleaved",
        })
    }
}

/// One step of a rank's program. `peer` is a pipeline stage in per-pipeline schedules and
/// a global rank in per-rank schedules. A message is named by its micro-batch and the
/// chunk of the piece that *sends* it, on both ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Instruction {
    /// Receive the input activation of (micro-batch, chunk).
    RecvActivation {
        peer: usize,
        micro_batch: usize,
        chunk: usize,
    },
    /// Forward of (micro-batch, chunk).
    Forward { micro_batch: usize, chunk: usize },
    /// Send the output activation of (micro-batch, chunk).
    SendActivation {
        peer: usize,
        micro_batch: usize,
        chunk: usize,
    },
    /// Receive the gradient of the output of (micro-batch, chunk).
    RecvGradient {
        peer: usize,
        micro_batch: usize,
        chunk: usize,
    },
    /// Backward of (micro-batch, chunk).
    Backward { micro_batch: usize, chunk: usize },
    /// Send the gradient of the input of (micro-batch, chunk).
    SendGradient {
        peer: usize,
        micro_batch: usize,
        chunk: usize,
    },
}

/// A schedule that cannot be built or does not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// Sizes the schedule does not support.
    #[error("{0}")]
    Unsupported(String),
    /// Some ranks wait forever.
    #[error("deadlock: {0}")]
    Deadlock(String),
    /// A rule of pipelining is broken.
    #[error("{0}")]
    Violation(String),
}

/// Per-stage instruction lists of one pipeline of `stages` stages with `chunks` virtual
/// chunks per stage and `micro_batches` micro-batches. Peers are stage indices.
pub fn pipeline_schedule(
    kind: ScheduleKind,
    stages: usize,
    chunks: usize,
    micro_batches: usize,
) -> Result<Vec<Vec<Instruction>>, ScheduleError> {
    if stages == 0 || chunks == 0 || micro_batches == 0 {
        return Err(ScheduleError::Unsupported(format!(
            "{stages} stages, {chunks} chunks, {micro_batches} micro-batches: all must be at least 1"
        )));
    }
    match kind {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB if chunks != 1 => {
            Err(ScheduleError::Unsupported(format!(
                "{kind:?} runs one chunk per stage; {chunks} virtual chunks need the interleaved schedule"
            )))
        }
        ScheduleKind::Interleaved if micro_batches % stages != 0 => {
            Err(ScheduleError::Unsupported(format!(
                "the interleaved schedule needs the micro-batch count ({micro_batches}) to be a multiple of the pipeline size ({stages}), as in Megatron"
            )))
        }
        _ => Ok((0..stages)
            .map(|p| stage_program(kind, p, stages, chunks, micro_batches))
            .collect()),
    }
}

/// The order in which stage `p` runs forwards and backwards, as (is_forward, virtual id).
fn compute_order(
    kind: ScheduleKind,
    p: usize,
    stages: usize,
    chunks: usize,
    m: usize,
) -> Vec<(bool, usize)> {
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
    let mut order: Vec<(bool, usize)> = (0..warmup).map(|k| (true, k)).collect();
    for k in 0..total - warmup {
        order.push((true, warmup + k));
        order.push((false, k));
    }
    order.extend((total - warmup..total).map(|k| (false, k)));
    order
}

/// Virtual id k → (micro-batch, chunk): Megatron's groups of `stages` micro-batches per
/// chunk; backwards walk the chunks in reverse.
fn virtual_to_real(k: usize, forward: bool, stages: usize, chunks: usize) -> (usize, usize) {
    let in_group = k % (stages * chunks);
    let mut chunk = in_group / stages;
    if !forward {
        chunk = chunks - chunk - 1;
    }
    let micro_batch = (k / (stages * chunks)) * stages + k % stages;
    (micro_batch, chunk)
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
    for (forward, k) in compute_order(kind, p, stages, chunks, m) {
        let (micro_batch, chunk) = if chunks == 1 {
            (k, 0)
        } else {
            virtual_to_real(k, forward, stages, chunks)
        };
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
        if forward {
            if let Some((peer, c)) = before {
                program.push(Instruction::RecvActivation {
                    peer,
                    micro_batch,
                    chunk: c,
                });
            }
            program.push(Instruction::Forward { micro_batch, chunk });
            if let Some((peer, _)) = after {
                program.push(Instruction::SendActivation {
                    peer,
                    micro_batch,
                    chunk,
                });
            }
        } else {
            if let Some((peer, c)) = after {
                program.push(Instruction::RecvGradient {
                    peer,
                    micro_batch,
                    chunk: c,
                });
            }
            program.push(Instruction::Backward { micro_batch, chunk });
            if let Some((peer, _)) = before {
                program.push(Instruction::SendGradient {
                    peer,
                    micro_batch,
                    chunk,
                });
            }
        }
    }
    program
}

/// Per-rank instruction lists of a whole plan: each rank runs its pipeline's schedule for
/// its stage with its replica's micro-batch count; peers are global ranks.
pub fn plan_schedule(
    plan: &ParallelPlan,
    kind: ScheduleKind,
) -> Result<Vec<Vec<Instruction>>, PlanError> {
    let topology = plan.topology()?;
    let stages = plan.stages.num_stages();
    let chunks = plan.stages.num_chunks();
    let mut cache: HashMap<usize, Vec<Vec<Instruction>>> = HashMap::new();
    let mut out = Vec::with_capacity(topology.world_size());
    for rank in 0..topology.world_size() {
        let c = topology.coordinates(rank)?;
        let m = plan.batches.replicas()[c.dp].num_micro_batches;
        let per_stage = match cache.get(&m) {
            Some(s) => s,
            None => {
                let s = pipeline_schedule(kind, stages, chunks, m)
                    .map_err(|e| PlanError::Mismatch(e.to_string()))?;
                cache.entry(m).or_insert(s)
            }
        };
        let to_rank = |stage: usize| {
            topology
                .rank(&crate::Coordinates { pp: stage, ..c })
                .expect("stage within the pipeline")
        };
        out.push(
            per_stage[c.pp]
                .iter()
                .map(|&i| match i {
                    Instruction::RecvActivation {
                        peer,
                        micro_batch,
                        chunk,
                    } => Instruction::RecvActivation {
                        peer: to_rank(peer),
                        micro_batch,
                        chunk,
                    },
                    Instruction::SendActivation {
                        peer,
                        micro_batch,
                        chunk,
                    } => Instruction::SendActivation {
                        peer: to_rank(peer),
                        micro_batch,
                        chunk,
                    },
                    Instruction::RecvGradient {
                        peer,
                        micro_batch,
                        chunk,
                    } => Instruction::RecvGradient {
                        peer: to_rank(peer),
                        micro_batch,
                        chunk,
                    },
                    Instruction::SendGradient {
                        peer,
                        micro_batch,
                        chunk,
                    } => Instruction::SendGradient {
                        peer: to_rank(peer),
                        micro_batch,
                        chunk,
                    },
                    other => other,
                })
                .collect(),
        );
    }
    Ok(out)
}

/// What a schedule run found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleReport {
    /// Per program: the most forwards whose backward had not run yet (activations held).
    pub peak_in_flight: Vec<usize>,
    /// Rounds of the simulation until every program finished (a rough makespan in steps).
    pub rounds: usize,
    /// Global order in which computations ran: (program, micro-batch, chunk, is_forward)
    /// → sequence number.
    pub computed_at: HashMap<(usize, usize, usize, bool), usize>,
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
        for mb in 0..micro_batches {
            let pieces: Vec<(usize, usize)> = (0..chunks)
                .flat_map(|c| pipeline.iter().map(move |&program| (program, c)))
                .collect();
            for forward in [true, false] {
                let times: Vec<usize> = pieces
                    .iter()
                    .map(|&(program, c)| {
                        self.computed_at
                            .get(&(program, mb, c, forward))
                            .copied()
                            .ok_or_else(|| {
                                ScheduleError::Violation(format!(
                                "program {program} never runs the {} of micro-batch {mb} chunk {c}",
                                if forward { "forward" } else { "backward" }
                            ))
                            })
                    })
                    .collect::<Result<_, _>>()?;
                let ordered = if forward {
                    times.windows(2).all(|w| w[0] < w[1])
                } else {
                    times.windows(2).all(|w| w[0] > w[1])
                };
                if !ordered {
                    return Err(ScheduleError::Violation(format!(
                        "micro-batch {mb}: {} out of pipeline order {times:?}",
                        if forward { "forwards" } else { "backwards" }
                    )));
                }
            }
        }
        Ok(())
    }
}

/// (sends, carries a gradient, peer, micro-batch, chunk) of a transfer instruction.
fn transfer(instruction: Instruction) -> Option<(bool, bool, usize, usize, usize)> {
    use Instruction::*;
    Some(match instruction {
        SendActivation {
            peer,
            micro_batch,
            chunk,
        } => (true, false, peer, micro_batch, chunk),
        RecvActivation {
            peer,
            micro_batch,
            chunk,
        } => (false, false, peer, micro_batch, chunk),
        SendGradient {
            peer,
            micro_batch,
            chunk,
        } => (true, true, peer, micro_batch, chunk),
        RecvGradient {
            peer,
            micro_batch,
            chunk,
        } => (false, true, peer, micro_batch, chunk),
        Forward { .. } | Backward { .. } => return None,
    })
}

/// Whether the messages from rank `from` to rank `to` are received in the order they are
/// sent. Transports without tags (NCCL point-to-point) match sends to receives by order
/// alone, so they may carry the link only when this holds.
pub fn link_in_order(programs: &[Vec<Instruction>], from: usize, to: usize) -> bool {
    let messages = |rank: usize, sending: bool, peer: usize| -> Vec<(bool, usize, usize)> {
        programs
            .get(rank)
            .into_iter()
            .flatten()
            .filter_map(|&i| transfer(i))
            .filter(|&(sends, _, p, _, _)| sends == sending && p == peer)
            .map(|(_, gradient, _, micro_batch, chunk)| (gradient, micro_batch, chunk))
            .collect()
    };
    messages(from, true, to) == messages(to, false, from)
}

/// Runs every program against the others: sends are buffered, receives wait for their
/// send. Checks that all programs finish (no deadlock), that every send is received,
/// that each (micro-batch, chunk) is forwarded then backwarded exactly once per program,
/// and that a forward never runs before its input was sent. `programs[i]` names its peers
/// by index into `programs`.
pub fn check_schedule(programs: &[Vec<Instruction>]) -> Result<ScheduleReport, ScheduleError> {
    type Key = (usize, usize, bool, usize, usize); // (from, to, is_activation, mb, chunk)
    let n = programs.len();
    let mut pc = vec![0usize; n];
    let mut mailbox: HashMap<Key, usize> = HashMap::new();
    let mut forwarded: Vec<HashMap<(usize, usize), usize>> = vec![HashMap::new(); n];
    let mut backwarded: Vec<HashMap<(usize, usize), usize>> = vec![HashMap::new(); n];
    let mut in_flight = vec![0usize; n];
    let mut peak = vec![0usize; n];
    let mut rounds = 0;
    let mut computed_at = HashMap::new();
    loop {
        let mut progressed = false;
        rounds += 1;
        for r in 0..n {
            // Each round a program runs until it blocks on a receive.
            while let Some(&instruction) = programs[r].get(pc[r]) {
                let ok = match instruction {
                    Instruction::SendActivation {
                        peer,
                        micro_batch,
                        chunk,
                    }
                    | Instruction::SendGradient {
                        peer,
                        micro_batch,
                        chunk,
                    } => {
                        if peer >= n {
                            return Err(ScheduleError::Violation(format!(
                                "program {r} sends to {peer}, which does not exist"
                            )));
                        }
                        let activation = matches!(instruction, Instruction::SendActivation { .. });
                        let done = if activation {
                            &forwarded[r]
                        } else {
                            &backwarded[r]
                        };
                        if !done.contains_key(&(micro_batch, chunk)) {
                            return Err(ScheduleError::Violation(format!(
                                "program {r} sends the {} of micro-batch {micro_batch} chunk {chunk} before computing it",
                                if activation { "activation" } else { "gradient" }
                            )));
                        }
                        *mailbox
                            .entry((r, peer, activation, micro_batch, chunk))
                            .or_default() += 1;
                        true
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
                        let activation = matches!(instruction, Instruction::RecvActivation { .. });
                        match mailbox.get_mut(&(peer, r, activation, micro_batch, chunk)) {
                            Some(count) if *count > 0 => {
                                *count -= 1;
                                true
                            }
                            _ => false,
                        }
                    }
                    Instruction::Forward { micro_batch, chunk } => {
                        if forwarded[r].insert((micro_batch, chunk), rounds).is_some() {
                            return Err(ScheduleError::Violation(format!("program {r} forwards micro-batch {micro_batch} chunk {chunk} twice")));
                        }
                        in_flight[r] += 1;
                        peak[r] = peak[r].max(in_flight[r]);
                        computed_at.insert((r, micro_batch, chunk, true), computed_at.len());
                        true
                    }
                    Instruction::Backward { micro_batch, chunk } => {
                        if !forwarded[r].contains_key(&(micro_batch, chunk)) {
                            return Err(ScheduleError::Violation(format!("program {r} runs the backward of micro-batch {micro_batch} chunk {chunk} before its forward")));
                        }
                        if backwarded[r].insert((micro_batch, chunk), rounds).is_some() {
                            return Err(ScheduleError::Violation(format!("program {r} runs the backward of micro-batch {micro_batch} chunk {chunk} twice")));
                        }
                        in_flight[r] -= 1;
                        computed_at.insert((r, micro_batch, chunk, false), computed_at.len());
                        true
                    }
                };
                if !ok {
                    break;
                }
                pc[r] += 1;
                progressed = true;
            }
        }
        if pc.iter().zip(programs).all(|(&p, prog)| p == prog.len()) {
            break;
        }
        if !progressed {
            let blocked: Vec<String> = (0..n)
                .filter(|&r| pc[r] < programs[r].len())
                .take(4)
                .map(|r| {
                    format!(
                        "program {r} waits at step {} on {:?}",
                        pc[r], programs[r][pc[r]]
                    )
                })
                .collect();
            return Err(ScheduleError::Deadlock(blocked.join("; ")));
        }
    }
    if let Some((key, _)) = mailbox.iter().find(|(_, &c)| c > 0) {
        return Err(ScheduleError::Violation(format!(
            "program {} sent {} of micro-batch {} chunk {} to program {}, which never receives it",
            key.0,
            if key.2 { "an activation" } else { "a gradient" },
            key.3,
            key.4,
            key.1
        )));
    }
    for r in 0..n {
        if forwarded[r].len() != backwarded[r].len() {
            return Err(ScheduleError::Violation(format!(
                "program {r} ends with {} forwards but {} backwards",
                forwarded[r].len(),
                backwarded[r].len()
            )));
        }
    }
    Ok(ScheduleReport {
        peak_in_flight: peak,
        rounds,
        computed_at,
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
                Instruction::Forward { micro_batch, .. } => Some(format!("F{micro_batch}")),
                Instruction::Backward { micro_batch, .. } => Some(format!("B{micro_batch}")),
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
        s[1].retain(|i| !matches!(i, Instruction::RecvActivation { micro_batch: 1, .. }));
        assert!(check_schedule(&s).is_err());
        // Out-of-order receives: tags save MPI, but NCCL would mismatch them.
        let mut swapped = pipeline_schedule(ScheduleKind::Gpipe, 2, 1, 2).unwrap();
        assert!(link_in_order(&swapped, 0, 1));
        let recvs: Vec<usize> = swapped[1]
            .iter()
            .enumerate()
            .filter(|(_, i)| matches!(i, Instruction::RecvActivation { .. }))
            .map(|(n, _)| n)
            .collect();
        swapped[1].swap(recvs[0], recvs[1]);
        assert!(!link_in_order(&swapped, 0, 1));
        assert!(link_in_order(&swapped, 1, 0));
        // Two stages that both receive first: deadlock.
        let s = vec![
            vec![Instruction::RecvGradient {
                peer: 1,
                micro_batch: 0,
                chunk: 0,
            }],
            vec![Instruction::RecvActivation {
                peer: 0,
                micro_batch: 0,
                chunk: 0,
            }],
        ];
        assert!(matches!(
            check_schedule(&s),
            Err(ScheduleError::Deadlock(_))
        ));
        assert!(pipeline_schedule(ScheduleKind::Interleaved, 4, 2, 6).is_err());
        assert!(pipeline_schedule(ScheduleKind::OneFOneB, 4, 2, 8).is_err());
    }

    #[test]
    fn hetero_plan_with_different_counts_runs() {
        let plan = ParallelPlan::from_synerfuse_args(
            &[
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "3",
                "--use-tp-pp-dp-mapping",
                "--num-layers",
                "12",
                "--hetero-pipeline-stages",
                "1",
                "6",
                "2",
                "3",
                "3",
                "--global-batch-size",
                "22",
                "--micro-batch-size-per-dp",
                "1",
                "4",
                "1",
                "2",
                "1",
                "1",
                "--num-micro-batches-per-dp",
                "1",
                "3",
                "1",
                "4",
                "1",
                "2",
            ],
            18,
        )
        .unwrap();
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            let programs = plan_schedule(&plan, kind).unwrap();
            let report = check_schedule(&programs).unwrap();
            let topology = plan.topology().unwrap();
            for pipeline in topology.groups(crate::GroupKind::Pp) {
                let dp = topology.coordinates(pipeline[0]).unwrap().dp;
                let m = plan.batches.replicas()[dp].num_micro_batches;
                report.check_pipeline_order(&pipeline, 1, m).unwrap();
            }
            for (rank, peak) in report.peak_in_flight.iter().enumerate() {
                let c = topology.coordinates(rank).unwrap();
                let m = plan.batches.replicas()[c.dp].num_micro_batches;
                let expected = if kind == ScheduleKind::Gpipe {
                    m
                } else {
                    (3 - c.pp).min(m)
                };
                assert_eq!(*peak, expected, "rank {rank}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whole plans whose replicas run different micro-batch counts: every rank's
        /// program runs, pipelines stay in order.
        #[test]
        fn mixed_replica_counts(
            tp in 1usize..3,
            pp in 1usize..6,
            shapes in prop::collection::vec((1usize..4, 1usize..9), 1..4),
            gpipe in any::<bool>(),
        ) {
            let batches = crate::ReplicaBatches::new(shapes.iter().map(|&(m, n)| crate::ReplicaBatch {
                micro_batch_size: m,
                num_micro_batches: n,
            }).collect()).unwrap();
            let world = tp * pp * shapes.len();
            let plan = ParallelPlan::new(
                crate::TopologySpec { world_size: world, tp, pp, cp: 1, ep: 1, order: crate::TP_PP_DP_ORDER.into() },
                crate::StageLayout::uniform(pp * 2, pp).unwrap(),
                batches,
                Vec::new(),
            ).unwrap();
            let kind = if gpipe { ScheduleKind::Gpipe } else { ScheduleKind::OneFOneB };
            let programs = plan_schedule(&plan, kind).unwrap();
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
                let forwards = program.iter().filter(|i| matches!(i, Instruction::Forward { .. })).count();
                prop_assert_eq!(forwards, m * v);
            }
        }
    }
}
