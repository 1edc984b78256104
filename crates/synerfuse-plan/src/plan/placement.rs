//! Where each rank computes: the runtime device it asks for, and what the cluster file
//! says of it (kind, memory, an emulated speed).

use serde::{Deserialize, Serialize};

/// The device a rank computes on at run time (`cpu`, `cuda`, `cuda:N`, `auto`), before
/// checking the machine has it; as opposed to the cluster's name for its kind
/// ([`RankPlacement::kind`]). `synerfuse_model` resolves it to a libtorch device.
///
/// `auto` picks a GPU when libtorch sees one and the CPU otherwise, which is what a
/// mixed CPU/GPU job wants from a single flag shared by every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceRequest {
    /// The host CPU.
    Cpu,
    /// A GPU: the given index, or the local rank's share of the visible GPUs.
    Cuda(Option<usize>),
    /// A GPU when one is visible, else the CPU.
    Auto,
}

/// A device name that is none of `cpu`, `cuda`, `cuda:N`, `auto`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a device: expected cpu, cuda, cuda:N or auto")]
pub struct UnknownDevice(pub String);

impl std::str::FromStr for DeviceRequest {
    type Err = UnknownDevice;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::Cuda(None)),
            "auto" => Ok(DeviceRequest::Auto),
            other => other
                .strip_prefix("cuda:")
                .and_then(|index| index.parse().ok())
                .map(|index| DeviceRequest::Cuda(Some(index)))
                .ok_or_else(|| UnknownDevice(s.to_owned())),
        }
    }
}

impl std::fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(None) => f.write_str("cuda"),
            DeviceRequest::Cuda(Some(index)) => write!(f, "cuda:{index}"),
            DeviceRequest::Auto => f.write_str("auto"),
        }
    }
}

impl TryFrom<String> for DeviceRequest {
    type Error = UnknownDevice;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        name.parse()
    }
}

impl From<DeviceRequest> for String {
    fn from(device: DeviceRequest) -> String {
        device.to_string()
    }
}

/// What a rank computes on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankPlacement {
    /// The runtime device; `None` (a plan file that names memory or speeds but no
    /// devices) leaves it to the job's `--device`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceRequest>,
    /// Emulated speed relative to the device's own (1.0 = as is; 0.5 = half as fast). A
    /// test and benchmark device for clusters without heterogeneity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed: Option<f64>,
    /// The cluster file's device kind (`a100-80g`, `cpu`, ...), for people and tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The device's memory in GB: the distributed optimizer gives each rank a share of
    /// the state in proportion to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_gb: Option<f64>,
    /// The cluster file's node (host) of the device: ranks of one node form an island
    /// that reduces inside itself before anything crosses to another node; on one
    /// machine, an emulated host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The cluster file's site (datacenter) of the node: nodes of two sites are joined by
    /// the slowest links.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site: Option<String>,
    /// What the rank computes in, where the plan says (else the job's `--bf16`/`--fp16`
    /// or fp32): one precision per stage; main gradients and reductions stay fp32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<crate::Precision>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_requests_parse_every_form_and_round_trip() {
        for (text, request) in [
            ("cpu", DeviceRequest::Cpu),
            ("cuda", DeviceRequest::Cuda(None)),
            ("cuda:3", DeviceRequest::Cuda(Some(3))),
            ("auto", DeviceRequest::Auto),
        ] {
            assert_eq!(text.parse::<DeviceRequest>(), Ok(request));
            assert_eq!(request.to_string(), text);
        }
        for bad in ["", "tpu", "cuda:", "cuda:x", "cuda:-1"] {
            assert_eq!(
                bad.parse::<DeviceRequest>(),
                Err(UnknownDevice(bad.to_owned()))
            );
        }
    }
}
