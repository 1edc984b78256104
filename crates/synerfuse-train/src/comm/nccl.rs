//! NCCL communicators over CUDA tch tensors, through cudarc's run-time loaded bindings.

use super::pieces::{piece_calls, piece_starts, PieceCall};
use super::watchdog::waiting;
use super::{CommError, MpiCommunicator};
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result, sys};
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

/// A group of CUDA ranks that exchanges tensors with NCCL.
///
/// libtorch enqueues its kernels on its own stream; NCCL runs on a stream of this
/// communicator. Each operation therefore waits for the device before it starts and
/// for its stream before it returns, so tensors are always complete on both sides.
pub struct NcclCommunicator {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    ordinal: usize,
    /// The group's name in timeout messages.
    name: Arc<str>,
    /// Whether `ncclCommFinalize` has run (it runs once, before `ncclCommDestroy`).
    finalized: bool,
}

/// A reduction enqueued on an NCCL communicator's stream, from
/// [`NcclCommunicator::start_all_reduce_sum`] or
/// [`NcclCommunicator::start_reduce_scatter_sum`].
pub struct PendingNccl {
    stream: Arc<CudaStream>,
    _tensor: Tensor,
    rank: usize,
    name: Arc<str>,
    /// The NCCL call, for timeout messages.
    op: &'static str,
    waited: bool,
}

impl PendingNccl {
    /// Waits until the stream has finished the reduction.
    pub fn wait(mut self) -> Result<(), CommError> {
        self.synchronize()
    }

    fn synchronize(&mut self) -> Result<(), CommError> {
        let _wait = waiting(self.op, &self.name, None);
        let done = self.stream.synchronize().map_err(|e| CommError::Cuda {
            rank: self.rank,
            context: "cuStreamSynchronize",
            message: format!("{e:?}"),
        });
        self.waited = true;
        done
    }
}

impl Drop for PendingNccl {
    fn drop(&mut self) {
        // NCCL may still write into the tensor: never hand its memory back before then.
        if !self.waited {
            let _ = self.synchronize();
        }
    }
}

impl NcclCommunicator {
    /// Runs this communicator's work on `other`'s stream from now on: collectives of
    /// several communicators on one stream run in the order they are issued, so ranks
    /// that issue them in one global order cannot deadlock on NCCL kernels that wait for
    /// each other across communicators.
    pub(crate) fn share_stream_of(&mut self, other: &NcclCommunicator) {
        self.stream = Arc::clone(&other.stream);
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
    /// `peer` (the lower world rank is its rank 0). Only the two ranks call it.
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
        Self::init(&id, usize::from(!first), 2, ordinal, Arc::from(name))
    }

