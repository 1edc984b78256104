//! Micro-batch size and count per data-parallel replica, and which samples of a global
//! batch each replica takes.
//!
//! Replica d takes the contiguous run of its samples (`mbs_d · nmb_d`, or the sum of its
//! micro-batch sizes when they differ) that follows those of replicas `0..d`, so every
//! sample of a global batch goes to exactly one replica and micro-batch, whatever the
//! sizes and counts (SynerFuse's sampler overlaps and skips
//! samples when a group has several replicas and several micro-batches).

use std::ops::Range;

/// One replica's share of a step: the sizes of its micro-batches, in the order it runs
/// them. Megatron's are all one size; a replica may also take any count of samples, its
/// last micro-batch short (`samples = 11` of at most 4: 4, 4, 3), or any sizes a plan
/// file lists, so a global batch splits over unequal replicas down to the sample.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "BatchForm", into = "BatchForm")]
pub struct ReplicaBatch {
    sizes: Vec<usize>,
}

impl ReplicaBatch {
    /// `num_micro_batches` micro-batches of `micro_batch_size` samples (Megatron's).
    pub fn uniform(micro_batch_size: usize, num_micro_batches: usize) -> Self {
        Self {
            sizes: vec![micro_batch_size; num_micro_batches],
        }
    }

    /// Micro-batches of the given sizes, in order.
    pub fn ragged(sizes: Vec<usize>) -> Self {
        Self { sizes }
    }

    /// `samples` in micro-batches of `largest`, the last one short when `largest` does
    /// not divide `samples` (11 of at most 4: 4, 4, 3).
    pub fn from_samples(samples: usize, largest: usize) -> Self {
        if largest == 0 {
            return Self::ragged(Vec::new());
        }
        let mut sizes = vec![largest; samples / largest];
        if samples % largest != 0 {
            sizes.push(samples % largest);
        }
        Self { sizes }
    }

    /// Samples this replica takes per step.
    pub fn samples(&self) -> usize {
        self.sizes.iter().sum()
    }

    /// Its largest micro-batch (what its activation memory is sized by).
    pub fn micro_batch_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    /// Micro-batches per step.
    pub fn num_micro_batches(&self) -> usize {
        self.sizes.len()
    }

    /// Each micro-batch's samples, in order.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Whether every micro-batch has the same size (what Megatron's flags express).
    pub fn is_uniform(&self) -> bool {
        self.sizes.windows(2).all(|w| w[0] == w[1])
    }

    /// Whether it is `samples` in micro-batches of its largest, the last one short.
    fn is_filled_then_short(&self) -> bool {
        *self == Self::from_samples(self.samples(), self.micro_batch_size())
    }
}

/// Count x size, as the plan report writes it: `3 x 2` (three micro-batches of two),
/// `2 x 4 + 1 x 3` (the last one short), or the sizes themselves (`[2, 4, 3]`).
impl std::fmt::Display for ReplicaBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (largest, count) = (self.micro_batch_size(), self.num_micro_batches());
        if self.is_uniform() {
            write!(f, "{count} x {largest}")
        } else if self.is_filled_then_short() {
            let last = self.sizes[count - 1];
            write!(f, "{} x {largest} + 1 x {last}", count - 1)
        } else {
            write!(f, "{:?}", self.sizes)
        }
    }
}

/// The most micro-batches a replica runs per step (each is listed: a count beyond it is
/// a typo, not a plan).
pub const MOST_MICRO_BATCHES: usize = 1 << 20;

/// A replica batch as plan files and stored plans spell it: `micro_batch_size` and
/// `num_micro_batches` (all one size), `samples` with `micro_batch_size` as the largest
/// (the last one short), or the `micro_batch_sizes` themselves.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchForm {
    /// Samples per micro-batch (the largest, with `samples`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<usize>,
    /// Micro-batches per step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_micro_batches: Option<usize>,
    /// Samples per step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<usize>,
    /// Each micro-batch's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_sizes: Option<Vec<usize>>,
}

