//! The planner: for every (pp, dp) factorization, device arrangement and micro-batch
//! size (one for every replica, or one per replica), an exact layer split (dynamic
//! programme on the slowest stage, subject to memory) alternated with an exact split of
//! the batch over the replicas (greedy on monotone pipeline times; with sizes that
//! differ, a bisection over reachable sample totals), scored by the 1F1B formula, the
//! best re-timed by simulating the real schedule.

mod pooled;
mod running;
mod samples;
mod tensor;

use crate::cluster::Device;
use crate::cost::{CostModel, Recompute, StageCosts, StageHolding};
use crate::timeline::{RankTimeline, Span, SpanKind, Timeline};
use crate::{
    plan_schedule, sim, DeviceRequest, ParallelPlan, Pass, RankPlacement, ReplicaBatch,
    ReplicaBatches, ScheduleKind, StageLayout, TopologySpec, DEFAULT_ORDER, TP_PP_DP_ORDER,
};
use std::cell::Cell;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use pooled::plan_pooled_noting_memory;
pub use pooled::{plan_pooled, pooled_timeline, to_general_plan, PoolLayout, PooledCandidate};
pub use running::{
    best_plan_for, fitted_cost, fitted_cost_of, predict_step_s, running_job_request, ReplanError,
    RunningJob,
};
pub use samples::{min_max_samples, ReplicaPace};
pub use tensor::{best_group, TpGroup, MOST_SHARE};

/// Most assignments of micro-batch sizes to replicas tried one by one per grid; past
/// it, replicas of the same devices share a size, and past that each replica takes the
/// size at which it computes a sample fastest.
const SIZE_ASSIGNMENTS: usize = 32;

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// `--global-batch-size`.
    pub global_batch_size: usize,
    /// Micro-batch sizes to try.
    pub micro_batch_sizes: Vec<usize>,
    /// Plans to keep.
    pub top_k: usize,
    /// Tensor-parallel sizes to try for per-replica pipelines (within a node; empty: 1).
    pub tensor_parallel_sizes: Vec<usize>,
    /// Whether plans recompute activations (auto: the stages that need it).
    pub recompute: Choice,
    /// Whether plans shard the optimizer over each stage's replicas (priced for grid
    /// plans; per-replica pipelines carry the flag when it is on, priced without it).
    pub distributed_optimizer: Choice,
}

/// Whether a plan uses an option: never, always, or where it makes the plan fit or
/// faster (ties go to off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Choice {
    /// Never.
    Off,
    /// Always.
    On,
    /// Both tried.
    #[default]
    Auto,
}

/// A choice other than `auto`, `on` or `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected auto, on or off")]
pub struct ChoiceError(pub String);

impl std::str::FromStr for Choice {
    type Err = ChoiceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(Choice::Auto),
            "on" => Ok(Choice::On),
            "off" => Ok(Choice::Off),
            _ => Err(ChoiceError(text.to_owned())),
        }
    }
}

impl Choice {
    fn values(self) -> &'static [bool] {
        match self {
            Choice::Off => &[false],
            Choice::On => &[true],
            Choice::Auto => &[false, true],
        }
    }

    /// As a choice of which stages recompute: off none, on all, auto none and then
    /// those that need it.
    fn recompute(self) -> &'static [Recompute] {
        match self {
            Choice::Off => &[Recompute::Never],
            Choice::On => &[Recompute::Always],
            Choice::Auto => &[Recompute::Never, Recompute::WhereNeeded],
        }
    }
}

/// How a plan trains beside its layout: what its memory and time were priced with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TrainOptions {
    /// Which stages may recompute their activations (the plan file says which do).
    pub recompute: Recompute,
    /// `--use-distributed-optimizer`.
    pub distributed_optimizer: bool,
}

impl TrainOptions {
    /// `cost` priced with these options.
    pub fn cost(&self, cost: &CostModel) -> CostModel {
        CostModel {
            recompute: self.recompute,
            distributed_optimizer: self.distributed_optimizer,
            ..cost.clone()
        }
    }

    /// The `synerfuse train` flags that ask for them beside `--plan` (which stages
    /// recompute is in the plan file).
    pub fn train_flags(&self) -> Vec<&'static str> {
        match self.distributed_optimizer {
            true => vec!["--use-distributed-optimizer"],
            false => Vec::new(),
        }
    }
}

impl PlanRequest {
    /// The options grid plans are searched with, off before on.
    fn grid_options(&self) -> Vec<TrainOptions> {
        let mut options = Vec::new();
        for &distributed_optimizer in self.distributed_optimizer.values() {
            for &recompute in self.recompute.recompute() {
                options.push(TrainOptions {
                    recompute,
                    distributed_optimizer,
                });
            }
        }
        options
    }

    /// The distinct positive tensor-parallel sizes, ascending (1 when none).
    fn tp_sizes(&self) -> Vec<usize> {
        let sizes: BTreeSet<usize> = (self.tensor_parallel_sizes.iter())
            .copied()
            .filter(|&t| t > 0)
            .collect();
        match sizes.is_empty() {
            true => vec![1],
            false => sizes.into_iter().collect(),
        }
    }
}

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
    /// Device index of (stage, replica).
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
    /// Whether (stage, replica) recomputes its activations.
    pub recompute: Grid<bool>,
}

impl Candidate {
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
    /// Slowest stage's gradient all-reduce, s.
    pub allreduce_s: f64,
    /// Slowest rank's optimizer step, s (0 where not priced: see
    /// [`PlanOutcome::unpriced_optimizer`]).
    pub optimizer_s: f64,
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

/// Why planning found nothing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanningError {
    /// A model without layers or a batch without samples.
    #[error("the model needs layers and the global batch samples (got {layers} layers, global batch {global_batch_size})")]
    EmptyRequest {
        /// Decoder layers.
        layers: usize,
        /// Samples per step.
        global_batch_size: usize,
    },
    /// A device the cost model cannot price.
    #[error(transparent)]
    Cost(#[from] crate::cost::CostError),
    /// A candidate that does not form a plan (a planner bug, reported).
    #[error(transparent)]
    Plan(#[from] crate::PlanError),
    /// A per-replica-pipeline candidate that does not form a plan (a planner bug,
    /// reported).
    #[error(transparent)]
    General(#[from] crate::GeneralPlanError),
    /// Every candidate breaks a constraint; the closest one's binding constraint.
    #[error("no feasible plan: {0}")]
    Infeasible(Infeasibility),
}

/// The constraint that rules out the candidate closest to feasible.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Infeasibility {
    /// The global batch is smaller than the replica count of every factorization.
    #[error("global batch {global_batch_size} cannot give each of the replicas of any factorization of {devices} devices a micro-batch")]
    BatchTooSmall {
        /// Samples per step.
        global_batch_size: usize,
        /// Devices in the cluster.
        devices: usize,
    },
    /// A stage needs more memory than its device has.
    #[error("out of memory: {0}")]
    OutOfMemory(MemoryShortfall),
    /// No split of the layers fits a factorization in memory.
    #[error("no layer split of {layers} layers over {stages} stages fits in memory")]
    NoLayerSplit {
        /// Decoder layers.
        layers: usize,
        /// Pipeline stages.
        stages: usize,
    },
}

/// A stage whose device lacks the memory it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryShortfall {
    /// Pipeline stage.
    pub stage: usize,
    /// Its decoder layers.
    pub layers: usize,
    /// Pipeline stages and replicas of the candidate.
    pub pp: usize,
    /// Replicas of the candidate.
    pub dp: usize,
    /// The device's kind.
    pub kind: String,
    /// The device's index in the cluster.
    pub device: usize,
    /// Bytes needed.
    pub need_bytes: f64,
    /// Bytes usable.
    pub usable_bytes: f64,
    /// Micro-batch size.
    pub micro_batch_size: usize,
    /// Micro-batches whose activations are held at once.
    pub in_flight: usize,
}

impl std::fmt::Display for MemoryShortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let extra = match (self.stage == 0, self.stage + 1 == self.pp) {
            (true, true) => ", embedding and head",
            (true, false) => " and the embedding",
            (false, true) => " and the head",
            _ => "",
        };
        write!(
            f,
            "pipeline stage {} ({} layers{extra}) on {} (device {}) needs {:.2} GB at micro-batch size {} with {} micro-batches in flight, {:.2} GB usable (pp {}, dp {})",
            self.stage,
            self.layers,
            self.kind,
            self.device,
            self.need_bytes / 1e9,
            self.micro_batch_size,
            self.in_flight,
            self.usable_bytes / 1e9,
            self.pp,
            self.dp
        )
    }
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
    /// to measure the best one rather than trust the prediction.
    pub uniform_layouts: Vec<Candidate>,
    /// The best plan whose replicas are pipelines of their own shape (devices, or
    /// tensor-parallel groups of a node, pooled by class), when one fits: `synerfuse
    /// plan` writes it when it beats the best grid plan or no grid plan fits.
    pub pooled: Option<PooledCandidate>,
    /// Candidates considered.
    pub considered: usize,
    /// What a perfect heterogeneous job would reach on this cluster.
    pub bound: ThroughputBound,
    /// Device kinds whose optimizer step has no price (a CPU kind without a profiled
    /// optimizer): the step times leave it out for them.
    pub unpriced_optimizer: Vec<String>,
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
}

impl ThroughputBound {
    /// The share of the bound a step of `step_time_s` over `tokens` reaches.
    pub fn fraction(&self, tokens: f64, step_time_s: f64) -> f64 {
        tokens / step_time_s / self.tokens_per_s.max(1e-30)
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

struct Ctx<'a> {
    cost: &'a CostModel,
    /// Per unit (a device, or a tensor-parallel group), the device that stands for it in
    /// sends and reports: its first member.
    devices: Vec<Device>,
    /// Per unit, its devices and shares.
    groups: Vec<TpGroup>,
    /// Per unit, an id shared by the units of the same member classes and shares.
    classes: Vec<usize>,
    /// The cluster's devices.
    all: Vec<Device>,
    /// (unit class, b) → costs.
    costs: HashMap<(usize, usize), StageCosts>,
    /// Per unit, the usable bytes of a whole stage's state (a group's: as its most
    /// loaded member holds its share).
    memory: Vec<Option<f64>>,
    /// Whether memory has ruled anything out: options that only save memory are
    /// searched only where it has.
    memory_bound: Cell<bool>,
}

impl<'a> Ctx<'a> {
    /// Every device a unit of its own, in the cluster's order.
    fn new(cost: &'a CostModel) -> Self {
        let devices = cost.cluster.devices();
        let groups = (0..devices.len()).map(TpGroup::single).collect();
        Self::with_groups(cost, devices, groups)
    }

