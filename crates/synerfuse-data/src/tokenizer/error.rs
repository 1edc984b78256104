//! The errors of the tokenizers: why one could not be built or used, with the argument
//! or the tokenizer type at fault.

use std::path::{Path, PathBuf};

/// Why a tokenizer could not be built or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// An argument this tokenizer type requires is missing.
    #[error("the {tokenizer} tokenizer needs its {argument}")]
    MissingArgument {
        /// The tokenizer type.
        tokenizer: &'static str,
        /// The missing argument.
        argument: TokenizerArgument,
    },
    /// A tokenizer file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A tokenizer file has the wrong content.
    #[error("{path}: {problem}")]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// Text the tokenizer cannot encode (e.g. a non-integer for the null tokenizer).
    #[error("cannot tokenize {text:?}: {problem}")]
    BadText {
        /// The offending text (shortened).
        text: String,
        /// Why.
        problem: String,
    },
    /// An id outside the vocabulary.
    #[error("token id {id} is not in the vocabulary")]
    UnknownId {
        /// The id.
        id: u32,
    },
    /// A tokenizer type that does not exist or is not supported here.
    #[error("`{name}`: {reason}")]
    UnsupportedType {
        /// The name given.
        name: String,
        /// Why it cannot be used.
        reason: UnsupportedTokenizer,
    },
}

/// Why a tokenizer type cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UnsupportedTokenizer {
    /// BERT's WordPiece tokenizers.
    #[error("BERT WordPiece is not implemented in synerfuse")]
    WordPiece,
    /// Megatron's Llama 3 and Mistral tokenizers.
    #[error("not implemented in synerfuse yet (Llama3 and Mistral need their own packages in Megatron too; a tokenizer.json of them works as HuggingFaceTokenizer)")]
    NotYet,
    /// A name Megatron does not know either.
    #[error("unknown; expected GPT2BPETokenizer, Llama2Tokenizer, GPTSentencePieceTokenizer, SentencePieceTokenizer, HuggingFaceTokenizer or NullTokenizer")]
    Unknown,
}

/// An argument of a tokenizer (Megatron's `--vocab-file`, `--merge-file`,
/// `--tokenizer-model`, `--vocab-size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerArgument {
    /// A vocabulary file (GPT-2's `vocab.json`).
    VocabFile,
    /// A merges file (GPT-2's `merges.txt`).
    MergeFile,
    /// A model file (SentencePiece's `.model`, a `tokenizer.json`).
    TokenizerModel,
    /// A vocabulary size (the null tokenizer).
    VocabSize,
}

impl std::fmt::Display for TokenizerArgument {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenizerArgument::VocabFile => "vocabulary file",
            TokenizerArgument::MergeFile => "merges file",
            TokenizerArgument::TokenizerModel => "model file",
            TokenizerArgument::VocabSize => "vocabulary size",
        })
    }
}

impl TokenizerError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TokenizerError + '_ {
        move |source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
