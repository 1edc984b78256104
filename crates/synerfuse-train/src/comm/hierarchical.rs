//! The hierarchical reduction of [`super::islands`] over MPI, in flight like any other
//! collective: a reduce-scatter inside this member's island (its island's communicator),
//! its piece's partial sums exchanged with the members of the other islands that hold
//! the same elements (point to point over a communicator of the group's own), then an
//! all-gather inside the island (point to point: see [`Phase::Finish`]), or for the
//! distributed optimizer each island piece handed to the members whose shards it holds.
//! Each phase starts when the last one has completed, as the caller drives it
//! ([`PendingHierarchical::progress`]). Across emulated nodes, the exchanges arrive no
//! sooner than the plan's links carry them ([`super::emulated_links`]).
//!
//! fp32 through host memory: a CUDA member's tensor is copied to the host and back.

use super::emulated_links::{monotonic_s, LinkEmulation, Traffic};
use super::host::{poll_until, MAX_ELEMENTS_PER_CALL};
use super::islands::{HierarchicalPlan, Islands};
use super::watchdog::waiting;
use super::{CommError, MpiCommunicator, PendingAllReduce};
use mpi::raw::AsRaw;
use std::cell::Cell;
use std::ops::Range;
use std::rc::Rc;
use tch::{Device, Kind, Tensor};

/// Tags of the point-to-point messages, one per reduction started (each member starts
/// the group's reductions in one order, so a reduction's messages match its own).
const TAGS: Range<i32> = 1000..31000;

/// Below this many elements a reduction goes flat: three phases cost more latency than
/// the bytes they save.
pub(crate) const MIN_ELEMENTS: usize = 1024;

/// A group's islands and the communicators a hierarchical reduction runs over.
pub(crate) struct HierarchicalGroup {
    islands: Islands,
    /// This member's island.
    island: MpiCommunicator,
    /// The whole group again, for the point-to-point exchanges only.
    cross: MpiCommunicator,
    /// This member's group rank.
    me: usize,
    next_tag: Cell<i32>,
    /// The run's emulated links, and each member's world rank: exchanges across
    /// emulated nodes arrive no sooner than the links carry them.
    links: Option<(Rc<LinkEmulation>, Vec<usize>)>,
}

impl HierarchicalGroup {
    /// The islands of `group` given each member's island key (collective over `group`:
    /// every member splits it), or `None` where a hierarchical reduction would be the flat
    /// one ([`Islands::hierarchical`]).
    pub(crate) fn new<K: PartialEq>(
        group: &MpiCommunicator,
        keys: &[K],
        members: &[usize],
        emulation: Option<&Rc<LinkEmulation>>,
    ) -> Option<Rc<Self>> {
        let islands = Islands::from_keys(keys);
        if !islands.hierarchical() {
            return None;
        }
        let me = group.rank();
        let (mine, place) = islands.of(me);
        let island = group.split(Some(mine as u32), place)?;
        let cross = group.split(Some(0), me)?;
        Some(Rc::new(HierarchicalGroup {
            island: island.with_name(format!("{}, island {mine}", group.name())),
            cross: cross.with_name(format!("{}, across its islands", group.name())),
            islands,
            me,
            next_tag: Cell::new(TAGS.start),
            links: emulation.map(|e| (Rc::clone(e), members.to_vec())),
        }))
    }

    /// When `bytes` sent now to member `peer` arrive over the emulated links, `None`
    /// where they are not emulated.
    fn arrival(&self, peer: usize, bytes: usize) -> Option<f64> {
        let (emulation, world) = self.links.as_ref()?;
        emulation.send(Traffic::Reduction, world[peer], bytes as f64)
    }

    /// Whether messages from member `peer` carry their arrival time.
    fn stamped(&self, peer: usize) -> bool {
        (self.links.as_ref()).is_some_and(|(emulation, world)| emulation.crosses_to(world[peer]))
    }

    /// The group rank of member `place` of this member's island.
    fn island_member(&self, place: usize) -> usize {
        self.islands.members()[self.islands.of(self.me).0][place]
    }