    /// Units of `size` devices of one node (fastest first within the node), each a
    /// tensor-parallel group with its best shares; `None` when the cluster does not cut
    /// into such groups.
    fn tensor_parallel(cost: &'a CostModel, size: usize) -> Result<Option<Self>, PlanningError> {
        if size <= 1 {
            return Ok(Some(Self::new(cost)));
        }
        let mut single = Self::new(cost);
        let order = fastest_first(&mut single)?;
        let layer_s: Vec<f64> = (0..single.devices.len())
            .map(|i| single.costs(i, 1).map(|c| c.layer_s))
            .collect::<Result<_, _>>()?;
        let devices = single.all;
        Ok(
            tensor::tp_groups(&cost.model, &devices, &order, &layer_s, size)
                .map(|groups| Self::with_groups(cost, devices, groups)),
        )
    }

    fn with_groups(cost: &'a CostModel, all: Vec<Device>, groups: Vec<TpGroup>) -> Self {
        // A unit's class: its members' classes and its shares.
        type UnitClass = (Vec<(usize, u64)>, Vec<u32>);
        let mut ids: HashMap<UnitClass, usize> = HashMap::new();
        let classes = (groups.iter())
            .map(|g| {
                let key = (
                    g.members.iter().map(|&i| all[i].class()).collect(),
                    g.shares.clone(),
                );
                let next = ids.len();
                *ids.entry(key).or_insert(next)
            })
            .collect();
        let memory = (groups.iter())
            .map(|g| {
                (g.members.iter().zip(&g.state))
                    .filter_map(|(&i, share)| Some(cost.usable_memory(&all[i])? / share))
                    .reduce(f64::min)
            })
            .collect();
        Ctx {
            cost,
            devices: groups.iter().map(|g| all[g.members[0]].clone()).collect(),
            groups,
            classes,
            all,
            costs: HashMap::new(),
            memory,
            memory_bound: Cell::new(false),
        }
    }

    /// Whether `need` bytes exceed `have` (none: no limit), noted.
    fn exceeds(&self, need: f64, have: Option<f64>) -> bool {
        let over = have.is_some_and(|have| need > have);
        if over {
            self.memory_bound.set(true);
        }
        over
    }

    /// A unit's costs at micro-batch size `b`: a group's slowest member on its share,
    /// plus the group's collectives (with sequence parallelism, per layer two
    /// all-gathers and two reduce-scatters forward and as many backward, together four
    /// all-reduces of the activation; one each for the embedding and the head).
    fn costs(&mut self, unit: usize, b: usize) -> Result<StageCosts, PlanningError> {
        let key = (self.classes[unit], b);
        if let Some(c) = self.costs.get(&key) {
            return Ok(*c);
        }
        let group = &self.groups[unit];
        let each: Vec<StageCosts> = (group.members.iter())
            .map(|&i| self.cost.stage_costs(&self.all[i], b))
            .collect::<Result<_, _>>()?;
        let mut c = each[0];
        if group.size() > 1 {
            let members: Vec<&Device> = group.members.iter().map(|&i| &self.all[i]).collect();
            let bytes = (self.cost.model).activation_message_bytes(b, self.cost.compute_bytes);
            let collective = self.cost.allreduce_seconds(&members, bytes);
            let layer_s: Vec<f64> = each.iter().map(|k| k.layer_s).collect();
            c.layer_s = group.layer_s(&layer_s) + 4.0 * collective;
            c.embedding_s = each.iter().map(|k| k.embedding_s).fold(0.0, f64::max) + collective;
            c.head_s = (each.iter().zip(&group.vocab))
                .map(|(k, v)| k.head_s * v)
                .fold(0.0, f64::max)
                + collective;
        }
        self.costs.insert(key, c);
        Ok(c)
    }

    /// The optimizer step of a unit holding `params` parameters, s: its slowest member
    /// on its share (`None` where no member is priced).
    fn optimizer_seconds(&self, unit: usize, params: f64) -> Option<f64> {
        let group = &self.groups[unit];
        (group.members.iter().zip(&group.state))
            .filter_map(|(&i, share)| self.cost.optimizer_seconds(&self.all[i], params * share))
            .reduce(f64::max)
    }

    /// The largest fraction of a stage's parameters a member of the unit holds: what its
    /// gradient reduction carries.
    fn state_fraction(&self, unit: usize) -> f64 {
        self.groups[unit].state.iter().copied().fold(0.0, f64::max)
    }
}

/// A constraint a candidate breaks, with how far (need / have) it is from feasible.
#[derive(Debug, Clone)]
struct Violation {
    ratio: f64,
    reason: Infeasibility,
}

/// Plans `request` on `cost`'s cluster and model.
pub fn plan(cost: &CostModel, request: &PlanRequest) -> Result<PlanOutcome, PlanningError> {
    let mut ctx = Ctx::new(cost);
    let n = ctx.devices.len();
    let l = cost.model.num_layers;
    let g = request.global_batch_size;
    if l == 0 || g == 0 {
        return Err(PlanningError::EmptyRequest {
            layers: l,
            global_batch_size: g,
        });
    }
    let keep = request.top_k.max(1);
    let (mut candidates, mut considered) = (Vec::new(), 0);
    let mut closest: Option<Violation> = None;
    let variants: Vec<(TrainOptions, CostModel)> = (request.grid_options().into_iter())
        .map(|options| (options, options.cost(cost)))
        .collect();
    // Per option, whether memory ruled anything out, and the layouts found without it.
    let mut searched: HashMap<TrainOptions, (bool, Vec<Candidate>)> = HashMap::new();
    let optimizer_priced = (ctx.devices.iter()).any(|d| cost.optimizer_seconds(d, 1.0).is_some());
    for (options, variant) in &variants {
        let (options, mut ctx) = (*options, Ctx::new(variant));
        // Whether memory bound the search without recomputation, or without sharding.
        let bound = |recompute, distributed_optimizer| {
            let options = TrainOptions {
                recompute,
                distributed_optimizer,
            };
            searched.get(&options).map(|(bound, _)| *bound)
        };
        let (d, plain) = (
            options.distributed_optimizer,
            options.recompute == Recompute::Never,
        );
        let unsharded = bound(Recompute::Never, false);
        let search = if options.recompute == Recompute::WhereNeeded
            && bound(Recompute::Never, d) == Some(false)
        {
            // Recomputation only saves memory at a cost in time: tried where memory bound.
            Search::default()
        } else if plain && d && unsharded == Some(false) {
            // Sharding saves memory and the optimizer's time: where memory did not bind,
            // the same layouts re-priced (nothing to gain where the optimizer is unpriced).
            match optimizer_priced {
                true => reprice(&mut ctx, &searched[&TrainOptions::default()].1)?,
                false => Search::default(),
            }
        } else {
            grid_search(&mut ctx, request)?
        };
        considered += search.considered;
        if let Some(v) = search.closest {
            if closest.as_ref().is_none_or(|c| v.ratio < c.ratio) {
                closest = Some(v);
            }
        }
        let found = search.candidates.clone();
        searched.insert(options, (ctx.memory_bound.get(), found));
        candidates.extend(search.candidates);
    }
    // Per-replica pipelines may fit where no grid does (a small device in a pipeline of
    // its own, or a tensor-parallel group).
    let pooled = plan_pooled_options(cost, request)?;
    let (plans, uniform_layouts) = match candidates.is_empty() {
        true => (Vec::new(), Vec::new()),
        false => {
            let mut ctxs: HashMap<TrainOptions, Ctx<'_>> = (variants.iter())
                .map(|(options, variant)| (*options, Ctx::new(variant)))
                .collect();
            retime_front(&mut ctxs, candidates, keep)?
        }
    };
    if plans.is_empty() && pooled.is_none() {
        return Err(PlanningError::Infeasible(closest.map_or(
            Infeasibility::BatchTooSmall {
                global_batch_size: g,
                devices: n,
            },
            |v| v.reason,
        )));
    }
    let uniform = uniform_layouts.first().cloned();
    let bound = throughput_bound(&mut ctx, request)?;
    let mut unpriced_optimizer: Vec<String> = (ctx.devices.iter())
        .filter(|d| cost.optimizer_seconds(d, 1.0).is_none())
        .map(|d| d.kind.clone())
        .collect();
    unpriced_optimizer.sort();
    unpriced_optimizer.dedup();
    Ok(PlanOutcome {
        plans,
        uniform,
        uniform_layouts,
        pooled,
        considered,
        bound,
        unpriced_optimizer,
    })
}

/// Every grid of every factorization and arrangement at every micro-batch size (one
/// for all replicas, or one each), on `ctx`'s costs.
fn grid_search(ctx: &mut Ctx<'_>, request: &PlanRequest) -> Result<Search, PlanningError> {
    let (n, l, g) = (
        ctx.devices.len(),
        ctx.cost.model.num_layers,
        request.global_batch_size,
    );
    let order = fastest_first(ctx)?;
    let mut search = Search::default();
    let sizes = micro_batch_sizes(request);
    for p in (1..=n.min(l)).filter(|p| n % p == 0) {
        let d = n / p;
        for arrangement in [Arrangement::ByReplica, Arrangement::ByStage] {
            let devices = arrange(&order, p, d, arrangement);
            let grid = Arranged {
                devices: &devices,
                arrangement,
            };
            for &b in &sizes {
                if g % b == 0 && g / b >= d {
                    search.grid(ctx, grid, b, g / b)?;
                }
            }
            if d > 1 && sizes.len() > 1 {
                search.mixed(ctx, grid, g, &sizes)?;
            }
        }
    }
    Ok(search)
}

/// `found`'s layouts priced again on `ctx`'s costs (those that still fit).
fn reprice(ctx: &mut Ctx<'_>, found: &[Candidate]) -> Result<Search, PlanningError> {
    let mut search = Search::default();
    for c in found {
        let grid = Arranged {
            devices: &c.devices,
            arrangement: c.arrangement,
        };
        let layout = (
            c.layers.clone(),
            c.micro_batch_sizes.clone(),
            c.micro_batches.clone(),
        );
        search.consider(ctx, grid, layout, c.origin)?;
    }
    Ok(search)
}

/// The best per-replica-pipeline plan with and without recomputation (as asked): the
/// distributed optimizer's shards are not priced for them (its flag, when asked for,
/// only lowers what they need).
fn plan_pooled_options(
    cost: &CostModel,
    request: &PlanRequest,
) -> Result<Option<PooledCandidate>, PlanningError> {
    let (g, sizes, tp) = (
        request.global_batch_size,
        micro_batch_sizes(request),
        request.tp_sizes(),
    );
    let (mut best, mut bound): (Option<PooledCandidate>, Option<bool>) = (None, None);
    for &recompute in request.recompute.recompute() {
        // Recomputation only saves memory at a cost in time: tried where memory bound.
        if recompute == Recompute::WhereNeeded && bound == Some(false) {
            continue;
        }
        let options = TrainOptions {
            recompute,
            distributed_optimizer: request.distributed_optimizer == Choice::On,
        };
        let variant = TrainOptions {
            distributed_optimizer: false,
            ..options
        }
        .cost(cost);
        let (found, memory_bound) = plan_pooled_noting_memory(&variant, g, &sizes, &tp)?;
        bound = Some(memory_bound);
        if let Some(mut c) = found {
            c.options = options;
            if best.as_ref().is_none_or(|b| c.step_time_s < b.step_time_s) {
                best = Some(c);
            }
        }
    }
    Ok(best)
}

/// Each device alone: the global batch through the whole model at the pace of the
/// request's micro-batch size it computes a sample fastest at (whether or not it
/// divides the batch: plans mix sizes), plus its optimizer step.
fn throughput_bound(
    ctx: &mut Ctx<'_>,
    request: &PlanRequest,
) -> Result<ThroughputBound, PlanningError> {
    let g = request.global_batch_size;
    let sizes = micro_batch_sizes(request);
    let model = &ctx.cost.model;
    let (layers, params) = (
        model.num_layers as f64,
        model.stage_params(model.num_layers, true, true),
    );
    let tokens = (g * model.seq_length) as f64;
    let mut device_tokens_per_s = Vec::with_capacity(ctx.devices.len());
    for i in 0..ctx.devices.len() {
        let optimizer = ctx
            .cost
            .optimizer_seconds(&ctx.devices[i], params)
            .unwrap_or(0.0);
        let mut best = f64::INFINITY;
        for &b in &sizes {
            let k = ctx.costs(i, b)?;
            let pass = layers * k.layer_s + k.embedding_s + k.head_s;
            best = best.min(g as f64 / b as f64 * pass + optimizer);
        }
        device_tokens_per_s.push(tokens / best);
    }
    Ok(ThroughputBound {
        tokens_per_s: device_tokens_per_s.iter().sum(),
        device_tokens_per_s,
    })
}

/// Device indices, fastest first (per-layer time at micro-batch size 1), ties by index.
fn fastest_first(ctx: &mut Ctx<'_>) -> Result<Vec<usize>, PlanningError> {
    let n = ctx.devices.len();
    let speed: Vec<f64> = (0..n)
        .map(|i| ctx.costs(i, 1).map(|c| c.layer_s))
        .collect::<Result<_, _>>()?;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| speed[a].total_cmp(&speed[b]).then(a.cmp(&b)));
    Ok(order)
}