impl BatchForm {
    /// The replica batch this form spells, or which of its fields contradict.
    pub fn batch(&self) -> Result<ReplicaBatch, BatchFormError> {
        use BatchFormError as E;
        let counts = [
            ("micro_batch_size", self.micro_batch_size),
            ("num_micro_batches", self.num_micro_batches),
            ("samples", self.samples),
        ];
        if let Some((field, _)) = counts.iter().find(|(_, n)| *n == Some(0)) {
            return Err(E::Zero { field });
        }
        // Micro-batches are listed one by one: a count no step holds is refused here.
        let implied = match (self.micro_batch_size, self.num_micro_batches, self.samples) {
            (_, Some(count), _) => count,
            (Some(size), None, Some(samples)) => samples.div_ceil(size),
            _ => 0,
        };
        if implied > MOST_MICRO_BATCHES {
            return Err(E::TooMany { count: implied });
        }
        match (
            self.micro_batch_size,
            self.num_micro_batches,
            self.samples,
            &self.micro_batch_sizes,
        ) {
            (None, None, None, Some(sizes)) => Ok(ReplicaBatch::ragged(sizes.clone())),
            (Some(_), _, _, Some(_)) | (_, Some(_), _, Some(_)) | (_, _, Some(_), Some(_)) => {
                Err(E::SizesAndCounts)
            }
            (Some(m), Some(n), None, None) => Ok(ReplicaBatch::uniform(m, n)),
            (Some(m), None, Some(s), None) => Ok(ReplicaBatch::from_samples(s, m)),
            (_, Some(_), Some(_), None) => Err(E::SamplesAndCount),
            (None, _, Some(_), None) => Err(E::SamplesWithoutSize),
            _ => Err(E::Missing),
        }
    }
}

impl From<ReplicaBatch> for BatchForm {
    fn from(batch: ReplicaBatch) -> Self {
        let largest = Some(batch.micro_batch_size());
        if batch.is_uniform() && !batch.sizes.is_empty() {
            Self {
                micro_batch_size: largest,
                num_micro_batches: Some(batch.num_micro_batches()),
                ..Self::default()
            }
        } else if batch.is_filled_then_short() {
            Self {
                micro_batch_size: largest,
                samples: Some(batch.samples()),
                ..Self::default()
            }
        } else {
            Self {
                micro_batch_sizes: Some(batch.sizes),
                ..Self::default()
            }
        }
    }
}

impl TryFrom<BatchForm> for ReplicaBatch {
    type Error = BatchFormError;
    fn try_from(form: BatchForm) -> Result<Self, BatchFormError> {
        form.batch()
    }
}

/// A replica's batch fields that do not say one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BatchFormError {
    /// `micro_batch_sizes` with any other batch field.
    #[error("`micro_batch_sizes` lists every micro-batch; it takes no `micro_batch_size`, `num_micro_batches` or `samples`")]
    SizesAndCounts,
    /// `samples` with `num_micro_batches`.
    #[error(
        "`samples` with `micro_batch_size` sets the micro-batch count; drop `num_micro_batches`"
    )]
    SamplesAndCount,
    /// `samples` without a largest micro-batch.
    #[error("`samples` needs `micro_batch_size`, the largest micro-batch")]
    SamplesWithoutSize,
    /// More micro-batches than a replica may run per step.
    #[error("{count} micro-batches per step; at most {MOST_MICRO_BATCHES} per replica")]
    TooMany {
        /// The count the fields give.
        count: usize,
    },
    /// A count of 0.
    #[error("`{field} = 0`: it must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// Not enough fields.
    #[error("a replica needs `micro_batch_size` with `num_micro_batches` or `samples`, or `micro_batch_sizes`")]
    Missing,
}

