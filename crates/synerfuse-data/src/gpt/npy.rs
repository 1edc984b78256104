//! Index arrays and numpy's `.npy` files, the format of Megatron's index caches.
//!
//! Written as `.npy` version 1.0 (what `numpy.save` writes), read from versions 1–3.
//! Loaded arrays stay memory-mapped, as Megatron's `numpy.load(mmap_mode='r')`: opening a
//! cache of hundreds of megabytes costs a header parse, not a copy.

use crate::DataError;
use memmap2::Mmap;
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

mod sealed {
    pub trait Sealed {}
}

/// An element type of a cache array: the numpy dtype it is stored as, and how many
/// columns one element spans (the sample index is `(M + 1, 2)` int64).
pub trait NpyElement: sealed::Sealed + Copy + Send + Sync + 'static {
    /// numpy `descr`, little-endian.
    const DESCR: &'static str;
    /// Columns of the 2-D array, or 1 for a 1-D array.
    const COLUMNS: usize;
}

macro_rules! npy_element {
    ($($t:ty => $descr:literal, $columns:literal);*) => {$(
        impl sealed::Sealed for $t {}
        impl NpyElement for $t {
            const DESCR: &'static str = $descr;
            const COLUMNS: usize = $columns;
        }
    )*};
}
npy_element!(i16 => "<i2", 1; i32 => "<i4", 1; u32 => "<u4", 1; i64 => "<i8", 1; [i64; 2] => "<i8", 2);

/// A read-only array, either built in memory or mapped from a `.npy` file.
#[derive(Clone)]
pub struct IndexArray<T: NpyElement> {
    storage: Storage<T>,
}

#[derive(Clone)]
enum Storage<T> {
    Owned(Arc<[T]>),
    Mapped {
        map: Arc<Mmap>,
        offset: usize,
        len: usize,
    },
}

impl<T: NpyElement> IndexArray<T> {
    /// Whether the array is mapped from a file rather than held in memory.
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }
}

impl<T: NpyElement> From<Vec<T>> for IndexArray<T> {
    fn from(values: Vec<T>) -> Self {
        IndexArray {
            storage: Storage::Owned(values.into()),
        }
    }
}

impl<T: NpyElement> Deref for IndexArray<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Owned(values) => values,
            Storage::Mapped { map, offset, len } => {
                // SAFETY: `read_npy` checked bounds and alignment, the map is read-only and
                // lives as long as `self`, and every bit pattern is a valid `T`.
                unsafe { std::slice::from_raw_parts(map.as_ptr().add(*offset) as *const T, *len) }
            }
        }
    }
}

impl<T: NpyElement + fmt::Debug> fmt::Debug for IndexArray<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: NpyElement + PartialEq> PartialEq for IndexArray<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: NpyElement + Eq> Eq for IndexArray<T> {}

impl<T: NpyElement + PartialEq, const N: usize> PartialEq<[T; N]> for IndexArray<T> {
    fn eq(&self, other: &[T; N]) -> bool {
        **self == other[..]
    }
}

impl<T: NpyElement + PartialEq> PartialEq<Vec<T>> for IndexArray<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        **self == other[..]
    }
}

/// The parsed header of a `.npy` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NpyHeader {
    pub descr: String,
    pub fortran_order: bool,
    pub shape: Vec<usize>,
    /// Where the data starts.
    pub data_offset: usize,
}

/// `.npy` v1.0 bytes up to the data: magic, version, header length, the header dict,
/// padded with spaces and a newline to a multiple of 64 bytes.
fn npy_preamble(descr: &str, shape: &[usize]) -> Vec<u8> {
    let shape = match shape {
        [n] => format!("({n},)"),
        dims => format!(
            "({})",
            dims.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = 10 + header.len() + 1;
    header.extend(std::iter::repeat_n(
        ' ',
        unpadded.next_multiple_of(64) - unpadded,
    ));
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

/// Little-endian bytes of `values`.
fn le_bytes<T: NpyElement>(values: &[T]) -> std::borrow::Cow<'_, [u8]> {
    let len = std::mem::size_of_val(values);
    if cfg!(target_endian = "little") {
        // SAFETY: plain integers without padding; any alignment is fine for u8.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(values.as_ptr() as *const u8, len)
        })
    } else {
        let width = std::mem::size_of::<T>() / T::COLUMNS;
        // SAFETY: as above; bytes are swapped per scalar below.
        let native = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, len) };
        std::borrow::Cow::Owned(
            native
                .chunks_exact(width)
                .flat_map(|scalar| scalar.iter().rev().copied())
                .collect(),
        )
    }
}

