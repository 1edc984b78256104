//! How pipeline activations and gradients travel between neighbouring stages.
//!
//! Between two CUDA ranks that can both load NCCL (on different GPUs), a link is a
//! two-rank NCCL communicator with a stream of its own; anywhere else (a CPU end, NCCL
//! missing) it is MPI, staged through pinned host memory for CUDA tensors. NCCL matches
//! sends to receives by order, not tag, so a link takes NCCL only when both directions
//! are received in send order ([`synerfuse_plan::link_in_order`]).
//!
//! NCCL sends block until the peer receives, so two neighbours that send to each other
//! at once (1F1B's steady state) would deadlock if each send ran alone. Sends are
//! therefore deferred and issued in one NCCL group with the next receive (or before an
//! MPI receive, or at the end of the step): a group's transfers proceed together. Like
//! MPI's non-blocking sends, sends are waited for only at the end of the step; a
//! receive waits for its own link's stream.
//!
//! Deferring makes the groups of a link's two ends differ ([sends, recv] on one rank,
//! [recv] on the other), which NCCL leaves undefined while it still has to connect the
//! peers. Each link is therefore connected both ways when it is made, by a symmetric
//! one-element exchange ([`super::nccl::first_contact`]).

use super::devices::RankDevice;
use super::emulated_links::LinkEmulation;
use super::nccl::nccl_group;
use super::{CommError, MpiCommunicator, NcclCommunicator, SetGroups};
use std::collections::{BTreeMap, BTreeSet};
use synerfuse_plan::{link_in_order, Instruction};
use tch::Tensor;

/// The transport of one pipeline link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkPath {
    /// Both ends on CPU: MPI.
    Mpi,
    /// A CUDA end: MPI through pinned host buffers (and why not NCCL).
    HostStaged(&'static str),
    /// Both ends on CUDA with NCCL: an NCCL pair communicator.
    Nccl,
}

impl std::fmt::Display for LinkPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkPath::Mpi => f.write_str("MPI"),
            LinkPath::HostStaged(why) => write!(f, "MPI through pinned host memory ({why})"),
            LinkPath::Nccl => f.write_str("NCCL send/recv on the link's own stream"),
        }
    }
}

impl LinkPath {
    /// The path of the link between world ranks `a` and `b`.
    pub(crate) fn of(a: &RankDevice, b: &RankDevice, in_order: bool) -> LinkPath {
        match (a.cuda, b.cuda) {
            (None, None) => LinkPath::Mpi,
            (Some(_), None) | (None, Some(_)) => LinkPath::HostStaged("a CPU end"),
            (Some(_), Some(_)) if a.same_gpu(b) => LinkPath::HostStaged("both ends on one GPU"),
            _ if !(a.nccl && b.nccl) => LinkPath::HostStaged("NCCL not loadable"),
            _ if !in_order => LinkPath::HostStaged("the schedule receives out of send order"),
            _ => LinkPath::Nccl,
        }
    }
}

/// This rank's pipeline links that use NCCL (by peer world rank); the rest use MPI.
pub struct PipelineLinks {
    /// By peer: ascending peers are the links in the global (lower rank, higher rank)
    /// order, which every rank tears down in (see `Drop`).
    nccl: BTreeMap<usize, NcclCommunicator>,
    /// This rank (for errors).
    rank: usize,
    /// The run's emulated links: MPI messages across emulated nodes carry their arrival
    /// time ([`super::emulated_links`]).
    emulation: Option<std::rc::Rc<LinkEmulation>>,
}

impl Drop for PipelineLinks {
    /// Finalizes every NCCL link, then destroys each, in ascending peer order: on every
    /// rank that is the global link order, so no two ranks wait on each other's link
    /// (NCCL's finalize may wait for the peer). A link that saw an error was aborted
    /// then and is neither finalized nor destroyed.
    fn drop(&mut self) {
        for link in self.nccl.values_mut() {
            if let Err(e) = link.finalize() {
                tracing::warn!("{e}");
            }
        }
        while let Some(link) = self.nccl.pop_first() {
            drop(link);
        }
    }
}

impl PipelineLinks {
    /// The links of `programs` (every rank's, peers are world ranks): one between each
    /// pair of ranks where one sends to the other. Collective over `world` in effect:
    /// NCCL links are set up (and connected both ways) in one global link order, so no
    /// two ranks wait on each other. Rank 0 logs every link's path.
    pub fn new(
        world: &MpiCommunicator,
        groups: &SetGroups,
        programs: &[Vec<Instruction>],
    ) -> Result<Self, CommError> {
        let devices = groups.devices();
        let links: BTreeSet<(usize, usize)> = programs
            .iter()
            .enumerate()
            .flat_map(|(rank, program)| {
                program.iter().filter_map(move |i| match i {
                    Instruction::Send(m) if m.peer != rank => {
                        Some((rank.min(m.peer), rank.max(m.peer)))
                    }
                    _ => None,
                })
            })
            .collect();
        let me = world.rank();
        let mut nccl = BTreeMap::new();
        for (a, b) in links {
            let in_order = link_in_order(programs, a, b) && link_in_order(programs, b, a);
            let path = match (devices.get(a), devices.get(b)) {
                (Some(da), Some(db)) => LinkPath::of(da, db, in_order),
                _ => LinkPath::Mpi,
            };
            if me == 0 {
                tracing::info!("pipeline link ranks {a} <-> {b}: {path}");
            }
            if path == LinkPath::Nccl && (me == a || me == b) {
                let peer = if me == a { b } else { a };
                let ordinal = devices[me].cuda.expect("NCCL links join CUDA ranks");
                nccl.insert(peer, NcclCommunicator::new_pair(world, peer, ordinal)?);
            }
        }
        Ok(PipelineLinks {
            nccl,
            rank: me,
            emulation: groups.link_emulation().cloned(),
        })
    }

