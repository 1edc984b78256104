//! The per-thread caches of word (or pre-token) ids each Rust encoder keeps (dropped with
//! it), keyed by a fast multiplicative hash: the keys are short strings from the text being
//! encoded, so SipHash's protection against chosen collisions buys nothing worth its cost (it
//! was the largest single cost of a cache hit). Short words and short id lists are held in
//! the entry itself: a hit then reads one entry instead of following two pointers.
//!
//! On a real corpus the words outgrow the CPU's caches (Shakespeare: 118,000 distinct
//! words, 7.5 MB of entries per worker), and a lookup that misses to memory cost more
//! than the rest of a word's encoding. So the table is small (4-byte slots: a hash tag
//! and a position), the entries are kept in the order first met (the frequent words
//! share a few hot cache lines), and [`each_word`] looks a few words ahead, loading
//! their slots and entries while earlier words are encoded.

use std::cell::RefCell;
use std::hash::Hasher;

/// FxHash (rustc's): a word at a time, rotate, xor, multiply.
#[derive(Default, Clone, Copy)]
struct FxHasher {
    hash: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            self.add(u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(last));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.add(u64::from(byte));
    }

    fn write_usize(&mut self, value: usize) {
        self.add(value as u64);
    }

    fn finish(&self) -> u64 {
        self.hash
    }
}

/// Words (or pre-tokens) and their cached value `V`, at most [`WordCache::LIMIT`]
/// of them (then it starts again empty).
pub(super) struct WordCache<V> {
    /// Open addressing, linear probing, at most half full. A slot is empty (0), or the
    /// top [`TAG_BITS`] bits of its word's hash over its position in `entries` plus one.
    slots: Vec<u32>,
    /// In the order first met.
    entries: Vec<(WordKey, V)>,
}

const TAG_BITS: u32 = 8;
const POSITION_MASK: u32 = (1 << (32 - TAG_BITS)) - 1;

impl<V> Default for WordCache<V> {
    fn default() -> Self {
        Self {
            slots: vec![0; 1 << 10],
            entries: Vec::new(),
        }
    }
}

impl<V> WordCache<V> {
    /// Beyond this many words the cache is emptied (a bound on memory for corpora whose
    /// words never repeat); positions fit in a slot.
    pub(super) const LIMIT: usize = 1 << 20;

    fn hash(word: &str) -> u64 {
        let mut hasher = FxHasher::default();
        std::hash::Hash::hash(word, &mut hasher);
        hasher.finish()
    }

    /// The hash's bits just below those of [`Self::first_slot`], in a slot's top bits.
    fn tag(&self, hash: u64) -> u32 {
        let below = 64 - self.slots.len().trailing_zeros() - TAG_BITS;
        (((hash >> below) as u32) & ((1 << TAG_BITS) - 1)) << (32 - TAG_BITS)
    }

    /// The hash's top bits: FxHash's low bits hardly depend on a short word's later
    /// bytes, and linear probing would run into long clusters.
    fn first_slot(&self, hash: u64) -> usize {
        (hash >> (64 - self.slots.len().trailing_zeros())) as usize
    }

    /// The position of `word`'s entry, or the empty slot where it would go.
    fn find(&self, word: &str, hash: u64) -> Result<usize, usize> {
        let (mask, tag) = (self.slots.len() - 1, self.tag(hash));
        let mut at = self.first_slot(hash);
        loop {
            let slot = self.slots[at];
            if slot == 0 {
                return Err(at);
            }
            let position = (slot & POSITION_MASK) as usize - 1;
            if slot & !POSITION_MASK == tag && self.entries[position].0.as_str() == word {
                return Ok(position);
            }
            at = (at + 1) & mask;
        }
    }

    /// The value cached for `word`.
    pub(super) fn get(&self, word: &str) -> Option<&V> {
        let position = self.find(word, Self::hash(word)).ok()?;
        Some(&self.entries[position].1)
    }

