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

/// The compute capability (major, minor) of GPU `ordinal` as the CUDA driver reports it;
/// `None` without a driver or such a GPU.
pub fn cuda_compute_capability(ordinal: usize) -> Option<(i32, i32)> {
    // SAFETY: as in `cuda_device_names`: the driver library is looked for first.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    use cudarc::driver::result::device;
    use cudarc::driver::sys::CUdevice_attribute as Attribute;
    cudarc::driver::result::init().ok()?;
    let dev = device::get(i32::try_from(ordinal).ok()?).ok()?;
    // SAFETY: `dev` is a device the driver just returned; the attributes are integers.
    let read = |a| unsafe { device::get_attribute(dev, a) }.ok();
    Some((
        read(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        read(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}