/// Writes `values` as a `.npy` file at `path` (which must not be visible to readers
/// yet: callers write to a temporary name and rename).
pub(crate) fn write_npy<T: NpyElement>(path: &Path, values: &[T]) -> Result<(), DataError> {
    let shape: Vec<usize> = if T::COLUMNS == 1 {
        vec![values.len()]
    } else {
        vec![values.len(), T::COLUMNS]
    };
    let io = DataError::io(path);
    let mut file = File::create(path).map_err(DataError::io(path))?;
    file.write_all(&npy_preamble(T::DESCR, &shape))
        .and_then(|_| file.write_all(&le_bytes(values)))
        .and_then(|_| file.sync_all())
        .map_err(io)
}

/// Parses the header of a `.npy` file.
pub(crate) fn parse_npy_header(path: &Path, bytes: &[u8]) -> Result<NpyHeader, DataError> {
    let corrupt = |field: &str, problem: String| DataError::corrupt(path, field, problem);
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(corrupt("magic", "not a .npy file".into()));
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(corrupt("version", format!("unsupported .npy version {v}"))),
    };
    let header = bytes
        .get(start..start + header_len)
        .ok_or_else(|| corrupt("header", "file ends inside the header".into()))?;
    let header =
        std::str::from_utf8(header).map_err(|_| corrupt("header", "header is not text".into()))?;
    let value_after = |key: &str| -> Result<&str, DataError> {
        let at = header
            .find(&format!("'{key}':"))
            .ok_or_else(|| corrupt("header", format!("no '{key}' in {header:?}")))?;
        Ok(header[at + key.len() + 3..].trim_start())
    };
    let descr = value_after("descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split_once('\''))
        .map(|(d, _)| d.to_owned())
        .ok_or_else(|| corrupt("descr", format!("cannot read {header:?}")))?;
    let fortran_order = value_after("fortran_order")?.starts_with("True");
    let shape = value_after("shape")?;
    let shape = shape
        .strip_prefix('(')
        .and_then(|s| s.split_once(')'))
        .map(|(s, _)| s)
        .ok_or_else(|| corrupt("shape", format!("cannot read {header:?}")))?;
    let shape = shape
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.trim_end_matches('L').parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| corrupt("shape", format!("cannot read {header:?}")))?;
    Ok(NpyHeader {
        descr,
        fortran_order,
        shape,
        data_offset: start + header_len,
    })
}

/// Opens a `.npy` file as an array of `T`, memory-mapped. The dtype (`descr`) and the
/// number of columns must match `T`; anything else is a named error, never a wrong read.
pub(crate) fn read_npy<T: NpyElement>(path: &Path) -> Result<IndexArray<T>, DataError> {
    let map = open_map(path)?;
    let header = parse_npy_header(path, &map)?;
    array_from_map(path, map, &header)
}

pub(crate) fn open_map(path: &Path) -> Result<Arc<Mmap>, DataError> {
    let file = File::open(path).map_err(DataError::io(path))?;
    // SAFETY: the cache file is read-only here; it is replaced by rename, never rewritten
    // in place, so the mapping keeps seeing the bytes it was opened with.
    let map = unsafe { Mmap::map(&file) }.map_err(DataError::io(path))?;
    Ok(Arc::new(map))
}

