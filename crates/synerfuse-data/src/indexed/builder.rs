//! Streaming writer of `PREFIX.bin` + `PREFIX.idx`.

use super::element::Element;
use super::{bin_path, idx_path, IndexedDataset, MAGIC, VERSION};
use crate::{DType, DataError};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// A file written under a temporary name in the target's directory.
struct TempFile {
    path: PathBuf,
    writer: BufWriter<File>,
}

impl TempFile {
    fn create(path: PathBuf) -> Result<Self, DataError> {
        let file = File::create(&path).map_err(DataError::io(&path))?;
        Ok(Self {
            writer: BufWriter::with_capacity(1 << 20, file),
            path,
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), DataError> {
        self.writer
            .write_all(bytes)
            .map_err(DataError::io(&self.path))
    }

    /// Flushes and reopens the file for reading.
    fn reader(&mut self) -> Result<BufReader<File>, DataError> {
        self.writer.flush().map_err(DataError::io(&self.path))?;
        let file = File::open(&self.path).map_err(DataError::io(&self.path))?;
        Ok(BufReader::with_capacity(1 << 20, file))
    }
}

/// Writes a Megatron indexed dataset, one sequence or document at a time.
///
/// Memory does not grow with the corpus: tokens go straight to a temporary `.bin`, and
/// the index arrays to temporary side files that [`Self::finalize`] streams into the
/// `.idx`. Nothing carries the final names until `finalize` renames the pair, `.idx`
/// last, so an interrupted run never leaves a pair that opens as complete; dropping an
/// unfinished builder removes its temporary files.
pub struct IndexedDatasetBuilder {
    prefix: PathBuf,
    dtype: DType,
    bin: TempFile,
    lengths: TempFile,
    boundaries: TempFile,
    modes: Option<TempFile>,
    sequence_count: u64,
    document_count: u64,
    scratch: Vec<u8>,
    finished: bool,
}

fn temp_name(path: &Path, part: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{part}.tmp-{}", std::process::id()));
    PathBuf::from(name)
}

impl IndexedDatasetBuilder {
    /// Starts `PREFIX.bin`/`PREFIX.idx` holding elements of `dtype`.
    pub fn create(prefix: impl AsRef<Path>, dtype: DType) -> Result<Self, DataError> {
        Self::create_with(prefix.as_ref(), dtype, false)
    }

    /// Like [`Self::create`], with a mode per sequence (Megatron's `multimodal=True`).
    pub fn create_multimodal(prefix: impl AsRef<Path>, dtype: DType) -> Result<Self, DataError> {
        Self::create_with(prefix.as_ref(), dtype, true)
    }

    fn create_with(prefix: &Path, dtype: DType, multimodal: bool) -> Result<Self, DataError> {
        // As Megatron, the output directory must exist; say so of the prefix given rather
        // than of a temporary file name.
        if let Some(parent) = prefix.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.is_dir() {
                let missing = std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("the output directory {} does not exist", parent.display()),
                );
                return Err(DataError::io(prefix)(missing));
            }
        }
        let idx = idx_path(prefix);
        let mut builder = Self {
            prefix: prefix.to_path_buf(),
            dtype,
            bin: TempFile::create(temp_name(&bin_path(prefix), "partial"))?,
            lengths: TempFile::create(temp_name(&idx, "lengths"))?,
            boundaries: TempFile::create(temp_name(&idx, "documents"))?,
            modes: None,
            sequence_count: 0,
            document_count: 0,
            scratch: Vec::new(),
            finished: false,
        };
        if multimodal {
            builder.modes = Some(TempFile::create(temp_name(&idx, "modes"))?);
        }
        Ok(builder)
    }

    /// The element type being written.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sequences added so far.
    pub fn sequence_count(&self) -> u64 {
        self.sequence_count
    }

    /// Documents closed so far.
    pub fn document_count(&self) -> u64 {
        self.document_count
    }

    /// Adds one sequence to the current document (mode 0 if multimodal).
    pub fn add_item<T: Copy + Into<i64>>(&mut self, tokens: &[T]) -> Result<(), DataError> {
        self.push_sequence(tokens, 0)
    }

