//! GPT-2's pre-tokenizer, hand-written.
//!
//! Megatron splits text with the `regex`-module pattern
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//! Rust's `regex` has no look-ahead, and a direct scanner is also several times faster;
//! this one takes, at each position, the first alternative that matches, exactly as
//! the backtracking engine does.

/// The character classes the pattern distinguishes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn is_letter(c: char) -> bool {
    // \p{L} = Lu | Ll | Lt | Lm | Lo. `is_alphabetic` also admits marks and Nl, so
    // those are excluded through the general-category tables of `unicode_class`.
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    super::unicode_class::is_letter(c)
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if is_letter(c) {
        Class::Letter
    } else if c.is_numeric() {
        // \p{N} = Nd | Nl | No, which is exactly `char::is_numeric`.
        Class::Number
    } else {
        Class::Other
    }
}

const CONTRACTIONS: [&str; 7] = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"];

/// Calls `emit` with each pre-token of `text`, in order; together they cover `text`.
pub fn for_each_pretoken<'a>(text: &'a str, mut emit: impl FnMut(&'a str)) {
    let mut pos = 0;
    while pos < text.len() {
        let len = next_pretoken_len(&text[pos..]);
        emit(&text[pos..pos + len]);
        pos += len;
    }
}

/// Byte length of the pre-token at the start of a non-empty `rest`.
fn next_pretoken_len(rest: &str) -> usize {
    if rest.starts_with('\'') {
        if let Some(c) = CONTRACTIONS.iter().find(|c| rest.starts_with(**c)) {
            return c.len();
        }
    }
    let mut chars = rest.char_indices().peekable();
    let (_, first) = chars.next().expect("non-empty");
    // ` ?X+` for X in letters, numbers, other: an optional U+0020 then a run of one class.
    let (run_start, run_class) = if first == ' ' {
        match chars.peek() {
            Some(&(at, c)) if class(c) != Class::Space => (at, class(c)),
            _ => (0, Class::Space),
        }
    } else {
        (0, class(first))
    };
    if run_class != Class::Space {
        return run_start + run_length(&rest[run_start..], run_class);
    }
    // Whitespace: `\s+(?!\S)` takes the run but leaves its last character when a
    // non-space follows (so that character can prefix the next word); `\s+` takes a
    // lone whitespace character before a non-space.
    let run = run_length(rest, Class::Space);
    if run == rest.len() {
        return run;
    }
    let last = rest[..run].chars().next_back().expect("non-empty run");
    if run > last.len_utf8() {
        run - last.len_utf8()
    } else {
        run
    }
}

/// Byte length of the longest prefix of `s` whose characters are all of `class`
/// (`Other` meaning: neither space, letter nor number).
fn run_length(s: &str, run_class: Class) -> usize {
    s.char_indices()
        .find(|&(_, c)| class(c) != run_class)
        .map_or(s.len(), |(at, _)| at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for_each_pretoken(text, |t| out.push(t));
        out
    }

    #[test]
    fn matches_the_regex_on_tricky_spacing() {
        assert_eq!(split("Hello world"), ["Hello", " world"]);
        assert_eq!(split("  hello"), [" ", " hello"]);
        assert_eq!(split("a  \n b"), ["a", "  \n", " b"]);
        assert_eq!(split("end   "), ["end", "   "]);
        assert_eq!(split("x\ny"), ["x", "\n", "y"]);
        assert_eq!(
            split("don't ?'s 're"),
            ["don", "'t", " ?'", "s", " '", "re"]
        );
        assert_eq!(split("I'll 42nd"), ["I", "'ll", " 42", "nd"]);
        assert_eq!(split(" !!?"), [" !!?"]);
        assert_eq!(split("é1\u{301}"), ["é", "1", "\u{301}"]);
        assert_eq!(split("\t\tx"), ["\t", "\t", "x"]);
    }
}
