//! SentencePiece `.model` tokenizers: Megatron's `Llama2Tokenizer`,
//! `GPTSentencePieceTokenizer` and `SentencePieceTokenizer`.
//!
//! BPE models whose pieces never span a word (LLaMA-2's kind) are encoded in Rust, word
//! by word with a cache ([`super::sentencepiece_bpe`]), and so are Unigram models
//! ([`super::sentencepiece_unigram`]; word by word when no piece spans words, else over
//! the whole text), both after the library's normalization ([`super::sentencepiece_norm`]). Other models go to the library
//! through `sentencepiece-sys`'s C functions on a processor of our own, ids coming from
//! the library's own id encoder through a small C++ shim (`spm_ids.cpp`, built by
//! `build.rs`). The serialized encoder that `sentencepiece-sys` exposes builds strings
//! for every piece (4.7 MB/s against the shim's 5.2 MB/s on 2 threads, read back with a
//! few lines of protobuf decoding); it remains as the fallback when the shim cannot be
//! built.

use super::api::Tokenizer;
use super::error::TokenizerError;
use super::sentencepiece_bpe::SentencePieceBpe;
use super::sentencepiece_unigram::SentencePieceUnigram;
use super::sentencepiece_vocab::{ModelSpec, BPE, NORMAL, UNIGRAM};
use sentencepiece_sys as sys;
use std::ffi::c_void;
use std::path::Path;

extern "C" {
    /// The C allocator's `free`: the library's results are `malloc`ed.
    fn free(ptr: *mut c_void);
}

#[cfg(synerfuse_spm_ids)]
extern "C" {
    /// `spm_ids.cpp`: the library's own id encoder; calls `sink` once with the ids.
    fn synerfuse_spp_encode_ids(
        spp: *mut sys::SentencePieceProcessor,
        text: *const std::ffi::c_char,
        len: usize,
        sink: extern "C" fn(*mut c_void, *const std::ffi::c_int, usize),
        ctx: *mut c_void,
    ) -> std::ffi::c_int;
}

/// Appends the ids the shim reports to the `Vec<u32>` behind `ctx`.
#[cfg(synerfuse_spm_ids)]
extern "C" fn append_ids(ctx: *mut c_void, ids: *const std::ffi::c_int, n: usize) {
    // SAFETY: `ctx` is the `&mut Vec<u32>` passed to `synerfuse_spp_encode_ids`, and
    // the library hands `n` ids at `ids` (possibly dangling when n == 0).
    let out = unsafe { &mut *(ctx as *mut Vec<u32>) };
    if n > 0 {
        out.extend(
            // SAFETY: n > 0 ids at `ids`, valid for this call.
            unsafe { std::slice::from_raw_parts(ids, n) }
                .iter()
                .map(|&id| id as u32),
        );
    }
}

/// Reads one protobuf varint at `*at`, advancing it; `None` when truncated.
fn varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}

/// One field of a protobuf message.
#[derive(Clone, Copy)]
enum Field<'a> {
    Varint(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
    Other,
}

/// Calls `field(number, value)` for each field of a protobuf message, in order.
/// `None` when the bytes are malformed.
fn for_each_field<'a>(bytes: &'a [u8], mut field: impl FnMut(u64, Field<'a>)) -> Option<()> {
    let mut at = 0;
    while at < bytes.len() {
        let key = varint(bytes, &mut at)?;
        let value = match key & 7 {
            0 => Field::Varint(varint(bytes, &mut at)?),
            1 => {
                at = at.checked_add(8)?;
                Field::Other
            }
            2 => {
                let len = varint(bytes, &mut at)? as usize;
                let payload = bytes.get(at..at.checked_add(len)?)?;
                at += len;
                Field::Bytes(payload)
            }
            5 => {
                let raw = bytes.get(at..at + 4)?;
                at += 4;
                Field::Fixed32(u32::from_le_bytes(raw.try_into().ok()?))
            }
            _ => return None,
        };
        field(key >> 3, value);
    }
    (at == bytes.len()).then_some(())
}