/// A batch layout that does not describe a valid step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// No replica.
    #[error("a batch layout needs at least one data-parallel replica")]
    NoReplicas,
    /// A replica whose samples overflow a step's count.
    #[error("data-parallel replica {replica}: its samples overflow the samples of a step")]
    Overflow {
        /// The replica where the running total overflows.
        replica: usize,
    },
    /// A replica with no micro-batch or an empty one.
    #[error("data-parallel replica {replica}: micro-batches of {sizes:?} samples; it needs at least one micro-batch, each of at least one sample")]
    EmptyReplica {
        /// The replica.
        replica: usize,
        /// Its micro-batch sizes.
        sizes: Vec<usize>,
    },
    /// `--num-micro-batches-per-dp` without `--micro-batch-size-per-dp`.
    #[error("--num-micro-batches-per-dp needs --micro-batch-size-per-dp")]
    CountsWithoutSizes,
    /// `--micro-batch-size` together with `--micro-batch-size-per-dp`.
    #[error("--micro-batch-size cannot be combined with --micro-batch-size-per-dp")]
    UniformAndPerReplicaSizes,
    /// A per-DP flag whose groups do not cover the data-parallel replicas.
    #[error("{flag}: the groups hold {actual} data-parallel replicas but the data-parallel size is {expected}")]
    ReplicaCountMismatch {
        /// The flag.
        flag: &'static str,
        /// Data-parallel size.
        expected: usize,
        /// Σ n_i.
        actual: usize,
    },
    /// A per-DP flag that is not `n0 v0 n1 v1 ...`.
    #[error("{flag}: {problem}")]
    BadGroups {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The global batch is not what the replicas take.
    #[error("the global batch size is {global_batch_size} but the replicas take {detail}")]
    GlobalBatchMismatch {
        /// Samples per step.
        global_batch_size: usize,
        /// What they take and why it does not fit.
        detail: String,
    },
    /// More micro-batches per step than a replica may run.
    #[error("data-parallel replica {replica}: {count} micro-batches per step; at most {MOST_MICRO_BATCHES}")]
    TooManyMicroBatches {
        /// The replica.
        replica: usize,
        /// Its micro-batches.
        count: usize,
    },
    /// A replica index past the last replica.
    #[error("data-parallel replica {replica} does not exist; there are {replicas}")]
    NoSuchReplica {
        /// The index asked for.
        replica: usize,
        /// Replicas in the layout.
        replicas: usize,
    },
}

/// Micro-batch size and count of every data-parallel replica, in replica order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "Vec<ReplicaBatch>", into = "Vec<ReplicaBatch>")]
pub struct ReplicaBatches {
    replicas: Vec<ReplicaBatch>,
    /// `offsets[d]`: samples of the global batch before replica d; last = global batch.
    offsets: Vec<usize>,
}

impl TryFrom<Vec<ReplicaBatch>> for ReplicaBatches {
    type Error = BatchError;
    fn try_from(replicas: Vec<ReplicaBatch>) -> Result<Self, BatchError> {
        Self::new(replicas)
    }
}

impl From<ReplicaBatches> for Vec<ReplicaBatch> {
    fn from(batches: ReplicaBatches) -> Self {
        batches.replicas
    }
}

/// Refuses `count` micro-batches for `replica` beyond [`MOST_MICRO_BATCHES`].
fn too_many(replica: usize, count: usize) -> Result<(), BatchError> {
    match count > MOST_MICRO_BATCHES {
        true => Err(BatchError::TooManyMicroBatches { replica, count }),
        false => Ok(()),
    }
}

/// `n0 v0 n1 v1 ...` → one value per replica.
fn expand_groups(
    flag: &'static str,
    values: &[usize],
    dp: usize,
) -> Result<(Vec<usize>, Vec<usize>), BatchError> {
    if values.is_empty() || values.len() % 2 != 0 {
        return Err(BatchError::BadGroups {
            flag,
            problem: format!(
                "{} values; expected pairs `n0 v0 n1 v1 ...` (replicas, then their value)",
                values.len()
            ),
        });
    }
    let mut per_replica = Vec::new();
    let mut group_sizes = Vec::new();
    for (g, pair) in values.chunks(2).enumerate() {
        let (n, v) = (pair[0], pair[1]);
        if n == 0 || v == 0 {
            return Err(BatchError::BadGroups {
                flag,
                problem: format!("group {g} is `{n} {v}`; both numbers must be at least 1"),
            });
        }
        group_sizes.push(n);
        per_replica.extend(std::iter::repeat_n(v, n));
    }
    if per_replica.len() != dp {
        return Err(BatchError::ReplicaCountMismatch {
            flag,
            expected: dp,
            actual: per_replica.len(),
        });
    }
    Ok((per_replica, group_sizes))
}

