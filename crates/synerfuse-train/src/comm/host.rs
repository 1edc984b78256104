//! MPI communicators over tch tensors.

use super::pieces::piece_starts;
use super::progress;
use super::watchdog::{self, waiting};
use super::CommError;
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::environment::{Threading, Universe};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Root, Source};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// Largest element count handed to one MPI call (MPI counts are `int`).
pub(super) const MAX_ELEMENTS_PER_CALL: usize = 1 << 30;

/// The MPI environment of this process: initialised once, finalised on drop.
pub struct MpiRuntime {
    /// Stopped and joined before `universe` finalises MPI.
    progress: Option<progress::SendProgress>,
    /// `None` only while dropping: taken out so that `MPI_Finalize` (its drop) runs
    /// inside a registered wait.
    universe: Option<Universe>,
}

impl Drop for MpiRuntime {
    fn drop(&mut self) {
        self.progress.take();
        // MPI_Finalize waits for every rank: a peer that froze would hold this one here
        // for ever, so the watchdog bounds it like any other wait.
        let _finalizing =
            watchdog::waiting_on("MPI_Finalize", "the world", std::time::Duration::ZERO);
        drop(self.universe.take());
    }
}

impl MpiRuntime {
    /// Initialises MPI. The thread that calls this makes the MPI calls; a helper thread
    /// only drives MPI's progress while a send is in flight (`comm::progress`), where MPI
    /// supports threads (`MULTIPLE`); libtorch's own worker threads never communicate.
    ///
    /// A panic on this rank then aborts the whole job: unwinding would otherwise run
    /// `MPI_Finalize`, which waits for ranks that are themselves waiting for this one.
    pub fn init() -> Result<Self, CommError> {
        let (universe, provided) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or(CommError::AlreadyInitialized)?;
        let progress = (provided == Threading::Multiple).then(progress::SendProgress::start);
        watchdog::start_for_rank(universe.world().rank() as usize);
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            report(info);
            if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
                // SAFETY: MPI is initialised and not finalised; MPI_Abort does not return.
                unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101) };
            }
        }));
        Ok(Self {
            progress,
            universe: Some(universe),
        })
    }

    /// All ranks of the job.
    pub fn world(&self) -> MpiCommunicator {
        let universe = (self.universe.as_ref()).expect("MPI is finalised only on drop");
        let world = universe.world();
        let name = format!("the world ({} ranks)", world.size());
        MpiCommunicator::new(world).with_name(name)
    }

    /// The MPI library's own version line (for `synerfuse env` and logs), without the C
    /// string's terminator (Open MPI counts it in the length it reports).
    pub fn library_version() -> String {
        mpi::environment::library_version()
            .map(|v| v.trim_end_matches('\0').to_owned())
            .unwrap_or_else(|_| "unknown MPI library".to_owned())
    }
}

/// How long a collective is polled in a tight loop before its waiter starts sleeping.
const SPIN_BEFORE_SLEEP: std::time::Duration = std::time::Duration::from_millis(1);
/// The sleep between progress calls of a long wait.
const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_micros(100);

