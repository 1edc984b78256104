//! Memory-mapped reader of `PREFIX.idx` + `PREFIX.bin`.

use super::element::{cast_slice, Element};
use super::{bin_path, idx_path, HEADER_LEN, MAGIC, VERSION};
use crate::{DType, DataError};
use memmap2::Mmap;
use std::fs::File;
use std::marker::PhantomData;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// A little-endian scalar stored unaligned in an `.idx` file.
pub trait LeScalar: Copy + 'static {
    /// Bytes per value.
    const SIZE: usize;
    /// Decodes one value from exactly `SIZE` bytes.
    fn read(bytes: &[u8]) -> Self;
}

impl LeScalar for i32 {
    const SIZE: usize = 4;
    fn read(bytes: &[u8]) -> Self {
        i32::from_le_bytes(bytes.try_into().expect("4 bytes"))
    }
}

impl LeScalar for i64 {
    const SIZE: usize = 8;
    fn read(bytes: &[u8]) -> Self {
        i64::from_le_bytes(bytes.try_into().expect("8 bytes"))
    }
}

/// A zero-copy view of one `.idx` array. The arrays follow a 34-byte header, so they are
/// not aligned for direct `&[i32]`/`&[i64]` views; values are decoded on access.
#[derive(Clone, Copy)]
pub struct LeArray<'a, T> {
    bytes: &'a [u8],
    _type: PhantomData<T>,
}

