//! What the planner returns: candidates, their predictions, and how they compare.

use super::{request::TrainOptions, tensor::TpGroup};

/// How devices are arranged into stages and replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arrangement {
    /// Each replica a block of similar devices (hetero DP; rank order tp-pp-dp).
    ByReplica,
    /// Each stage a block of similar devices, slow ones late (hetero PP; default order).
    ByStage,
}

/// A plan with its predicted costs.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// How devices were arranged.
    pub arrangement: Arrangement,
    /// Unit of (stage, replica): a device index, or an index into `groups`.
    pub devices: Vec<Vec<usize>>,
    /// Layers per stage.
    pub layers: Vec<usize>,
    /// Micro-batch size per replica.
    pub micro_batch_sizes: Vec<usize>,
    /// Micro-batches per replica.
    pub micro_batches: Vec<usize>,
    /// Predicted costs.
    pub prediction: Prediction,
    /// How the layout was found.
    pub origin: CandidateOrigin,
    /// What it trains with beside its layout.
    pub options: TrainOptions,
    /// Per stage, its own expert-parallel size where stages differ (each stage's
    /// experts divided over groups of that many consecutive replicas, 1: each holds
    /// every expert); empty: `options.expert_parallel` for every stage.
    pub stage_expert_parallel: Vec<usize>,
    /// Whether (stage, replica) recomputes its activations.
    pub recompute: Grid<bool>,
    /// What each unit of `devices` is, a tensor-parallel group of one node (even shares,
    /// as Megatron splits); empty: each unit is the device of that index. Shared by the
    /// candidates of one search.
    pub groups: std::sync::Arc<Vec<TpGroup>>,
}

impl Candidate {
    /// Stage `i`'s expert-parallel size.
    pub fn expert_parallel_of(&self, i: usize) -> usize {
        (self.stage_expert_parallel.get(i))
            .copied()
            .unwrap_or(self.options.expert_parallel)
    }

    /// Each stage's expert-parallel size.
    pub fn expert_parallel_sizes(&self) -> Vec<usize> {
        (0..self.layers.len())
            .map(|i| self.expert_parallel_of(i))
            .collect()
    }

    /// Devices per stage of each replica's tensor-parallel groups (Megatron's
    /// `--tensor-model-parallel-size`).
    pub fn tensor_parallel_size(&self) -> usize {
        self.groups.first().map_or(1, TpGroup::tp_size)
    }

    /// Context-parallel members per stage of each replica (Megatron's
    /// `--context-parallel-size`).
    pub fn context_parallel_size(&self) -> usize {
        self.groups.first().map_or(1, |g| g.cp)
    }

    /// The devices of `unit` (one of `devices`' entries), in tensor-parallel rank order.
    pub fn unit_devices(&self, unit: usize) -> Vec<usize> {
        self.groups
            .get(unit)
            .map_or(vec![unit], |g| g.members.clone())
    }

    /// "micro-batch size 2" when every replica has the same, else "micro-batch sizes
    /// [4, 1]" (per replica).
    pub fn micro_batch_size_text(&self) -> String {
        match self.micro_batch_sizes.split_first() {
            Some((b, rest)) if rest.iter().all(|x| x == b) => format!("micro-batch size {b}"),
            _ => format!("micro-batch sizes {:?}", self.micro_batch_sizes),
        }
    }
}

/// Where a candidate's layout comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CandidateOrigin {
    /// Megatron's even split (the baseline every plan is compared with).
    Uniform,
    /// Layers and batches sized to the devices by the planner.
    Planned,
}

impl std::fmt::Display for CandidateOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CandidateOrigin::Uniform => "uniform",
            CandidateOrigin::Planned => "planned",
        })
    }
}

/// Predicted costs of a candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// One training step, s (pipeline + DP all-reduce).
    pub step_time_s: f64,
    /// Slowest replica's pipeline, s.
    pub pipeline_s: f64,
    /// Slowest stage's gradient all-reduce, s: all of it, of which buckets overlapping
    /// the last backward hide part.
    pub allreduce_s: f64,
    /// Slowest rank's optimizer step, s (0 where not priced: see
    /// [`PlanOutcome::unpriced_optimizer`]).
    pub optimizer_s: f64,
    /// What the step waits for the distributed optimizer's gather of the updated
    /// parameters, s: all of it after the optimizer, or with `--overlap-param-gather`
    /// what the next forward does not hide (0 without the distributed optimizer).
    pub param_gather_s: f64,
    /// Idle fraction of rank-time.
    pub bubble_fraction: f64,
    /// Per stage, the largest per-micro-batch time over replicas, s.
    pub stage_time_s: Vec<f64>,
    /// Per stage, the largest memory need over its ranks, bytes.
    pub stage_memory_bytes: Vec<f64>,
    /// Per (stage, replica) compute time in the step, s.
    pub busy_s: Vec<Vec<f64>>,
    /// Whether the times come from the discrete-event simulation.
    pub simulated: bool,
}

