//! SentencePiece BPE encoding in Rust, word by word with a cache: the LLaMA-2 case.
//!
//! The library merges the highest-scoring adjacent pair of the whole normalized text
//! until none is a piece. When no piece has `▁` (the escaped space) after its first
//! character, no merge can cross the start of a `▁`, so the text splits there into
//! words that merge independently; a word's ids can then be cached, as for GPT-2.
//! [`SentencePieceBpe::from_model`] accepts a model only when that, and everything else
//! this encoder reproduces, holds: a BPE model (its normalization, a precompiled map such
//! as `nmt_nfkc` or the identity, applied by `sentencepiece_norm` as the library applies
//! it), spaces escaped as a prefix `▁`, no user-defined or unused pieces. Other models go through
//! the library. Results equal the library's `EncodeAsIds`, including byte fallback and
//! the merging of consecutive unknown pieces (tested against it).

use super::sentencepiece_norm::{CharsMap, Normalizer};
use std::cell::RefCell;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};

const SPACE: &str = "\u{2581}";

/// Piece types of `ModelProto.SentencePiece.Type`.
pub(super) const NORMAL: u64 = 1;
pub(super) const UNKNOWN: u64 = 2;
pub(super) const USER_DEFINED: u64 = 4;
pub(super) const UNUSED: u64 = 5;

/// What the encoder needs from a `ModelProto`.
pub(super) struct ModelSpec {
    /// (piece, score, type) by id.
    pub pieces: Vec<(String, f32, u64)>,
    /// `TrainerSpec.model_type` (BPE = 2).
    pub model_type: u64,
    pub byte_fallback: bool,
    pub treat_whitespace_as_suffix: bool,
    /// `NormalizerSpec.precompiled_charsmap` (empty: the identity).
    pub precompiled_charsmap: Vec<u8>,
    pub add_dummy_prefix: bool,
    pub remove_extra_whitespaces: bool,
    pub escape_whitespaces: bool,
}

static NEXT_INSTANCE: AtomicUsize = AtomicUsize::new(0);
type WordCache = HashMap<Box<str>, Box<[u32]>>;
thread_local! {
    static CACHE: RefCell<HashMap<usize, WordCache>> = RefCell::new(HashMap::new());
}
const CACHE_LIMIT: usize = 1 << 20;

/// A SentencePiece BPE model that can be encoded word by word.
pub(super) struct SentencePieceBpe {
    /// NORMAL pieces (the only mergeable ones here): id and score.
    pieces: HashMap<String, (u32, f32)>,
    /// UNKNOWN, CONTROL and BYTE pieces, looked up first, as the library does.
    reserved: HashMap<String, u32>,
    unk_id: u32,
    byte_fallback: bool,
    /// Id of `<0xXX>` for each byte (unknown when the model lacks it).
    byte_ids: Vec<u32>,
    normalizer: Normalizer,
    instance: usize,
}

