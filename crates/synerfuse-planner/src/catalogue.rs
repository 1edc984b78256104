//! The device catalogue: each kind's dense peaks (bf16 and fp16, and whether it has
//! bf16 at all), memory and links, and the driver names that map to each.

use serde::{Deserialize, Serialize};
use synerfuse_plan::Precision;

/// One row of the device catalogue (vendors' dense, non-sparse peaks).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// bf16 dense TFLOP/s (for a device without bf16, its fp16 peak: what it runs a
    /// bf16 job's work at, in fp16).
    pub tflops_bf16: f64,
    /// fp16 dense TFLOP/s.
    pub tflops_fp16: f64,
    /// Whether it computes in bf16 (the V100, the T4 and older GPUs do not).
    pub bf16: bool,
    /// Memory in GB.
    pub memory_gb: f64,
    /// Memory bandwidth in GB/s.
    pub mem_bw_gbs: f64,
    /// Device-to-device link within a node, bidirectional GB/s (vendor figure).
    pub link_gbs: f64,
    /// Whether it is an accelerator with a runtime context to reserve (not a CPU).
    pub accelerator: bool,
}

/// The built-in catalogue: `(slug, name, spec)`.
pub const CATALOGUE: &[(&str, &str, DeviceSpec)] = &[
    ("a100-40g", "A100-40G SXM", gpu(312.0, 40.0, 1555.0, 600.0)),
    ("a100-80g", "A100-80G SXM", gpu(312.0, 80.0, 2039.0, 600.0)),
    ("a800", "A800-80G", gpu(312.0, 80.0, 2039.0, 400.0)),
    ("h100-sxm", "H100 SXM", gpu(989.0, 80.0, 3350.0, 900.0)),
    ("h100-pcie", "H100 PCIe", gpu(756.0, 80.0, 2000.0, 600.0)),
    ("h800", "H800 SXM", gpu(989.0, 80.0, 3350.0, 400.0)),
    ("h200", "H200 SXM", gpu(989.0, 141.0, 4800.0, 900.0)),
    ("h20", "H20", gpu(148.0, 96.0, 4000.0, 900.0)),
    ("l40s", "L40S", gpu(362.0, 48.0, 864.0, 64.0)),
    ("a10", "A10", gpu(125.0, 24.0, 600.0, 64.0)),
    ("v100", "V100 SXM2", fp16_only(125.0, 32.0, 900.0, 300.0)),
    ("rtx4090", "RTX 4090", gpu(165.0, 24.0, 1008.0, 32.0)),
    ("rtx3090", "RTX 3090", gpu(71.0, 24.0, 936.0, 112.5)),
    ("t4", "T4", fp16_only(65.0, 16.0, 320.0, 32.0)),
    (
        "mi250x",
        "MI250X (per GCD)",
        gpu(191.0, 64.0, 1600.0, 400.0),
    ),
    ("mi300x", "MI300X", gpu(1307.0, 192.0, 5300.0, 896.0)),
    ("ascend910b", "Ascend 910B", gpu(320.0, 64.0, 1600.0, 392.0)),
    ("gaudi2", "Gaudi2", gpu(432.0, 96.0, 2460.0, 600.0)),
];

/// A GPU with bf16 whose fp16 dense peak equals its bf16 one (every one listed).
const fn gpu(tflops_bf16: f64, memory_gb: f64, mem_bw_gbs: f64, link_gbs: f64) -> DeviceSpec {
    DeviceSpec {
        tflops_bf16,
        tflops_fp16: tflops_bf16,
        bf16: true,
        memory_gb,
        mem_bw_gbs,
        link_gbs,
        accelerator: true,
    }
}

/// A GPU without bf16.
const fn fp16_only(tflops_fp16: f64, memory_gb: f64, mem_bw_gbs: f64, link_gbs: f64) -> DeviceSpec {
    DeviceSpec {
        bf16: false,
        ..gpu(tflops_fp16, memory_gb, mem_bw_gbs, link_gbs)
    }
}

