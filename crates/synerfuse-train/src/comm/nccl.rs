//! NCCL communicators over CUDA tch tensors, through cudarc's run-time loaded bindings.

use super::nccl_handle::{error_string, CommHandle};
use super::nccl_lane::Lane;
use super::pieces::{piece_calls, piece_starts, PieceCall};
use super::watchdog::waiting;
use super::{CommError, MpiCommunicator};
use cudarc::driver::{CudaContext, CudaEvent, DriverError};
use cudarc::nccl::{result, sys};
use std::rc::Rc;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// A collective over the pieces of a flat buffer, one member's piece each.
#[derive(Debug, Clone, Copy)]
enum Pieces {
    /// Member `m`'s piece gets the sum over members on member `m`.
    ReduceSum,
    /// Member `m`'s piece goes from member `m` to every member.
    Gather,
}

impl Pieces {
    /// The NCCL function that carries out `call`.
    fn context(self, call: &PieceCall) -> &'static str {
        match (self, call) {
            (Pieces::ReduceSum, PieceCall::Equal { .. }) => "ncclReduceScatter",
            (Pieces::ReduceSum, PieceCall::Rooted { .. }) => "ncclReduce",
            (Pieces::Gather, PieceCall::Equal { .. }) => "ncclAllGather",
            (Pieces::Gather, PieceCall::Rooted { .. }) => "ncclBroadcast",
        }
    }
}

/// The dtype NCCL sums a tensor of `kind` in: fp32 for half-precision tensors, which
/// are widened into a temporary fp32 copy, summed, and rounded back once. MPI sums them
/// so (`MpiCommunicator::all_reduce_sum`); NCCL would sum bf16 in bf16, rounding at every
/// step of its ring or tree, so the result would depend on the transport, the number of
/// ranks and the algorithm NCCL picks. The cost, twice the bytes, falls on the small
/// tensor- and context-parallel activations only: gradient buckets are fp32 already.
pub(crate) fn summed_kind(kind: Kind) -> Kind {
    match kind {
        Kind::Half | Kind::BFloat16 => Kind::Float,
        kind => kind,
    }
}

/// The buffer NCCL sums `tensor` in, and the half-precision `tensor` to round the sum
/// back into when it was widened (`summed_kind`).
fn widened(tensor: &Tensor) -> (Tensor, Option<Tensor>) {
    match summed_kind(tensor.kind()) {
        kind if kind != tensor.kind() => (
            tch::no_grad(|| tensor.to_kind(kind).contiguous()),
            Some(tensor.shallow_clone()),
        ),
        _ => (tensor.shallow_clone(), None),
    }
}

/// One call of the first contact of a pair communicator ([`first_contact`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contact {
    /// `ncclSend` of one element to pair rank `to`.
    Send { to: usize },
    /// `ncclRecv` of one element from pair rank `from`.
    Recv { from: usize },
}

/// The calls, in one NCCL group, of pair rank `rank`'s first contact with its peer: a
/// send and a receive, the same pattern on both ranks.
///
/// NCCL connects point-to-point peers lazily, inside the `ncclGroupEnd` of the first
/// group that needs a connection, and leaves unequal first patterns undefined (NCCL
/// issues 1279 and 2130: hangs, truncated messages). Pipeline links defer sends into the
/// group of the next receive, so the first real group of a link could be [sends, recv]
/// on one rank and [recv] on the other. This exchange connects both directions while
/// both ranks are still creating the link, before any real traffic.
pub(crate) fn first_contact(rank: usize) -> [Contact; 2] {
    let peer = 1 - rank;
    [Contact::Send { to: peer }, Contact::Recv { from: peer }]
}

/// A group of CUDA ranks that exchanges tensors with NCCL.
///
/// libtorch enqueues its kernels on its own stream; NCCL runs on a stream of this
/// communicator's `Lane`, which waits on the GPU for libtorch's kernels before each
/// operation (`Lane::after_libtorch`); the host waits only for completion, polling
/// NCCL's errors (`Lane::wait`). Every NCCL call is bounded by the watchdog: calls
/// can block while NCCL connects peers lazily.
pub struct NcclCommunicator {
    handle: Rc<CommHandle>,
    lane: Rc<Lane>,
    rank: usize,
    size: usize,
    ordinal: usize,
    /// The group's name in errors and timeout messages.
    name: Arc<str>,
}