    /// When `bytes` sent now over MPI to world rank `peer` arrive on the emulated links
    /// (sent first, as a one-element fp64 message under the same tag), `None` where the
    /// link is NCCL or not emulated.
    pub fn arrival(&self, peer: usize, bytes: usize) -> Option<f64> {
        let emulation = self.emulation.as_ref().filter(|_| !self.is_nccl(peer))?;
        emulation.send(super::emulated_links::Traffic::Pipeline, peer, bytes as f64)
    }

    /// Whether MPI messages from world rank `peer` come after their arrival time.
    pub fn stamped(&self, peer: usize) -> bool {
        !self.is_nccl(peer) && self.emulation.as_ref().is_some_and(|e| e.crosses_to(peer))
    }

    /// Whether the link to world rank `peer` uses NCCL.
    pub fn is_nccl(&self, peer: usize) -> bool {
        self.nccl.contains_key(&peer)
    }

    fn link(&self, peer: usize) -> Result<&NcclCommunicator, CommError> {
        self.nccl.get(&peer).ok_or(CommError::NoNcclLink {
            rank: self.rank,
            peer,
        })
    }

    /// Issues `sends` (peer world rank, contiguous CUDA tensor) and the optional receive
    /// into `recv` as one NCCL group, and waits for the receive (its link's stream, which
    /// also completes earlier sends on that link) but not for sends on other links: the
    /// caller keeps sent tensors alive until [`Self::synchronize`]. Every peer must have
    /// an NCCL link. The links' streams wait for libtorch's kernels on the GPU, not the
    /// host; a failed group aborts every link in it.
    pub fn exchange(
        &self,
        sends: &[(usize, Tensor)],
        recv: Option<(usize, &Tensor)>,
    ) -> Result<(), CommError> {
        let sends = sends
            .iter()
            .map(|(peer, tensor)| Ok((self.link(*peer)?, tensor)))
            .collect::<Result<Vec<_>, CommError>>()?;
        let recv = recv
            .map(|(peer, tensor)| Ok::<_, CommError>((self.link(peer)?, tensor)))
            .transpose()?;
        let comms = involved(sends.iter().map(|(c, _)| *c).chain(recv.map(|(c, _)| c)));
        if comms.is_empty() {
            return Ok(());
        }
        // Each link's stream waits on the GPU for the kernels that produced the tensors.
        for comm in &comms {
            comm.after_libtorch()?;
        }
        nccl_group(&comms, "pipeline exchange (ncclSend/ncclRecv)", || {
            for (comm, tensor) in &sends {
                comm.enqueue(tensor, 1 - comm.rank(), true)?;
            }
            if let Some((comm, tensor)) = recv {
                comm.enqueue(tensor, 1 - comm.rank(), false)?;
            }
            Ok(())
        })?;
        if let Some((comm, _)) = recv {
            comm.synchronize("pipeline recv")?;
        }
        Ok(())
    }

    /// Waits until every transfer on the links to `peers` has completed.
    pub fn synchronize(&self, peers: impl IntoIterator<Item = usize>) -> Result<(), CommError> {
        for peer in peers.into_iter().collect::<BTreeSet<_>>() {
            self.link(peer)?.synchronize("pipeline send")?;
        }
        Ok(())
    }
}

/// The distinct communicators among `comms`, in first-seen order.
fn involved<'a>(comms: impl Iterator<Item = &'a NcclCommunicator>) -> Vec<&'a NcclCommunicator> {
    let mut distinct: Vec<&NcclCommunicator> = Vec::new();
    for comm in comms {
        if !distinct.iter().any(|c| std::ptr::eq(*c, comm)) {
            distinct.push(comm);
        }
    }
    distinct
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(host: i64, cuda: Option<usize>, nccl: bool) -> RankDevice {
        RankDevice {
            host,
            cuda,
            gpu: None,
            nccl,
            pid: 1,
        }
    }

    #[test]
    fn nccl_only_between_distinct_gpus_that_load_it_in_order() {
        let gpu0 = device(1, Some(0), true);
        let gpu1 = device(1, Some(1), true);
        let cpu = device(1, None, false);
        assert_eq!(LinkPath::of(&gpu0, &gpu1, true), LinkPath::Nccl);
        assert_eq!(LinkPath::of(&cpu, &cpu, true), LinkPath::Mpi);
        assert!(matches!(
            LinkPath::of(&gpu0, &cpu, true),
            LinkPath::HostStaged(_)
        ));
        assert!(matches!(
            LinkPath::of(&gpu0, &gpu0, true),
            LinkPath::HostStaged(_)
        ));
        assert!(matches!(
            LinkPath::of(&gpu0, &device(1, Some(1), false), true),
            LinkPath::HostStaged(_)
        ));
        assert!(matches!(
            LinkPath::of(&gpu0, &gpu1, false),
            LinkPath::HostStaged(_)
        ));
        // The same ordinal on another host is another GPU.
        assert_eq!(
            LinkPath::of(&gpu0, &device(2, Some(0), true), true),
            LinkPath::Nccl
        );
    }
}