impl ReplicaBatches {
    /// The layout SynerFuse's flags describe, checked more strictly than SynerFuse does.
    ///
    /// * Without per-DP flags: Megatron's `--micro-batch-size` on every replica and
    ///   `GBS / (mbs · dp)` micro-batches (GBS defaults to `mbs · dp`).
    /// * `--micro-batch-size-per-dp n0 mbs0 n1 mbs1 ...` (`micro_batch_size` must be unset):
    ///   with `--num-micro-batches-per-dp` (same grouping), GBS must equal
    ///   `Σ n_i · mbs_i · k_i`; without it, GBS must be a multiple of `Σ n_i · mbs_i` and
    ///   every replica runs `GBS / Σ n_i · mbs_i` micro-batches.
    pub fn from_flags(
        dp: usize,
        global_batch_size: Option<usize>,
        micro_batch_size: Option<usize>,
        micro_batch_size_per_dp: Option<&[usize]>,
        num_micro_batches_per_dp: Option<&[usize]>,
    ) -> Result<Self, BatchError> {
        if dp == 0 {
            return Err(BatchError::NoReplicas);
        }
        let mismatch = |gbs: usize, detail: String| BatchError::GlobalBatchMismatch {
            global_batch_size: gbs,
            detail,
        };
        let Some(per_dp) = micro_batch_size_per_dp else {
            if num_micro_batches_per_dp.is_some() {
                return Err(BatchError::CountsWithoutSizes);
            }
            let mbs = micro_batch_size.unwrap_or(1);
            let gbs = global_batch_size.unwrap_or(mbs.saturating_mul(dp));
            if mbs == 0 || gbs == 0 || gbs % (mbs * dp) != 0 {
                return Err(mismatch(
                    gbs,
                    format!(
                        "micro-batches of {mbs} on {dp} replicas, so it must be a positive multiple of {}",
                        mbs * dp
                    ),
                ));
            }
            let count = gbs / (mbs * dp);
            too_many(0, count)?;
            return Self::uniform(dp, mbs, count);
        };
        if micro_batch_size.is_some() {
            return Err(BatchError::UniformAndPerReplicaSizes);
        }
        let (mbs, mbs_groups) = expand_groups("--micro-batch-size-per-dp", per_dp, dp)?;
        let per_step: usize = mbs.iter().sum();
        let counts = match num_micro_batches_per_dp {
            Some(values) => {
                let (counts, count_groups) =
                    expand_groups("--num-micro-batches-per-dp", values, dp)?;
                if count_groups != mbs_groups {
                    return Err(BatchError::BadGroups {
                        flag: "--num-micro-batches-per-dp",
                        problem: format!(
                            "groups of {count_groups:?} replicas must match --micro-batch-size-per-dp's {mbs_groups:?}"
                        ),
                    });
                }
                let total: usize = mbs.iter().zip(&counts).map(|(m, k)| m * k).sum();
                if let Some(gbs) = global_batch_size.filter(|&g| g != total) {
                    return Err(mismatch(gbs, format!("Σ n_i·mbs_i·k_i = {total}")));
                }
                counts
            }
            None => {
                let gbs = global_batch_size.unwrap_or(per_step);
                if gbs == 0 || gbs % per_step != 0 {
                    return Err(mismatch(
                        gbs,
                        format!("Σ n_i·mbs_i = {per_step} per micro-batch round, so it must be a positive multiple of {per_step}"),
                    ));
                }
                vec![gbs / per_step; dp]
            }
        };
        for (replica, &count) in counts.iter().enumerate() {
            too_many(replica, count)?;
        }
        Self::new(
            mbs.into_iter()
                .zip(counts)
                .map(|(size, count)| ReplicaBatch::uniform(size, count))
                .collect(),
        )
    }

    /// SynerFuse's `--micro-batch-size-per-dp` and `--num-micro-batches-per-dp` values,
    /// consecutive equal replicas grouped; `None` when a replica's micro-batches differ in
    /// size, which those flags cannot say.
    pub fn to_flags(&self) -> Option<(Vec<usize>, Vec<usize>)> {
        if !self.is_uniform() {
            return None;
        }
        let mut mbs = Vec::new();
        let mut counts = Vec::new();
        let mut i = 0;
        while i < self.replicas.len() {
            let r = &self.replicas[i];
            let n = self.replicas[i..].iter().take_while(|&x| x == r).count();
            mbs.extend([n, r.micro_batch_size()]);
            counts.extend([n, r.num_micro_batches()]);
            i += n;
        }
        Some((mbs, counts))
    }