pub(crate) fn array_from_map<T: NpyElement>(
    path: &Path,
    map: Arc<Mmap>,
    header: &NpyHeader,
) -> Result<IndexArray<T>, DataError> {
    let corrupt = |field: &str, problem: String| DataError::corrupt(path, field, problem);
    if header.descr != T::DESCR {
        return Err(corrupt(
            "descr",
            format!("dtype {} where {} was expected", header.descr, T::DESCR),
        ));
    }
    let expected_columns = if T::COLUMNS == 1 { 1 } else { 2 };
    let rows = match (header.shape.as_slice(), expected_columns) {
        ([n], 1) => *n,
        ([n, c], 2) if *c == T::COLUMNS => *n,
        (shape, _) => {
            return Err(corrupt(
                "shape",
                format!(
                    "shape {shape:?} where {} was expected",
                    if T::COLUMNS == 1 { "(n,)" } else { "(n, 2)" }
                ),
            ))
        }
    };
    if header.fortran_order && T::COLUMNS > 1 && rows > 1 {
        return Err(corrupt(
            "fortran_order",
            "column-major arrays are not supported".into(),
        ));
    }
    let bytes = rows
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| corrupt("shape", format!("{rows} rows overflow")))?;
    let available = map.len().saturating_sub(header.data_offset);
    if available != bytes {
        return Err(corrupt(
            "data",
            format!("{available} data bytes, the header says {bytes}"),
        ));
    }
    let aligned = (map.as_ptr() as usize + header.data_offset) % std::mem::align_of::<T>() == 0;
    if rows == 0 || !aligned || !cfg!(target_endian = "little") {
        // Rare (old numpy headers, big-endian hosts): decode a copy.
        let data = &map[header.data_offset..];
        let width = std::mem::size_of::<T>() / T::COLUMNS;
        let mut values = Vec::<T>::with_capacity(rows);
        // SAFETY: capacity reserved; bytes are copied element by element (unaligned
        // source), swapped on big-endian hosts; any bit pattern is a valid `T`.
        unsafe {
            let dst = values.as_mut_ptr() as *mut u8;
            for (i, scalar) in data.chunks_exact(width).enumerate() {
                for (k, byte) in scalar.iter().enumerate() {
                    let k = if cfg!(target_endian = "little") {
                        k
                    } else {
                        width - 1 - k
                    };
                    *dst.add(i * width + k) = *byte;
                }
            }
            values.set_len(rows);
        }
        return Ok(values.into());
    }
    Ok(IndexArray {
        storage: Storage::Mapped {
            map,
            offset: header.data_offset,
            len: rows,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_header_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.npy");
        write_npy(&path, &[1i32, -2, 3]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        // 58 header characters do not fit the first 64 bytes: padded to 128.
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), 118);
        let header = std::str::from_utf8(&bytes[10..128]).unwrap();
        assert!(header.starts_with("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }"));
        assert!(header.ends_with('\n'));
        assert_eq!(bytes.len(), 128 + 12);
        let back: IndexArray<i32> = read_npy(&path).unwrap();
        assert!(back.is_mapped());
        assert_eq!(back, [1, -2, 3]);

        let rows = dir.path().join("b.npy");
        write_npy(&rows, &[[0i64, 0], [5, 7]]).unwrap();
        let back: IndexArray<[i64; 2]> = read_npy(&rows).unwrap();
        assert_eq!(back, [[0, 0], [5, 7]]);
        let header = parse_npy_header(&rows, &std::fs::read(&rows).unwrap()).unwrap();
        assert_eq!(header.shape, [2, 2]);
    }

    #[test]
    fn wrong_dtype_shape_or_length_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.npy");
        write_npy(&path, &[1i64, 2]).unwrap();
        let err = read_npy::<i32>(&path).unwrap_err().to_string();
        assert!(err.contains("descr") && err.contains("<i8"), "{err}");
        assert!(read_npy::<[i64; 2]>(&path).is_err());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.pop();
        std::fs::write(&path, &bytes).unwrap();
        let err = read_npy::<i64>(&path).unwrap_err().to_string();
        assert!(err.contains("data bytes"), "{err}");
        std::fs::write(&path, b"junk").unwrap();
        assert!(read_npy::<i64>(&path).is_err());
    }
}
