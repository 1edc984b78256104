//! Value parsers of numeric flags: every number is checked when the command line is
//! parsed, so clap names the flag and nothing out of range reaches a library.
//!
//! (clap's value parsers return `Result<_, String>`; that is their interface, not a
//! library API.)

fn number<T: std::str::FromStr>(text: &str, what: &str) -> Result<T, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{text}` is not {what}"))
}

/// A count of at least 1 (ranks, threads, layers, sizes, repetitions).
pub fn positive_count(text: &str) -> Result<usize, String> {
    match number::<usize>(text, "a whole number of at least 1")? {
        0 => Err(format!("`{text}` is not a whole number of at least 1")),
        n => Ok(n),
    }
}

/// An iteration or sample count of at least 1.
pub fn positive_u64(text: &str) -> Result<u64, String> {
    match number::<u64>(text, "a whole number of at least 1")? {
        0 => Err(format!("`{text}` is not a whole number of at least 1")),
        n => Ok(n),
    }
}

/// A whole count of at least 1 that Megatron types as a float (`--loss-scale-window
/// 1000` or `1000.0`).
pub fn positive_whole(text: &str) -> Result<u64, String> {
    let value = number::<f64>(text, "a whole number of at least 1")?;
    match value >= 1.0 && value.fract() == 0.0 && value < 1e15 {
        true => Ok(value as u64),
        false => Err(format!("`{text}` is not a whole number of at least 1")),
    }
}

/// A size in bytes as transformers writes `max_shard_size`: a whole number of bytes, or
/// with a unit: `KB`, `MB`, `GB`, `TB` (powers of 1000) or `KiB`, `MiB`, `GiB`, `TiB`
/// (powers of 1024); at least 1.
pub fn byte_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    // transformers' convert_file_size_to_int upper-cases the unit.
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        _ => {
            return Err(format!(
                "`{text}`: use bytes, or KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            ))
        }
    };
    let n: u64 = number(digits, "a size in bytes")?;
    match n.checked_mul(scale) {
        Some(0) => Err(format!("`{text}` is not a size of at least 1 byte")),
        Some(bytes) => Ok(bytes),
        None => Err(format!("`{text}` does not fit in 64 bits")),
    }
}

fn finite(text: &str) -> Result<f64, String> {
    let x = number::<f64>(text, "a number")?;
    if x.is_finite() {
        Ok(x)
    } else {
        Err(format!("`{text}` is not a finite number"))
    }
}

/// A finite number ≥ 0 (rates, weight decay, clipping, temperature).
pub fn non_negative(text: &str) -> Result<f64, String> {
    match finite(text)? {
        x if x >= 0.0 => Ok(x),
        _ => Err(format!("`{text}` is below 0")),
    }
}

/// A finite number > 0 (epsilons, bases, scales).
pub fn positive(text: &str) -> Result<f64, String> {
    match finite(text)? {
        x if x > 0.0 => Ok(x),
        _ => Err(format!("`{text}` is not above 0")),
    }
}

/// A fraction in [0, 1] (warm-up fraction, dropout).
pub fn fraction(text: &str) -> Result<f64, String> {
    match finite(text)? {
        x if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(format!("`{text}` is not in [0, 1]")),
    }
}

/// An Adam β in [0, 1).
pub fn adam_beta(text: &str) -> Result<f64, String> {
    match finite(text)? {
        x if (0.0..1.0).contains(&x) => Ok(x),
        _ => Err(format!("`{text}` is not in [0, 1)")),
    }
}

/// An emulated device speed in (0, 1].
pub fn speed(text: &str) -> Result<f64, String> {
    match finite(text)? {
        x if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("`{text}` is not a speed in (0, 1]")),
    }
}

/// `--distributed-timeout-minutes`: a finite number of minutes above zero.
pub fn positive_minutes(text: &str) -> Result<f64, String> {
    match finite(text)? {
        m if m > 0.0 && m <= 1e6 => Ok(m),
        _ => Err(format!("`{text}` is not a number of minutes above 0")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_numbers_are_refused() {
        assert_eq!(positive_count("3"), Ok(3));
        assert!(positive_count("0").is_err());
        assert!(positive_count("-1").is_err());
        assert!(positive_u64("0").is_err());
        assert!(non_negative("-0.1").is_err());
        assert!(non_negative("NaN").is_err());
        assert!(positive("0").is_err());
        assert!(positive("inf").is_err());
        assert_eq!(fraction("1"), Ok(1.0));
        assert!(fraction("1.5").is_err());
        assert!(adam_beta("1").is_err());
        assert_eq!(speed("1"), Ok(1.0));
        assert!(speed("0").is_err());
        assert!(positive_minutes("0").is_err());
        assert_eq!(byte_size("5GB"), Ok(5_000_000_000));
        assert_eq!(byte_size("2MiB"), Ok(2 << 20));
        assert_eq!(byte_size("5gb"), Ok(5_000_000_000));
        assert_eq!(byte_size("100"), Ok(100));
        assert!(byte_size("0KB").is_err());
        assert!(byte_size("5 GBs").is_err());
        assert!(byte_size("GB").is_err());
    }
}