    /// A fresh NCCL unique id when `create`, zeros otherwise (to be overwritten).
    fn unique_id_bytes(rank: usize, create: bool) -> Result<[u8; 128], CommError> {
        let id = if create {
            result::get_uniqueid().map_err(|e| CommError::Cuda {
                rank,
                context: "ncclGetUniqueId",
                message: format!("{e:?}"),
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
            move |e: cudarc::driver::DriverError| CommError::Cuda {
                rank,
                context,
                message: format!("{e:?}"),
            }
        };
        // Binds the device's primary context (the one libtorch uses) to this thread, so
        // NCCL initialises on the right GPU.
        let context = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let stream = context.new_stream().map_err(driver_err("cuStreamCreate"))?;
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
                message: format!("{e:?}"),
            })?;
            comm.assume_init()
        };
        Ok(Self {
            comm,
            stream,
            rank,
            size,
            ordinal,
            name,
            finalized: false,
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

    /// Replaces `tensor` on every rank with the element-wise sum over all ranks.
    pub fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<(), CommError> {
        let dtype = self.nccl_type(tensor, "all_reduce_sum")?;
        // SAFETY: run_in_place hands the closure a live, contiguous buffer of `count`
        // elements of `dtype` on this communicator's GPU, and its stream.
        self.run_in_place(tensor, "ncclAllReduce", |ptr, count, stream| unsafe {
            result::all_reduce(
                ptr,
                ptr,
                count,
                dtype,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                stream,
            )
        })
    }

    /// Enqueues the sum of `tensor` over the group on this communicator's stream and
    /// returns at once; libtorch's later kernels overlap it. The caller must not touch
    /// `tensor` before [`PendingNccl::wait`].
    pub fn start_all_reduce_sum(&self, tensor: &Tensor) -> Result<PendingNccl, CommError> {
        let dtype = self.nccl_type(tensor, "start_all_reduce_sum")?;
        if !tensor.is_contiguous() {
            return Err(CommError::Shape {
                rank: self.rank,
                op: "start_all_reduce_sum",
                problem: "the tensor must be contiguous".to_owned(),
            });
        }
        // The gradients must be complete before NCCL reads them.
        self.wait_for_libtorch()?;
        // SAFETY: `tensor` is a contiguous CUDA tensor on this communicator's device of
        // `numel` elements of `dtype`; PendingNccl keeps it alive until the stream is done.
        unsafe {
            result::all_reduce(
                tensor.data_ptr(),
                tensor.data_ptr(),
                tensor.numel(),
                dtype,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| CommError::Cuda {
            rank: self.rank,
            context: "ncclAllReduce",
            message: format!("{e:?}"),
        })?;
        Ok(self.pending(tensor, "ncclAllReduce"))
    }

    /// What waits for `tensor`'s collective `op`, just enqueued on this stream.
    fn pending(&self, tensor: &Tensor, op: &'static str) -> PendingNccl {
        PendingNccl {
            stream: Arc::clone(&self.stream),
            _tensor: tensor.shallow_clone(),
            rank: self.rank,
            name: Arc::clone(&self.name),
            op,
            waited: false,
        }
    }

    /// Enqueues summing the contiguous 1-D `tensor` over the group so that member `m`'s
    /// piece (the `counts[m]` elements after `counts[..m]`) holds its sum on member `m`,
    /// the rest of `tensor` left as it was (as [`MpiCommunicator::start_reduce_scatter_sum`]),
    /// and returns at once: one in-place `ncclReduceScatter` when the pieces are equal,
    /// otherwise one in-place `ncclReduce` per non-empty piece to its member, grouped
    /// (see [`super::pieces::piece_calls`] for why not a padded reduce-scatter). The
    /// caller must not touch `tensor` before [`PendingNccl::wait`].
    pub fn start_reduce_scatter_sum(
        &self,
        tensor: &Tensor,
        counts: &[usize],
    ) -> Result<PendingNccl, CommError> {
        let plan = self.check_pieces(tensor, counts, "start_reduce_scatter_sum")?;
        // The gradients must be complete before NCCL reads them.
        self.wait_for_libtorch()?;
        self.enqueue_pieces(tensor, plan, Pieces::ReduceSum)?;
        Ok(self.pending(tensor, "ncclReduceScatter"))
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
        let op = "all_gather_in_place";
        let contiguous = tensor.is_contiguous();
        let buffer = match contiguous {
            true => tensor.shallow_clone(),
            false => tensor.contiguous(),
        };
        let plan = self.check_pieces(&buffer, counts, op)?;
        self.wait_for_libtorch()?;
        self.enqueue_pieces(&buffer, plan, Pieces::Gather)?;
        self.synchronize(op)?;
        if !contiguous {
            tch::no_grad(|| tensor.copy_(&buffer));
        }
        Ok(())
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
    /// stream, in one NCCL group when there are several, without waiting.
    fn enqueue_pieces(
        &self,
        tensor: &Tensor,
        (dtype, calls): (sys::ncclDataType_t, Vec<PieceCall>),
        pieces: Pieces,
    ) -> Result<(), CommError> {
        let nccl_err = |context: &'static str| {
            move |e: result::NcclError| CommError::Cuda {
                rank: self.rank,
                context,
                message: format!("{e:?}"),
            }
        };
        let grouped = calls.len() > 1;
        if grouped {
            result::group_start().map_err(nccl_err("ncclGroupStart"))?;
        }
        let enqueued = calls.iter().try_for_each(|call| {
            let context = pieces.context(call);
            (self.enqueue_piece(tensor, dtype, call, pieces))
                .map(drop)
                .map_err(nccl_err(context))
        });
        if grouped {
            result::group_end().map_err(nccl_err("ncclGroupEnd"))?;
        }
        enqueued
    }

    /// Enqueues one call of a collective over pieces of the contiguous 1-D `tensor` of
    /// `dtype`, in place, on this stream.
    fn enqueue_piece(
        &self,
        tensor: &Tensor,
        dtype: sys::ncclDataType_t,
        call: &PieceCall,
        pieces: Pieces,
    ) -> Result<result::NcclStatus, result::NcclError> {
        let base = tensor.data_ptr().cast::<u8>();
        let element = tensor.kind().elt_size_in_bytes();
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let sum = sys::ncclRedOp_t::ncclSum;
        // SAFETY: `tensor` is a contiguous CUDA tensor on this communicator's GPU of
        // `dtype` elements that the pieces cover exactly (check_pieces), so every offset
        // and count below stays inside it; the caller keeps it alive until the stream
        // has finished. Equal pieces: the in-place forms NCCL documents (the reduce-scatter
        // receives at, and the all-gather sends from, `rank * count`); rooted calls pass
        // one pointer as both buffers, which NCCL runs in place.
        unsafe {
            match (*call, pieces) {
                (PieceCall::Equal { count }, Pieces::ReduceSum) => {
                    let own = base.add(self.rank * count * element).cast();
                    result::reduce_scatter(base.cast(), own, count, dtype, sum, self.comm, stream)
                }
                (PieceCall::Equal { count }, Pieces::Gather) => {
                    let own = base.add(self.rank * count * element).cast();
                    result::all_gather(own, base.cast(), count, dtype, self.comm, stream)
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
                            result::reduce(piece, piece, count, dtype, sum, root, self.comm, stream)
                        }
                        Pieces::Gather => {
                            result::broadcast(piece, piece, count, dtype, root, self.comm, stream)
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
        // SAFETY: run_in_place hands the closure a live, contiguous buffer of `count`
        // elements of `dtype` on this communicator's GPU, and its stream.
        self.run_in_place(tensor, "ncclBroadcast", |ptr, count, stream| unsafe {
            result::broadcast(ptr, ptr, count, dtype, root as i32, self.comm, stream)
        })
    }

    /// Sends `tensor` to rank `dest` of this group.
    pub fn send(&self, tensor: &Tensor, dest: usize) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, dest)?;
        let dtype = self.nccl_type(tensor, "send")?;
        let mut source = tensor.contiguous();
        // SAFETY: run_in_place hands the closure a live, contiguous buffer of `count`
        // elements of `dtype` on this communicator's GPU, and its stream.
        self.run_in_place(&mut source, "ncclSend", |ptr, count, stream| unsafe {
            result::send(ptr, count, dtype, dest as i32, self.comm, stream)
        })
    }

    /// Receives into `tensor` what rank `source` sent (same shape and dtype).
    pub fn recv(&self, tensor: &mut Tensor, source: usize) -> Result<(), CommError> {
        CommError::check_peer(self.rank, self.size, source)?;
        let dtype = self.nccl_type(tensor, "recv")?;
        // SAFETY: run_in_place hands the closure a live, contiguous buffer of `count`
        // elements of `dtype` on this communicator's GPU, and its stream.
        self.run_in_place(tensor, "ncclRecv", |ptr, count, stream| unsafe {
            result::recv(ptr, count, dtype, source as i32, self.comm, stream)
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
        let (kind, row) = super::host::check_parts(self.rank, self.size, parts, "all_to_all")?;
        let sends: Vec<Tensor> = parts.iter().map(Tensor::contiguous).collect();
        let device = sends[self.rank].device();
        let mut received: Vec<Tensor> = (received_rows.iter())
            .map(|&n| {
                let shape: Vec<i64> = std::iter::once(n).chain(row.iter().copied()).collect();
                Tensor::empty(shape.as_slice(), (kind, device))
            })
            .collect();
        // The parts must be complete before NCCL's stream reads them.
        self.wait_for_libtorch()?;
        let group_err = |context: &'static str| {
            move |e: result::NcclError| CommError::Cuda {
                rank: self.rank,
                context,
                message: format!("{e:?}"),
            }
        };
        result::group_start().map_err(group_err("ncclGroupStart"))?;
        let enqueued = (|| {
            for peer in (0..self.size).filter(|&p| p != self.rank) {
                if sends[peer].numel() > 0 {
                    self.enqueue(&sends[peer], peer, true)?;
                }
                if received[peer].numel() > 0 {
                    self.enqueue(&received[peer], peer, false)?;
                }
            }
            Ok::<(), CommError>(())
        })();
        result::group_end().map_err(group_err("ncclGroupEnd"))?;
        enqueued?;
        received[self.rank] = sends[self.rank].copy();
        self.synchronize("all_to_all")?;
        Ok(received)
    }

    /// Enqueues sending the contiguous `tensor` to rank `peer` of this communicator (or,
    /// without `send`, receiving into it from `peer`) on its stream, without waiting: for
    /// grouped exchanges ([`super::PipelineLinks`]), between `ncclGroupStart` and
    /// `ncclGroupEnd`. The caller keeps `tensor` alive and calls [`Self::synchronize`]
    /// before reusing it.
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
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let (ptr, count, peer) = (tensor.data_ptr(), tensor.numel(), peer as i32);
        // SAFETY: a contiguous tensor of `count` elements of `dtype` on this communicator's
        // GPU, kept alive by the caller until the stream has been synchronised.
        unsafe {
            if send {
                result::send(ptr, count, dtype, peer, self.comm, stream)
            } else {
                result::recv(ptr, count, dtype, peer, self.comm, stream)
            }
        }
        .map(drop)
        .map_err(|e| CommError::Cuda {
            rank: self.rank,
            context,
            message: format!("{e:?}"),
        })
    }

    /// Waits (bounded by the watchdog) until this communicator's stream is idle.
    pub(crate) fn synchronize(&self, op: &'static str) -> Result<(), CommError> {
        let _wait = waiting(op, &self.name, None);
        self.stream.synchronize().map_err(|e| CommError::Cuda {
            rank: self.rank,
            context: "cuStreamSynchronize",
            message: format!("{e:?}"),
        })
    }

    /// Waits until libtorch's kernels are done (its legacy default stream) but not for
    /// NCCL's own non-blocking streams, so reductions in flight keep overlapping (a
    /// device-wide synchronise would wait for them). Bounded by the watchdog.
    pub(crate) fn wait_for_libtorch(&self) -> Result<(), CommError> {
        let _wait = waiting("waiting for libtorch's kernels", &self.name, None);
        // SAFETY: the null stream is the legacy default stream of the thread's current
        // context, the GPU's primary context that `init` bound and libtorch uses.
        unsafe { cudarc::driver::result::stream::synchronize(std::ptr::null_mut()) }.map_err(|e| {
            CommError::Cuda {
                rank: self.rank,
                context: "cuStreamSynchronize(legacy default stream)",
                message: format!("{e:?}"),
            }
        })
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
        // SAFETY: run_in_place hands the closure a live, contiguous buffer of `count`
        // elements of `dtype` on this communicator's GPU, and its stream.
        self.run_in_place(&mut out, "ncclAllGather", |ptr, _, stream| unsafe {
            result::all_gather(source.data_ptr(), ptr, count, dtype, self.comm, stream)
        })?;
        Ok(out)
    }

    /// The element-wise sum over ranks, scattered by rows of the leading dimension.
    pub fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        let dtype = self.nccl_type(tensor, "reduce_scatter_sum")?;
        let rows = CommError::check_scatter_rows(self.rank, self.size, tensor)?;
        let source = tensor.contiguous();
        let mut shape = tensor.size();
        shape[0] = rows / self.size as i64;
        let mut out = Tensor::empty(shape.as_slice(), (tensor.kind(), tensor.device()));
        // SAFETY: run_in_place hands the closure a live, contiguous buffer of `count`
        // elements of `dtype` on this communicator's GPU, and its stream.
        self.run_in_place(&mut out, "ncclReduceScatter", |ptr, count, stream| unsafe {
            result::reduce_scatter(
                source.data_ptr(),
                ptr,
                count,
                dtype,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                stream,
            )
        })?;
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

    /// Runs one NCCL call on a contiguous view of `tensor`, synchronised with libtorch on
    /// both sides, and writes the result back if a contiguous copy had to be made.
    fn run_in_place(
        &self,
        tensor: &mut Tensor,
        context: &'static str,
        call: impl FnOnce(
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
        let count = buffer.numel();
        self.wait_for_libtorch()?;
        call(
            buffer.data_ptr(),
            count,
            self.stream.cu_stream() as sys::cudaStream_t,
        )
        .map_err(|e| CommError::Cuda {
            rank: self.rank,
            context,
            message: format!("{e:?}"),
        })?;
        {
            let _wait = waiting(context, &self.name, None);
            self.stream.synchronize().map_err(|e| CommError::Cuda {
                rank: self.rank,
                context: "cuStreamSynchronize",
                message: format!("{e:?}"),
            })?;
        }
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
    /// on every rank, all of them before destroying any ([`super::SetGroups`]).
    /// Bounded by the watchdog.
    pub(crate) fn finalize(&mut self) -> Result<(), CommError> {
        if std::mem::replace(&mut self.finalized, true) {
            return Ok(());
        }
        let _wait = waiting("ncclCommFinalize", &self.name, None);
        // SAFETY: `comm` was created by ncclCommInitRank, is not destroyed yet, and is
        // finalized once (the flag above).
        unsafe { result::comm_finalize(self.comm) }
            .map(drop)
            .map_err(|e| CommError::Cuda {
                rank: self.rank,
                context: "ncclCommFinalize",
                message: format!("{e:?}"),
            })
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if let Err(e) = self.finalize() {
            tracing::warn!("{}: {e}", self.name);
        }
        // SAFETY: `comm` was created by ncclCommInitRank and is destroyed once.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}
