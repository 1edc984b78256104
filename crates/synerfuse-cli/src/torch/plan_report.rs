//! What `synerfuse plan` reports: the best grid plan, its runners-up and even layouts,
//! and per-replica pipelines, as a table or as one JSON object (typed: each report a
//! struct serialised with serde).

use std::collections::BTreeMap;
use synerfuse_plan::GridFlags;
use synerfuse_planner::cost::CostModel;
use synerfuse_planner::planner::{self, BehindBy, Candidate, PooledCandidate, TpGroup};

pub(crate) fn describe_devices(cost: &CostModel, c: &Candidate, stage: usize) -> String {
    let devices = cost.cluster.devices();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for d in c.devices[stage].iter().flat_map(|&u| c.unit_devices(u)) {
        let dev = &devices[d];
        let name = if dev.speed < 1.0 {
            format!("{}@{}", dev.kind, dev.speed)
        } else {
            dev.kind.clone()
        };
        *counts.entry(name).or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, n)| format!("{n}x{k}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// "pp 4 x dp 8 (tp 2)", "pp 1 x dp 2 (cp 2, shares [2, 1])": a grid plan's sizes.
pub(crate) fn grid_text(c: &Candidate) -> String {
    let unit = match c.context_parallel_size() {
        1 => format!("tp {}", c.tensor_parallel_size()),
        cp => match c.groups.first().map(|g| &g.shares) {
            Some(shares) if shares.iter().any(|&s| s != shares[0]) => {
                format!("cp {cp}, shares {shares:?}")
            }
            _ => format!("cp {cp}"),
        },
    };
    let sizes = c.expert_parallel_sizes();
    let experts = if sizes.iter().all(|&ep| ep == 1) {
        String::new()
    } else if sizes.iter().all(|&ep| ep == sizes[0]) {
        format!(", ep {}", sizes[0])
    } else {
        format!(", ep by stage {sizes:?}")
    };
    format!(
        "pp {} x dp {} ({unit}{experts})",
        c.layers.len(),
        c.micro_batches.len()
    )
}

/// What `synerfuse plan` found, with what it needs to print it.
pub(crate) struct PlanReport<'a> {
    pub(crate) cost: &'a CostModel,
    pub(crate) outcome: &'a planner::PlanOutcome,
    /// The best grid plan's flags (none where its stages divide the experts over
    /// groups of their own sizes, which Megatron's one flag cannot say).
    pub(crate) flags: Option<GridFlags>,
    pub(crate) tokens_per_step: f64,
    pub(crate) planning_s: f64,
    /// Whether `--try` decides the plan written.
    pub(crate) tried: bool,
    /// Under expert parallelism, the best grid plan's experts per stage and replica.
    pub(crate) experts: Option<Vec<Vec<Vec<usize>>>>,
}

impl PlanReport<'_> {
    pub(crate) fn best(&self) -> &Candidate {
        &self.outcome.plans[0]
    }

    /// `--json`: one object.
    pub(crate) fn json(&self) -> GridReport<'_> {
        let best = self.best();
        let p = &best.prediction;
        let uniform = |u: &Candidate| UniformLayoutReport {
            pipeline_parallel_size: u.layers.len(),
            data_parallel_size: u.micro_batches.len(),
            tensor_parallel_size: u.tensor_parallel_size(),
            micro_batch_size: u.micro_batch_sizes[0],
            num_micro_batches: u.micro_batches[0],
            arrangement: format!("{:?}", u.arrangement),
            predicted_step_time_s: u.prediction.step_time_s,
            train_flags: u.options.train_flags(),
        };
        GridReport {
            pipeline_parallel_size: best.layers.len(),
            data_parallel_size: best.micro_batches.len(),
            tensor_parallel_size: best.tensor_parallel_size(),
            context_parallel_size: best.context_parallel_size(),
            expert_parallel_size: best.options.expert_parallel,
            expert_parallel_size_per_stage: best.expert_parallel_sizes(),
            experts_per_stage_and_replica: self.experts.as_deref(),
            layers_per_stage: &best.layers,
            micro_batch_size_per_replica: &best.micro_batch_sizes,
            num_micro_batches_per_replica: &best.micro_batches,
            predicted_step_time_s: p.step_time_s,
            predicted_tokens_per_s: self.tokens_per_step / p.step_time_s,
            param_gather_wait_s: p.param_gather_s,
            bubble_fraction: p.bubble_fraction,
            peak_memory_gb_per_stage: p.stage_memory_bytes.iter().map(|b| b / 1e9).collect(),
            uniform_step_time_s: (self.outcome.uniform.as_ref()).map(|u| u.prediction.step_time_s),
            uniform_layouts: self.outcome.uniform_layouts.iter().map(uniform).collect(),
            synerfuse_flags: self.synerfuse_flags(),
            train_flags: best.options.train_flags(),
            recompute_per_stage_and_replica: &best.recompute,
            use_distributed_optimizer: best.options.distributed_optimizer,
            rank_order: self.flags.as_ref().map(|f| f.rank_order.as_str()),
            candidates_considered: self.outcome.considered,
            folded: self.outcome.folded,
            planning_time_s: self.planning_s,
            bound_tokens_per_s: self.outcome.bound.tokens_per_s,
            device_alone_tokens_per_s: &self.outcome.bound.device_tokens_per_s,
            fraction_of_bound: self.fraction_of_bound(best),
            optimizer_unpriced_kinds: &self.outcome.unpriced_optimizer,
            runner_ups: (self.outcome.plans[1..].iter())
                .map(|c| self.runner_up_json(c))
                .collect(),
            per_replica_pipelines: self.outcome.pooled.as_ref().map(|p| self.pooled_json(p)),
            expert_layout: ExpertReport::new(self.outcome, self.tokens_per_step),
            integer_split_tokens_per_s: self.outcome.bound.integer_split_tokens_per_s,
            written_plan: match self.outcome.pooled_wins() {
                Some(p) => WrittenPlan::pooled(self.outcome, p, self.tokens_per_step),
                None => WrittenPlan::new(
                    "grid",
                    &self.outcome.bound,
                    (self.tokens_per_step, p.step_time_s),
                    best.options.train_flags(),
                ),
            },
        }
    }

    /// SynerFuse's flags for the best grid plan, with its options (its flags recompute
    /// every stage or none: `--recompute-activations` when any stage recomputes).
    fn synerfuse_flags(&self) -> Option<String> {
        let best = self.best();
        let mut flags = self.flags.as_ref()?.args.clone();
        if best.recompute.iter().flatten().any(|&x| x) {
            flags.push("--recompute-activations".into());
        }
        flags.extend(best.options.train_flags());
        Some(flags.join(" "))
    }

    /// The `synerfuse train` flags beside `--plan` of the plan written.
    pub(crate) fn written_flags(&self) -> Vec<String> {
        match self.outcome.pooled_wins() {
            Some(p) => pooled_train_flags(p),
            None => self.best().options.train_flags(),
        }
    }

    fn pooled_json(&self, p: &PooledCandidate) -> PooledReport {
        let parts = (pool_reports(self.cost, p), pooled_replicas(self.cost, p));
        pooled_json(self.outcome, p, parts, self.tokens_per_step)
    }

    fn fraction_of_bound(&self, c: &Candidate) -> f64 {
        (self.outcome.bound).fraction(self.tokens_per_step, c.prediction.step_time_s)
    }

    fn runner_up_json(&self, c: &Candidate) -> RunnerUpReport {
        let behind = BehindBy::of(&c.prediction, &self.best().prediction);
        let (part, extra_s) = match behind {
            BehindBy::Compute { extra_s } => ("compute", extra_s),
            BehindBy::Waiting { extra_s } => ("waiting", extra_s),
            BehindBy::AfterPipeline { extra_s } => ("after_pipeline", extra_s),
        };
        RunnerUpReport {
            pipeline_parallel_size: c.layers.len(),
            data_parallel_size: c.micro_batches.len(),
            tensor_parallel_size: c.tensor_parallel_size(),
            layers_per_stage: c.layers.clone(),
            micro_batch_size_per_replica: c.micro_batch_sizes.clone(),
            num_micro_batches_per_replica: c.micro_batches.clone(),
            origin: c.origin.to_string(),
            predicted_step_time_s: c.prediction.step_time_s,
            fraction_of_bound: self.fraction_of_bound(c),
            behind_by: BehindByReport {
                part,
                extra_s,
                reason: behind.to_string(),
            },
        }
    }

    /// The human-readable report: the best plan's stages, its prediction against the
    /// even layout, its flags, and the runners-up.
    pub(crate) fn print(&self) {
        let best = self.best();
        let p = &best.prediction;
        println!(
            "best plan: {}, {}{}, {} candidates in {:.3}s",
            grid_text(best),
            best.micro_batch_size_text(),
            options_text(best.options),
            self.outcome.considered,
            self.planning_s
        );
        print_fold(self.outcome);
        println!(
            "| stage | devices | layers | time/micro-batch (ms) | memory (GB) |\n|---|---|---|---|---|"
        );
        for i in 0..best.layers.len() {
            println!(
                "| {i} | {} | {} | {:.2} | {:.2} |",
                describe_devices(self.cost, best, i),
                best.layers[i],
                p.stage_time_s[i] * 1e3,
                p.stage_memory_bytes[i] / 1e9
            );
        }
        println!(
            "replicas: micro-batches {} of size {}",
            runs(&best.micro_batches),
            runs(&best.micro_batch_sizes)
        );
        if let Some(stages) = &self.experts {
            let stages: Vec<String> = (stages.iter())
                .map(|row| {
                    row.iter()
                        .map(|x| compact_experts(x))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect();
            println!(
                "experts per stage, per replica (by pace, memory and tokens per expert; in the plan file): {}",
                stages.join(" | ")
            );
        }
        if best.recompute.iter().flatten().any(|&x| x) {
            let stages: Vec<String> = best.recompute.iter().map(|row| runs(row)).collect();
            println!(
                "recomputes its activations (per stage, per replica; in the plan file): [{}]",
                stages.join(", ")
            );
        }
        println!(
            "predicted: {:.4} s per step ({:.0} tokens/s), bubble {:.1}%, DP all-reduce {:.4} s, optimizer {:.4} s{}",
            p.step_time_s,
            self.tokens_per_step / p.step_time_s,
            p.bubble_fraction * 100.0,
            p.allreduce_s,
            p.optimizer_s,
            gather_text(best.options, p.param_gather_s)
        );
        let bound = &self.outcome.bound;
        println!(
            "bound: {:.0} tokens/s (each device training the model alone, added up); devices taking whole samples alone reach at most {:.1}% of it (integer split); the plan reaches {:.1}% of the bound, {:.1}% of the integer split",
            bound.tokens_per_s,
            bound.integer_split_fraction() * 100.0,
            self.fraction_of_bound(best) * 100.0,
            bound.fraction_of_integer_split(self.tokens_per_step, p.step_time_s) * 100.0
        );
        if !self.outcome.unpriced_optimizer.is_empty() {
            println!(
                "the optimizer step is not priced on {} (profile them with synerfuse profile)",
                self.outcome.unpriced_optimizer.join(", ")
            );
        }
        if let Some(u) = &self.outcome.uniform {
            println!(
                "uniform layout (even layers and batches, {}): {:.4} s per step; the plan is {:.2}x faster",
                grid_text(u),
                u.prediction.step_time_s,
                u.prediction.step_time_s / p.step_time_s
            );
        }
        match self.synerfuse_flags() {
            Some(flags) => println!("flags: {flags}"),
            None => println!(
                "flags: none (its stages divide the experts over groups of their own sizes, which --expert-model-parallel-size cannot say): train it with --plan"
            ),
        }
        if let Some(pooled) = &self.outcome.pooled {
            self.print_pooled(pooled);
        }
        if let Some(expert) = ExpertReport::new(self.outcome, self.tokens_per_step) {
            expert.print();
        }
        for (k, c) in self.outcome.plans.iter().enumerate().skip(1) {
            self.print_runner_up(k, c);
        }
    }

    /// The per-replica-pipeline plan: each replica, its step against the grid plan's.
    pub(crate) fn print_pooled(&self, p: &PooledCandidate) {
        let grid = self.best().prediction.step_time_s;
        let verdict = match (self.outcome.pooled_wins(), self.tried) {
            (_, true) => "tried below, with the grid plans",
            (Some(_), false) => {
                "faster than the grid plan: written instead of it (no SynerFuse flags express it)"
            }
            (None, false) => "slower than the grid plan",
        };
        let ep = match p.options.expert_parallel {
            1 => String::new(),
            _ if !p.pool_expert_parallel.is_empty() => {
                "; each pool's experts divided over groups of its own size of alike replicas (ep)"
                    .to_owned()
            }
            ep => format!("; the experts divided over groups of {ep} alike replicas"),
        };
        println!(
            "per-replica pipelines (alike devices pooled{ep}): {:.4} s per step, {:.2}x the grid plan's speed, {:.1}% of the bound; {verdict}",
            p.step_time_s,
            grid / p.step_time_s,
            self.outcome.bound.fraction(self.tokens_per_step, p.step_time_s) * 100.0
        );
        print_pool_table(&pool_reports(self.cost, p));
        print_replicas(&pooled_replicas(self.cost, p));
    }

    fn print_runner_up(&self, k: usize, c: &Candidate) {
        let p = &c.prediction;
        let slowest = p
            .stage_time_s
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i);
        println!(
            "runner-up {k}: {}, layers {:?}, micro-batches {}, {}{}: {:.4} s (+{:.1}%, {:.1}% of the bound): {}; bubble {:.1}%, all-reduce {:.4} s, slowest stage {slowest} ({})",
            grid_text(c),
            c.layers,
            runs(&c.micro_batches),
            c.micro_batch_size_text(),
            options_text(c.options),
            p.step_time_s,
            (p.step_time_s / self.best().prediction.step_time_s - 1.0) * 100.0,
            self.fraction_of_bound(c) * 100.0,
            BehindBy::of(p, &self.best().prediction),
            p.bubble_fraction * 100.0,
            p.allreduce_s,
            describe_devices(self.cost, c, slowest)
        );
    }
}

