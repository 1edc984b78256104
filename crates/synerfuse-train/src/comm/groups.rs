//! An MPI sub-communicator for every group kind a rank belongs to, with members in
//! Megatron's order (sub-communicator rank i is the group's i-th member).

use super::MpiCommunicator;
use std::collections::HashMap;
use synerfuse_parallel::{GroupKind, Topology};

/// This rank's communicator for each group kind it belongs to.
pub struct ProcessGroups {
    groups: HashMap<GroupKind, (Vec<usize>, MpiCommunicator)>,
}

impl ProcessGroups {
    /// Splits `world` along every group kind of `topology` (collective: every rank of the
    /// world calls it with the same topology). `world` must have `topology`'s size.
    pub fn new(world: &MpiCommunicator, topology: &Topology) -> Result<Self, String> {
        if world.size() != topology.world_size() {
            return Err(format!(
                "the job has {} ranks but the plan's topology has {}",
                world.size(),
                topology.world_size()
            ));
        }
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
                groups.insert(kind, (members, comm));
            }
        }
        Ok(ProcessGroups { groups })
    }

    /// The communicator of `kind`, or `None` if this rank is in no such group (e.g. a
    /// middle pipeline stage and the embedding group).
    pub fn get(&self, kind: GroupKind) -> Option<&MpiCommunicator> {
        self.groups.get(&kind).map(|(_, c)| c)
    }

    /// The global ranks of this rank's group of `kind`, in communicator order.
    pub fn members(&self, kind: GroupKind) -> Option<&[usize]> {
        self.groups.get(&kind).map(|(m, _)| m.as_slice())
    }
}
