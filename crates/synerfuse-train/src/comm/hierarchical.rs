//! The hierarchical reduction of [`super::islands`], in flight like any other collective:
//! a reduce-scatter inside this member's island, its piece's partial sums exchanged with
//! the members of the other islands that hold the same elements (point to point over
//! host-staged MPI, on a communicator of the group's own), then an all-gather inside the
//! island, or for the distributed optimizer each island piece handed to the members whose
//! shards it holds. Each phase starts when the last one has completed, as the caller
//! drives it ([`PendingHierarchical::progress`]). Across emulated nodes, the exchanges
//! arrive no sooner than the plan's links carry them ([`super::emulated_links`]).
//!
//! Inside an island of CUDA ranks that can all load NCCL (on one host, links not
//! emulated) the reduce-scatter and all-gather run over NCCL on the GPUs, and only the
//! member's piece goes through host memory for the exchange across; inside any other
//! island, MPI carries them (fp32 through host memory: a CUDA member's tensor is copied to
//! the host and back).

use super::devices::{GroupPath, RankDevice};
use super::emulated_links::{monotonic_s, LinkEmulation, Traffic};
use super::exchange::Exchange;
use super::host::poll_until;
use super::islands::{HierarchicalPlan, Islands};
use super::watchdog::waiting;
use super::{CommError, MpiCommunicator, NcclCommunicator, PendingAllReduce, PendingNccl};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
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
    /// NCCL over this member's island, where it has two or more members, all CUDA ranks
    /// that can load NCCL, on one host whose links are not emulated.
    island_nccl: Option<NcclCommunicator>,
    /// The whole group again, for the point-to-point exchanges only.
    cross: MpiCommunicator,
    /// This member's group rank.
    me: usize,
    next_tag: Cell<i32>,
    /// The run's emulated links, and each member's world rank: exchanges across
    /// emulated nodes arrive no sooner than the links carry them.
    links: Option<(Rc<LinkEmulation>, Vec<usize>)>,
    /// The reductions in flight, by the order they started (one order on every member).
    /// Driving one drives those before it. Collectives on one NCCL communicator must be
    /// issued in one order by every member, and the exchanges across islands complete
    /// in whatever order they do: so an NCCL island's reduce-scatters start as the
    /// reductions start, and its all-gathers only inside a wait, in the order the
    /// reductions started (every member starts and waits for the group's reductions in
    /// one order, so the island's collectives interleave alike everywhere).
    flights: RefCell<BTreeMap<u64, Flight>>,
    next_flight: Cell<u64>,
}

impl HierarchicalGroup {
    /// The islands of `group` (world ranks `members`, computing on `devices`) given
    /// each member's island key (collective over `group`: every member splits it, and the
    /// members of an island that NCCL can carry create its communicator), or `None` where
    /// a hierarchical reduction would be the flat one ([`Islands::hierarchical`]).
    pub(crate) fn new<K: PartialEq>(
        group: &MpiCommunicator,
        keys: &[K],
        members: &[usize],
        devices: &[RankDevice],
        emulation: Option<&Rc<LinkEmulation>>,
    ) -> Result<Option<Rc<Self>>, CommError> {
        let islands = Islands::from_keys(keys);
        if !islands.hierarchical() {
            return Ok(None);
        }
        let me = group.rank();
        let (mine, place) = islands.of(me);
        let (Some(island), Some(cross)) = (
            group.split(Some(mine as u32), place),
            group.split(Some(0), me),
        ) else {
            return Ok(None);
        };
        let island = island.with_name(format!("{}, island {mine}", group.name()));
        let island_world: Vec<usize> = islands.members()[mine]
            .iter()
            .map(|&m| members[m])
            .collect();
        let island_nccl = island_nccl(&island, &island_world, devices, emulation)?;
        Ok(Some(Rc::new(HierarchicalGroup {
            island,
            island_nccl,
            cross: cross.with_name(format!("{}, across its islands", group.name())),
            islands,
            me,
            next_tag: Cell::new(TAGS.start),
            links: emulation.map(|e| (Rc::clone(e), members.to_vec())),
            flights: RefCell::new(BTreeMap::new()),
            next_flight: Cell::new(0),
        })))
    }

