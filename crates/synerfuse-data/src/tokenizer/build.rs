//! Megatron's `--tokenizer-type` and tokenizer flags: building a tokenizer by type (the
//! factory above the concrete tokenizers, as Megatron's `build_tokenizer`) and the
//! tokenizer's part of Megatron's cache descriptions.

use super::api::Tokenizer;
use super::error::{TokenizerArgument, TokenizerError, UnsupportedTokenizer};
use super::gpt2::Gpt2BpeTokenizer;
use super::huggingface::HuggingFaceTokenizer;
use super::null::NullTokenizer;
use super::sentencepiece::{
    SentencePieceFlavor, SentencePieceTokenizer, SpecialSentencePieceTokenizer,
};
use std::path::PathBuf;
use std::str::FromStr;

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
