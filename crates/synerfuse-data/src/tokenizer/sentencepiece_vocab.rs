//! What the Rust SentencePiece encoders share, whatever the model type: the model's
//! fields, its piece types, and what the library does around a segmentation
//! (`SentencePieceProcessor::Encode`): normalize first; afterwards, unknown pieces
//! become bytes (byte fallback) or, without it, runs of them merge into one.

pub(super) use super::sentencepiece_norm::SPACE;
use super::sentencepiece_norm::{CharsMap, Normalizer, UserPieces};
use std::collections::HashMap;

/// Piece types of `ModelProto.SentencePiece.Type`.
pub(super) const NORMAL: u64 = 1;
pub(super) const UNKNOWN: u64 = 2;
pub(super) const USER_DEFINED: u64 = 4;
pub(super) const UNUSED: u64 = 5;

/// `TrainerSpec.ModelType`.
pub(super) const UNIGRAM: u64 = 1;
pub(super) const BPE: u64 = 2;

/// What the encoders need from a `ModelProto`.
pub(super) struct ModelSpec {
    /// (piece, score, type) by id.
    pub pieces: Vec<(String, f32, u64)>,
    /// `TrainerSpec.model_type`.
    pub model_type: u64,
    pub byte_fallback: bool,
    pub treat_whitespace_as_suffix: bool,
    /// `NormalizerSpec.precompiled_charsmap` (empty: the identity).
    pub precompiled_charsmap: Vec<u8>,
    pub add_dummy_prefix: bool,
    pub remove_extra_whitespaces: bool,
    pub escape_whitespaces: bool,
}

impl ModelSpec {
    /// The pieces of `kind`, with their ids.
    pub(super) fn pieces_of(&self, kind: u64) -> impl Iterator<Item = (u32, &str, f32)> {
        (self.pieces.iter().enumerate())
            .filter(move |(_, (_, _, k))| *k == kind)
            .map(|(id, (piece, score, _))| (id as u32, piece.as_str(), *score))
    }

    /// Whether a piece of `kinds` has `▁` after its first character, so that a piece
    /// may span the start of a word.
    pub(super) fn spans_words(&self, kinds: &[u64]) -> bool {
        self.pieces.iter().any(|(piece, _, kind)| {
            let first = piece.chars().next().map_or(0, char::len_utf8);
            kinds.contains(kind) && piece[first..].contains(SPACE)
        })
    }
}

/// A model's normalizer and the pieces looked up outside its segmentation.
pub(super) struct Vocabulary {
    pub normalizer: Normalizer,
    /// UNKNOWN, CONTROL and BYTE pieces, looked up before the others, as the library does.
    reserved: HashMap<String, u32>,
    pub unk_id: u32,
    byte_fallback: bool,
    /// Id of `<0xXX>` for each byte (unknown when the model lacks it).
    byte_ids: Vec<u32>,
}

impl Vocabulary {
    /// The vocabulary of `spec`, or which of its properties the Rust encoders lack.
    pub(super) fn from_spec(spec: &ModelSpec) -> Result<Self, &'static str> {
        if spec.treat_whitespace_as_suffix {
            return Err("whitespace treated as a suffix");
        }
        let map = match spec.precompiled_charsmap.is_empty() {
            true => None,
            false => Some(
                CharsMap::parse(&spec.precompiled_charsmap)
                    .ok_or("a precompiled normalization map it cannot read")?,
            ),
        };
        let mut reserved = HashMap::new();
        let mut others = HashMap::new();
        let mut unk_id = None;
        for (id, (piece, _, kind)) in spec.pieces.iter().enumerate() {
            let id = id as u32;
            match *kind {
                NORMAL | USER_DEFINED | UNUSED => {
                    others.entry(piece.as_str()).or_insert(id);
                }
                kind => {
                    if kind == UNKNOWN {
                        unk_id = Some(id);
                    }
                    reserved.entry(piece.clone()).or_insert(id);
                }
            }
        }
        let unk_id = unk_id.ok_or("no unknown piece")?;
        let byte_ids = (0..=255u8)
            .map(|b| {
                let piece = format!("<0x{b:02X}>");
                (reserved.get(&piece).or_else(|| others.get(piece.as_str())))
                    .copied()
                    .unwrap_or(unk_id)
            })
            .collect();
        let user_pieces = UserPieces::new(spec.pieces_of(USER_DEFINED).map(|(_, p, _)| p));
        Ok(Self {
            normalizer: Normalizer {
                map,
                user_pieces,
                add_dummy_prefix: spec.add_dummy_prefix,
                remove_extra_whitespaces: spec.remove_extra_whitespaces,
                escape_whitespaces: spec.escape_whitespaces,
            },
            reserved,
            unk_id,
            byte_fallback: spec.byte_fallback,
            byte_ids,
        })
    }

    /// The id of a reserved piece.
    pub(super) fn reserved_id(&self, piece: &str) -> Option<u32> {
        self.reserved.get(piece).copied()
    }

    /// Appends a segmented piece's id, or its bytes' when it is unknown and the model
    /// falls back to bytes.
    pub(super) fn push_piece(&self, piece: &str, id: u32, out: &mut Vec<u32>) {
        if id == self.unk_id && self.byte_fallback {
            out.extend(piece.bytes().map(|b| self.byte_ids[b as usize]));
        } else {
            out.push(id);
        }
    }

    /// Merges each run of unknown ids in `out[start..]` into one, as the library does
    /// without byte fallback (across words too).
    pub(super) fn merge_unknowns(&self, out: &mut Vec<u32>, start: usize) {
        if self.byte_fallback {
            return;
        }
        let mut write = start;
        for read in start..out.len() {
            if out[read] == self.unk_id && write > start && out[write - 1] == self.unk_id {
                continue;
            }
            out[write] = out[read];
            write += 1;
        }
        out.truncate(write);
    }
}

/// Splits a normalized text before every `▁`.
pub(super) fn split_words(normalized: &str) -> impl Iterator<Item = &str> {
    let mut rest = normalized;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = next_space(rest.as_bytes(), 1).unwrap_or(rest.len());
        let (word, tail) = rest.split_at(end);
        rest = tail;
        Some(word)
    })
}

/// The first `▁` (E2 96 81) in `bytes` at or after `from`: a byte scan for its lead
/// byte, which `str::find` would redo with a new searcher for every word.
fn next_space(bytes: &[u8], from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(offset) = bytes.get(at..)?.iter().position(|&b| b == 0xE2) {
        at += offset;
        if bytes.get(at + 1..at + 3) == Some(&[0x96, 0x81]) {
            return Some(at);
        }
        at += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_before_each_escaped_space() {
        let words: Vec<&str> = split_words("ab▁cd▁▁e").collect();
        assert_eq!(words, ["ab", "▁cd", "▁", "▁e"]);
        assert_eq!(split_words("").count(), 0);
    }
}
