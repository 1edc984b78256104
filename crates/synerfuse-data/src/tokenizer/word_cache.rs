//! The per-thread caches of word (or pre-token) ids the Rust encoders keep, keyed by a
//! fast multiplicative hash: the keys are short strings from the text being encoded, so
//! SipHash's protection against chosen collisions buys nothing worth its cost (it was
//! the largest single cost of a cache hit). Short words and short id lists are held in
//! the table itself: a hit then reads one bucket instead of following two pointers.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// FxHash (rustc's): a word at a time, rotate, xor, multiply.
#[derive(Default, Clone, Copy)]
pub(super) struct FxHasher {
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

/// A `HashMap` with [`FxHasher`].
pub(super) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// A per-thread cache of words' results.
pub(super) type WordCache<V> = FastMap<WordKey, V>;

/// A cache key: a word of up to 22 bytes held in the table itself, so
/// that a hit compares bytes already loaded with the bucket instead of following a
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

/// Ids (or other `u32`s) of a cached word: up to 6 in the table itself.
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
            cache.insert((*word).into(), Ids::from(&ids[..]));
        }
        assert_eq!(cache["▁the"].as_slice(), &[0u32; 0][..]);
        assert_eq!(cache[""].as_slice(), &[0, 1, 2, 3]);
        assert_eq!(cache[long].as_slice(), &(0..8).collect::<Vec<u32>>()[..]);
        assert!(!cache.contains_key("▁th"));
    }

    #[test]
    fn tells_short_keys_apart() {
        let mut map: FastMap<Box<str>, usize> = FastMap::default();
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
            map.insert((*word).into(), i);
        }
        for (i, word) in words.iter().enumerate() {
            assert_eq!(map[*word], i);
        }
    }
}
