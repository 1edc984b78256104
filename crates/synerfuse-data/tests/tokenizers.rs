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

/// `tokenizer train`: a byte-level BPE trained on the fixture corpus, loaded back both as
/// HuggingFaceTokenizer (tokenizer.json) and as GPT2BPETokenizer (vocab.json +
/// merges.txt), gives the same ids for every text without special-token strings, and
/// round-trips text exactly. In text, `<|endoftext|>` is the special token for the HF
/// tokenizer (as with `AutoTokenizer`) and plain text for Megatron's GPT-2 BPE.
#[test]
fn trained_bpe_agrees_between_tokenizer_json_and_gpt2_files() {
    use std::path::Path;
    use synerfuse_data::preprocess::read_json_texts;
    use synerfuse_data::tokenizer::{
        train_byte_level_bpe, Gpt2BpeTokenizer, HuggingFaceTokenizer, Tokenizer,
    };

    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron/corpus.jsonl");
    let texts = read_json_texts(&corpus, &["text".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("tokenizer.json");
    let trained = train_byte_level_bpe(texts.clone().into_iter(), 600, &output, true).unwrap();
    assert!(
        trained.vocab_size > 300 && trained.vocab_size <= 600,
        "{}",
        trained.vocab_size
    );
    let (vocab, merges) = trained.gpt2_files.unwrap();
    let hf = HuggingFaceTokenizer::open(&output).unwrap();
    let gpt2 = Gpt2BpeTokenizer::from_files(&vocab, &merges).unwrap();
    assert_eq!(hf.eod(), gpt2.eod());
    assert_eq!(hf.vocab_size(), gpt2.vocab_size());
    let eod = hf.eod().unwrap();
    for text in &texts {
        let ids = hf.tokenize(text).unwrap();
        if text.contains("<|endoftext|>") {
            assert!(
                ids.contains(&eod) && !gpt2.tokenize(text).unwrap().contains(&eod),
                "{text:?}"
            );
        } else {
            assert_eq!(ids, gpt2.tokenize(text).unwrap(), "{text:?}");
            assert_eq!(&hf.detokenize(&ids).unwrap(), text);
        }
    }
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["merges.txt", "tokenizer.json", "vocab.json"]);
}