/// Calls `field(number, payload)` for each length-delimited field of a message.
fn for_each_message_field<'a>(bytes: &'a [u8], mut field: impl FnMut(u64, &'a [u8])) -> Option<()> {
    for_each_field(bytes, |number, value| {
        if let Field::Bytes(payload) = value {
            field(number, payload);
        }
    })
}

/// The `uint32 id = 2` of a `SentencePiece` message.
fn piece_id(piece: &[u8]) -> Option<u32> {
    let mut id = None;
    for_each_field(piece, |number, value| {
        if let (2, Field::Varint(v)) = (number, value) {
            id = Some(v as u32);
        }
    })?;
    id
}

/// The fields of a `ModelProto` that decide how it encodes.
fn model_spec(bytes: &[u8]) -> Option<ModelSpec> {
    let mut spec = ModelSpec {
        pieces: Vec::new(),
        model_type: 1,
        byte_fallback: false,
        treat_whitespace_as_suffix: false,
        precompiled_charsmap: Vec::new(),
        add_dummy_prefix: true,
        remove_extra_whitespaces: true,
        escape_whitespaces: true,
    };
    let mut ok = true;
    for_each_field(bytes, |number, value| match (number, value) {
        (1, Field::Bytes(message)) => {
            let (mut piece, mut score, mut kind) = (String::new(), 0.0f32, NORMAL);
            ok &= for_each_field(message, |n, v| match (n, v) {
                (1, Field::Bytes(text)) => piece = String::from_utf8_lossy(text).into_owned(),
                (2, Field::Fixed32(bits)) => score = f32::from_bits(bits),
                (3, Field::Varint(v)) => kind = v,
                _ => {}
            })
            .is_some();
            spec.pieces.push((piece, score, kind));
        }
        (2, Field::Bytes(trainer)) => {
            ok &= for_each_field(trainer, |n, v| match (n, v) {
                (3, Field::Varint(v)) => spec.model_type = v,
                (24, Field::Varint(v)) => spec.treat_whitespace_as_suffix = v != 0,
                (35, Field::Varint(v)) => spec.byte_fallback = v != 0,
                _ => {}
            })
            .is_some();
        }
        (3, Field::Bytes(normalizer)) => {
            ok &= for_each_field(normalizer, |n, v| match (n, v) {
                (2, Field::Bytes(charsmap)) => spec.precompiled_charsmap = charsmap.to_vec(),
                (3, Field::Varint(v)) => spec.add_dummy_prefix = v != 0,
                (4, Field::Varint(v)) => spec.remove_extra_whitespaces = v != 0,
                (5, Field::Varint(v)) => spec.escape_whitespaces = v != 0,
                _ => {}
            })
            .is_some();
        }
        _ => {}
    })?;
    ok.then_some(spec)
}

/// The Rust encoder of a model, by its type.
enum RustEncoder {
    Bpe(SentencePieceBpe),
    Unigram(SentencePieceUnigram),
}

impl RustEncoder {
    /// The encoder for `spec`, or which of its properties needs the library.
    fn from_model(spec: &ModelSpec) -> Result<Self, &'static str> {
        match spec.model_type {
            BPE => SentencePieceBpe::from_model(spec).map(Self::Bpe),
            UNIGRAM => SentencePieceUnigram::from_model(spec).map(Self::Unigram),
            _ => Err("a word or character model"),
        }
    }

    fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        match self {
            Self::Bpe(bpe) => bpe.encode_into(text, out),
            Self::Unigram(unigram) => unigram.encode_into(text, out),
        }
    }
}

/// A loaded SentencePiece model.
pub struct SentencePieceModel {
    raw: *mut sys::SentencePieceProcessor,
    /// Piece strings by id, from the model's `ModelProto.pieces`.
    pieces: Vec<String>,
    /// The Rust encoder, for the models it reproduces exactly.
    rust: Option<RustEncoder>,
    /// Why `rust` is `None`.
    library_reason: Option<&'static str>,
}

// SAFETY: the processor is immutable after loading, and SentencePiece's encode and
// decode are const methods that may run concurrently.
unsafe impl Send for SentencePieceModel {}
// SAFETY: as for Send: shared use only calls const methods of a loaded processor.
unsafe impl Sync for SentencePieceModel {}

