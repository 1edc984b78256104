//! A communicator for every group kind a rank belongs to, with members in Megatron's
//! order (communicator rank i is the group's i-th member): NCCL where every member is a
//! CUDA rank, MPI with host staging otherwise.

use super::{CommError, MpiCommunicator, NcclCommunicator};
use std::collections::HashMap;
use synerfuse_parallel::{GroupKind, Topology};
use tch::{Device, Kind, Tensor};

/// One group's communicator: NCCL for all-CUDA groups, MPI (host staging) otherwise.
/// The MPI communicator is always there (barriers, and the NCCL bootstrap).
pub struct GroupCommunicator {
    mpi: MpiCommunicator,
    nccl: Option<NcclCommunicator>,
}

impl GroupCommunicator {
    /// A group carried by MPI alone.
    pub fn mpi(mpi: MpiCommunicator) -> Self {
        Self { mpi, nccl: None }
    }

    /// This rank's position in the group.
    pub fn rank(&self) -> usize {
        self.mpi.rank()
    }

    /// Members.
    pub fn size(&self) -> usize {
        self.mpi.size()
    }

    /// Whether collectives of CUDA tensors run on NCCL.
    pub fn uses_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// The MPI communicator of the group.
    pub fn mpi_communicator(&self) -> &MpiCommunicator {
        &self.mpi
    }

    fn nccl_for(&self, tensor: &Tensor) -> Option<&NcclCommunicator> {
        self.nccl
            .as_ref()
            .filter(|_| matches!(tensor.device(), Device::Cuda(_)))
    }

    /// Element-wise sum over the group, in place.
    pub fn all_reduce_sum(&self, tensor: &mut Tensor) -> Result<(), CommError> {
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.all_reduce_sum(tensor),
            None => self.mpi.all_reduce_sum(tensor),
        }
    }

    /// Copies `root`'s tensor into every member's.
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CommError> {
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.broadcast(tensor, root),
            None => self.mpi.broadcast(tensor, root),
        }
    }

    /// Every member's tensor stacked in member order.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.all_gather(tensor),
            None => self.mpi.all_gather(tensor),
        }
    }

    /// Sum over members, scattered by leading rows.
    pub fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        match self.nccl_for(tensor) {
            Some(nccl) => nccl.reduce_scatter_sum(tensor),
            None => self.mpi.reduce_scatter_sum(tensor),
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
}

/// This rank's communicator for each group kind it belongs to.
pub struct ProcessGroups {
    groups: HashMap<GroupKind, (Vec<usize>, GroupCommunicator)>,
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
        let ordinal = match device {
            Device::Cuda(i) if NcclCommunicator::available() => i as i64,
            _ => -1,
        };
        let ordinals: Vec<i64> = Vec::try_from(
            world
                .all_gather(&Tensor::from_slice(&[ordinal]))?
                .to_kind(Kind::Int64)
                .view([-1]),
        )
        .unwrap_or_default();
        let rank = world.rank();
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
                let all_cuda = members.len() > 1 && members.iter().all(|&r| ordinals[r] >= 0);
                let nccl = if all_cuda {
                    Some(NcclCommunicator::new(&comm, ordinal as usize)?)
                } else {
                    None
                };
                groups.insert(kind, (members, GroupCommunicator { mpi: comm, nccl }));
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
