//! What the CUDA driver says of this machine's GPUs (the peak a run's model FLOP
//! utilisation is stated against is the planner's catalogue: `cluster::catalogue_peak`).

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
