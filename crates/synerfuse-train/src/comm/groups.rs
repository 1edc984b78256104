//! Communicators over groups of ranks: [`SetGroups`] over any sets of ranks (what the
//! trainer uses: one per gradient reduction's members), [`ProcessGroups`] over a grid's
//! group kinds in Megatron's order (the multi-rank communicator checks). NCCL where every
//! member is a CUDA rank, MPI with host staging otherwise; over MPI a group whose members
//! sit on several hosts (islands) reduces hierarchically ([`super::hierarchical`]).

use super::devices::{check_and_log, GroupPath, RankDevice};
use super::emulated_links::{wait_for, wait_until, LinkEmulation, PlannedHosts};
use super::hierarchical::{HierarchicalGroup, PendingHierarchical, MIN_ELEMENTS};
use super::nccl::PendingNccl;
use super::{CommError, MpiCommunicator, NcclCommunicator, PendingAllReduce};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use synerfuse_plan::{GroupKind, Topology};
use tch::{Device, Tensor};

/// One group's communicator: NCCL for all-CUDA groups, MPI (host staging) otherwise.
/// The MPI communicator is always there (barriers, and the NCCL bootstrap).
pub struct GroupCommunicator {
    mpi: MpiCommunicator,
    nccl: Option<NcclCommunicator>,
    /// Its islands, where its members sit on more than one host and share one with
    /// another member: its fp32 reductions over MPI then go hierarchically.
    hierarchy: Option<std::rc::Rc<HierarchicalGroup>>,
    /// Its emulated links, where its MPI collectives cross emulated nodes.
    links: Option<GroupLinks>,
}

/// A group's members (world ranks) on the run's emulated links.
struct GroupLinks {
    emulation: Rc<LinkEmulation>,
    members: Vec<usize>,
}

impl GroupLinks {
    /// When a ring collective of `steps` steps of `chunk` bytes completes here.
    fn ring(&self, steps: usize, chunk: f64) -> Option<f64> {
        self.emulation.ring(&self.members, steps, chunk)
    }
}

impl GroupCommunicator {
    /// A group carried by MPI alone.
    pub fn mpi(mpi: MpiCommunicator) -> Self {
        Self {
            mpi,
            nccl: None,
            hierarchy: None,
            links: None,
        }
    }

    /// When an MPI collective over the group completes on the emulated links, `None`
    /// where they are not emulated (or NCCL carries `tensor`): `steps` ring steps of
    /// `chunk` elements of `tensor`.
    fn emulated(&self, tensor: &Tensor, steps: usize, chunk: usize) -> Option<f64> {
        let links = self
            .links
            .as_ref()
            .filter(|_| self.nccl_for(tensor).is_none())?;
        links.ring(steps, (chunk * tensor.kind().elt_size_in_bytes()) as f64)
    }

    /// Ring steps of an all-reduce (a reduce-scatter and an all-gather).
    fn all_reduce_steps(&self) -> usize {
        2 * (self.size() - 1)
    }

    /// The group's islands, each its members (group ranks), where it reduces
    /// hierarchically.
    pub fn islands(&self) -> Option<&[Vec<usize>]> {
        (self.hierarchy.as_ref()).map(|h| h.islands().members())
    }

    /// The hierarchy that reduces the 1-D fp32 `tensor`, where one does: MPI carries it
    /// and it is not tiny.
    fn hierarchy_for(&self, tensor: &Tensor) -> Option<&std::rc::Rc<HierarchicalGroup>> {
        (self.hierarchy.as_ref()).filter(|_| {
            self.nccl_for(tensor).is_none()
                && tensor.kind() == tch::Kind::Float
                && tensor.dim() == 1
                && tensor.numel() >= MIN_ELEMENTS
        })
    }

    /// This rank's position in the group.
    pub fn rank(&self) -> usize {
        self.mpi.rank()
    }

    /// Members.
    pub fn size(&self) -> usize {
        self.mpi.size()
    }

