//! SentencePiece's normalizer in Rust: the model's precompiled character map (a
//! darts-clone double-array trie of byte strings, each mapped to its replacement, as
//! `nmt_nfkc` compiles NFKC with SentencePiece's own additions) applied as the library's
//! `Normalizer::Normalize` applies it: at each position the longest matching rule, or
//! else one character copied; then whitespace handled on the rules' output.
//!
//! The `spm_precompiled` crate reads the same blob but exposes neither the length of a
//! match nor the longest one (Hugging Face normalizes grapheme by grapheme instead), so
//! the lookup is written here after the library: `darts.h`'s `commonPrefixSearch` and
//! `normalizer.cc`'s `NormalizePrefix`.

use std::collections::HashSet;

/// The escaped space.
pub(super) const SPACE: &str = "\u{2581}";

/// A precompiled character map: its double array and the replacement strings.
pub(super) struct CharsMap {
    units: Vec<u32>,
    /// Replacements, each ended by a NUL byte.
    normalized: Vec<u8>,
    /// ASCII bytes that no rule matches when an ASCII byte (or the end) follows: no rule
    /// is the byte alone, and every rule starting with it goes on with a non-ASCII byte
    /// (a combining mark). Most text is copied through this table.
    ascii_plain: [bool; 128],
}

impl CharsMap {
    /// Reads `<trie size: u32 LE><trie units: u32 LE each><replacements>`; `None` when
    /// the blob is malformed.
    pub(super) fn parse(blob: &[u8]) -> Option<CharsMap> {
        let size = u32::from_le_bytes(blob.get(..4)?.try_into().ok()?) as usize;
        let trie = blob.get(4..4 + size)?;
        if size % 4 != 0 || size == 0 {
            return None;
        }
        let units = trie
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut map = CharsMap {
            units,
            normalized: blob[4 + size..].to_vec(),
            ascii_plain: [false; 128],
        };
        for byte in 0..128u8 {
            let alone = map.longest_prefix(&[byte]).is_some();
            let continued = (0..128u8).any(|next| map.reaches(&[byte, next]));
            map.ascii_plain[byte as usize] = !alone && !continued;
        }
        Some(map)
    }

    /// Whether some rule starts with `key`.
    fn reaches(&self, key: &[u8]) -> bool {
        let unit = |pos: usize| self.units.get(pos).copied();
        let Some(root) = unit(0) else { return false };
        let mut pos = unit_offset(root);
        for &byte in key {
            pos ^= byte as usize;
            match unit(pos) {
                Some(u) if unit_label(u) == byte as u32 => pos ^= unit_offset(u),
                _ => return false,
            }
        }
        true
    }

    /// Whether no rule can match at the start of `rest`, by the ASCII table alone.
    fn plain_ascii_at(&self, rest: &[u8]) -> bool {
        match rest {
            [first, next, ..] => *first < 0x80 && *next < 0x80 && self.ascii_plain[*first as usize],
            [first] => *first < 0x80 && self.ascii_plain[*first as usize],
            [] => false,
        }
    }

    /// The longest rule matching a prefix of `key`: (its length in bytes, its
    /// replacement). darts-clone's `commonPrefixSearch`, keeping the longest.
    fn longest_prefix(&self, key: &[u8]) -> Option<(usize, &[u8])> {
        let unit = |pos: usize| self.units.get(pos).copied();
        let has_leaf = |u: u32| (u >> 8) & 1 == 1;
        let mut pos = unit_offset(unit(0)?);
        let mut longest = None;
        for (i, &byte) in key.iter().enumerate() {
            pos ^= byte as usize;
            let u = unit(pos)?;
            if unit_label(u) != byte as u32 {
                break;
            }
            pos ^= unit_offset(u);
            if has_leaf(u) {
                let value = (unit(pos)? & ((1 << 31) - 1)) as usize;
                longest = Some((i + 1, value));
            }
        }
        let (length, value) = longest?;
        let rest = self.normalized.get(value..)?;
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        Some((length, &rest[..end]))
    }
}

