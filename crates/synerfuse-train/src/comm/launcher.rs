//! The rank a launcher assigned to this process, read from its environment.

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
