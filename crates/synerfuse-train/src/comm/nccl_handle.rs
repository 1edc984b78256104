//! An NCCL communicator handle shared by its [`super::NcclCommunicator`] and the
//! operations still in flight on it, and how it ends: NCCL's errors read, a communicator
//! that saw one aborted (never destroyed: `ncclCommDestroy` waits for work that a failed
//! communicator may never finish), and a healthy one finalized, then destroyed.

use super::watchdog::waiting;
use super::CommError;
use cudarc::nccl::sys::{self, ncclResult_t};
use std::cell::Cell;
use std::sync::Arc;

/// Where a communicator is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Life {
    /// Created; operations may be issued.
    Live,
    /// `ncclCommFinalize` has run: no new operations; destroy next.
    Finalized,
    /// `ncclCommAbort` has run after an error: the handle is gone.
    Aborted,
    /// `ncclCommDestroy` has run: the handle is gone.
    Destroyed,
}

/// Whether the handle still exists (NCCL may be asked about it).
pub(crate) fn handle_exists(life: Life) -> bool {
    matches!(life, Life::Live | Life::Finalized)
}

/// The error `ncclCommGetAsyncError` reports, given what the call returned (`queried`)
/// and the code it wrote (`reported`): `None` while the communicator is healthy
/// (`ncclInProgress` is a non-blocking communicator still working, not a failure).
pub(crate) fn async_failure(queried: ncclResult_t, reported: ncclResult_t) -> Option<ncclResult_t> {
    let healthy = |code| {
        matches!(
            code,
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress
        )
    };
    match (healthy(queried), healthy(reported)) {
        (false, _) => Some(queried),
        (true, false) => Some(reported),
        (true, true) => None,
    }
}

/// One NCCL communicator's handle. Not `Send`: the communicator and the operations on it
/// stay on the thread that made it (NCCL does not allow concurrent calls on one
/// communicator), so a `Cell` is enough to track its life.
pub(crate) struct CommHandle {
    comm: sys::ncclComm_t,
    life: Cell<Life>,
    /// This rank in the communicator (for errors).
    pub(crate) rank: usize,
    /// The group's name in errors and timeout messages.
    pub(crate) name: Arc<str>,
}

impl CommHandle {
    /// Takes ownership of `comm`, just created by `ncclCommInitRank`.
    pub(crate) fn new(comm: sys::ncclComm_t, rank: usize, name: Arc<str>) -> Self {
        CommHandle {
            comm,
            life: Cell::new(Life::Live),
            rank,
            name,
        }
    }

    /// The raw handle, to issue `op` with: only while the communicator is live.
    pub(crate) fn raw(&self, op: &'static str) -> Result<sys::ncclComm_t, CommError> {
        match self.life.get() {
            Life::Live => Ok(self.comm),
            _ => Err(self.gone(op)),
        }
    }

    /// Why `op` cannot run on this communicator any more.
    pub(crate) fn gone(&self, op: &'static str) -> CommError {
        CommError::NcclGone {
            rank: self.rank,
            group: self.name.to_string(),
            op,
            life: format!("{:?}", self.life.get()).to_lowercase(),
        }
    }