/// A double-array unit's offset (darts-clone's `DoubleArrayUnit`).
fn unit_offset(u: u32) -> usize {
    ((u >> 10) << ((u & (1 << 9)) >> 6)) as usize
}

/// A double-array unit's label.
fn unit_label(u: u32) -> u32 {
    u & ((1 << 31) | 0xFF)
}

/// A model's user-defined pieces, matched longest first at a position: the library's
/// `PrefixMatcher` (which keeps only the first 64 prefix matches; no model has 64 user
/// pieces that are prefixes of one another). The normalizer copies them unchanged and BPE keeps them whole.
pub(super) struct UserPieces {
    pieces: HashSet<Box<str>>,
    /// The pieces' lengths in bytes, longest first.
    lengths: Vec<usize>,
    /// Whether some piece starts with this byte (most positions are rejected here).
    first_bytes: [bool; 256],
}

impl UserPieces {
    /// The matcher for `pieces`; `None` when there are none.
    pub(super) fn new<'a>(pieces: impl IntoIterator<Item = &'a str>) -> Option<UserPieces> {
        let pieces: HashSet<Box<str>> = pieces
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(Box::from)
            .collect();
        let mut first_bytes = [false; 256];
        let mut lengths: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
        for piece in &pieces {
            first_bytes[piece.as_bytes()[0] as usize] = true;
        }
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        lengths.dedup();
        (!pieces.is_empty()).then_some(UserPieces {
            pieces,
            lengths,
            first_bytes,
        })
    }

    /// Whether some piece starts with `byte`.
    fn starts_with(&self, byte: u8) -> bool {
        self.first_bytes[byte as usize]
    }

    /// The length of the longest piece that `text` starts with.
    pub(super) fn longest_prefix(&self, text: &str) -> Option<usize> {
        let &first = text.as_bytes().first()?;
        if !self.starts_with(first) {
            return None;
        }
        self.lengths
            .iter()
            .copied()
            .find(|&length| text.is_char_boundary(length) && self.pieces.contains(&text[..length]))
    }
}

/// How a model normalizes (`NormalizerSpec`, and `TrainerSpec`'s whitespace side).
pub(super) struct Normalizer {
    /// `None`: the identity.
    pub map: Option<CharsMap>,
    /// Matched before any rule and not rewritten (`NormalizePrefix`); their spaces are
    /// still escaped and dropped as any other's.
    pub user_pieces: Option<UserPieces>,
    pub add_dummy_prefix: bool,
    pub remove_extra_whitespaces: bool,
    pub escape_whitespaces: bool,
}

