//! Megatron's `NullTokenizer`: the text already is token ids.

use super::api::Tokenizer;
use super::error::TokenizerError;

/// Space-separated integers in, the same integers out; `eod` is `vocab_size` and the
/// reported vocabulary is one larger, as in Megatron.
pub struct NullTokenizer {
    vocab_size: usize,
}

impl NullTokenizer {
    /// A null tokenizer for ids below `vocab_size` (`--vocab-size`).
    pub fn new(vocab_size: usize) -> Self {
        Self { vocab_size }
    }
}

impl Tokenizer for NullTokenizer {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        // Python: `[int(x) for x in text.split(' ')]`, so "" and double spaces fail.
        text.split(' ')
            .map(|piece| {
                piece.trim().parse::<u32>().map_err(|_| TokenizerError::BadText {
                    text: text.chars().take(40).collect(),
                    problem: format!("{piece:?} is not a non-negative integer (NullTokenizer takes space-separated ids)"),
                })
            })
            .collect()
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size + 1
    }

    fn eod(&self) -> Option<u32> {
        Some(self.vocab_size as u32)
    }

    fn pad(&self) -> Option<u32> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_semantics() {
        let t = NullTokenizer::new(786);
        assert_eq!(t.tokenize("1 2 785").unwrap(), vec![1, 2, 785]);
        assert!(t.tokenize("").is_err());
        assert!(t.tokenize("1  2").is_err());
        assert_eq!((t.vocab_size(), t.eod()), (787, Some(786)));
    }
}
