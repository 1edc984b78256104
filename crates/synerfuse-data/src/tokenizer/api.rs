//! The interface every tokenizer implements, whatever its type.

use super::error::TokenizerError;

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