/// Each replica of a per-replica-pipeline plan: its devices (a tensor-parallel group's
/// kinds joined by `+`), layers, shares and batch.
/// One replica of a per-replica-pipeline plan, as `synerfuse plan` reports it.
#[derive(serde::Serialize)]
pub(crate) struct ReplicaReport {
    /// Per stage, its devices' kinds (`a100+v100` for a tensor-parallel group, `8xh100-sxm`
    /// for one of a kind).
    devices: Vec<String>,
    /// Layers per stage.
    layers: Vec<usize>,
    /// Per stage, whether it recomputes its activations.
    recompute: Option<Vec<bool>>,
    /// Per stage, its tensor-parallel group's shares.
    tensor_parallel_shares: Vec<Vec<u32>>,
    /// Per stage, its context-parallel members' token shares (`[1]` without), where a
    /// stage splits sequences.
    #[serde(skip_serializing_if = "Option::is_none")]
    context_parallel_shares: Option<Vec<Vec<u32>>>,
    /// Its largest micro-batch.
    micro_batch_size: usize,
    num_micro_batches: usize,
    /// Samples per step (size × count, less what a short last micro-batch lacks).
    samples: usize,
    /// Each micro-batch's size, when they differ.
    #[serde(skip_serializing_if = "Option::is_none")]
    micro_batch_sizes: Option<Vec<usize>>,
    #[serde(skip)]
    batch: synerfuse_plan::ReplicaBatch,
}

