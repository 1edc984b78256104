//! What the CUDA driver says of this machine's GPUs, and the peak a run's model FLOP
//! utilisation is stated against.

use synerfuse_parallel::cluster::{catalogue, catalogue_slug_for_device_name};

/// The name of each GPU the CUDA driver sees ("NVIDIA H100 80GB HBM3"), in ordinal
/// order; empty without a driver.
pub fn cuda_device_names() -> Vec<String> {
    // SAFETY: only looks for the driver library (cudarc would panic on a call without it).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Vec::new();
    }
    use cudarc::driver::result::device;
    if cudarc::driver::result::init().is_err() {
        return Vec::new();
    }
    let count = device::get_count().unwrap_or(0);
    (0..count)
        .filter_map(|ordinal| device::get(ordinal).ok())
        .map(|dev| device::get_name(dev).unwrap_or_else(|_| "unknown GPU".to_owned()))
        .collect()
}

/// A GPU's catalogue entry by its driver name: (slug, dense bf16 peak TFLOP/s).
pub fn catalogue_peak(name: &str) -> Option<(&'static str, f64)> {
    let slug = catalogue_slug_for_device_name(name)?;
    catalogue(slug).map(|spec| (slug, spec.tflops_bf16))
}