impl Drop for SentencePieceModel {
    fn drop(&mut self) {
        // SAFETY: `raw` came from spp_new and is freed once.
        unsafe { sys::spp_free(self.raw) }
    }
}

impl SentencePieceModel {
    /// Loads a `.model` file.
    pub fn open(path: &Path) -> Result<Self, TokenizerError> {
        let bytes = std::fs::read(path).map_err(TokenizerError::io(path))?;
        let bad = |problem: &str| TokenizerError::BadFile {
            path: path.to_path_buf(),
            problem: problem.to_owned(),
        };
        let spec = model_spec(&bytes)
            .ok_or_else(|| bad("not a SentencePiece model (malformed protobuf)"))?;
        let pieces = spec
            .pieces
            .iter()
            .map(|(piece, ..)| piece.clone())
            .collect();
        let (rust, library_reason) = match RustEncoder::from_model(&spec) {
            Ok(rust) => (Some(rust), None),
            Err(reason) => (None, Some(reason)),
        };
        // SAFETY: a fresh processor, loaded from bytes that outlive the call.
        let raw = unsafe { sys::spp_new() };
        // SAFETY: `raw` is the processor just made; `bytes` lives across the call.
        let status =
            unsafe { sys::spp_from_serialized_proto(raw, bytes.as_ptr() as *const _, bytes.len()) };
        let model = Self {
            raw,
            pieces,
            rust,
            library_reason,
        };
        if status != 0 {
            return Err(bad(&format!(
                "SentencePiece could not load it (status {status})"
            )));
        }
        if model.pieces.len() != model.piece_size() {
            return Err(bad(
                "its piece list disagrees with the library's piece count",
            ));
        }
        Ok(model)
    }

    /// Number of pieces.
    pub fn piece_size(&self) -> usize {
        // SAFETY: loaded processor.
        unsafe { sys::spp_piece_size(self.raw) }.max(0) as usize
    }

    fn special_id(id: i32) -> Option<u32> {
        u32::try_from(id).ok()
    }

