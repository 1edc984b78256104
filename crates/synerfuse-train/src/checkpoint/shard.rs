//! One rank's files of a checkpoint: the pieces it holds, streamed into safetensors
//! files through one bounded buffer, hashed as they are written, and the fragment of the
//! manifest that says which elements of which global tensors they hold.

use super::files::{hex, io_err, problem_at, write_atomically, ManifestEntry};
use super::region::Region;
use crate::comm::watchdog::waiting_on;
use crate::error::{CheckpointProblem, TrainError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use synerfuse_model::tch::{Device, Kind, Tensor};

pub use super::layout::{failure_file, fragment_file, rank_file};

/// Elements moved to the host and written at a time: the write buffer a save adds to a
/// rank's memory (4 MiB of fp32 bytes; a second 4 MiB host chunk when the data is on a
/// GPU or in another dtype; and a 1 MiB file buffer).
pub const WRITE_CHUNK_ELEMENTS: i64 = 1 << 20;

/// One stored piece of a global tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredPiece {
    /// The file, in the checkpoint directory.
    pub file: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// Where its data starts in the file, in bytes.
    pub offset: u64,
    /// safetensors' name of its dtype (`F32`, `BF16`, `F16`).
    pub dtype: String,
    /// The elements of the whole tensor it holds, in this order.
    #[serde(flatten)]
    pub region: Region,
}

/// A global tensor of a checkpoint: its whole shape and the pieces that cover it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredTensor {
    /// The whole tensor's shape.
    pub shape: Vec<i64>,
    /// Pieces, disjoint, together every element.
    pub pieces: Vec<StoredPiece>,
}

/// What one rank wrote: its files and the pieces in them (merged into the manifest).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Fragment {
    /// The rank.
    pub rank: usize,
    /// Its files.
    pub files: BTreeMap<String, ManifestEntry>,
    /// Global tensor name → its shape and this rank's pieces of it.
    pub tensors: BTreeMap<String, StoredTensor>,
}

/// A piece to write: elements `region` of the global tensor `name` (whole shape `shape`),
/// `data` holding them flat (any float dtype and device; written as fp32).
#[derive(Debug)]
pub struct PieceToWrite {
    /// Global (Hugging Face) name; moments as `NAME.exp_avg`, `NAME.exp_avg_sq`.
    pub name: String,
    /// The whole tensor's shape.
    pub shape: Vec<i64>,
    /// Which of its elements.
    pub region: Region,
    /// The elements, `region.len()` of them.
    pub data: Tensor,
}

/// A writer that hashes and counts what passes through it.
struct Hashing<W> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The safetensors header of `pieces` stored flat in fp32, padded to 8 bytes as
/// safetensors pads it; each piece's data offset after the header.
fn header(pieces: &[PieceToWrite]) -> (Vec<u8>, Vec<u64>) {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0u64;
    let mut offsets = Vec::with_capacity(pieces.len());
    for p in pieces {
        let bytes = 4 * p.region.len() as u64;
        map.insert(
            p.name.clone(),
            serde_json::json!({"dtype": "F32", "shape": [p.region.len()], "data_offsets": [at, at + bytes]}),
        );
        offsets.push(at);
        at += bytes;
    }
    let mut text = serde_json::to_vec(&map).expect("header serialises");
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let start = 8 + text.len() as u64;
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    (out, offsets.into_iter().map(|o| start + o).collect())
}

/// Writes `pieces` (names unique) into `dir/file` as one safetensors file, a chunk of
/// [`WRITE_CHUNK_ELEMENTS`] at a time, and records them in `fragment`.
pub fn write_pieces(
    dir: &Path,
    file: &str,
    pieces: &[PieceToWrite],
    fragment: &mut Fragment,
) -> Result<(), TrainError> {
    let path = dir.join(file);
    if let Some(p) = pieces
        .iter()
        .find(|p| p.data.numel() as i64 != p.region.len())
    {
        let length = CheckpointProblem::PieceLength {
            name: p.name.clone(),
            found: p.data.numel() as i64,
            expected: p.region.len(),
        };
        return Err(problem_at(&path, length));
    }
    let (head, offsets) = header(pieces);
    let handle = std::fs::File::create(&path).map_err(io_err(&path))?;
    let mut out = Hashing {
        inner: std::io::BufWriter::with_capacity(1 << 20, handle),
        hasher: Sha256::new(),
        bytes: 0,
    };
    out.write_all(&head).map_err(io_err(&path))?;
    let mut buffer = Vec::new();
    for piece in pieces {
        write_elements(&mut out, &piece.data, &mut buffer).map_err(io_err(&path))?;
    }
    let inner = out
        .inner
        .into_inner()
        .map_err(|e| problem_at(&path, e.into_error()))?;
    {
        // A dead or frozen filesystem blocks here; the watchdog names the file.
        let file = path.display().to_string();
        let _flushing = waiting_on("fsync", &file, std::time::Duration::ZERO);
        inner.sync_data().map_err(io_err(&path))?;
    }
    let entry = ManifestEntry {
        bytes: out.bytes,
        sha256: hex(out.hasher),
    };
    fragment.files.insert(file.to_owned(), entry);
    for (piece, offset) in pieces.iter().zip(offsets) {
        let stored = fragment.tensors.entry(piece.name.clone()).or_default();
        stored.shape = piece.shape.clone();
        stored.pieces.push(StoredPiece {
            file: file.to_owned(),
            rank: fragment.rank,
            offset,
            dtype: "F32".into(),
            region: piece.region.clone(),
        });
    }
    Ok(())
}

/// `data`'s elements as little-endian fp32, moved to the host a chunk at a time through
/// `buffer`.
fn write_elements(
    out: &mut impl Write,
    data: &Tensor,
    buffer: &mut Vec<u8>,
) -> std::io::Result<()> {
    let flat = data.reshape([-1]);
    let numel = flat.numel() as i64;
    let mut start = 0;
    while start < numel {
        let n = WRITE_CHUNK_ELEMENTS.min(numel - start);
        let part = flat.narrow(0, start, n);
        let part = part
            .to_kind(Kind::Float)
            .to_device(Device::Cpu)
            .contiguous();
        buffer.resize(4 * n as usize, 0);
        part.copy_data_u8(buffer, n as usize);
        out.write_all(buffer)?;
        start += n;
    }
    Ok(())
}

/// Writes `fragment` as `dir`'s fragment of its rank, under a temporary name then
/// renamed: its presence says the rank's files are complete.
pub fn write_fragment(dir: &Path, fragment: &Fragment) -> Result<PathBuf, TrainError> {
    let path = dir.join(fragment_file(fragment.rank));
    let text = serde_json::to_string(fragment).expect("fragment serialises");
    write_atomically(&path, &text)?;
    Ok(path)
}
