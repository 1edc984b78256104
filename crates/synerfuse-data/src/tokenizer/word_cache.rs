//! The per-thread caches of word (or pre-token) ids the Rust encoders keep, keyed by a
//! fast multiplicative hash: the keys are short strings from the text being encoded, so
//! SipHash's protection against chosen collisions buys nothing worth its cost (it was
//! the largest single cost of a cache hit).

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

#[cfg(test)]
mod tests {
    use super::*;

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
