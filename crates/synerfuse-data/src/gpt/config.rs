//! A run's data configuration from Megatron's data flags, checked as Megatron checks
//! them, and the samples each split is sized to.

use super::{Blend, BlendError, GptDataConfig, GptDatasetConfig, GptDatasetError, PyValue};
use std::path::PathBuf;

/// Megatron's default split when one blend is given without one.
pub const DEFAULT_SPLIT: &str = "969, 30, 1";

/// Where a run's data comes from: one blend split by a split string (Megatron's
/// `--data-path` and `--split`), or a blend per split (`--train-data-path`,
/// `--valid-data-path`, `--test-data-path`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataSources {
    /// One blend over all splits: prefixes, or `weight prefix` pairs.
    pub blend: Vec<String>,
    /// A blend per split (train, valid, test); empty lists for none.
    pub per_split: [Vec<String>; 3],
    /// The split string (default [`DEFAULT_SPLIT`] with one blend).
    pub split: Option<String>,
    /// Where index caches go (default: beside each dataset).
    pub cache_dir: Option<PathBuf>,
}

impl GptDataConfig {
    /// The configuration of `sources` with the run's `seed`, `sequence_length` and the
    /// tokenizer's identifiers (part of the cache names).
    pub fn from_sources(
        sources: &DataSources,
        seed: u32,
        sequence_length: usize,
        tokenizer: PyValue,
    ) -> Result<Self, GptDatasetError> {
        let has_per_split = sources.per_split.iter().any(|p| !p.is_empty());
        match (sources.blend.is_empty(), has_per_split) {
            (false, true) => return Err(BlendError::BlendAndPerSplit.into()),
            (true, false) => return Err(BlendError::NoData.into()),
            _ => {}
        }
        if has_per_split && sources.split.is_some() {
            return Err(BlendError::SplitWithPerSplit.into());
        }
        if sequence_length == 0 {
            return Err(GptDatasetError::ZeroSequenceLength);
        }
        let blend = (!sources.blend.is_empty())
            .then(|| Blend::from_list(&sources.blend))
            .transpose()?;
        let mut blend_per_split = [None, None, None];
        for (slot, paths) in blend_per_split.iter_mut().zip(&sources.per_split) {
            if !paths.is_empty() {
                *slot = Some(Blend::from_list(paths)?);
            }
        }
        let split =
            (!has_per_split).then(|| sources.split.as_deref().unwrap_or(DEFAULT_SPLIT).to_owned());
        Ok(GptDataConfig {
            blend,
            blend_per_split,
            dataset: GptDatasetConfig {
                seed,
                sequence_length,
                split,
                path_to_cache: sources.cache_dir.clone(),
                tokenizer,
                add_extra_token: true,
                drop_last_partial_validation: true,
            },
        })
    }
}

/// How many samples a run draws from each split, in Megatron's terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleBudget {
    /// `--train-samples`.
    pub train_samples: Option<u64>,
    /// `--train-iters`.
    pub train_iters: Option<u64>,
    /// `--global-batch-size`.
    pub global_batch_size: Option<u64>,
    /// `--eval-interval` (at least 1).
    pub eval_interval: u64,
    /// `--eval-iters`.
    pub eval_iters: u64,
    /// `--valid-samples` (this tool's override).
    pub valid_samples: Option<u64>,
    /// `--test-samples` (this tool's override).
    pub test_samples: Option<u64>,
}

/// A budget that does not size the splits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    /// Evaluation every 0 iterations.
    #[error("the evaluation interval must be at least 1")]
    ZeroEvalInterval,
    /// Neither a sample count nor iterations with a batch size.
    #[error("the train split needs a sample count, or iterations and a global batch size")]
    NoTrainSize,
    /// A product beyond 64 bits.
    #[error("the sample counts overflow 64 bits")]
    Overflow,
}

impl SampleBudget {
    /// Samples per split (train, valid, test), as Megatron's
    /// `build_train_valid_test_datasets` sizes them.
    pub fn split_sizes(&self) -> Result<[Option<u64>; 3], BudgetError> {
        if self.eval_interval == 0 {
            return Err(BudgetError::ZeroEvalInterval);
        }
        let mul = |a: u64, b: u64| a.checked_mul(b).ok_or(BudgetError::Overflow);
        let gbs = self.global_batch_size;
        let train = match (self.train_samples, self.train_iters, gbs) {
            (Some(samples), _, _) => samples,
            (None, Some(iters), Some(gbs)) => mul(iters, gbs)?,
            (None, _, _) => return Err(BudgetError::NoTrainSize),
        };
        let train_iters = match (self.train_iters, gbs) {
            (Some(iters), _) => Some(iters),
            (None, Some(gbs)) if gbs > 0 => Some(train / gbs),
            _ => None,
        };
        let valid = match (self.valid_samples, train_iters, gbs) {
            (Some(samples), _, _) => samples,
            (None, Some(iters), Some(gbs)) => {
                mul(mul(iters / self.eval_interval + 1, self.eval_iters)?, gbs)?
            }
            _ => 0,
        };
        let test = match (self.test_samples, gbs) {
            (Some(samples), _) => samples,
            (None, Some(gbs)) => mul(self.eval_iters, gbs)?,
            _ => 0,
        };
        Ok([Some(train), Some(valid), Some(test)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_sizes_the_splits_from_iterations() {
        let budget = SampleBudget {
            train_iters: Some(100),
            global_batch_size: Some(8),
            eval_interval: 10,
            eval_iters: 2,
            ..Default::default()
        };
        // valid: (100 / 10 + 1) * 2 * 8, test: 2 * 8.
        assert_eq!(budget.split_sizes(), Ok([Some(800), Some(176), Some(16)]));
        let none = SampleBudget {
            eval_interval: 1,
            ..Default::default()
        };
        assert_eq!(none.split_sizes(), Err(BudgetError::NoTrainSize));
        let huge = SampleBudget {
            train_iters: Some(u64::MAX),
            global_batch_size: Some(2),
            eval_interval: 1,
            ..Default::default()
        };
        assert_eq!(huge.split_sizes(), Err(BudgetError::Overflow));
    }

    #[test]
    fn sources_are_checked_as_megatron_checks_them() {
        let tokenizer = PyValue::None;
        let check = |sources: DataSources| {
            GptDataConfig::from_sources(&sources, 1234, 16, tokenizer.clone())
                .map(|c| c.dataset.split)
        };
        assert!(matches!(
            check(DataSources::default()),
            Err(GptDatasetError::Blend(BlendError::NoData))
        ));
        let one = DataSources {
            blend: vec!["a".into()],
            ..Default::default()
        };
        assert_eq!(check(one.clone()).unwrap(), Some(DEFAULT_SPLIT.to_owned()));
        let both = DataSources {
            per_split: [vec!["t".into()], vec![], vec![]],
            ..one
        };
        assert!(matches!(
            check(both),
            Err(GptDatasetError::Blend(BlendError::BlendAndPerSplit))
        ));
        let per_split_with_split = DataSources {
            per_split: [vec!["t".into()], vec![], vec![]],
            split: Some("1,0,0".into()),
            ..Default::default()
        };
        assert!(matches!(
            check(per_split_with_split),
            Err(GptDatasetError::Blend(BlendError::SplitWithPerSplit))
        ));
    }
}
