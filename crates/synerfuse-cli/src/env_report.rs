//! `synerfuse env`: what a bug report or a cluster bring-up needs to know first.

use anyhow::Result;
use serde_json::json;
use synerfuse_model::cuda::CudaSupport;
use synerfuse_train::comm::{launcher_rank, MpiRuntime, NcclCommunicator};

pub fn run(as_json: bool) -> Result<()> {
    let libtorch_lib = option_env!("SYNERFUSE_LIBTORCH_LIB").unwrap_or("unknown");
    let libtorch_version = std::fs::read_to_string(format!("{libtorch_lib}/../version.py"))
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("__version__ = ")
                    .map(|v| v.trim_matches(['\'', '"']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let cuda_support = synerfuse_model::cuda::ensure_loaded();
    let cuda_devices = synerfuse_model::cuda::visible_gpus();
    let nccl = NcclCommunicator::available();
    let mpi = MpiRuntime::library_version();
    let mpi = mpi.lines().next().unwrap_or("").trim().to_owned();
    let rank = launcher_rank();
    if as_json {
        let report = json!({
            "synerfuse": env!("CARGO_PKG_VERSION"),
            "libtorch": { "version": libtorch_version, "lib_dir": libtorch_lib },
            "intra_op_threads": tch::get_num_threads(),
            "libtorch_cuda": match cuda_support {
                CudaSupport::Loaded(path) => json!({ "loaded": true, "path": path }),
                CudaSupport::NotInLibtorch => json!({ "loaded": false, "reason": "not in this libtorch" }),
                CudaSupport::LoadFailed { path, error } => json!({ "loaded": false, "path": path, "reason": error }),
            },
            "cuda_devices": cuda_devices,
            "cudnn": tch::Cuda::cudnn_is_available(),
            "mpi": mpi,
            "nccl_loadable": nccl,
            "launcher_rank": rank.map(|(r, n)| json!({ "rank": r, "size": n })),
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("synerfuse: {}", env!("CARGO_PKG_VERSION"));
        println!("libtorch: {libtorch_version} ({libtorch_lib})");
        println!("intra-op threads: {}", tch::get_num_threads());
        println!("libtorch CUDA support: {cuda_support}");
        println!(
            "GPUs visible: {cuda_devices}{}",
            if cuda_devices > 0 {
                format!(" (cuDNN {})", tch::Cuda::cudnn_is_available())
            } else {
                String::new()
            }
        );
        println!("MPI: {mpi}");
        println!(
            "NCCL: {}",
            if nccl {
                "loadable"
            } else {
                "not loadable (no GPU groups)"
            }
        );
        println!(
            "launcher rank: {}",
            match rank {
                Some((r, n)) => format!("{r} of {n}"),
                None => "none (not under mpirun or srun)".to_owned(),
            }
        );
    }
    Ok(())
}