/// A reduction enqueued on an NCCL communicator's stream, from
/// [`NcclCommunicator::start_all_reduce_sum`] or
/// [`NcclCommunicator::start_reduce_scatter_sum`].
pub struct PendingNccl {
    lane: Rc<Lane>,
    handle: Rc<CommHandle>,
    /// Recorded on the stream just after the reduction.
    done: CudaEvent,
    /// The buffer NCCL reads and writes: kept alive until the stream is past it.
    buffer: Tensor,
    /// The tensor `buffer` stands for (a half-precision one it was widened from, or a
    /// non-contiguous one), which gets the result at the wait.
    narrow: Option<Tensor>,
    /// The NCCL call, for errors and timeout messages.
    op: &'static str,
    waited: bool,
}

impl PendingNccl {
    /// Waits until the reduction is complete (the only point where the host blocks),
    /// and rounds a widened sum back into the half-precision tensor.
    pub fn wait(mut self) -> Result<(), CommError> {
        self.synchronize()?;
        if let Some(mut narrow) = self.narrow.take() {
            tch::no_grad(|| narrow.copy_(&self.buffer));
        }
        Ok(())
    }

    /// Whether the reduction has completed, without waiting (NCCL's error, if any, as
    /// the wait would give it); the caller still calls [`Self::wait`].
    pub(crate) fn test(&self) -> Result<bool, CommError> {
        self.lane.poll(&self.done, self.op, &self.handle)
    }

    fn synchronize(&mut self) -> Result<(), CommError> {
        self.waited = true;
        self.lane.wait(&self.done, self.op, &self.handle)
    }
}

impl Drop for PendingNccl {
    fn drop(&mut self) {
        // NCCL may still write into the buffer: never hand its memory back before then.
        if !self.waited {
            let _ = self.synchronize();
        }
    }
}

/// Runs `body`'s NCCL calls on `comms` as one NCCL group, bounded by the watchdog as
/// `op` (`ncclGroupEnd` is where NCCL connects peers, and may block). When the body or
/// `ncclGroupEnd` fails, every communicator of the group is aborted: part of the group
/// may have been launched, and the peers' matching calls would never complete.
pub(crate) fn nccl_group<T>(
    comms: &[&NcclCommunicator],
    op: &'static str,
    body: impl FnOnce() -> Result<T, CommError>,
) -> Result<T, CommError> {
    let Some(first) = comms.first() else {
        return body();
    };
    let _wait = waiting(op, &first.name, None);
    result::group_start().map_err(|e| first.handle.failure("ncclGroupStart", e.0))?;
    let issued = body();
    let ended =
        (result::group_end().map(drop)).map_err(|e| first.handle.failure("ncclGroupEnd", e.0));
    let error = match (issued, ended) {
        (Ok(t), Ok(())) => return Ok(t),
        (Err(e), _) | (Ok(_), Err(e)) => e,
    };
    for comm in comms {
        comm.handle.abort();
    }
    Err(error)
}

impl NcclCommunicator {
    /// Runs this communicator's work on `other`'s stream from now on: collectives of
    /// several communicators on one stream run in the order they are issued, so ranks
    /// that issue them in one global order cannot deadlock on NCCL kernels that wait for
    /// each other across communicators. Waits on that stream then also watch this
    /// communicator's errors.
    pub(crate) fn share_stream_of(&mut self, other: &NcclCommunicator) {
        self.lane = Rc::clone(&other.lane);
        self.lane.join(&self.handle);
    }

    /// Whether NCCL and the CUDA driver library can be loaded in this process.
    pub fn available() -> bool {
        // SAFETY: these only try to dlopen the libraries.
        unsafe { cudarc::driver::sys::is_culib_present() && sys::is_culib_present() }
    }

    /// Creates the NCCL communicator for the ranks of `group`, each on its own GPU
    /// `ordinal`. Rank 0 of the group makes NCCL's unique id and broadcasts it over MPI.
    /// Collective: every rank of `group` must call it.
    pub fn new(group: &MpiCommunicator, ordinal: usize) -> Result<Self, CommError> {
        let rank = group.rank();
        if !Self::available() {
            return Err(CommError::NcclUnavailable);
        }
        let mut id = Tensor::from_slice(&Self::unique_id_bytes(rank, rank == 0)?);
        group.broadcast(&mut id, 0)?;
        Self::init(&id, rank, group.size(), ordinal, Arc::from(group.name()))
    }

