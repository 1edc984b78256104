//! What a rank's training occupies, measured: its parameters, gradients, fp32 main
//! gradients and optimizer state as the runtime holds them (counted tensor by tensor),
//! and the activation high-water mark of a step: the memory in use sampled between the
//! pipeline's instructions, above the rank's state. On a CPU rank that is the C
//! allocator's bytes in use (glibc's `mallinfo2`, every arena and mmapped block), which
//! libtorch's CPU tensors come from, above what was in use when the step began. On a
//! CUDA rank it is the device's memory in use (`cuMemGetInfo`) above what was in use
//! once the state was built (plus the gradients the first step allocates): libtorch's
//! caching allocator keeps the blocks of a step reserved for the next, so a per-step
//! baseline would read zero after the first; the figure includes what the cache holds
//! beyond the live activations, so it bounds them from above (the allocator's own
//! statistics are not reachable through tch).

use std::sync::Arc;
use synerfuse_model::tch::Device;

/// A rank's memory, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryReport {
    /// Its parameters (in their training dtype).
    pub parameters: u64,
    /// Their gradients, as libtorch allocates them (the parameters' dtype).
    pub gradients: u64,
    /// The fp32 main-gradient buffers (and staging of whole-tensor reductions).
    pub main_gradients: u64,
    /// Optimizer state: moments and fp32 masters (its shards only under the distributed
    /// optimizer).
    pub optimizer: u64,
    /// The highest bytes in use above the step's start, over the steps after the first
    /// (the first also allocates the gradients); `None` until measured or off glibc.
    pub activations_peak: Option<u64>,
}

impl MemoryReport {
    /// Parameters, gradients, main gradients and optimizer state together: what the
    /// planner's memory model calls a stage's state.
    pub fn state(&self) -> u64 {
        self.parameters + self.gradients + self.main_gradients + self.optimizer
    }
}

/// A field of `/proc/self/status` in bytes (`VmHWM`, `VmRSS`), where the system says.
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The highest peak resident memory seen before the last [`PeakWatch`] reset it.
static EARLIER_PEAK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`, and peaks
/// before a [`PeakWatch`] reset it), where the system says.
pub fn peak_resident_bytes() -> Option<u64> {
    let now = status_bytes("VmHWM:")?;
    Some(now.max(EARLIER_PEAK.load(std::sync::atomic::Ordering::Relaxed)))
}

/// How much a piece of work raises the resident memory above what it was when the
/// work began: the kernel's peak is reset to the current size at the start (Linux
/// `clear_refs` 5; the peak before is kept for [`peak_resident_bytes`]).
pub struct PeakWatch {
    resident: u64,
}

impl PeakWatch {
    /// Starts watching; `None` where the system cannot reset the peak.
    pub fn start() -> Option<PeakWatch> {
        let before = status_bytes("VmHWM:")?;
        EARLIER_PEAK.fetch_max(before, std::sync::atomic::Ordering::Relaxed);
        std::fs::write("/proc/self/clear_refs", "5").ok()?;
        let resident = status_bytes("VmRSS:")?;
        Some(PeakWatch { resident })
    }

    /// (resident bytes at the start, peak resident bytes since).
    pub fn finish(self) -> (u64, u64) {
        let peak = status_bytes("VmHWM:").unwrap_or(self.resident);
        (self.resident, peak.max(self.resident))
    }
}

/// Bytes the C allocator has handed out and not taken back, where it can say (glibc
/// 2.33 and later: `mallinfo2`, looked up at run time so that the binaries still load on
/// older systems, where this is `None`).
pub fn allocated_bytes() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        type MallInfo2 = unsafe extern "C" fn() -> libc::mallinfo2;
        static MALLINFO2: std::sync::OnceLock<Option<MallInfo2>> = std::sync::OnceLock::new();
        let mallinfo2 = MALLINFO2.get_or_init(|| {
            // SAFETY: a symbol lookup; the symbol, where present, is glibc's mallinfo2
            // with this signature.
            let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallinfo2".as_ptr()) };
            (!symbol.is_null()).then(|| {
                // SAFETY: a non-null address of glibc's mallinfo2, whose signature is
                // MallInfo2's; a function pointer has a data pointer's size here.
                unsafe { std::mem::transmute::<*mut libc::c_void, MallInfo2>(symbol) }
            })
        });
        // SAFETY: mallinfo2 only reads the allocator's own statistics.
        let info = unsafe { (*mallinfo2)?() };
        Some((info.uordblks + info.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// Where a rank's memory in use is read.
#[derive(Clone)]
pub enum MemoryProbe {
    /// The C allocator's bytes in use.
    Host,
    /// The device's memory in use, through its primary context (the one libtorch uses),
    /// and the bytes in use once the rank's state is allocated: the fixed baseline of
    /// every step.
    Cuda {
        /// The device's primary context.
        context: Arc<cudarc::driver::CudaContext>,
        /// Bytes in use with the state allocated.
        state_base: u64,
    },
}

impl MemoryProbe {
    /// The probe of a rank on `device`, made once its state is allocated but for
    /// `pending` bytes (the gradients its first backward allocates); `None` where
    /// nothing can be read (no glibc, or no CUDA driver).
    pub fn for_device(device: Device, pending: u64) -> Option<Self> {
        match device {
            Device::Cuda(ordinal) => {
                // SAFETY: only looks for the driver library (cudarc would panic on a
                // call without it).
                let driver = unsafe { cudarc::driver::sys::is_culib_present() };
                let context = driver.then(|| cudarc::driver::CudaContext::new(ordinal).ok());
                let context = context.flatten()?;
                let in_use = cuda_in_use(&context)?;
                Some(MemoryProbe::Cuda {
                    context,
                    state_base: in_use + pending,
                })
            }
            _ => allocated_bytes().map(|_| MemoryProbe::Host),
        }
    }

    /// Bytes in use now.
    pub fn in_use(&self) -> Option<u64> {
        match self {
            MemoryProbe::Host => allocated_bytes(),
            MemoryProbe::Cuda { context, .. } => cuda_in_use(context),
        }
    }

    /// What a step's high-water mark is measured above: the bytes in use when the step
    /// begins on the host, the state's on a device.
    fn step_base(&self) -> Option<u64> {
        match self {
            MemoryProbe::Host => allocated_bytes(),
            MemoryProbe::Cuda { state_base, .. } => Some(*state_base),
        }
    }
}

/// The device memory in use, all processes' (the rank's device is its own).
fn cuda_in_use(context: &cudarc::driver::CudaContext) -> Option<u64> {
    context.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some(total.saturating_sub(free) as u64)
}

/// The high-water mark of a [`MemoryProbe`] above a baseline.
#[derive(Clone)]
pub struct HighWater {
    probe: MemoryProbe,
    base: u64,
    peak: u64,
}

impl HighWater {
    /// Starts at the probe's baseline for a step; `None` where it cannot read.
    pub fn start(probe: &MemoryProbe) -> Option<Self> {
        let base = probe.step_base()?;
        Some(HighWater {
            probe: probe.clone(),
            base,
            peak: base,
        })
    }

    /// Takes a sample.
    pub fn sample(&mut self) {
        if let Some(now) = self.probe.in_use() {
            self.peak = self.peak.max(now);
        }
    }

    /// The highest sample above the baseline.
    pub fn above_base(&self) -> u64 {
        self.peak.saturating_sub(self.base)
    }
}

/// Bytes of `tensors`' elements.
pub fn tensor_bytes<'a>(tensors: impl IntoIterator<Item = &'a tch::Tensor>) -> u64 {
    (tensors.into_iter())
        .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}
