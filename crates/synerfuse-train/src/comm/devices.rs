//! Where each rank computes, as every rank sees it, and the path a group's collectives
//! take from that (NCCL where every member is a CUDA rank that can load it, MPI otherwise):
//! what [`super::groups`] and the islands of [`super::hierarchical`] decide by.

use super::{CommError, MpiCommunicator, NcclCommunicator};
use tch::{Device, Tensor};

/// Where a rank computes, as every other rank sees it (gathered once at start-up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankDevice {
    /// A hash of the host name: GPUs are shared only within a host.
    pub host: i64,
    /// The CUDA ordinal, or `None` on the CPU.
    pub cuda: Option<usize>,
    /// The GPU's UUID, when the CUDA driver gives it: which GPU a rank computes on, where
    /// the ordinal only numbers the GPUs this process sees (under a `CUDA_VISIBLE_DEVICES`
    /// of its own, every rank's GPU is `cuda:0`).
    pub gpu: Option<u128>,
    /// Whether NCCL can be loaded on this rank.
    pub nccl: bool,
    /// The rank's process id (on its host).
    pub pid: u32,
}

impl RankDevice {
    /// Every rank's device, in world rank order (collective over `world`).
    pub fn gather(world: &MpiCommunicator, device: Device) -> Result<Vec<Self>, CommError> {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        mpi::environment::processor_name()
            .unwrap_or_default()
            .hash(&mut hasher);
        let cuda = match device {
            Device::Cuda(i) => Some(i),
            _ => None,
        };
        // Under the test-only switch each rank is a host of its own (see `one_gpu`).
        let host = super::one_gpu::host_id(hasher.finish() as i64, world.rank());
        let mine = RankDevice {
            host,
            cuda,
            gpu: cuda.and_then(gpu_uuid),
            nccl: cuda.is_some() && NcclCommunicator::available(),
            pid: std::process::id(),
        };
        let mine = Tensor::from_slice(&mine.to_words());
        let all: Vec<i64> = Vec::try_from(world.all_gather(&mine)?.view([-1])).unwrap_or_default();
        let devices: Vec<RankDevice> = all.chunks_exact(7).map(RankDevice::from_words).collect();
        // The watchdog can then say which rank on this host has died or stopped.
        super::watchdog::set_local_peers(
            devices
                .iter()
                .enumerate()
                .filter(|(r, d)| d.host == host && *r != world.rank())
                .map(|(r, d)| (r, d.pid))
                .collect(),
        );
        Ok(devices)
    }

    /// What a rank sends in [`Self::gather`]: host, CUDA ordinal (-1 on the CPU), NCCL
    /// loadable, pid, UUID known, the UUID's high and low halves.
    fn to_words(self) -> [i64; 7] {
        let uuid = self.gpu.unwrap_or(0);
        [
            self.host,
            self.cuda.map_or(-1, |i| i as i64),
            i64::from(self.nccl),
            i64::from(self.pid),
            i64::from(self.gpu.is_some()),
            (uuid >> 64) as i64,
            uuid as i64,
        ]
    }

    /// A rank's device from its words ([`Self::to_words`]).
    fn from_words(c: &[i64]) -> Self {
        let uuid = (u128::from(c[5] as u64) << 64) | u128::from(c[6] as u64);
        RankDevice {
            host: c[0],
            cuda: usize::try_from(c[1]).ok(),
            gpu: (c[4] != 0).then_some(uuid),
            nccl: c[2] != 0,
            pid: c[3] as u32,
        }
    }

    /// Whether two ranks compute on one GPU: on one host (as NCCL judges it, which the
    /// test-only `one_gpu` switch relies on) and the same GPU by UUID where both know it,
    /// by CUDA ordinal otherwise. CPU ranks share no GPU.
    pub fn same_gpu(&self, other: &RankDevice) -> bool {
        self.host == other.host
            && match (self.gpu, other.gpu) {
                (Some(a), Some(b)) => a == b,
                _ => self.cuda.is_some() && self.cuda == other.cuda,
            }
    }

    fn describe(&self) -> String {
        match self.cuda {
            Some(i) => format!(
                "cuda:{i}{}",
                if self.nccl {
                    ""
                } else {
                    " (NCCL not loadable)"
                }
            ),
            None => "cpu".to_owned(),
        }
    }
}

/// The UUID of this process's CUDA device `ordinal`, or `None` when the driver cannot
/// be loaded or asked (then ranks are told apart by ordinal).
fn gpu_uuid(ordinal: usize) -> Option<u128> {
    use cudarc::driver::result;
    // SAFETY: this only tries to dlopen the CUDA driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    result::init().ok()?;
    let device = result::device::get(i32::try_from(ordinal).ok()?).ok()?;
    let uuid = result::device::get_uuid(device).ok()?;
    Some(u128::from_be_bytes(uuid.bytes.map(|b| b as u8)))
}

/// How a group's collectives travel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GroupPath {
    /// NCCL.
    Nccl,
    /// Every member is on CUDA, but these ranks cannot load NCCL: MPI host staging.
    NcclMissing { ranks: Vec<usize> },
    /// Some member computes on the CPU (or the group has one member): MPI.
    Mpi,
}