    /// Whether every replica's micro-batches are all one size.
    pub fn is_uniform(&self) -> bool {
        self.replicas.iter().all(ReplicaBatch::is_uniform)
    }

    /// The factor each replica multiplies its summed token loss by so that a plain sum over
    /// replicas is the mean over the whole global batch: one over the global number of
    /// loss tokens (every replica's count, all-reduced by the runtime).
    pub fn loss_normaliser(loss_tokens_per_replica: &[f64]) -> f64 {
        let total: f64 = loss_tokens_per_replica.iter().sum();
        if total > 0.0 {
            1.0 / total
        } else {
            0.0
        }
    }

    /// A layout from each replica's micro-batch size and count.
    pub fn new(replicas: Vec<ReplicaBatch>) -> Result<Self, BatchError> {
        if replicas.is_empty() {
            return Err(BatchError::NoReplicas);
        }
        if let Some((replica, r)) = replicas
            .iter()
            .enumerate()
            .find(|(_, r)| r.sizes.is_empty() || r.sizes.contains(&0))
        {
            return Err(BatchError::EmptyReplica {
                replica,
                sizes: r.sizes.clone(),
            });
        }
        let mut offsets = vec![0usize];
        for (replica, r) in replicas.iter().enumerate() {
            let total = (r.sizes.iter())
                .try_fold(offsets[replica], |sum, &size| sum.checked_add(size))
                .ok_or(BatchError::Overflow { replica })?;
            offsets.push(total);
        }
        Ok(Self { replicas, offsets })
    }

    /// Megatron's homogeneous layout: `dp` replicas of `mbs × nmb`.
    pub fn uniform(
        dp: usize,
        micro_batch_size: usize,
        num_micro_batches: usize,
    ) -> Result<Self, BatchError> {
        Self::new(vec![
            ReplicaBatch::uniform(
                micro_batch_size,
                num_micro_batches
            );
            dp
        ])
    }

    /// The replicas, in order.
    pub fn replicas(&self) -> &[ReplicaBatch] {
        &self.replicas
    }

    /// Number of data-parallel replicas.
    pub fn dp_size(&self) -> usize {
        self.replicas.len()
    }

    /// Samples per step, all replicas together.
    pub fn global_batch_size(&self) -> usize {
        self.offsets[self.replicas.len()]
    }

    /// Positions within a global batch that replica `d` takes.
    pub fn replica_range(&self, d: usize) -> Result<Range<usize>, BatchError> {
        if d >= self.replicas.len() {
            return Err(BatchError::NoSuchReplica {
                replica: d,
                replicas: self.replicas.len(),
            });
        }
        Ok(self.offsets[d]..self.offsets[d + 1])
    }