    /// The two-rank communicator of a pipeline link between this rank and world rank
    /// `peer` (the lower world rank is its rank 0), connected both ways
    /// (`first_contact`). Only the two ranks call it, together.
    pub fn new_pair(
        world: &MpiCommunicator,
        peer: usize,
        ordinal: usize,
    ) -> Result<Self, CommError> {
        const ID_TAG: i32 = 32_767;
        if !Self::available() {
            return Err(CommError::NcclUnavailable);
        }
        let me = world.rank();
        let first = me < peer;
        let mut id = Tensor::from_slice(&Self::unique_id_bytes(me, first)?);
        if first {
            world.send(&id, peer, ID_TAG)?;
        } else {
            world.recv(&mut id, peer, ID_TAG)?;
        }
        let name = format!(
            "the pipeline link between ranks {} and {}",
            me.min(peer),
            me.max(peer)
        );
        let pair = Self::init(&id, usize::from(!first), 2, ordinal, Arc::from(name))?;
        pair.connect_pair()?;
        Ok(pair)
    }

    /// This pair communicator's [`first_contact`]: one element each way in one group,
    /// waited for, so that both directions are connected before any real transfer.
    fn connect_pair(&self) -> Result<(), CommError> {
        const OP: &str = "first contact (ncclSend/ncclRecv of one element)";
        let options = (Kind::Float, Device::Cuda(self.ordinal));
        let (outbox, inbox) = (Tensor::zeros([1], options), Tensor::zeros([1], options));
        self.after_libtorch()?;
        nccl_group(&[self], OP, || {
            first_contact(self.rank)
                .iter()
                .try_for_each(|contact| match *contact {
                    Contact::Send { to } => self.enqueue(&outbox, to, true),
                    Contact::Recv { from } => self.enqueue(&inbox, from, false),
                })
        })?;
        self.complete(OP)
    }