/// The planner's answer.
#[derive(Debug, Clone)]
pub struct PlanOutcome {
    /// The best grid plans, best first (none when only per-replica pipelines fit).
    pub plans: Vec<Candidate>,
    /// The best even layout (uniform layers and batches) over every factorization,
    /// when one is feasible: the baseline the plans are compared with.
    pub uniform: Option<Candidate>,
    /// Every feasible even layout considered (each factorization, arrangement and
    /// micro-batch size once), predicted fastest first: the baselines a benchmark runs
    /// to measure the best one rather than trust the prediction (simulated, past the
    /// best few, while their ranks add up to 16,384; the others in closed form; on a
    /// folded cluster, those of the grids chosen on its copy).
    pub uniform_layouts: Vec<Candidate>,
    /// The best plan whose replicas are pipelines of their own shape (devices, or
    /// tensor-parallel groups of a node, pooled by class), when one fits: `synerfuse
    /// plan` writes it when it beats the best grid plan or no grid plan fits.
    pub pooled: Option<PooledCandidate>,
    /// The best layout an expert would write by hand (one tensor-parallel size in
    /// every node, as few stages as memory allows, even layers), priced alike: when it
    /// beats the plans found, it is `pooled`, the plan written.
    pub expert: Option<ExpertLayout>,
    /// Candidates considered.
    pub considered: usize,
    /// What a perfect heterogeneous job would reach on this cluster.
    pub bound: ThroughputBound,
    /// Device kinds whose optimizer step has no price (a CPU kind without a profiled
    /// optimizer): the step times leave it out for them.
    pub unpriced_optimizer: Vec<String>,
    /// Copies of one smaller cluster the search ran on (1: the whole cluster); the
    /// layouts it chose are laid out and priced on the whole (see [`crate::planner::FOLD_ABOVE`]).
    pub folded: usize,
}

/// The best layout an expert would try, as priced by the planner's model.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertLayout {
    /// Tensor-parallel size, the same in every node.
    pub tensor_parallel_size: usize,
    /// Whether each pool of alike devices has its own depth and batch (else every
    /// replica has the same).
    pub per_pool: bool,
    /// The layout, simulated.
    pub candidate: PooledCandidate,
}

/// The throughput a perfect heterogeneous job would reach: every device training the
/// whole model alone (memory aside) at its fastest micro-batch size per sample, their
/// throughputs added, with no communication and no bubble.
#[derive(Debug, Clone, PartialEq)]
pub struct ThroughputBound {
    /// Tokens per second of each device alone, in cluster order.
    pub device_tokens_per_s: Vec<f64>,
    /// Their sum.
    pub tokens_per_s: f64,
    /// The most the devices reach together when each takes a whole number of the global
    /// batch's samples at its own pace alone (the slowest to finish sets the step): the
    /// sum less the integer rounding of samples, what no split of whole samples over
    /// single devices recovers (pipelines and tensor parallelism share a sample's work
    /// among devices, and can pass it where samples are few).
    pub integer_split_tokens_per_s: f64,
}

impl ThroughputBound {
    /// Each device alone (tokens/s), and the integer-split ceiling of a global batch of
    /// `samples` (see [`ThroughputBound::integer_split_tokens_per_s`]).
    pub fn new(device_tokens_per_s: Vec<f64>, samples: usize) -> Self {
        let tokens_per_s = device_tokens_per_s.iter().sum();
        // Samples one at a time to the device that finishes it first: optimal for equal
        // jobs on devices of fixed speeds. Time in units of "one sample's tokens"; a
        // max-heap on reversed bit patterns (non-negative doubles order as their bits).
        use std::cmp::Reverse;
        let finish =
            |d: usize, taken: usize| (taken + 1) as f64 / device_tokens_per_s[d].max(1e-300);
        let mut next: std::collections::BinaryHeap<(Reverse<u64>, usize, usize)> = (0
            ..device_tokens_per_s.len())
            .map(|d| (Reverse(finish(d, 0).to_bits()), d, 0))
            .collect();
        let mut step = 0.0f64;
        for _ in 0..samples {
            let Some((Reverse(bits), d, taken)) = next.pop() else {
                break;
            };
            step = step.max(f64::from_bits(bits));
            next.push((Reverse(finish(d, taken + 1).to_bits()), d, taken + 1));
        }
        let integer_split_tokens_per_s = match step > 0.0 {
            true => samples as f64 / step,
            false => tokens_per_s,
        };
        ThroughputBound {
            device_tokens_per_s,
            tokens_per_s,
            integer_split_tokens_per_s,
        }
    }