    fn nccl_for(&self, tensor: &Tensor) -> Option<&NcclCommunicator> {
        self.nccl
            .as_ref()
            .filter(|_| matches!(tensor.device(), Device::Cuda(_)))
    }

    /// Element-wise sum over the group, in place.
    pub fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<(), CommError> {
        if let Some(hierarchy) = self.hierarchy_for(tensor) {
            return hierarchy.start(tensor, None)?.wait();
        }
        let chunk = tensor.numel().div_ceil(self.size());
        let done = self.emulated(tensor, self.all_reduce_steps(), chunk);
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.all_reduce_sum(tensor)?,
            None => self.mpi.all_reduce_sum(tensor)?,
        }
        wait_for(done);
        Ok(())
    }

    /// Starts summing the fp32 `tensor` over the group (NCCL on its own stream, or
    /// non-blocking MPI) and returns at once; see [`PendingReduction`].
    pub fn start_all_reduce_sum(&self, tensor: &Tensor) -> Result<PendingReduction, CommError> {
        if let Some(hierarchy) = self.hierarchy_for(tensor) {
            return Ok(PendingReduction::Hierarchical(Box::new(
                hierarchy.start(tensor, None)?,
            )));
        }
        let chunk = tensor.numel().div_ceil(self.size());
        let done = self.emulated(tensor, self.all_reduce_steps(), chunk);
        let pending = match self.nccl_for(tensor) {
            Some(nccl) => PendingReduction::Nccl(nccl.start_all_reduce_sum(tensor)?),
            None => PendingReduction::Mpi(self.mpi.start_all_reduce_sum(tensor)?),
        };
        Ok(pending.until(done))
    }

    /// Starts summing the fp32 1-D `tensor` over the group so that member `r` gets
    /// its piece, the `counts[r]` elements after `counts[..r]`, in that piece of its
    /// `tensor` (the rest left as it was; see
    /// [`MpiCommunicator::start_reduce_scatter_sum`]). Each element is reduced once: on
    /// NCCL one reduce-scatter when the pieces are equal, one reduce per piece to its
    /// member otherwise ([`NcclCommunicator::start_reduce_scatter_sum`]).
    pub fn start_reduce_scatter_sum(
        &self,
        tensor: &Tensor,
        counts: &[usize],
    ) -> Result<PendingReduction, CommError> {
        if let Some(hierarchy) = self.hierarchy_for(tensor) {
            let pending = hierarchy.start(tensor, Some(counts))?;
            return Ok(PendingReduction::Hierarchical(Box::new(pending)));
        }
        let largest = counts.iter().copied().max().unwrap_or(0);
        let done = self.emulated(tensor, self.size() - 1, largest);
        let pending = match self.nccl_for(tensor) {
            Some(nccl) => PendingReduction::Nccl(nccl.start_reduce_scatter_sum(tensor, counts)?),
            None => PendingReduction::Mpi(self.mpi.start_reduce_scatter_sum(tensor, counts)?),
        };
        Ok(pending.until(done))
    }

    /// Copies member `m`'s piece of the 1-D `tensor` (the `counts[m]` elements after
    /// `counts[..m]`) into every member's `tensor`, in its own dtype (bf16 included):
    /// what the distributed optimizer gathers its updated shards with, straight into the
    /// parameters. NCCL's all-gather, or its broadcasts per piece when the pieces differ
    /// ([`NcclCommunicator::all_gather_in_place`]); MPI's `Allgatherv` otherwise
    /// ([`MpiCommunicator::all_gather_in_place`]).
    pub fn all_gather_in_place(
        &self,
        tensor: &mut Tensor,
        counts: &[usize],
    ) -> Result<(), CommError> {
        let largest = counts.iter().copied().max().unwrap_or(0);
        let done = self.emulated(tensor, self.size() - 1, largest);
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.all_gather_in_place(tensor, counts)?,
            None => self.mpi.all_gather_in_place(tensor, counts)?,
        }
        wait_for(done);
        Ok(())
    }

    /// Starts [`Self::all_gather_in_place`] and returns at once (NCCL on its own stream,
    /// or a non-blocking MPI `Allgatherv`): `tensor` is complete when the returned
    /// collective's [`PendingReduction::wait`] returns, and the caller leaves it alone
    /// until then.
    pub fn start_all_gather_in_place(
        &self,
        tensor: &Tensor,
        counts: &[usize],
    ) -> Result<PendingReduction, CommError> {
        let largest = counts.iter().copied().max().unwrap_or(0);
        let done = self.emulated(tensor, self.size() - 1, largest);
        let pending = match self.nccl_for(tensor) {
            Some(nccl) => PendingReduction::Nccl(nccl.start_all_gather_in_place(tensor, counts)?),
            None => PendingReduction::Mpi(self.mpi.start_all_gather_in_place(tensor, counts)?),
        };
        Ok(pending.until(done))
    }

    /// Copies `root`'s tensor into every member's.
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CommError> {
        let done = self.emulated(tensor, 1, tensor.numel());
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.broadcast(tensor, root)?,
            None => self.mpi.broadcast(tensor, root)?,
        }
        wait_for(done);
        Ok(())
    }

    /// Every member's tensor stacked in member order.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        let done = self.emulated(tensor, self.size() - 1, tensor.numel());
        let gathered = match self.nccl_for(tensor) {
            Some(nccl) => nccl.all_gather(tensor)?,
            None => self.mpi.all_gather(tensor)?,
        };
        wait_for(done);
        Ok(gathered)
    }

    /// Sum over members, scattered by leading rows.
    pub fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        let chunk = tensor.numel().div_ceil(self.size());
        let done = self.emulated(tensor, self.size() - 1, chunk);
        let piece = match self.nccl_for(tensor) {
            Some(nccl) => nccl.reduce_scatter_sum(tensor)?,
            None => self.mpi.reduce_scatter_sum(tensor)?,
        };
        wait_for(done);
        Ok(piece)
    }

    /// `parts[m]` to member `m`: what each member sent this one, in member order (NCCL
    /// grouped sends and receives on CUDA groups, MPI's `Alltoallv` otherwise; the row
    /// counts go first over MPI).
    pub fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CommError> {
        // Emulated as n − 1 shifts of the largest part.
        let largest = parts.iter().map(Tensor::numel).max().unwrap_or(0);
        let done = (parts.first()).and_then(|p| self.emulated(p, self.size() - 1, largest));
        let received = self.exchange_parts(parts)?;
        wait_for(done);
        Ok(received)
    }

    fn exchange_parts(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CommError> {
        match parts.first().and_then(|p| self.nccl_for(p)) {
            Some(nccl) => {
                // Refused alike on every member before any message.
                super::host::check_parts(self.rank(), self.size(), parts, "all_to_all")?;
                let rows: Vec<Tensor> = (parts.iter())
                    .map(|p| Tensor::from_slice(&[p.size()[0]]))
                    .collect();
                let received = self.mpi.all_to_all(&rows)?;
                let received: Vec<i64> = received.iter().map(|r| r.int64_value(&[0])).collect();
                nccl.all_to_all(parts, &received)
            }
            None => self.mpi.all_to_all(parts),
        }
    }

    /// Sends to a member (blocking until the tensor may be reused).
    pub fn send(&self, tensor: &Tensor, dest: usize, tag: i32) -> Result<(), CommError> {
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.send(tensor, dest),
            None => self.mpi.send(tensor, dest, tag),
        }
    }

    /// Receives from a member into `tensor`.
    pub fn recv(&self, tensor: &mut Tensor, source: usize, tag: i32) -> Result<(), CommError> {
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.recv(tensor, source),
            None => self.mpi.recv(tensor, source, tag),
        }
    }

    /// Waits for every member.
    pub fn barrier(&self) {
        self.mpi.barrier();
    }

    /// Finalizes the NCCL communicator, if any, before it is destroyed (see
    /// [`NcclCommunicator::finalize`]); a failure is logged, as teardown goes on.
    fn finalize(&mut self) {
        if let Some(Err(e)) = self.nccl.as_ref().map(NcclCommunicator::finalize) {
            tracing::warn!("{}: {e}", self.mpi.name());
        }
        if let Some(hierarchy) = &self.hierarchy {
            hierarchy.finalize();
        }
    }
}

