//! GPT-2's and LLaMA-3's pre-tokenizers, hand-written.
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
pub fn for_each_pretoken<'a>(text: &'a str, emit: impl FnMut(&'a str)) {
    for_each_split(text, next_pretoken_len, emit);
}

/// Calls `emit` with each piece of `text`, `next_len` giving the byte length of the
/// piece at the start of a non-empty rest.
fn for_each_split<'a>(text: &'a str, next_len: fn(&str) -> usize, mut emit: impl FnMut(&'a str)) {
    let mut pos = 0;
    while pos < text.len() {
        let len = next_len(&text[pos..]);
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
    whitespace_run(rest, run_length(rest, Class::Space))
}

/// LLaMA-3's pre-tokenizer regex (a `tokenizer.json` `Split`, isolated), which
/// [`for_each_llama3_pretoken`] follows.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Calls `emit` with each pre-token of `text` under [`LLAMA3_PATTERN`], in order;
/// together they cover `text`. At each position the first alternative that matches,
/// as the backtracking engine takes it.
pub fn for_each_llama3_pretoken<'a>(text: &'a str, emit: impl FnMut(&'a str)) {
    for_each_split(text, next_llama3_pretoken_len, emit);
}

/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` after the apostrophe: the byte length matched.
fn contraction_ignoring_case(rest: &str) -> Option<usize> {
    let mut chars = rest.chars().map(|c| match c {
        // Unicode case folding: LATIN SMALL LETTER LONG S folds to `s`.
        '\u{17f}' => ('s', 2),
        c => (c.to_ascii_lowercase(), c.len_utf8()),
    });
    let (first, first_len) = chars.next()?;
    match first {
        's' | 't' | 'm' | 'd' => Some(first_len),
        'r' | 'v' | 'l' => {
            let expected = match first {
                'r' | 'v' => 'e',
                _ => 'l',
            };
            let (second, second_len) = chars.next()?;
            (second == expected).then_some(first_len + second_len)
        }
        _ => None,
    }
}

/// Byte length of the LLaMA-3 pre-token at the start of a non-empty `rest`.
fn next_llama3_pretoken_len(rest: &str) -> usize {
    let newline = |c: char| c == '\r' || c == '\n';
    let mut chars = rest.chars();
    let first = chars.next().expect("non-empty");
    let second = chars.next();
    if first == '\'' {
        if let Some(len) = contraction_ignoring_case(&rest[1..]) {
            return 1 + len;
        }
    }
    let first_class = class(first);
    // `[^\r\n\p{L}\p{N}]?\p{L}+`
    if first_class == Class::Letter {
        return run_length(rest, Class::Letter);
    }
    let prefixable = !newline(first) && first_class != Class::Number;
    if prefixable && second.is_some_and(|c| class(c) == Class::Letter) {
        let at = first.len_utf8();
        return at + run_length(&rest[at..], Class::Letter);
    }
    // `\p{N}{1,3}`
    if first_class == Class::Number {
        return (rest.char_indices().take(3))
            .find(|&(_, c)| class(c) != Class::Number)
            .map_or_else(
                || rest.chars().take(3).map(char::len_utf8).sum(),
                |(at, _)| at,
            );
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let other_at = match (first, second.map(class)) {
        (' ', Some(Class::Other)) => Some(1),
        _ if first_class == Class::Other => Some(0),
        _ => None,
    };
    if let Some(at) = other_at {
        let end = at + run_length(&rest[at..], Class::Other);
        let newlines = rest[end..]
            .find(|c: char| !newline(c))
            .unwrap_or(rest.len() - end);
        return end + newlines;
    }
    // Whitespace. `\s*[\r\n]+`: the run up to its last line break.
    let run = run_length(rest, Class::Space);
    if let Some(last) = rest[..run].rfind(newline) {
        return last + 1;
    }
    whitespace_run(rest, run)
}

/// `\s+(?!\S)|\s+` over a whitespace run of `run` bytes at the start of `rest`.
fn whitespace_run(rest: &str, run: usize) -> usize {
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

/// GPT-2 pre-tokenization (exposed for differential tests against Megatron's regex).
pub fn gpt2_pretokens(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    for_each_pretoken(text, |p| pieces.push(p));
    pieces
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

    fn split_llama3(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for_each_llama3_pretoken(text, |t| out.push(t));
        out
    }

    #[test]
    fn follows_llama3s_regex() {
        assert_eq!(split_llama3("Hello world"), ["Hello", " world"]);
        assert_eq!(split_llama3("I'M here"), ["I", "'M", " here"]);
        assert_eq!(split_llama3("12345x"), ["123", "45", "x"]);
        assert_eq!(
            split_llama3("(hello) !!\n\nx"),
            ["(hello", ")", " !!\n\n", "x"]
        );
        assert_eq!(split_llama3("a  \n b"), ["a", "  \n", " b"]);
        assert_eq!(split_llama3("end   "), ["end", "   "]);
        assert_eq!(split_llama3("x\r\n\ty"), ["x", "\r\n", "\ty"]);
        assert_eq!(split_llama3("'ſ 'x"), ["'ſ", " '", "x"]);
        // `ſ` folds to `s`: a contraction, not a letter run.
        assert_eq!(split_llama3("'ſt"), ["'ſ", "t"]);
    }
}
