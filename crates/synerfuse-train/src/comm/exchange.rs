//! Point-to-point messages of a hierarchical reduction ([`super::hierarchical`]): fp32
//! host ranges, each message under the reduction's tag, stamped with its arrival time
//! where the plan's links are emulated ([`super::emulated_links`]).

use super::emulated_links::monotonic_s;
use super::host::{poll_until, MAX_ELEMENTS_PER_CALL};
use super::watchdog::waiting;
use super::MpiCommunicator;
use mpi::raw::AsRaw;
use tch::{Device, Kind, Tensor};

/// Point-to-point messages of fp32 host ranges in flight, each under one tag (a range
/// beyond MPI's `int` counts in several messages, which MPI keeps in order).
pub(super) struct Exchange {
    comm: mpi::ffi::MPI_Comm,
    tag: i32,
    requests: Vec<mpi::ffi::MPI_Request>,
    /// The tensors the requests read and write, kept alive until they complete.
    buffers: Vec<Tensor>,
    /// The arrival times received (fp64, one each), read once the requests complete.
    stamps: Vec<Tensor>,
    /// When the last message arrives on the emulated links, once known.
    arrives: Option<f64>,
    group: std::sync::Arc<str>,
}

impl Exchange {
    pub(super) fn new(comm: &MpiCommunicator, tag: i32) -> Self {
        Exchange {
            comm: comm.raw().as_raw(),
            tag,
            requests: Vec::new(),
            buffers: Vec::new(),
            stamps: Vec::new(),
            arrives: None,
            group: comm.shared_name(),
        }
    }

    /// Sends the contiguous fp32 CPU `part` to `peer`, stamped with its `arrival` on
    /// the emulated links where they carry it.
    pub(super) fn send(&mut self, part: &Tensor, peer: usize, arrival: Option<f64>) {
        if let Some(arrival) = arrival {
            self.post_stamp(Tensor::from_slice(&[arrival]), peer, true);
        }
        self.post(part, peer, true);
    }

    /// Receives into the contiguous fp32 CPU `into` from `peer`, and its arrival time
    /// first where it is `stamped`.
    pub(super) fn receive(&mut self, into: &Tensor, peer: usize, stamped: bool) {
        if stamped {
            let stamp = Tensor::zeros([1], (Kind::Double, Device::Cpu));
            self.post_stamp(stamp.shallow_clone(), peer, false);
            self.stamps.push(stamp);
        }
        self.post(into, peer, false);
    }

    /// Posts one fp64 `stamp` (kept alive with the buffers) under the exchange's tag,
    /// before its data: MPI keeps messages of one pair and tag in order.
    fn post_stamp(&mut self, stamp: Tensor, peer: usize, send: bool) {
        // SAFETY: `stamp` is a one-element fp64 CPU tensor, kept alive in `buffers`
        // until every request has completed.
        unsafe { self.issue(stamp.data_ptr(), 1, mpi::ffi::RSMPI_DOUBLE, peer, send) };
        self.buffers.push(stamp);
    }

    /// Posts the contiguous fp32 CPU `buffer` to (or from) `peer`, in messages of at
    /// most MPI's `int` count.
    fn post(&mut self, buffer: &Tensor, peer: usize, send: bool) {
        let numel = buffer.numel();
        let mut offset = 0;
        while offset < numel {
            let count = (numel - offset).min(MAX_ELEMENTS_PER_CALL);
            // SAFETY: `buffer` is a contiguous fp32 CPU tensor of `numel` elements, kept
            // alive in `buffers` until every request has completed.
            unsafe {
                let at = (buffer.data_ptr() as *mut f32).add(offset).cast();
                self.issue(at, count as i32, mpi::ffi::RSMPI_FLOAT, peer, send);
            }
            offset += count;
        }
        self.buffers.push(buffer.shallow_clone());
    }

    /// One non-blocking send (or receive) of `count` elements of `datatype` at `at`, under
    /// the exchange's tag, its request kept.
    ///
    /// # Safety
    /// `at` must hold `count` elements of `datatype` until the request completes. `comm`
    /// is the group's own communicator, which outlives the exchange (the reduction
    /// holding it is held by its `HierarchicalGroup`).
    unsafe fn issue(
        &mut self,
        at: *mut std::ffi::c_void,
        count: i32,
        datatype: mpi::ffi::MPI_Datatype,
        peer: usize,
        send: bool,
    ) {
        let mut request = std::mem::MaybeUninit::uninit();
        let (peer, tag, comm, out) = (peer as i32, self.tag, self.comm, request.as_mut_ptr());
        // SAFETY: the caller's guarantees; `out` receives the request on return.
        unsafe {
            match send {
                true => mpi::ffi::MPI_Isend(at, count, datatype, peer, tag, comm, out),
                false => mpi::ffi::MPI_Irecv(at, count, datatype, peer, tag, comm, out),
            };
            self.requests.push(request.assume_init());
        }
    }

    /// Whether every message has completed (MPI moves them on inside this call).
    pub(super) fn test(&mut self) -> bool {
        let done = self.requests.iter_mut().all(|request| {
            let mut flag = 0;
            // SAFETY: a request from MPI_Isend/MPI_Irecv, or MPI_REQUEST_NULL once
            // complete (for which MPI_Test reports completion).
            unsafe { mpi::ffi::MPI_Test(request, &mut flag, mpi::ffi::RSMPI_STATUS_IGNORE) };
            flag != 0
        });
        if done && !self.requests.is_empty() {
            self.requests.clear();
            self.buffers.clear();
            let stamps = std::mem::take(&mut self.stamps);
            let latest = stamps.iter().map(|s| s.double_value(&[0]));
            self.arrives = latest.fold(None, |a, t| Some(a.map_or(t, |a: f64| a.max(t))));
        }
        done && self.arrives.is_none_or(|at| monotonic_s() >= at)
    }

    pub(super) fn wait(&mut self) {
        if !self.requests.is_empty() {
            let _wait = waiting("hierarchical exchange", &self.group, None);
            poll_until(|| self.test());
        }
    }
}
