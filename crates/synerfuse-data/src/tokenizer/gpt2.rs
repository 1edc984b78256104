//! Megatron's `GPT2BPETokenizer`: byte-level BPE from `vocab.json` + `merges.txt`.
//!
//! Same ids as Megatron's `gpt2_tokenization.py`, including its quirks: the merges
//! file's first line *and last line* are dropped (a file without a trailing newline
//! loses its last merge), special tokens in the text are not parsed, and a piece
//! missing from the vocabulary becomes id 0. Speed comes from a scanner instead of a
//! regex, merges over interned symbol ids, and a per-thread cache of pre-tokens.

use super::api::Tokenizer;
use super::error::TokenizerError;
use super::pretokenize::{for_each_llama3_pretoken, for_each_pretoken};
use super::word_cache::{each_word, Ids, ThreadCaches};
use std::collections::HashMap;
use std::path::Path;

/// GPT-2's reversible map from bytes to printable characters.
fn bytes_to_unicode() -> [char; 256] {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut table = ['\0'; 256];
    for (b, c) in printable.into_iter().zip(chars) {
        table[b as usize] = char::from_u32(c).expect("valid code point");
    }
    table
}

/// How text splits into pre-tokens before byte-level BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pretokens {
    /// GPT-2's regex.
    Gpt2,
    /// LLaMA-3's regex ([`super::pretokenize::LLAMA3_PATTERN`]).
    Llama3,
}

/// Megatron's GPT-2 byte-level BPE tokenizer.
pub struct Gpt2BpeTokenizer {
    encoder: HashMap<String, u32>,
    decoder: HashMap<u32, String>,
    /// Vocabulary id of each interned symbol (0 when the vocabulary lacks it).
    symbol_ids: Vec<u32>,
    /// Symbol of each byte.
    byte_symbols: [u32; 256],
    /// (left, right) symbols → (rank, merged symbol).
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_decoder: HashMap<char, u8>,
    /// The printable character of each byte.
    byte_chars: [char; 256],
    eod: u32,
    pretokens: Pretokens,
    /// A pre-token in the vocabulary is one token, whatever the merges (Hugging Face's
    /// `ignore_merges`, as LLaMA-3 sets).
    ignore_merges: bool,
    /// Pre-tokens' ids, per thread.
    cache: ThreadCaches<Ids>,
}

/// A GPT-2 vocabulary without its end-of-document token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the vocabulary has no <|endoftext|> token (GPT-2's end of document)")]
pub struct NoEndOfText;

impl Gpt2BpeTokenizer {
    /// Loads `vocab.json` and `merges.txt`.
    pub fn from_files(vocab_file: &Path, merge_file: &Path) -> Result<Self, TokenizerError> {
        let vocab = std::fs::read_to_string(vocab_file).map_err(TokenizerError::io(vocab_file))?;
        let merges = std::fs::read_to_string(merge_file).map_err(TokenizerError::io(merge_file))?;
        let encoder: HashMap<String, u32> =
            serde_json::from_str(&vocab).map_err(|e| TokenizerError::BadFile {
                path: vocab_file.to_path_buf(),
                problem: format!("not a JSON object of token → id: {e}"),
            })?;
        Self::new(encoder, &merges).map_err(|e| TokenizerError::BadFile {
            path: vocab_file.to_path_buf(),
            problem: e.to_string(),
        })
    }

    /// Builds the tokenizer from a vocabulary and the text of a merges file.
    pub fn new(encoder: HashMap<String, u32>, merges_text: &str) -> Result<Self, NoEndOfText> {
        let eod = *encoder.get("<|endoftext|>").ok_or(NoEndOfText)?;
        Ok(Self::with_eod(encoder, merges_text, eod))
    }

    /// [`Self::new`] with another end-of-document id (a Hugging Face tokenizer's EOS).
    pub fn with_eod(encoder: HashMap<String, u32>, merges_text: &str, eod: u32) -> Self {
        let byte_chars = bytes_to_unicode();
        let mut interner: HashMap<String, u32> = HashMap::new();
        let mut symbol_ids = Vec::new();
        let mut intern = |s: &str| -> u32 {
            if let Some(&id) = interner.get(s) {
                return id;
            }
            let id = symbol_ids.len() as u32;
            symbol_ids.push(encoder.get(s).copied().unwrap_or(0));
            interner.insert(s.to_owned(), id);
            id
        };
        let mut byte_symbols = [0u32; 256];
        for (b, c) in byte_chars.iter().enumerate() {
            byte_symbols[b] = intern(&c.to_string());
        }
        // Python: `read().split('\n')[1:-1]`, each line `tuple(line.split())`, ranks by
        // position; a later duplicate overrides, lines that are not pairs never match.
        let lines: Vec<&str> = merges_text.split('\n').collect();
        let kept = if lines.len() >= 2 {
            &lines[1..lines.len() - 1]
        } else {
            &[][..]
        };
        let mut merges = HashMap::new();
        for (rank, line) in kept.iter().enumerate() {
            let mut parts = line.split_whitespace();
            if let (Some(a), Some(b), None) = (parts.next(), parts.next(), parts.next()) {
                let merged = intern(&format!("{a}{b}"));
                let key = (intern(a), intern(b));
                merges.insert(key, (rank as u32, merged));
            }
        }
        let decoder = encoder.iter().map(|(k, &v)| (v, k.clone())).collect();
        let byte_decoder = byte_chars
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Self {
            encoder,
            decoder,
            symbol_ids,
            byte_symbols,
            merges,
            byte_decoder,
            byte_chars,
            eod,
            pretokens: Pretokens::Gpt2,
            ignore_merges: false,
            cache: ThreadCaches::default(),
        }
    }