    /// The share of the bound a step of `step_time_s` over `tokens` reaches.
    pub fn fraction(&self, tokens: f64, step_time_s: f64) -> f64 {
        tokens / step_time_s / self.tokens_per_s.max(1e-30)
    }

    /// The share of the integer-split ceiling a step of `step_time_s` over `tokens`
    /// reaches.
    pub fn fraction_of_integer_split(&self, tokens: f64, step_time_s: f64) -> f64 {
        tokens / step_time_s / self.integer_split_tokens_per_s.max(1e-30)
    }

    /// The integer-split ceiling as a share of the summed devices.
    pub fn integer_split_fraction(&self) -> f64 {
        self.integer_split_tokens_per_s / self.tokens_per_s.max(1e-30)
    }
}

/// Where a step's time goes, rank by rank added up into three parts: the busiest
/// rank's compute, the rest of the pipeline (waiting: bubble and transfers), and what
/// follows it (the data-parallel reduction beyond its overlap, the optimizer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepBreakdown {
    /// The busiest rank's forward and backward time, s.
    pub compute_s: f64,
    /// The pipeline's time beyond that, s.
    pub waiting_s: f64,
    /// The step's time beyond the pipeline, s.
    pub after_pipeline_s: f64,
}

impl Prediction {
    /// The step split into [`StepBreakdown`]'s parts (they add up to the step).
    pub fn breakdown(&self) -> StepBreakdown {
        let compute_s = self.busy_s.iter().flatten().copied().fold(0.0, f64::max);
        StepBreakdown {
            compute_s,
            waiting_s: (self.pipeline_s - compute_s).max(0.0),
            after_pipeline_s: self.step_time_s - self.pipeline_s.max(compute_s),
        }
    }
}

/// Why a plan is slower than the best: the part of the step that grew most.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BehindBy {
    /// Its busiest rank computes longer (a less even split of the work).
    Compute {
        /// Seconds more than the best plan's.
        extra_s: f64,
    },
    /// Its pipeline waits longer (bubble, transfers).
    Waiting {
        /// Seconds more than the best plan's.
        extra_s: f64,
    },
    /// Its data-parallel reduction or optimizer step takes longer past the pipeline.
    AfterPipeline {
        /// Seconds more than the best plan's.
        extra_s: f64,
    },
}

impl BehindBy {
    /// Why `plan` is behind `best` (the part with the largest increase).
    pub fn of(plan: &Prediction, best: &Prediction) -> Self {
        let (a, b) = (plan.breakdown(), best.breakdown());
        let parts = [
            BehindBy::Compute {
                extra_s: a.compute_s - b.compute_s,
            },
            BehindBy::Waiting {
                extra_s: a.waiting_s - b.waiting_s,
            },
            BehindBy::AfterPipeline {
                extra_s: a.after_pipeline_s - b.after_pipeline_s,
            },
        ];
        parts
            .into_iter()
            .max_by(|x, y| x.extra_s().total_cmp(&y.extra_s()))
            .expect("three parts")
    }

    /// The seconds it adds.
    pub fn extra_s(&self) -> f64 {
        match *self {
            BehindBy::Compute { extra_s }
            | BehindBy::Waiting { extra_s }
            | BehindBy::AfterPipeline { extra_s } => extra_s,
        }
    }
}

impl std::fmt::Display for BehindBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.extra_s() * 1e3;
        match self {
            BehindBy::Compute { .. } => write!(f, "its busiest rank computes {ms:.1} ms longer"),
            BehindBy::Waiting { .. } => write!(
                f,
                "its pipeline waits {ms:.1} ms longer (bubble, transfers)"
            ),
            BehindBy::AfterPipeline { .. } => {
                write!(
                    f,
                    "its gradient reduction and optimizer step end {ms:.1} ms later"
                )
            }
        }
    }
}

impl PlanOutcome {
    /// The per-replica-pipeline plan, when no grid plan fits or it beats the best by
    /// more than 1 % (the grid plan, which SynerFuse's flags also express, wins ties and
    /// noise), or the grid plan is slower than the expert layout at all.
    pub fn pooled_wins(&self) -> Option<&PooledCandidate> {
        let grid = self.plans.first().map(|c| c.prediction.step_time_s);
        // The expert's layout is a floor (`pooled` is never slower than it): the grid
        // plan is not written where the expert's is faster at all.
        let expert = (self.expert.as_ref()).map(|e| e.candidate.step_time_s);
        (self.pooled.as_ref()).filter(|p| {
            grid.is_none_or(|g| p.step_time_s < g * 0.99 || expert.is_some_and(|e| e < g))
        })
    }
}

