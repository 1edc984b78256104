//! `synerfuse env`: what a bug report or a cluster bring-up needs to know first.

use anyhow::Result;
use serde_json::json;
use synerfuse_model::cuda::CudaSupport;
use synerfuse_train::comm::{launcher_rank, MpiRuntime, NcclCommunicator};

pub fn run(as_json: bool) -> Result<()> {
    let cuda_support = synerfuse_model::cuda::ensure_loaded();
    let cuda_devices = synerfuse_model::cuda::visible_gpus();
    // What was loaded, not what the binary was built against.
    let (libtorch_lib, libtorch_version) = match synerfuse_model::cuda::loaded_libtorch() {
        Some((dir, version)) => (
            dir.display().to_string(),
            version.unwrap_or_else(|| "unknown".to_owned()),
        ),
        None => ("not loaded".to_owned(), "unknown".to_owned()),
    };
    let gpus: Vec<(String, Option<(&str, f64)>)> =
        synerfuse_train::device_info::cuda_device_names()
            .into_iter()
            .map(|name| {
                let peak = synerfuse_planner::cluster::catalogue_peak(&name);
                (name, peak)
            })
            .collect();
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
            "gpus": gpus.iter().map(|(name, peak)| json!({
                "name": name,
                "catalogue": peak.map(|(slug, _)| slug),
                "peak_bf16_tflops": peak.map(|(_, tflops)| tflops),
            })).collect::<Vec<_>>(),
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
        for (ordinal, (name, peak)) in gpus.iter().enumerate() {
            match peak {
                Some((slug, tflops)) => println!(
                    "GPU {ordinal}: {name} (catalogue {slug}: {tflops} TFLOP/s dense bf16)"
                ),
                None => println!("GPU {ordinal}: {name} (not in the device catalogue)"),
            }
        }
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
