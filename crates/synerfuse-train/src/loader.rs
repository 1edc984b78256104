//! The training-side data loader: which samples each data-parallel replica trains on in
//! the next step, and those samples as model inputs.
//!
//! Megatron's pretraining sampler walks dataset indices `consumed_samples..` in order; one
//! step takes the next global batch of consecutive indices. Replica d takes the run of
//! `mbs_d · nmb_d` indices after replicas `0..d`, cut into its micro-batches in order. The
//! position in the data is nothing but `consumed_samples`, so resuming from a checkpoint's
//! count continues the exact sequence.

use crate::comm::MpiCommunicator;
use std::ops::Range;
use synerfuse_data::gpt::{GptDatasetError, SampleOptions, SplitDataset};
use synerfuse_plan::{BatchError, ReplicaBatches};

pub use crate::error::LoaderError;

/// The three splits of a run's data; a split without documents, or not asked for, is
/// `None`.
#[derive(Debug, Clone, Default)]
pub struct SplitDatasets {
    /// The train split.
    pub train: Option<SplitDataset>,
    /// The validation split.
    pub valid: Option<SplitDataset>,
    /// The test split.
    pub test: Option<SplitDataset>,
}

/// The splits `build` makes (each sized as the caller asked), on every rank of
/// `world`: rank 0 builds the indices (and writes their caches) first, the others then
/// load its caches, so no two ranks write one cache. Collective over `world`.
pub fn build_splits(
    world: &MpiCommunicator,
    build: impl Fn() -> Result<[Option<SplitDataset>; 3], GptDatasetError>,
) -> Result<SplitDatasets, LoaderError> {
    let build = || -> Result<SplitDatasets, LoaderError> {
        let [train, valid, test] = build()?;
        Ok(SplitDatasets { train, valid, test })
    };
    if world.rank() == 0 {
        let built = build();
        world.barrier();
        built
    } else {
        world.barrier();
        build()
    }
}

/// Dataset indices of each micro-batch of `replica` in the step that starts after
/// `consumed_samples` samples.
pub fn replica_sample_ranges(
    batches: &ReplicaBatches,
    replica: usize,
    consumed_samples: u64,
) -> Result<Vec<Range<u64>>, BatchError> {
    Ok(batches
        .micro_batch_ranges(replica)?
        .into_iter()
        .map(|r| consumed_samples + r.start as u64..consumed_samples + r.end as u64)
        .collect())
}

/// One micro-batch as model inputs, row-major `[micro_batch_size, sequence_length]`.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatch {
    /// Dataset indices of the rows.
    pub sample_indices: Range<u64>,
    /// Which blended dataset each row came from (0 without a blend).
    pub dataset_ids: Vec<usize>,
    /// Input ids.
    pub tokens: Vec<i64>,
    /// Target ids.
    pub labels: Vec<i64>,
    /// 1 where the loss counts.
    pub loss_mask: Vec<f32>,
    /// Positions.
    pub position_ids: Vec<i64>,
    /// `[mbs, S, S]`, `true` = masked, when the options ask for it.
    pub attention_mask: Option<Vec<bool>>,
}

impl MicroBatch {
    /// Rows (samples).
    pub fn len(&self) -> usize {
        self.dataset_ids.len()
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.dataset_ids.is_empty()
    }

    /// Tokens that count in the loss: the replica-independent normaliser is the sum of
    /// these over the whole global batch.
    pub fn loss_tokens(&self) -> f64 {
        self.loss_mask.iter().map(|&m| f64::from(m)).sum()
    }
    /// A context-parallel member's part: every row at `positions` (sequence indices, in
    /// the member's order), the attention mask's rows likewise (all key columns kept).
    /// The members' parts of a split together hold every token once, so their loss
    /// tokens add up to this micro-batch's.
    pub fn context_part(&self, positions: &[usize]) -> MicroBatch {
        let rows = self.len();
        let sequence = match rows {
            0 => 0,
            n => self.tokens.len() / n,
        };
        let pick = |values: &[i64]| -> Vec<i64> {
            (0..rows)
                .flat_map(|r| positions.iter().map(move |&p| values[r * sequence + p]))
                .collect()
        };
        let loss_mask = (0..rows)
            .flat_map(|r| positions.iter().map(move |&p| (r, p)))
            .map(|(r, p)| self.loss_mask[r * sequence + p])
            .collect();
        let attention_mask = self.attention_mask.as_ref().map(|mask| {
            (0..rows)
                .flat_map(|r| positions.iter().map(move |&p| (r, p)))
                .flat_map(|(r, p)| {
                    let row = (r * sequence + p) * sequence;
                    mask[row..row + sequence].iter().copied()
                })
                .collect()
        });
        MicroBatch {
            sample_indices: self.sample_indices.clone(),
            dataset_ids: self.dataset_ids.clone(),
            tokens: pick(&self.tokens),
            labels: pick(&self.labels),
            loss_mask,
            position_ids: pick(&self.position_ids),
            attention_mask,
        }
    }
}

/// Serves one replica's micro-batches, step after step.
#[derive(Debug, Clone)]
pub struct ReplicaLoader {
    dataset: SplitDataset,
    batches: ReplicaBatches,
    replica: usize,
    options: SampleOptions,
}

impl ReplicaLoader {
    /// A loader for `replica` of the layout `batches` over the train split `dataset`.
    ///
    /// A plain causal mask is never materialised, whatever `create_attention_mask` says:
    /// the model attends causally without one, and a mask would keep SDPA off its flash
    /// kernel (Megatron's flash path ignores it too). Masks are built only when
    /// `reset_attention_mask` makes them differ from causal.
    pub fn new(
        dataset: SplitDataset,
        batches: ReplicaBatches,
        replica: usize,
        mut options: SampleOptions,
    ) -> Result<Self, LoaderError> {
        batches.replica_range(replica)?;
        options.create_attention_mask &= options.reset_attention_mask;
        Ok(Self {
            dataset,
            batches,
            replica,
            options,
        })
    }

