//! Device emulation: a rank that stands in for a slower device, so heterogeneous plans can
//! be tested and benchmarked on one CPU machine.
//!
//! On a CPU rank a computation is charged by the CPU time it used (the computing thread's
//! when libtorch runs one intra-op thread, else every thread's), not by its wall time: a rank emulating speed `s` takes `cpu / s` of wall time
//! per computation, sleeping for the rest. Wall time would not do: ranks sharing cores run
//! faster whenever an emulated slow rank sleeps and frees its core, so measured speeds
//! would depend on the neighbours. CPU time is the same whoever shares the machine, as
//! long as the emulated devices fit in it (Σ speeds ≤ cores; the trainer warns otherwise).
//! Speed 1 is one core's worth of work per second. On CUDA ranks the computation is
//! timed by the wall clock after a synchronisation, and `s` scales that.

use std::time::{Duration, Instant};
use synerfuse_model::tch::{Cuda, Device};

/// The CPU time of the computation so far: this thread's when libtorch computes on it
/// alone (one intra-op thread; MPI's and the runtime's helper threads then do not count),
/// every thread of the process otherwise.
pub fn compute_cpu_time() -> Duration {
    let clock = if synerfuse_model::tch::get_num_threads() == 1 {
        libc::CLOCK_THREAD_CPUTIME_ID
    } else {
        libc::CLOCK_PROCESS_CPUTIME_ID
    };
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux supports.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The start of one timed computation.
#[derive(Debug, Clone, Copy)]
pub struct ComputeSpan {
    wall: Instant,
    cpu: Duration,
}

impl ComputeSpan {
    /// Starts timing now.
    pub fn start() -> Self {
        ComputeSpan {
            wall: Instant::now(),
            cpu: compute_cpu_time(),
        }
    }

    /// Wall time since the start.
    pub fn elapsed(&self) -> Duration {
        self.wall.elapsed()
    }

    /// CPU time the computation used since the start.
    pub fn cpu_elapsed(&self) -> Duration {
        compute_cpu_time().saturating_sub(self.cpu)
    }
}

/// Emulates a device `speed` times as fast as one CPU core (CPU ranks) or as the rank's
/// GPU (CUDA ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Emulation {
    /// Relative speed, in (0, 1].
    pub speed: f64,
    /// The device the rank computes on (it picks the clock).
    pub device: Device,
}

impl Emulation {
    /// Ends the computation started at `span`: waits until it has lasted as long as it
    /// would on the emulated device and returns that duration.
    pub fn finish(&self, span: ComputeSpan) -> Duration {
        let target = match self.device {
            Device::Cuda(i) => {
                Cuda::synchronize(i as i64);
                span.elapsed().div_f64(self.speed)
            }
            _ => span.cpu_elapsed().div_f64(self.speed),
        };
        let wall = span.elapsed();
        if target > wall {
            std::thread::sleep(target - wall);
        }
        span.elapsed()
    }

    /// The duration of the computation started at `span`: emulated when `emulation` is set.
    pub fn account(emulation: Option<&Emulation>, span: ComputeSpan) -> Duration {
        emulation.map_or_else(|| span.elapsed(), |e| e.finish(span))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(d: Duration) {
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < d {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
    }

    // One test: with one intra-op thread the clock is this thread's, so tests running
    // beside it in the same process (`cargo test`) do not count (the sleep still looks
    // for a quiet window in three tries).
    #[test]
    fn cpu_emulation_charges_cpu_time_over_speed() {
        let threads = synerfuse_model::tch::get_num_threads();
        synerfuse_model::tch::set_num_threads(1);
        charges_cpu_time_over_speed();
        synerfuse_model::tch::set_num_threads(threads);
    }

    fn charges_cpu_time_over_speed() {
        let quiet = (0..3).any(|_| {
            let span = ComputeSpan::start();
            std::thread::sleep(Duration::from_millis(30));
            assert!(span.elapsed() >= Duration::from_millis(30));
            span.cpu_elapsed() < Duration::from_millis(10)
        });
        assert!(quiet, "sleeping used CPU time");

        let e = Emulation {
            speed: 0.25,
            device: Device::Cpu,
        };
        let span = ComputeSpan::start();
        spin(Duration::from_millis(40));
        let cpu = span.cpu_elapsed();
        let total = e.finish(span);
        // At least cpu / speed; the spin used at most its wall time of CPU.
        assert!(total >= cpu.div_f64(0.25), "{total:?} < 4 x {cpu:?}");
        assert!(
            cpu > Duration::from_millis(5),
            "spinning used no CPU time: {cpu:?}"
        );
        // Not charged twice over: the sleep's overshoot on a loaded machine stays far
        // under another 160 ms.
        assert!(total < Duration::from_millis(40).div_f64(0.25) + Duration::from_millis(150));
    }
}