impl ReplicaReport {
    /// `  replica 0: ["a100+v100"] layers [36] (tensor-parallel shares [[5,2]]) micro-batches 8 x 2`.
    fn print(&self, r: usize) {
        let recompute = match &self.recompute {
            Some(flags) if flags.iter().any(|&x| x) => format!(" (recomputes {})", compact(flags)),
            _ => String::new(),
        };
        let shares = match self.tensor_parallel_shares.iter().any(|g| g.len() > 1) {
            true => format!(
                " (tensor-parallel shares {})",
                compact(&self.tensor_parallel_shares)
            ),
            false => String::new(),
        };
        let context = match &self.context_parallel_shares {
            Some(shares) => format!(" (context-parallel shares {})", compact(shares)),
            None => String::new(),
        };
        let batches = match self.batch.is_uniform() {
            true => self.batch.to_string(),
            false => format!("{} ({} samples)", self.batch, self.samples),
        };
        println!(
            "  replica {r}: {} layers {}{shares}{context}{recompute} micro-batches {batches}",
            compact(&self.devices),
            compact(&self.layers),
        );
    }
}

/// `value` as compact JSON (`[4,2]`), as the report prints lists.
pub(crate) fn compact<T: serde::Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// Each replica of a per-replica-pipeline plan, pool by pool.
pub(crate) fn pooled_replicas(cost: &CostModel, p: &PooledCandidate) -> Vec<ReplicaReport> {
    let devices = cost.cluster.devices();
    let mut out = Vec::new();
    for pool in &p.pools {
        for r in 0..pool.micro_batches.len() {
            let batch = pool.batch(r);
            let groups: Vec<_> = pool.devices.iter().map(|row| &p.groups[row[r]]).collect();
            // `8xh100-sxm` for a group of one kind, `a100+v100` otherwise.
            let kind_of = |g: &&TpGroup| {
                let kinds: Vec<&str> = (g.members.iter())
                    .map(|&i| devices[i].kind.as_str())
                    .collect();
                match kinds.len() > 1 && kinds.iter().all(|k| *k == kinds[0]) {
                    true => format!("{}x{}", kinds.len(), kinds[0]),
                    false => kinds.join("+"),
                }
            };
            out.push(ReplicaReport {
                devices: groups.iter().map(kind_of).collect(),
                layers: pool.layers.clone(),
                recompute: p.recompute.get(out.len()).cloned(),
                tensor_parallel_shares: (groups.iter())
                    .map(|g| match g.cp {
                        1 => g.shares.clone(),
                        _ => vec![1; g.tp_size()],
                    })
                    .collect(),
                context_parallel_shares: (groups.iter().any(|g| g.cp > 1)).then(|| {
                    (groups.iter())
                        .map(|g| match g.cp {
                            1 => vec![1],
                            _ => g.shares.clone(),
                        })
                        .collect()
                }),
                micro_batch_size: batch.micro_batch_size(),
                num_micro_batches: batch.num_micro_batches(),
                samples: batch.samples(),
                micro_batch_sizes: (!batch.is_uniform()).then(|| batch.sizes().to_vec()),
                batch,
            });
        }
    }
    out
}