    /// When this member's island's reduce-scatter of pieces of at most `largest` fp32
    /// elements completes on the emulated links (a site's island spans nodes), `None`
    /// where they are not emulated.
    fn island_scatter_done(&self, largest: usize) -> Option<f64> {
        let (emulation, world) = self.links.as_ref()?;
        let island = &self.islands.members()[self.islands.of(self.me).0];
        let ranks: Vec<usize> = island.iter().map(|&m| world[m]).collect();
        emulation.ring(&ranks, island.len() - 1, 4.0 * largest as f64)
    }

    /// The islands, as group ranks.
    pub(crate) fn islands(&self) -> &Islands {
        &self.islands
    }

    /// Starts reducing the fp32 1-D `tensor` over the group: the whole sum into every
    /// member's `tensor`, or with `shards` (one count per member) each member's shard of
    /// it into that part of its `tensor` (the rest left as it was).
    pub(crate) fn start(
        self: &Rc<Self>,
        tensor: &Tensor,
        shards: Option<&[usize]>,
    ) -> Result<PendingHierarchical, CommError> {
        let op = match shards {
            Some(_) => "hierarchical reduce_scatter_sum",
            None => "hierarchical all_reduce_sum",
        };
        let rank = self.me;
        if tensor.kind() != Kind::Float {
            let kind = tensor.kind();
            return Err(CommError::UnsupportedDtype { rank, op, kind });
        }
        if tensor.dim() != 1 {
            let problem = format!(
                "a flat buffer is reduced, not one of shape {:?}",
                tensor.size()
            );
            return Err(CommError::Shape { rank, op, problem });
        }
        let numel = tensor.numel();
        if let Some(shards) = shards {
            super::pieces::piece_starts(rank, self.islands.size(), shards, numel, op)?;
        }
        let plan = HierarchicalPlan::new(&self.islands, self.me, numel, shards);
        // In place on a CPU tensor when the whole sum lands in it; a copy otherwise.
        let in_place = shards.is_none() && tensor.device() == Device::Cpu && tensor.is_contiguous();
        let work = match in_place {
            true => tensor.shallow_clone(),
            false => tch::no_grad(|| tensor.detach().to_device(Device::Cpu).contiguous().copy()),
        };
        let tag = self.next_tag.get();
        self.next_tag.set(match tag + 1 < TAGS.end {
            true => tag + 1,
            false => TAGS.start,
        });
        let copy_back = (!in_place).then(|| {
            let shard = shards.map(|s| super::islands::ranges(s)[rank].clone());
            (tensor.shallow_clone(), shard.unwrap_or(0..numel))
        });
        let (scatter, done) = match self.islands.members()[self.islands.of(self.me).0].len() {
            1 => (None, None),
            _ => {
                let largest = plan.island_counts.iter().copied().max().unwrap_or(0);
                let done = self.island_scatter_done(largest);
                let scatter = (self.island).start_reduce_scatter_sum(&work, &plan.island_counts)?;
                (Some(scatter), done)
            }
        };
        Ok(PendingHierarchical {
            group: Rc::clone(self),
            phase: Phase::Scatter(scatter, done),
            work,
            plan,
            tag,
            copy_back,
            op,
            sharded: shards.is_some(),
        })
    }
}

/// Where a hierarchical reduction is.
enum Phase {
    /// The reduce-scatter inside the island (none for an island of one), and when it
    /// completes on the emulated links.
    Scatter(Option<PendingAllReduce>, Option<f64>),
    /// The partial sums of this member's piece going to, and coming from, the other
    /// islands' holders; the received ones by slice, in the slices' holder order.
    Cross(Exchange, Vec<Vec<Option<Tensor>>>),
    /// The all-gather inside the island, or the handover of the shards: point to point,
    /// each under the reduction's tag, because reductions reach this phase in whatever
    /// order their exchanges complete on each member, and collectives on one
    /// communicator must start in one order everywhere.
    Finish(Exchange),
    Done,
}

/// A hierarchical reduction in flight: the caller leaves its tensor alone until
/// [`Self::wait`], and drives it with [`Self::progress`] meanwhile.
pub struct PendingHierarchical {
    group: Rc<HierarchicalGroup>,
    phase: Phase,
    /// The host buffer reduced (the caller's tensor, or a copy of it).
    work: Tensor,
    plan: HierarchicalPlan,
    tag: i32,
    /// The caller's tensor and the elements to copy into it, when `work` is a copy.
    copy_back: Option<(Tensor, Range<usize>)>,
    op: &'static str,
    sharded: bool,
}

