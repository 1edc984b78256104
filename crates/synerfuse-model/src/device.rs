//! Which libtorch device a rank computes on: a [`DeviceRequest`] (the plan's and the
//! user's words) resolved against the GPUs this process sees.

pub use synerfuse_plan::DeviceRequest;
use tch::Device;

/// Errors of this crate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    /// CUDA was asked for but libtorch sees no GPU (or was built without CUDA).
    #[error(
        "device {requested}: no GPU is visible to libtorch (libtorch CUDA support: {support})"
    )]
    CudaUnavailable {
        /// The device asked for.
        requested: String,
        /// [`crate::cuda::ensure_loaded`]'s verdict.
        support: String,
    },
    /// A GPU index past the last GPU.
    #[error("device cuda:{index}: only {count} CUDA device(s) are visible")]
    NoSuchCudaDevice {
        /// The index asked for.
        index: usize,
        /// GPUs visible to libtorch.
        count: usize,
    },
}

/// Resolution of a [`DeviceRequest`] to a libtorch device.
pub trait ResolveDevice {
    /// The libtorch device, checked against the GPUs this process can see (loading
    /// libtorch's CUDA backend first when this libtorch has one).
    fn resolve(self) -> Result<Device, ModelError>;

    /// Like [`Self::resolve`] for the `local_rank`-th process of a node: `cuda` and
    /// `auto` without an index take GPU `local_rank mod count`, so the ranks of a node
    /// spread over its GPUs.
    fn resolve_for_local_rank(self, local_rank: usize) -> Result<Device, ModelError>;

    /// [`Self::resolve`] for a given number of visible GPUs (pure, for tests).
    fn resolve_with(self, cuda_devices: usize) -> Result<Device, ModelError>;
}

impl ResolveDevice for DeviceRequest {
    fn resolve(self) -> Result<Device, ModelError> {
        self.resolve_for_local_rank(0)
    }

    fn resolve_for_local_rank(self, local_rank: usize) -> Result<Device, ModelError> {
        let count = crate::cuda::visible_gpus();
        let spread = match self {
            DeviceRequest::Cuda(None) | DeviceRequest::Auto if count > 0 => {
                DeviceRequest::Cuda(Some(local_rank % count))
            }
            other => other,
        };
        spread.resolve_with(count).map_err(|e| match e {
            ModelError::CudaUnavailable { requested, .. } => ModelError::CudaUnavailable {
                requested,
                support: crate::cuda::ensure_loaded().to_string(),
            },
            other => other,
        })
    }

    fn resolve_with(self, cuda_devices: usize) -> Result<Device, ModelError> {
        match self {
            DeviceRequest::Cpu => Ok(Device::Cpu),
            DeviceRequest::Auto if cuda_devices == 0 => Ok(Device::Cpu),
            DeviceRequest::Auto => Ok(Device::Cuda(0)),
            DeviceRequest::Cuda(_) if cuda_devices == 0 => Err(ModelError::CudaUnavailable {
                requested: self.to_string(),
                support: "no GPU counted".to_owned(),
            }),
            DeviceRequest::Cuda(index) => {
                let index = index.unwrap_or(0);
                if index < cuda_devices {
                    Ok(Device::Cuda(index))
                } else {
                    Err(ModelError::NoSuchCudaDevice {
                        index,
                        count: cuda_devices,
                    })
                }
            }
        }
    }
}

/// Deterministic mode for tests and reproducible runs: seeds libtorch's CPU and CUDA
/// generators, turns off cuDNN autotuning (which picks kernels by timing) and cuDNN
/// itself (whose convolution-free paths we do not need), and pins intra-op threads so
/// CPU reductions split the same way every run.
pub fn set_deterministic(seed: u64, threads: usize) {
    tch::manual_seed(seed as i64);
    tch::Cuda::manual_seed_all(seed);
    tch::Cuda::cudnn_set_benchmark(false);
    tch::Cuda::set_user_enabled_cudnn(false);
    tch::set_num_threads(threads.max(1) as i32);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_against_the_visible_gpus() {
        assert_eq!(DeviceRequest::Auto.resolve_with(0), Ok(Device::Cpu));
        assert_eq!(DeviceRequest::Auto.resolve_with(2), Ok(Device::Cuda(0)));
        assert_eq!(
            DeviceRequest::Cuda(Some(1)).resolve_with(2),
            Ok(Device::Cuda(1))
        );
        assert_eq!(
            DeviceRequest::Cuda(Some(2)).resolve_with(2),
            Err(ModelError::NoSuchCudaDevice { index: 2, count: 2 })
        );
        assert!(matches!(
            DeviceRequest::Cuda(None).resolve_with(0),
            Err(ModelError::CudaUnavailable { .. })
        ));
    }
}
