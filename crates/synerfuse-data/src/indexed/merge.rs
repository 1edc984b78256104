//! Megatron's `tools/merge_datasets.py`: every dataset of a directory into one.

use super::{bin_path, idx_path, IndexedDataset, IndexedDatasetBuilder};
use crate::DataError;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Merges every `PREFIX.bin`/`PREFIX.idx` pair in `input_dir`, in sorted prefix order,
/// into `output_prefix`. All datasets must share one dtype; `multimodal` carries the
/// modes arrays along. Returns the merged prefixes in the order they were appended.
///
/// As in Megatron, any regular file in the directory must belong to a complete pair.
pub fn merge_datasets(
    input_dir: impl AsRef<Path>,
    output_prefix: impl AsRef<Path>,
    multimodal: bool,
) -> Result<Vec<PathBuf>, DataError> {
    let input_dir = input_dir.as_ref();
    let entries = std::fs::read_dir(input_dir).map_err(DataError::io(input_dir))?;
    let mut prefixes = BTreeSet::new();
    for entry in entries {
        let entry = entry.map_err(DataError::io(input_dir))?;
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        let (Some(stem), ext) = (path.file_stem(), path.extension().and_then(|e| e.to_str()))
        else {
            continue;
        };
        let pair = if ext == Some("idx") { "bin" } else { "idx" };
        let prefix = input_dir.join(stem);
        let sibling = if pair == "bin" {
            bin_path(&prefix)
        } else {
            idx_path(&prefix)
        };
        if !sibling.is_file() {
            return Err(DataError::InvalidUse {
                path: path.clone(),
                problem: format!("has no sibling {}: every file in a merge directory must belong to a .bin/.idx pair", sibling.display()),
            });
        }
        prefixes.insert(prefix);
    }
    let Some(first) = prefixes.first() else {
        return Err(DataError::InvalidUse {
            path: input_dir.to_path_buf(),
            problem: "holds no .bin/.idx pair to merge".to_owned(),
        });
    };
    let dtype = IndexedDataset::open(first)?.dtype();
    let mut builder = if multimodal {
        IndexedDatasetBuilder::create_multimodal(output_prefix, dtype)?
    } else {
        IndexedDatasetBuilder::create(output_prefix, dtype)?
    };
    for prefix in &prefixes {
        builder.add_index(prefix)?;
    }
    builder.finalize()?;
    Ok(prefixes.into_iter().collect())
}
