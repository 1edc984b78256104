//! Tokenizers with Megatron's semantics: the same ids, `eod`, `vocab_size` and `pad` as
//! Megatron-LM's `build_tokenizer` for the same files, so that preprocessed datasets
//! are byte-identical.

mod gpt2;
mod huggingface;
mod null;
mod pretokenize;
mod sentencepiece;
mod sentencepiece_bpe;
mod sentencepiece_norm;
mod sentencepiece_unigram;
mod sentencepiece_vocab;
mod unicode_class;
mod word_cache;

pub use gpt2::{Gpt2BpeTokenizer, NoEndOfText};
pub use huggingface::{train_byte_level_bpe, HuggingFaceTokenizer, TrainedTokenizer};
pub use null::NullTokenizer;
pub use sentencepiece::{
    SentencePieceFlavor, SentencePieceModel, SentencePieceTokenizer, SpecialSentencePieceTokenizer,
};

use std::path::{Path, PathBuf};
use std::str::FromStr;

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

/// Text ↔ token ids, as one of Megatron's tokenizer types.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text` (Megatron's `tokenizer.tokenize`).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError>;
    /// Text of `ids`.
    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError>;
    /// Megatron's `vocab_size`: un-padded, and the size the `.bin` dtype is chosen from.
    fn vocab_size(&self) -> usize;
    /// The end-of-document id `--append-eod` appends, if the type has one.
    fn eod(&self) -> Option<u32>;
    /// The pad id the GPT dataset uses, if any (Megatron's −1 otherwise).
    fn pad(&self) -> Option<u32>;
    /// Why this tokenizer encodes through a library rather than synerfuse's own encoder
    /// (the model's property the own encoders do not cover), if it does.
    fn library_reason(&self) -> Option<&'static str> {
        None
    }
}

/// Megatron's `--tokenizer-type` values that synerfuse implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerType {
    /// Byte-level BPE from `--vocab-file` (vocab.json) and `--merge-file` (merges.txt).
    Gpt2Bpe,
    /// Integers separated by spaces; `--vocab-size`.
    Null,
    /// SentencePiece `--tokenizer-model` with BOS before every text (LLaMA-2).
    Llama2,
    /// SentencePiece `--tokenizer-model`, plain ids.
    GptSentencePiece,
    /// SentencePiece `--tokenizer-model` with Megatron's special-token strings.
    SentencePiece,
    /// A Hugging Face `tokenizer.json` as `--tokenizer-model` (Megatron accepts it for
    /// training only; synerfuse also preprocesses with it).
    HuggingFace,
}

impl TokenizerType {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            TokenizerType::Gpt2Bpe => "GPT2BPETokenizer",
            TokenizerType::Null => "NullTokenizer",
            TokenizerType::Llama2 => "Llama2Tokenizer",
            TokenizerType::GptSentencePiece => "GPTSentencePieceTokenizer",
            TokenizerType::SentencePiece => "SentencePieceTokenizer",
            TokenizerType::HuggingFace => "HuggingFaceTokenizer",
        }
    }
}

impl FromStr for TokenizerType {
    type Err = TokenizerError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "GPT2BPETokenizer" => Ok(TokenizerType::Gpt2Bpe),
            "NullTokenizer" => Ok(TokenizerType::Null),
            "Llama2Tokenizer" => Ok(TokenizerType::Llama2),
            "GPTSentencePieceTokenizer" => Ok(TokenizerType::GptSentencePiece),
            "SentencePieceTokenizer" => Ok(TokenizerType::SentencePiece),
            "HuggingFaceTokenizer" => Ok(TokenizerType::HuggingFace),
            other => Err(TokenizerError::UnsupportedType {
                name: other.to_owned(),
                reason: match other {
                    "BertWordPieceLowerCase" | "BertWordPieceCase" => {
                        UnsupportedTokenizer::WordPiece
                    }
                    "Llama3Tokenizer" | "MistralTokenizer" => UnsupportedTokenizer::NotYet,
                    _ => UnsupportedTokenizer::Unknown,
                },
            }),
        }
    }
}

/// The tokenizer flags of `preprocess` and friends, as Megatron names them.
#[derive(Debug, Clone, Default)]
pub struct TokenizerArgs {
    /// `--tokenizer-model`.
    pub tokenizer_model: Option<PathBuf>,
    /// `--vocab-file`.
    pub vocab_file: Option<PathBuf>,
    /// `--merge-file`.
    pub merge_file: Option<PathBuf>,
    /// `--vocab-size` (NullTokenizer).
    pub vocab_size: Option<usize>,
}