pub(crate) fn pooled_json(
    outcome: &planner::PlanOutcome,
    p: &PooledCandidate,
    (pools, replicas): (Vec<PoolReport>, Vec<ReplicaReport>),
    tokens_per_step: f64,
) -> PooledReport {
    PooledReport {
        pools,
        predicted_step_time_s: p.step_time_s,
        predicted_tokens_per_s: tokens_per_step / p.step_time_s,
        fraction_of_bound: outcome.bound.fraction(tokens_per_step, p.step_time_s),
        fraction_of_integer_split: (outcome.bound)
            .fraction_of_integer_split(tokens_per_step, p.step_time_s),
        tensor_parallel_size: p.groups.iter().map(|g| g.tp_size()).max().unwrap_or(1),
        train_flags: pooled_train_flags(p),
        reduce_s: p.reduce_s,
        optimizer_s: p.optimizer_s,
        param_gather_wait_s: p.param_gather_s,
        replicas,
    }
}

/// The per-replica-pipeline plan's step and replicas.
pub(crate) fn print_pooled_replicas(
    outcome: &planner::PlanOutcome,
    p: &PooledCandidate,
    (pools, replicas): (&[PoolReport], &[ReplicaReport]),
    tokens_per_step: f64,
) {
    println!(
        "per-replica pipelines: {:.4} s per step ({:.0} tokens/s), {:.1}% of the bound ({:.0} tokens/s: each device training the model alone, added up)",
        p.step_time_s,
        tokens_per_step / p.step_time_s,
        outcome.bound.fraction(tokens_per_step, p.step_time_s) * 100.0,
        outcome.bound.tokens_per_s
    );
    print_pool_table(pools);
    print_replicas(replicas);
}

