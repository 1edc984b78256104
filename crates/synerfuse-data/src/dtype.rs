//! Element types of an indexed dataset and their `.idx` header codes.

/// The dtype byte of an `.idx` header is none of the eight Megatron codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("dtype code {0} is not a Megatron dtype (valid codes are 1..=8)")]
pub struct DTypeError(pub u8);

/// An element type of a Megatron indexed dataset, named as in numpy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// numpy uint8, code 1.
    U8,
    /// numpy int8, code 2.
    I8,
    /// numpy int16, code 3.
    I16,
    /// numpy int32, code 4: token ids of vocabularies of 65500 or more.
    I32,
    /// numpy int64, code 5.
    I64,
    /// numpy float64, code 6.
    F64,
    /// numpy float32, code 7.
    F32,
    /// numpy uint16, code 8: token ids of vocabularies under 65500.
    U16,
}

impl DType {
    /// All dtypes, in code order.
    pub const ALL: [DType; 8] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F64,
        DType::F32,
        DType::U16,
    ];

    /// The code stored in the `.idx` header (Megatron's `DType` enum).
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    /// The dtype for a header code.
    pub fn from_code(code: u8) -> Result<DType, DTypeError> {
        DType::ALL
            .into_iter()
            .find(|d| d.code() == code)
            .ok_or(DTypeError(code))
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Megatron's choice for token ids: uint16 below 65500 tokens, else int32.
    ///
    /// The threshold is 65500, not 65536, and applies to the *un-padded* vocabulary
    /// size; matching it is what makes our `.bin` files byte-identical.
    pub fn optimal_for_vocab(vocab_size: usize) -> DType {
        if vocab_size < 65500 {
            DType::U16
        } else {
            DType::I32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_megatron() {
        let codes: Vec<u8> = DType::ALL.iter().map(|d| d.code()).collect();
        assert_eq!(codes, (1..=8).collect::<Vec<u8>>());
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Ok(d));
        }
        assert_eq!(DType::from_code(0), Err(DTypeError(0)));
        assert_eq!(DType::from_code(9), Err(DTypeError(9)));
    }

    #[test]
    fn vocab_threshold_is_65500() {
        assert_eq!(DType::optimal_for_vocab(65499), DType::U16);
        assert_eq!(DType::optimal_for_vocab(65500), DType::I32);
        assert_eq!(DType::U16.size(), 2);
        assert_eq!(DType::I32.size(), 4);
    }
}