/// The tokenizer's part of Megatron's cache descriptions (`MegatronTokenizer.unique_identifiers`):
/// the Python class name, the paths exactly as typed on the command line, and the keyword
/// arguments as strings. It names caches, so nothing is canonicalised.
pub fn megatron_tokenizer_identifiers(
    kind: TokenizerType,
    args: &TokenizerArgs,
) -> Result<crate::gpt::PyValue, TokenizerError> {
    use crate::gpt::PyValue;
    let need = |value: &Option<PathBuf>, argument| {
        required(kind, value, argument).map(|p| PyValue::Str(p.to_string_lossy().into_owned()))
    };
    let (class, paths, options): (&str, Vec<PyValue>, Vec<(String, PyValue)>) = match kind {
        TokenizerType::Gpt2Bpe => (
            "_GPT2BPETokenizer",
            vec![
                need(&args.vocab_file, TokenizerArgument::VocabFile)?,
                need(&args.merge_file, TokenizerArgument::MergeFile)?,
            ],
            vec![],
        ),
        TokenizerType::Null => {
            let vocab_size = required(kind, &args.vocab_size, TokenizerArgument::VocabSize)?;
            (
                "_NullTokenizer",
                vec![PyValue::None],
                vec![("vocab_size".into(), PyValue::Str(vocab_size.to_string()))],
            )
        }
        TokenizerType::Llama2 | TokenizerType::GptSentencePiece | TokenizerType::SentencePiece => (
            match kind {
                TokenizerType::Llama2 => "_Llama2Tokenizer",
                TokenizerType::GptSentencePiece => "_GPTSentencePieceTokenizer",
                _ => "_SentencePieceTokenizer",
            },
            vec![need(
                &args.tokenizer_model,
                TokenizerArgument::TokenizerModel,
            )?],
            // `--vocab-extra-ids` is 0 (synerfuse has no T5 sentinels).
            vec![("vocab_extra_ids".into(), PyValue::str("0"))],
        ),
        TokenizerType::HuggingFace => (
            "_HuggingFaceTokenizer",
            vec![need(
                &args.tokenizer_model,
                TokenizerArgument::TokenizerModel,
            )?],
            vec![],
        ),
    };
    let mut dict = vec![
        ("class".to_owned(), PyValue::str(class)),
        ("tokenizer_path".to_owned(), PyValue::List(paths)),
    ];
    dict.extend(options);
    Ok(PyValue::Dict(dict))
}

/// `value`, or the error naming the `argument` that `kind` needs.
fn required<T: Clone>(
    kind: TokenizerType,
    value: &Option<T>,
    argument: TokenizerArgument,
) -> Result<T, TokenizerError> {
    value.clone().ok_or(TokenizerError::MissingArgument {
        tokenizer: kind.name(),
        argument,
    })
}

/// Builds a tokenizer of `kind` from its flags, as Megatron's `build_tokenizer`.
pub fn build_tokenizer(
    kind: TokenizerType,
    args: &TokenizerArgs,
) -> Result<Box<dyn Tokenizer>, TokenizerError> {
    let need = |value: &Option<PathBuf>, argument| required(kind, value, argument);
    Ok(match kind {
        TokenizerType::Gpt2Bpe => Box::new(Gpt2BpeTokenizer::from_files(
            &need(&args.vocab_file, TokenizerArgument::VocabFile)?,
            &need(&args.merge_file, TokenizerArgument::MergeFile)?,
        )?),
        TokenizerType::Llama2 => Box::new(SentencePieceTokenizer::open(
            &need(&args.tokenizer_model, TokenizerArgument::TokenizerModel)?,
            SentencePieceFlavor::Llama2,
        )?),
        TokenizerType::GptSentencePiece => Box::new(SentencePieceTokenizer::open(
            &need(&args.tokenizer_model, TokenizerArgument::TokenizerModel)?,
            SentencePieceFlavor::Gpt,
        )?),
        TokenizerType::SentencePiece => Box::new(SpecialSentencePieceTokenizer::open(&need(
            &args.tokenizer_model,
            TokenizerArgument::TokenizerModel,
        )?)?),
        TokenizerType::HuggingFace => Box::new(HuggingFaceTokenizer::open(&need(
            &args.tokenizer_model,
            TokenizerArgument::TokenizerModel,
        )?)?),
        TokenizerType::Null => Box::new(NullTokenizer::new(required(
            kind,
            &args.vocab_size,
            TokenizerArgument::VocabSize,
        )?)),
    })
}

/// GPT-2 pre-tokenization (exposed for differential tests against Megatron's regex).
pub fn gpt2_pretokens(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    pretokenize::for_each_pretoken(text, |p| pieces.push(p));
    pieces
}
