//! Micro-batch size and count per data-parallel replica, and which samples of a global
//! batch each replica takes.
//!
//! Replica d takes the contiguous run of `mbs_d · nmb_d` samples that follows those of
//! replicas `0..d`, so every sample of a global batch goes to exactly one replica and
//! micro-batch, whatever the sizes and counts (SynerFuse's sampler overlaps and skips
//! samples when a group has several replicas and several micro-batches).

use std::ops::Range;

/// One replica's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ReplicaBatch {
    /// Samples per micro-batch.
    pub micro_batch_size: usize,
    /// Micro-batches per step.
    pub num_micro_batches: usize,
}

impl ReplicaBatch {
    /// Samples this replica takes per step.
    pub fn samples(&self) -> usize {
        self.micro_batch_size * self.num_micro_batches
    }
}

/// A batch layout that does not describe a valid step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// No replica.
    #[error("a batch layout needs at least one data-parallel replica")]
    NoReplicas,
    /// A replica with an empty micro-batch or no micro-batch.
    #[error(
        "data-parallel replica {replica}: micro-batch size × count overflows the samples of a step"
    )]
    Overflow {
        /// The replica where the running total overflows.
        replica: usize,
    },
    /// A replica with no samples.
    #[error("data-parallel replica {replica}: micro-batch size {micro_batch_size} × {num_micro_batches} micro-batches; both must be at least 1")]
    EmptyReplica {
        /// The replica.
        replica: usize,
        /// Its micro-batch size.
        micro_batch_size: usize,
        /// Its micro-batch count.
        num_micro_batches: usize,
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
            let gbs = global_batch_size.unwrap_or(mbs * dp);
            if mbs == 0 || gbs == 0 || gbs % (mbs * dp) != 0 {
                return Err(mismatch(
                    gbs,
                    format!(
                        "micro-batches of {mbs} on {dp} replicas, so it must be a positive multiple of {}",
                        mbs * dp
                    ),
                ));
            }
            return Self::uniform(dp, mbs, gbs / (mbs * dp));
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
        Self::new(
            mbs.into_iter()
                .zip(counts)
                .map(|(micro_batch_size, num_micro_batches)| ReplicaBatch {
                    micro_batch_size,
                    num_micro_batches,
                })
                .collect(),
        )
    }

    /// SynerFuse's `--micro-batch-size-per-dp` and `--num-micro-batches-per-dp` values,
    /// consecutive equal replicas grouped.
    pub fn to_flags(&self) -> (Vec<usize>, Vec<usize>) {
        let mut mbs = Vec::new();
        let mut counts = Vec::new();
        let mut i = 0;
        while i < self.replicas.len() {
            let r = self.replicas[i];
            let n = self.replicas[i..].iter().take_while(|&&x| x == r).count();
            mbs.extend([n, r.micro_batch_size]);
            counts.extend([n, r.num_micro_batches]);
            i += n;
        }
        (mbs, counts)
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
            .find(|(_, r)| r.micro_batch_size == 0 || r.num_micro_batches == 0)
        {
            return Err(BatchError::EmptyReplica {
                replica,
                micro_batch_size: r.micro_batch_size,
                num_micro_batches: r.num_micro_batches,
            });
        }
        let mut offsets = vec![0usize];
        for (replica, r) in replicas.iter().enumerate() {
            let total = r
                .micro_batch_size
                .checked_mul(r.num_micro_batches)
                .and_then(|n| n.checked_add(offsets[replica]))
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
            ReplicaBatch {
                micro_batch_size,
                num_micro_batches,
            };
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
        let range = self.replica_range(d)?;
        let mbs = self.replicas[d].micro_batch_size;
        Ok(range.step_by(mbs).map(|start| start..start + mbs).collect())
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
            ReplicaBatch {
                micro_batch_size: 6,
                num_micro_batches: 4,
            },
            ReplicaBatch {
                micro_batch_size: 2,
                num_micro_batches: 4,
            },
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
        assert_eq!(b.to_flags(), (vec![1, 6, 1, 2], vec![1, 4, 1, 4]));
        // Without counts: GBS / Σ mbs micro-batches each.
        let b = ReplicaBatches::from_flags(3, Some(40), None, Some(&[2, 3, 1, 2]), None).unwrap();
        assert_eq!(
            b.replicas()
                .iter()
                .map(|r| r.num_micro_batches)
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
            let b = ReplicaBatches::new(shapes.iter().map(|&(m, n)| ReplicaBatch {
                micro_batch_size: m,
                num_micro_batches: n,
            }).collect()).unwrap();
            let (mbs, counts) = b.to_flags();
            let back = ReplicaBatches::from_flags(b.dp_size(), Some(b.global_batch_size()), None, Some(&mbs), Some(&counts)).unwrap();
            prop_assert_eq!(back, b);
        }

        /// Every position of a global batch belongs to exactly one micro-batch of one
        /// replica, and replica d's micro-batches have its size.
        #[test]
        fn micro_batches_partition_the_global_batch(
            shapes in prop::collection::vec((1usize..9, 1usize..9), 1..12)
        ) {
            let b = ReplicaBatches::new(shapes.iter().map(|&(m, n)| ReplicaBatch {
                micro_batch_size: m,
                num_micro_batches: n,
            }).collect()).unwrap();
            let mut seen = vec![0u32; b.global_batch_size()];
            for (d, &(mbs, nmb)) in shapes.iter().enumerate() {
                let ranges = b.micro_batch_ranges(d).unwrap();
                prop_assert_eq!(ranges.len(), nmb);
                for r in ranges {
                    prop_assert_eq!(r.len(), mbs);
                    for i in r {
                        seen[i] += 1;
                    }
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1));
        }
    }
}
