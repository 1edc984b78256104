//! The libtorch dtype of each compute precision (the plan crate, free of libtorch, names
//! the precisions; the trainer and the profiler compute in them).

use synerfuse_model::tch::Kind;
use synerfuse_plan::Precision;

/// The dtype parameters and activations take in `precision`.
pub(crate) fn compute_kind(precision: Precision) -> Kind {
    match precision {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        Precision::Fp16 => Kind::Half,
    }
}