/// A tensor-parallel group's collectives, for the model's tensor-parallel forward and
/// backward (NCCL on CUDA groups, MPI with host staging otherwise).
impl synerfuse_model::tp::TpCollectives for GroupCommunicator {
    fn rank(&self) -> usize {
        GroupCommunicator::rank(self)
    }

    fn size(&self) -> usize {
        GroupCommunicator::size(self)
    }

    fn reduce_scatter_sum(
        &self,
        tensor: &Tensor,
    ) -> Result<Tensor, synerfuse_model::tp::CollectiveError> {
        Ok(GroupCommunicator::reduce_scatter_sum(
            self,
            &tensor.detach().contiguous(),
        )?)
    }

    fn all_reduce_sum(
        &self,
        tensor: &Tensor,
    ) -> Result<Tensor, synerfuse_model::tp::CollectiveError> {
        let mut sum = tensor.detach().contiguous().copy();
        GroupCommunicator::all_reduce_sum(self, &mut sum)?;
        Ok(sum)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, synerfuse_model::tp::CollectiveError> {
        Ok(GroupCommunicator::all_gather(
            self,
            &tensor.detach().contiguous(),
        )?)
    }

    fn all_to_all(
        &self,
        parts: &[Tensor],
    ) -> Result<Vec<Tensor>, synerfuse_model::tp::CollectiveError> {
        let parts: Vec<Tensor> = parts.iter().map(|p| p.detach().contiguous()).collect();
        Ok(GroupCommunicator::all_to_all(self, &parts)?)
    }
}

/// A collective in flight (a reduction, or the distributed optimizer's gather): the
/// caller leaves its tensor alone until [`Self::wait`].
pub enum PendingReduction {
    /// On an NCCL stream.
    Nccl(PendingNccl),
    /// A non-blocking MPI all-reduce (host-staged for CUDA tensors).
    Mpi(PendingAllReduce),
    /// A hierarchical reduction over the group's islands, phase by phase.
    Hierarchical(Box<PendingHierarchical>),
    /// A collective over emulated links: complete no sooner than its time on them
    /// ([`super::emulated_links`]).
    Emulated(Box<PendingReduction>, f64),
}

impl PendingReduction {
    /// Lets the reduction progress (MPI advances only inside MPI calls; NCCL on its own);
    /// whether it is known to have completed (an NCCL one is only known at its wait).
    pub fn progress(&mut self) -> bool {
        match self {
            PendingReduction::Mpi(pending) => pending.test(),
            PendingReduction::Hierarchical(pending) => pending.progress(),
            PendingReduction::Nccl(_) => false,
            PendingReduction::Emulated(pending, done) => {
                pending.progress() && super::emulated_links::monotonic_s() >= *done
            }
        }
    }