/// `[0-5]` for a run of consecutive experts, else `[0,2,7]`.
fn compact_experts(experts: &[usize]) -> String {
    let run = experts.windows(2).all(|w| w[1] == w[0] + 1);
    match (experts.first(), experts.last()) {
        (Some(a), Some(b)) if run && b > a => format!("[{a}-{b}]"),
        _ => format!("{experts:?}").replace(' ', ""),
    }
}

/// `, --use-distributed-optimizer, --ddp-bucket-size 5000` and the like (each flag
/// with its value), or nothing.
pub(crate) fn options_text(options: planner::TrainOptions) -> String {
    (options.train_flags().iter())
        .map(|f| match f.starts_with("--") {
            true => format!(", {f}"),
            false => format!(" {f}"),
        })
        .collect()
}

/// `, parameter gather 0.0123 s (after the optimizer)` where the plan shards its
/// optimizer; nothing otherwise.
fn gather_text(options: planner::TrainOptions, seconds: f64) -> String {
    if !options.distributed_optimizer {
        return String::new();
    }
    let when = match options.overlaps_param_gather() {
        true => "not hidden by the next forward",
        false => "after the optimizer",
    };
    format!(", parameter gather {seconds:.4} s ({when})")
}

/// The `synerfuse train` flags a per-replica-pipeline plan was priced with: its
/// options, and sequence parallelism with tensor-parallel groups.
pub(crate) fn pooled_train_flags(p: &PooledCandidate) -> Vec<String> {
    let mut flags = p.options.train_flags();
    if p.groups.iter().any(|g| g.tp_size() > 1) {
        flags.push("--sequence-parallel".to_owned());
    }
    flags
}