    /// Adds one sequence with its mode; only for multimodal datasets.
    pub fn add_item_with_mode<T: Copy + Into<i64>>(
        &mut self,
        tokens: &[T],
        mode: i8,
    ) -> Result<(), DataError> {
        if self.modes.is_none() {
            return Err(
                self.invalid("a sequence mode was given but the dataset was created without modes")
            );
        }
        self.push_sequence(tokens, mode)
    }

    /// Closes the current document (possibly empty).
    pub fn end_document(&mut self) -> Result<(), DataError> {
        let boundary = self.sequence_count as i64;
        self.boundaries.write(&boundary.to_le_bytes())?;
        self.document_count += 1;
        Ok(())
    }

    /// Adds a whole document: `tokens` cut into sequences of `lengths` (which must add
    /// up to `tokens.len()`; an empty `lengths` adds an empty document).
    pub fn add_document<T: Copy + Into<i64>>(
        &mut self,
        tokens: &[T],
        lengths: &[usize],
    ) -> Result<(), DataError> {
        self.add_document_impl(tokens, lengths, None)
    }

    /// [`Self::add_document`] with a mode per sequence; only for multimodal datasets.
    pub fn add_document_with_modes<T: Copy + Into<i64>>(
        &mut self,
        tokens: &[T],
        lengths: &[usize],
        modes: &[i8],
    ) -> Result<(), DataError> {
        if self.modes.is_none() {
            return Err(
                self.invalid("sequence modes were given but the dataset was created without modes")
            );
        }
        if modes.len() != lengths.len() {
            return Err(self.invalid(format!(
                "{} modes for {} sequences",
                modes.len(),
                lengths.len()
            )));
        }
        self.add_document_impl(tokens, lengths, Some(modes))
    }

    fn add_document_impl<T: Copy + Into<i64>>(
        &mut self,
        tokens: &[T],
        lengths: &[usize],
        modes: Option<&[i8]>,
    ) -> Result<(), DataError> {
        let total: usize = lengths.iter().sum();
        if total != tokens.len() {
            return Err(self.invalid(format!(
                "sequence lengths add up to {total} but the document has {} tokens",
                tokens.len()
            )));
        }
        let mut rest = tokens;
        for (i, &length) in lengths.iter().enumerate() {
            let (sequence, tail) = rest.split_at(length);
            self.push_sequence(sequence, modes.map_or(0, |m| m[i]))?;
            rest = tail;
        }
        self.end_document()
    }

    fn push_sequence<T: Copy + Into<i64>>(
        &mut self,
        tokens: &[T],
        mode: i8,
    ) -> Result<(), DataError> {
        let length = i32::try_from(tokens.len()).map_err(|_| {
            self.invalid(format!(
                "a sequence of {} tokens exceeds the format's i32 length",
                tokens.len()
            ))
        })?;
        self.scratch.clear();
        let dtype = self.dtype;
        super::element::with_element!(dtype, E => {
            for &token in tokens {
                let value: i64 = token.into();
                if E::encode(value, &mut self.scratch).is_none() {
                    return Err(DataError::TokenOutOfRange { path: self.prefix.clone(), value, dtype });
                }
            }
        });
        self.bin.write(&self.scratch)?;
        self.lengths.write(&length.to_le_bytes())?;
        if let Some(modes) = &mut self.modes {
            modes.write(&mode.to_le_bytes())?;
        }
        self.sequence_count += 1;
        Ok(())
    }

