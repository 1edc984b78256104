//! Any Hugging Face `tokenizer.json`, and byte-level BPE training for users who have none.

use super::api::Tokenizer;
use super::error::TokenizerError;
use super::gpt2::{Gpt2BpeTokenizer, Pretokens};
use super::pretokenize::LLAMA3_PATTERN;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Model, TokenizerBuilder};

/// Megatron's `HuggingFaceTokenizer` semantics over the `tokenizers` crate: ids with the
/// tokenizer's own special tokens, `eos_token` as `eod`, the full vocabulary (added
/// tokens included) as `vocab_size`, and no pad.
pub struct HuggingFaceTokenizer {
    inner: tokenizers::Tokenizer,
    eod: Option<u32>,
    /// The GPT-2 encoder, when it gives this tokenizer's ids exactly, with the added
    /// tokens matched in the text before it; else why not.
    own: Result<OwnEncoder, &'static str>,
}

/// Synerfuse's GPT-2 encoder standing in for a `tokenizer.json`, its added tokens
/// (longest first), matched in the text before it, and the ids its post-processor puts
/// around a text.
struct OwnEncoder {
    gpt2: Gpt2BpeTokenizer,
    added: Vec<(String, u32)>,
    around: AddedAround,
}

/// The special tokens a post-processor adds before and after a single text.
#[derive(Debug, Default, PartialEq)]
struct AddedAround {
    before: Vec<u32>,
    after: Vec<u32>,
}

/// A JSON flag that is absent or false.
fn off(v: &Value) -> bool {
    v.is_null() || v.as_bool() == Some(false)
}

/// The pre-tokenization of a byte-level BPE our scanners reproduce: GPT-2's (a
/// `ByteLevel` with its regex) or LLaMA-3's (its `Split` regex, isolated, then a
/// `ByteLevel` without regex); no prefix space.
fn pretokens(pre: &Value) -> Result<Pretokens, &'static str> {
    let byte_level = |p: &Value| p["type"] == "ByteLevel" && off(&p["add_prefix_space"]);
    if byte_level(pre) && pre["use_regex"].as_bool() != Some(false) {
        return Ok(Pretokens::Gpt2);
    }
    if let (Some("Sequence"), Some([split, bytes])) = (
        pre["type"].as_str(),
        pre["pretokenizers"].as_array().map(Vec::as_slice),
    ) {
        let llama3 = split["type"] == "Split"
            && split["pattern"]["Regex"] == LLAMA3_PATTERN
            && split["behavior"] == "Isolated"
            && off(&split["invert"])
            && byte_level(bytes)
            && bytes["use_regex"] == false;
        if llama3 {
            return Ok(Pretokens::Llama3);
        }
    }
    Err("a pre-tokenizer other than GPT-2's or LLaMA-3's byte-level one (no prefix space)")
}

/// What a post-processor adds around a single text: nothing (none, or `ByteLevel`,
/// which only trims offsets), a `TemplateProcessing`'s special tokens around `$A`, or a
/// `Sequence` of those with at most one template.
fn added_around(post: &Value) -> Result<AddedAround, &'static str> {
    const OTHER: &str = "a post-processor other than a template around the text";
    match post["type"].as_str() {
        None if post.is_null() => Ok(AddedAround::default()),
        Some("ByteLevel") => Ok(AddedAround::default()),
        Some("TemplateProcessing") => template_around(post),
        Some("Sequence") => {
            let mut around = AddedAround::default();
            for processor in post["processors"].as_array().ok_or(OTHER)? {
                let added = added_around(processor)?;
                if added != AddedAround::default() {
                    if around != AddedAround::default() {
                        return Err("two post-processors that add tokens");
                    }
                    around = added;
                }
            }
            Ok(around)
        }
        _ => Err(OTHER),
    }
}

/// A `TemplateProcessing`'s `single` template: special tokens, then `$A`, then special
/// tokens.
fn template_around(post: &Value) -> Result<AddedAround, &'static str> {
    const BAD: &str = "a post-processor template other than special tokens around $A";
    let mut around = AddedAround::default();
    let mut seen_text = false;
    for piece in post["single"].as_array().ok_or(BAD)? {
        if let Some(sequence) = piece.get("Sequence") {
            if seen_text || sequence["id"] != "A" {
                return Err(BAD);
            }
            seen_text = true;
        } else if let Some(name) = piece["SpecialToken"]["id"].as_str() {
            let ids = post["special_tokens"][name]["ids"].as_array().ok_or(BAD)?;
            let side = match seen_text {
                false => &mut around.before,
                true => &mut around.after,
            };
            for id in ids {
                side.push(
                    id.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or(BAD)?,
                );
            }
        } else {
            return Err(BAD);
        }
    }
    match seen_text {
        true => Ok(around),
        false => Err(BAD),
    }
}

