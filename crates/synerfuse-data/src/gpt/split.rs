//! Megatron's `--split` strings (`"969, 30, 1"`) and the sequence ranges they select.

use std::ops::Range;

/// Per split (train, valid, test), the fraction `[lo, hi)` of the sequences, or `None`
/// when the split is empty. The first `lo` is Megatron's int `0`, which matters when the
/// matrix is hashed into cache names.
pub type SplitMatrix = [Option<(f64, f64)>; 3];

/// A `--split` string Megatron would mis-handle or reject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("split {split:?}: {problem}")]
pub struct SplitError {
    /// The string as given.
    pub split: String,
    /// What is wrong with it.
    pub problem: String,
}

/// Parses a split string as Megatron does: the numbers in it (`[.0-9]+`), padded with
/// zeros to three, normalized, then cumulated.
pub fn parse_split(split: &str) -> Result<SplitMatrix, SplitError> {
    let error = |problem: String| SplitError {
        split: split.to_owned(),
        problem,
    };
    let mut weights = Vec::new();
    let mut rest = split;
    while let Some(start) = rest.find(|c: char| c == '.' || c.is_ascii_digit()) {
        let run = &rest[start..];
        let len = run
            .find(|c: char| c != '.' && !c.is_ascii_digit())
            .unwrap_or(run.len());
        let number = &run[..len];
        weights.push(
            number
                .parse::<f64>()
                .map_err(|_| error(format!("{number:?} is not a number")))?,
        );
        rest = &run[len..];
    }
    if weights.len() > 3 {
        return Err(error(format!(
            "{} weights; at most 3 (train, valid, test)",
            weights.len()
        )));
    }
    weights.resize(3, 0.0);
    let total: f64 = weights.iter().sum();
    if total <= 0.0 {
        return Err(error("the weights sum to 0".to_owned()));
    }
    let mut bounds = [0.0f64; 4];
    for (i, w) in weights.iter().enumerate() {
        bounds[i + 1] = bounds[i] + w / total;
    }
    Ok(std::array::from_fn(|i| {
        (bounds[i + 1] > bounds[i]).then_some((bounds[i], bounds[i + 1]))
    }))
}

/// The sequence ranges of each split for a dataset of `sequences` sequences: bounds
/// rounded half to even, as Python's `round`.
pub fn split_ranges(matrix: &SplitMatrix, sequences: usize) -> [Option<Range<usize>>; 3] {
    let n = sequences as f64;
    matrix.map(|bounds| {
        bounds.map(|(lo, hi)| {
            (lo * n).round_ties_even() as usize..(hi * n).round_ties_even() as usize
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_examples() {
        let m = parse_split("969, 30, 1").unwrap();
        assert_eq!(
            m,
            [Some((0.0, 0.969)), Some((0.969, 0.999)), Some((0.999, 1.0))]
        );
        assert_eq!(
            split_ranges(&m, 1000),
            [Some(0..969), Some(969..999), Some(999..1000)]
        );
        let thirds = parse_split("1,1,1").unwrap();
        assert_eq!(
            split_ranges(&thirds, 1000),
            [Some(0..333), Some(333..667), Some(667..1000)]
        );
        let m = parse_split("90,5,5").unwrap();
        assert_eq!(m[1], Some((0.9, 0.9500000000000001)));
        assert_eq!(m[2], Some((0.9500000000000001, 1.0)));
        assert_eq!(
            parse_split("100,0,0").unwrap(),
            [Some((0.0, 1.0)), None, None]
        );
        assert_eq!(parse_split("1").unwrap(), [Some((0.0, 1.0)), None, None]);
    }

    #[test]
    fn rounds_half_to_even() {
        // 0.5 of 5 sequences is 2.5, which Python rounds to 2.
        let m = parse_split("1,1").unwrap();
        assert_eq!(split_ranges(&m, 5), [Some(0..2), Some(2..5), None]);
    }

    #[test]
    fn refuses_what_megatron_mishandles() {
        for bad in ["", "0,0,0", "1.2.3", "1,2,3,4", "."] {
            assert!(parse_split(bad).is_err(), "{bad:?}");
        }
    }
}
