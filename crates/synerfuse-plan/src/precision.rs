//! The number format a rank computes in. Main gradients, master parameters and every
//! gradient reduction stay fp32 whatever it is, so ranks of different precisions can
//! reduce together.

/// A compute precision: Megatron's `--bf16`, `--fp16`, or neither (fp32).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 throughout (neither flag).
    #[default]
    Fp32,
    /// bf16 parameters and compute (`--bf16`): fp32's range, no loss scaling.
    Bf16,
    /// fp16 parameters and compute (`--fp16`): a narrow range, so the loss is scaled
    /// (Megatron's dynamic loss scaling) and a step whose gradients overflow is skipped.
    Fp16,
}

impl Precision {
    /// Every precision, in the order Megatron's flags list them.
    pub const ALL: [Precision; 3] = [Precision::Fp32, Precision::Bf16, Precision::Fp16];

    /// Bytes of one parameter or activation element in this precision.
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }

    /// Whether gradients in this precision need the loss scaled (fp16's range).
    pub fn scales_loss(self) -> bool {
        self == Precision::Fp16
    }

    /// The name plan files and logs use.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

/// A precision name that is none of `fp32`, `bf16`, `fp16`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision {0:?} (expected fp32, bf16 or fp16)")]
pub struct UnknownPrecision(pub String);

impl std::str::FromStr for Precision {
    type Err = UnknownPrecision;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        (Precision::ALL.into_iter())
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPrecision(s.to_owned()))
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_named() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(json, format!("\"{p}\""));
        }
        let err = "fp8".parse::<Precision>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown precision \"fp8\" (expected fp32, bf16 or fp16)"
        );
        assert!(Precision::Fp16.scales_loss() && !Precision::Bf16.scales_loss());
        assert_eq!(Precision::default().bytes(), 4);
    }
}