/// Synerfuse's byte-level BPE encoder for a `tokenizer.json` that it serves exactly: a
/// BPE model without dropout, unknown token, affixes or byte fallback (ignored merges
/// allowed); no normalizer; GPT-2's or LLaMA-3's byte-level pre-tokenization; no
/// post-processor, or a template of special tokens around the text; added tokens
/// without whitespace rules. With its added tokens, longest first. Otherwise the
/// property that needs the `tokenizers` crate.
fn own_encoder(json: &Value) -> Result<OwnEncoder, &'static str> {
    let absent = |v: &Value| v.is_null() || v.as_str() == Some("");
    if !json["normalizer"].is_null() {
        return Err("a normalizer");
    }
    let pretokens = pretokens(&json["pre_tokenizer"])?;
    let around = added_around(&json["post_processor"])?;
    let model = &json["model"];
    let plain_bpe = model["type"] == "BPE"
        && absent(&model["dropout"])
        && absent(&model["unk_token"])
        && absent(&model["continuing_subword_prefix"])
        && absent(&model["end_of_word_suffix"])
        && off(&model["byte_fallback"]);
    if !plain_bpe {
        return Err(
            "a model other than plain BPE (dropout, an unknown token, affixes or byte fallback)",
        );
    }
    let encoder: HashMap<String, u32> = (model["vocab"].as_object())
        .ok_or("a BPE model without a vocabulary")?
        .iter()
        .filter_map(|(token, id)| Some((token.clone(), u32::try_from(id.as_u64()?).ok()?)))
        .collect();
    let merges_text = merges_text(model)?;
    let added = added_tokens(json)?;
    let gpt2 = Gpt2BpeTokenizer::with_eod(encoder, &merges_text, u32::MAX)
        .with_pretokens(pretokens, model["ignore_merges"].as_bool() == Some(true));
    Ok(OwnEncoder {
        gpt2,
        added,
        around,
    })
}

/// A BPE model's merges as the text of a GPT-2 merges file (a header line, one pair per
/// line, a final newline).
fn merges_text(model: &Value) -> Result<String, &'static str> {
    let mut text = String::from("#version: 0.2\n");
    for merge in model["merges"]
        .as_array()
        .ok_or("a BPE model without merges")?
    {
        let line = match merge {
            Value::String(pair) => pair.clone(),
            Value::Array(pair) => (pair.iter())
                .map(|p| p.as_str().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(" "),
            _ => return Err("a merge that is neither \"a b\" nor [a, b]"),
        };
        if line.split(' ').count() != 2 {
            return Err("a merge whose pieces hold spaces");
        }
        text.push_str(&line);
        text.push('\n');
    }
    Ok(text)
}

/// The added tokens, longest first, when none has whitespace rules. They stay out of
/// the model's vocabulary: the library matches them in the text only, never as a BPE
/// word (which `ignore_merges` looks up in the vocabulary).
fn added_tokens(json: &Value) -> Result<Vec<(String, u32)>, &'static str> {
    let mut added = Vec::new();
    for token in json["added_tokens"].as_array().into_iter().flatten() {
        let plain = off(&token["single_word"]) && off(&token["lstrip"]) && off(&token["rstrip"]);
        let (Some(content), Some(id)) = (token["content"].as_str(), token["id"].as_u64()) else {
            return Err("an added token without content or id");
        };
        if !plain || content.is_empty() {
            return Err("added tokens with whitespace rules");
        }
        let id = u32::try_from(id).map_err(|_| "an added token id beyond u32")?;
        added.push((content.to_owned(), id));
    }
    added.sort_by_key(|(content, _)| std::cmp::Reverse(content.len()));
    Ok(added)
}

/// The earliest added token in `text` (the longest of those starting there): its byte
/// range and id.
fn next_added(text: &str, added: &[(String, u32)]) -> Option<(std::ops::Range<usize>, u32)> {
    let mut best: Option<(std::ops::Range<usize>, u32)> = None;
    for (content, id) in added {
        if let Some(at) = text.find(content.as_str()) {
            // Longest first: a later, equally early match is shorter.
            if best.as_ref().is_none_or(|(range, _)| at < range.start) {
                best = Some((at..at + content.len(), *id));
            }
        }
    }
    best
}

/// End-of-text tokens tried, in order, when no `tokenizer_config.json` names one.
const EOS_CANDIDATES: [&str; 5] = [
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|eot_id|>",
];

