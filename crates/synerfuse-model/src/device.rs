//! Which libtorch device a rank computes on.

use std::fmt;
use std::str::FromStr;
use tch::Device;

/// Errors of this crate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    /// A device name that is none of `cpu`, `cuda`, `cuda:N`, `auto`.
    #[error("`{0}` is not a device: expected cpu, cuda, cuda:N or auto")]
    BadDeviceName(String),
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

/// The device a user asked for (`--device`), before checking the machine has it.
///
/// `auto` picks the first GPU when libtorch sees one and the CPU otherwise, which is
/// what a mixed CPU/GPU job wants from a single flag shared by every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRequest {
    /// The host CPU.
    Cpu,
    /// A GPU; `None` means the first one.
    Cuda(Option<usize>),
    /// A GPU when libtorch sees one, else the CPU.
    Auto,
}

impl FromStr for DeviceRequest {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(None)),
            "auto" => Ok(Self::Auto),
            other => other
                .strip_prefix("cuda:")
                .and_then(|index| index.parse::<usize>().ok())
                .map(|index| Self::Cuda(Some(index)))
                .ok_or_else(|| ModelError::BadDeviceName(s.to_owned())),
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(None) => f.write_str("cuda"),
            Self::Cuda(Some(index)) => write!(f, "cuda:{index}"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

impl DeviceRequest {
    /// The libtorch device, checked against the GPUs this process can see (loading
    /// libtorch's CUDA backend first when this libtorch has one).
    pub fn resolve(self) -> Result<Device, ModelError> {
        self.resolve_for_local_rank(0)
    }

    /// Like [`Self::resolve`] for the `local_rank`-th process of a node: `cuda` and
    /// `auto` without an index take GPU `local_rank mod count`, so the ranks of a node
    /// spread over its GPUs.
    pub fn resolve_for_local_rank(self, local_rank: usize) -> Result<Device, ModelError> {
        let count = crate::cuda::visible_gpus();
        let spread = match self {
            Self::Cuda(None) | Self::Auto if count > 0 => Self::Cuda(Some(local_rank % count)),
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

    /// [`Self::resolve`] for a given number of visible GPUs (pure, for tests).
    pub fn resolve_with(self, cuda_devices: usize) -> Result<Device, ModelError> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Auto if cuda_devices == 0 => Ok(Device::Cpu),
            Self::Auto => Ok(Device::Cuda(0)),
            Self::Cuda(_) if cuda_devices == 0 => Err(ModelError::CudaUnavailable {
                requested: self.to_string(),
                support: "no GPU counted".to_owned(),
            }),
            Self::Cuda(index) => {
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
    fn parses_every_form_and_round_trips() {
        for (text, request) in [
            ("cpu", DeviceRequest::Cpu),
            ("cuda", DeviceRequest::Cuda(None)),
            ("cuda:3", DeviceRequest::Cuda(Some(3))),
            ("auto", DeviceRequest::Auto),
        ] {
            assert_eq!(text.parse::<DeviceRequest>(), Ok(request));
            assert_eq!(request.to_string(), text);
        }
    }

    #[test]
    fn rejects_unknown_names() {
        for bad in ["", "tpu", "cuda:", "cuda:x", "cuda:-1"] {
            assert_eq!(
                bad.parse::<DeviceRequest>(),
                Err(ModelError::BadDeviceName(bad.to_owned()))
            );
        }
    }

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
