//! The errors of this crate: each names the file and the field or constraint at fault.

use crate::DType;
use std::path::PathBuf;

/// Why a dataset could not be read, written or built.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An operating-system error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The `.idx` file is not a Megatron index, or is damaged.
    #[error("{path}: {field}: {problem}")]
    CorruptIndex {
        /// The `.idx` (or `.bin`) file.
        path: PathBuf,
        /// The header field or array at fault, e.g. `sequence_pointers[12]`.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Two datasets, or a dataset and a request, disagree on the element type.
    #[error("{path}: dtype is {actual:?}, expected {expected:?}")]
    DTypeMismatch {
        /// The dataset whose dtype was unexpected.
        path: PathBuf,
        /// What the caller or the other dataset has.
        expected: DType,
        /// What this dataset has.
        actual: DType,
    },
    /// A sequence, document or token range outside the dataset.
    #[error("{path}: {what} out of range: {detail}")]
    OutOfRange {
        /// The dataset prefix.
        path: PathBuf,
        /// `sequence`, `document` or `tokens`.
        what: &'static str,
        /// The index asked for and the bound it broke.
        detail: String,
    },
    /// A token id that the dataset's dtype cannot store.
    #[error("{path}: token id {value} does not fit dtype {dtype:?}")]
    TokenOutOfRange {
        /// The dataset being written.
        path: PathBuf,
        /// The token id.
        value: i64,
        /// The dataset's element type.
        dtype: DType,
    },
    /// A builder call that breaks the format's rules (e.g. modes on a text-only dataset).
    #[error("{path}: {problem}")]
    InvalidUse {
        /// The dataset being written.
        path: PathBuf,
        /// What was wrong.
        problem: String,
    },
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> DataError {
        let path = path.into();
        move |source| DataError::Io { path, source }
    }

    pub(crate) fn corrupt(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        problem: impl Into<String>,
    ) -> DataError {
        DataError::CorruptIndex {
            path: path.into(),
            field: field.into(),
            problem: problem.into(),
        }
    }
}
