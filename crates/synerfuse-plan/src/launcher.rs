//! The rank a launcher assigned to this process, read from its environment.
//!
//! Here rather than with the MPI runtime so that commands which never start MPI (the
//! data tools) can still put the rank in their log lines.

/// `(rank, world size)` from OpenMPI's, PMIx's, MPICH's or Slurm's variables, or `None`
/// when the process was not started by a launcher. Available before MPI is initialised,
/// so logs can carry the rank from the first line.
pub fn launcher_rank() -> Option<(usize, usize)> {
    const VARS: [(&str, &str); 4] = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS"),
    ];
    let read = |name: &str| std::env::var(name).ok()?.trim().parse::<usize>().ok();
    VARS.iter()
        .find_map(|(rank, size)| Some((read(rank)?, read(size)?)))
}

/// `(local rank, ranks on this node)` from the launcher's variables, `(0, 1)` without one:
/// picks this rank's GPU and its share of the CPU cores.
pub fn launcher_local_rank() -> (usize, usize) {
    const VARS: [(&str, &str); 3] = [
        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ];
    let read = |name: &str| std::env::var(name).ok()?.trim().parse::<usize>().ok();
    VARS.iter()
        .find_map(|(rank, size)| Some((read(rank)?, read(size).unwrap_or(1).max(1))))
        .unwrap_or((0, 1))
}