    /// The BOS id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        // SAFETY: `raw` is a loaded processor owned by `self`.
        Self::special_id(unsafe { sys::spp_bos_id(self.raw) })
    }

    /// The EOS id, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        // SAFETY: `raw` is a loaded processor owned by `self`.
        Self::special_id(unsafe { sys::spp_eos_id(self.raw) })
    }

    /// The PAD id, if the model has one.
    pub fn pad_id(&self) -> Option<u32> {
        // SAFETY: `raw` is a loaded processor owned by `self`.
        Self::special_id(unsafe { sys::spp_pad_id(self.raw) })
    }

    /// The piece string of `id`.
    pub fn id_to_piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Appends the ids of `text` to `out` (the library's `EncodeAsIds`).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        match &self.rust {
            Some(rust) => {
                rust.encode_into(text, out);
                Ok(())
            }
            None => self.encode_with_library(text, out),
        }
    }

    /// Whether [`Self::encode_into`] uses the Rust encoder.
    pub fn has_rust_encoder(&self) -> bool {
        self.rust.is_some()
    }

    /// Why [`Self::encode_into`] goes through the library (the model's property the Rust
    /// encoder does not cover), or `None` when it does not.
    pub fn library_reason(&self) -> Option<&'static str> {
        self.library_reason
    }

    /// [`Self::encode_into`] through the SentencePiece library itself.
    pub fn encode_with_library(
        &self,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        #[cfg(synerfuse_spm_ids)]
        {
            // SAFETY: loaded processor; `text` and `out` outlive the call.
            let status = unsafe {
                synerfuse_spp_encode_ids(
                    self.raw,
                    text.as_ptr() as *const _,
                    text.len(),
                    append_ids,
                    out as *mut Vec<u32> as *mut c_void,
                )
            };
            if status != 0 {
                return Err(self.encode_error(text));
            }
            Ok(())
        }
        #[cfg(not(synerfuse_spm_ids))]
        self.encode_serialized(text, out)
    }

    /// The library's serialized encoder, ids read from its protobuf: the fallback when
    /// the id-encoder shim could not be built.
    #[cfg_attr(synerfuse_spm_ids, allow(dead_code))]
    fn encode_serialized(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut len = 0usize;
        // SAFETY: `text` outlives the call; the result is malloc'ed and freed below.
        let data = unsafe {
            sys::spp_encode_as_serialized_proto(
                self.raw,
                text.as_ptr() as *const _,
                text.len(),
                &mut len,
            )
        };
        if data.is_null() {
            return Err(self.encode_error(text));
        }
        // SAFETY: the library wrote `len` bytes at `data`.
        let bytes = unsafe { std::slice::from_raw_parts(data, len) };
        let mut ok = true;
        // SentencePieceText: `repeated SentencePiece pieces = 2`.
        let parsed = for_each_message_field(bytes, |number, piece| {
            if number == 2 {
                match piece_id(piece) {
                    Some(id) => out.push(id),
                    None => ok = false,
                }
            }
        });
        // SAFETY: `data` was malloc'ed by the library for us and is freed once.
        unsafe { free(data as *mut c_void) };
        if parsed.is_none() || !ok {
            return Err(self.encode_error(text));
        }
        Ok(())
    }

    fn encode_error(&self, text: &str) -> TokenizerError {
        TokenizerError::BadText {
            text: text.chars().take(40).collect(),
            problem: "SentencePiece returned no result".to_owned(),
        }
    }

    /// Text of `ids` (the library's `DecodeIds`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.pieces.len()) {
            return Err(TokenizerError::UnknownId { id });
        }
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: ids are in range; the result is malloc'ed and freed below.
        let status = unsafe {
            sys::spp_decode_piece_ids(self.raw, ids.as_ptr(), ids.len(), &mut data, &mut len)
        };
        if status != 0 || (data.is_null() && len > 0) {
            return Err(TokenizerError::BadText {
                text: format!("{:?}", &ids[..ids.len().min(8)]),
                problem: format!("SentencePiece could not decode (status {status})"),
            });
        }
        let text = if len == 0 {
            String::new()
        } else {
            // SAFETY: the library wrote `len` bytes at `data`.
            String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(data, len) }).into_owned()
        };
        if !data.is_null() {
            // SAFETY: `data` was malloc'ed by the library for us and is freed once.
            unsafe { free(data as *mut c_void) };
        }
        Ok(text)
    }
}

/// How a SentencePiece model is wrapped, after Megatron's classes of the same names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SentencePieceFlavor {
    /// `Llama2Tokenizer`: BOS before every piece of text, EOS as `eod`, no pad.
    Llama2,
    /// `GPTSentencePieceTokenizer`: plain ids, EOS as `eod`, the model's pad.
    Gpt,
}

/// Megatron's `Llama2Tokenizer` and `GPTSentencePieceTokenizer`.
pub struct SentencePieceTokenizer {
    model: SentencePieceModel,
    flavor: SentencePieceFlavor,
}

impl SentencePieceTokenizer {
    /// Loads `--tokenizer-model`.
    pub fn open(path: &Path, flavor: SentencePieceFlavor) -> Result<Self, TokenizerError> {
        let model = SentencePieceModel::open(path)?;
        if flavor == SentencePieceFlavor::Llama2 && model.bos_id().is_none() {
            return Err(TokenizerError::BadFile {
                path: path.to_path_buf(),
                problem: "Llama2Tokenizer needs a model with a BOS piece".to_owned(),
            });
        }
        Ok(Self { model, flavor })
    }
}

impl Tokenizer for SentencePieceTokenizer {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        if self.flavor == SentencePieceFlavor::Llama2 {
            // Megatron adds BOS even to an empty text.
            ids.extend(self.model.bos_id());
        }
        self.model.encode_into(text, &mut ids)?;
        Ok(ids)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.model.decode(ids)
    }

    fn vocab_size(&self) -> usize {
        self.model.piece_size()
    }

    fn eod(&self) -> Option<u32> {
        self.model.eos_id()
    }

    fn pad(&self) -> Option<u32> {
        match self.flavor {
            SentencePieceFlavor::Llama2 => None,
            SentencePieceFlavor::Gpt => self.model.pad_id(),
        }
    }

    fn library_reason(&self) -> Option<&'static str> {
        self.model.library_reason()
    }
}

