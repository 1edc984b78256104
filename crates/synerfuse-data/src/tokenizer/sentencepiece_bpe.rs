//! SentencePiece BPE encoding in Rust, word by word with a cache: the LLaMA-2 case.
//!
//! The library merges the highest-scoring adjacent pair of the whole normalized text
//! until none is a piece. When no piece has `▁` (the escaped space) after its first
//! character, no merge can cross the start of a `▁`, so the text splits there into
//! words that merge independently; a word's ids can then be cached, as for GPT-2.
//! [`SentencePieceBpe::from_model`] accepts a model only when that, and everything else
//! this encoder reproduces, holds: a BPE model (its normalization, a precompiled map such
//! as `nmt_nfkc` or the identity, applied by `sentencepiece_norm` as the library applies
//! it), spaces escaped as a prefix `▁`, no unused pieces. User-defined pieces are kept
//! whole, as the library's `PrefixMatcher` freezes them. Other models go through the
//! library. Results equal the library's `EncodeAsIds`, including byte fallback and the
//! merging of consecutive unknown pieces (tested against it).

use super::sentencepiece_vocab::{
    split_words, ModelSpec, Vocabulary, BPE, NORMAL, UNUSED, USER_DEFINED,
};
use super::word_cache::{each_word, Ids, ThreadCaches};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// A SentencePiece BPE model that can be encoded word by word.
pub(super) struct SentencePieceBpe {
    /// NORMAL and USER_DEFINED pieces (the library's `pieces_`): id and score.
    pieces: HashMap<String, (u32, f32)>,
    vocab: Vocabulary,
    /// Words' ids, per thread.
    cache: ThreadCaches<Ids>,
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
    /// A user-defined piece: never merged.
    frozen: bool,
    prev: Option<usize>,
    next: Option<usize>,
}

impl SentencePieceBpe {
    /// The encoder for `spec`, or which of its properties needs the library.
    pub(super) fn from_model(spec: &ModelSpec) -> Result<Self, &'static str> {
        if spec.model_type != BPE {
            return Err("not a BPE model (word or character)");
        }
        if !spec.escape_whitespaces {
            return Err("whitespace not escaped as a prefix `▁`");
        }
        // A `▁` after the first character would let merges cross words.
        if spec.spans_words(&[NORMAL, USER_DEFINED]) {
            return Err("pieces with `▁` inside (merges across words)");
        }
        if spec.pieces_of(UNUSED).next().is_some() {
            return Err("unused pieces");
        }
        let vocab = Vocabulary::from_spec(spec)?;
        let mut pieces = HashMap::new();
        for kind in [NORMAL, USER_DEFINED] {
            for (id, piece, score) in spec.pieces_of(kind) {
                pieces.entry(piece.to_owned()).or_insert((id, score));
            }
        }
        Ok(Self {
            pieces,
            vocab,
            cache: ThreadCaches::default(),
        })
    }

    /// Appends the ids of `text`, as the library's `EncodeAsIds`.
    pub(super) fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let normalized = self.vocab.normalizer.normalize(text);
        let start = out.len();
        self.cache.with(|cache| {
            each_word(
                cache,
                |feed| split_words(&normalized).for_each(feed),
                |cache, word| {
                    if let Some(hit) = cache.get(word) {
                        out.extend_from_slice(hit.as_slice());
                        return;
                    }
                    let from = out.len();
                    self.encode_word(word, out);
                    cache.insert(word, Ids::from(&out[from..]));
                },
            );
        });
        self.vocab.merge_unknowns(out, start);
    }

    fn piece_id(&self, piece: &str) -> u32 {
        (self.vocab.reserved_id(piece))
            .or_else(|| self.pieces.get(piece).map(|&(id, _)| id))
            .unwrap_or(self.vocab.unk_id)
    }

    /// The library's BPE merge loop over one word.
    fn encode_word(&self, word: &str, out: &mut Vec<u32>) {
        // Characters, and user-defined pieces kept whole.
        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        let user_pieces = self.vocab.normalizer.user_pieces.as_ref();
        let mut start = 0;
        while start < word.len() {
            let user = user_pieces.and_then(|u| u.longest_prefix(&word[start..]));
            let len =
                user.unwrap_or_else(|| word[start..].chars().next().map_or(1, char::len_utf8));
            symbols.push(Symbol {
                start,
                len,
                frozen: user.is_some(),
                prev: symbols.len().checked_sub(1),
                next: None,
            });
            start += len;
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
                if l.frozen || r.frozen {
                    return None;
                }
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
            self.vocab.push_piece(piece, self.piece_id(piece), out);
            index = symbol.next;
        }
    }
}