/// The request's distinct positive micro-batch sizes, ascending (1 when none).
fn micro_batch_sizes(request: &PlanRequest) -> Vec<usize> {
    let sizes: BTreeSet<usize> = request
        .micro_batch_sizes
        .iter()
        .copied()
        .filter(|&b| b > 0)
        .collect();
    if sizes.is_empty() {
        vec![1]
    } else {
        sizes.into_iter().collect()
    }
}

/// Devices arranged as (stage, replica), and how.
#[derive(Clone, Copy)]
struct Arranged<'a> {
    devices: &'a [Vec<usize>],
    arrangement: Arrangement,
}

/// What the search has found so far.
#[derive(Default)]
struct Search {
    candidates: Vec<Candidate>,
    /// The infeasible candidate closest to fitting.
    closest: Option<Violation>,
    considered: usize,
}

impl Search {
    /// Evaluates one layout of `grid` and keeps it, or notes why it does not fit.
    fn consider(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        (layers, sizes, micro_batches): (Vec<usize>, Vec<usize>, Vec<usize>),
        origin: CandidateOrigin,
    ) -> Result<(), PlanningError> {
        self.considered += 1;
        match evaluate(ctx, grid.devices, &layers, &sizes, &micro_batches)? {
            Ok(prediction) => self.candidates.push(Candidate {
                recompute: (stage_fits(ctx, grid.devices, &layers, &sizes, &micro_batches)?)
                    .iter()
                    .map(|row| row.iter().map(|f| f.recompute).collect())
                    .collect(),
                options: TrainOptions {
                    recompute: ctx.cost.recompute,
                    // One replica has nothing to shard over.
                    distributed_optimizer: ctx.cost.distributed_optimizer
                        && micro_batches.len() > 1,
                },
                arrangement: grid.arrangement,
                devices: grid.devices.to_vec(),
                layers,
                micro_batch_sizes: sizes,
                micro_batches,
                prediction,
                origin,
            }),
            Err(v) => self.note(v),
        }
        Ok(())
    }

    fn note(&mut self, v: Violation) {
        if self.closest.as_ref().is_none_or(|c| v.ratio < c.ratio) {
            self.closest = Some(v);
        }
    }

    /// The layouts of one grid at micro-batch size `b` with `total` micro-batches: the
    /// even layout when it exists, then alternating exact splits of layers and
    /// micro-batches, starting from micro-batches in proportion to replica throughput
    /// under even layers.
    fn grid(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        b: usize,
        total: usize,
    ) -> Result<(), PlanningError> {
        let devices = grid.devices;
        let (p, d, l) = (devices.len(), devices[0].len(), ctx.cost.model.num_layers);
        if l % p == 0 && total % d == 0 {
            let even = (vec![l / p; p], vec![b; d], vec![total / d; d]);
            self.consider(ctx, grid, even, CandidateOrigin::Uniform)?;
        }
        let m = proportional_split(ctx, devices, b, total)?;
        self.alternate(ctx, grid, &vec![b; d], b * total, m)
    }

    /// The layouts of one grid whose replicas take micro-batch sizes of their own: for
    /// each assignment of [`size_assignments`] in which the sizes differ, the batch split
    /// under even layers, then alternating exact splits.
    fn mixed(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        samples: usize,
        sizes: &[usize],
    ) -> Result<(), PlanningError> {
        let devices = grid.devices;
        let even = even_layers(ctx.cost.model.num_layers, devices.len());
        for assigned in size_assignments(ctx, devices, &even, sizes)? {
            if assigned.iter().all(|&b| b == assigned[0]) {
                continue;
            }
            if let Some(m) = split_samples(ctx, devices, &assigned, &even, samples)? {
                self.alternate(ctx, grid, &assigned, samples, m)?;
            }
        }
        Ok(())
    }

    /// From micro-batch counts `m`, alternates the exact layer split for the counts and
    /// the exact batch split for the layers, keeping each new layout, until one repeats
    /// (three rounds at most).
    fn alternate(
        &mut self,
        ctx: &mut Ctx<'_>,
        grid: Arranged<'_>,
        sizes: &[usize],
        samples: usize,
        mut m: Vec<usize>,
    ) -> Result<(), PlanningError> {
        let (devices, l) = (grid.devices, ctx.cost.model.num_layers);
        let mut seen = BTreeSet::new();
        for _ in 0..3 {
            let Some(layers) = split_layers(ctx, devices, sizes, &m, l)? else {
                self.note(memory_violation(ctx, devices, sizes, &m, l)?);
                break;
            };
            let Some(split) = split_samples(ctx, devices, sizes, &layers, samples)? else {
                break;
            };
            m = split;
            if !seen.insert((layers.clone(), m.clone())) {
                break;
            }
            let layout = (layers, sizes.to_vec(), m.clone());
            self.consider(ctx, grid, layout, CandidateOrigin::Planned)?;
        }
        Ok(())
    }
}

/// `l` layers over `p` stages as evenly as they go, the first stages one more.
fn even_layers(l: usize, p: usize) -> Vec<usize> {
    (0..p).map(|i| l / p + usize::from(i < l % p)).collect()
}

/// Micro-batch sizes per replica to try: every assignment of `sizes` when there are at
/// most [`SIZE_ASSIGNMENTS`]; else every assignment per kind of replica (replicas on
/// the same device classes and memory take the same size) when those are few enough;
/// else each kind the size at which it computes a sample fastest among those that fit
/// its memory under `layers` (the smallest when none fits).
fn size_assignments(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
) -> Result<Vec<Vec<usize>>, PlanningError> {
    let d = grid[0].len();
    // A replica's kind: its devices' classes and memory, stage by stage.
    type ReplicaKind = Vec<(usize, Option<u64>)>;
    let mut kinds: Vec<ReplicaKind> = Vec::new();
    let kind_of: Vec<usize> = (0..d)
        .map(|r| {
            let key: ReplicaKind = (grid.iter())
                .map(|stage| {
                    (
                        ctx.classes[stage[r]],
                        ctx.memory[stage[r]].map(f64::to_bits),
                    )
                })
                .collect();
            kinds.iter().position(|k| *k == key).unwrap_or_else(|| {
                kinds.push(key);
                kinds.len() - 1
            })
        })
        .collect();
    let assignments = |units: usize| {
        (sizes.len().checked_pow(u32::try_from(units).ok()?)).filter(|&n| n <= SIZE_ASSIGNMENTS)
    };
    // The `k`-th assignment of sizes to `units` units, in base |sizes|.
    let nth = |mut k: usize, units: usize| -> Vec<usize> {
        (0..units)
            .map(|_| {
                let size = sizes[k % sizes.len()];
                k /= sizes.len();
                size
            })
            .collect()
    };
    if let Some(n) = assignments(d) {
        return Ok((0..n).map(|k| nth(k, d)).collect());
    }
    let per_kind: Vec<Vec<usize>> = match assignments(kinds.len()) {
        Some(n) => (0..n).map(|k| nth(k, kinds.len())).collect(),
        None => {
            let mut fastest = Vec::with_capacity(kinds.len());
            for kind in 0..kinds.len() {
                let r = kind_of
                    .iter()
                    .position(|&k| k == kind)
                    .expect("a replica per kind");
                fastest.push(fastest_size(ctx, grid, layers, r, sizes)?);
            }
            vec![fastest]
        }
    };
    Ok(per_kind
        .into_iter()
        .map(|of_kind| kind_of.iter().map(|&k| of_kind[k]).collect())
        .collect())
}

