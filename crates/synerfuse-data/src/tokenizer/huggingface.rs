//! Any Hugging Face `tokenizer.json`, and byte-level BPE training for users who have none.

use super::{Tokenizer, TokenizerError};
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
        Ok(Self { inner, eod })
    }
}

impl Tokenizer for HuggingFaceTokenizer {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| TokenizerError::BadText {
                text: text.chars().take(40).collect(),
                problem: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
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
        Some("a Hugging Face tokenizer.json, encoded by the tokenizers crate")
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