impl PendingHierarchical {
    /// Moves it on as far as it goes without waiting; whether it has completed.
    pub fn progress(&mut self) -> bool {
        loop {
            let next = match &mut self.phase {
                Phase::Scatter(scatter, done) => match scatter.as_mut().is_none_or(|s| s.test())
                    && done.is_none_or(|at| monotonic_s() >= at)
                {
                    true => {
                        if let Some(s) = scatter.take() {
                            s.wait();
                        }
                        self.start_cross()
                    }
                    false => return false,
                },
                Phase::Cross(exchange, received) => {
                    if !exchange.test() {
                        return false;
                    }
                    let received = std::mem::take(received);
                    self.add_up(received);
                    self.start_finish()
                }
                Phase::Finish(exchange) => match exchange.test() {
                    true => Phase::Done,
                    false => return false,
                },
                Phase::Done => {
                    if let Some((target, range)) = self.copy_back.take() {
                        let (start, len) = (range.start as i64, range.len() as i64);
                        tch::no_grad(|| {
                            target
                                .narrow(0, start, len)
                                .copy_(&self.work.narrow(0, start, len))
                        });
                    }
                    return true;
                }
            };
            self.phase = next;
        }
    }

    /// Waits for the result, which is then in the tensor the reduction started from.
    pub fn wait(mut self) -> Result<(), CommError> {
        let _wait = waiting(self.op, &self.group.cross.shared_name(), None);
        poll_until(|| self.progress());
        Ok(())
    }

    /// Sends this member's partial sums of each slice to the slice's other holders and
    /// receives theirs.
    fn start_cross(&mut self) -> Phase {
        let mut exchange = Exchange::new(&self.group.cross, self.tag);
        let mut received = Vec::with_capacity(self.plan.slices.len());
        for (slice, holders) in &self.plan.slices {
            let part = self.work.narrow(0, slice.start as i64, slice.len() as i64);
            let mut theirs = Vec::with_capacity(holders.len());
            for &holder in holders {
                if holder == self.group.me {
                    theirs.push(None);
                    continue;
                }
                let arrival = self.group.arrival(holder, 4 * slice.len());
                exchange.send(&part, holder, arrival);
                let buffer = Tensor::empty([slice.len() as i64], (Kind::Float, Device::Cpu));
                exchange.receive(&buffer, holder, self.group.stamped(holder));
                theirs.push(Some(buffer));
            }
            received.push(theirs);
        }
        Phase::Cross(exchange, received)
    }

    /// Each slice's sum, added up in island order (so every holder has the same bits),
    /// into this member's piece.
    fn add_up(&mut self, received: Vec<Vec<Option<Tensor>>>) {
        tch::no_grad(|| {
            for ((slice, _), theirs) in self.plan.slices.iter().zip(received) {
                let mut part = self.work.narrow(0, slice.start as i64, slice.len() as i64);
                let mine = part.copy();
                let mut parts = theirs
                    .into_iter()
                    .map(|t| t.unwrap_or_else(|| mine.shallow_clone()));
                let Some(mut sum) = parts.next().map(|first| first.copy()) else {
                    continue;
                };
                for next in parts {
                    let _ = sum.g_add_(&next);
                }
                part.copy_(&sum);
            }
        });
    }

    /// The all-gather inside the island, or the shards' handover.
    fn start_finish(&mut self) -> Phase {
        if self.sharded {
            let mut exchange = Exchange::new(&self.group.cross, self.tag);
            for (peer, range) in &self.plan.handover.sends {
                let part = self.work.narrow(0, range.start as i64, range.len() as i64);
                let arrival = self.group.arrival(*peer, 4 * range.len());
                exchange.send(&part, *peer, arrival);
            }
            for (peer, range) in &self.plan.handover.receives {
                let into = self.work.narrow(0, range.start as i64, range.len() as i64);
                exchange.receive(&into, *peer, self.group.stamped(*peer));
            }
            return Phase::Finish(exchange);
        }
        // Each island member's piece to every other member of the island.
        let mut exchange = Exchange::new(&self.group.island, self.tag);
        let place = self.group.islands.of(self.group.me).1;
        let counts = &self.plan.island_counts;
        let starts = counts
            .iter()
            .scan(0, |at, &c| Some(std::mem::replace(at, *at + c)));
        let pieces: Vec<(usize, i64, i64)> = (starts.zip(counts).enumerate())
            .filter(|(_, (_, &count))| count > 0)
            .map(|(p, (start, &count))| (p, start as i64, count as i64))
            .collect();
        if let Some(&(_, at, len)) = pieces.iter().find(|(p, _, _)| *p == place) {
            for p in (0..counts.len()).filter(|&p| p != place) {
                let arrival = (self.group).arrival(self.group.island_member(p), 4 * len as usize);
                exchange.send(&self.work.narrow(0, at, len), p, arrival);
            }
        }
        for &(p, start, count) in pieces.iter().filter(|(p, _, _)| *p != place) {
            let stamped = self.group.stamped(self.group.island_member(p));
            exchange.receive(&self.work.narrow(0, start, count), p, stamped);
        }
        Phase::Finish(exchange)
    }
}