    /// Caches `value` for `word` (not looked up first: call it after [`Self::get`]
    /// missed).
    pub(super) fn insert(&mut self, word: &str, value: V) {
        if self.entries.len() >= Self::LIMIT {
            self.slots.iter_mut().for_each(|slot| *slot = 0);
            self.entries.clear();
        }
        if 2 * (self.entries.len() + 1) > self.slots.len() {
            self.grow();
        }
        let hash = Self::hash(word);
        let at = self.find(word, hash).unwrap_or_else(|empty| empty);
        self.entries.push((word.into(), value));
        self.slots[at] = self.tag(hash) | self.entries.len() as u32;
    }

    /// Doubles the slots and places every entry again.
    fn grow(&mut self) {
        self.slots = vec![0; 2 * self.slots.len()];
        let mask = self.slots.len() - 1;
        for (position, (key, _)) in self.entries.iter().enumerate() {
            let hash = Self::hash(key.as_str());
            let mut at = self.first_slot(hash);
            while self.slots[at] != 0 {
                at = (at + 1) & mask;
            }
            self.slots[at] = self.tag(hash) | (position as u32 + 1);
        }
    }

    /// Starts loading the slot of the word with `hash` into the CPU's cache.
    fn prefetch_slot(&self, hash: u64) {
        prefetch(&self.slots[self.first_slot(hash)]);
    }

    /// Starts loading the entry the first slot of `hash` points to, when its tag
    /// matches (the slot itself should be loaded by now).
    fn prefetch_entry(&self, hash: u64) {
        let slot = self.slots[self.first_slot(hash)];
        if slot != 0 && slot & !POSITION_MASK == self.tag(hash) {
            if let Some(entry) = self.entries.get((slot & POSITION_MASK) as usize - 1) {
                prefetch(entry);
            }
        }
    }
}

/// Hints the CPU to load `value`'s cache line; no effect on the program's meaning.
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch has no architectural effect (it never faults), and the
    // pointer comes from a reference.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// How many words ahead [`each_word`] loads slots, and entries.
const SLOT_AHEAD: usize = 8;
const ENTRY_AHEAD: usize = 4;