    /// The collective, complete no sooner than `done` where its links are emulated.
    fn until(self, done: Option<f64>) -> Self {
        match done {
            Some(done) => PendingReduction::Emulated(Box::new(self), done),
            None => self,
        }
    }

    /// Waits for the result, which is then in the tensor the collective started from.
    pub fn wait(self) -> Result<(), CommError> {
        match self {
            PendingReduction::Nccl(pending) => pending.wait(),
            PendingReduction::Mpi(pending) => {
                pending.wait();
                Ok(())
            }
            PendingReduction::Hierarchical(pending) => pending.wait(),
            PendingReduction::Emulated(pending, done) => {
                pending.wait()?;
                wait_until(done);
                Ok(())
            }
        }
    }
}

impl GroupCommunicator {
    /// The communicator of the group `members` (world ranks, in `comm`'s order) made of
    /// `comm`, with NCCL when every member computes on CUDA and can load it; over MPI,
    /// with `hosts` (each world rank's host as the plan names it, `None`: its own), its
    /// islands: the CUDA ranks of one host, and the other ranks of one host; and the
    /// run's emulated links, if any.
    fn over(
        comm: MpiCommunicator,
        members: &[usize],
        devices: &[RankDevice],
        hosts: Option<&PlannedHosts>,
        emulation: Option<&Rc<LinkEmulation>>,
    ) -> Result<Self, CommError> {
        let rank = members[comm.rank()];
        let nccl = match GroupPath::of(members, devices)? {
            GroupPath::Nccl => {
                let ordinal = devices[rank].cuda.expect("NCCL groups are all on CUDA");
                Some(NcclCommunicator::new(&comm, ordinal)?)
            }
            GroupPath::NcclMissing { ranks } => {
                if members[0] == rank {
                    tracing::warn!(
                        "{}: every member computes on CUDA but NCCL cannot be loaded on rank(s) {ranks:?}; its collectives are staged through host memory over MPI",
                        comm.name()
                    );
                }
                None
            }
            GroupPath::Mpi => None,
        };
        let links =
            (emulation.filter(|e| nccl.is_none() && e.spans(members))).map(|e| GroupLinks {
                emulation: Rc::clone(e),
                members: members.to_vec(),
            });
        let hierarchy = match (&nccl, hosts) {
            (None, Some(hosts)) if hosts.hierarchical => {
                let keys = island_keys(members, devices, hosts);
                HierarchicalGroup::new(&comm, &keys, members, devices, emulation)?
            }
            _ => None,
        };
        if let Some(h) = hierarchy.as_ref() {
            log_islands(&comm, members, h);
        }
        if let Some(l) = links.as_ref().filter(|_| members[0] == rank) {
            tracing::info!(
                "{}: its transfers across emulated nodes are delayed as the plan's [network] carries them (ranks' nodes {:?})",
                comm.name(),
                (l.members.iter()).map(|&r| hosts.and_then(|h| h.nodes.get(r)?.as_deref()).unwrap_or("-")).collect::<Vec<_>>()
            );
        }
        Ok(GroupCommunicator {
            mpi: comm,
            nccl,
            hierarchy,
            links,
        })
    }
}

/// The group's islands (by its first member) and each island's transport (by the
/// island's first member, which alone knows it).
fn log_islands(comm: &MpiCommunicator, members: &[usize], hierarchy: &HierarchicalGroup) {
    let world = |island: &[usize]| island.iter().map(|&m| members[m]).collect::<Vec<_>>();
    if comm.rank() == 0 {
        let islands: Vec<Vec<usize>> = (hierarchy.islands().members().iter())
            .map(|island| world(island))
            .collect();
        tracing::info!(
            "{}: islands {islands:?}; fp32 reductions of {MIN_ELEMENTS}+ elements reduce-scatter inside each island, exchange their pieces across the islands over host-staged MPI, and gather inside each island",
            comm.name()
        );
    }
    let island = hierarchy.own_island();
    if island.len() > 1 && island[0] == comm.rank() {
        tracing::info!(
            "{}: island {:?} reduce-scatters and gathers over {}",
            comm.name(),
            world(island),
            hierarchy.island_transport()
        );
    }
}

/// Each member's island key: its site where the members span several sites (the
/// slowest links are between sites; the reduction crosses them once), else its node
/// (as the plan names it, or its real host); and whether it computes on CUDA.
fn island_keys(
    members: &[usize],
    devices: &[RankDevice],
    hosts: &PlannedHosts,
) -> Vec<(String, bool)> {
    let site = |r: usize| hosts.sites.get(r).map_or("", String::as_str);
    let by_site = members.iter().any(|&r| site(r) != site(members[0]));
    (members.iter())
        .map(|&r| {
            let node = hosts.nodes.get(r).cloned().flatten();
            let key = match by_site {
                true => format!("site {}", site(r)),
                false => node.unwrap_or_else(|| format!("host {:x}", devices[r].host)),
            };
            (key, devices[r].cuda.is_some())
        })
        .collect()
}

/// Communicators over any sets of ranks (the holders of a gradient segment, every copy of
/// a tied embedding), one per distinct set of two or more ranks, NCCL where every member
/// computes on CUDA: the groups of a general plan, which no grid describes.
pub struct SetGroups {
    /// By member list, so that every rank tears them down in one order (see `Drop`).
    groups: BTreeMap<Vec<usize>, GroupCommunicator>,
    devices: Vec<RankDevice>,
    /// The run's emulated links, if its plan carries a network.
    emulation: Option<Rc<LinkEmulation>>,
}

impl Drop for SetGroups {
    /// Tears the communicators down in one order on every rank, by member list: NCCL's
    /// finalize may wait for the other members, so ranks going through their groups in
    /// different orders (a hash map's, which differs from process to process) could each
    /// wait on a group the other has not reached. Every NCCL communicator is finalized
    /// first, then each group is dropped (NCCL destroyed, MPI freed), in the same order.
    fn drop(&mut self) {
        for group in self.groups.values_mut() {
            group.finalize();
        }
        while let Some(group) = self.groups.pop_first() {
            drop(group);
        }
    }
}

impl SetGroups {
    /// Splits `world` once per distinct set (members in the order given, which is the
    /// communicator's: ascending for reductions, tensor-parallel order for a stage's group;
    /// sets of one rank need no communicator). Collective: every rank passes the same
    /// sets; this rank computes on `device`. NCCL groups share one stream, which runs
    /// their collectives in the plan's global order, but for the sets `apart` (the
    /// expert-parallel groups of no other use: their exchanges, between other replicas
    /// than the reductions in flight, must not queue behind those).
    ///
    /// `hosts` names each world rank's host where the plan does (emulated hosts; `None`
    /// or missing: the rank's own): MPI groups that span hosts reduce over their islands
    /// ([`GroupCommunicator::islands`]) unless `hosts` says flat; with its network, the
    /// links between the hosts are emulated ([`super::emulated_links`]).
    pub fn new(
        world: &MpiCommunicator,
        device: Device,
        sets: impl IntoIterator<Item = Vec<usize>>,
        apart: &std::collections::BTreeSet<Vec<usize>>,
        hosts: &PlannedHosts,
    ) -> Result<Self, CommError> {
        let sets: std::collections::BTreeSet<Vec<usize>> =
            sets.into_iter().filter(|s| s.len() > 1).collect();
        if let Some(&rank) = sets.iter().flatten().find(|&&r| r >= world.size()) {
            return Err(CommError::Shape {
                rank: world.rank(),
                op: "SetGroups::new",
                problem: format!(
                    "a group names rank {rank} but the job has {} ranks",
                    world.size()
                ),
            });
        }
        let devices = RankDevice::gather(world, device)?;
        check_and_log(world, &devices, sets.iter().cloned())?;
        let rank = world.rank();
        let machines: Vec<i64> = devices.iter().map(|d| d.host).collect();
        let emulation = LinkEmulation::new(hosts, rank, &machines)?.map(Rc::new);
        let mut groups = BTreeMap::new();
        // The first NCCL communicator's stream carries every group's collectives: one
        // stream runs them in issue order, which is the plan's global order on every rank.
        let mut first_nccl: Option<Vec<usize>> = None;
        for members in sets {
            let key = members.iter().position(|&r| r == rank);
            if let Some(comm) = world.split(key.map(|_| 0), key.unwrap_or(0)) {
                let comm = comm.with_name(format!("the group of ranks {members:?}"));
                let emulated = emulation.as_ref();
                let mut group =
                    GroupCommunicator::over(comm, &members, &devices, Some(hosts), emulated)?;
                if let Some(nccl) = group.nccl.as_mut().filter(|_| !apart.contains(&members)) {
                    match first_nccl.as_ref().and_then(|m| groups.get(m)) {
                        Some(GroupCommunicator {
                            nccl: Some(first), ..
                        }) => nccl.share_stream_of(first),
                        _ => first_nccl = Some(members.clone()),
                    }
                }
                groups.insert(members, group);
            }
        }
        Ok(SetGroups {
            groups,
            devices,
            emulation,
        })
    }