impl Drop for PendingHierarchical {
    /// An abandoned reduction finishes its messages in flight (their buffers must outlive
    /// them) and starts no more.
    fn drop(&mut self) {
        if let Phase::Cross(exchange, _) | Phase::Finish(exchange) = &mut self.phase {
            exchange.wait();
        }
    }
}

/// Point-to-point messages of fp32 host ranges in flight, each under one tag (a range
/// beyond MPI's `int` counts in several messages, which MPI keeps in order).
struct Exchange {
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
    fn new(comm: &MpiCommunicator, tag: i32) -> Self {
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
    fn send(&mut self, part: &Tensor, peer: usize, arrival: Option<f64>) {
        if let Some(arrival) = arrival {
            self.post_stamp(Tensor::from_slice(&[arrival]), peer, true);
        }
        self.post(part, peer, true);
    }

    /// Receives into the contiguous fp32 CPU `into` from `peer`, and its arrival time
    /// first where it is `stamped`.
    fn receive(&mut self, into: &Tensor, peer: usize, stamped: bool) {
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
        let mut request = std::mem::MaybeUninit::uninit();
        // SAFETY: `stamp` is a one-element fp64 CPU tensor, kept alive in `buffers`
        // until every request has completed; `comm` outlives the exchange (see `post`).
        unsafe {
            let at = stamp.data_ptr();
            let (peer, tag, comm) = (peer as i32, self.tag, self.comm);
            let datatype = mpi::ffi::RSMPI_DOUBLE;
            match send {
                true => mpi::ffi::MPI_Isend(at, 1, datatype, peer, tag, comm, request.as_mut_ptr()),
                false => {
                    mpi::ffi::MPI_Irecv(at, 1, datatype, peer, tag, comm, request.as_mut_ptr())
                }
            };
            self.requests.push(request.assume_init());
        }
        self.buffers.push(stamp);
    }

    fn post(&mut self, buffer: &Tensor, peer: usize, send: bool) {
        let numel = buffer.numel();
        let mut offset = 0;
        while offset < numel {
            let count = (numel - offset).min(MAX_ELEMENTS_PER_CALL);
            let mut request = std::mem::MaybeUninit::uninit();
            // SAFETY: `buffer` is a contiguous fp32 CPU tensor of `numel` elements, kept
            // alive in `buffers` until every request has completed; `comm` is the
            // group's own communicator, which outlives the reduction (its
            // HierarchicalGroup is held by the PendingHierarchical that owns this).
            unsafe {
                let at = (buffer.data_ptr() as *mut f32).add(offset).cast();
                match send {
                    true => mpi::ffi::MPI_Isend(
                        at,
                        count as i32,
                        mpi::ffi::RSMPI_FLOAT,
                        peer as i32,
                        self.tag,
                        self.comm,
                        request.as_mut_ptr(),
                    ),
                    false => mpi::ffi::MPI_Irecv(
                        at,
                        count as i32,
                        mpi::ffi::RSMPI_FLOAT,
                        peer as i32,
                        self.tag,
                        self.comm,
                        request.as_mut_ptr(),
                    ),
                };
                self.requests.push(request.assume_init());
            }
            offset += count;
        }
        self.buffers.push(buffer.shallow_clone());
    }

    /// Whether every message has completed (MPI moves them on inside this call).
    fn test(&mut self) -> bool {
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

    fn wait(&mut self) {
        if !self.requests.is_empty() {
            let _wait = waiting("hierarchical exchange", &self.group, None);
            poll_until(|| self.test());
        }
    }
}