/// The size at which replica `r` computes a sample fastest (its slowest stage's time per
/// sample) among those that fit its memory with every micro-batch of 1F1B in flight.
fn fastest_size(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    r: usize,
    sizes: &[usize],
) -> Result<usize, PlanningError> {
    let p = grid.len();
    let shares = Shares::of_grid(ctx, grid);
    let mut best: Option<(f64, usize)> = None;
    for &b in sizes {
        let (mut fits, mut slowest) = (true, 0.0f64);
        for (i, &own) in layers.iter().enumerate() {
            let fit = grid_fit(ctx, grid, &shares, (i, r), own, b, p)?;
            fits &= !ctx.exceeds(fit.need, ctx.memory[grid[i][r]]);
            slowest = slowest.max(stage_seconds(&fit.costs, own, i, p));
        }
        let per_sample = slowest / b as f64;
        if fits && best.is_none_or(|(s, _)| per_sample < s) {
            best = Some((per_sample, b));
        }
    }
    Ok(best.map_or(sizes[0], |(_, b)| b))
}

/// Re-times the front runners (up to `keep` × 3 planned ones) and every even layout by
/// simulating their schedules; returns the best `keep` and every distinct even layout,
/// fastest first.
fn retime_front(
    ctxs: &mut HashMap<TrainOptions, Ctx<'_>>,
    mut candidates: Vec<Candidate>,
    keep: usize,
) -> Result<(Vec<Candidate>, Vec<Candidate>), PlanningError> {
    let by_time = |a: &Candidate, b: &Candidate| {
        a.prediction
            .step_time_s
            .total_cmp(&b.prediction.step_time_s)
    };
    // Fastest first; on ties the options searched first (off before on). A layout found
    // under several options keeps its fastest.
    candidates.sort_by(by_time);
    let mut front: Vec<Candidate> = Vec::new();
    let mut planned = 0;
    for c in candidates {
        let is_uniform = c.origin == CandidateOrigin::Uniform;
        let duplicate = front.iter().any(|f| {
            f.layers == c.layers
                && f.micro_batches == c.micro_batches
                && f.micro_batch_sizes == c.micro_batch_sizes
                && f.devices == c.devices
        });
        if duplicate || (!is_uniform && planned >= keep * 3) {
            continue;
        }
        planned += usize::from(!is_uniform);
        front.push(c);
    }
    for c in &mut front {
        // A single replica's candidate carries no sharding: priced alike either way.
        let ctx = match ctxs.contains_key(&c.options) {
            true => ctxs.get_mut(&c.options),
            false => ctxs
                .values_mut()
                .find(|x| x.cost.recompute == c.options.recompute),
        }
        .expect("a context for each option searched");
        c.prediction = simulate_candidate(ctx, c)?;
    }
    front.sort_by(by_time);
    let uniform: Vec<Candidate> = (front.iter())
        .filter(|c| c.origin == CandidateOrigin::Uniform)
        .cloned()
        .collect();
    front.truncate(keep);
    Ok((front, uniform))
}

/// Device of (stage, replica).
fn arrange(order: &[usize], p: usize, d: usize, arrangement: Arrangement) -> Vec<Vec<usize>> {
    let mut grid = vec![vec![0; d]; p];
    for (k, &device) in order.iter().enumerate() {
        let (stage, replica) = match arrangement {
            Arrangement::ByReplica => (k % p, k / p),
            Arrangement::ByStage => (k / d, k % d),
        };
        grid[stage][replica] = device;
    }
    grid
}

/// Values by (stage, replica).
type Grid<T> = Vec<Vec<T>>;

/// One distinct replica of a stage, as the layer DP sees it.
#[derive(Clone)]
struct StageRow {
    micro_batches: f64,
    usable_bytes: Option<f64>,
    costs: StageCosts,
    /// Bytes needed as (fixed, per layer), without and with recomputation.
    need: (f64, f64),
    recomputed_need: (f64, f64),
}

/// Per (stage, replica): per-micro-batch time (at the replica's micro-batch size in
/// `sizes`, recomputing where [`stage_fit`] says with `m` micro-batches), and p2p
/// seconds to the next stage.
fn stage_times(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<(Grid<f64>, Grid<f64>), PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let fits = stage_fits(ctx, grid, layers, sizes, m)?;
    let mut t = vec![vec![0.0; d]; p];
    let mut c = vec![vec![0.0; d]; p];
    for i in 0..p {
        for r in 0..d {
            let b = sizes[r];
            t[i][r] = stage_seconds(&fits[i][r].costs, layers[i], i, p);
            if i + 1 < p {
                c[i][r] =
                    ctx.cost
                        .p2p_seconds(&ctx.devices[grid[i][r]], &ctx.devices[grid[i + 1][r]], b);
            }
        }
    }
    Ok((t, c))
}

/// One micro-batch's forward and backward through stage `i` of `p` holding `layers`
/// layers (and the embedding or head at the ends).
fn stage_seconds(k: &StageCosts, layers: usize, i: usize, p: usize) -> f64 {
    layers as f64 * k.layer_s
        + if i == 0 { k.embedding_s } else { 0.0 }
        + if i + 1 == p { k.head_s } else { 0.0 }
}

/// The 1F1B time of a replica: fill and drain plus (m − 1) of its slowest stage.
fn pipeline_time(t: &[Vec<f64>], c: &[Vec<f64>], r: usize, m: usize) -> f64 {
    let sum: f64 = t.iter().map(|s| s[r]).sum();
    let comm: f64 = c.iter().map(|s| 2.0 * s[r]).sum();
    let max = t.iter().map(|s| s[r]).fold(0.0, f64::max);
    sum + comm + (m.saturating_sub(1)) as f64 * max
}

/// Memory check of one (stage, replica) of `grid`, whose stages' optimizer shares are
/// `shares`: (need, usable).
fn memory_need(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    shares: &[Shares],
    (i, r): (usize, usize),
    layers: usize,
    b: usize,
    m: usize,
) -> Result<(f64, Option<f64>), PlanningError> {
    let fit = grid_fit(ctx, grid, shares, (i, r), layers, b, m)?;
    Ok((fit.need, ctx.memory[grid[i][r]]))
}

/// [`stage_fit`] of (stage, replica) of `grid` holding `layers` layers with `m`
/// micro-batches of `b` samples (1F1B keeps min(p − i, m) in flight).
fn grid_fit(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    shares: &[Shares],
    (i, r): (usize, usize),
    layers: usize,
    b: usize,
    m: usize,
) -> Result<StageFit, PlanningError> {
    let p = grid.len();
    let holding = StageHolding {
        layers,
        first: i == 0,
        last: i + 1 == p,
        in_flight: (p - i).min(m),
        micro_batch_size: b,
        optimizer_share: shares[i].of(ctx, grid[i][r]),
        recompute: false,
    };
    stage_fit(ctx, grid[i][r], holding)
}

/// A unit holding a stage: the costs it runs at, whether it recomputes (by the
/// context's [`Recompute`]: where needed, when it would not fit otherwise), and the
/// bytes it needs so.
#[derive(Debug, Clone, Copy)]
struct StageFit {
    costs: StageCosts,
    recompute: bool,
    need: f64,
}

fn stage_fit(
    ctx: &mut Ctx<'_>,
    unit: usize,
    holding: StageHolding,
) -> Result<StageFit, PlanningError> {
    let plain = ctx.costs(unit, holding.micro_batch_size)?;
    let need = |recompute| {
        let holding = StageHolding {
            recompute,
            ..holding
        };
        ctx.cost.memory_bytes(&plain, &holding)
    };
    let recompute = match ctx.cost.recompute {
        Recompute::Never => false,
        Recompute::Always => true,
        Recompute::WhereNeeded => ctx.memory[unit].is_some_and(|have| need(false) > have),
    };
    Ok(StageFit {
        costs: match recompute {
            true => plain.recomputed(),
            false => plain,
        },
        recompute,
        need: need(recompute),
    })
}

/// [`stage_fit`] of every (stage, replica) of `grid` with `layers`, micro-batch sizes
/// `sizes` and counts `m`.
fn stage_fits(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<Grid<StageFit>, PlanningError> {
    let p = grid.len();
    let shares = Shares::of_grid(ctx, grid);
    let mut fits = Vec::with_capacity(p);
    for i in 0..p {
        let mut row = Vec::with_capacity(grid[i].len());
        for r in 0..grid[i].len() {
            row.push(grid_fit(
                ctx,
                grid,
                &shares,
                (i, r),
                layers[i],
                sizes[r],
                m[r],
            )?);
        }
        fits.push(row);
    }
    Ok(fits)
}

/// How a stage's optimizer state divides over its replicas: under the distributed
/// optimizer in proportion to their devices' memory, as the trainer divides it (equally
/// where memory is not known), else not at all.
#[derive(Clone, Copy)]
struct Shares {
    sharded: bool,
    replicas: usize,
    /// Their memory together, when every one's is known.
    memory: Option<f64>,
}

impl Shares {
    fn of_stage(ctx: &Ctx<'_>, stage: &[usize]) -> Self {
        let sharded = ctx.cost.distributed_optimizer && stage.len() > 1;
        Shares {
            sharded,
            replicas: stage.len(),
            memory: match sharded {
                true => stage.iter().map(|&u| Self::weight(ctx, u)).sum(),
                false => None,
            },
        }
    }

    /// A unit's weight as the trainer shards by it (`GeneralPlan::memory_shares`): its
    /// device's memory in tenths of a GB, as the plan file gives it.
    fn weight(ctx: &Ctx<'_>, unit: usize) -> Option<f64> {
        let gb = ctx.devices[unit].spec?.memory_gb;
        Some(f64::from(crate::general::memory_share_weight(gb)))
    }

    fn of_grid(ctx: &Ctx<'_>, grid: &[Vec<usize>]) -> Vec<Self> {
        grid.iter()
            .map(|stage| Self::of_stage(ctx, stage))
            .collect()
    }

    /// `unit`'s share.
    fn of(&self, ctx: &Ctx<'_>, unit: usize) -> f64 {
        match (self.sharded, self.memory, Self::weight(ctx, unit)) {
            (false, ..) => 1.0,
            (true, Some(all), Some(mine)) => mine / all.max(1.0),
            _ => 1.0 / self.replicas as f64,
        }
    }
}

/// Scores a layout by the closed form; `Err(violation)` when a rank runs out of memory.
fn evaluate(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
    sizes: &[usize],
    m: &[usize],
) -> Result<Result<Prediction, Violation>, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let shares = Shares::of_grid(ctx, grid);
    let mut stage_memory = vec![0.0f64; p];
    for i in 0..p {
        for r in 0..d {
            let (need, have) = memory_need(ctx, grid, &shares, (i, r), layers[i], sizes[r], m[r])?;
            stage_memory[i] = stage_memory[i].max(need);
            if let Some(have) = have {
                if ctx.exceeds(need, Some(have)) {
                    let dev = &ctx.devices[grid[i][r]];
                    return Ok(Err(Violation {
                        ratio: need / have.max(1.0),
                        reason: Infeasibility::OutOfMemory(MemoryShortfall {
                            stage: i,
                            layers: layers[i],
                            pp: p,
                            dp: d,
                            kind: dev.kind.clone(),
                            device: dev.index,
                            need_bytes: need,
                            usable_bytes: have,
                            micro_batch_size: sizes[r],
                            in_flight: (p - i).min(m[r]),
                        }),
                    }));
                }
            }
        }
    }
    let (t, c) = stage_times(ctx, grid, layers, sizes, m)?;
    let pipeline_s = (0..d)
        .map(|r| pipeline_time(&t, &c, r, m[r]))
        .fold(0.0, f64::max);
    let allreduce_s = max(&allreduce_times(ctx, grid, layers));
    let optimizer_s = max(&optimizer_times(ctx, grid, layers).concat());
    let step = pipeline_s + allreduce_s + optimizer_s;
    let busy: Vec<Vec<f64>> = (0..p)
        .map(|i| (0..d).map(|r| t[i][r] * m[r] as f64).collect())
        .collect();
    let total_busy: f64 = busy.iter().flatten().sum();
    Ok(Ok(Prediction {
        step_time_s: step,
        pipeline_s,
        allreduce_s,
        optimizer_s,
        bubble_fraction: 1.0 - total_busy / (step * (p * d) as f64).max(1e-30),
        stage_time_s: t
            .iter()
            .map(|s| s.iter().copied().fold(0.0, f64::max))
            .collect(),
        stage_memory_bytes: stage_memory,
        busy_s: busy,
        simulated: false,
    }))
}