    /// No communicators, as in a single-rank job.
    #[cfg(test)]
    pub(crate) fn none() -> Self {
        SetGroups {
            groups: BTreeMap::new(),
            devices: Vec::new(),
            emulation: None,
        }
    }

    /// The communicator of `members` (in the order its set was given), if this rank is one
    /// of two or more.
    pub fn get(&self, members: &[usize]) -> Option<&GroupCommunicator> {
        self.groups.get(members)
    }

    /// Every rank's device, in world rank order.
    pub(crate) fn devices(&self) -> &[RankDevice] {
        &self.devices
    }

    /// The run's emulated links, if its plan carries a network between several nodes.
    pub fn link_emulation(&self) -> Option<&Rc<LinkEmulation>> {
        self.emulation.as_ref()
    }
}

/// This rank's communicator for each group kind it belongs to.
pub struct ProcessGroups {
    groups: HashMap<GroupKind, (Vec<usize>, GroupCommunicator)>,
}

impl Drop for ProcessGroups {
    /// Tears the communicators down in `GroupKind::ALL`'s order on every rank, NCCL's
    /// finalized first (see `SetGroups`' drop).
    fn drop(&mut self) {
        for kind in GroupKind::ALL {
            if let Some((_, group)) = self.groups.get_mut(&kind) {
                group.finalize();
            }
        }
        for kind in GroupKind::ALL {
            drop(self.groups.remove(&kind));
        }
    }
}

impl ProcessGroups {
    /// Splits `world` along every group kind of `topology`, with MPI communicators only
    /// (collective: every rank of the world calls it with the same topology).
    pub fn new(world: &MpiCommunicator, topology: &Topology) -> Result<Self, CommError> {
        Self::with_devices(world, topology, Device::Cpu)
    }

