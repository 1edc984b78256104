//! Micro-batch size and count per data-parallel replica, and which samples of a global
//! batch each replica takes.
//!
//! Replica d takes the contiguous run of `mbs_d · nmb_d` samples that follows those of
//! replicas `0..d`, so every sample of a global batch goes to exactly one replica and
//! micro-batch, whatever the sizes and counts (SynerFuse's sampler overlaps and skips
//! samples when a group has several replicas and several micro-batches).

use std::ops::Range;

/// One replica's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    #[error("data-parallel replica {replica}: micro-batch size {micro_batch_size} × {num_micro_batches} micro-batches; both must be at least 1")]
    EmptyReplica {
        /// The replica.
        replica: usize,
        /// Its micro-batch size.
        micro_batch_size: usize,
        /// Its micro-batch count.
        num_micro_batches: usize,
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReplicaBatches {
    replicas: Vec<ReplicaBatch>,
    /// `offsets[d]`: samples of the global batch before replica d; last = global batch.
    offsets: Vec<usize>,
}

impl ReplicaBatches {
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
        let offsets = std::iter::once(0)
            .chain(replicas.iter().scan(0, |total, r| {
                *total += r.samples();
                Some(*total)
            }))
            .collect();
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

    proptest! {
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