/// The largest of `values` (0 for none).
fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(0.0, f64::max)
}

/// Per stage, the fp32 gradient all-reduce over its replicas, s.
fn allreduce_times(ctx: &Ctx<'_>, grid: &[Vec<usize>], layers: &[usize]) -> Vec<f64> {
    let p = grid.len();
    let m = &ctx.cost.model;
    (0..p)
        .map(|i| {
            let mut params = layers[i] as f64 * m.layer_params();
            if i == 0 {
                params += m.embedding_params();
            }
            if i + 1 == p {
                params += m.embedding_params();
            }
            let devs: Vec<&Device> = grid[i].iter().map(|&k| &ctx.devices[k]).collect();
            ctx.cost.allreduce_seconds(&devs, params * 4.0)
        })
        .collect()
}

/// Per (stage, replica), the optimizer step over the stage's parameters, s (0 where
/// not priced).
fn optimizer_times(ctx: &Ctx<'_>, grid: &[Vec<usize>], layers: &[usize]) -> Grid<f64> {
    let p = grid.len();
    (0..p)
        .map(|i| {
            let params = ctx.cost.model.stage_params(layers[i], i == 0, i + 1 == p);
            let shares = Shares::of_stage(ctx, &grid[i]);
            (grid[i].iter())
                .map(|&k| {
                    let share = shares.of(ctx, k);
                    ctx.optimizer_seconds(k, params * share).unwrap_or(0.0)
                })
                .collect()
        })
        .collect()
}

/// Micro-batches in proportion to each replica's throughput under even layers, at
/// least one each, largest remainders first.
fn proportional_split(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    b: usize,
    total: usize,
) -> Result<Vec<usize>, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    let even = even_layers(ctx.cost.model.num_layers, p);
    // Every stage with its pipeline's depth in flight, as a long batch keeps it.
    let (t, _) = stage_times(ctx, grid, &even, &vec![b; d], &vec![p; d])?;
    let rate: Vec<f64> = (0..d)
        .map(|r| 1.0 / t.iter().map(|s| s[r]).fold(1e-30, f64::max))
        .collect();
    let sum: f64 = rate.iter().sum();
    let spare = total - d;
    let exact: Vec<f64> = rate.iter().map(|x| spare as f64 * x / sum).collect();
    let mut m: Vec<usize> = exact.iter().map(|x| 1 + x.floor() as usize).collect();
    let mut left = total - m.iter().sum::<usize>();
    let mut by_remainder: Vec<usize> = (0..d).collect();
    by_remainder
        .sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for &r in by_remainder.iter().cycle() {
        if left == 0 {
            break;
        }
        m[r] += 1;
        left -= 1;
    }
    Ok(m)
}

/// Exact min-max split of `total` micro-batches over replicas whose pipeline time is
/// nondecreasing in their count: start at one each, give each next micro-batch to the
/// replica that would finish earliest with it.
pub fn min_max_split(
    total: usize,
    time: impl Fn(usize, usize) -> f64,
    replicas: usize,
) -> Vec<usize> {
    let mut m = vec![1usize; replicas];
    #[derive(PartialEq)]
    struct Next(f64, usize);
    impl Eq for Next {}
    impl PartialOrd for Next {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Next {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            // A min-heap on time, then on replica index.
            o.0.total_cmp(&self.0).then(o.1.cmp(&self.1))
        }
    }
    let mut heap: BinaryHeap<Next> = (0..replicas).map(|r| Next(time(r, 2), r)).collect();
    for _ in replicas..total {
        let Some(Next(_, r)) = heap.pop() else { break };
        m[r] += 1;
        heap.push(Next(time(r, m[r] + 1), r));
    }
    m
}

/// The exact min-max split of `samples` over the replicas at micro-batch sizes
/// `sizes` under `layers`; `None` when no counts make `samples`.
fn split_samples(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    sizes: &[usize],
    layers: &[usize],
    samples: usize,
) -> Result<Option<Vec<usize>>, PlanningError> {
    let (t, c) = stage_times(ctx, grid, layers, sizes, &vec![grid.len(); grid[0].len()])?;
    let d = grid[0].len();
    let b = sizes[0];
    if sizes.iter().all(|&s| s == b) {
        let fits = samples % b == 0 && samples / b >= d;
        let time = |r, m| pipeline_time(&t, &c, r, m);
        return Ok(fits.then(|| min_max_split(samples / b, time, d)));
    }
    let paces: Vec<ReplicaPace> = (0..d)
        .map(|r| ReplicaPace {
            micro_batch_size: sizes[r],
            first_s: pipeline_time(&t, &c, r, 1),
            each_s: t.iter().map(|s| s[r]).fold(0.0, f64::max),
            most_micro_batches: usize::MAX,
        })
        .collect();
    Ok(min_max_samples(samples, &paces))
}

/// Exact contiguous split of `l` layers over `costs.len()` stages minimising the largest
/// stage cost; `costs[i](ℓ)` is stage i's cost holding ℓ layers, `None` when ℓ does not
/// fit. `None` when no split fits. O(p·L²).
pub fn min_max_layers(l: usize, costs: &[&dyn Fn(usize) -> Option<f64>]) -> Option<Vec<usize>> {
    let p = costs.len();
    if p == 0 || l < p {
        return None;
    }
    // best[i][k]: min over splits of the first k layers into stages 0..=i of the max cost.
    let mut best = vec![vec![f64::INFINITY; l + 1]; p];
    let mut choice = vec![vec![0usize; l + 1]; p];
    for k in 1..=l {
        if let Some(c) = costs[0](k) {
            best[0][k] = c;
            choice[0][k] = k;
        }
    }
    for i in 1..p {
        for k in (i + 1)..=l {
            for own in 1..=(k - i) {
                let before = best[i - 1][k - own];
                if !before.is_finite() {
                    continue;
                }
                let Some(c) = costs[i](own) else { continue };
                let v = before.max(c);
                if v < best[i][k] {
                    best[i][k] = v;
                    choice[i][k] = own;
                }
            }
        }
    }
    if !best[p - 1][l].is_finite() {
        return None;
    }
    let mut out = vec![0; p];
    let mut k = l;
    for i in (0..p).rev() {
        out[i] = choice[i][k];
        k -= out[i];
    }
    Some(out)
}

fn split_layers(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    sizes: &[usize],
    m: &[usize],
    l: usize,
) -> Result<Option<Vec<usize>>, PlanningError> {
    let p = grid.len();
    let d = grid[0].len();
    // Per stage, the distinct (per-layer time, extra time, micro-batches, memory terms)
    // of its replicas: a few device kinds make a few distinct rows.
    let mut rows: Vec<Vec<StageRow>> = Vec::new();
    for (i, stage_devices) in grid.iter().enumerate() {
        let mut stage_rows = Vec::new();
        let mut seen = BTreeSet::new();
        let shares = Shares::of_stage(ctx, stage_devices);
        for r in 0..d {
            let (dev, b) = (stage_devices[r], sizes[r]);
            let k = ctx.costs(dev, b)?;
            let share = shares.of(ctx, dev);
            let key = (
                k.layer_s.to_bits(),
                (k.embedding_s.to_bits(), k.head_s.to_bits()),
                (k.activation_bytes.to_bits(), k.forward_fraction.to_bits()),
                m[r],
                ctx.memory[dev].map(f64::to_bits),
                b,
                share.to_bits(),
            );
            if seen.insert(key) {
                // A rank's need is affine in its layers: two points give it.
                let need = |recompute, layers| {
                    let holding = StageHolding {
                        layers,
                        first: i == 0,
                        last: i + 1 == p,
                        in_flight: (p - i).min(m[r]),
                        micro_batch_size: b,
                        optimizer_share: share,
                        recompute,
                    };
                    ctx.cost.memory_bytes(&k, &holding)
                };
                let affine = |recompute| {
                    let base = need(recompute, 0);
                    (base, need(recompute, 1) - base)
                };
                stage_rows.push(StageRow {
                    micro_batches: m[r] as f64,
                    usable_bytes: ctx.memory[dev],
                    costs: k,
                    need: affine(false),
                    recomputed_need: affine(true),
                });
            }
        }
        rows.push(stage_rows);
    }
    let (cost, bound) = (ctx.cost, &ctx.memory_bound);
    let closures: Vec<Box<dyn Fn(usize) -> Option<f64> + '_>> = (0..p)
        .map(|i| {
            let stage_rows = rows[i].clone();
            let f: Box<dyn Fn(usize) -> Option<f64>> = Box::new(move |layers: usize| {
                let mut worst = 0.0f64;
                for row in &stage_rows {
                    let over = |recompute| {
                        let (fixed, per_layer) = match recompute {
                            true => row.recomputed_need,
                            false => row.need,
                        };
                        let need = fixed + per_layer * layers as f64;
                        row.usable_bytes.is_some_and(|have| need > have)
                    };
                    // As stage_fit decides, for this many layers.
                    let recompute = match cost.recompute {
                        Recompute::Never => false,
                        Recompute::Always => true,
                        Recompute::WhereNeeded => over(false),
                    };
                    if over(recompute) {
                        bound.set(true);
                        return None;
                    }
                    let k = match recompute {
                        true => row.costs.recomputed(),
                        false => row.costs,
                    };
                    worst = worst.max(row.micro_batches * stage_seconds(&k, layers, i, p));
                }
                Some(worst)
            });
            f
        })
        .collect();
    let refs: Vec<&dyn Fn(usize) -> Option<f64>> = closures.iter().map(|f| f.as_ref()).collect();
    Ok(min_max_layers(l, &refs))
}

