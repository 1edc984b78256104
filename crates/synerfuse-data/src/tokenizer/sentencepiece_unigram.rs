//! SentencePiece Unigram encoding in Rust: the library's Viterbi (`unigram_model.cc`,
//! `EncodeOptimized`) with its arithmetic, so that ids equal the library's even where
//! two segmentations score alike or almost.
//!
//! The library keeps, at each byte position of the normalized text, the best path
//! ending there, its score an `f32`: a piece's score (or a user-defined piece's bonus)
//! added in `f32` to the score where the piece starts, the first of equal candidates
//! kept. That is the Python package's arithmetic (0.2.3, which Megatron's tools use);
//! the C++ 0.2.1 that `sentencepiece-sys` builds adds in `f64` before storing, so the
//! two differ on ties such as `w|ww` against `ww|w`, and ours follows the Python one.
//!
//! When no piece has `▁` after its first character, every path breaks before each
//! `▁`, and the lattice is one word after another, each started from the score the
//! words before it left. A word's path is then cached, as for BPE, with the largest
//! starting score for which rounding cannot change it ([`CachedWord::safe_below`]):
//! every choice the word's lattice makes wins by more than the rounding error at that
//! magnitude. A hit advances the running score along the cached path with the library's
//! own roundings; a word used beyond its safe score, or any text of a model whose pieces
//! span words, runs the lattice with the library's arithmetic.

use super::sentencepiece_vocab::{
    split_words, ModelSpec, Vocabulary, NORMAL, UNIGRAM, UNUSED, USER_DEFINED,
};
use super::word_cache::{each_word, Ids, ThreadCaches, WordCache};
use std::cell::RefCell;
use std::collections::BTreeMap;

/// The library's penalty for an unknown character, below the lowest piece score.
const UNKNOWN_PENALTY: f32 = 10.0;
/// A node no path reaches yet.
const UNSET: usize = usize::MAX;
/// No piece ends at a trie node.
const NONE: u32 = u32::MAX;

/// A byte trie of the pieces: the library's `commonPrefixSearch` over them.
struct PieceTrie {
    /// Node `n`'s children are `edges[first[n]..first[n + 1]]`, sorted by byte.
    first: Vec<u32>,
    edges: Vec<(u8, u32)>,
    /// The id of the piece ending at each node, or [`NONE`].
    value: Vec<u32>,
}

impl PieceTrie {
    /// The trie of `(piece, id)`; the first id of a piece stays.
    fn new<'a>(keys: impl IntoIterator<Item = (&'a str, u32)>) -> PieceTrie {
        let mut children: Vec<BTreeMap<u8, u32>> = vec![BTreeMap::new()];
        let mut value = vec![NONE];
        for (key, id) in keys {
            let mut node = 0;
            for &byte in key.as_bytes() {
                let next = children.len() as u32;
                node = *children[node].entry(byte).or_insert(next) as usize;
                if node == next as usize {
                    children.push(BTreeMap::new());
                    value.push(NONE);
                }
            }
            if value[node] == NONE {
                value[node] = id;
            }
        }
        let mut first = Vec::with_capacity(children.len() + 1);
        let mut edges = Vec::new();
        for node in &children {
            first.push(edges.len() as u32);
            edges.extend(node.iter().map(|(&b, &child)| (b, child)));
        }
        first.push(edges.len() as u32);
        PieceTrie {
            first,
            edges,
            value,
        }
    }

    /// Calls `found(length, id)` for each piece that starts `text`, shortest first.
    fn for_each_prefix(&self, text: &[u8], mut found: impl FnMut(usize, u32)) {
        let mut node = 0usize;
        for (i, &byte) in text.iter().enumerate() {
            let edges = &self.edges[self.first[node] as usize..self.first[node + 1] as usize];
            match edges.binary_search_by_key(&byte, |&(b, _)| b) {
                Ok(at) => node = edges[at].1 as usize,
                Err(_) => return,
            }
            if self.value[node] != NONE {
                found(i + 1, self.value[node]);
            }
        }
    }
}

/// The best path ending at a position: its score (an `f32` value in the library's
/// arithmetic), where its last piece starts and the piece's id.
#[derive(Clone, Copy)]
struct Node {
    score: f64,
    start: usize,
    id: u32,
}

/// How a lattice computes: in `f32` as the library does, from a starting score, or in
/// `f64` from zero, which is exact enough to tell how narrowly each choice wins.
#[derive(Clone, Copy, PartialEq)]
enum Arithmetic {
    Library,
    Exact,
}

/// A lattice's result: the path is in the scratch nodes; `end_score` is its score, the
/// narrowest win of any choice, and the largest magnitude of any score.
struct Lattice {
    end_score: f64,
    narrowest: f64,
    largest: f64,
}