    /// Positions within a global batch of micro-batch `k` of replica `d`, for every k.
    pub fn micro_batch_ranges(&self, d: usize) -> Result<Vec<Range<usize>>, BatchError> {
        let mut start = self.replica_range(d)?.start;
        Ok((self.replicas[d].sizes.iter())
            .map(|&size| {
                start += size;
                start - size..start
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn readme_example() {
        // SynerFuse README: DP 2, mbs 6 and 2, 4 micro-batches each: 24 + 8 = 32.
        let b = ReplicaBatches::new(vec![
            ReplicaBatch::uniform(6, 4),
            ReplicaBatch::uniform(2, 4),
        ])
        .unwrap();
        assert_eq!(b.global_batch_size(), 32);
        assert_eq!(b.replica_range(0).unwrap(), 0..24);
        assert_eq!(b.replica_range(1).unwrap(), 24..32);
        assert_eq!(
            b.micro_batch_ranges(1).unwrap(),
            [24..26, 26..28, 28..30, 30..32]
        );
        assert!(b.replica_range(2).is_err());
        assert!(ReplicaBatches::uniform(0, 1, 1).is_err());
        assert!(ReplicaBatches::uniform(2, 0, 1).is_err());
    }

    #[test]
    fn synerfuse_flags() {
        // README: DP 2, GBS 32, mbs 6 and 2, 4 micro-batches each.
        let b =
            ReplicaBatches::from_flags(2, Some(32), None, Some(&[1, 6, 1, 2]), Some(&[1, 4, 1, 4]))
                .unwrap();
        assert_eq!(b.replica_range(0).unwrap(), 0..24);
        assert_eq!(b.to_flags(), Some((vec![1, 6, 1, 2], vec![1, 4, 1, 4])));
        // Without counts: GBS / Σ mbs micro-batches each.
        let b = ReplicaBatches::from_flags(3, Some(40), None, Some(&[2, 3, 1, 2]), None).unwrap();
        assert_eq!(
            b.replicas()
                .iter()
                .map(|r| r.num_micro_batches())
                .collect::<Vec<_>>(),
            [5, 5, 5]
        );
        // Three distinct counts (SynerFuse allows two).
        let b = ReplicaBatches::from_flags(
            3,
            Some(20), // 2·1 + 3·2 + 4·3
            None,
            Some(&[1, 2, 1, 3, 1, 4]),
            Some(&[1, 1, 1, 2, 1, 3]),
        )
        .unwrap();
        assert_eq!(b.global_batch_size(), 20);
        // Homogeneous Megatron flags.
        let b = ReplicaBatches::from_flags(4, Some(64), Some(2), None, None).unwrap();
        assert_eq!(b, ReplicaBatches::uniform(4, 2, 8).unwrap());
        // Loud errors naming expected and actual values.
        let e =
            ReplicaBatches::from_flags(2, Some(30), None, Some(&[1, 6, 1, 2]), Some(&[1, 4, 1, 4]))
                .unwrap_err();
        assert!(
            e.to_string().contains("30") && e.to_string().contains("32"),
            "{e}"
        );
        let e =
            ReplicaBatches::from_flags(3, Some(32), None, Some(&[1, 6, 1, 2]), None).unwrap_err();
        assert!(
            e.to_string().contains("3") && e.to_string().contains("2 data-parallel"),
            "{e}"
        );
        let e = ReplicaBatches::from_flags(2, Some(32), None, Some(&[2, 4]), Some(&[1, 4, 1, 4]))
            .unwrap_err();
        assert!(e.to_string().contains("must match"), "{e}");
        assert!(ReplicaBatches::from_flags(2, Some(32), Some(2), Some(&[2, 4]), None).is_err());
        assert!(ReplicaBatches::from_flags(2, Some(33), None, Some(&[2, 4]), None).is_err());
        assert!(ReplicaBatches::from_flags(2, Some(32), None, Some(&[2, 4, 1]), None).is_err());
        assert!(ReplicaBatches::from_flags(2, Some(30), Some(4), None, None).is_err());
    }

    proptest! {
        /// Summing each replica's token loss times the normaliser gives the mean over the
        /// global batch, whatever the split among replicas.
        #[test]
        fn normalised_sum_is_the_global_mean(
            losses in prop::collection::vec(prop::collection::vec(0.0f64..10.0, 1..20), 1..6)
        ) {
            let tokens: Vec<f64> = losses.iter().map(|l| l.len() as f64).collect();
            let scale = ReplicaBatches::loss_normaliser(&tokens);
            let summed: f64 = losses.iter().map(|l| l.iter().sum::<f64>() * scale).sum();
            let all: Vec<f64> = losses.iter().flatten().copied().collect();
            let mean = all.iter().sum::<f64>() / all.len() as f64;
            prop_assert!((summed - mean).abs() <= 1e-12 * mean.abs().max(1.0));
        }

        /// Flags → layout → flags → the same layout.
        #[test]
        fn flags_round_trip(shapes in prop::collection::vec((1usize..5, 1usize..5), 1..8)) {
            let b = ReplicaBatches::new(shapes.iter().map(|&(m, n)| ReplicaBatch::uniform(m, n)).collect()).unwrap();
            let (mbs, counts) = b.to_flags().unwrap();
            let back = ReplicaBatches::from_flags(b.dp_size(), Some(b.global_batch_size()), None, Some(&mbs), Some(&counts)).unwrap();
            prop_assert_eq!(back, b);
        }

        /// Every position of a global batch belongs to exactly one micro-batch of one
        /// replica, in order, and replica d's micro-batches have its sizes, ragged or not.
        #[test]
        fn micro_batches_partition_the_global_batch(
            sizes in prop::collection::vec(prop::collection::vec(1usize..9, 1..9), 1..12)
        ) {
            let b = ReplicaBatches::new(sizes.iter().cloned().map(ReplicaBatch::ragged).collect()).unwrap();
            let mut next = 0;
            for (d, sizes) in sizes.iter().enumerate() {
                let ranges = b.micro_batch_ranges(d).unwrap();
                prop_assert_eq!(ranges.iter().map(Range::len).collect::<Vec<_>>(), sizes.clone());
                for r in ranges {
                    prop_assert_eq!(r.start, next);
                    next = r.end;
                }
            }
            prop_assert_eq!(next, b.global_batch_size());
        }

        /// Any batch survives its file form, which is the shortest that says it.
        #[test]
        fn the_file_form_round_trips(sizes in prop::collection::vec(1usize..6, 1..7)) {
            let batch = ReplicaBatch::ragged(sizes);
            let form = BatchForm::from(batch.clone());
            prop_assert_eq!(form.batch().unwrap(), batch.clone());
            let json = serde_json::to_string(&batch).unwrap();
            prop_assert_eq!(serde_json::from_str::<ReplicaBatch>(&json).unwrap(), batch);
        }
    }

    #[test]
    fn samples_fill_micro_batches_then_the_last_is_short() {
        assert_eq!(ReplicaBatch::from_samples(11, 4).sizes(), [4, 4, 3]);
        assert_eq!(ReplicaBatch::from_samples(9, 4).sizes(), [4, 4, 1]);
        assert_eq!(
            ReplicaBatch::from_samples(8, 4),
            ReplicaBatch::uniform(4, 2)
        );
        let form = |json: &str| serde_json::from_str::<BatchForm>(json).unwrap().batch();
        assert_eq!(
            form(r#"{"micro_batch_size": 4, "samples": 11}"#)
                .unwrap()
                .sizes(),
            [4, 4, 3]
        );
        assert_eq!(
            form(r#"{"micro_batch_sizes": [2, 4, 3]}"#).unwrap().sizes(),
            [2, 4, 3]
        );
        let contradictions = [
            (
                r#"{"micro_batch_sizes": [2], "samples": 2}"#,
                BatchFormError::SizesAndCounts,
            ),
            (
                r#"{"micro_batch_size": 2, "num_micro_batches": 2, "samples": 3}"#,
                BatchFormError::SamplesAndCount,
            ),
            (r#"{"samples": 3}"#, BatchFormError::SamplesWithoutSize),
            (r#"{"micro_batch_size": 3}"#, BatchFormError::Missing),
            (
                r#"{"micro_batch_size": 3, "num_micro_batches": 0}"#,
                BatchFormError::Zero {
                    field: "num_micro_batches",
                },
            ),
        ];
        for (json, error) in contradictions {
            assert_eq!(form(json).unwrap_err(), error, "{json}");
        }
        let huge = form(r#"{"micro_batch_size": 1, "samples": 1000000000000}"#).unwrap_err();
        assert_eq!(
            huge,
            BatchFormError::TooMany {
                count: 1_000_000_000_000
            }
        );
        let huge = ReplicaBatches::from_flags(2, Some(1 << 40), Some(1), None, None).unwrap_err();
        assert!(
            matches!(huge, BatchError::TooManyMicroBatches { replica: 0, .. }),
            "{huge}"
        );
        let ragged = ReplicaBatches::new(vec![ReplicaBatch::from_samples(5, 2)]).unwrap();
        assert_eq!(ragged.to_flags(), None);
        let empty = ReplicaBatches::new(vec![ReplicaBatch::ragged(vec![2, 0])]).unwrap_err();
        assert!(empty.to_string().contains("[2, 0]"), "{empty}");
    }
}