impl DeviceSpec {
    /// The precision it computes a job of `precision` in: bf16 becomes fp16 on a device
    /// without bf16 (when `fallback`), `None` when it cannot run it.
    pub fn runs(&self, precision: Precision, fallback: bool) -> Option<Precision> {
        match (precision, self.bf16, fallback) {
            (Precision::Bf16, false, true) => Some(Precision::Fp16),
            (Precision::Bf16, false, false) => None,
            (p, _, _) => Some(p),
        }
    }

    /// Its dense peak in `precision`, TFLOP/s (fp32 is priced at the bf16 peak, as the
    /// planner always has: its efficiency absorbs the difference).
    pub fn peak(&self, precision: Precision) -> f64 {
        match precision {
            Precision::Fp16 => self.tflops_fp16,
            Precision::Bf16 | Precision::Fp32 => self.tflops_bf16,
        }
    }
}

/// The catalogue entry of `slug`.
pub fn catalogue(slug: &str) -> Option<DeviceSpec> {
    CATALOGUE
        .iter()
        .find(|(s, _, _)| s.eq_ignore_ascii_case(slug))
        .map(|(_, _, spec)| *spec)
}

/// Driver names to catalogue slugs: (a word of the name, a word the name must also
/// hold or `""`, the slug), first match wins, so a qualified entry comes before its
/// plain one.
const DEVICE_NAMES: &[(&str, &str, &str)] = &[
    ("H200", "", "h200"),
    ("H100", "PCIE", "h100-pcie"),
    ("H100", "HBM3", "h100-sxm"),
    ("H100", "SXM", "h100-sxm"),
    ("H800", "", "h800"),
    ("H20", "", "h20"),
    ("A100", "40GB", "a100-40g"),
    ("A100", "", "a100-80g"),
    ("A800", "", "a800"),
    ("L40S", "", "l40s"),
    ("A10", "", "a10"),
    ("V100", "", "v100"),
    ("4090", "", "rtx4090"),
    ("3090", "", "rtx3090"),
    ("T4", "", "t4"),
    ("MI300X", "", "mi300x"),
    ("MI250X", "", "mi250x"),
];

/// The catalogue slug of a GPU by the name its driver reports (`nvidia-smi`,
/// `cuDeviceGetName`: "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA H200"),
/// so a run can state its model FLOP utilisation against the right peak; `None` for a
/// device the catalogue does not hold or cannot tell apart by name (an H100 NVL, say).
pub fn catalogue_slug_for_device_name(name: &str) -> Option<&'static str> {
    let upper = name.to_ascii_uppercase().replace(['-', '_'], " ");
    let words: Vec<&str> = upper.split_whitespace().collect();
    DEVICE_NAMES
        .iter()
        .find(|(word, also, _)| {
            words.contains(word) && (also.is_empty() || words.iter().any(|w| w.contains(also)))
        })
        .map(|(_, _, slug)| *slug)
}

/// A GPU's catalogue entry by its driver name: (slug, dense bf16 peak TFLOP/s), the peak a
/// run's model FLOP utilisation is stated against.
pub fn catalogue_peak(name: &str) -> Option<(&'static str, f64)> {
    let slug = catalogue_slug_for_device_name(name)?;
    catalogue(slug).map(|spec| (slug, spec.tflops_bf16))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_without_bf16_run_a_bf16_job_in_fp16_at_their_fp16_peak() {
        let (v100, a100) = (catalogue("v100").unwrap(), catalogue("a100-80g").unwrap());
        assert!(!v100.bf16 && a100.bf16 && !catalogue("t4").unwrap().bf16);
        assert_eq!(v100.runs(Precision::Bf16, true), Some(Precision::Fp16));
        assert_eq!(v100.runs(Precision::Bf16, false), None);
        assert_eq!(a100.runs(Precision::Bf16, true), Some(Precision::Bf16));
        assert_eq!(v100.runs(Precision::Fp16, false), Some(Precision::Fp16));
        assert_eq!(v100.peak(Precision::Fp16), 125.0);
        assert_eq!(a100.peak(Precision::Bf16), 312.0);
        // No catalogue name says "(fp16)" any more: the precision is a field.
        assert!(CATALOGUE.iter().all(|(_, name, _)| !name.contains("fp16")));
    }
}