/// The memory constraint that blocks every layer split of this arrangement: the least
/// over-committed rank of the even split.
fn memory_violation(
    ctx: &mut Ctx<'_>,
    grid: &[Vec<usize>],
    sizes: &[usize],
    m: &[usize],
    l: usize,
) -> Result<Violation, PlanningError> {
    let p = grid.len();
    let even = even_layers(l, p);
    match evaluate(ctx, grid, &even, sizes, m)? {
        Err(v) => Ok(v),
        Ok(_) => Ok(Violation {
            ratio: 1.0,
            reason: Infeasibility::NoLayerSplit {
                layers: l,
                stages: p,
            },
        }),
    }
}

/// The device index of each rank of the candidate's grid plan, in rank order.
pub fn grid_rank_devices(candidate: &Candidate) -> Result<Vec<usize>, crate::PlanError> {
    let (p, d) = (candidate.layers.len(), candidate.micro_batches.len());
    let order = match candidate.arrangement {
        Arrangement::ByReplica => TP_PP_DP_ORDER,
        Arrangement::ByStage => DEFAULT_ORDER,
    };
    let topology = crate::Topology::new(p * d, 1, p, 1, 1, order)?;
    (0..p * d)
        .map(|rank| -> Result<usize, crate::PlanError> {
            let c = topology.coordinates(rank)?;
            Ok(candidate.devices[c.pp][c.dp])
        })
        .collect()
}

/// The candidate as a plan `synerfuse train --plan` runs.
pub fn to_parallel_plan(
    cost: &CostModel,
    candidate: &Candidate,
) -> Result<ParallelPlan, crate::PlanError> {
    let devices = cost.cluster.devices();
    let p = candidate.layers.len();
    let d = candidate.micro_batches.len();
    let order = match candidate.arrangement {
        Arrangement::ByReplica => TP_PP_DP_ORDER,
        Arrangement::ByStage => DEFAULT_ORDER,
    };
    let spec = TopologySpec {
        world_size: p * d,
        tp: 1,
        pp: p,
        cp: 1,
        ep: 1,
        order: order.into(),
    };
    let ranks = (grid_rank_devices(candidate)?.into_iter())
        .map(|device| placement(&devices[device]))
        .collect();
    let batches = ReplicaBatches::new(
        candidate
            .micro_batch_sizes
            .iter()
            .zip(&candidate.micro_batches)
            .map(|(&b, &m)| ReplicaBatch {
                micro_batch_size: b,
                num_micro_batches: m,
            })
            .collect(),
    )?;
    ParallelPlan::new(
        spec,
        StageLayout::new(candidate.layers.clone(), cost.model.num_layers)?,
        batches,
        ranks,
    )
}

/// The candidate as the file `synerfuse plan` writes: its grid plan in the general
/// form (the grid's rank order kept), with the stages that recompute their activations.
pub fn to_general_grid_plan(
    cost: &CostModel,
    candidate: &Candidate,
) -> Result<crate::GeneralPlan, PlanningError> {
    let general = crate::GeneralPlan::from_grid(&to_parallel_plan(cost, candidate)?)?;
    if !candidate.recompute.iter().flatten().any(|&x| x) {
        return Ok(general);
    }
    let replicas = (general.replicas().iter().enumerate())
        .map(|(r, replica)| crate::general::ReplicaPipeline {
            recompute: candidate.recompute.iter().map(|row| row[r]).collect(),
            ..replica.clone()
        })
        .collect();
    Ok(crate::GeneralPlan::new(replicas)?)
}

/// Where a rank on `dev` computes: CUDA for an accelerator, else the CPU; its emulated
/// speed, kind and memory.
fn placement(dev: &Device) -> RankPlacement {
    let accelerator = dev.spec.is_some_and(|s| s.accelerator);
    RankPlacement {
        device: Some(match accelerator {
            true => DeviceRequest::Cuda(None),
            false => DeviceRequest::Cpu,
        }),
        speed: dev.emulated.then_some(dev.speed),
        kind: Some(dev.kind.clone()),
        memory_gb: dev.spec.map(|s| s.memory_gb),
    }
}

impl PlanOutcome {
    /// The per-replica-pipeline plan, when no grid plan fits or it beats the best by
    /// more than 1 % (the grid plan, which SynerFuse's flags also express, wins ties and
    /// noise).
    pub fn pooled_wins(&self) -> Option<&PooledCandidate> {
        let grid = self.plans.first().map(|c| c.prediction.step_time_s);
        (self.pooled.as_ref()).filter(|p| grid.is_none_or(|g| p.step_time_s < g * 0.99))
    }
}

/// Re-times a candidate by simulating its 1F1B schedule (with p2p times), each stage's
/// gradient reduction starting when its last replica finishes, and the optimizer step
/// once every reduction is done (the gradient norm is global).
fn simulate_candidate(ctx: &mut Ctx<'_>, c: &Candidate) -> Result<Prediction, PlanningError> {
    Ok(simulate_step(ctx, c, false)?.0)
}

/// The simulated step of `c`, with every rank's spans when `record`.
fn simulate_step(
    ctx: &mut Ctx<'_>,
    c: &Candidate,
    record: bool,
) -> Result<(Prediction, Vec<RankTimeline>), PlanningError> {
    let plan = to_parallel_plan(ctx.cost, c)?;
    let programs = plan_schedule(&plan, ScheduleKind::OneFOneB)?;
    let topology = plan.topology()?;
    let p = c.layers.len();
    let sizes = &c.micro_batch_sizes;
    let (t, _) = stage_times(ctx, &c.devices, &c.layers, sizes, &c.micro_batches)?;
    let fits = stage_fits(ctx, &c.devices, &c.layers, sizes, &c.micro_batches)?;
    let coords: Vec<(usize, usize)> = (0..plan.topology.world_size)
        .map(|r| {
            let x = topology.coordinates(r).expect("rank in topology");
            (x.pp, x.dp)
        })
        .collect();
    let mut fractions = vec![0.0; coords.len()];
    for (rank, &(i, r)) in coords.iter().enumerate() {
        fractions[rank] = fits[i][r].costs.forward_fraction;
    }
    let devices = &ctx.devices;
    let cost = ctx.cost;
    let op_seconds = |rank: usize, pass: Pass, _| {
        let (i, r) = coords[rank];
        let f = fractions[rank];
        match pass {
            Pass::Forward => t[i][r] * f,
            Pass::Backward => t[i][r] * (1.0 - f),
        }
    };
    let message_seconds = |from: usize, to: usize| {
        let (a, b_) = (coords[from], coords[to]);
        cost.transfer(
            &devices[c.devices[a.0][a.1]],
            &devices[c.devices[b_.0][b_.1]],
            sizes[a.1],
        )
    };
    let report = match record {
        true => sim::simulate_spans(&programs, op_seconds, message_seconds),
        false => sim::simulate(&programs, op_seconds, message_seconds),
    }
    .map_err(crate::PlanError::from)?;
    let reduce = allreduce_times(ctx, &c.devices, &c.layers);
    let optimizer = optimizer_times(ctx, &c.devices, &c.layers);
    // Each stage's reduction starts when the last of its replicas finishes.
    let mut stage_done = vec![0.0f64; p];
    for (rank, &(i, _)) in coords.iter().enumerate() {
        stage_done[i] = stage_done[i].max(report.finish_s[rank]);
    }
    let reduced: Vec<f64> = (0..p).map(|i| stage_done[i] + reduce[i]).collect();
    let all_reduced = max(&reduced);
    let optimizer_s = max(&optimizer.concat());
    let step = all_reduced + optimizer_s;
    let total_busy: f64 = report.busy_s.iter().sum();
    let prediction = Prediction {
        step_time_s: step,
        pipeline_s: report.makespan_s,
        allreduce_s: max(&reduce),
        optimizer_s,
        bubble_fraction: 1.0 - total_busy / (step * report.busy_s.len() as f64).max(1e-30),
        simulated: true,
        stage_time_s: c.prediction.stage_time_s[..p].to_vec(),
        ..c.prediction.clone()
    };
    let mut rows = Vec::with_capacity(if record { coords.len() } else { 0 });
    for (rank, mut spans) in report.spans.into_iter().enumerate() {
        let (i, r) = coords[rank];
        let mut span = |kind, start_s: f64, end_s: f64| {
            if end_s > start_s {
                spans.push(Span {
                    kind,
                    start_s,
                    end_s,
                    micro_batch: None,
                });
            }
        };
        span(SpanKind::Wait, report.finish_s[rank], stage_done[i]);
        span(SpanKind::Reduce, stage_done[i], reduced[i]);
        span(SpanKind::Wait, reduced[i], all_reduced);
        span(
            SpanKind::Optimizer,
            all_reduced,
            all_reduced + optimizer[i][r],
        );
        let dev = &devices[c.devices[i][r]];
        rows.push(RankTimeline {
            label: format!("rank {rank}: stage {i}, replica {r}, {}", dev.kind),
            spans,
        });
    }
    Ok((prediction, rows))
}