    /// `Ok` while NCCL reports no error on the communicator (or it no longer exists
    /// because it was destroyed in order); the error, after aborting the communicator,
    /// once NCCL reports one, and for a communicator aborted earlier.
    pub(crate) fn check(&self, op: &'static str) -> Result<(), CommError> {
        match self.life.get() {
            Life::Destroyed => return Ok(()),
            Life::Aborted => return Err(self.gone(op)),
            Life::Live | Life::Finalized => {}
        }
        let mut reported = ncclResult_t::ncclSuccess;
        // SAFETY: the handle exists (checked above); NCCL documents this call as safe to
        // make while operations run on the communicator; `reported` is written by it.
        let queried = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut reported) };
        match async_failure(queried, reported) {
            None => Ok(()),
            Some(code) => Err(self.fail(op, code)),
        }
    }

    /// The error of `op` failing with `code`, NCCL's words included, without aborting
    /// (inside an NCCL group the communicator must outlive `ncclGroupEnd`).
    pub(crate) fn failure(&self, op: &'static str, code: ncclResult_t) -> CommError {
        CommError::Nccl {
            rank: self.rank,
            group: self.name.to_string(),
            op,
            code: format!("{code:?}"),
            reason: error_string(code),
            detail: last_error(),
        }
    }

    /// [`Self::failure`], after which the communicator is aborted.
    pub(crate) fn fail(&self, op: &'static str, code: ncclResult_t) -> CommError {
        let error = self.failure(op, code);
        self.abort();
        error
    }

    /// Aborts the communicator (once; nothing if it no longer exists): NCCL stops its
    /// kernels and frees it without waiting for the peers. Bounded by the watchdog.
    pub(crate) fn abort(&self) {
        if !handle_exists(self.life.get()) {
            return;
        }
        self.life.set(Life::Aborted);
        let _wait = waiting("ncclCommAbort", &self.name, None);
        // SAFETY: the handle exists (checked above) and is marked aborted first, so no
        // later call reaches it.
        if let Err(e) = unsafe { cudarc::nccl::result::comm_abort(self.comm) } {
            tracing::warn!("{}: ncclCommAbort: {}", self.name, error_string(e.0));
        }
    }

    /// Completes the communicator's work and releases its links (`ncclCommFinalize`),
    /// once, while it is live; aborts it if that fails. Bounded by the watchdog.
    pub(crate) fn finalize(&self) -> Result<(), CommError> {
        if self.life.get() != Life::Live {
            return Ok(());
        }
        self.life.set(Life::Finalized);
        let _wait = waiting("ncclCommFinalize", &self.name, None);
        // SAFETY: the handle exists (it was live) and is finalized once (marked above).
        match unsafe { cudarc::nccl::result::comm_finalize(self.comm) } {
            Ok(_) => Ok(()),
            Err(e) => Err(self.fail("ncclCommFinalize", e.0)),
        }
    }

    /// Finalizes the communicator if need be, then destroys it; an aborted one is
    /// already freed, and one whose finalize failed is aborted instead.
    pub(crate) fn release(&self) {
        if let Err(e) = self.finalize() {
            tracing::warn!("{e}");
        }
        if !handle_exists(self.life.get()) {
            return;
        }
        self.life.set(Life::Destroyed);
        // SAFETY: the handle exists and was finalized (above); it is destroyed once
        // (marked above), and `raw`/`check` never hand it out again.
        let _ = unsafe { cudarc::nccl::result::comm_destroy(self.comm) };
    }
}

/// NCCL's words for `code` (`ncclGetErrorString`).
pub(crate) fn error_string(code: ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString takes any code and returns a static string (or null).
    let text = unsafe { sys::ncclGetErrorString(code) };
    c_text(text).unwrap_or_else(|| format!("{code:?}"))
}

/// NCCL's description of the last error on this thread (`ncclGetLastError`), often
/// the cause (a peer's closed connection, a CUDA error) behind a generic code.
fn last_error() -> String {
    // SAFETY: NCCL documents the communicator argument as unused (null is allowed); the
    // result is a NUL-terminated string owned by NCCL, copied at once.
    let text = unsafe { sys::ncclGetLastError(std::ptr::null_mut()) };
    c_text(text).unwrap_or_default()
}

/// A copy of the C string at `text`, unless null or empty.
fn c_text(text: *const std::ffi::c_char) -> Option<String> {
    if text.is_null() {
        return None;
    }
    // SAFETY: a non-null NUL-terminated string from NCCL, read before any other NCCL call.
    let text = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy();
    (!text.is_empty()).then(|| text.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclResult_t as R;

    #[test]
    fn only_real_errors_fail_a_communicator() {
        assert_eq!(async_failure(R::ncclSuccess, R::ncclSuccess), None);
        assert_eq!(async_failure(R::ncclSuccess, R::ncclInProgress), None);
        assert_eq!(
            async_failure(R::ncclSuccess, R::ncclRemoteError),
            Some(R::ncclRemoteError)
        );
        assert_eq!(
            async_failure(R::ncclSuccess, R::ncclSystemError),
            Some(R::ncclSystemError)
        );
        // A failed query is itself the error, whatever it wrote.
        assert_eq!(
            async_failure(R::ncclInvalidArgument, R::ncclSuccess),
            Some(R::ncclInvalidArgument)
        );
    }

    #[test]
    fn aborted_or_destroyed_handles_are_never_touched_again() {
        assert!(handle_exists(Life::Live));
        assert!(handle_exists(Life::Finalized));
        assert!(!handle_exists(Life::Aborted));
        assert!(!handle_exists(Life::Destroyed));
        // A handle that is not live issues nothing, and says why.
        let handle = CommHandle::new(std::ptr::null_mut(), 1, Arc::from("the group [0, 1]"));
        handle.life.set(Life::Aborted);
        let err = handle.raw("ncclAllReduce").unwrap_err();
        assert!(matches!(err, CommError::NcclGone { rank: 1, .. }), "{err}");
        assert!(err.to_string().contains("aborted"), "{err}");
        assert!(handle.check("wait").is_err());
        // Teardown of an aborted handle calls nothing (a null handle would crash NCCL).
        handle.release();
        handle.abort();
        assert_eq!(handle.life.get(), Life::Aborted);
        handle.life.set(Life::Destroyed);
        assert!(handle.check("wait").is_ok());
    }
}