impl GroupPath {
    /// The path of the group `members` (world ranks) given every rank's device; an error
    /// when two members share one GPU (NCCL cannot run two ranks on one device).
    pub fn of(members: &[usize], devices: &[RankDevice]) -> Result<Self, CommError> {
        let on_cuda: Vec<(usize, RankDevice)> = members
            .iter()
            .filter_map(|&r| devices.get(r).filter(|d| d.cuda.is_some()).map(|d| (r, *d)))
            .collect();
        if members.len() < 2 || on_cuda.len() < members.len() {
            return Ok(GroupPath::Mpi);
        }
        for (i, (a, da)) in on_cuda.iter().enumerate() {
            if let Some((b, _)) = on_cuda[i + 1..].iter().find(|(_, db)| db.same_gpu(da)) {
                return Err(CommError::SharedGpu {
                    first: *a,
                    second: *b,
                    ordinal: da.cuda.unwrap_or(0),
                });
            }
        }
        let missing: Vec<usize> = on_cuda
            .iter()
            .filter(|(_, d)| !d.nccl)
            .map(|(r, _)| *r)
            .collect();
        if !missing.is_empty() {
            return Ok(GroupPath::NcclMissing { ranks: missing });
        }
        Ok(GroupPath::Nccl)
    }
}

/// Checks every group's path (two members on one GPU is refused) and has rank 0 log
/// where each rank computes. Every rank checks every group, so a refused layout stops all
/// ranks rather than only the members of the bad group.
pub(crate) fn check_and_log(
    world: &MpiCommunicator,
    devices: &[RankDevice],
    groups: impl IntoIterator<Item = Vec<usize>>,
) -> Result<(), CommError> {
    let mut paths = std::collections::BTreeMap::<String, usize>::new();
    for group in groups.into_iter().filter(|g| g.len() > 1) {
        *paths
            .entry(format!("{:?}", GroupPath::of(&group, devices)?))
            .or_default() += 1;
    }
    if world.rank() == 0 {
        for (r, d) in devices.iter().enumerate() {
            tracing::info!("rank {r} computes on {}", d.describe());
        }
        tracing::info!("groups of two or more ranks by path: {paths:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(host: i64, ordinal: usize, nccl: bool) -> RankDevice {
        RankDevice {
            host,
            cuda: Some(ordinal),
            gpu: None,
            nccl,
            pid: 1,
        }
    }

    const CPU: RankDevice = RankDevice {
        host: 1,
        cuda: None,
        gpu: None,
        nccl: false,
        pid: 1,
    };

    #[test]
    fn one_gpu_is_known_by_its_uuid_rather_than_its_ordinal() {
        let on = |ordinal, gpu| RankDevice {
            gpu: Some(gpu),
            ..cuda(1, ordinal, true)
        };
        // Each rank sees its own GPU as cuda:0 (CUDA_VISIBLE_DEVICES per rank).
        let devices = [on(0, 0xa), on(0, 0xb), on(1, 0xa)];
        assert_eq!(GroupPath::of(&[0, 1], &devices).unwrap(), GroupPath::Nccl);
        assert!(matches!(
            GroupPath::of(&[1, 2], &devices),
            Ok(GroupPath::Nccl)
        ));
        // Two ordinals of one GPU (different visible sets).
        assert!(matches!(
            GroupPath::of(&[0, 2], &devices),
            Err(CommError::SharedGpu {
                first: 0,
                second: 2,
                ..
            })
        ));
        // One UUID on two hosts (the one-GPU test switch's separate host ids) is apart.
        let apart = [
            on(0, 0xa),
            RankDevice {
                host: 2,
                ..on(0, 0xa)
            },
        ];
        assert_eq!(GroupPath::of(&[0, 1], &apart).unwrap(), GroupPath::Nccl);
        // What travels between ranks comes back whole.
        for device in [on(3, u128::MAX - 5), cuda(-7, 1, false), CPU] {
            assert_eq!(RankDevice::from_words(&device.to_words()), device);
        }
        // Without a UUID, the ordinal decides.
        assert!(on(0, 0xa).same_gpu(&cuda(1, 0, true)));
        assert!(!on(0, 0xa).same_gpu(&cuda(1, 1, true)));
        assert!(!CPU.same_gpu(&CPU));
    }

    #[test]
    fn all_cuda_groups_use_nccl_and_mixed_ones_mpi() {
        let devices = [cuda(1, 0, true), cuda(1, 1, true), CPU, cuda(2, 0, true)];
        assert_eq!(GroupPath::of(&[0, 1], &devices).unwrap(), GroupPath::Nccl);
        // The same ordinal on another host is another GPU.
        assert_eq!(GroupPath::of(&[0, 3], &devices).unwrap(), GroupPath::Nccl);
        assert_eq!(GroupPath::of(&[0, 2], &devices).unwrap(), GroupPath::Mpi);
        assert_eq!(GroupPath::of(&[1], &devices).unwrap(), GroupPath::Mpi);
    }

    #[test]
    fn missing_nccl_is_named() {
        let devices = [cuda(1, 0, true), cuda(1, 1, false)];
        assert_eq!(
            GroupPath::of(&[0, 1], &devices).unwrap(),
            GroupPath::NcclMissing { ranks: vec![1] }
        );
    }

    #[test]
    fn two_ranks_on_one_gpu_are_refused_by_name() {
        let devices = [cuda(1, 0, true), cuda(1, 1, true), cuda(1, 0, true)];
        let err = GroupPath::of(&[0, 1, 2], &devices).unwrap_err();
        assert!(matches!(
            err,
            CommError::SharedGpu {
                first: 0,
                second: 2,
                ordinal: 0
            }
        ));
        assert!(err.to_string().contains("ranks 0 and 2"), "{err}");
    }
}
