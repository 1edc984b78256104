//! The CUDA stream NCCL runs on ("lane"), shared by the communicators that enqueue on
//! it, how it is ordered after libtorch's kernels, and how the host waits for it.

use super::nccl_handle::CommHandle;
use super::watchdog::{abort_if_expired, waiting};
use super::CommError;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a wait spins (yielding) before it sleeps between looks.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_millis(1);
/// The sleep between looks after that.
const POLL_INTERVAL: Duration = Duration::from_micros(100);

/// What one look at a wait finds, from NCCL's health and the completion event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Poll {
    /// The work is complete and NCCL reports no error.
    Done,
    /// Not yet: look again.
    Pending,
    /// NCCL reported an error on a communicator of the lane.
    NcclFailed,
    /// CUDA reported an error for the event (a sticky context error).
    CudaFailed(CUresult),
}

/// The decision of one look: NCCL's error first (a failed NCCL kernel can end, so the
/// event completes, with garbage in the buffer), then the event's state
/// (`Ok(true)`: complete, `Ok(false)`: `CUDA_ERROR_NOT_READY`, `Err`: any other code).
pub(crate) fn decide(nccl_healthy: bool, event: Result<bool, CUresult>) -> Poll {
    match (nccl_healthy, event) {
        (false, _) => Poll::NcclFailed,
        (true, Err(code)) => Poll::CudaFailed(code),
        (true, Ok(true)) => Poll::Done,
        (true, Ok(false)) => Poll::Pending,
    }
}

/// The pause after a look that found the work pending, `waited` into the wait: none
/// (a yield) at first, since most NCCL operations end within a millisecond, then a short
/// sleep, so a rank waiting for slower ranks leaves its core to others.
pub(crate) fn pause(waited: Duration) -> Option<Duration> {
    (waited > SPIN_BEFORE_SLEEP).then_some(POLL_INTERVAL)
}

/// An NCCL stream and the communicators that enqueue on it.
pub(crate) struct Lane {
    stream: Arc<CudaStream>,
    /// The context's legacy default stream, where libtorch computes (see
    /// [`Self::after_libtorch`]).
    legacy: Arc<CudaStream>,
    /// Re-recorded on `legacy` before each operation; a wait already enqueued on an
    /// event keeps the work it captured when the event is recorded again.
    produced: CudaEvent,
    comms: RefCell<Vec<Weak<CommHandle>>>,
}

impl Lane {
    /// A new non-blocking stream on `context` (no implicit synchronisation with the
    /// legacy default stream: the order with libtorch is explicit, by event).
    pub(crate) fn new(context: &Arc<CudaContext>) -> Result<Self, DriverError> {
        let stream = context.new_stream()?;
        Ok(Lane {
            legacy: context.default_stream(),
            produced: context.new_event(None)?,
            stream,
            comms: RefCell::new(Vec::new()),
        })
    }

    /// The stream as NCCL takes it.
    pub(crate) fn raw_stream(&self) -> cudarc::nccl::sys::cudaStream_t {
        self.stream.cu_stream() as cudarc::nccl::sys::cudaStream_t
    }

    /// Counts `comm` among those enqueueing on this lane: their errors can hold it up.
    pub(crate) fn join(&self, comm: &Rc<CommHandle>) {
        let mut comms = self.comms.borrow_mut();
        comms.retain(|c| c.strong_count() > 0);
        comms.push(Rc::downgrade(comm));
    }

    /// Makes this stream wait, on the GPU, for the kernels libtorch has enqueued so far,
    /// without blocking the host (a device-wide or host-side synchronise would stall the
    /// backward that launches gradient buckets and leave the GPU idle).
    ///
    /// The event is recorded on the legacy default stream of the device's primary
    /// context: `NcclCommunicator::init` takes that context (`CudaContext::new`, which
    /// retains the primary context, the one the CUDA runtime and so libtorch use), and
    /// libtorch launches on its current stream, which is the default stream (null, the
    /// legacy stream, as libtorch is not built with per-thread default streams) since
    /// tch never sets another. Every kernel that produced the tensor, and any copy into
    /// it, was therefore enqueued there before this call.
    pub(crate) fn after_libtorch(&self) -> Result<(), DriverError> {
        self.produced.record(&self.legacy)?;
        self.stream.wait(&self.produced)
    }

