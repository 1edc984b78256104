//! **Test only**: several ranks on the one GPU of a check machine, talking over NCCL.
//!
//! NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected"),
//! and synerfuse refuses such a group before NCCL would ([`super::CommError::SharedGpu`]).
//! Both judge "same device" as "same host and same GPU", and NCCL takes the host from a
//! hash of `NCCL_HOSTID` when it is set. With [`ONE_GPU_RANKS_ENV`] set (to anything but
//! `0` or nothing), [`prepare`] gives each rank a host id of its own (`NCCL_HOSTID`, and
//! the host synerfuse compares, `host_id`): the ranks on one GPU then look like
//! separate hosts and talk over NCCL's network transport, its socket implementation
//! (`NCCL_NET=Socket`, `NCCL_IB_DISABLE=1`; NCCL maps one rank to one GPU only within a
//! host, hence separate host ids rather than a switch in NCCL's topology). Every rank
//! computes on `cuda:0` ([`cuda_local_rank`]), and since every rank is on one machine,
//! NCCL's sockets use the loopback interface unless `NCCL_SOCKET_IFNAME` says otherwise.
//!
//! This exists so the GPU check (`xtask/gpu/check.sh`) can run NCCL collectives and
//! sends between two ranks on the one GPU it borrows. It is not a way to train: ranks
//! sharing a GPU share its compute and memory, the socket transport copies through host
//! memory, and the watchdog no longer knows which ranks share this host (each rank is a
//! host of its own), so a timeout names no stopped local peer.

/// The test-only switch: set (not `0`, not empty) to run the ranks of one machine on its
/// GPU `cuda:0`, each rank a host of its own to NCCL, over NCCL's socket transport.
pub const ONE_GPU_RANKS_ENV: &str = "SYNERFUSE_TEST_ONE_GPU_RANKS";

/// Whether [`ONE_GPU_RANKS_ENV`] is on.
pub fn enabled() -> bool {
    switch_on(std::env::var_os(ONE_GPU_RANKS_ENV).as_deref())
}

/// Whether the switch's value turns it on: set, and neither empty nor `0`.
fn switch_on(value: Option<&std::ffi::OsStr>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// The `NCCL_HOSTID` of world rank `rank` under the switch.
fn nccl_host_id(rank: usize) -> String {
    format!("synerfuse-test-one-gpu-rank-{rank}")
}

/// Under the switch, sets NCCL's environment for this process (rank from the launcher's
/// variables, `OMPI_COMM_WORLD_RANK` and the like, else 0): `NCCL_HOSTID` of this rank's
/// own, `NCCL_NET=Socket`, `NCCL_IB_DISABLE=1`, and `NCCL_SOCKET_IFNAME=lo` unless set;
/// returns this rank's `NCCL_HOSTID`, or `None` with the switch off (nothing changed).
///
/// Call it at the start of the process, before any thread that could read the
/// environment and before any NCCL communicator: NCCL reads these once, at its first use.
pub fn prepare() -> Option<String> {
    if !enabled() {
        return None;
    }
    let rank = super::launcher_rank().map_or(0, |(rank, _)| rank);
    let host = nccl_host_id(rank);
    std::env::set_var("NCCL_HOSTID", &host);
    std::env::set_var("NCCL_NET", "Socket");
    std::env::set_var("NCCL_IB_DISABLE", "1");
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    }
    tracing::warn!(
        "{ONE_GPU_RANKS_ENV} (test only): rank {rank} takes cuda:0 where it computes on a GPU, and is a host of its own to NCCL (NCCL_HOSTID={host}, NCCL_NET=Socket, NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME={})",
        std::env::var("NCCL_SOCKET_IFNAME").unwrap_or_default()
    );
    Some(host)
}

/// The host that synerfuse's "do these ranks share a GPU?" judgement compares for world
/// rank `rank`: `host_hash` (a hash of the host name), or under the switch a value of
/// this rank's own, as `NCCL_HOSTID` makes it for NCCL.
pub(crate) fn host_id(host_hash: i64, rank: usize) -> i64 {
    match enabled() {
        true => own_host(host_hash, rank),
        false => host_hash,
    }
}

/// A host id of world rank `rank`'s own, on the host of `host_hash`.
fn own_host(host_hash: i64, rank: usize) -> i64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (host_hash, nccl_host_id(rank)).hash(&mut hasher);
    hasher.finish() as i64
}

/// The local rank that picks this rank's GPU (`cuda` or `auto` without an index take GPU
/// `local rank mod count`): `local_rank`, or 0 (every rank on `cuda:0`) under the switch.
pub fn cuda_local_rank(local_rank: usize) -> usize {
    if enabled() {
        0
    } else {
        local_rank
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn the_switch_is_on_when_set_to_anything_but_nothing_or_0() {
        assert!(!switch_on(None));
        assert!(!switch_on(Some(OsStr::new(""))));
        assert!(!switch_on(Some(OsStr::new("0"))));
        assert!(switch_on(Some(OsStr::new("1"))));
        assert!(switch_on(Some(OsStr::new("yes"))));
    }

    #[test]
    fn each_rank_is_a_host_of_its_own() {
        let hosts: Vec<i64> = (0..64).map(|r| own_host(42, r)).collect();
        let distinct: std::collections::BTreeSet<i64> = hosts.iter().copied().collect();
        assert_eq!(distinct.len(), hosts.len());
        assert_eq!(own_host(42, 1), own_host(42, 1));
        assert_ne!(nccl_host_id(0), nccl_host_id(1));
    }
}