impl HuggingFaceTokenizer {
    /// Loads `tokenizer.json`, or the one inside a directory; the `eos_token` of a
    /// `tokenizer_config.json` beside it is the end-of-document token.
    pub fn open(path: &Path) -> Result<Self, TokenizerError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(TokenizerError::io(&file))?;
        let inner: tokenizers::Tokenizer = text.parse().map_err(|e| TokenizerError::BadFile {
            path: file.clone(),
            problem: format!("not a Hugging Face tokenizer.json: {e}"),
        })?;
        let configured = file
            .parent()
            .map(|dir| dir.join("tokenizer_config.json"))
            .and_then(|config| std::fs::read_to_string(config).ok())
            .and_then(|config| serde_json::from_str::<serde_json::Value>(&config).ok())
            .and_then(|config| match &config["eos_token"] {
                serde_json::Value::String(s) => Some(s.clone()),
                other => other["content"].as_str().map(str::to_owned),
            });
        let eod = configured
            .iter()
            .map(String::as_str)
            .chain(EOS_CANDIDATES)
            .find_map(|token| inner.token_to_id(token));
        let own = serde_json::from_str::<Value>(&text)
            .map_err(|_| "a tokenizer.json serde_json cannot read")
            .and_then(|json| own_encoder(&json));
        Ok(Self { inner, eod, own })
    }
}

impl HuggingFaceTokenizer {
    /// The ids through the `tokenizers` crate, whatever the tokenizer.
    pub fn tokenize_with_library(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| TokenizerError::BadText {
                text: text.chars().take(40).collect(),
                problem: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Whether [`Tokenizer::tokenize`] uses synerfuse's own GPT-2 encoder.
    pub fn has_own_encoder(&self) -> bool {
        self.own.is_ok()
    }
}

impl Tokenizer for HuggingFaceTokenizer {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let Ok(OwnEncoder {
            gpt2,
            added,
            around,
        }) = &self.own
        else {
            return self.tokenize_with_library(text);
        };
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        ids.extend_from_slice(&around.before);
        let mut rest = text;
        while let Some((range, id)) = next_added(rest, added) {
            if range.start > 0 {
                ids.extend(gpt2.tokenize(&rest[..range.start])?);
            }
            ids.push(id);
            rest = &rest[range.end..];
        }
        if !rest.is_empty() {
            ids.extend(gpt2.tokenize(rest)?);
        }
        ids.extend_from_slice(&around.after);
        Ok(ids)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::BadText {
                text: format!("{:?}", &ids[..ids.len().min(8)]),
                problem: e.to_string(),
            })
    }

    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn eod(&self) -> Option<u32> {
        self.eod
    }

    fn pad(&self) -> Option<u32> {
        None
    }

    fn library_reason(&self) -> Option<&'static str> {
        self.own.as_ref().err().copied()
    }
}

/// What [`train_byte_level_bpe`] wrote.
#[derive(Debug, Clone)]
pub struct TrainedTokenizer {
    /// The `tokenizer.json`.
    pub tokenizer_json: PathBuf,
    /// GPT-2 style `vocab.json` and `merges.txt` (usable as GPT2BPETokenizer), if asked for.
    pub gpt2_files: Option<(PathBuf, PathBuf)>,
    /// Vocabulary size reached (at most the one asked for).
    pub vocab_size: usize,
}

/// Trains a GPT-2 style byte-level BPE of `vocab_size` tokens (including
/// `<|endoftext|>`) on `texts`, writes `output` (a `tokenizer.json`) and, with
/// `gpt2_files`, `vocab.json` + `merges.txt` beside it. Files are written under
/// temporary names and renamed.
pub fn train_byte_level_bpe<I>(
    texts: I,
    vocab_size: usize,
    output: &Path,
    gpt2_files: bool,
) -> Result<TrainedTokenizer, TokenizerError>
where
    I: Iterator<Item = String> + Send,
{
    let failed = |problem: String| TokenizerError::BadFile {
        path: output.to_path_buf(),
        problem,
    };
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<tokenizers::NormalizerWrapper>)
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_post_processor(None::<tokenizers::PostProcessorWrapper>)
        .with_decoder(Some(ByteLevelDecoder::default()))
        .build()
        .map_err(|e| failed(e.to_string()))?;
    tokenizer
        .train(&mut trainer, texts)
        .map_err(|e| failed(format!("training failed: {e}")))?;
    let trained_size = tokenizer.get_vocab_size(true);

    let dir = output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let temp = dir.join(format!(".synerfuse-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&temp).map_err(TokenizerError::io(&temp))?;
    let result = (|| {
        let json = temp.join("tokenizer.json");
        tokenizer
            .save(&json, false)
            .map_err(|e| failed(e.to_string()))?;
        let mut written = vec![(json, output.to_path_buf())];
        let mut gpt2 = None;
        if gpt2_files {
            tokenizer
                .get_model()
                .save(&temp, None)
                .map_err(|e| failed(e.to_string()))?;
            let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
            written.push((temp.join("vocab.json"), vocab.clone()));
            written.push((temp.join("merges.txt"), merges.clone()));
            gpt2 = Some((vocab, merges));
        }
        for (from, to) in written {
            std::fs::rename(&from, &to).map_err(TokenizerError::io(&to))?;
        }
        Ok(TrainedTokenizer {
            tokenizer_json: output.to_path_buf(),
            gpt2_files: gpt2,
            vocab_size: trained_size,
        })
    })();
    let _ = std::fs::remove_dir_all(&temp);
    result
}