/// One pool's part of a plan: its replicas, each `layers.len()` stages deep.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolLayout {
    /// Unit of (stage, replica): an index into the candidate's `groups`.
    pub devices: Grid<usize>,
    /// Layers per stage, the same for each of its replicas.
    pub layers: Vec<usize>,
    /// Micro-batch size of its replicas.
    pub micro_batch_size: usize,
    /// Micro-batches of each of its replicas.
    pub micro_batches: Vec<usize>,
    /// Samples the last micro-batch of each of its replicas lacks (less than the size;
    /// empty: none), so that a replica takes any count of samples.
    pub short: Vec<usize>,
}

impl PoolLayout {
    /// Samples replica `r` lacks in its last micro-batch.
    pub fn short_of(&self, r: usize) -> usize {
        let short = self.short.get(r).copied().unwrap_or(0);
        debug_assert!(
            short < self.micro_batch_size,
            "{short} short of {}",
            self.micro_batch_size
        );
        short
    }

    /// Samples replica `r` takes per step.
    pub fn samples(&self, r: usize) -> usize {
        self.micro_batches[r] * self.micro_batch_size - self.short_of(r)
    }

    /// Replica `r`'s micro-batches: full ones, the last one short by [`Self::short_of`].
    pub fn batch(&self, r: usize) -> synerfuse_plan::ReplicaBatch {
        synerfuse_plan::ReplicaBatch::from_samples(self.samples(r), self.micro_batch_size)
    }
}

/// A plan of pools with its predicted step.
#[derive(Debug, Clone, PartialEq)]
pub struct PooledCandidate {
    /// The pools, fastest first; their replicas in this order are the plan's.
    pub pools: Vec<PoolLayout>,
    /// What each unit of the pools is: one device, or a tensor-parallel group.
    pub groups: Vec<TpGroup>,
    /// What it trains with beside its layout.
    pub options: TrainOptions,
    /// Per pool, its own expert-parallel size where pools differ (groups of that many
    /// consecutive replicas of the pool dividing each stage's experts; 1: each replica
    /// holds every expert); empty: `options.expert_parallel` for every pool.
    pub pool_expert_parallel: Vec<usize>,
    /// Whether each stage of each replica (in the plan's order) recomputes its
    /// activations.
    pub recompute: Vec<Vec<bool>>,
    /// One training step, s (simulated schedule, the reduction, the optimizer).
    pub step_time_s: f64,
    /// The slowest replica's pipeline, s.
    pub pipeline_s: f64,
    /// The gradient reduction of the busiest rank, s: all of it, of which buckets
    /// overlapping the last backward hide part.
    pub reduce_s: f64,
    /// The slowest rank's optimizer step, s.
    pub optimizer_s: f64,
    /// What the step waits for the distributed optimizer's parameter gathers, s
    /// ([`Prediction::param_gather_s`]).
    pub param_gather_s: f64,
    /// When each replica's pipeline finishes (its last rank), s, in the plan's order.
    pub replica_finish_s: Vec<f64>,
}

impl PooledCandidate {
    /// Pool `k`'s expert-parallel size.
    pub fn expert_parallel_of(&self, k: usize) -> usize {
        (self.pool_expert_parallel.get(k))
            .copied()
            .unwrap_or(self.options.expert_parallel)
    }

    /// Every replica: (pool, index in the pool).
    pub(super) fn replicas(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        replicas(&self.pools)
    }

    /// The device index of each rank of [`PooledCandidate::to_plan`]'s plan, in rank order.
    pub fn rank_devices(&self) -> Vec<usize> {
        (self.replicas())
            .flat_map(|(k, r)| {
                let pool = &self.pools[k];
                (pool.devices.iter())
                    .flat_map(move |row| self.groups[row[r]].members.iter().copied())
            })
            .collect()
    }
}

/// Every replica of `pools`: (pool, index in the pool).
pub(super) fn replicas(pools: &[PoolLayout]) -> impl Iterator<Item = (usize, usize)> + '_ {
    (pools.iter().enumerate())
        .flat_map(|(k, pool)| (0..pool.micro_batches.len()).map(move |r| (k, r)))
}

/// Values by (stage, replica).
pub(super) type Grid<T> = Vec<Vec<T>>;