    /// A fresh NCCL unique id when `create`, zeros otherwise (to be overwritten).
    fn unique_id_bytes(rank: usize, create: bool) -> Result<[u8; 128], CommError> {
        let id = if create {
            result::get_uniqueid().map_err(|e| CommError::Cuda {
                rank,
                context: "ncclGetUniqueId",
                message: error_string(e.0),
            })?
        } else {
            sys::ncclUniqueId { internal: [0; 128] }
        };
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator of `size` ranks named by the unique id `id_bytes`.
    fn init(
        id_bytes: &Tensor,
        rank: usize,
        size: usize,
        ordinal: usize,
        name: Arc<str>,
    ) -> Result<Self, CommError> {
        let mut internal = [0 as std::ffi::c_char; 128];
        for (slot, byte) in internal
            .iter_mut()
            .zip(Vec::<u8>::try_from(id_bytes).unwrap_or_default())
        {
            *slot = byte as std::ffi::c_char;
        }
        let driver_err = |context: &'static str| {
            move |e: DriverError| CommError::Cuda {
                rank,
                context,
                message: format!("{e:?}"),
            }
        };
        // Binds the device's primary context (the one libtorch uses) to this thread, so
        // NCCL initialises on the right GPU.
        let context = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let lane = Lane::new(&context).map_err(driver_err("cuStreamCreate/cuEventCreate"))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        let _wait = waiting("ncclCommInitRank", &name, None);
        // SAFETY: `comm` is written by NCCL on success; the id is the group's shared id.
        let comm = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                size as i32,
                sys::ncclUniqueId { internal },
                rank as i32,
            )
            .map_err(|e| CommError::Cuda {
                rank,
                context: "ncclCommInitRank",
                message: error_string(e.0),
            })?;
            comm.assume_init()
        };
        let handle = Rc::new(CommHandle::new(comm, rank, Arc::clone(&name)));
        lane.join(&handle);
        Ok(Self {
            handle,
            lane: Rc::new(lane),
            rank,
            size,
            ordinal,
            name,
        })
    }

    /// This process's rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Replaces `tensor` on every rank with the element-wise sum over all ranks
    /// (half-precision tensors summed in fp32 and rounded once: `summed_kind`).
    pub fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<(), CommError> {
        if let (mut wide, Some(_)) = widened(tensor) {
            self.all_reduce_sum(&mut wide)?;
            tch::no_grad(|| tensor.copy_(&wide));
            return Ok(());
        }
        let dtype = self.nccl_type(tensor, "all_reduce_sum")?;
        // SAFETY: run_in_place hands the closure this communicator's live handle, a live,
        // contiguous buffer of `count` elements of `dtype` on its GPU, and its stream.
        self.run_in_place(tensor, "ncclAllReduce", |comm, ptr, count, stream| unsafe {
            result::all_reduce(
                ptr,
                ptr,
                count,
                dtype,
                sys::ncclRedOp_t::ncclSum,
                comm,
                stream,
            )
        })
    }

    /// Enqueues the sum of `tensor` over the group on this communicator's stream and
    /// returns at once; libtorch's later kernels overlap it. The caller must not touch
    /// `tensor` before [`PendingNccl::wait`] (which rounds a half-precision sum, made in
    /// fp32, back into it: `summed_kind`).
    pub fn start_all_reduce_sum(&self, tensor: &Tensor) -> Result<PendingNccl, CommError> {
        const OP: &str = "ncclAllReduce";
        self.nccl_type(tensor, "start_all_reduce_sum")?;
        if !tensor.is_contiguous() {
            return Err(CommError::Shape {
                rank: self.rank,
                op: "start_all_reduce_sum",
                problem: "the tensor must be contiguous".to_owned(),
            });
        }
        let (buffer, narrow) = widened(tensor);
        let dtype = self.nccl_type(&buffer, "start_all_reduce_sum")?;
        // NCCL's stream waits for the kernels that produced the gradients, on the GPU.
        self.after_libtorch()?;
        nccl_group(&[self], OP, || {
            // SAFETY: `buffer` is a contiguous CUDA tensor on this communicator's device of
            // `numel` elements of `dtype`; PendingNccl keeps it alive until the stream is
            // past the reduction; `comm` is this communicator's live handle.
            self.issue(OP, |comm, stream| unsafe {
                let ptr = buffer.data_ptr();
                let sum = sys::ncclRedOp_t::ncclSum;
                result::all_reduce(ptr, ptr, buffer.numel(), dtype, sum, comm, stream)
            })
        })?;
        self.pending(buffer, narrow, OP)
    }

    /// What waits for the collective `op` on `buffer`, just enqueued on this stream.
    fn pending(
        &self,
        buffer: Tensor,
        narrow: Option<Tensor>,
        op: &'static str,
    ) -> Result<PendingNccl, CommError> {
        let done = self.lane.mark().map_err(self.driver_err("cuEventRecord"))?;
        Ok(PendingNccl {
            lane: Rc::clone(&self.lane),
            handle: Rc::clone(&self.handle),
            done,
            buffer,
            narrow,
            op,
            waited: false,
        })
    }

    /// Enqueues summing the contiguous 1-D `tensor` over the group so that member `m`'s
    /// piece (the `counts[m]` elements after `counts[..m]`) holds its sum on member `m`,
    /// the rest of `tensor` left as it was (as [`MpiCommunicator::start_reduce_scatter_sum`]),
    /// and returns at once: one in-place `ncclReduceScatter` when the pieces are equal,
    /// otherwise one in-place `ncclReduce` per non-empty piece to its member, grouped
    /// (see `pieces::piece_calls` for why not a padded reduce-scatter). The
    /// caller must not touch `tensor` before [`PendingNccl::wait`]; half-precision
    /// tensors are summed in fp32 (`summed_kind`).
    pub fn start_reduce_scatter_sum(
        &self,
        tensor: &Tensor,
        counts: &[usize],
    ) -> Result<PendingNccl, CommError> {
        self.check_pieces(tensor, counts, "start_reduce_scatter_sum")?;
        let (buffer, narrow) = widened(tensor);
        let plan = self.check_pieces(&buffer, counts, "start_reduce_scatter_sum")?;
        // NCCL's stream waits for the kernels that produced the gradients, on the GPU.
        self.after_libtorch()?;
        self.enqueue_pieces(&buffer, plan, Pieces::ReduceSum)?;
        self.pending(buffer, narrow, "ncclReduceScatter")
    }

    /// Copies member `m`'s piece of the 1-D `tensor` (the `counts[m]` elements after
    /// `counts[..m]`) into every member's, in any dtype NCCL carries: one in-place
    /// `ncclAllGather` when the pieces are equal, otherwise one in-place `ncclBroadcast`
    /// per non-empty piece from its member, grouped. Returns once `tensor` is complete.
    pub fn all_gather_in_place(
        &self,
        tensor: &mut Tensor,
        counts: &[usize],
    ) -> Result<(), CommError> {
        self.start_all_gather_in_place(tensor, counts)?.wait()
    }

    /// Enqueues [`Self::all_gather_in_place`] on this communicator's stream and returns
    /// at once (the distributed optimizer's `--overlap-param-gather`): `tensor` is
    /// complete once [`PendingNccl::wait`] returns, and the caller leaves it alone until
    /// then. NCCL's stream first waits for libtorch's (which wrote this rank's piece).
    pub fn start_all_gather_in_place(
        &self,
        tensor: &Tensor,
        counts: &[usize],
    ) -> Result<PendingNccl, CommError> {
        let op = "start_all_gather_in_place";
        let contiguous = tensor.is_contiguous();
        let buffer = match contiguous {
            true => tensor.shallow_clone(),
            false => tensor.contiguous(),
        };
        let plan = self.check_pieces(&buffer, counts, op)?;
        self.after_libtorch()?;
        self.enqueue_pieces(&buffer, plan, Pieces::Gather)?;
        // A non-contiguous tensor gets the gathered copy at the wait.
        let copy_back = (!contiguous).then(|| tensor.shallow_clone());
        self.pending(buffer, copy_back, "ncclAllGather")
    }

    /// The dtype and calls of a collective over the pieces `counts` of `tensor`, or why
    /// it cannot run (refused before any call).
    fn check_pieces(
        &self,
        tensor: &Tensor,
        counts: &[usize],
        op: &'static str,
    ) -> Result<(sys::ncclDataType_t, Vec<PieceCall>), CommError> {
        let dtype = self.nccl_type(tensor, op)?;
        if tensor.dim() != 1 || !tensor.is_contiguous() {
            return Err(CommError::Shape {
                rank: self.rank,
                op,
                problem: format!(
                    "the tensor of shape {:?} must be 1-D and contiguous",
                    tensor.size()
                ),
            });
        }
        piece_starts(self.rank, self.size, counts, tensor.numel(), op)?;
        Ok((dtype, piece_calls(counts)))
    }

    /// Enqueues the calls of `plan` (from [`Self::check_pieces`] on `tensor`) on this
    /// stream, in one NCCL group, without waiting.
    fn enqueue_pieces(
        &self,
        tensor: &Tensor,
        (dtype, calls): (sys::ncclDataType_t, Vec<PieceCall>),
        pieces: Pieces,
    ) -> Result<(), CommError> {
        let Some(first) = calls.first() else {
            return Ok(());
        };
        nccl_group(&[self], pieces.context(first), || {
            calls.iter().try_for_each(|call| {
                self.issue(pieces.context(call), |comm, stream| {
                    self.enqueue_piece(tensor, dtype, call, pieces, comm, stream)
                })
            })
        })
    }

    /// Enqueues one call of a collective over pieces of the contiguous 1-D `tensor` of
    /// `dtype`, in place, on `stream` over `comm` (this communicator's, from
    /// [`Self::issue`]).
    fn enqueue_piece(
        &self,
        tensor: &Tensor,
        dtype: sys::ncclDataType_t,
        call: &PieceCall,
        pieces: Pieces,
        comm: sys::ncclComm_t,
        stream: sys::cudaStream_t,
    ) -> Result<result::NcclStatus, result::NcclError> {
        let base = tensor.data_ptr().cast::<u8>();
        let element = tensor.kind().elt_size_in_bytes();
        let sum = sys::ncclRedOp_t::ncclSum;
        // SAFETY: `tensor` is a contiguous CUDA tensor on this communicator's GPU of
        // `dtype` elements that the pieces cover exactly (check_pieces), so every offset
        // and count below stays inside it; the caller keeps it alive until the stream
        // has finished; `comm` is live (issue). Equal pieces: the in-place forms NCCL
        // documents (the reduce-scatter receives at, and the all-gather sends from,
        // `rank * count`); rooted calls pass one pointer as both buffers, which NCCL runs
        // in place.
        unsafe {
            match (*call, pieces) {
                (PieceCall::Equal { count }, Pieces::ReduceSum) => {
                    let own = base.add(self.rank * count * element).cast();
                    result::reduce_scatter(base.cast(), own, count, dtype, sum, comm, stream)
                }
                (PieceCall::Equal { count }, Pieces::Gather) => {
                    let own = base.add(self.rank * count * element).cast();
                    result::all_gather(own, base.cast(), count, dtype, comm, stream)
                }
                (
                    PieceCall::Rooted {
                        root,
                        offset,
                        count,
                    },
                    pieces,
                ) => {
                    let piece = base.add(offset * element).cast::<std::ffi::c_void>();
                    let root = root as i32;
                    match pieces {
                        Pieces::ReduceSum => {
                            result::reduce(piece, piece, count, dtype, sum, root, comm, stream)
                        }
                        Pieces::Gather => {
                            result::broadcast(piece, piece, count, dtype, root, comm, stream)
                        }
                    }
                }
            }
        }
    }

    /// Copies `tensor` of rank `root` into `tensor` of every other rank.
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, root)?;
        let dtype = self.nccl_type(tensor, "broadcast")?;
        // SAFETY: run_in_place hands the closure this communicator's live handle, a live,
        // contiguous buffer of `count` elements of `dtype` on its GPU, and its stream.
        self.run_in_place(tensor, "ncclBroadcast", |comm, ptr, count, stream| unsafe {
            result::broadcast(ptr, ptr, count, dtype, root as i32, comm, stream)
        })
    }

    /// Sends `tensor` to rank `dest` of this group.
    pub fn send(&self, tensor: &Tensor, dest: usize) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, dest)?;
        let dtype = self.nccl_type(tensor, "send")?;
        let mut source = tensor.contiguous();
        // SAFETY: run_in_place hands the closure this communicator's live handle, a live,
        // contiguous buffer of `count` elements of `dtype` on its GPU, and its stream.
        self.run_in_place(&mut source, "ncclSend", |comm, ptr, count, stream| unsafe {
            result::send(ptr, count, dtype, dest as i32, comm, stream)
        })
    }

    /// Receives into `tensor` what rank `source` sent (same shape and dtype).
    pub fn recv(&self, tensor: &mut Tensor, source: usize) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, source)?;
        let dtype = self.nccl_type(tensor, "recv")?;
        // SAFETY: run_in_place hands the closure this communicator's live handle, a live,
        // contiguous buffer of `count` elements of `dtype` on its GPU, and its stream.
        self.run_in_place(tensor, "ncclRecv", |comm, ptr, count, stream| unsafe {
            result::recv(ptr, count, dtype, source as i32, comm, stream)
        })
    }

    /// `parts[r]` to rank `r` of this group, as grouped sends and receives (one
    /// `ncclGroupStart`/`ncclGroupEnd`), into buffers of `received_rows[r]` rows from
    /// each rank (the row counts, exchanged beforehand): what each rank sent this one.
    pub fn all_to_all(
        &self,
        parts: &[Tensor],
        received_rows: &[i64],
    ) -> Result<Vec<Tensor>, CommError> {
        const OP: &str = "all_to_all (ncclSend/ncclRecv)";
        let (kind, row) = super::host::check_parts(self.rank, self.size, parts, "all_to_all")?;
        let sends: Vec<Tensor> = parts.iter().map(Tensor::contiguous).collect();
        let device = sends[self.rank].device();
        let mut received: Vec<Tensor> = (received_rows.iter())
            .map(|&n| {
                let shape: Vec<i64> = std::iter::once(n).chain(row.iter().copied()).collect();
                Tensor::empty(shape.as_slice(), (kind, device))
            })
            .collect();
        // After the parts are produced and the receive buffers allocated (the memory may
        // be what libtorch's pending kernels still read).
        self.after_libtorch()?;
        nccl_group(&[self], OP, || {
            for peer in (0..self.size).filter(|&p| p != self.rank) {
                if sends[peer].numel() > 0 {
                    self.enqueue(&sends[peer], peer, true)?;
                }
                if received[peer].numel() > 0 {
                    self.enqueue(&received[peer], peer, false)?;
                }
            }
            Ok(())
        })?;
        received[self.rank] = sends[self.rank].copy();
        self.complete(OP)?;
        Ok(received)
    }

    /// Enqueues sending the contiguous `tensor` to rank `peer` of this communicator (or,
    /// without `send`, receiving into it from `peer`) on its stream, without waiting:
    /// inside [`nccl_group`] (grouped exchanges, [`super::PipelineLinks`]). The caller
    /// keeps `tensor` alive and calls [`Self::synchronize`] before reusing it.
    pub(crate) fn enqueue(
        &self,
        tensor: &Tensor,
        peer: usize,
        send: bool,
    ) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, peer)?;
        let (op, context) = if send {
            ("send", "ncclSend")
        } else {
            ("recv", "ncclRecv")
        };
        let dtype = self.nccl_type(tensor, op)?;
        let (ptr, count, peer) = (tensor.data_ptr(), tensor.numel(), peer as i32);
        // SAFETY: a contiguous tensor of `count` elements of `dtype` on this communicator's
        // GPU, kept alive by the caller until the stream has been synchronised; `comm` is
        // this communicator's live handle (issue).
        self.issue(context, |comm, stream| unsafe {
            if send {
                result::send(ptr, count, dtype, peer, comm, stream)
            } else {
                result::recv(ptr, count, dtype, peer, comm, stream)
            }
        })
    }

    /// Issues one NCCL call on this communicator's live handle and stream. Inside
    /// [`nccl_group`], which aborts the communicator if the call fails (not here: the
    /// handle must outlive `ncclGroupEnd`).
    fn issue(
        &self,
        op: &'static str,
        call: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), CommError> {
        let comm = self.handle.raw(op)?;
        (call(comm, self.lane.raw_stream()).map(drop)).map_err(|e| self.handle.failure(op, e.0))
    }

    /// Waits (bounded by the watchdog, polling NCCL's errors) until the work enqueued so
    /// far on this communicator's stream is complete.
    pub(crate) fn synchronize(&self, op: &'static str) -> Result<(), CommError> {
        self.complete(op)
    }

    fn complete(&self, op: &'static str) -> Result<(), CommError> {
        let done = self.lane.mark().map_err(self.driver_err("cuEventRecord"))?;
        self.lane.wait(&done, op, &self.handle)
    }

    /// Makes this communicator's stream wait, on the GPU and without blocking the host,
    /// for libtorch's kernels enqueued so far (`Lane::after_libtorch`). Call it after
    /// every tensor NCCL will touch exists (produced, copied or allocated).
    pub(crate) fn after_libtorch(&self) -> Result<(), CommError> {
        (self.lane.after_libtorch())
            .map_err(self.driver_err("cuEventRecord/cuStreamWaitEvent (after libtorch)"))
    }

    /// A driver error of `context` as this rank's [`CommError`].
    fn driver_err(&self, context: &'static str) -> impl Fn(DriverError) -> CommError {
        let rank = self.rank;
        move |e| CommError::Cuda {
            rank,
            context,
            message: format!("{e:?}"),
        }
    }

    /// The GPU this communicator runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Every rank's `tensor` stacked along a new leading dimension in rank order.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        let dtype = self.nccl_type(tensor, "all_gather")?;
        let source = tensor.contiguous();
        let mut shape = vec![self.size as i64];
        shape.extend(tensor.size());
        let mut out = Tensor::empty(shape.as_slice(), (tensor.kind(), tensor.device()));
        let count = source.numel();
        // SAFETY: run_in_place hands the closure this communicator's live handle, a live,
        // contiguous buffer of `count` elements of `dtype` on its GPU, and its stream;
        // `source` holds `count` elements of `dtype` and outlives the call's completion.
        self.run_in_place(&mut out, "ncclAllGather", |comm, ptr, _, stream| unsafe {
            result::all_gather(source.data_ptr(), ptr, count, dtype, comm, stream)
        })?;
        Ok(out)
    }

    /// The element-wise sum over ranks, scattered by rows of the leading dimension
    /// (half-precision tensors summed in fp32 and rounded once: `summed_kind`).
    pub fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        if let (wide, Some(_)) = widened(tensor) {
            let sum = self.reduce_scatter_sum(&wide)?;
            return Ok(tch::no_grad(|| sum.to_kind(tensor.kind())));
        }
        let dtype = self.nccl_type(tensor, "reduce_scatter_sum")?;
        let rows = CommError::check_scatter_rows(self.rank, self.size, tensor)?;
        let source = tensor.contiguous();
        let mut shape = tensor.size();
        shape[0] = rows / self.size as i64;
        let mut out = Tensor::empty(shape.as_slice(), (tensor.kind(), tensor.device()));
        let sum = sys::ncclRedOp_t::ncclSum;
        let call = |comm, ptr, count, stream| {
            // SAFETY: run_in_place hands the closure this communicator's live handle, a
            // live, contiguous buffer of `count` elements of `dtype` on its GPU, and its
            // stream; `source` holds `size * count` elements and outlives the call's
            // completion.
            unsafe {
                result::reduce_scatter(source.data_ptr(), ptr, count, dtype, sum, comm, stream)
            }
        };
        self.run_in_place(&mut out, "ncclReduceScatter", call)?;
        Ok(out)
    }

    fn nccl_type(
        &self,
        tensor: &Tensor,
        op: &'static str,
    ) -> Result<sys::ncclDataType_t, CommError> {
        if tensor.device() != Device::Cuda(self.ordinal) {
            return Err(CommError::WrongDevice {
                rank: self.rank,
                device: tensor.device(),
                ordinal: self.ordinal,
            });
        }
        use sys::ncclDataType_t as T;
        Ok(match tensor.kind() {
            Kind::Float => T::ncclFloat32,
            Kind::Double => T::ncclFloat64,
            Kind::Half => T::ncclFloat16,
            Kind::BFloat16 => T::ncclBfloat16,
            Kind::Int => T::ncclInt32,
            Kind::Int64 => T::ncclInt64,
            Kind::Int8 => T::ncclInt8,
            Kind::Uint8 | Kind::Bool => T::ncclUint8,
            kind => {
                return Err(CommError::UnsupportedDtype {
                    rank: self.rank,
                    op,
                    kind,
                })
            }
        })
    }

    /// Runs one NCCL call on a contiguous view of `tensor`, ordered after libtorch's
    /// kernels on the GPU and waited for (polling NCCL's errors), and writes the result
    /// back if a contiguous copy had to be made.
    fn run_in_place(
        &self,
        tensor: &mut Tensor,
        context: &'static str,
        call: impl FnOnce(
            sys::ncclComm_t,
            *mut std::ffi::c_void,
            usize,
            sys::cudaStream_t,
        ) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), CommError> {
        let contiguous = tensor.is_contiguous();
        let buffer = if contiguous {
            tensor.shallow_clone()
        } else {
            tensor.contiguous()
        };
        self.after_libtorch()?;
        nccl_group(&[self], context, || {
            self.issue(context, |comm, stream| {
                call(comm, buffer.data_ptr(), buffer.numel(), stream)
            })
        })?;
        self.complete(context)?;
        if !contiguous {
            tch::no_grad(|| tensor.copy_(&buffer));
        }
        Ok(())
    }
}