    /// This tokenizer splitting text as `pretokens` and, with `ignore_merges`, taking a
    /// pre-token found in the vocabulary as one token (a `tokenizer.json`'s settings).
    pub(super) fn with_pretokens(self, pretokens: Pretokens, ignore_merges: bool) -> Self {
        Self {
            pretokens,
            ignore_merges,
            ..self
        }
    }

    /// BPE of one pre-token: repeatedly merge every occurrence of the lowest-ranked pair.
    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        if self.ignore_merges {
            let mapped: String = piece.bytes().map(|b| self.byte_chars[b as usize]).collect();
            if let Some(&id) = self.encoder.get(&mapped) {
                out.push(id);
                return;
            }
        }
        let mut word: Vec<u32> = piece
            .bytes()
            .map(|b| self.byte_symbols[b as usize])
            .collect();
        let mut next = Vec::with_capacity(word.len());
        while word.len() > 1 {
            let best = word
                .windows(2)
                .filter_map(|pair| {
                    self.merges
                        .get(&(pair[0], pair[1]))
                        .map(|&(rank, merged)| (rank, pair[0], pair[1], merged))
                })
                .min_by_key(|&(rank, ..)| rank);
            let Some((_, first, second, merged)) = best else {
                break;
            };
            next.clear();
            let mut i = 0;
            while i < word.len() {
                if word[i] == first && i + 1 < word.len() && word[i + 1] == second {
                    next.push(merged);
                    i += 2;
                } else {
                    next.push(word[i]);
                    i += 1;
                }
            }
            std::mem::swap(&mut word, &mut next);
        }
        out.extend(word.iter().map(|&s| self.symbol_ids[s as usize]));
    }
}

impl Tokenizer for Gpt2BpeTokenizer {
    fn tokenize<'t>(&self, text: &'t str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        self.cache.with(|cache| {
            let pieces = |feed: &mut dyn FnMut(&'t str)| match self.pretokens {
                Pretokens::Gpt2 => for_each_pretoken(text, feed),
                Pretokens::Llama3 => for_each_llama3_pretoken(text, feed),
            };
            each_word(cache, pieces, |cache, piece| {
                if let Some(hit) = cache.get(piece) {
                    ids.extend_from_slice(hit.as_slice());
                    return;
                }
                let start = ids.len();
                self.bpe(piece, &mut ids);
                cache.insert(piece, Ids::from(&ids[start..]));
            });
        });
        Ok(ids)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for id in ids {
            let token = self
                .decoder
                .get(id)
                .ok_or(TokenizerError::UnknownId { id: *id })?;
            bytes.extend(token.chars().filter_map(|c| self.byte_decoder.get(&c)));
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> usize {
        self.encoder.len()
    }

    fn eod(&self) -> Option<u32> {
        Some(self.eod)
    }

    fn pad(&self) -> Option<u32> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Gpt2BpeTokenizer {
        let mut encoder: HashMap<String, u32> = HashMap::new();
        for (i, c) in bytes_to_unicode().iter().enumerate() {
            encoder.insert(c.to_string(), i as u32);
        }
        for (i, t) in ["he", "hel", "hell", "hello", "Ġw", "Ġwo", "<|endoftext|>"]
            .iter()
            .enumerate()
        {
            encoder.insert(t.to_string(), 256 + i as u32);
        }
        // First line is a header; the last line (no trailing newline) is dropped.
        let merges = "#version: 0.2\nh e\nhe l\nhel l\nhell o\nĠ w\nĠw o";
        Gpt2BpeTokenizer::new(encoder, merges).unwrap()
    }

    #[test]
    fn merges_and_drops_the_last_merge_line() {
        let t = tiny();
        // "hello" merges fully; " wo" stops at "Ġw" + "o" since "Ġw o" was the dropped last line.
        assert_eq!(t.tokenize("hello wo").unwrap(), vec![259, 260, b'o' as u32]);
        assert_eq!(
            t.detokenize(&t.tokenize("hello wo").unwrap()).unwrap(),
            "hello wo"
        );
        assert_eq!(t.eod(), Some(262));
        // Specials are not parsed: they are BPE'd like any text.
        assert_ne!(t.tokenize("<|endoftext|>").unwrap(), vec![262]);
    }

    #[test]
    fn round_trips_arbitrary_bytes() {
        let t = tiny();
        let text = "Ünïcödé\t\n  ✓ 12";
        assert_eq!(t.detokenize(&t.tokenize(text).unwrap()).unwrap(), text);
    }
}