    /// The batch layout.
    pub fn batches(&self) -> &ReplicaBatches {
        &self.batches
    }

    /// This replica's micro-batches for the step after `consumed_samples` samples.
    /// The caller adds `global_batch_size()` to `consumed_samples` after each step.
    pub fn step(&self, consumed_samples: u64) -> Result<Vec<MicroBatch>, LoaderError> {
        let global = self.batches.global_batch_size() as u64;
        let available = self.dataset.len() as u64;
        if consumed_samples + global > available {
            return Err(LoaderError::Exhausted {
                consumed_samples,
                needed: consumed_samples..consumed_samples + global,
                available,
            });
        }
        replica_sample_ranges(&self.batches, self.replica, consumed_samples)?
            .into_iter()
            .map(|range| self.micro_batch(range))
            .collect()
    }

    fn micro_batch(&self, range: Range<u64>) -> Result<MicroBatch, LoaderError> {
        let rows = (range.end - range.start) as usize;
        let s = self.options.sequence_length;
        let mut batch = MicroBatch {
            sample_indices: range.clone(),
            dataset_ids: Vec::with_capacity(rows),
            tokens: Vec::with_capacity(rows * s),
            labels: Vec::with_capacity(rows * s),
            loss_mask: Vec::with_capacity(rows * s),
            position_ids: Vec::with_capacity(rows * s),
            attention_mask: self
                .options
                .create_attention_mask
                .then(|| Vec::with_capacity(rows * s * s)),
        };
        for idx in range {
            let (dataset_id, sample) = self.dataset.sample(idx as usize, &self.options)?;
            batch.dataset_ids.push(dataset_id);
            batch.tokens.extend(sample.tokens);
            batch.labels.extend(sample.labels);
            batch.loss_mask.extend(sample.loss_mask);
            batch.position_ids.extend(sample.position_ids);
            if let (Some(all), Some(mask)) = (&mut batch.attention_mask, sample.attention_mask) {
                all.extend(mask);
            }
        }
        Ok(batch)
    }
}

/// A thread reading one step's micro-batches.
type PrefetchThread = std::thread::JoinHandle<Result<Vec<MicroBatch>, LoaderError>>;

/// Reads the next step's micro-batches on a background thread while the current step
/// computes (Megatron's data-loader workers; `--num-workers 0` reads them inline).
pub struct Prefetcher {
    loader: ReplicaLoader,
    background: bool,
    /// The step being read ahead: (its consumed samples, the reading thread).
    next: Option<(u64, PrefetchThread)>,
}

impl Prefetcher {
    /// Serves `loader`'s steps, reading ahead on a thread when `background`.
    pub fn new(loader: ReplicaLoader, background: bool) -> Self {
        Prefetcher {
            loader,
            background,
            next: None,
        }
    }

    /// The micro-batches of the step after `consumed_samples` samples, and (in the
    /// background) a start on the step after it.
    pub fn step(&mut self, consumed_samples: u64) -> Result<Vec<MicroBatch>, LoaderError> {
        let ready = match self.next.take() {
            Some((at, handle)) if at == consumed_samples => handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            _ => self.loader.step(consumed_samples),
        };
        if self.background {
            let following = consumed_samples + self.loader.batches().global_batch_size() as u64;
            let loader = self.loader.clone();
            let handle = std::thread::Builder::new()
                .name("synerfuse-prefetch".into())
                .spawn(move || loader.step(following))
                .map_err(|source| LoaderError::Thread { source })?;
            self.next = Some((following, handle));
        }
        ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_parts_hold_every_token_once() {
        let (rows, sequence) = (2, 8);
        let n = rows * sequence;
        let batch = MicroBatch {
            sample_indices: 0..2,
            dataset_ids: vec![0, 0],
            tokens: (0..n as i64).collect(),
            labels: (100..100 + n as i64).collect(),
            loss_mask: (0..n).map(|i| (i % 3 != 0) as u8 as f32).collect(),
            position_ids: (0..rows).flat_map(|_| 0..sequence as i64).collect(),
            attention_mask: Some(
                (0..rows * sequence * sequence)
                    .map(|i| i % 2 == 0)
                    .collect(),
            ),
        };
        let split = synerfuse_plan::cp::ContextSplit::in_shares(sequence, &[3, 1]).unwrap();
        let parts: Vec<MicroBatch> = (0..split.ranks())
            .map(|r| batch.context_part(&split.position_list(r)))
            .collect();
        let loss_tokens: f64 = parts.iter().map(MicroBatch::loss_tokens).sum();
        assert_eq!(loss_tokens, batch.loss_tokens());
        let mut tokens: Vec<i64> = parts.iter().flat_map(|p| p.tokens.clone()).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, batch.tokens);
        // Member 1 holds positions 3 and 4 of each row: their ids, labels and positions.
        assert_eq!(parts[1].tokens, vec![3, 4, 11, 12]);
        assert_eq!(parts[1].labels, vec![103, 104, 111, 112]);
        assert_eq!(parts[1].position_ids, vec![3, 4, 3, 4]);
        let mask = parts[1].attention_mask.as_ref().unwrap();
        assert_eq!(mask.len(), rows * 2 * sequence);
        let whole = batch.attention_mask.as_ref().unwrap();
        assert_eq!(mask[..sequence], whole[3 * sequence..4 * sequence]);
    }
}