/// A word's ids, valid for starting scores of magnitude below `safe_below`, and what
/// each piece of its path adds (for advancing the running score past it), in one
/// allocation: a cache hit then touches one block besides the table.
struct CachedWord {
    /// The ids, then the steps' `f32` bits.
    ids_then_steps: Ids,
    ids: u32,
    /// Rounded down from the `f64` bound.
    safe_below: f32,
}

impl CachedWord {
    fn ids(&self) -> &[u32] {
        &self.ids_then_steps.as_slice()[..self.ids as usize]
    }

    fn steps(&self) -> impl Iterator<Item = f32> + '_ {
        self.ids_then_steps.as_slice()[self.ids as usize..]
            .iter()
            .map(|&bits| f32::from_bits(bits))
    }
}

thread_local! {
    static NODES: RefCell<Vec<Node>> = const { RefCell::new(Vec::new()) };
}

/// A SentencePiece Unigram model encoded in Rust.
pub(super) struct SentencePieceUnigram {
    /// NORMAL, USER_DEFINED and UNUSED pieces (the library's `pieces_`).
    trie: PieceTrie,
    /// By id, what a piece adds to a path; `None` for an unused piece, which the
    /// lattice skips, and for reserved pieces.
    scores: Vec<Option<f32>>,
    unk_score: f32,
    /// No piece spans the start of a word: words are encoded (and cached) one by one.
    splits_words: bool,
    vocab: Vocabulary,
    /// Words' paths, per thread.
    cache: ThreadCaches<CachedWord>,
}