    /// Like [`ProcessGroups::new`], and adds an NCCL communicator to every group whose
    /// members all compute on CUDA with NCCL available (this rank computes on `device`).
    pub fn with_devices(
        world: &MpiCommunicator,
        topology: &Topology,
        device: Device,
    ) -> Result<Self, CommError> {
        if world.size() != topology.world_size() {
            return Err(CommError::Shape {
                rank: world.rank(),
                op: "ProcessGroups::new",
                problem: format!(
                    "the job has {} ranks but the plan's topology has {}",
                    world.size(),
                    topology.world_size()
                ),
            });
        }
        let devices = RankDevice::gather(world, device)?;
        let rank = world.rank();
        check_and_log(
            world,
            &devices,
            GroupKind::ALL.iter().flat_map(|&k| topology.groups(k)),
        )?;
        let mut groups = HashMap::new();
        for kind in GroupKind::ALL {
            let all = topology.groups(kind);
            let mine = all.iter().enumerate().find(|(_, g)| g.contains(&rank));
            let (color, key) = match mine {
                Some((index, group)) => (
                    Some(index as u32),
                    group.iter().position(|&r| r == rank).expect("member"),
                ),
                None => (None, 0),
            };
            if let Some(comm) = world.split(color, key) {
                let members = mine.expect("a communicator only for members").1.clone();
                let comm = comm.with_name(format!("the {kind} group {members:?}"));
                let group = GroupCommunicator::over(comm, &members, &devices, None, None)?;
                groups.insert(kind, (members, group));
            }
        }
        Ok(ProcessGroups { groups })
    }

    /// The communicator of `kind`, or `None` if this rank is in no such group (e.g. a
    /// middle pipeline stage and the embedding group).
    pub fn get(&self, kind: GroupKind) -> Option<&GroupCommunicator> {
        self.groups.get(&kind).map(|(_, c)| c)
    }

    /// The global ranks of this rank's group of `kind`, in communicator order.
    pub fn members(&self, kind: GroupKind) -> Option<&[usize]> {
        self.groups.get(&kind).map(|(m, _)| m.as_slice())
    }
}