/// `synerfuse plan --json` when a grid plan fits: the best one, and the rest.
#[derive(serde::Serialize)]
pub(crate) struct GridReport<'a> {
    pipeline_parallel_size: usize,
    data_parallel_size: usize,
    tensor_parallel_size: usize,
    context_parallel_size: usize,
    /// The largest of `expert_parallel_size_per_stage`.
    expert_parallel_size: usize,
    /// Each stage's expert-parallel size (1: each replica holds every expert).
    expert_parallel_size_per_stage: Vec<usize>,
    /// Under expert parallelism, the experts each replica holds of each stage (the plan
    /// file's `experts`).
    #[serde(skip_serializing_if = "Option::is_none")]
    experts_per_stage_and_replica: Option<&'a [Vec<Vec<usize>>]>,
    layers_per_stage: &'a [usize],
    micro_batch_size_per_replica: &'a [usize],
    num_micro_batches_per_replica: &'a [usize],
    predicted_step_time_s: f64,
    predicted_tokens_per_s: f64,
    /// What the step waits for the distributed optimizer's parameter gathers.
    param_gather_wait_s: f64,
    bubble_fraction: f64,
    peak_memory_gb_per_stage: Vec<f64>,
    uniform_step_time_s: Option<f64>,
    uniform_layouts: Vec<UniformLayoutReport>,
    /// `null` where no flags say the plan (stages of their own expert-parallel sizes).
    synerfuse_flags: Option<String>,
    train_flags: Vec<String>,
    recompute_per_stage_and_replica: &'a [Vec<bool>],
    use_distributed_optimizer: bool,
    rank_order: Option<&'a str>,
    candidates_considered: usize,
    /// Copies of a smaller cluster the search ran on (1: searched whole).
    folded: usize,
    planning_time_s: f64,
    bound_tokens_per_s: f64,
    device_alone_tokens_per_s: &'a [f64],
    fraction_of_bound: f64,
    /// The integer-split ceiling (see `ThroughputBound`), tokens/s.
    integer_split_tokens_per_s: f64,
    optimizer_unpriced_kinds: &'a [String],
    runner_ups: Vec<RunnerUpReport>,
    per_replica_pipelines: Option<PooledReport>,
    expert_layout: Option<ExpertReport>,
    written_plan: WrittenPlan,
}

impl GridReport<'_> {
    /// The report with `written` as the plan `--output` holds (`--try`'s measured best).
    pub(crate) fn written(self, written: WrittenPlan) -> Self {
        GridReport {
            written_plan: written,
            ..self
        }
    }
}

/// An even layout (every stage the same layers, every replica the same batch).
#[derive(serde::Serialize)]
struct UniformLayoutReport {
    pipeline_parallel_size: usize,
    data_parallel_size: usize,
    tensor_parallel_size: usize,
    micro_batch_size: usize,
    num_micro_batches: usize,
    arrangement: String,
    predicted_step_time_s: f64,
    train_flags: Vec<String>,
}

/// A grid plan behind the best, and where it loses.
#[derive(serde::Serialize)]
struct RunnerUpReport {
    pipeline_parallel_size: usize,
    data_parallel_size: usize,
    tensor_parallel_size: usize,
    layers_per_stage: Vec<usize>,
    micro_batch_size_per_replica: Vec<usize>,
    num_micro_batches_per_replica: Vec<usize>,
    origin: String,
    predicted_step_time_s: f64,
    fraction_of_bound: f64,
    behind_by: BehindByReport,
}

/// Which part of the step a runner-up loses in (`compute`, `waiting`,
/// `after_pipeline`), by how much, and why.
#[derive(serde::Serialize)]
struct BehindByReport {
    part: &'static str,
    extra_s: f64,
    reason: String,
}

/// The per-replica-pipeline plan: its step and its replicas.
#[derive(serde::Serialize)]
pub(crate) struct PooledReport {
    predicted_step_time_s: f64,
    predicted_tokens_per_s: f64,
    fraction_of_bound: f64,
    fraction_of_integer_split: f64,
    tensor_parallel_size: usize,
    train_flags: Vec<String>,
    reduce_s: f64,
    optimizer_s: f64,
    param_gather_wait_s: f64,
    pools: Vec<PoolReport>,
    replicas: Vec<ReplicaReport>,
}

/// One pool of a per-replica-pipeline plan: alike devices cut into replicas of one
/// shape.
#[derive(serde::Serialize)]
pub(crate) struct PoolReport {
    /// Its devices by kind (`32xh100-sxm`).
    devices: String,
    tensor_parallel_size: usize,
    pipeline_parallel_size: usize,
    /// Replicas (its data-parallel size).
    replicas: usize,
    /// Consecutive replicas each MoE layer's experts are divided over (1: each holds
    /// every expert).
    expert_parallel_size: usize,
    layers_per_stage: Vec<usize>,
    micro_batch_size: usize,
    /// The fewest and the most micro-batches of its replicas.
    micro_batches: [usize; 2],
    /// Samples of all its replicas per step.
    samples: usize,
    /// Whether any of its stages recomputes its activations.
    recomputes: bool,
}