    /// Finalizes its island's NCCL communicator, if any (see [`super::SetGroups`]'s
    /// teardown); a failure is logged, as teardown goes on.
    pub(crate) fn finalize(&self) {
        if let Some(Err(e)) = self.island_nccl.as_ref().map(NcclCommunicator::finalize) {
            tracing::warn!("{}: {e}", self.island.name());
        }
    }

    /// What carries the reduce-scatter and all-gather inside this member's island.
    pub(crate) fn island_transport(&self) -> &'static str {
        match self.island_nccl {
            Some(_) => "NCCL",
            None => "MPI",
        }
    }

    /// This member's island (group ranks).
    pub(crate) fn own_island(&self) -> &[usize] {
        &self.islands.members()[self.islands.of(self.me).0]
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
        self.own_island()[place]
    }

    /// When this member's island's reduce-scatter of pieces of at most `largest` fp32
    /// elements completes on the emulated links (a site's island spans nodes), `None`
    /// where they are not emulated.
    fn island_scatter_done(&self, largest: usize) -> Option<f64> {
        let (emulation, world) = self.links.as_ref()?;
        let ranks: Vec<usize> = self.own_island().iter().map(|&m| world[m]).collect();
        emulation.ring(&ranks, ranks.len() - 1, 4.0 * largest as f64)
    }

    /// The islands, as group ranks.
    pub(crate) fn islands(&self) -> &Islands {
        &self.islands
    }

    /// The next reduction's tag.
    fn take_tag(&self) -> i32 {
        let tag = self.next_tag.get();
        self.next_tag.set(match tag + 1 < TAGS.end {
            true => tag + 1,
            false => TAGS.start,
        });
        tag
    }

    /// Moves on every reduction in flight that started up to `upto`, in the order they
    /// started, inside a wait for `upto` when `waiting` (see `flights`); whether `upto`
    /// has completed.
    fn drive(&self, upto: u64, waiting: bool) -> bool {
        let mut flights = self.flights.borrow_mut();
        let mut in_turn = waiting;
        for (_, flight) in flights.range_mut(..=upto) {
            flight.progress(self, in_turn);
            in_turn &= flight.gathering();
        }
        flights.get(&upto).is_none_or(Flight::done)
    }
}

