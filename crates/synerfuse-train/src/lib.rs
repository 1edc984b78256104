//! The synerfuse training runtime.
//!
//! Every rank runs one pipeline stage of one data-parallel replica. Ranks are launched
//! and bootstrapped by MPI (`mpirun`, `srun`); tensors move between them through a
//! communicator: MPI for CPU ranks and host-staged transfers, NCCL for groups whose
//! members are all CUDA ranks.
//!
//! What is here today: [`comm`], the communicators over tch tensors.
//!
//! ```no_run
//! use synerfuse_train::comm::MpiRuntime;
//! use tch::{Kind, Tensor};
//!
//! // Run under `mpirun -np 4`: every rank ends with 1 + 2 + 3 + 4 = 10.
//! let runtime = MpiRuntime::init().unwrap();
//! let world = runtime.world();
//! let mut t = Tensor::full([3], (world.rank() + 1) as f64, (Kind::Float, tch::Device::Cpu));
//! world.all_reduce_sum(&mut t).unwrap();
//! ```

pub mod comm;