/// Megatron's `SentencePieceTokenizer`: special-token strings in the text are matched
/// first (earliest match, ties by insertion order) and the text between them is
/// encoded; `<CLS>`, `<SEP>`, `<EOD>`, `<MASK>` and the pad/bos/eos pieces are added to
/// the vocabulary after the model's pieces when the model lacks them.
pub struct SpecialSentencePieceTokenizer {
    model: SentencePieceModel,
    /// Special tokens in insertion order, with their ids.
    specials: Vec<(String, u32)>,
    vocab_size: usize,
    eod: u32,
    pad: u32,
}

impl SpecialSentencePieceTokenizer {
    /// Loads `--tokenizer-model` (no `vocab_extra_ids`, as preprocess_data.py sets).
    pub fn open(path: &Path) -> Result<Self, TokenizerError> {
        let model = SentencePieceModel::open(path)?;
        let mut vocab: std::collections::HashMap<String, u32> = model
            .pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (p.clone(), i as u32))
            .collect();
        let mut specials: Vec<(String, u32)> = Vec::new();
        let mut add = |token: String| -> u32 {
            let next = vocab.len() as u32;
            let id = *vocab.entry(token.clone()).or_insert(next);
            if !specials.iter().any(|(t, _)| *t == token) {
                specials.push((token, id));
            }
            id
        };
        add("<CLS>".into());
        add("<SEP>".into());
        let eod = add("<EOD>".into());
        add("<MASK>".into());
        let named = |id: Option<u32>, fallback: &str| {
            id.and_then(|i| model.id_to_piece(i))
                .unwrap_or(fallback)
                .to_owned()
        };
        let pad = add(named(model.pad_id(), "<PAD>"));
        add(named(model.bos_id(), "<BOS>"));
        add(named(model.eos_id(), "<EOS>"));
        let vocab_size = vocab.len();
        Ok(Self {
            model,
            specials,
            vocab_size,
            eod,
            pad,
        })
    }
}

impl Tokenizer for SpecialSentencePieceTokenizer {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        let mut rest = text;
        loop {
            // The earliest special token; among equal positions the first added.
            let next = self
                .specials
                .iter()
                .filter_map(|(token, id)| rest.find(token.as_str()).map(|at| (at, token, *id)))
                .min_by_key(|&(at, ..)| at);
            let Some((at, token, id)) = next else { break };
            self.model.encode_into(&rest[..at], &mut ids)?;
            ids.push(id);
            rest = &rest[at + token.len()..];
        }
        self.model.encode_into(rest, &mut ids)?;
        Ok(ids)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut text = String::new();
        let mut run = Vec::new();
        for &id in ids {
            match self.specials.iter().find(|(_, sid)| *sid == id) {
                Some((token, _)) => {
                    text.push_str(&self.model.decode(&run)?);
                    run.clear();
                    text.push_str(token);
                }
                None => run.push(id),
            }
        }
        text.push_str(&self.model.decode(&run)?);
        Ok(text)
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn eod(&self) -> Option<u32> {
        Some(self.eod)
    }

    fn pad(&self) -> Option<u32> {
        Some(self.pad)
    }

    fn library_reason(&self) -> Option<&'static str> {
        self.model.library_reason()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ids_from_a_serialized_piece_list() {
        // SentencePieceText { pieces: [{piece: "a", id: 5}, {id: 300, surface: "b"}] }
        let piece_a = [0x0a, 0x01, b'a', 0x10, 0x05];
        let piece_b = [0x10, 0xac, 0x02, 0x1a, 0x01, b'b'];
        let mut message = vec![0x0a, 0x02, b'h', b'i', 0x12, piece_a.len() as u8];
        message.extend(piece_a);
        message.push(0x12);
        message.push(piece_b.len() as u8);
        message.extend(piece_b);
        let mut ids = Vec::new();
        for_each_message_field(&message, |n, p| {
            if n == 2 {
                ids.push(piece_id(p).unwrap());
            }
        })
        .unwrap();
        assert_eq!(ids, vec![5, 300]);
        assert!(for_each_message_field(&message[..message.len() - 1], |_, _| {}).is_none());
    }
}
