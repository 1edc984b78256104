//! Tokenizers against Megatron's own rules, on committed fixtures.

use synerfuse_data::tokenizer::gpt2_pretokens;

/// 409 strings split by Python's `regex` module with Megatron's GPT-2 pattern: letters,
/// digits (Nd, Nl, No), combining and spacing marks, many kinds of whitespace, and
/// contractions in every position.
#[test]
fn gpt2_pretokenizer_matches_megatrons_regex() {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gpt2_pretokenize.json")).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() > 400);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<&str> = case["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(gpt2_pretokens(text), expected, "text {text:?}");
    }
}