/// Calls `each` with `cache` and every word `words` produces, in order, while loading
/// the slots and entries of the next words: their misses to memory then overlap.
pub(super) fn each_word<'t, V>(
    cache: &mut WordCache<V>,
    words: impl FnOnce(&mut dyn FnMut(&'t str)),
    mut each: impl FnMut(&mut WordCache<V>, &'t str),
) {
    let mut ahead: std::collections::VecDeque<(&'t str, u64)> =
        std::collections::VecDeque::with_capacity(SLOT_AHEAD + 1);
    words(&mut |word| {
        let hash = WordCache::<V>::hash(word);
        cache.prefetch_slot(hash);
        ahead.push_back((word, hash));
        if let Some(&(_, hash)) = ahead.get(ahead.len().wrapping_sub(1 + ENTRY_AHEAD)) {
            cache.prefetch_entry(hash);
        }
        if ahead.len() > SLOT_AHEAD {
            if let Some((word, _)) = ahead.pop_front() {
                each(cache, word);
            }
        }
    });
    for (word, _) in ahead {
        each(cache, word);
    }
}

/// One encoder's caches, one per thread that encodes with it; they go with the encoder.
pub(super) struct ThreadCaches<V: Send>(thread_local::ThreadLocal<RefCell<WordCache<V>>>);

impl<V: Send> Default for ThreadCaches<V> {
    fn default() -> Self {
        Self(thread_local::ThreadLocal::new())
    }
}

impl<V: Send> ThreadCaches<V> {
    /// This thread's cache, given to `work`.
    pub(super) fn with<R>(&self, work: impl FnOnce(&mut WordCache<V>) -> R) -> R {
        work(&mut self.0.get_or_default().borrow_mut())
    }
}

/// A cache key: a word of up to 22 bytes held in its entry, so
/// that a hit compares bytes already loaded with the entry instead of following a
/// pointer; longer words on the heap.
#[derive(Clone)]
pub(super) struct WordKey(KeyRepr);

/// [`WordKey`]'s representation, private so that inline bytes always come from a `&str`.
#[derive(Clone)]
enum KeyRepr {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<str>),
}

/// The longest word held inline.
const INLINE_KEY: usize = 22;

impl WordKey {
    fn as_str(&self) -> &str {
        match &self.0 {
            KeyRepr::Inline { len, bytes } => {
                // SAFETY: `bytes[..len]` was copied from a `&str` in `From<&str>`, the
                // only constructor.
                unsafe { std::str::from_utf8_unchecked(&bytes[..*len as usize]) }
            }
            KeyRepr::Heap(word) => word,
        }
    }
}

impl From<&str> for WordKey {
    fn from(word: &str) -> WordKey {
        if word.len() <= INLINE_KEY {
            let mut bytes = [0u8; INLINE_KEY];
            bytes[..word.len()].copy_from_slice(word.as_bytes());
            WordKey(KeyRepr::Inline {
                len: word.len() as u8,
                bytes,
            })
        } else {
            WordKey(KeyRepr::Heap(word.into()))
        }
    }
}

impl std::borrow::Borrow<str> for WordKey {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for WordKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for WordKey {}

impl std::hash::Hash for WordKey {
    /// As the `str`'s hash, so that the table can be searched with a `&str`.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

/// Ids (or other `u32`s) of a cached word: up to 6 in its entry.
#[derive(Clone)]
pub(super) enum Ids {
    Inline { len: u8, ids: [u32; INLINE_IDS] },
    Heap(Box<[u32]>),
}

/// The most ids held inline.
const INLINE_IDS: usize = 6;

impl Ids {
    pub(super) fn as_slice(&self) -> &[u32] {
        match self {
            Ids::Inline { len, ids } => &ids[..*len as usize],
            Ids::Heap(ids) => ids,
        }
    }
}

impl From<&[u32]> for Ids {
    fn from(values: &[u32]) -> Ids {
        if values.len() <= INLINE_IDS {
            let mut ids = [0u32; INLINE_IDS];
            ids[..values.len()].copy_from_slice(values);
            Ids::Inline {
                len: values.len() as u8,
                ids,
            }
        } else {
            Ids::Heap(values.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_inline_and_heap_keys_by_str() {
        let mut cache: WordCache<Ids> = WordCache::default();
        let long = "▁a-word-longer-than-twenty-two-bytes";
        for (i, word) in ["▁the", "", long].iter().enumerate() {
            let ids: Vec<u32> = (0..i as u32 * 4).collect();
            cache.insert(word, Ids::from(&ids[..]));
        }
        let ids = |word: &str| cache.get(word).map(|ids| ids.as_slice().to_vec());
        assert_eq!(ids("▁the"), Some(vec![]));
        assert_eq!(ids(""), Some(vec![0, 1, 2, 3]));
        assert_eq!(ids(long), Some((0..8).collect()));
        assert_eq!(ids("▁th"), None);
    }

    /// Many words (the table grows several times) keep their own values.
    #[test]
    fn every_word_keeps_its_value_as_the_table_grows() {
        let mut cache: WordCache<usize> = WordCache::default();
        let words: Vec<String> = (0..40_000).map(|i| format!("▁w{i}")).collect();
        for (i, word) in words.iter().enumerate() {
            assert_eq!(cache.get(word), None);
            cache.insert(word, i);
        }
        for (i, word) in words.iter().enumerate().rev() {
            assert_eq!(cache.get(word), Some(&i), "{word}");
        }
        assert_eq!(cache.get("▁w40000"), None);
    }

    #[test]
    fn tells_short_keys_apart() {
        let mut cache: WordCache<usize> = WordCache::default();
        let words = [
            "",
            "a",
            "ab",
            "▁the",
            "▁thee",
            "abcdefgh",
            "abcdefghi",
            "abcdefgi",
        ];
        for (i, word) in words.iter().enumerate() {
            cache.insert(word, i);
        }
        for (i, word) in words.iter().enumerate() {
            assert_eq!(cache.get(word), Some(&i));
        }
    }
}