impl SentencePieceUnigram {
    /// The encoder for `spec`, or which of its properties needs the library.
    pub(super) fn from_model(spec: &ModelSpec) -> Result<Self, &'static str> {
        if spec.model_type != UNIGRAM {
            return Err("not a Unigram model");
        }
        let vocab = Vocabulary::from_spec(spec)?;
        // `Model::Model`: the scores' range over NORMAL pieces, from FLT_MAX / FLT_MIN.
        let normal: Vec<f32> = spec.pieces_of(NORMAL).map(|(_, _, score)| score).collect();
        let min_score = normal.iter().copied().fold(f32::MAX, f32::min);
        let max_score = normal.iter().copied().fold(f32::MIN_POSITIVE, f32::max);
        let mut scores = vec![None; spec.pieces.len()];
        let mut keys = Vec::new();
        for kind in [NORMAL, USER_DEFINED, UNUSED] {
            for (id, piece, score) in spec.pieces_of(kind) {
                scores[id as usize] = match kind {
                    // A bonus that always selects it: `length * max_score_ - 0.1`.
                    USER_DEFINED => Some(piece.len() as f32 * max_score - 0.1),
                    UNUSED => None,
                    _ => Some(score),
                };
                keys.push((piece, id));
            }
        }
        keys.sort_by_key(|&(_, id)| id);
        let trie = PieceTrie::new(keys);
        Ok(Self {
            trie,
            scores,
            unk_score: min_score - UNKNOWN_PENALTY,
            splits_words: spec.escape_whitespaces && !spec.spans_words(&[NORMAL, USER_DEFINED]),
            vocab,
            cache: ThreadCaches::default(),
        })
    }

    /// Appends the ids of `text`, as the library's `EncodeAsIds`.
    pub(super) fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let normalized = self.vocab.normalizer.normalize(text);
        let start = out.len();
        NODES.with(|nodes| {
            let nodes = &mut nodes.borrow_mut();
            if !self.splits_words {
                self.lattice(&normalized, 0.0, Arithmetic::Library, nodes);
                self.emit(&normalized, nodes, out, |_| {});
                return;
            }
            self.cache.with(|cache| {
                let mut score = 0f32;
                each_word(
                    cache,
                    |feed| split_words(&normalized).for_each(feed),
                    |cache, word| {
                        score = self.encode_word(word, score, cache, nodes, out);
                    },
                );
            });
        });
        self.vocab.merge_unknowns(out, start);
    }

    /// Appends the ids of `word`, started from the running `score`; returns the score
    /// at its end.
    fn encode_word(
        &self,
        word: &str,
        score: f32,
        cache: &mut WordCache<CachedWord>,
        nodes: &mut Vec<Node>,
        out: &mut Vec<u32>,
    ) -> f32 {
        if let Some(hit) = cache.get(word) {
            return self.encode_cached(hit, word, score, nodes, out);
        }
        let entry = self.cached_word(word, nodes);
        let end = self.encode_cached(&entry, word, score, nodes, out);
        cache.insert(word, entry);
        end
    }

    /// Appends the ids of `word` from its cache entry when the running `score` is within
    /// its safe range, or else from its lattice in the library's arithmetic; returns the
    /// score at its end.
    fn encode_cached(
        &self,
        hit: &CachedWord,
        word: &str,
        score: f32,
        nodes: &mut Vec<Node>,
        out: &mut Vec<u32>,
    ) -> f32 {
        if score.abs() < hit.safe_below {
            out.extend_from_slice(hit.ids());
            return hit.steps().fold(score, |score, step| step + score);
        }
        let lattice = self.lattice(word, f64::from(score), Arithmetic::Library, nodes);
        self.emit(word, nodes, out, |_| {});
        lattice.end_score as f32
    }

    /// The cache entry of `word`: its path from a zero score, exactly, and how far that
    /// path holds.
    fn cached_word(&self, word: &str, nodes: &mut Vec<Node>) -> CachedWord {
        let lattice = self.lattice(word, 0.0, Arithmetic::Exact, nodes);
        let (mut ids, mut steps) = (Vec::new(), Vec::new());
        self.emit(word, nodes, &mut ids, |id| {
            steps.push(self.scores[id as usize].unwrap_or(self.unk_score).to_bits());
        });
        let count = ids.len() as u32;
        ids.extend(steps);
        CachedWord {
            ids_then_steps: Ids::from(&ids[..]),
            ids: count,
            safe_below: round_down(safe_below(&lattice, word.chars().count())),
        }
    }

    /// Fills `nodes` with the best path ending at each byte of `text`, from `start`.
    fn lattice(
        &self,
        text: &str,
        start: f64,
        arithmetic: Arithmetic,
        nodes: &mut Vec<Node>,
    ) -> Lattice {
        let bytes = text.as_bytes();
        let unset = Node {
            score: 0.0,
            start: UNSET,
            id: 0,
        };
        nodes.clear();
        nodes.resize(bytes.len() + 1, unset);
        nodes[0].score = start;
        let (mut narrowest, mut largest) = (f64::INFINITY, 0f64);
        let mut offer = |node: &mut Node, score: f32, here: f64, from: usize, id: u32| {
            let candidate = match arithmetic {
                Arithmetic::Library => f64::from(score + here as f32),
                Arithmetic::Exact => f64::from(score) + here,
            };
            if node.start != UNSET {
                narrowest = narrowest.min((candidate - node.score).abs());
            }
            // Strictly better only: the first of equal paths stays.
            if node.start == UNSET || candidate > node.score {
                *node = Node {
                    score: candidate,
                    start: from,
                    id,
                };
                largest = largest.max(candidate.abs());
            }
        };
        let mut at = 0;
        while at < bytes.len() {
            let here = nodes[at].score;
            let char_len = text[at..].chars().next().map_or(1, char::len_utf8);
            let mut single = false;
            self.trie.for_each_prefix(&bytes[at..], |length, id| {
                if let Some(score) = self.scores[id as usize] {
                    offer(&mut nodes[at + length], score, here, at, id);
                    single |= length == char_len;
                }
            });
            if !single {
                let unknown = self.unk_score;
                offer(
                    &mut nodes[at + char_len],
                    unknown,
                    here,
                    at,
                    self.vocab.unk_id,
                );
            }
            at += char_len;
        }
        Lattice {
            end_score: nodes[bytes.len()].score,
            narrowest,
            largest,
        }
    }

    /// Appends the ids of the best path in `nodes` over `text`, calling `step` with each
    /// piece's id in order.
    fn emit(&self, text: &str, nodes: &[Node], out: &mut Vec<u32>, mut step: impl FnMut(u32)) {
        let mut pieces = Vec::new();
        let mut end = text.len();
        while end > 0 {
            let node = nodes[end];
            pieces.push((node.start, end, node.id));
            end = node.start;
        }
        for &(start, end, id) in pieces.iter().rev() {
            step(id);
            self.vocab.push_piece(&text[start..end], id, out);
        }
    }
}

/// `bound` as an `f32` no larger than it; a negative bound as -1 (never safe).
fn round_down(bound: f64) -> f32 {
    if bound <= 0.0 {
        return -1.0;
    }
    let rounded = bound as f32;
    if f64::from(rounded) > bound {
        // A positive finite `f32`: its bits less one are the next value down.
        f32::from_bits(rounded.to_bits() - 1)
    } else {
        rounded
    }
}

/// The largest magnitude of starting score below which the library's roundings cannot
/// change a word's path: each choice in its lattice wins by more than twice the error
/// two paths through its `chars` characters can gather (at most one `f32` ulp per
/// piece added).
fn safe_below(lattice: &Lattice, chars: usize) -> f64 {
    let rounds = 2.0 * chars as f64 + 2.0;
    // narrowest > 2 · rounds · (|start| + largest + 1) · 2^-23
    lattice.narrowest * f64::from(1u32 << 22) / rounds - lattice.largest - 1.0
}
