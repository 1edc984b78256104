//! Rust element types of indexed datasets.

use crate::DType;

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that is one of the eight Megatron dtypes, so a `.bin` region can be
/// viewed as `&[Self]` without copying.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtype this type stores.
    const DTYPE: DType;
    /// Little-endian bytes of `value` converted to this type, or `None` if it does not fit.
    fn encode(value: i64, out: &mut Vec<u8>) -> Option<()>;
    /// This element as an i64 (floats are truncated towards zero).
    fn to_i64(self) -> i64;
}

macro_rules! integer_element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn encode(value: i64, out: &mut Vec<u8>) -> Option<()> {
                out.extend_from_slice(&<$t>::try_from(value).ok()?.to_le_bytes());
                Some(())
            }
            fn to_i64(self) -> i64 {
                self as i64
            }
        }
    )*};
}
integer_element!(u8 => U8, i8 => I8, i16 => I16, i32 => I32, i64 => I64, u16 => U16);

macro_rules! float_element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn encode(value: i64, out: &mut Vec<u8>) -> Option<()> {
                out.extend_from_slice(&(value as $t).to_le_bytes());
                Some(())
            }
            fn to_i64(self) -> i64 {
                self as i64
            }
        }
    )*};
}
float_element!(f32 => F32, f64 => F64);

/// Views little-endian bytes as elements, without copying.
///
/// Returns `None` if the bytes are misaligned for `T` or not a whole number of
/// elements. Only little-endian targets read Megatron files natively.
pub(crate) fn cast_slice<T: Element>(bytes: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    if bytes.is_empty() {
        // An empty slice's pointer may be dangling and unaligned; no element is read.
        return Some(&[]);
    }
    if !cfg!(target_endian = "little")
        || bytes.len() % size != 0
        || (bytes.as_ptr() as usize) % std::mem::align_of::<T>() != 0
    {
        return None;
    }
    // SAFETY: aligned, in bounds, and every bit pattern is a valid `T` (plain numbers).
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) })
}

/// Runs `$body` with `$T` bound to the element type of `$dtype`.
macro_rules! with_element {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            crate::DType::U8 => {
                type $T = u8;
                $body
            }
            crate::DType::I8 => {
                type $T = i8;
                $body
            }
            crate::DType::I16 => {
                type $T = i16;
                $body
            }
            crate::DType::I32 => {
                type $T = i32;
                $body
            }
            crate::DType::I64 => {
                type $T = i64;
                $body
            }
            crate::DType::F64 => {
                type $T = f64;
                $body
            }
            crate::DType::F32 => {
                type $T = f32;
                $body
            }
            crate::DType::U16 => {
                type $T = u16;
                $body
            }
        }
    };
}

pub(crate) use with_element;