impl Normalizer {
    /// The rule's output at the start of `input` and the bytes it consumes
    /// (`NormalizePrefix`; `input` is valid UTF-8, so no replacement character).
    fn prefix<'a>(&'a self, input: &'a str) -> (&'a [u8], usize) {
        if let Some(length) = (self.user_pieces.as_ref()).and_then(|u| u.longest_prefix(input)) {
            return (&input.as_bytes()[..length], length);
        }
        if (self.map.as_ref()).is_some_and(|m| m.plain_ascii_at(input.as_bytes())) {
            return (&input.as_bytes()[..1], 1);
        }
        let rule = (self.map.as_ref()).and_then(|m| m.longest_prefix(input.as_bytes()));
        // A rule ends between characters (a damaged map that does not is ignored).
        if let Some((length, replacement)) = rule.filter(|&(l, _)| input.is_char_boundary(l)) {
            return (replacement, length);
        }
        let length = input.chars().next().map_or(0, char::len_utf8);
        (&input.as_bytes()[..length], length)
    }

    /// The ASCII bytes that start no user piece and that no rule matches alone or
    /// followed by another ASCII byte: the rules copy them one by one.
    fn plain_ascii(&self) -> [bool; 128] {
        std::array::from_fn(|byte| {
            !(self.user_pieces.as_ref()).is_some_and(|u| u.starts_with(byte as u8))
                && (self.map.as_ref()).is_none_or(|m| m.ascii_plain[byte])
        })
    }

    /// Normalizes the plain ASCII bytes at the start of `input` into `out` (copied, a
    /// space escaped, or dropped after another with `remove_extra_whitespaces`), as the
    /// rules one by one would; returns how many it took. Most text goes this way.
    fn copy_plain(&self, input: &[u8], plain: &[bool; 128], out: &mut Output) -> usize {
        let mut taken = 0;
        for (at, &byte) in input.iter().enumerate() {
            if !plain.get(byte as usize).is_some_and(|&p| p) {
                break;
            }
            // A rule may go on from an ASCII byte with a non-ASCII one (a combining mark).
            if self.map.is_some() && input.get(at + 1).is_some_and(|&next| next >= 0x80) {
                break;
            }
            if byte == b' ' {
                if !out.previous_space {
                    out.bytes.extend_from_slice(out.space);
                }
                out.previous_space = self.remove_extra_whitespaces;
            } else {
                out.bytes.push(byte);
                out.previous_space = false;
            }
            taken = at + 1;
        }
        taken
    }

    /// `text` as the library's `Normalizer::Normalize` makes it.
    pub(super) fn normalize(&self, text: &str) -> String {
        let mut input = text;
        if self.remove_extra_whitespaces {
            loop {
                let (out, consumed) = self.prefix(input);
                if input.is_empty() || out != b" " {
                    break;
                }
                input = &input[consumed..];
            }
        }
        if input.is_empty() {
            return String::new();
        }
        let mut out = Output {
            bytes: Vec::with_capacity(input.len() * 3),
            space: match self.escape_whitespaces {
                true => SPACE.as_bytes(),
                false => b" ",
            },
            previous_space: self.remove_extra_whitespaces,
            valid: true,
        };
        if self.add_dummy_prefix {
            out.bytes.extend_from_slice(out.space);
        }
        self.write(input, &mut out);
        if self.remove_extra_whitespaces {
            while out.bytes.ends_with(out.space) {
                out.bytes.truncate(out.bytes.len() - out.space.len());
            }
        }
        if out.valid {
            // SAFETY: the bytes are a concatenation of UTF-8 strings (plain ASCII, escaped
            // spaces, the input's own characters and user pieces, replacements checked
            // in `write`), less whole spaces at the end: UTF-8 themselves.
            return unsafe { String::from_utf8_unchecked(out.bytes) };
        }
        String::from_utf8(out.bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    /// Writes the normalized `input` into `out`, rule by rule (`Normalize`'s loop).
    fn write(&self, mut input: &str, out: &mut Output) {
        let plain = self.plain_ascii();
        while !input.is_empty() {
            let copied = self.copy_plain(input.as_bytes(), &plain, out);
            if copied > 0 {
                input = &input[copied..];
                continue;
            }
            let (mut piece, consumed) = self.prefix(input);
            // The input is UTF-8 and so is a sound map's replacement; a damaged one's
            // bytes are replaced in `normalize`.
            out.valid &= std::str::from_utf8(piece).is_ok();
            while out.previous_space && piece.first() == Some(&b' ') {
                piece = &piece[1..];
            }
            if !piece.is_empty() {
                for &byte in piece {
                    match byte {
                        b' ' => out.bytes.extend_from_slice(out.space),
                        _ => out.bytes.push(byte),
                    }
                }
                out.previous_space = piece.last() == Some(&b' ');
            }
            input = &input[consumed..];
            if !self.remove_extra_whitespaces {
                out.previous_space = false;
            }
        }
    }
}

/// What [`Normalizer::normalize`] has written so far.
struct Output {
    bytes: Vec<u8>,
    /// The escaped space (or a plain one).
    space: &'static [u8],
    /// The last byte written was a space (leading spaces count as such when extra ones
    /// are removed).
    previous_space: bool,
    /// Every piece written is UTF-8.
    valid: bool,
}