/// Each pool of `p` (replicas of the same shape).
pub(crate) fn pool_reports(cost: &CostModel, p: &PooledCandidate) -> Vec<PoolReport> {
    let devices = cost.cluster.devices();
    let mut first_replica = 0;
    let mut out = Vec::with_capacity(p.pools.len());
    for (k, pool) in p.pools.iter().enumerate() {
        let d = pool.micro_batches.len();
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        let units = pool.devices.iter().flatten();
        for &member in units.clone().flat_map(|&u| p.groups[u].members.iter()) {
            *kinds.entry(devices[member].kind.as_str()).or_default() += 1;
        }
        let tp = units.map(|&u| p.groups[u].size()).max().unwrap_or(1);
        let recompute = &p.recompute[first_replica.min(p.recompute.len())..];
        out.push(PoolReport {
            devices: (kinds.iter())
                .map(|(k, n)| format!("{n}x{k}"))
                .collect::<Vec<_>>()
                .join(" "),
            tensor_parallel_size: tp,
            pipeline_parallel_size: pool.layers.len(),
            replicas: d,
            expert_parallel_size: p.expert_parallel_of(k),
            layers_per_stage: pool.layers.clone(),
            micro_batch_size: pool.micro_batch_size,
            micro_batches: [
                pool.micro_batches.iter().copied().min().unwrap_or(0),
                pool.micro_batches.iter().copied().max().unwrap_or(0),
            ],
            samples: (0..d).map(|r| pool.samples(r)).sum(),
            recomputes: recompute.iter().take(d).flatten().any(|&x| x),
        });
        first_replica += d;
    }
    out
}

/// The pools as a table: `| devices | tp | pp | dp | layers per stage | ... |`.
pub(crate) fn print_pool_table(pools: &[PoolReport]) {
    println!("| devices | tp | pp | dp | ep | layers per stage | micro-batch size | micro-batches per replica | samples | recomputes |\n|---|---|---|---|---|---|---|---|---|---|");
    for pool in pools {
        let [least, most] = pool.micro_batches;
        let counts = match least == most {
            true => least.to_string(),
            false => format!("{least}-{most}"),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {counts} | {} | {} |",
            pool.devices,
            pool.tensor_parallel_size,
            pool.pipeline_parallel_size,
            pool.replicas,
            pool.expert_parallel_size,
            compact(&pool.layers_per_stage),
            pool.micro_batch_size,
            pool.samples,
            if pool.recomputes { "yes" } else { "no" }
        );
    }
}

/// The most replicas listed one by one in the text report (the JSON lists all).
const LISTED_REPLICAS: usize = 16;

/// Each replica, when few enough to list.
fn print_replicas(replicas: &[ReplicaReport]) {
    if replicas.len() > LISTED_REPLICAS {
        println!(
            "  ({} replicas: each listed with --json, each placed in the plan file)",
            replicas.len()
        );
        return;
    }
    for (r, replica) in replicas.iter().enumerate() {
        replica.print(r);
    }
}

/// The best layout an expert would write by hand, priced by the same model.
#[derive(serde::Serialize)]
pub(crate) struct ExpertReport {
    tensor_parallel_size: usize,
    /// Replicas each MoE layer's experts are divided over (groups of alike replicas).
    expert_parallel_size: usize,
    /// Whether each pool of alike devices has its own depth and batch share.
    per_pool: bool,
    pipeline_parallel_sizes: Vec<usize>,
    data_parallel_sizes: Vec<usize>,
    micro_batch_size: usize,
    predicted_step_time_s: f64,
    fraction_of_bound: f64,
    /// Whether it is the plan written (nothing the planner found beat it).
    written: bool,
}

impl ExpertReport {
    pub(crate) fn new(outcome: &planner::PlanOutcome, tokens_per_step: f64) -> Option<Self> {
        let e = outcome.expert.as_ref()?;
        let c = &e.candidate;
        Some(ExpertReport {
            tensor_parallel_size: e.tensor_parallel_size,
            expert_parallel_size: c.options.expert_parallel,
            per_pool: e.per_pool,
            pipeline_parallel_sizes: c.pools.iter().map(|p| p.layers.len()).collect(),
            data_parallel_sizes: c.pools.iter().map(|p| p.micro_batches.len()).collect(),
            micro_batch_size: c.pools.first().map_or(1, |p| p.micro_batch_size),
            predicted_step_time_s: c.step_time_s,
            fraction_of_bound: outcome.bound.fraction(tokens_per_step, c.step_time_s),
            written: outcome.pooled.as_ref() == Some(c) && outcome.pooled_wins().is_some(),
        })
    }