impl NcclCommunicator {
    /// Completes this communicator's work and releases its links (`ncclCommFinalize`),
    /// once: NCCL's first step of tearing a communicator down, which may wait for the
    /// other members, so the owners of several communicators finalize them in one order
    /// on every rank, all of them before destroying any ([`super::SetGroups`]). Bounded
    /// by the watchdog; a communicator whose finalize fails is aborted, and one aborted
    /// after an earlier error is left alone.
    pub(crate) fn finalize(&self) -> Result<(), CommError> {
        self.handle.finalize()
    }
}

impl Drop for NcclCommunicator {
    /// Finalizes (if not yet) and destroys a healthy communicator; one that saw an error
    /// was aborted instead and is never destroyed (`CommHandle::release`).
    fn drop(&mut self) {
        self.handle.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_contact_is_one_send_and_one_receive_each_way() {
        let (zero, one) = (first_contact(0), first_contact(1));
        // The same pattern on both ranks: one send, then one receive, in one group.
        assert_eq!(zero, [Contact::Send { to: 1 }, Contact::Recv { from: 1 }]);
        assert_eq!(one, [Contact::Send { to: 0 }, Contact::Recv { from: 0 }]);
        // Every send meets a receive from its sender on the other rank, so both
        // directions connect in this group.
        for (rank, plan) in [(0, zero), (1, one)] {
            for contact in plan {
                if let Contact::Send { to } = contact {
                    assert!(first_contact(to).contains(&Contact::Recv { from: rank }));
                }
            }
        }
    }

    #[test]
    fn half_precision_is_summed_in_fp32() {
        assert_eq!(summed_kind(Kind::BFloat16), Kind::Float);
        assert_eq!(summed_kind(Kind::Half), Kind::Float);
        for kind in [Kind::Float, Kind::Double, Kind::Int64, Kind::Int8] {
            assert_eq!(summed_kind(kind), kind);
        }
        // The widened copy rounds back to the tensor it came from (on the CPU here).
        let narrow = Tensor::from_slice(&[1.0f32, 3.0, 1e-3]).to_kind(Kind::BFloat16);
        let (wide, back) = widened(&narrow);
        assert_eq!(wide.kind(), Kind::Float);
        assert!(wide.is_contiguous());
        let mut back = back.expect("bf16 is widened");
        tch::no_grad(|| back.copy_(&(&wide * 3.0)));
        assert_eq!(narrow.to_kind(Kind::Float).double_value(&[1]), 9.0);
        let (same, none) = widened(&wide);
        assert!(none.is_none());
        assert_eq!(same.data_ptr(), wide.data_ptr());
    }

    /// Three ranks' bf16 values whose sum depends on where it is rounded: summed in
    /// fp32 and rounded once it is MPI's result, whatever the order of the ranks.
    #[test]
    fn a_widened_sum_rounds_once_like_mpi() {
        let parts = [256.0f32, 1.0, 1.0];
        let bf16 = |v: f32| Tensor::from_slice(&[v]).to_kind(Kind::BFloat16);
        let once: f64 = (parts.iter())
            .fold(Tensor::zeros([1], (Kind::Float, Device::Cpu)), |sum, &p| {
                sum + bf16(p).to_kind(Kind::Float)
            })
            .to_kind(Kind::BFloat16)
            .double_value(&[0]);
        // bf16 steps of 2 at 256: rounding after each addition loses both ones.
        let stepwise: f64 = (parts.iter())
            .fold(bf16(0.0), |sum, &p| sum + bf16(p))
            .double_value(&[0]);
        assert_eq!(once, 258.0);
        assert_eq!(stepwise, 256.0);
    }
}