    /// Appends every document of the dataset at `prefix` (same dtype; modes too when
    /// this builder has them), copying its `.bin` byte for byte.
    pub fn add_index(&mut self, prefix: impl AsRef<Path>) -> Result<(), DataError> {
        let other = if self.modes.is_some() {
            IndexedDataset::open_multimodal(prefix.as_ref())?
        } else {
            IndexedDataset::open(prefix.as_ref())?
        };
        if other.dtype() != self.dtype {
            return Err(DataError::DTypeMismatch {
                path: other.prefix().to_path_buf(),
                expected: self.dtype,
                actual: other.dtype(),
            });
        }
        let offset = self.sequence_count as i64;
        for length in other.sequence_lengths().iter() {
            self.lengths.write(&length.to_le_bytes())?;
        }
        for boundary in other.document_indices().iter().skip(1) {
            self.boundaries.write(&(offset + boundary).to_le_bytes())?;
        }
        if let (Some(modes), Some(other_modes)) = (&mut self.modes, other.sequence_modes()) {
            let bytes: Vec<u8> = other_modes.iter().map(|&m| m as u8).collect();
            modes.write(&bytes)?;
        }
        // Per sequence rather than the whole file: identical for the dense files every
        // builder writes, and still right for a .bin with gaps or trailing bytes.
        for i in 0..other.len() {
            self.bin.write(other.sequence_bytes(i)?)?;
        }
        self.sequence_count += other.len() as u64;
        self.document_count += other.num_documents() as u64;
        Ok(())
    }

    /// Writes the `.idx` and moves both files to their final names.
    pub fn finalize(mut self) -> Result<(), DataError> {
        let idx = idx_path(&self.prefix);
        let bin = bin_path(&self.prefix);
        let mut out = TempFile::create(temp_name(&idx, "partial"))?;
        let mut header = Vec::with_capacity(super::HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.push(self.dtype.code());
        header.extend_from_slice(&self.sequence_count.to_le_bytes());
        header.extend_from_slice(&(self.document_count + 1).to_le_bytes());
        out.write(&header)?;
        copy_all(&mut self.lengths, &mut out)?;
        // Pointers are recomputed from the lengths, as Megatron's writer does.
        let item = self.dtype.size() as i64;
        let mut lengths = self.lengths.reader()?;
        let mut pointer = 0i64;
        let mut length = [0u8; 4];
        for _ in 0..self.sequence_count {
            lengths
                .read_exact(&mut length)
                .map_err(DataError::io(&self.lengths.path))?;
            out.write(&pointer.to_le_bytes())?;
            pointer += i32::from_le_bytes(length) as i64 * item;
        }
        out.write(&0i64.to_le_bytes())?;
        copy_all(&mut self.boundaries, &mut out)?;
        if let Some(modes) = &mut self.modes {
            copy_all(modes, &mut out)?;
        }
        out.writer.flush().map_err(DataError::io(&out.path))?;
        self.bin
            .writer
            .flush()
            .map_err(DataError::io(&self.bin.path))?;
        // An old .idx must not pair with the new .bin if we stop between the renames.
        match std::fs::remove_file(&idx) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(DataError::Io {
                    path: idx,
                    source: e,
                })
            }
            _ => {}
        }
        std::fs::rename(&self.bin.path, &bin).map_err(DataError::io(&bin))?;
        std::fs::rename(&out.path, &idx).map_err(DataError::io(&idx))?;
        self.finished = true;
        self.remove_temp_files();
        Ok(())
    }

    fn remove_temp_files(&self) {
        let mut paths = vec![
            self.lengths.path.clone(),
            self.boundaries.path.clone(),
            temp_name(&idx_path(&self.prefix), "partial"),
        ];
        paths.extend(self.modes.as_ref().map(|m| m.path.clone()));
        if !self.finished {
            paths.push(self.bin.path.clone());
        }
        for path in paths {
            let _ = std::fs::remove_file(path);
        }
    }

    fn invalid(&self, problem: impl Into<String>) -> DataError {
        DataError::InvalidUse {
            path: self.prefix.clone(),
            problem: problem.into(),
        }
    }
}

impl Drop for IndexedDatasetBuilder {
    fn drop(&mut self) {
        if !self.finished {
            self.remove_temp_files();
        }
    }
}

fn copy_all(from: &mut TempFile, to: &mut TempFile) -> Result<(), DataError> {
    let mut reader = from.reader()?;
    std::io::copy(&mut reader, &mut to.writer).map_err(DataError::io(&to.path))?;
    Ok(())
}