/// The simulated step of `candidate` on `cost`'s cluster, rank by rank.
pub fn timeline(cost: &CostModel, candidate: &Candidate) -> Result<Timeline, PlanningError> {
    let variant = candidate.options.cost(cost);
    let mut ctx = Ctx::new(&variant);
    let (prediction, ranks) = simulate_step(&mut ctx, candidate, true)?;
    let layers: Vec<String> = candidate.layers.iter().map(usize::to_string).collect();
    Ok(Timeline {
        title: format!(
            "predicted: pp {} x dp {}, layers [{}], {}, step {:.4} s",
            candidate.layers.len(),
            candidate.micro_batches.len(),
            layers.join(", "),
            candidate.micro_batch_size_text(),
            prediction.step_time_s
        ),
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A 1.1B-parameter model at sequence 4096 on A10s (24 GB), `count` on one node.
    fn a10s(count: usize, seq_length: usize) -> CostModel {
        let cluster = crate::cluster::ClusterSpec::from_toml(&format!(
            "[[group]]\nkind = \"a10\"\ncount = {count}\nnode = \"a\"\n[network]\nintra_node_gbs = 32\ninter_node_gbs = 12\n"
        ))
        .unwrap();
        let model = crate::cost::ModelShape {
            num_layers: 24,
            hidden_size: 2048,
            num_heads: 16,
            num_kv_heads: 16,
            ffn_hidden_size: 5632,
            vocab_size: 32_000,
            seq_length,
            tied: false,
        };
        CostModel::new(model, cluster, None)
    }

    fn request(g: usize, recompute: Choice, distributed_optimizer: Choice) -> PlanRequest {
        PlanRequest {
            global_batch_size: g,
            micro_batch_sizes: vec![1, 2, 4],
            top_k: 3,
            tensor_parallel_sizes: vec![1],
            recompute,
            distributed_optimizer,
        }
    }

    /// Two A10s hold the model's state in a two-stage pipeline but not its activations
    /// at sequence 4096: recomputing them makes it fit, at a forward's extra cost.
    #[test]
    fn recomputation_makes_a_plan_fit() {
        let cost = a10s(2, 4096);
        let off = plan(&cost, &request(16, Choice::Off, Choice::Off));
        assert!(
            matches!(
                off,
                Err(PlanningError::Infeasible(Infeasibility::OutOfMemory(_)))
            ),
            "{off:?}"
        );
        let outcome = plan(&cost, &request(16, Choice::Auto, Choice::Off)).unwrap();
        let best = &outcome.plans[0];
        assert_eq!(best.options.recompute, Recompute::WhereNeeded, "{best:?}");
        // Only the stages that need it: the last keeps one micro-batch in flight, the
        // first two.
        let stages: Vec<bool> = best.recompute.iter().map(|row| row[0]).collect();
        assert_eq!(stages, [true, false], "{best:?}");
        // The plan file says so; no train flag is needed.
        assert!(best.options.train_flags().is_empty());
        let file = to_general_grid_plan(&cost, best).unwrap();
        assert_eq!(file.replicas()[0].recompute, [true, false]);
        // Each stage's forward runs twice: a third more compute than without.
        let plain = plan(&a10s(2, 2048), &request(32, Choice::Off, Choice::Off)).unwrap();
        let busy = |c: &Candidate| c.prediction.busy_s.iter().flatten().sum::<f64>();
        let again = plan(&a10s(2, 2048), &request(32, Choice::On, Choice::Off)).unwrap();
        let same = (again.plans.iter())
            .find(|c| {
                c.layers == plain.plans[0].layers && c.micro_batches == plain.plans[0].micro_batches
            })
            .expect("the same layout with recomputation");
        let ratio = busy(same) / busy(&plain.plans[0]);
        assert!((ratio - 4.0 / 3.0).abs() < 1e-9, "{ratio}");
    }

    /// Four A10s: without the distributed optimizer two replicas of two stages run out of
    /// memory at micro-batch size 2; sharding the optimizer state over the replicas
    /// makes that plan fit, and it beats the four-stage pipeline.
    #[test]
    fn distributed_optimizer_makes_a_faster_plan_fit() {
        let cost = a10s(4, 2048);
        let off = plan(&cost, &request(16, Choice::Off, Choice::Off)).unwrap();
        assert!(!off
            .plans
            .iter()
            .any(|c| c.layers.len() == 2 && c.micro_batch_sizes[0] == 2));
        let auto = plan(&cost, &request(16, Choice::Off, Choice::Auto)).unwrap();
        let best = &auto.plans[0];
        assert!(best.options.distributed_optimizer, "{best:?}");
        assert_eq!((best.layers.len(), best.micro_batch_sizes[0]), (2, 2));
        assert!(best.prediction.step_time_s < off.plans[0].prediction.step_time_s);
        // Each rank holds its share of the optimizer state: half, on equal devices.
        let variant = best.options.cost(&cost);
        let mut ctx = Ctx::new(&variant);
        let shares = Shares::of_grid(&ctx, &best.devices);
        let (need, have) = memory_need(
            &mut ctx,
            &best.devices,
            &shares,
            (0, 0),
            best.layers[0],
            2,
            best.micro_batches[0],
        )
        .unwrap();
        let whole = plan_memory_without_sharding(&cost, best);
        let optimizer = cost.model.stage_params(best.layers[0], true, false)
            * variant.optimizer_bytes_per_param();
        assert!(
            (whole - need - optimizer / 2.0).abs() < 1.0,
            "{whole} {need} {optimizer}"
        );
        assert!(need <= have.unwrap() && whole > have.unwrap());
    }

    /// Stage 0's need of `c` on its first rank, the optimizer state whole.
    fn plan_memory_without_sharding(cost: &CostModel, c: &Candidate) -> f64 {
        let variant = TrainOptions {
            distributed_optimizer: false,
            ..c.options
        }
        .cost(cost);
        let mut ctx = Ctx::new(&variant);
        let shares = Shares::of_grid(&ctx, &c.devices);
        memory_need(
            &mut ctx,
            &c.devices,
            &shares,
            (0, 0),
            c.layers[0],
            c.micro_batch_sizes[0],
            c.micro_batches[0],
        )
        .unwrap()
        .0
    }

    fn compositions(total: usize, parts: usize) -> Vec<Vec<usize>> {
        if parts == 1 {
            return vec![vec![total]];
        }
        let mut out = Vec::new();
        for first in 1..=total.saturating_sub(parts - 1) {
            for mut rest in compositions(total - first, parts - 1) {
                rest.insert(0, first);
                out.push(rest);
            }
        }
        out
    }

    proptest! {
        /// The DP layer split equals brute force over all contiguous splits (L ≤ 12, p ≤ 4),
        /// memory limits included.
        #[test]
        fn layer_split_matches_brute_force(
            l in 1usize..=12,
            per_layer in proptest::collection::vec(0.1f64..5.0, 1..=4),
            extra in proptest::collection::vec(0.0f64..3.0, 4),
            cap in proptest::collection::vec(1usize..=12, 4),
        ) {
            let p = per_layer.len();
            let closures: Vec<Box<dyn Fn(usize) -> Option<f64>>> = (0..p)
                .map(|i| {
                    let (a, e, c) = (per_layer[i], extra[i], cap[i]);
                    let f: Box<dyn Fn(usize) -> Option<f64>> =
                        Box::new(move |k: usize| (k <= c).then_some(k as f64 * a + e));
                    f
                })
                .collect();
            let refs: Vec<&dyn Fn(usize) -> Option<f64>> = closures.iter().map(|f| f.as_ref()).collect();
            let got = min_max_layers(l, &refs);
            let brute = if l >= p {
                compositions(l, p)
                    .into_iter()
                    .filter_map(|split| {
                        let costs: Option<Vec<f64>> = split.iter().enumerate().map(|(i, &k)| refs[i](k)).collect();
                        costs.map(|c| c.into_iter().fold(0.0, f64::max))
                    })
                    .min_by(|a, b| a.total_cmp(b))
            } else {
                None
            };
            match (got, brute) {
                (None, None) => {}
                (Some(split), Some(best)) => {
                    prop_assert_eq!(split.iter().sum::<usize>(), l);
                    let v = split.iter().enumerate().map(|(i, &k)| refs[i](k).unwrap()).fold(0.0, f64::max);
                    prop_assert!((v - best).abs() < 1e-9, "{:?} gives {} but brute force {}", split, v, best);
                }
                (g, b) => prop_assert!(false, "dp {:?} vs brute {:?}", g, b),
            }
        }

        /// Every plan satisfies every constraint (layers, batch, memory, a valid
        /// ParallelPlan), and the best is never predicted slower than the even layout.
        #[test]
        fn plans_satisfy_constraints_and_beat_uniform(
            groups in proptest::collection::vec((10.0f64..400.0, 4.0f64..80.0, 1usize..=4), 1..=3),
            layers in 2usize..=12,
            hidden in prop_oneof![Just(256usize), Just(1024), Just(4096)],
            vocab in 1000usize..50_000,
            g in 1usize..=32,
        ) {
            use crate::cluster::ClusterSpec;
            use crate::cost::ModelShape;
            let mut toml = String::new();
            for (i, (tflops, mem, count)) in groups.iter().enumerate() {
                toml.push_str(&format!(
                    "[[group]]\nkind = \"custom\"\ncount = {count}\nnode = \"n{i}\"\ntflops_bf16 = {tflops}\nmemory_gb = {mem}\nmem_bw_gbs = 1000\n"
                ));
            }
            toml.push_str("[network]\nintra_node_gbs = 100\ninter_node_gbs = 10\n");
            let cluster = ClusterSpec::from_toml(&toml).unwrap();
            let model = ModelShape {
                num_layers: layers,
                hidden_size: hidden,
                num_heads: 8,
                num_kv_heads: 8,
                ffn_hidden_size: hidden * 3,
                vocab_size: vocab,
                seq_length: 512,
                tied: false,
            };
            let cost = CostModel::new(model, cluster, None);
            let request = PlanRequest { global_batch_size: g, micro_batch_sizes: vec![1, 2, 4], top_k: 3, tensor_parallel_sizes: vec![1], recompute: Choice::Auto, distributed_optimizer: Choice::Auto };
            let n = cost.cluster.devices().len();
            match plan(&cost, &request) {
                Err(PlanningError::Infeasible(
                    Infeasibility::OutOfMemory(_)
                    | Infeasibility::BatchTooSmall { .. }
                    | Infeasibility::NoLayerSplit { .. },
                )) => {}
                Err(e) => prop_assert!(false, "{}", e),
                Ok(outcome) => {
                    let devices = cost.cluster.devices();
                    for c in &outcome.plans {
                        let (p, d) = (c.layers.len(), c.micro_batches.len());
                        prop_assert_eq!(p * d, n);
                        prop_assert_eq!(c.layers.iter().sum::<usize>(), layers);
                        prop_assert!(c.layers.iter().all(|&l| l >= 1));
                        let samples: usize = c.micro_batch_sizes.iter().zip(&c.micro_batches).map(|(b, m)| b * m).sum();
                        prop_assert_eq!(samples, g);
                        prop_assert!(c.micro_batches.iter().all(|&m| m >= 1));
                        // Each rank holds its stage with the plan's options (its share
                        // of the optimizer in proportion to memory when sharded).
                        let priced = c.options.cost(&cost);
                        for i in 0..p {
                            let stage_memory: f64 = c.devices[i].iter().map(|&x| cost.usable_memory(&devices[x]).unwrap()).sum();
                            for r in 0..d {
                                let dev = &devices[c.devices[i][r]];
                                let b = c.micro_batch_sizes[r];
                                let k = priced.stage_costs(dev, b).unwrap();
                                let holding = StageHolding {
                                    layers: c.layers[i],
                                    first: i == 0,
                                    last: i + 1 == p,
                                    in_flight: (p - i).min(c.micro_batches[r]),
                                    micro_batch_size: b,
                                    optimizer_share: cost.usable_memory(dev).unwrap() / stage_memory,
                                    recompute: c.recompute[i][r],
                                };
                                let need = priced.memory_bytes(&k, &holding);
                                prop_assert!(need <= cost.usable_memory(dev).unwrap() + 1.0);
                            }
                        }
                        prop_assert!(to_parallel_plan(&cost, c).is_ok());
                        // No plan beats every device working alone.
                        let fraction = outcome.bound.fraction((g * 512) as f64, c.prediction.step_time_s);
                        prop_assert!(fraction > 0.0 && fraction <= 1.0 + 1e-9, "{}", fraction);
                        // The drawn step is the predicted one, each rank's passes its busy time.
                        let drawn = timeline(&cost, c).unwrap();
                        prop_assert_eq!(drawn.ranks.len(), n);
                        prop_assert!((drawn.step_s() - c.prediction.step_time_s).abs() < 1e-9 * c.prediction.step_time_s);
                        let passes: f64 = drawn.ranks.iter().map(|r| r.seconds(SpanKind::Forward) + r.seconds(SpanKind::Backward)).sum();
                        let busy: f64 = c.prediction.busy_s.iter().flatten().sum();
                        prop_assert!((passes - busy).abs() < 1e-6 * busy);
                    }
                    // No grid fits only where per-replica pipelines do, and then they are written.
                    let Some(first) = outcome.plans.first() else {
                        prop_assert!(outcome.pooled.is_some() && outcome.pooled_wins().is_some());
                        prop_assert!(outcome.uniform.is_none());
                        return Ok(());
                    };
                    let best = &first.prediction;
                    for c in &outcome.plans[1..] {
                        let behind = BehindBy::of(&c.prediction, best);
                        prop_assert!(behind.extra_s() >= -1e-12, "{:?}", behind);
                    }
                    if let Some(u) = &outcome.uniform {
                        prop_assert!(best.step_time_s <= u.prediction.step_time_s * (1.0 + 1e-12));
                    }
                    // Every even layout: even layers and batches, distinct, fastest first.
                    prop_assert_eq!(outcome.uniform.as_ref(), outcome.uniform_layouts.first());
                    for (k, u) in outcome.uniform_layouts.iter().enumerate() {
                        prop_assert!(u.layers.iter().all(|&l| l == u.layers[0]));
                        prop_assert!(u.micro_batches.iter().all(|&m| m == u.micro_batches[0]));
                        prop_assert!(u.micro_batch_sizes.iter().all(|&b| b == u.micro_batch_sizes[0]));
                        if let Some(next) = outcome.uniform_layouts.get(k + 1) {
                            prop_assert!(u.prediction.step_time_s <= next.prediction.step_time_s);
                            prop_assert!(u.devices != next.devices || u.micro_batch_sizes != next.micro_batch_sizes || u.layers != next.layers);
                        }
                    }
                }
            }
        }

        /// The bound is each device alone: the batch through the whole model at its
        /// fastest pace per sample, plus its optimizer step, added over devices.
        #[test]
        fn bound_adds_each_device_alone(
            tflops in proptest::collection::vec(10.0f64..400.0, 1..=3),
            g in 1usize..=16,
        ) {
            use crate::cluster::ClusterSpec;
            use crate::cost::ModelShape;
            let mut toml = String::new();
            for t in &tflops {
                toml.push_str(&format!("[[group]]\nkind = \"custom\"\ncount = 2\ntflops_bf16 = {t}\nmemory_gb = 80\nmem_bw_gbs = 1000\n"));
            }
            toml.push_str("[network]\nintra_node_gbs = 100\ninter_node_gbs = 10\n");
            let cluster = ClusterSpec::from_toml(&toml).unwrap();
            let model = ModelShape {
                num_layers: 4, hidden_size: 256, num_heads: 8, num_kv_heads: 8,
                ffn_hidden_size: 768, vocab_size: 1000, seq_length: 128, tied: false,
            };
            let cost = CostModel::new(model.clone(), cluster, None);
            let request = PlanRequest { global_batch_size: g, micro_batch_sizes: vec![1, 2, 4], top_k: 1, tensor_parallel_sizes: vec![1], recompute: Choice::Off, distributed_optimizer: Choice::Off };
            let mut ctx = Ctx::new(&cost);
            let bound = throughput_bound(&mut ctx, &request).unwrap();
            let params = model.stage_params(4, true, true);
            for (dev, &rate) in cost.cluster.devices().iter().zip(&bound.device_tokens_per_s) {
                let step = [1usize, 2, 4].into_iter().map(|b| {
                    let k = cost.stage_costs(dev, b).unwrap();
                    g as f64 / b as f64 * (4.0 * k.layer_s + k.embedding_s + k.head_s)
                }).fold(f64::INFINITY, f64::min) + cost.optimizer_seconds(dev, params).unwrap();
                prop_assert!((rate - (g * 128) as f64 / step).abs() < 1e-9 * rate);
            }
            let sum: f64 = bound.device_tokens_per_s.iter().sum();
            prop_assert!((bound.tokens_per_s - sum).abs() < 1e-9 * sum);
            prop_assert_eq!(bound.device_tokens_per_s.len(), 2 * tflops.len());
        }

        /// With one layer (one stage), the best plan equals brute force over every
        /// micro-batch size and count per replica (memory included): sizes may differ.
        #[test]
        fn per_replica_sizes_match_brute_force(
            devices in proptest::collection::vec((10.0f64..400.0, 1.0f64..3.0), 1..=3),
            g in 1usize..=12,
        ) {
            use crate::cluster::ClusterSpec;
            use crate::cost::ModelShape;
            let mut toml = String::new();
            for (tflops, mem) in &devices {
                toml.push_str(&format!(
                    "[[group]]\nkind = \"custom\"\ncount = 1\nnode = \"n\"\ntflops_bf16 = {tflops}\nmemory_gb = {mem}\nmem_bw_gbs = 1000\n"
                ));
            }
            toml.push_str("[network]\nintra_node_gbs = 100\ninter_node_gbs = 10\n");
            let cluster = ClusterSpec::from_toml(&toml).unwrap();
            let model = ModelShape {
                num_layers: 1, hidden_size: 1024, num_heads: 8, num_kv_heads: 8,
                ffn_hidden_size: 3072, vocab_size: 32_000, seq_length: 1024, tied: false,
            };
            let cost = CostModel::new(model, cluster, None);
            let sizes = [1usize, 2, 4];
            let request = PlanRequest { global_batch_size: g, micro_batch_sizes: sizes.to_vec(), top_k: 1, tensor_parallel_sizes: vec![1], recompute: Choice::Off, distributed_optimizer: Choice::Off };
            let devs = cost.cluster.devices();
            let d = devs.len();
            let params = cost.model.stage_params(1, true, true);
            let all: Vec<&Device> = devs.iter().collect();
            let after = cost.allreduce_seconds(&all, params * 4.0)
                + devs.iter().map(|x| cost.optimizer_seconds(x, params).unwrap()).fold(0.0, f64::max);
            // Every (size, count) per replica whose samples add up to g.
            let mut brute: Option<f64> = None;
            let choices: Vec<(usize, usize)> = sizes.iter().flat_map(|&b| (1..=g / b).map(move |m| (b, m))).collect();
            let mut pick = vec![0usize; d];
            'all: loop {
                let chosen: Vec<(usize, usize)> = pick.iter().map(|&k| choices[k]).collect();
                if chosen.iter().map(|(b, m)| b * m).sum::<usize>() == g {
                    let mut worst = 0.0f64;
                    let mut fits = true;
                    for (dev, &(b, m)) in devs.iter().zip(&chosen) {
                        let k = cost.stage_costs(dev, b).unwrap();
                        let need = cost.memory_bytes(&k, &StageHolding { layers: 1, first: true, last: true, in_flight: 1, micro_batch_size: b, optimizer_share: 1.0, recompute: false });
                        fits &= need <= cost.usable_memory(dev).unwrap();
                        worst = worst.max(m as f64 * (k.layer_s + k.embedding_s + k.head_s));
                    }
                    if fits {
                        brute = Some(brute.map_or(worst + after, |x: f64| x.min(worst + after)));
                    }
                }
                for slot in pick.iter_mut() {
                    *slot += 1;
                    if *slot < choices.len() {
                        continue 'all;
                    }
                    *slot = 0;
                }
                break;
            }
            match (plan(&cost, &request), brute) {
                (Ok(outcome), Some(best)) => {
                    let got = outcome.plans[0].prediction.step_time_s;
                    prop_assert!((got - best).abs() < 1e-9 * best, "{:?}: {} vs brute force {}", outcome.plans[0].micro_batch_sizes, got, best);
                }
                (Err(PlanningError::Infeasible(_)), None) => {}
                (got, brute) => prop_assert!(false, "{:?} vs brute force {:?}", got.map(|o| o.plans[0].clone()), brute),
            }
        }

        /// The greedy replica split equals brute force on small cases.
        #[test]
        fn replica_split_matches_brute_force(
            fixed in proptest::collection::vec(0.0f64..5.0, 1..=3),
            per_mb in proptest::collection::vec(0.1f64..4.0, 3),
            extra in 0usize..6,
        ) {
            let d = fixed.len();
            let total = d + extra;
            let time = |r: usize, m: usize| fixed[r] + (m - 1) as f64 * per_mb[r];
            let split = min_max_split(total, time, d);
            prop_assert_eq!(split.iter().sum::<usize>(), total);
            prop_assert!(split.iter().all(|&m| m >= 1));
            let got = (0..d).map(|r| time(r, split[r])).fold(0.0, f64::max);
            let brute = compositions(total, d)
                .into_iter()
                .map(|c| (0..d).map(|r| time(r, c[r])).fold(0.0, f64::max))
                .fold(f64::INFINITY, f64::min);
            prop_assert!((got - brute).abs() < 1e-9, "{:?}: {} vs {}", split, got, brute);
        }
    }
}
