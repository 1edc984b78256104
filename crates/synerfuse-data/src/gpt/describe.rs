//! Cache names: Megatron hashes `json.dumps(unique_identifiers, indent=4)` with md5, so a
//! cache is shared only if the description text is the same byte for byte. This module
//! writes Python's JSON (indent 4, `ensure_ascii`, Python float `repr`, int vs float kept
//! apart) for the few value kinds the descriptions hold.

use std::fmt::Write;

/// A Python value as `json.dumps` sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    /// `None` → `null`.
    None,
    /// `True`/`False`.
    Bool(bool),
    /// A Python `int`.
    Int(i64),
    /// A Python `float`: printed with `repr`, so `0` and `0.0` differ.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A list or tuple.
    List(Vec<PyValue>),
    /// A dict, in insertion order.
    Dict(Vec<(String, PyValue)>),
}

impl PyValue {
    /// A string value.
    pub fn str(s: impl Into<String>) -> PyValue {
        PyValue::Str(s.into())
    }

    /// `json.dumps(self, indent=4)`.
    pub fn to_python_json(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, 0);
        out
    }

    fn write(&self, out: &mut String, depth: usize) {
        match self {
            PyValue::None => out.push_str("null"),
            PyValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            PyValue::Int(i) => {
                let _ = write!(out, "{i}");
            }
            PyValue::Float(f) => out.push_str(&python_float_repr(*f)),
            PyValue::Str(s) => write_python_string(out, s),
            PyValue::List(items) if items.is_empty() => out.push_str("[]"),
            PyValue::Dict(items) if items.is_empty() => out.push_str("{}"),
            PyValue::List(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    out.push_str(if i == 0 { "\n" } else { ",\n" });
                    indent(out, depth + 1);
                    item.write(out, depth + 1);
                }
                out.push('\n');
                indent(out, depth);
                out.push(']');
            }
            PyValue::Dict(items) => {
                out.push('{');
                for (i, (key, value)) in items.iter().enumerate() {
                    out.push_str(if i == 0 { "\n" } else { ",\n" });
                    indent(out, depth + 1);
                    write_python_string(out, key);
                    out.push_str(": ");
                    value.write(out, depth + 1);
                }
                out.push('\n');
                indent(out, depth);
                out.push('}');
            }
        }
    }
}

fn indent(out: &mut String, depth: usize) {
    out.extend(std::iter::repeat_n(' ', 4 * depth));
}

/// A JSON string with `ensure_ascii=True`: non-ASCII as `\uXXXX` (surrogate pairs above
/// the BMP), `/` left alone.
fn write_python_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation when
/// the decimal exponent is in `[-4, 16)` (always with a fraction, `1.0`), otherwise as
/// `d.ddde±XX` with at least two exponent digits. `json.dumps` writes the non-finite
/// values as `NaN`, `Infinity`, `-Infinity`.
pub fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "1e16".
    let sci = format!("{x:e}");
    let (mantissa, exponent) = sci.split_once('e').expect("{:e} has an exponent");
    let exponent: i32 = exponent.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exponent) {
        let point = exponent + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-point) as usize));
            out.push_str(&digits);
        } else if point as usize >= digits.len() {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', point as usize - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point as usize]);
            out.push('.');
            out.push_str(&digits[point as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.abs()
        );
    }
    out
}

/// `hashlib.md5(text.encode("utf-8")).hexdigest()`.
pub fn md5_hex(text: &str) -> String {
    use md5::{Digest, Md5};
    let digest = Md5::digest(text.as_bytes());
    digest.iter().fold(String::with_capacity(32), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (x, expected) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.969, "0.969"),
            (0.9500000000000001, "0.9500000000000001"),
            (1e-5, "1e-05"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.2345e16, "1.2345e+16"),
            (1e15, "1000000000000000.0"),
            (123.25, "123.25"),
            (1.0 / 3.0, "0.3333333333333333"),
            (-2.5e-300, "-2.5e-300"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(python_float_repr(x), expected, "{x:e}");
        }
    }

    #[test]
    fn strings_are_ascii_escaped() {
        let mut out = String::new();
        write_python_string(&mut out, "a/b\"c\\é😀\u{1}");
        assert_eq!(out, r#""a/b\"c\\\u00e9\ud83d\ude00\u0001""#);
    }

    /// A description megatron-core 0.8.0 writes, and its md5 (the cache name).
    #[test]
    fn spec_description_and_hash() {
        let d = PyValue::Dict(vec![
            ("class".into(), PyValue::str("GPTDataset")),
            (
                "dataset_path".into(),
                PyValue::str("/data/tiny_text_document"),
            ),
            ("num_samples".into(), PyValue::Int(6)),
            ("index_split".into(), PyValue::str("train")),
            ("random_seed".into(), PyValue::Int(1234)),
            ("sequence_length".into(), PyValue::Int(4)),
            ("split".into(), PyValue::str("1")),
            (
                "split_matrix".into(),
                PyValue::List(vec![
                    PyValue::List(vec![PyValue::Int(0), PyValue::Float(1.0)]),
                    PyValue::None,
                    PyValue::None,
                ]),
            ),
            (
                "tokenizer".into(),
                PyValue::Dict(vec![
                    ("class".into(), PyValue::str("_NullTokenizer")),
                    ("tokenizer_path".into(), PyValue::List(vec![PyValue::None])),
                    ("vocab_size".into(), PyValue::str("786")),
                ]),
            ),
        ]);
        let text = d.to_python_json();
        assert!(text.starts_with("{\n    \"class\": \"GPTDataset\",\n"));
        assert!(text.contains("\"split_matrix\": [\n        [\n            0,\n            1.0\n        ],\n        null,"));
        assert_eq!(md5_hex(&text), "b84af7e4abf7c73ff43efe90474c7fe2");
        assert_eq!(PyValue::List(vec![]).to_python_json(), "[]");
    }
}
