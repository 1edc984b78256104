//! Tokenizers with Megatron's semantics: the same ids, `eod`, `vocab_size` and `pad` as
//! Megatron-LM's `build_tokenizer` for the same files, so that preprocessed datasets
//! are byte-identical.
//!
//! The modules are layered, each using only those below it: `error` (`TokenizerError`)
//! and `api` (the `Tokenizer` trait) at the bottom; the concrete tokenizers (`gpt2`,
//! `sentencepiece`, `huggingface`, `null`) and their parts above them; `build` (the
//! tokenizer types and flags, `build_tokenizer`) on top. This module only declares and
//! re-exports.

mod api;
mod build;
mod error;
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

pub use api::Tokenizer;
pub use build::{build_tokenizer, megatron_tokenizer_identifiers, TokenizerArgs, TokenizerType};
pub use error::{TokenizerArgument, TokenizerError, UnsupportedTokenizer};
pub use gpt2::{Gpt2BpeTokenizer, NoEndOfText};
pub use huggingface::{train_byte_level_bpe, HuggingFaceTokenizer, TrainedTokenizer};
pub use null::NullTokenizer;
pub use pretokenize::gpt2_pretokens;
pub use sentencepiece::{
    SentencePieceFlavor, SentencePieceModel, SentencePieceTokenizer, SpecialSentencePieceTokenizer,
};
