//! Which pipeline schedule a plan runs, by Megatron's names.

/// Which pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward (Megatron's non-interleaved schedule).
    OneFOneB,
    /// 1F1B over virtual chunks (Megatron's interleaved schedule).
    Interleaved,
}

/// A schedule name that is none of `1f1b`, `gpipe`, `interleaved`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a pipeline schedule: expected 1f1b, gpipe or interleaved")]
pub struct UnknownScheduleKind(pub String);

impl std::str::FromStr for ScheduleKind {
    type Err = UnknownScheduleKind;

    /// Megatron's and the CLI's names: `1f1b`, `gpipe`, `interleaved`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "gpipe" => Ok(ScheduleKind::Gpipe),
            "interleaved" => Ok(ScheduleKind::Interleaved),
            other => Err(UnknownScheduleKind(other.to_owned())),
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::Interleaved => "interleaved",
        })
    }
}