    /// `expert layout (tp 8 in every node, pp by memory [4, 8], one per pool): ...`.
    pub(crate) fn print(&self) {
        let verdict = match self.written {
            true => "nothing found beats it: written",
            false => "the plan written is at least as fast",
        };
        let ep = match self.expert_parallel_size {
            1 => String::new(),
            ep => format!(", ep {ep} within each pool"),
        };
        println!(
            "expert layout (tp {} in every node{ep}, fewest stages memory allows {}, even layers, {}): {:.4} s per step, {:.1}% of the bound; {verdict}",
            self.tensor_parallel_size,
            compact(&self.pipeline_parallel_sizes),
            match self.per_pool {
                true => "batch split by pace",
                false => "every replica the same batch",
            },
            self.predicted_step_time_s,
            self.fraction_of_bound * 100.0,
        );
    }
}

/// The plan `--output` holds: which kind, its predicted step, its acceleration ratios
/// (of the summed devices and of the integer-split ceiling), and the `synerfuse train`
/// flags it was priced with.
#[derive(serde::Serialize)]
pub(crate) struct WrittenPlan {
    kind: &'static str,
    predicted_step_time_s: f64,
    fraction_of_bound: f64,
    fraction_of_integer_split: f64,
    train_flags: Vec<String>,
}

impl WrittenPlan {
    /// A plan of `kind` whose step over `tokens` takes `step_time_s`.
    pub(crate) fn new(
        kind: &'static str,
        bound: &planner::ThroughputBound,
        (tokens, step_time_s): (f64, f64),
        train_flags: Vec<String>,
    ) -> Self {
        WrittenPlan {
            kind,
            predicted_step_time_s: step_time_s,
            fraction_of_bound: bound.fraction(tokens, step_time_s),
            fraction_of_integer_split: bound.fraction_of_integer_split(tokens, step_time_s),
            train_flags,
        }
    }

    /// Per-replica pipelines, written.
    pub(crate) fn pooled(outcome: &planner::PlanOutcome, p: &PooledCandidate, tokens: f64) -> Self {
        let bound = &outcome.bound;
        Self::new(
            "per_replica_pipelines",
            bound,
            (tokens, p.step_time_s),
            pooled_train_flags(p),
        )
    }
}

/// `synerfuse plan --json` when only per-replica pipelines fit.
#[derive(serde::Serialize)]
pub(crate) struct PooledOnlyReport {
    pub(crate) candidates_considered: usize,
    /// Copies of a smaller cluster the search ran on (1: searched whole).
    pub(crate) folded: usize,
    pub(crate) planning_time_s: f64,
    pub(crate) bound_tokens_per_s: f64,
    pub(crate) device_alone_tokens_per_s: Vec<f64>,
    pub(crate) integer_split_tokens_per_s: f64,
    pub(crate) per_replica_pipelines: PooledReport,
    pub(crate) expert_layout: Option<ExpertReport>,
    pub(crate) written_plan: WrittenPlan,
}

/// Values listed whole up to [`LISTED_REPLICAS`], else as runs of equal neighbours
/// ("[4 x3000, 5 x1096]"): a grid of thousands of replicas stays one readable line.
fn runs<T: std::fmt::Debug + PartialEq>(values: &[T]) -> String {
    if values.len() <= LISTED_REPLICAS {
        return format!("{values:?}");
    }
    let mut out: Vec<String> = Vec::new();
    let mut start = 0;
    for i in 1..=values.len() {
        if i == values.len() || values[i] != values[start] {
            out.push(match i - start {
                1 => format!("{:?}", values[start]),
                n => format!("{:?} x{n}", values[start]),
            });
            start = i;
        }
    }
    format!("[{}]", out.join(", "))
}

/// Where the search ran on one copy of a folded cluster, says so.
pub(crate) fn print_fold(outcome: &synerfuse_planner::planner::PlanOutcome) {
    if outcome.folded > 1 {
        let devices = outcome.bound.device_tokens_per_s.len();
        println!(
            "searched on one of {} alike copies of the cluster ({} devices each, the batch divided alike); the layouts chosen there laid out and priced on all {devices}",
            outcome.folded,
            devices / outcome.folded
        );
    }
}
