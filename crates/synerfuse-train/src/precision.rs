//! The libtorch dtype of each compute precision (the plan crate, free of libtorch, names
//! the precisions; the trainer and the profiler compute in them).

use crate::TrainError;
use synerfuse_model::tch::{Device, Kind};
use synerfuse_plan::Precision;

/// The dtype parameters and activations take in `precision`.
pub(crate) fn compute_kind(precision: Precision) -> Kind {
    match precision {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        Precision::Fp16 => Kind::Half,
    }
}

/// Whether a GPU of compute capability `(major, minor)` computes in bf16: Ampere (8.0)
/// and later; a V100 (7.0) or T4 (7.5) has no bf16 units (libtorch emulates some of it,
/// slowly, and its matrix products not at all).
pub(crate) fn gpu_has_bf16((major, _minor): (i32, i32)) -> bool {
    major >= 8
}

/// Refuses `precision` on `rank`'s `device` where it cannot run: bf16 on a GPU without
/// it (fp16 runs on every GPU, and both on CPUs).
pub(crate) fn check_device_runs(
    precision: Precision,
    device: Device,
    rank: usize,
) -> Result<(), TrainError> {
    let Device::Cuda(ordinal) = device else {
        return Ok(());
    };
    let capability = crate::device_info::cuda_compute_capability(ordinal);
    match (precision, capability) {
        (Precision::Bf16, Some(capability)) if !gpu_has_bf16(capability) => {
            let names = crate::device_info::cuda_device_names();
            Err(TrainError::NoBf16 {
                rank,
                gpu: names
                    .get(ordinal)
                    .cloned()
                    .unwrap_or_else(|| format!("cuda:{ordinal}")),
                capability,
            })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_needs_ampere_or_later() {
        for (capability, has) in [
            ((7, 0), false),
            ((7, 5), false),
            ((8, 0), true),
            ((9, 0), true),
        ] {
            assert_eq!(gpu_has_bf16(capability), has, "{capability:?}");
        }
        // A CPU runs every precision.
        check_device_runs(Precision::Bf16, Device::Cpu, 0).unwrap();
    }
}