/// A candidate merge: the library's `SymbolPair` and its heap order (higher score
/// first, then the leftmost).
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pair {}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pair {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl SentencePieceBpe {
    /// The encoder for `spec`, or which of its properties needs the library.
    pub(super) fn from_model(spec: &ModelSpec) -> Result<Self, &'static str> {
        if spec.model_type != 2 {
            return Err("not a BPE model (Unigram, word or character)");
        }
        if !spec.escape_whitespaces || spec.treat_whitespace_as_suffix {
            return Err("whitespace not escaped as a prefix `▁`");
        }
        let map = match spec.precompiled_charsmap.is_empty() {
            true => None,
            false => Some(
                CharsMap::parse(&spec.precompiled_charsmap)
                    .ok_or("a precompiled normalization map it cannot read")?,
            ),
        };
        let mut pieces = HashMap::new();
        let mut reserved = HashMap::new();
        let mut unk_id = None;
        for (id, (piece, score, kind)) in spec.pieces.iter().enumerate() {
            let id = id as u32;
            match *kind {
                NORMAL => {
                    // A `▁` after the first character would let merges cross words.
                    let first = piece.chars().next().map_or(0, char::len_utf8);
                    if piece[first..].contains(SPACE) {
                        return Err("pieces with `▁` inside (merges across words)");
                    }
                    pieces.entry(piece.clone()).or_insert((id, *score));
                }
                USER_DEFINED | UNUSED => return Err("user-defined or unused pieces"),
                kind => {
                    if kind == UNKNOWN {
                        unk_id = Some(id);
                    }
                    reserved.entry(piece.clone()).or_insert(id);
                }
            }
        }
        let unk_id = unk_id.ok_or("no unknown piece")?;
        let lookup = |piece: &str| {
            reserved
                .get(piece)
                .or_else(|| pieces.get(piece).map(|(id, _)| id))
                .copied()
        };
        let byte_ids = (0..=255u8)
            .map(|b| lookup(&format!("<0x{b:02X}>")).unwrap_or(unk_id))
            .collect();
        Ok(Self {
            pieces,
            reserved,
            unk_id,
            byte_fallback: spec.byte_fallback,
            byte_ids,
            normalizer: Normalizer {
                map,
                add_dummy_prefix: spec.add_dummy_prefix,
                remove_extra_whitespaces: spec.remove_extra_whitespaces,
                escape_whitespaces: spec.escape_whitespaces,
            },
            instance: NEXT_INSTANCE.fetch_add(1, AtomicOrdering::Relaxed),
        })
    }

    /// Appends the ids of `text`, as the library's `EncodeAsIds`.
    pub(super) fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let normalized = self.normalizer.normalize(text);
        let start = out.len();
        CACHE.with(|cache| {
            let mut caches = cache.borrow_mut();
            let cache = caches.entry(self.instance).or_default();
            for word in split_words(&normalized) {
                if let Some(hit) = cache.get(word) {
                    out.extend_from_slice(hit);
                    continue;
                }
                let from = out.len();
                self.encode_word(word, out);
                if cache.len() >= CACHE_LIMIT {
                    cache.clear();
                }
                cache.insert(word.into(), out[from..].into());
            }
        });
        if !self.byte_fallback {
            // The library merges runs of unknown pieces into one, across words too.
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

    fn piece_id(&self, piece: &str) -> u32 {
        self.reserved
            .get(piece)
            .copied()
            .or_else(|| self.pieces.get(piece).map(|&(id, _)| id))
            .unwrap_or(self.unk_id)
    }

    /// The library's BPE merge loop over one word.
    fn encode_word(&self, word: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        for (i, (start, c)) in word.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
        }
        let count = symbols.len();
        for (i, symbol) in symbols.iter_mut().enumerate() {
            symbol.next = (i + 1 < count).then_some(i + 1);
        }
        let mut agenda = BinaryHeap::new();
        let candidate =
            |symbols: &[Symbol], left: Option<usize>, right: Option<usize>| -> Option<Pair> {
                let (left, right) = (left?, right?);
                let (l, r) = (&symbols[left], &symbols[right]);
                let piece = &word[l.start..l.start + l.len + r.len];
                let &(_, score) = self.pieces.get(piece)?;
                Some(Pair {
                    score,
                    left,
                    right,
                    size: piece.len(),
                })
            };
        for i in 1..count {
            agenda.extend(candidate(&symbols, Some(i - 1), Some(i)));
        }
        while let Some(top) = agenda.pop() {
            let (l, r) = (&symbols[top.left], &symbols[top.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != top.size {
                continue;
            }
            let right_next = r.next;
            symbols[top.left].len += symbols[top.right].len;
            symbols[top.left].next = right_next;
            if let Some(next) = right_next {
                symbols[next].prev = Some(top.left);
            }
            symbols[top.right].len = 0;
            let prev = symbols[top.left].prev;
            agenda.extend(candidate(&symbols, prev, Some(top.left)));
            agenda.extend(candidate(&symbols, Some(top.left), right_next));
        }
        let mut index = (count > 0).then_some(0);
        while let Some(i) = index {
            let symbol = &symbols[i];
            let piece = &word[symbol.start..symbol.start + symbol.len];
            let id = self.piece_id(piece);
            if id == self.unk_id && self.byte_fallback {
                out.extend(piece.bytes().map(|b| self.byte_ids[b as usize]));
            } else {
                out.push(id);
            }
            index = symbol.next;
        }
    }
}

/// Splits a normalized text before every `▁`.
fn split_words(normalized: &str) -> impl Iterator<Item = &str> {
    let mut rest = normalized;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let skip = if rest.starts_with(SPACE) {
            SPACE.len()
        } else {
            0
        };
        let end = rest[skip..].find(SPACE).map_or(rest.len(), |at| at + skip);
        let (word, tail) = rest.split_at(end);
        rest = tail;
        Some(word)
    })
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