    /// An event recorded on this stream now: complete when everything enqueued so far is.
    pub(crate) fn mark(&self) -> Result<CudaEvent, DriverError> {
        self.stream.record_event(None)
    }

    /// Waits (bounded by the watchdog) until `done` completes. Polls rather than blocks
    /// in `cuStreamSynchronize`, so an NCCL error on any communicator of this lane
    /// (which would hold the stream forever) ends the wait at once, naming NCCL's error,
    /// instead of at the timeout as "a rank died or froze". An event rather than a
    /// stream query: the lane may be shared, and the stream then also holds
    /// collectives enqueued later, which this wait must not wait for.
    pub(crate) fn wait(
        &self,
        done: &CudaEvent,
        op: &'static str,
        comm: &CommHandle,
    ) -> Result<(), CommError> {
        let _wait = waiting(op, &comm.name, None);
        let started = Instant::now();
        while !self.poll(done, op, comm)? {
            abort_if_expired();
            match pause(started.elapsed()) {
                Some(pause) => std::thread::sleep(pause),
                None => std::thread::yield_now(),
            }
        }
        Ok(())
    }

    /// Whether `done` has completed, without waiting; NCCL's error on any communicator
    /// of this lane first (see [`Self::wait`]).
    pub(crate) fn poll(
        &self,
        done: &CudaEvent,
        op: &'static str,
        comm: &CommHandle,
    ) -> Result<bool, CommError> {
        let cuda_err = |code: CUresult| CommError::Cuda {
            rank: comm.rank,
            context: "cuEventQuery",
            message: format!("{op} over {}: {:?}", comm.name, DriverError(code)),
        };
        done.context().bind_to_thread().map_err(|e| cuda_err(e.0))?;
        let nccl = self.check(op);
        let event = done.try_is_complete().map_err(|e| e.0);
        match decide(nccl.is_ok(), event) {
            Poll::Done => Ok(true),
            Poll::NcclFailed => nccl.map(|()| false),
            Poll::CudaFailed(code) => {
                // The context is broken: destroying a communicator would hang.
                self.abort_all();
                Err(cuda_err(code))
            }
            Poll::Pending => Ok(false),
        }
    }

    /// NCCL's first error on the communicators of this lane (each that reports one is
    /// aborted).
    fn check(&self, op: &'static str) -> Result<(), CommError> {
        let comms = self.comms.borrow();
        (comms.iter().filter_map(Weak::upgrade)).try_for_each(|comm| comm.check(op))
    }

    /// Aborts every communicator of this lane.
    fn abort_all(&self) {
        for comm in self.comms.borrow().iter().filter_map(Weak::upgrade) {
            comm.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_errors_come_first_then_cuda_then_completion() {
        let not_ready = CUresult::CUDA_ERROR_NOT_READY;
        let illegal = CUresult::CUDA_ERROR_ILLEGAL_ADDRESS;
        assert_eq!(decide(true, Ok(true)), Poll::Done);
        assert_eq!(decide(true, Ok(false)), Poll::Pending);
        // A failed NCCL kernel may end and complete the event: still a failure.
        assert_eq!(decide(false, Ok(true)), Poll::NcclFailed);
        assert_eq!(decide(false, Ok(false)), Poll::NcclFailed);
        assert_eq!(decide(false, Err(illegal)), Poll::NcclFailed);
        assert_eq!(decide(true, Err(illegal)), Poll::CudaFailed(illegal));
        // NOT_READY never reaches `decide` as an error (try_is_complete maps it), but
        // were it to, it would not pass for completion.
        assert_ne!(decide(true, Err(not_ready)), Poll::Done);
    }

    #[test]
    fn waits_spin_briefly_then_sleep() {
        assert_eq!(pause(Duration::ZERO), None);
        assert_eq!(pause(Duration::from_micros(500)), None);
        assert_eq!(pause(Duration::from_millis(2)), Some(POLL_INTERVAL));
        assert_eq!(pause(Duration::from_secs(60)), Some(POLL_INTERVAL));
    }
}