impl<'a, T: LeScalar> LeArray<'a, T> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            _type: PhantomData,
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.bytes.len() / T::SIZE
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Value `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<T> {
        let start = i.checked_mul(T::SIZE)?;
        self.bytes.get(start..start + T::SIZE).map(T::read)
    }

    /// All values in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = T> + 'a {
        self.bytes.chunks_exact(T::SIZE).map(T::read)
    }

    /// The values as a vector.
    pub fn to_vec(&self) -> Vec<T> {
        self.iter().collect()
    }
}

impl<T: LeScalar + std::fmt::Debug> std::fmt::Debug for LeArray<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A Megatron indexed dataset, opened read-only and memory-mapped.
///
/// Opening validates everything that later reads depend on (header, array sizes, every
/// pointer and length against the `.bin`, document boundaries), so no access can read
/// outside the files, whatever their bytes.
pub struct IndexedDataset {
    prefix: PathBuf,
    idx: Mmap,
    bin: Option<Mmap>,
    dtype: DType,
    sequence_count: usize,
    document_count: usize,
    multimodal: bool,
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("dtype", &self.dtype)
            .field("sequences", &self.sequence_count)
            .field("documents", &self.num_documents())
            .field("multimodal", &self.multimodal)
            .finish()
    }
}

fn map(path: &Path) -> Result<Option<Mmap>, DataError> {
    let file = File::open(path).map_err(DataError::io(path))?;
    let len = file.metadata().map_err(DataError::io(path))?.len();
    if len == 0 {
        // An empty file cannot be mapped; it holds no tokens.
        return Ok(None);
    }
    // SAFETY: the mapping is read-only; datasets are not modified while they are read.
    let map = unsafe { Mmap::map(&file) }.map_err(DataError::io(path))?;
    Ok(Some(map))
}

impl IndexedDataset {
    /// Opens `PREFIX.idx` and `PREFIX.bin` (text-only: any modes array is ignored).
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self, DataError> {
        Self::open_with(prefix, false)
    }

    /// Opens a dataset whose `.idx` ends with a modes array (`multimodal=True` in
    /// Megatron; the header does not record it).
    pub fn open_multimodal(prefix: impl AsRef<Path>) -> Result<Self, DataError> {
        Self::open_with(prefix, true)
    }

    fn open_with(prefix: impl AsRef<Path>, multimodal: bool) -> Result<Self, DataError> {
        let prefix = prefix.as_ref().to_path_buf();
        let idx_path = idx_path(&prefix);
        let idx = map(&idx_path)?
            .ok_or_else(|| DataError::corrupt(&idx_path, "header", "the file is empty"))?;
        let (dtype, sequence_count, document_count) = parse_header(&idx_path, &idx, multimodal)?;
        let bin = map(&bin_path(&prefix))?;
        let dataset = Self {
            prefix,
            idx,
            bin,
            dtype,
            sequence_count,
            document_count,
            multimodal,
        };
        dataset.validate()?;
        Ok(dataset)
    }

    fn validate(&self) -> Result<(), DataError> {
        let idx_path = idx_path(&self.prefix);
        let bin_len = self.bin_bytes().len() as u128;
        let item = self.dtype.size() as u128;
        let pointers = self.sequence_pointers();
        for (i, length) in self.sequence_lengths().iter().enumerate() {
            let pointer = pointers.get(i).expect("validated size");
            if length < 0 {
                return Err(DataError::corrupt(
                    &idx_path,
                    format!("sequence_lengths[{i}]"),
                    format!("is negative ({length})"),
                ));
            }
            if pointer < 0 || pointer as u128 % item != 0 {
                return Err(DataError::corrupt(
                    &idx_path,
                    format!("sequence_pointers[{i}]"),
                    format!(
                        "{pointer} is not a non-negative multiple of the {}-byte {:?} element",
                        item, self.dtype
                    ),
                ));
            }
            let end = pointer as u128 + length as u128 * item;
            if end > bin_len {
                return Err(DataError::corrupt(
                    bin_path(&self.prefix),
                    format!("sequence {i}"),
                    format!("bytes {pointer}..{end} lie past the end of the {bin_len}-byte .bin"),
                ));
            }
        }
        let documents = self.document_indices();
        let mut previous = 0i64;
        for (k, boundary) in documents.iter().enumerate() {
            let bad = if k == 0 && boundary != 0 {
                Some(format!("is {boundary}; the first boundary must be 0"))
            } else if boundary < previous {
                Some(format!(
                    "is {boundary}, below the previous boundary {previous}"
                ))
            } else if boundary as u128 > self.sequence_count as u128 {
                Some(format!(
                    "is {boundary}, past the {} sequences",
                    self.sequence_count
                ))
            } else {
                None
            };
            if let Some(problem) = bad {
                return Err(DataError::corrupt(
                    &idx_path,
                    format!("document_indices[{k}]"),
                    problem,
                ));
            }
            previous = boundary;
        }
        if previous as u128 != self.sequence_count as u128 {
            return Err(DataError::corrupt(
                &idx_path,
                format!("document_indices[{}]", self.document_count - 1),
                format!(
                    "is {previous}; the last boundary must equal the sequence count {}",
                    self.sequence_count
                ),
            ));
        }
        Ok(())
    }

    /// The prefix the dataset was opened with.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The element type of the `.bin`.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of sequences (Megatron's `len(dataset)`).
    pub fn len(&self) -> usize {
        self.sequence_count
    }

    /// Whether there is no sequence.
    pub fn is_empty(&self) -> bool {
        self.sequence_count == 0
    }

    /// Number of documents (one less than the number of document boundaries).
    pub fn num_documents(&self) -> usize {
        self.document_count - 1
    }

    /// Tokens per sequence.
    pub fn sequence_lengths(&self) -> LeArray<'_, i32> {
        let start = HEADER_LEN;
        LeArray::new(&self.idx[start..start + 4 * self.sequence_count])
    }

    /// Byte offset of each sequence in the `.bin`.
    pub fn sequence_pointers(&self) -> LeArray<'_, i64> {
        let start = HEADER_LEN + 4 * self.sequence_count;
        LeArray::new(&self.idx[start..start + 8 * self.sequence_count])
    }

    /// Document boundaries: document `k` is sequences `[d[k], d[k+1])`.
    pub fn document_indices(&self) -> LeArray<'_, i64> {
        let start = HEADER_LEN + 12 * self.sequence_count;
        LeArray::new(&self.idx[start..start + 8 * self.document_count])
    }

    /// The mode of each sequence (0 text, 1 image in Megatron's multimodal tool), when
    /// opened with [`Self::open_multimodal`].
    pub fn sequence_modes(&self) -> Option<&[i8]> {
        self.multimodal.then(|| {
            let start = HEADER_LEN + 12 * self.sequence_count + 8 * self.document_count;
            let bytes = &self.idx[start..start + self.sequence_count];
            // SAFETY: i8 and u8 have the same size and alignment.
            unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const i8, bytes.len()) }
        })
    }

    /// The sequences of document `k`.
    pub fn document(&self, k: usize) -> Result<Range<usize>, DataError> {
        if k >= self.num_documents() {
            return Err(self.out_of_range(
                "document",
                format!("{k} >= {} documents", self.num_documents()),
            ));
        }
        let d = self.document_indices();
        let (start, end) = (d.get(k).expect("checked"), d.get(k + 1).expect("checked"));
        Ok(start as usize..end as usize)
    }

    /// The whole `.bin`.
    pub fn bin_bytes(&self) -> &[u8] {
        self.bin.as_deref().unwrap_or(&[])
    }

    /// The raw bytes of sequence `i`.
    pub fn sequence_bytes(&self, i: usize) -> Result<&[u8], DataError> {
        self.get_bytes(i, 0, None)
    }

    fn get_bytes(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<&[u8], DataError> {
        let len = self.sequence_lengths().get(i).ok_or_else(|| {
            self.out_of_range(
                "sequence",
                format!("{i} >= {} sequences", self.sequence_count),
            )
        })? as usize;
        let length = length.unwrap_or(len.saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > len) {
            return Err(self.out_of_range(
                "tokens",
                format!("offset {offset} + length {length} past the {len} tokens of sequence {i}"),
            ));
        }
        let item = self.dtype.size();
        let start = self.sequence_pointers().get(i).expect("validated") as usize + offset * item;
        Ok(&self.bin_bytes()[start..start + length * item])
    }

    /// The tokens of sequence `i`, without copying; `T` must be the dataset's dtype.
    pub fn sequence<T: Element>(&self, i: usize) -> Result<&[T], DataError> {
        self.get(i, 0, None)
    }

    /// `length` tokens (default: to the end) of sequence `i` from token `offset`, as
    /// Megatron's `IndexedDataset.get`, without copying.
    pub fn get<T: Element>(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<&[T], DataError> {
        if T::DTYPE != self.dtype {
            return Err(DataError::DTypeMismatch {
                path: self.prefix.clone(),
                expected: T::DTYPE,
                actual: self.dtype,
            });
        }
        let bytes = self.get_bytes(i, offset, length)?;
        cast_slice(bytes).ok_or_else(|| {
            DataError::corrupt(
                bin_path(&self.prefix),
                format!("sequence {i}"),
                "tokens are not aligned for their dtype",
            )
        })
    }

    /// Like [`Self::get`] for any dtype, widened to `i64` (the type Megatron's GPT
    /// dataset returns).
    pub fn get_i64(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<Vec<i64>, DataError> {
        super::element::with_element!(self.dtype, T => {
            Ok(self.get::<T>(i, offset, length)?.iter().map(|&t| t.to_i64()).collect())
        })
    }

    fn out_of_range(&self, what: &'static str, detail: String) -> DataError {
        DataError::OutOfRange {
            path: self.prefix.clone(),
            what,
            detail,
        }
    }
}

fn parse_header(
    path: &Path,
    idx: &[u8],
    multimodal: bool,
) -> Result<(DType, usize, usize), DataError> {
    if idx.len() < HEADER_LEN {
        return Err(DataError::corrupt(
            path,
            "header",
            format!(
                "the file has {} bytes, fewer than the {HEADER_LEN}-byte header",
                idx.len()
            ),
        ));
    }
    if &idx[..9] != MAGIC {
        return Err(DataError::corrupt(
            path,
            "magic",
            format!(
                "{:?} is not MMIDIDX\\0\\0: not a Megatron .idx file",
                &idx[..9]
            ),
        ));
    }
    let u64_at = |at: usize| u64::from_le_bytes(idx[at..at + 8].try_into().expect("8 bytes"));
    let version = u64_at(9);
    if version != VERSION {
        return Err(DataError::corrupt(
            path,
            "version",
            format!("is {version}, only version {VERSION} exists"),
        ));
    }
    let dtype =
        DType::from_code(idx[17]).map_err(|e| DataError::corrupt(path, "dtype", e.to_string()))?;
    let (sequences, documents) = (u64_at(18), u64_at(26));
    if documents == 0 {
        return Err(DataError::corrupt(
            path,
            "document_count",
            "is 0; an index holds at least the leading 0 boundary",
        ));
    }
    let per_sequence = if multimodal { 13 } else { 12 };
    let needed = HEADER_LEN as u128 + per_sequence * sequences as u128 + 8 * documents as u128;
    if needed > idx.len() as u128 {
        return Err(DataError::corrupt(
            path,
            "sequence_count/document_count",
            format!(
                "{sequences} sequences and {documents} document boundaries{} need {needed} bytes, the file has {}",
                if multimodal { " with modes" } else { "" },
                idx.len()
            ),
        ));
    }
    // `needed` fits the file, so both counts fit usize.
    Ok((dtype, sequences as usize, documents as usize))
}