/// NCCL over the island `island` (world ranks `members`), where NCCL can carry it: two
/// or more CUDA ranks that can load it, on one host (two ranks on one GPU fall back to
/// MPI, as they always could), whose links the plan does not emulate (NCCL's transfers
/// are not emulated). Collective over the island.
fn island_nccl(
    island: &MpiCommunicator,
    members: &[usize],
    devices: &[RankDevice],
    emulation: Option<&Rc<LinkEmulation>>,
) -> Result<Option<NcclCommunicator>, CommError> {
    if emulation.is_some_and(|e| e.spans(members)) {
        return Ok(None);
    }
    match GroupPath::of(members, devices) {
        Ok(GroupPath::Nccl) => {
            let me = members[island.rank()];
            let ordinal = devices[me].cuda.unwrap_or(0);
            NcclCommunicator::new(island, ordinal).map(Some)
        }
        Ok(_) | Err(CommError::SharedGpu { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

impl HierarchicalGroup {
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
        let shard = match shards {
            Some(shards) => {
                super::pieces::piece_starts(rank, self.islands.size(), shards, numel, op)?;
                Some(super::islands::ranges(shards)[rank].clone())
            }
            None => None,
        };
        let plan = HierarchicalPlan::new(&self.islands, self.me, numel, shards);
        let flight = Flight::start(self, tensor, plan, shard)?;
        let ticket = self.next_flight.get();
        self.next_flight.set(ticket + 1);
        self.flights.borrow_mut().insert(ticket, flight);
        Ok(PendingHierarchical {
            group: Rc::clone(self),
            ticket,
            op,
            result: None,
        })
    }
}

/// Where a hierarchical reduction is.
enum Phase {
    /// The reduce-scatter inside the island (none for an island of one), and when it
    /// completes on the emulated links.
    Scatter(Option<IslandScatter>, Option<f64>),
    /// The partial sums of this member's piece going to, and coming from, the other
    /// islands' holders; the received ones by slice, in the slices' holder order.
    Cross(Exchange, Vec<Vec<Option<Tensor>>>),
    /// The all-gather inside an MPI island, or the handover of the shards: point to
    /// point, each under the reduction's tag, because reductions reach this phase in
    /// whatever order their exchanges complete on each member, and collectives on one
    /// communicator must start in one order everywhere.
    Finish(Exchange),
    /// The all-gather inside an NCCL island (started inside a wait, in the reductions'
    /// order: see [`HierarchicalGroup`]'s `flights`).
    Gather(PendingNccl),
    Done,
    Failed(CommError),
}

/// The reduce-scatter inside an island.
enum IslandScatter {
    Mpi(PendingAllReduce),
    Nccl(PendingNccl),
}

impl IslandScatter {
    fn test(&mut self) -> Result<bool, CommError> {
        match self {
            IslandScatter::Mpi(pending) => Ok(pending.test()),
            IslandScatter::Nccl(pending) => pending.test(),
        }
    }

    fn wait(self) -> Result<(), CommError> {
        match self {
            IslandScatter::Mpi(pending) => {
                pending.wait();
                Ok(())
            }
            IslandScatter::Nccl(pending) => pending.wait(),
        }
    }
}

/// One reduction in flight, held by its group ([`HierarchicalGroup::drive`]).
struct Flight {
    phase: Phase,
    /// What the island's collectives run on: a host buffer over MPI, a buffer on this
    /// member's GPU over NCCL (the caller's tensor itself, or a copy of it).
    work: Tensor,
    /// The host buffer of the exchanges across islands and the handover, and the
    /// element it starts at: `work` itself, from 0, on an MPI island; on an NCCL island a
    /// copy of the part of `work` holding this member's piece (and shard), made once the
    /// island's reduce-scatter has completed.
    host: Option<(Tensor, usize)>,
    plan: HierarchicalPlan,
    tag: i32,
    /// This member's shard, under the distributed optimizer.
    shard: Option<Range<usize>>,
    /// The caller's tensor and the elements to copy into it, when `work` is not it.
    copy_back: Option<(Tensor, Range<usize>)>,
}

impl Flight {
    /// Starts the island's reduce-scatter of `tensor` (a copy of it where the result
    /// must not land in it directly).
    fn start(
        group: &HierarchicalGroup,
        tensor: &Tensor,
        plan: HierarchicalPlan,
        shard: Option<Range<usize>>,
    ) -> Result<Self, CommError> {
        let device = match &group.island_nccl {
            Some(nccl) => Device::Cuda(nccl.ordinal()),
            None => Device::Cpu,
        };
        // In place when the whole sum lands in the caller's tensor; a copy otherwise.
        let in_place = shard.is_none() && tensor.device() == device && tensor.is_contiguous();
        let work = match in_place {
            true => tensor.shallow_clone(),
            false => tch::no_grad(|| tensor.detach().to_device(device).contiguous().copy()),
        };
        let copy_back = (!in_place).then(|| {
            let range = shard.clone().unwrap_or(0..tensor.numel());
            (tensor.shallow_clone(), range)
        });
        let host = (device == Device::Cpu).then(|| (work.shallow_clone(), 0));
        let (scatter, done) = match group.own_island().len() {
            1 => (None, None),
            _ => {
                let counts = &plan.island_counts;
                let scatter = match &group.island_nccl {
                    Some(nccl) => {
                        IslandScatter::Nccl(nccl.start_reduce_scatter_sum(&work, counts)?)
                    }
                    None => {
                        IslandScatter::Mpi(group.island.start_reduce_scatter_sum(&work, counts)?)
                    }
                };
                let largest = counts.iter().copied().max().unwrap_or(0);
                (Some(scatter), group.island_scatter_done(largest))
            }
        };
        Ok(Flight {
            phase: Phase::Scatter(scatter, done),
            work,
            host,
            plan,
            tag: group.take_tag(),
            shard,
            copy_back,
        })
    }

    /// Whether its last phase has started (or it has ended).
    fn gathering(&self) -> bool {
        !matches!(self.phase, Phase::Scatter(..) | Phase::Cross(..))
    }

    fn done(&self) -> bool {
        matches!(self.phase, Phase::Done | Phase::Failed(_))
    }

    /// Moves it on as far as it goes without waiting; `in_turn`: whether it may start an
    /// NCCL all-gather (inside a wait, every reduction started before it having started
    /// its last phase).
    fn progress(&mut self, group: &HierarchicalGroup, in_turn: bool) {
        loop {
            self.phase = match self.step(group, in_turn) {
                Ok(Some(next)) => next,
                Ok(None) => return,
                Err(e) => Phase::Failed(e),
            };
        }
    }

    /// The next phase, where the current one has completed.
    fn step(
        &mut self,
        group: &HierarchicalGroup,
        in_turn: bool,
    ) -> Result<Option<Phase>, CommError> {
        match &mut self.phase {
            Phase::Scatter(scatter, done) => {
                let scattered = match scatter.as_mut() {
                    Some(s) => s.test()?,
                    None => true,
                };
                if !scattered || !done.is_none_or(|at| monotonic_s() >= at) {
                    return Ok(None);
                }
                if let Some(s) = scatter.take() {
                    s.wait()?;
                }
                Ok(Some(self.start_cross(group)))
            }
            Phase::Cross(exchange, received) => {
                let nccl_gather = group.island_nccl.is_some() && self.shard.is_none();
                if !exchange.test() || (nccl_gather && !in_turn) {
                    return Ok(None);
                }
                let received = std::mem::take(received);
                self.add_up(received);
                self.start_finish(group).map(Some)
            }
            Phase::Finish(exchange) => Ok(exchange.test().then(|| self.complete())),
            Phase::Gather(pending) => {
                if !pending.test()? {
                    return Ok(None);
                }
                if let Phase::Gather(pending) = std::mem::replace(&mut self.phase, Phase::Done) {
                    pending.wait()?;
                }
                Ok(Some(self.complete()))
            }
            Phase::Done | Phase::Failed(_) => Ok(None),
        }
    }

    /// Elements `range` of the host buffer.
    fn host_part(&self, range: &Range<usize>) -> Tensor {
        let (host, at) = self
            .host
            .as_ref()
            .expect("the host buffer exists from the exchange on");
        host.narrow(0, (range.start - at) as i64, range.len() as i64)
    }

    /// The host copy of this member's piece (and shard) on an NCCL island.
    fn stage_to_host(&mut self) {
        if self.host.is_some() {
            return;
        }
        let piece = &self.plan.piece;
        let span = match &self.shard {
            Some(shard) => piece.start.min(shard.start)..piece.end.max(shard.end),
            None => piece.clone(),
        };
        let part = self.work.narrow(0, span.start as i64, span.len() as i64);
        let host = tch::no_grad(|| part.to_device(Device::Cpu).contiguous());
        self.host = Some((host, span.start));
    }

    /// Sends this member's partial sums of each slice to the slice's other holders and
    /// receives theirs.
    fn start_cross(&mut self, group: &HierarchicalGroup) -> Phase {
        self.stage_to_host();
        let mut exchange = Exchange::new(&group.cross, self.tag);
        let mut received = Vec::with_capacity(self.plan.slices.len());
        for (slice, holders) in &self.plan.slices {
            let part = self.host_part(slice);
            let mut theirs = Vec::with_capacity(holders.len());
            for &holder in holders {
                if holder == group.me {
                    theirs.push(None);
                    continue;
                }
                let arrival = group.arrival(holder, 4 * slice.len());
                exchange.send(&part, holder, arrival);
                let buffer = Tensor::empty([slice.len() as i64], (Kind::Float, Device::Cpu));
                exchange.receive(&buffer, holder, group.stamped(holder));
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
                let mut part = self.host_part(slice);
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
    fn start_finish(&mut self, group: &HierarchicalGroup) -> Result<Phase, CommError> {
        if self.shard.is_some() {
            let mut exchange = Exchange::new(&group.cross, self.tag);
            for (peer, range) in &self.plan.handover.sends {
                let arrival = group.arrival(*peer, 4 * range.len());
                exchange.send(&self.host_part(range), *peer, arrival);
            }
            for (peer, range) in &self.plan.handover.receives {
                exchange.receive(&self.host_part(range), *peer, group.stamped(*peer));
            }
            return Ok(Phase::Finish(exchange));
        }
        if let Some(nccl) = &group.island_nccl {
            let piece = &self.plan.piece;
            let (at, len) = (piece.start as i64, piece.len() as i64);
            let summed = self.host_part(piece);
            tch::no_grad(|| self.work.narrow(0, at, len).copy_(&summed));
            let gather = nccl.start_all_gather_in_place(&self.work, &self.plan.island_counts)?;
            return Ok(Phase::Gather(gather));
        }
        Ok(Phase::Finish(self.island_gather(group)))
    }

    /// Each MPI island member's piece to every other member of the island.
    fn island_gather(&self, group: &HierarchicalGroup) -> Exchange {
        let mut exchange = Exchange::new(&group.island, self.tag);
        let place = group.islands.of(group.me).1;
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
                let arrival = group.arrival(group.island_member(p), 4 * len as usize);
                exchange.send(&self.work.narrow(0, at, len), p, arrival);
            }
        }
        for &(p, start, count) in pieces.iter().filter(|(p, _, _)| *p != place) {
            let stamped = group.stamped(group.island_member(p));
            exchange.receive(&self.work.narrow(0, start, count), p, stamped);
        }
        exchange
    }

    /// The result into the caller's tensor, where `work` is not it: the whole sum from
    /// `work`, or this member's shard from the host buffer.
    fn complete(&mut self) -> Phase {
        if let Some((target, range)) = self.copy_back.take() {
            let source = match self.shard.is_some() {
                true => self.host_part(&range),
                false => (self.work).narrow(0, range.start as i64, range.len() as i64),
            };
            let (start, len) = (range.start as i64, range.len() as i64);
            tch::no_grad(|| target.narrow(0, start, len).copy_(&source));
        }
        Phase::Done
    }
}

impl Drop for Flight {
    /// An abandoned reduction finishes its messages in flight (their buffers must outlive
    /// them) and starts no more (an NCCL collective in flight waits in its own drop).
    fn drop(&mut self) {
        if let Phase::Cross(exchange, _) | Phase::Finish(exchange) = &mut self.phase {
            exchange.wait();
        }
    }
}

/// A hierarchical reduction in flight: the caller leaves its tensor alone until
/// [`Self::wait`], and drives it with [`Self::progress`] meanwhile (which also drives
/// the group's reductions started before it). Every member starts and waits for the
/// group's reductions in one order.
pub struct PendingHierarchical {
    group: Rc<HierarchicalGroup>,
    /// Its place among the group's reductions ([`HierarchicalGroup::drive`]).
    ticket: u64,
    op: &'static str,
    /// Its outcome, once it has completed.
    result: Option<Result<(), CommError>>,
}

impl PendingHierarchical {
    /// Moves it on as far as it goes without waiting; whether it has completed (on an
    /// NCCL island, an all-reduce completes only inside [`Self::wait`]).
    pub fn progress(&mut self) -> bool {
        self.advance(false)
    }

    /// Moves it on, inside a wait when `waiting`; whether it has completed.
    fn advance(&mut self, waiting: bool) -> bool {
        if self.result.is_some() {
            return true;
        }
        if !self.group.drive(self.ticket, waiting) {
            return false;
        }
        let flight = self.group.flights.borrow_mut().remove(&self.ticket);
        self.result = Some(
            match flight.map(|mut f| std::mem::replace(&mut f.phase, Phase::Done)) {
                Some(Phase::Failed(e)) => Err(e),
                _ => Ok(()),
            },
        );
        true
    }

    /// Waits for the result, which is then in the tensor the reduction started from.
    pub fn wait(mut self) -> Result<(), CommError> {
        let _wait = waiting(self.op, &self.group.cross.shared_name(), None);
        poll_until(|| self.advance(true));
        self.result.take().unwrap_or(Ok(()))
    }
}

impl Drop for PendingHierarchical {
    fn drop(&mut self) {
        let flight = self.group.flights.borrow_mut().remove(&self.ticket);
        drop(flight);
    }
}