/// Polls `done` until it returns true: a tight loop for the first millisecond, then
/// with sleeps between calls, so a rank waiting for a slower one leaves its core to
/// ranks that still compute.
pub(super) fn poll_until(mut done: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        watchdog::abort_if_expired();
        if started.elapsed() > SPIN_BEFORE_SLEEP {
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

/// Waits for a raw MPI request, politely (see [`poll_until`]).
fn wait_raw(request: &mut mpi::ffi::MPI_Request) {
    poll_until(|| {
        let mut flag = 0;
        // SAFETY: a live request from a non-blocking MPI call; MPI_Test frees it (and
        // sets it to MPI_REQUEST_NULL) once complete, after which testing is a no-op.
        unsafe { mpi::ffi::MPI_Test(request, &mut flag, mpi::ffi::RSMPI_STATUS_IGNORE) };
        flag != 0
    });
}

/// A non-blocking send in flight; owns the host copy being sent.
pub struct PendingSend {
    request: Option<mpi::ffi::MPI_Request>,
    _buffer: Tensor,
    group: Arc<str>,
    dest: usize,
}

impl PendingSend {
    /// Waits until the message has left this rank's buffer.
    pub fn wait(mut self) {
        self.complete();
    }

    fn complete(&mut self) {
        if let Some(mut request) = self.request.take() {
            let _wait = waiting("send", &self.group, Some(self.dest));
            wait_raw(&mut request);
            progress::send_ended();
        }
    }
}

impl Drop for PendingSend {
    fn drop(&mut self) {
        self.complete();
    }
}

/// Rounds of a reduce-scatter whose pieces have `counts` elements, each round at most
/// `max_per_call` elements in all: per round, per rank, (offset in its piece, count).
/// Each piece is cut in `rounds` nearly equal parts, so a round carries at most
/// `⌈count/rounds⌉` of each piece.
fn scatter_rounds(counts: &[usize], max_per_call: usize) -> Vec<Vec<(usize, usize)>> {
    let numel: usize = counts.iter().sum();
    let room = max_per_call.saturating_sub(counts.len()).max(1);
    let rounds = numel.div_ceil(room).max(1);
    (0..rounds)
        .map(|k| {
            (counts.iter())
                .map(|&c| (k * c / rounds, (k + 1) * c / rounds - k * c / rounds))
                .collect()
        })
        .collect()
}

/// A non-blocking collective in flight: a sum from [`MpiCommunicator::start_all_reduce_sum`] or
/// [`MpiCommunicator::start_reduce_scatter_sum`], or a gather from
/// [`MpiCommunicator::start_all_gather_in_place`].
pub struct PendingAllReduce {
    requests: Vec<mpi::ffi::MPI_Request>,
    _send: Tensor,
    _recv: Tensor,
    /// (host result, the caller's device tensor) when the result must be copied back.
    copy_back: Option<(Tensor, Tensor)>,
    /// Counts (and a gather's displacements) that MPI reads until it completes.
    _counts: Vec<i32>,
    group: Arc<str>,
    /// The collective, for timeout messages.
    op: &'static str,
    /// Keeps MPI progressing it while it is in flight (none once complete).
    in_flight: Option<super::progress::InFlight>,
}

impl PendingAllReduce {
    /// Lets MPI progress the reduction; whether it has completed. MPI moves non-blocking
    /// collectives forward only inside MPI calls, so a rank calls this between pieces of
    /// computation.
    pub fn test(&mut self) -> bool {
        let done = self.requests.iter_mut().all(|request| {
            let mut flag = 0;
            // SAFETY: a request from MPI_Iallreduce (or MPI_REQUEST_NULL once complete,
            // for which MPI_Test reports completion).
            unsafe { mpi::ffi::MPI_Test(request, &mut flag, mpi::ffi::RSMPI_STATUS_IGNORE) };
            flag != 0
        });
        if done {
            self.in_flight = None;
        }
        done
    }

    /// Waits for the sum and writes it into the caller's tensor.
    pub fn wait(mut self) {
        {
            let _wait = waiting(self.op, &self.group, None);
            poll_until(|| self.test());
        }
        self.requests.clear();
        if let Some((host, mut target)) = self.copy_back.take() {
            tch::no_grad(|| target.copy_(&host));
        }
    }
}

impl Drop for PendingAllReduce {
    fn drop(&mut self) {
        // The buffers must outlive the requests, even on an error path.
        if !self.requests.is_empty() {
            let _wait = waiting(self.op, &self.group, None);
            poll_until(|| self.test());
        }
    }
}

/// The MPI datatype that carries elements of `kind` (the one `recv` probes with).
fn mpi_datatype(kind: Kind) -> Option<mpi::ffi::MPI_Datatype> {
    // SAFETY: reading MPI's predefined datatype handles.
    unsafe {
        Some(match kind {
            Kind::Float => mpi::ffi::RSMPI_FLOAT,
            Kind::Double => mpi::ffi::RSMPI_DOUBLE,
            Kind::Int64 => mpi::ffi::RSMPI_INT64_T,
            Kind::Int => mpi::ffi::RSMPI_INT32_T,
            Kind::Int16 => mpi::ffi::RSMPI_INT16_T,
            Kind::Int8 => mpi::ffi::RSMPI_INT8_T,
            Kind::Uint8 | Kind::Bool => mpi::ffi::RSMPI_UINT8_T,
            Kind::Half | Kind::BFloat16 => mpi::ffi::RSMPI_UINT16_T,
            _ => return None,
        })
    }
}

/// A group of ranks that exchanges tch tensors over MPI.
///
/// Tensors on any device and of any layout are accepted: they are staged through a
/// contiguous host copy, and results are written back into the caller's tensor.
pub struct MpiCommunicator {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// What timeout messages call this group.
    name: Arc<str>,
}

/// Runs `$body` with `$T` bound to the Rust element type that carries `$kind`, or
/// returns `UnsupportedDtype`. Half-precision kinds are carried as raw `u16` bits,
/// which is exact for transfers but meaningless for arithmetic.
macro_rules! with_element_type {
    ($kind:expr, $rank:expr, $op:expr, $T:ident => $body:expr) => {
        match $kind {
            Kind::Float => {
                type $T = f32;
                $body
            }
            Kind::Double => {
                type $T = f64;
                $body
            }
            Kind::Int => {
                type $T = i32;
                $body
            }
            Kind::Int64 => {
                type $T = i64;
                $body
            }
            Kind::Int16 => {
                type $T = i16;
                $body
            }
            Kind::Int8 => {
                type $T = i8;
                $body
            }
            Kind::Uint8 | Kind::Bool => {
                type $T = u8;
                $body
            }
            Kind::Half | Kind::BFloat16 => {
                type $T = u16;
                $body
            }
            kind => {
                return Err(CommError::UnsupportedDtype {
                    rank: $rank,
                    op: $op,
                    kind,
                })
            }
        }
    };
}

/// The dtype and row shape of an all-to-all's `parts`: one per rank, alike but for
/// their row counts.
pub(crate) fn check_parts(
    rank: usize,
    size: usize,
    parts: &[Tensor],
    op: &'static str,
) -> Result<(Kind, Vec<i64>), CommError> {
    let shape = |problem: String| CommError::Shape { rank, op, problem };
    let first = parts
        .first()
        .filter(|_| parts.len() == size)
        .ok_or_else(|| shape(format!("{} parts for {size} ranks", parts.len())))?;
    let row = first.size().get(1..).unwrap_or_default().to_vec();
    match (parts.iter()).find(|p| p.kind() != first.kind() || p.size().get(1..) != Some(&row[..])) {
        Some(p) => Err(shape(format!(
            "parts of rows {row:?} {:?} and {:?} {:?}",
            first.kind(),
            p.size(),
            p.kind()
        ))),
        None => Ok((first.kind(), row)),
    }
}

/// A contiguous CPU tensor that shares storage with the caller's tensor when it can,
/// and is copied back into it otherwise.
struct HostStaging<'a> {
    target: &'a mut Tensor,
    host: Tensor,
    shared: bool,
}

impl<'a> HostStaging<'a> {
    fn new(target: &'a mut Tensor, kind: Kind) -> Self {
        let shared =
            target.device() == Device::Cpu && target.is_contiguous() && target.kind() == kind;
        let host = if shared {
            target.shallow_clone()
        } else {
            tch::no_grad(|| target.to_device(Device::Cpu).to_kind(kind).contiguous())
        };
        Self {
            target,
            host,
            shared,
        }
    }

    /// Like [`Self::new`] for a 1-D `target` whose values matter only in `piece` (the
    /// rest is about to be received): a host buffer of its dtype that holds only that
    /// piece, rather than a copy of the whole tensor.
    fn for_piece(target: &'a mut Tensor, piece: std::ops::Range<usize>) -> Self {
        let kind = target.kind();
        if target.device() == Device::Cpu && target.is_contiguous() {
            return Self::new(target, kind);
        }
        let host = Tensor::empty([target.numel() as i64], (kind, Device::Cpu));
        let (start, length) = (piece.start as i64, piece.len() as i64);
        tch::no_grad(|| {
            (host.narrow(0, start, length)).copy_(&target.narrow(0, start, length));
        });
        Self {
            target,
            host,
            shared: false,
        }
    }

    /// The host elements; `T` must have the size of an element of the staged kind.
    fn elements<T>(&mut self) -> &mut [T] {
        let len = self.host.numel();
        if len == 0 {
            return &mut [];
        }
        debug_assert_eq!(
            self.host.kind().elt_size_in_bytes(),
            std::mem::size_of::<T>()
        );
        // SAFETY: `host` is a contiguous CPU tensor of `len` elements of `T`'s size that
        // lives as long as `self`, and nothing else accesses it while the slice exists.
        unsafe { std::slice::from_raw_parts_mut(self.host.data_ptr() as *mut T, len) }
    }

    /// Writes the staged values back when the caller's tensor is not the host buffer.
    fn finish(self) {
        if !self.shared {
            let back = self
                .host
                .to_device(self.target.device())
                .to_kind(self.target.kind());
            tch::no_grad(|| self.target.copy_(&back));
        }
    }
}

impl MpiCommunicator {
    fn new(comm: SimpleCommunicator) -> Self {
        let rank = comm.rank() as usize;
        let size = comm.size() as usize;
        let name = Arc::from(format!("a group of {size} ranks"));
        Self {
            comm,
            rank,
            size,
            name,
        }
    }

    /// Names the group in timeout messages (e.g. "the dp group [0, 2]").
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Arc::from(name.into());
        self
    }

    /// The group's name, shared with what waits on it.
    pub(super) fn shared_name(&self) -> Arc<str> {
        Arc::clone(&self.name)
    }

    /// The group's name in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This process's rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The underlying MPI communicator, for splitting into groups.
    pub fn raw(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// Waits until every rank of the communicator has arrived.
    pub fn barrier(&self) {
        use mpi::collective::CommunicatorCollectives;
        // Blocking (MPI spins): ranks leave together, which the profiler's timings rely
        // on. The watchdog still bounds the wait.
        let _wait = waiting("barrier", &self.name, None);
        self.comm.barrier();
    }

    /// Ends every rank of the job; for fatal errors that other ranks cannot see.
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }

    /// Replaces `tensor` on every rank with the element-wise sum over all ranks.
    ///
    /// Half-precision tensors are summed in fp32 and rounded once at the end.
    pub fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<(), CommError> {
        let kind = match tensor.kind() {
            Kind::Half | Kind::BFloat16 => Kind::Float,
            Kind::Bool => {
                return Err(CommError::UnsupportedDtype {
                    rank: self.rank,
                    op: "all_reduce_sum",
                    kind: Kind::Bool,
                })
            }
            kind => kind,
        };
        let mut staging = HostStaging::new(tensor, kind);
        let _wait = waiting("all_reduce_sum", &self.name, None);
        with_element_type!(kind, self.rank, "all_reduce_sum", T => {
            for chunk in staging.elements::<T>().chunks_mut(MAX_ELEMENTS_PER_CALL) {
                self.all_reduce_chunk(chunk);
            }
        });
        staging.finish();
        Ok(())
    }

    /// One all-reduce, waited on without busy-spinning once it has taken a while: a rank
    /// that waits for slower ones (heterogeneous data parallelism) then sleeps between
    /// progress calls instead of taking a core from ranks that still compute.
    fn all_reduce_chunk<T: Equivalence + Copy>(&self, chunk: &mut [T]) {
        use mpi::collective::CommunicatorCollectives;
        let send = chunk.to_vec();
        mpi::request::scope(|scope| {
            let request = self.comm.immediate_all_reduce_into(
                scope,
                &send[..],
                chunk,
                SystemOperation::sum(),
            );
            let mut request = Some(request);
            poll_until(|| match request.take().map(|r| r.test()) {
                Some(Err(pending)) => {
                    request = Some(pending);
                    false
                }
                _ => true,
            });
        });
    }

    /// Starts summing the fp32 `tensor` over the group and returns at once; the sum lands
    /// in `tensor` when [`PendingAllReduce::wait`] returns. Until then the caller must not
    /// touch `tensor`. A CUDA tensor is staged through pinned host memory.
    pub fn start_all_reduce_sum(&self, tensor: &Tensor) -> Result<PendingAllReduce, CommError> {
        use mpi::raw::AsRaw;
        if tensor.kind() != Kind::Float {
            return Err(CommError::UnsupportedDtype {
                rank: self.rank,
                op: "start_all_reduce_sum",
                kind: tensor.kind(),
            });
        }
        let on_host = tensor.device() == Device::Cpu && tensor.is_contiguous();
        let send = tch::no_grad(|| {
            let host = tensor.detach().to_device(Device::Cpu).contiguous();
            if on_host {
                host.copy()
            } else {
                host
            }
        });
        let recv = if on_host {
            tensor.shallow_clone()
        } else {
            let pinned = Tensor::empty_like(&send);
            if matches!(tensor.device(), Device::Cuda(_)) {
                pinned.pin_memory(tensor.device())
            } else {
                pinned
            }
        };
        let numel = send.numel();
        let mut requests = Vec::new();
        let mut offset = 0;
        while offset < numel {
            let count = (numel - offset).min(MAX_ELEMENTS_PER_CALL);
            let mut request = std::mem::MaybeUninit::uninit();
            // SAFETY: `send` and `recv` are contiguous fp32 CPU tensors of `numel` elements
            // that PendingAllReduce keeps alive until every request has completed.
            unsafe {
                let from = (send.data_ptr() as *const f32).add(offset);
                let into = (recv.data_ptr() as *mut f32).add(offset);
                mpi::ffi::MPI_Iallreduce(
                    from.cast(),
                    into.cast(),
                    count as i32,
                    mpi::ffi::RSMPI_FLOAT,
                    mpi::ffi::RSMPI_SUM,
                    self.comm.as_raw(),
                    request.as_mut_ptr(),
                );
                requests.push(request.assume_init());
            }
            offset += count;
        }
        Ok(PendingAllReduce {
            requests,
            _send: send,
            copy_back: (!on_host).then(|| (recv.shallow_clone(), tensor.shallow_clone())),
            _recv: recv,
            _counts: Vec::new(),
            group: Arc::clone(&self.name),
            op: "all_reduce_sum",
            in_flight: Some(super::progress::InFlight::start()),
        })
    }

    /// Starts summing the fp32 1-D `tensor` over the group and returns at once; rank `r`
    /// gets its piece of the sum, elements `counts[..r].sum()..` of length `counts[r]`,
    /// in that piece of `tensor` when [`PendingAllReduce::wait`] returns (the rest of
    /// `tensor` is left as it was). The caller leaves `tensor` alone until then.
    pub fn start_reduce_scatter_sum(
        &self,
        tensor: &Tensor,
        counts: &[usize],
    ) -> Result<PendingAllReduce, CommError> {
        self.start_reduce_scatter_sum_in_rounds(tensor, counts, MAX_ELEMENTS_PER_CALL)
    }

    /// [`Self::start_reduce_scatter_sum`] in rounds of at most `max_per_call` elements
    /// (MPI counts are `int`): round `k` reduces the `k`-th part of every rank's piece, so
    /// each round's send buffer is those parts laid end to end and its receive buffer a
    /// contiguous part of this rank's piece. Public for the tests of the rounds.
    #[doc(hidden)]
    pub fn start_reduce_scatter_sum_in_rounds(
        &self,
        tensor: &Tensor,
        counts: &[usize],
        max_per_call: usize,
    ) -> Result<PendingAllReduce, CommError> {
        use mpi::raw::AsRaw;
        let numel = tensor.numel();
        if tensor.kind() != Kind::Float {
            return Err(CommError::UnsupportedDtype {
                rank: self.rank,
                op: "start_reduce_scatter_sum",
                kind: tensor.kind(),
            });
        }
        let op = "start_reduce_scatter_sum";
        let starts = piece_starts(self.rank, self.size, counts, numel, op)?;
        let rounds = scatter_rounds(counts, max_per_call);
        let own = tensor.narrow(0, starts[self.rank] as i64, counts[self.rank] as i64);
        let on_host = tensor.device() == Device::Cpu && own.is_contiguous();
        let host = tch::no_grad(|| tensor.detach().to_device(Device::Cpu));
        // Every round's parts, round after round: one buffer MPI reads from.
        let parts: Vec<Tensor> = (rounds.iter())
            .flat_map(|round| round.iter().zip(&starts))
            .map(|(&(offset, count), &start)| host.narrow(0, (start + offset) as i64, count as i64))
            .collect();
        let send = tch::no_grad(|| Tensor::cat(&parts, 0).contiguous());
        let recv = match on_host {
            true => own.shallow_clone(),
            false => {
                let pinned = Tensor::empty([counts[self.rank] as i64], (Kind::Float, Device::Cpu));
                if matches!(tensor.device(), Device::Cuda(_)) {
                    pinned.pin_memory(tensor.device())
                } else {
                    pinned
                }
            }
        };
        let round_counts: Vec<i32> = (rounds.iter().flatten()).map(|&(_, c)| c as i32).collect();
        let mut requests = Vec::with_capacity(rounds.len());
        let mut sent = 0;
        for (k, round) in rounds.iter().enumerate() {
            let offset = round[self.rank].0;
            let mut request = std::mem::MaybeUninit::uninit();
            // SAFETY: `send` holds every round's parts (this round's at `sent`), `recv`
            // this rank's piece (this round's part at `offset`), and `round_counts` one
            // entry per rank per round; PendingAllReduce keeps the three alive until the
            // requests have completed.
            unsafe {
                mpi::ffi::MPI_Ireduce_scatter(
                    (send.data_ptr() as *const f32).add(sent) as *const std::ffi::c_void,
                    (recv.data_ptr() as *mut f32).add(offset) as *mut std::ffi::c_void,
                    round_counts.as_ptr().add(k * self.size),
                    mpi::ffi::RSMPI_FLOAT,
                    mpi::ffi::RSMPI_SUM,
                    self.comm.as_raw(),
                    request.as_mut_ptr(),
                );
                requests.push(request.assume_init());
            }
            sent += round.iter().map(|&(_, c)| c).sum::<usize>();
        }
        Ok(PendingAllReduce {
            requests,
            _send: send,
            copy_back: (!on_host).then(|| (recv.shallow_clone(), own)),
            _recv: recv,
            _counts: round_counts,
            group: Arc::clone(&self.name),
            op: "reduce_scatter_sum",
            in_flight: Some(super::progress::InFlight::start()),
        })
    }

    /// Copies `tensor` of rank `root` into `tensor` of every other rank (same shape and dtype).
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, root)?;
        let mut staging = HostStaging::new(tensor, tensor.kind());
        let _wait = waiting("broadcast", &self.name, Some(root));
        let root = self.comm.process_at_rank(root as i32);
        with_element_type!(staging.host.kind(), self.rank, "broadcast", T => {
            for chunk in staging.elements::<T>().chunks_mut(MAX_ELEMENTS_PER_CALL) {
                root.broadcast_into(chunk);
            }
        });
        staging.finish();
        Ok(())
    }

    /// Copies every member's piece of the 1-D `tensor` (any dtype, bf16 as raw bits) to
    /// every member, in place: member `m`'s piece is the `counts[m]` elements after
    /// `counts[..m]`, and only this rank's own piece of its tensor is read. One
    /// `Allgatherv` through host memory (the tensor itself when it is a contiguous CPU
    /// tensor; otherwise only its own piece goes to the host, and the whole comes back),
    /// sent from a copy of this rank's piece: MPI may not read and write overlapping
    /// buffers in one call, and the bindings do not expose `MPI_IN_PLACE`.
    pub fn all_gather_in_place(
        &self,
        tensor: &mut Tensor,
        counts: &[usize],
    ) -> Result<(), CommError> {
        self.all_gather_in_place_in_rounds(tensor, counts, MAX_ELEMENTS_PER_CALL)
    }

    /// Starts [`Self::all_gather_in_place`] and returns at once: every member's piece is
    /// in `tensor` when [`PendingAllReduce::wait`] returns, and the caller leaves `tensor`
    /// alone until then. One `MPI_Iallgatherv` through host memory (the tensor itself when
    /// it is a contiguous CPU tensor), sent from a copy of this rank's piece; a tensor
    /// beyond MPI's `int` counts is gathered before this returns (its rounds are calls
    /// of their own).
    pub fn start_all_gather_in_place(
        &self,
        tensor: &Tensor,
        counts: &[usize],
    ) -> Result<PendingAllReduce, CommError> {
        use mpi::raw::AsRaw;
        let op = "start_all_gather_in_place";
        let starts = self.gather_starts(tensor, counts, op)?;
        let (kind, rank) = (tensor.kind(), self.rank);
        let datatype = mpi_datatype(kind).ok_or(CommError::UnsupportedDtype { rank, op, kind })?;
        let mut pending = PendingAllReduce {
            requests: Vec::new(),
            _send: Tensor::new(),
            copy_back: None,
            _recv: Tensor::new(),
            _counts: Vec::new(),
            group: Arc::clone(&self.name),
            op: "all_gather_in_place",
            in_flight: None,
        };
        if tensor.numel() > MAX_ELEMENTS_PER_CALL {
            self.all_gather_in_place(&mut tensor.shallow_clone(), counts)?;
            return Ok(pending);
        }
        let own = tensor.narrow(0, starts[rank] as i64, counts[rank] as i64);
        // A copy: MPI may not read and write overlapping buffers in one call.
        let send = tch::no_grad(|| own.detach().to_device(Device::Cpu).contiguous().copy());
        let on_host = tensor.device() == Device::Cpu && tensor.is_contiguous();
        let recv = match (on_host, tensor.device()) {
            (true, _) => tensor.shallow_clone(),
            (false, Device::Cuda(_)) => Tensor::empty([tensor.numel() as i64], (kind, Device::Cpu))
                .pin_memory(tensor.device()),
            (false, _) => Tensor::empty([tensor.numel() as i64], (kind, Device::Cpu)),
        };
        // Counts, then displacements: MPI reads both until the gather completes.
        let sizes: Vec<i32> = (counts.iter().chain(&starts)).map(|&c| c as i32).collect();
        let mut request = std::mem::MaybeUninit::uninit();
        // SAFETY: `send` holds this rank's `counts[rank]` elements and `recv` the whole
        // tensor's, both contiguous CPU tensors of one `datatype`-sized element kind;
        // `sizes` holds `size` counts then `size` displacements within `recv`
        // (piece_starts checked they cover it); PendingAllReduce keeps all three alive
        // until the request has completed.
        unsafe {
            mpi::ffi::MPI_Iallgatherv(
                send.data_ptr(),
                counts[rank] as i32,
                datatype,
                recv.data_ptr(),
                sizes.as_ptr(),
                sizes.as_ptr().add(self.size),
                datatype,
                self.comm.as_raw(),
                request.as_mut_ptr(),
            );
            pending.requests.push(request.assume_init());
        }
        pending.copy_back = (!on_host).then(|| (recv.shallow_clone(), tensor.shallow_clone()));
        (pending._send, pending._recv, pending._counts) = (send, recv, sizes);
        pending.in_flight = Some(super::progress::InFlight::start());
        Ok(pending)
    }

    /// [`Self::all_gather_in_place`], where a tensor of more than `max_per_call` elements
    /// (MPI's counts and displacements are `int`) takes one broadcast per piece instead,
    /// in chunks of at most `max_per_call` elements. Public for the tests of the rounds.
    #[doc(hidden)]
    pub fn all_gather_in_place_in_rounds(
        &self,
        tensor: &mut Tensor,
        counts: &[usize],
        max_per_call: usize,
    ) -> Result<(), CommError> {
        let op = "all_gather_in_place";
        let starts = self.gather_starts(tensor, counts, op)?;
        let kind = tensor.kind();
        let own = starts[self.rank]..starts[self.rank] + counts[self.rank];
        let mut staging = HostStaging::for_piece(tensor, own);
        let _wait = waiting(op, &self.name, None);
        with_element_type!(kind, self.rank, op, T => {
            let elements = staging.elements::<T>();
            if elements.len() <= max_per_call.max(1) {
                self.all_gather_pieces(elements, counts, &starts);
            } else {
                let pieces = starts.iter().zip(counts).enumerate();
                for (root, (&start, &count)) in pieces {
                    let root = self.comm.process_at_rank(root as i32);
                    for chunk in elements[start..start + count].chunks_mut(max_per_call.max(1)) {
                        root.broadcast_into(chunk);
                    }
                }
            }
        });
        staging.finish();
        Ok(())
    }

    /// Where each member's piece of the 1-D `tensor` starts, for a gather of pieces of
    /// `counts` elements (refused, naming `op`, when they do not cover it).
    fn gather_starts(
        &self,
        tensor: &Tensor,
        counts: &[usize],
        op: &'static str,
    ) -> Result<Vec<usize>, CommError> {
        if tensor.dim() != 1 {
            return Err(CommError::Shape {
                rank: self.rank,
                op,
                problem: format!("a tensor of shape {:?} is not 1-D", tensor.size()),
            });
        }
        piece_starts(self.rank, self.size, counts, tensor.numel(), op)
    }

    /// One `Allgatherv` of the pieces (`counts`, from `starts`) of `elements`, which hold
    /// at most `i32::MAX` elements.
    fn all_gather_pieces<T: Equivalence + Copy>(
        &self,
        elements: &mut [T],
        counts: &[usize],
        starts: &[usize],
    ) {
        use mpi::collective::CommunicatorCollectives;
        use mpi::datatype::PartitionMut;
        let own = elements[starts[self.rank]..][..counts[self.rank]].to_vec();
        let counts: Vec<i32> = counts.iter().map(|&c| c as i32).collect();
        let displs: Vec<i32> = starts.iter().map(|&s| s as i32).collect();
        let mut pieces = PartitionMut::new(elements, &counts[..], &displs[..]);
        self.comm.all_gather_varcount_into(&own[..], &mut pieces);
    }

    /// The sub-communicator of the ranks that pass the same `color` (`None`: this rank
    /// joins none and gets `None`), ordered by `key`. Collective over this communicator.
    pub fn split(&self, color: Option<u32>, key: usize) -> Option<MpiCommunicator> {
        use mpi::topology::Color;
        let color = match color {
            Some(c) => Color::with_value(c as i32),
            None => Color::undefined(),
        };
        let _wait = waiting("communicator split", &self.name, None);
        self.comm
            .split_by_color_with_key(color, key as i32)
            .map(MpiCommunicator::new)
    }

    /// Every rank's `tensor` (same shape and dtype everywhere) concatenated along a new
    /// leading dimension in rank order: `[size, ...shape]`, on `tensor`'s device.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        self.all_gather_in_rounds(tensor, MAX_ELEMENTS_PER_CALL)
    }

    /// [`Self::all_gather`] in rounds of at most `max_per_call` elements received (MPI
    /// counts are `int`): round `k` gathers the `k`-th part of every rank's tensor.
    /// Public for the tests of the rounds.
    #[doc(hidden)]
    pub fn all_gather_in_rounds(
        &self,
        tensor: &Tensor,
        max_per_call: usize,
    ) -> Result<Tensor, CommError> {
        use mpi::collective::CommunicatorCollectives;
        let mut source = tensor.shallow_clone();
        let staging = HostStaging::new(&mut source, tensor.kind());
        let mut shape = vec![self.size as i64];
        shape.extend(tensor.size());
        let out = Tensor::empty(shape.as_slice(), (tensor.kind(), Device::Cpu));
        let numel = staging.host.numel();
        let per_round = (max_per_call / self.size).max(1);
        let flat_out = out.view([self.size as i64, numel as i64]);
        let _wait = waiting("all_gather", &self.name, None);
        with_element_type!(tensor.kind(), self.rank, "all_gather", T => {
            // SAFETY: a contiguous CPU tensor of `numel` `T`-sized elements.
            let send = unsafe { std::slice::from_raw_parts(staging.host.data_ptr() as *const T, numel) };
            for (k, part) in send.chunks(per_round).enumerate() {
                // One round gathers straight into `out`.
                let round = match part.len() == numel {
                    true => flat_out.shallow_clone(),
                    false => Tensor::empty([self.size as i64, part.len() as i64], (tensor.kind(), Device::Cpu)),
                };
                // SAFETY: `round` holds `part.len() * size` elements of `T`'s size.
                let recv = unsafe { std::slice::from_raw_parts_mut(round.data_ptr() as *mut T, part.len() * self.size) };
                self.comm.all_gather_into(part, recv);
                if part.len() != numel {
                    let at = (k * per_round) as i64;
                    tch::no_grad(|| flat_out.narrow(1, at, part.len() as i64).copy_(&round));
                }
            }
        });
        Ok(out.to_device(tensor.device()))
    }

    /// `parts[r]` to rank `r`: what each rank sent this one, in rank order (MPI's
    /// `Alltoallv` through host memory, the row counts exchanged first). Every part has
    /// any number of rows along the first dimension and the same row shape and dtype
    /// on every rank.
    pub fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CommError> {
        use mpi::collective::CommunicatorCollectives;
        use mpi::datatype::{Partition, PartitionMut};
        let op = "all_to_all";
        let (kind, row) = check_parts(self.rank, self.size, parts, op)?;
        let row_elements: i64 = row.iter().product();
        let mine: Vec<i64> = parts.iter().map(|p| p.size()[0]).collect();
        // Every rank's rows to every rank, so that all of them refuse an exchange too
        // large for MPI's `int` counts alike (none left waiting for the others).
        let mut matrix = vec![0i64; self.size * self.size];
        let _wait = waiting(op, &self.name, None);
        self.comm.all_gather_into(&mine[..], &mut matrix[..]);
        let n = self.size;
        let too_large = (0..n).find_map(|r| {
            let sent: i64 = matrix[r * n..(r + 1) * n].iter().sum();
            let received: i64 = (0..n).map(|src| matrix[src * n + r]).sum();
            let most = sent.max(received) * row_elements;
            (most > MAX_ELEMENTS_PER_CALL as i64).then_some(most)
        });
        if let Some(elements) = too_large {
            return Err(CommError::TooLarge {
                rank: self.rank,
                op,
                elements: elements as usize,
            });
        }
        let sent_rows: Vec<i64> = mine;
        let received_rows: Vec<i64> = (0..n).map(|src| matrix[src * n + self.rank]).collect();
        let elements = |rows: &[i64]| -> Result<(Vec<i32>, Vec<i32>), CommError> {
            let counts: Vec<i64> = rows.iter().map(|&r| r * row_elements).collect();
            let displs = (counts.iter())
                .scan(0i64, |at, &c| {
                    let d = *at;
                    *at += c;
                    Some(d as i32)
                })
                .collect();
            Ok((counts.into_iter().map(|c| c as i32).collect(), displs))
        };
        let (send_counts, send_displs) = elements(&sent_rows)?;
        let (recv_counts, recv_displs) = elements(&received_rows)?;
        let send = tch::no_grad(|| Tensor::cat(parts, 0).to_device(Device::Cpu).contiguous());
        let mut shape = vec![received_rows.iter().sum::<i64>()];
        shape.extend(&row);
        let out = Tensor::empty(shape.as_slice(), (kind, Device::Cpu));
        with_element_type!(kind, self.rank, op, T => {
            let send_slice: &[T] = match send.numel() {
                0 => &[],
                // SAFETY: a contiguous CPU tensor of `numel` `T`-sized elements, alive here.
                n => unsafe { std::slice::from_raw_parts(send.data_ptr() as *const T, n) },
            };
            let recv_slice: &mut [T] = match out.numel() {
                0 => &mut [],
                // SAFETY: `out` is a fresh contiguous CPU tensor of `numel` elements.
                n => unsafe { std::slice::from_raw_parts_mut(out.data_ptr() as *mut T, n) },
            };
            let partition = Partition::new(send_slice, &send_counts[..], &send_displs[..]);
            let mut received = PartitionMut::new(recv_slice, &recv_counts[..], &recv_displs[..]);
            self.comm.all_to_all_varcount_into(&partition, &mut received);
        });
        let device = parts[0].device();
        Ok((out.split_with_sizes(&received_rows, 0).into_iter())
            .map(|t| t.to_device(device))
            .collect())
    }

    /// The element-wise sum over ranks of `tensor`, scattered: rank r gets rows
    /// `[r·n/size, (r+1)·n/size)` of the leading dimension (`n` must divide by `size`).
    pub fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        use mpi::collective::CommunicatorCollectives;
        let rows = CommError::check_scatter_rows(self.rank, self.size, tensor)?;
        let kind = match tensor.kind() {
            Kind::Half | Kind::BFloat16 => Kind::Float,
            kind => kind,
        };
        let mut source = tensor.shallow_clone();
        let staging = HostStaging::new(&mut source, kind);
        let mut shape = tensor.size();
        shape[0] = rows / self.size as i64;
        let out = Tensor::empty(shape.as_slice(), (kind, Device::Cpu));
        let numel = staging.host.numel();
        if numel > MAX_ELEMENTS_PER_CALL {
            return Err(CommError::TooLarge {
                rank: self.rank,
                op: "reduce_scatter_sum",
                elements: numel,
            });
        }
        let _wait = waiting("reduce_scatter_sum", &self.name, None);
        with_element_type!(kind, self.rank, "reduce_scatter_sum", T => {
            if numel > 0 {
                // SAFETY: both are contiguous CPU tensors of `T`-sized elements.
                let send = unsafe { std::slice::from_raw_parts(staging.host.data_ptr() as *const T, numel) };
                // SAFETY: `out` holds `numel / size` elements of `T`'s size.
                let recv = unsafe { std::slice::from_raw_parts_mut(out.data_ptr() as *mut T, numel / self.size) };
                self.comm.reduce_scatter_block_into(send, recv, SystemOperation::sum());
            }
        });
        Ok(out.to_kind(tensor.kind()).to_device(tensor.device()))
    }

    /// Waits (politely) until a message from `source` with `tag` has arrived.
    fn poll_probe(&self, source: usize, tag: i32) -> mpi::point_to_point::Status {
        let process = self.comm.process_at_rank(source as i32);
        let mut status = None;
        poll_until(|| {
            status = process.immediate_probe_with_tag(tag);
            status.is_some()
        });
        status.expect("poll_until returns once probed")
    }

    /// Sends `tensor` to rank `dest`, which receives it with [`Self::recv`] and the same tag.
    pub fn send(&self, tensor: &Tensor, dest: usize, tag: i32) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, dest)?;
        let mut source = tensor.shallow_clone();
        let mut staging = HostStaging::new(&mut source, tensor.kind());
        let process = self.comm.process_at_rank(dest as i32);
        let _wait = waiting("send", &self.name, Some(dest));
        with_element_type!(staging.host.kind(), self.rank, "send", T => {
            let elements = staging.elements::<T>();
            if elements.is_empty() {
                process.send_with_tag(elements, tag);
            }
            for chunk in elements.chunks(MAX_ELEMENTS_PER_CALL) {
                process.send_with_tag(chunk, tag);
            }
        });
        Ok(())
    }

    /// Starts sending `tensor` to rank `dest` and returns at once; the transfer completes
    /// in the background and [`PendingSend::wait`] (or dropping it) waits for it. The
    /// receiver uses [`Self::recv`] with the same tag. Pipelines send this way so that
    /// two neighbours that send to each other at the same time never deadlock.
    pub fn isend(&self, tensor: &Tensor, dest: usize, tag: i32) -> Result<PendingSend, CommError> {
        use mpi::raw::AsRaw;
        CommError::check_peer(self.rank, self.size, dest)?;
        // A private host copy: the caller may reuse or free its tensor right away.
        let buffer = match tensor.device() {
            // Pinned, so the device-to-host copy is one DMA transfer.
            Device::Cuda(_) => {
                let mut pinned = Tensor::empty(tensor.size(), (tensor.kind(), Device::Cpu))
                    .pin_memory(tensor.device());
                tch::no_grad(|| pinned.copy_(tensor));
                pinned
            }
            _ => tensor.detach().contiguous().copy(),
        };
        let bytes = buffer.numel() * buffer.kind().elt_size_in_bytes();
        if bytes > i32::MAX as usize {
            return Err(CommError::TooLarge {
                rank: self.rank,
                op: "isend",
                elements: buffer.numel(),
            });
        }
        // The receiver probes for a count of elements of its own type; send with the
        // matching MPI type so counts agree.
        let datatype = mpi_datatype(buffer.kind()).ok_or(CommError::UnsupportedDtype {
            rank: self.rank,
            op: "isend",
            kind: buffer.kind(),
        })?;
        let mut request = std::mem::MaybeUninit::uninit();
        // SAFETY: the buffer stays alive (owned by PendingSend) until the request completes.
        unsafe {
            mpi::ffi::MPI_Isend(
                buffer.data_ptr(),
                buffer.numel() as i32,
                datatype,
                dest as i32,
                tag,
                self.comm.as_raw(),
                request.as_mut_ptr(),
            );
        }
        progress::send_started();
        Ok(PendingSend {
            // SAFETY: MPI_Isend wrote the request (errors abort: MPI_ERRORS_ARE_FATAL).
            request: Some(unsafe { request.assume_init() }),
            _buffer: buffer,
            group: Arc::clone(&self.name),
            dest,
        })
    }

    /// Receives into `tensor` what rank `source` sent with [`Self::send`] and the same tag.
    ///
    /// A message of another size is refused (before it is received) with
    /// [`CommError::SizeMismatch`], rather than truncated or overflowing.
    pub fn recv(&self, tensor: &mut Tensor, source: usize, tag: i32) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, source)?;
        let mut staging = HostStaging::new(tensor, tensor.kind());
        let process = self.comm.process_at_rank(source as i32);
        let _wait = waiting("recv", &self.name, Some(source));
        with_element_type!(staging.host.kind(), self.rank, "recv", T => {
            let elements = staging.elements::<T>();
            let expected = elements.len();
            let mut received = 0;
            let mut chunks = elements.chunks_mut(MAX_ELEMENTS_PER_CALL);
            loop {
                // Probe without matching: a refused message stays queued for a later
                // receive, and MPI's non-overtaking order makes the next receive from
                // this source and tag take exactly the probed message.
                let status = self.poll_probe(source, tag);
                let count = status.count(T::equivalent_datatype()).max(0) as usize;
                let Some(chunk) = chunks.next().filter(|c| c.len() == count).or_else(|| {
                    // An empty tensor travels as one empty message.
                    (expected == 0 && count == 0).then_some(&mut [][..])
                }) else {
                    return Err(CommError::SizeMismatch {
                        rank: self.rank,
                        source_rank: source,
                        tag,
                        expected,
                        got: received + count,
                    });
                };
                process.receive_into_with_tag(chunk, tag);
                received += count;
                if received == expected {
                    break;
                }
            }
        });
        staging.finish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process that runs [`mpi_checks_in_a_process_of_their_own`].
    const CHILD_ENV: &str = "SYNERFUSE_TEST_MPI_CHILD";

    /// MPI is initialised once per process, and its panic hook aborts the process: the
    /// MPI checks run in a child process of this test binary, alone, as a one-rank world
    /// (MPI's singleton start, no launcher). The child test is written for any number
    /// of ranks, so it also runs by hand under `mpirun -np N` (with `SYNERFUSE_TEST_MPI_CHILD=1`).
    #[test]
    fn one_rank_mpi_world_gathers_and_reduces_uneven_pieces() {
        let path = module_path!().split_once("::").map_or("", |(_, p)| p);
        let test = format!("{path}::mpi_checks_in_a_process_of_their_own");
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([test.as_str(), "--exact", "--ignored", "--nocapture"])
            .env(CHILD_ENV, "1")
            .output()
            .expect("running this test binary again");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
    }

    #[test]
    #[ignore = "run by one_rank_mpi_world_gathers_and_reduces_uneven_pieces in a process of its own"]
    fn mpi_checks_in_a_process_of_their_own() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        let runtime = MpiRuntime::init().expect("MPI init");
        let group = super::super::GroupCommunicator::mpi(runtime.world());
        let outcome = uneven_pieces(&runtime.world(), &group);
        drop(group);
        // Asserted once MPI is finalised: a panic before would abort the process.
        drop(runtime);
        outcome.unwrap();
    }

    /// Member `m`'s piece (`counts[m]` elements, none for member 1) holds its elements'
    /// indices on member `m`, -1 elsewhere; every transfer must give every member all
    /// the indices (exact in bf16), and a reduce-scatter each member its piece's sum.
    fn uneven_pieces(
        world: &MpiCommunicator,
        group: &super::super::GroupCommunicator,
    ) -> Result<(), String> {
        let (rank, n) = (world.rank(), world.size());
        let counts: Vec<usize> = (0..n).map(|m| if m == 1 { 0 } else { 2 * m + 3 }).collect();
        let numel: usize = counts.iter().sum();
        let (start, own) = (
            counts[..rank].iter().sum::<usize>() as i64,
            counts[rank] as i64,
        );
        let all = Tensor::arange(numel as i64, (Kind::Float, Device::Cpu));
        let mine = |kind: Kind, stride: i64| {
            let t = Tensor::full([numel as i64 * stride], -1.0, (kind, Device::Cpu));
            let t = t.slice(0, 0, None, stride);
            tch::no_grad(|| t.narrow(0, start, own).copy_(&all.narrow(0, start, own)));
            t
        };
        for (kind, stride, max_per_call) in [
            (Kind::Float, 1, MAX_ELEMENTS_PER_CALL),
            (Kind::BFloat16, 1, MAX_ELEMENTS_PER_CALL),
            (Kind::Int64, 1, MAX_ELEMENTS_PER_CALL),
            (Kind::BFloat16, 2, MAX_ELEMENTS_PER_CALL),
            (Kind::Float, 1, 2),
            (Kind::BFloat16, 2, 3),
        ] {
            let mut t = mine(kind, stride);
            world
                .all_gather_in_place_in_rounds(&mut t, &counts, max_per_call)
                .map_err(|e| e.to_string())?;
            if t.to_kind(Kind::Float) != all {
                return Err(format!("{kind:?} stride {stride} by {max_per_call}: {t:?}"));
            }
            let mut t = mine(kind, stride);
            group
                .all_gather_in_place(&mut t, &counts)
                .map_err(|e| e.to_string())?;
            if t.to_kind(Kind::Float) != all {
                return Err(format!("the group's {kind:?} stride {stride}: {t:?}"));
            }
        }
        // Member r contributes (r + 1) × the indices; the rest of its tensor stays.
        let t = &all * (rank + 1) as f64;
        let want = t.copy();
        let total = all.narrow(0, start, own) * (n * (n + 1) / 2) as f64;
        tch::no_grad(|| want.narrow(0, start, own).copy_(&total));
        group
            .start_reduce_scatter_sum(&t, &counts)
            .and_then(|pending| pending.wait())
            .map_err(|e| e.to_string())?;
        if t != want {
            return Err(format!("reduce-scatter gave {t:?}, not {want:?}"));
        }
        refusals(world, &counts)
    }

    /// Counts that do not cover the tensor one per member, and tensors that are not 1-D,
    /// are refused alike on every member, before any message.
    fn refusals(world: &MpiCommunicator, counts: &[usize]) -> Result<(), String> {
        let numel: usize = counts.iter().sum();
        let mut t = Tensor::zeros([numel as i64], (Kind::Float, Device::Cpu));
        let mut longer = counts.to_vec();
        longer.push(1);
        let mut more = counts.to_vec();
        more[0] += 1;
        for bad in [longer, more] {
            match world.all_gather_in_place(&mut t, &bad) {
                Err(CommError::ScatterCounts { .. }) => {}
                other => return Err(format!("counts {bad:?} gave {other:?}")),
            }
        }
        let mut square = Tensor::zeros([numel as i64, 1], (Kind::Float, Device::Cpu));
        match world.all_gather_in_place(&mut square, counts) {
            Err(CommError::Shape { .. }) => Ok(()),
            other => Err(format!("a 2-D tensor gave {other:?}")),
        }
    }
}
