//! Cluster descriptions: device groups (a catalogue kind, or custom numbers), nodes,
//! links and memory headroom, read from TOML (`cluster.toml`).
//!
//! ```toml
//! [[group]]
//! kind = "a100-80g"        # a catalogue slug, or "custom" with tflops_bf16, memory_gb, mem_bw_gbs
//! count = 8
//! node = "n0"              # optional; groups on one node share intra-node links
//! [network]
//! intra_node_gbs = 300     # per direction
//! inter_node_gbs = 25
//! ```

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

pub use crate::catalogue::{
    catalogue, catalogue_peak, catalogue_slug_for_device_name, DeviceSpec, CATALOGUE,
};

/// A cluster file that does not describe a usable cluster.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClusterError {
    /// Not TOML of the expected shape (the parser's message).
    #[error("cluster file: {0}")]
    Toml(String),
    /// No `[[group]]` of devices.
    #[error("cluster file: no [[group]]")]
    NoGroups,
    /// A memory headroom outside [0, 0.9).
    #[error("cluster file: memory_headroom {0} must be in [0, 0.9)")]
    Headroom(f64),
    /// A group that cannot be used, named by its index and kind.
    #[error("cluster file: group {index} ({kind}): {problem}")]
    Group {
        /// 0-based group index.
        index: usize,
        /// Its kind.
        kind: String,
        /// What is wrong.
        problem: GroupProblem,
    },
    /// A network bandwidth or latency that is out of range.
    #[error("cluster file: {0}")]
    Network(#[from] synerfuse_plan::NetworkError),
}

/// What is wrong with a `[[group]]`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GroupProblem {
    /// No device.
    #[error("count must be at least 1")]
    Empty,
    /// A kind that is neither in the catalogue nor `custom` nor `cpu`.
    #[error("unknown kind; use one of {}, \"custom\" or \"cpu\"", catalogue_slugs().join(", "))]
    UnknownKind,
    /// A custom group without one of its numbers.
    #[error("a custom group needs {0}")]
    CustomWithout(&'static str),
    /// A number that must be positive.
    #[error("{field} must be positive (got {value})")]
    NotPositive {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A fraction outside (0, 1].
    #[error("{field} must be in (0, 1] (got {value})")]
    NotAFraction {
        /// `efficiency` or `speed`.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// More devices, with the groups before it, than the planner supports.
    #[error(
        "count {count} brings the cluster to {total} devices; the planner supports at most {limit}"
    )]
    TooMany {
        /// The group's count.
        count: usize,
        /// Devices up to and including this group.
        total: usize,
        /// [`MAX_DEVICES`].
        limit: usize,
    },
}

/// The most devices a cluster may hold: the planner keeps a record per device and its
/// search grows with their number (32,768 devices of 4 kinds plan in about 28 s), so a
/// larger count is refused up front rather than run out of memory.
pub const MAX_DEVICES: usize = 131_072;

fn catalogue_slugs() -> Vec<&'static str> {
    CATALOGUE.iter().map(|(s, _, _)| *s).collect()
}

/// One `[[group]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceGroup {
    /// A catalogue slug, `custom`, or `cpu` (numbers from a profile).
    pub kind: String,
    /// Devices in the group.
    pub count: usize,
    /// Node name; groups on one node share intra-node links.
    #[serde(default)]
    pub node: Option<String>,
    /// Site (datacenter) name; nodes of different sites are joined by the network's
    /// inter-site links.
    #[serde(default)]
    pub site: Option<String>,
    /// Custom or overriding peak bf16 TFLOP/s.
    #[serde(default)]
    pub tflops_bf16: Option<f64>,
    /// Custom or overriding peak fp16 TFLOP/s (default: the bf16 one).
    #[serde(default)]
    pub tflops_fp16: Option<f64>,
    /// Whether the device computes in bf16 (default: the catalogue's; custom kinds do);
    /// `false` makes a bf16 job compute on it in fp16.
    #[serde(default)]
    pub bf16: Option<bool>,
    /// Custom or overriding memory in GB.
    #[serde(default)]
    pub memory_gb: Option<f64>,
    /// Custom or overriding memory bandwidth in GB/s.
    #[serde(default)]
    pub mem_bw_gbs: Option<f64>,
    /// Achieved fraction of peak (η); default 0.45.
    #[serde(default)]
    pub efficiency: Option<f64>,
    /// Emulated speed relative to the profiled kind (the CPU test cluster): times are
    /// divided by it, and plans carry it to `synerfuse train` as device emulation.
    #[serde(default)]
    pub speed: Option<f64>,
}

pub use synerfuse_plan::{Network, NodeLink};

/// A cluster file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Fraction of each device's memory kept free (fragmentation, runtime); default 0.1.
    #[serde(default = "default_headroom")]
    pub memory_headroom: f64,
    /// Device groups.
    pub group: Vec<DeviceGroup>,
    /// Links.
    pub network: Network,
}

fn default_headroom() -> f64 {
    0.1
}

/// One device of the cluster, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Device {
    /// Index in the cluster (group order).
    pub index: usize,
    /// The group it came from.
    pub group: usize,
    /// The first group of the same kind and numbers (the group itself when none comes
    /// before): devices of identical groups on other nodes are interchangeable, and the
    /// planner prices and pools them once.
    pub class_group: usize,
    /// Kind slug (`a100-80g`, `custom`, `cpu`).
    pub kind: String,
    /// Node (`group{index}` where the group names none).
    pub node: String,
    /// Whether the cluster file named the node.
    pub named_node: bool,
    /// Site (`""`: the default one).
    pub site: String,
    /// Catalogue or custom numbers (`None` for kinds only a profile describes).
    pub spec: Option<DeviceSpec>,
    /// η.
    pub efficiency: f64,
    /// Emulated relative speed (1 = as profiled).
    pub speed: f64,
    /// Whether the cluster file gave a `speed` (the rank is then emulated in training,
    /// also at speed 1).
    pub emulated: bool,
}

impl Device {
    /// Its node and site.
    pub fn host(&self) -> synerfuse_plan::Host<'_> {
        synerfuse_plan::Host {
            node: &self.node,
            site: &self.site,
        }
    }

    /// The key of its compute costs: the first group of its kind and numbers
    /// (efficiency included) and its emulated speed (devices that share it are
    /// interchangeable; two groups of one kind with different numbers are not).
    pub fn class(&self) -> (usize, u64) {
        (self.class_group, self.speed.to_bits())
    }
}

impl DeviceGroup {
    /// Its numbers beside the kind, as bits: groups of one kind and numbers are alike
    /// (the planner prices and pools their devices once).
    pub fn numbers(&self) -> [Option<u64>; 7] {
        let numbers = [
            self.tflops_bf16,
            self.tflops_fp16,
            self.bf16.map(f64::from),
            self.memory_gb,
            self.mem_bw_gbs,
            self.efficiency,
            self.speed,
        ];
        numbers.map(|x| x.map(f64::to_bits))
    }
}

impl ClusterSpec {
    /// Parses and checks a cluster file.
    pub fn from_toml(text: &str) -> Result<Self, ClusterError> {
        let spec: ClusterSpec =
            toml::from_str(text).map_err(|e| ClusterError::Toml(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    fn validate(&self) -> Result<(), ClusterError> {
        if self.group.is_empty() {
            return Err(ClusterError::NoGroups);
        }
        if !(0.0..0.9).contains(&self.memory_headroom) {
            return Err(ClusterError::Headroom(self.memory_headroom));
        }
        let mut total = 0usize;
        for (index, g) in self.group.iter().enumerate() {
            let err = |problem: GroupProblem| ClusterError::Group {
                index,
                kind: g.kind.clone(),
                problem,
            };
            if g.count == 0 {
                return Err(err(GroupProblem::Empty));
            }
            total = total.saturating_add(g.count);
            if total > MAX_DEVICES {
                return Err(err(GroupProblem::TooMany {
                    count: g.count,
                    total,
                    limit: MAX_DEVICES,
                }));
            }
            let custom = g.kind == "custom";
            if !custom && g.kind != "cpu" && catalogue(&g.kind).is_none() {
                return Err(err(GroupProblem::UnknownKind));
            }
            if custom {
                for (field, value) in [
                    ("tflops_bf16", g.tflops_bf16.or(g.tflops_fp16)),
                    ("memory_gb", g.memory_gb),
                    ("mem_bw_gbs", g.mem_bw_gbs),
                ] {
                    if value.is_none() {
                        return Err(err(GroupProblem::CustomWithout(field)));
                    }
                }
            }
            for (field, value) in [
                ("tflops_bf16", g.tflops_bf16),
                ("tflops_fp16", g.tflops_fp16),
                ("memory_gb", g.memory_gb),
                ("mem_bw_gbs", g.mem_bw_gbs),
            ] {
                if let Some(value) = value.filter(|v| !(*v > 0.0 && v.is_finite())) {
                    return Err(err(GroupProblem::NotPositive { field, value }));
                }
            }
            for (field, value) in [("efficiency", g.efficiency), ("speed", g.speed)] {
                if let Some(value) = value.filter(|v| !(*v > 0.0 && *v <= 1.0)) {
                    return Err(err(GroupProblem::NotAFraction { field, value }));
                }
            }
        }
        self.network.check()?;
        let hosts = (self.group.iter())
            .filter_map(|g| Some((g.node.as_deref()?, g.site.as_deref().unwrap_or(""))));
        synerfuse_plan::network::sites_of_nodes(hosts)?;
        Ok(())
    }

    /// The site of `node` (`""`: the default site).
    pub fn site_of(&self, node: &str) -> &str {
        if self.group.iter().all(|g| g.site.is_none()) {
            return "";
        }
        let unnamed = (node.strip_prefix("group")).and_then(|i| i.parse::<usize>().ok());
        let named = |i: usize, g: &DeviceGroup| match &g.node {
            Some(n) => n == node,
            None => unnamed == Some(i),
        };
        (self.group.iter().enumerate())
            .find(|(i, g)| named(*i, g))
            .and_then(|(_, g)| g.site.as_deref())
            .unwrap_or("")
    }

    /// Every device, group by group.
    pub fn devices(&self) -> Vec<Device> {
        let mut out = Vec::new();
        // Groups are alike when all but the count and the node agree.
        let mut first_alike: HashMap<(&str, [Option<u64>; 7]), usize> = HashMap::new();
        for (gi, g) in self.group.iter().enumerate() {
            let key = (g.kind.as_str(), g.numbers());
            let class_group = *first_alike.entry(key).or_insert(gi);
            let base = catalogue(&g.kind);
            let spec = match (base, g.kind.as_str()) {
                (Some(b), _) => Some(DeviceSpec {
                    tflops_bf16: g.tflops_bf16.unwrap_or(b.tflops_bf16),
                    tflops_fp16: g.tflops_fp16.or(g.tflops_bf16).unwrap_or(b.tflops_fp16),
                    bf16: g.bf16.unwrap_or(b.bf16),
                    memory_gb: g.memory_gb.unwrap_or(b.memory_gb),
                    mem_bw_gbs: g.mem_bw_gbs.unwrap_or(b.mem_bw_gbs),
                    ..b
                }),
                (None, "custom") => Some(DeviceSpec {
                    tflops_bf16: g.tflops_bf16.or(g.tflops_fp16).unwrap_or(1.0),
                    tflops_fp16: g.tflops_fp16.or(g.tflops_bf16).unwrap_or(1.0),
                    bf16: g.bf16.unwrap_or(true),
                    memory_gb: g.memory_gb.unwrap_or(1.0),
                    mem_bw_gbs: g.mem_bw_gbs.unwrap_or(1.0),
                    link_gbs: 2.0 * self.network.intra_node_gbs,
                    accelerator: true,
                }),
                _ => g.memory_gb.map(|memory_gb| DeviceSpec {
                    tflops_bf16: g.tflops_bf16.or(g.tflops_fp16).unwrap_or(1.0),
                    tflops_fp16: g.tflops_fp16.or(g.tflops_bf16).unwrap_or(1.0),
                    bf16: g.bf16.unwrap_or(true),
                    memory_gb,
                    mem_bw_gbs: g.mem_bw_gbs.unwrap_or(1.0),
                    link_gbs: 2.0 * self.network.intra_node_gbs,
                    accelerator: false,
                }),
            };
            for _ in 0..g.count {
                out.push(Device {
                    index: out.len(),
                    group: gi,
                    class_group,
                    kind: g.kind.clone(),
                    node: g.node.clone().unwrap_or_else(|| format!("group{gi}")),
                    named_node: g.node.is_some(),
                    site: g.site.clone().unwrap_or_default(),
                    spec,
                    efficiency: g.efficiency.unwrap_or(0.45),
                    speed: g.speed.unwrap_or(1.0),
                    emulated: g.speed.is_some(),
                });
            }
        }
        out
    }

    /// Per-direction bandwidth between two devices in bytes/s.
    pub fn bandwidth(&self, a: &Device, b: &Device) -> f64 {
        self.network.between(a.host(), b.host()).bytes_per_s
    }

    /// Per-direction bandwidth between devices on nodes `a` and `b` in bytes/s.
    pub fn node_bandwidth(&self, a: &str, b: &str) -> f64 {
        self.node_link(a, b).bytes_per_s
    }

    /// The link between devices on nodes `a` and `b` ([`Network::between`], each node
    /// in its site).
    pub fn node_link(&self, a: &str, b: &str) -> synerfuse_plan::LinkSpeed {
        let host = |node| synerfuse_plan::Host {
            node,
            site: self.site_of(node),
        };
        self.network.between(host(a), host(b))
    }

    /// The slowest link between two of `nodes` (distinct names), bytes/s: what
    /// [`Self::node_bandwidth`] gives over every pair, without visiting every pair.
    pub fn slowest_inter_node(&self, nodes: &[&str]) -> f64 {
        // A hot path of the search: sites looked up only where the cluster names some.
        let sited = self.group.iter().any(|g| g.site.is_some());
        let mut by_site: BTreeMap<&str, std::collections::BTreeSet<&str>> = BTreeMap::new();
        for &node in nodes {
            let site = if sited { self.site_of(node) } else { "" };
            by_site.entry(site).or_default().insert(node);
        }
        let sites: Vec<(&str, Vec<&str>)> = (by_site.into_iter())
            .map(|(site, nodes)| (site, nodes.into_iter().collect()))
            .collect();
        let mut slowest = f64::INFINITY;
        for (i, (site, here)) in sites.iter().enumerate() {
            let default = self.network.inter_node_gbs;
            slowest = slowest.min(self.slowest_between(here, None, default));
            for (other, there) in &sites[i + 1..] {
                let n = &self.network;
                let named_sites = (n.link.iter())
                    .find(|l| (l.a == *site && l.b == *other) || (l.a == *other && l.b == *site));
                let default = n.inter_site_gbs.unwrap_or(n.inter_node_gbs);
                let default = named_sites.map_or(default, |l| l.gbs);
                slowest = slowest.min(self.slowest_between(here, Some(there), default));
            }
        }
        slowest
    }

    /// The slowest link, bytes/s, between a node of `a` and another of `b` (distinct
    /// names, sorted; `None`: the pairs within `a`), `default_gbs` where no
    /// named link joins a pair; the first naming of a pair counts (as
    /// [`Self::node_bandwidth`] finds it).
    fn slowest_between(&self, a: &[&str], b: Option<&[&str]>, default_gbs: f64) -> f64 {
        let (within, b) = (b.is_none(), b.unwrap_or(a));
        let mut named: BTreeMap<(&str, &str), f64> = BTreeMap::new();
        for l in &self.network.link {
            let (x, y) = (l.a.as_str(), l.b.as_str());
            let pair = match within {
                true => (x != y && a.binary_search(&x).is_ok() && a.binary_search(&y).is_ok())
                    .then(|| (x.min(y), x.max(y))),
                false => match (a.binary_search(&x).is_ok(), b.binary_search(&y).is_ok()) {
                    (true, true) => Some((x, y)),
                    _ if a.binary_search(&y).is_ok() && b.binary_search(&x).is_ok() => Some((y, x)),
                    _ => None,
                },
            };
            if let Some(pair) = pair {
                named.entry(pair).or_insert(l.gbs * 1e9);
            }
        }
        let pairs = match within {
            true => a.len() * a.len().saturating_sub(1) / 2,
            false => a.len() * b.len(),
        };
        let default = (named.len() < pairs).then_some(default_gbs * 1e9);
        (named.values().copied().chain(default)).fold(f64::INFINITY, f64::min)
    }

    /// Message latency in seconds.
    pub fn latency(&self) -> f64 {
        self.network.latency_us * 1e-6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slowest inter-node link equals the minimum over every pair of nodes.
    #[test]
    fn slowest_inter_node_equals_every_pair() {
        let link = |a: &str, b: &str, gbs| NodeLink {
            a: a.into(),
            b: b.into(),
            gbs,
            latency_us: None,
        };
        let cluster = ClusterSpec::from_toml(
            "[[group]]\nkind = \"a100-80g\"\ncount = 1\n[network]\nintra_node_gbs = 100\ninter_node_gbs = 10\ninter_site_gbs = 2\n",
        )
        .unwrap();
        // Without sites, and with n2 and n3 in a site of their own.
        let mut sited = cluster.clone();
        for (i, site) in ["", "", "far", "far"].iter().enumerate() {
            let node = format!("n{i}");
            sited.group.push(DeviceGroup {
                node: Some(node),
                site: (!site.is_empty()).then(|| site.to_string()),
                ..cluster.group[0].clone()
            });
        }
        let nodes = ["n0", "n1", "n2", "n3"];
        let cases = [
            vec![],
            vec![link("n0", "n1", 3.0)],
            vec![
                link("n1", "n0", 30.0),
                link("n0", "n2", 20.0),
                link("n2", "n1", 25.0),
            ],
            vec![
                link("n0", "n1", 30.0),
                link("n0", "n1", 1.0),
                link("n5", "n0", 1.0),
            ],
            vec![link("n3", "n1", 0.5), link("", "far", 1.5)],
            vec![
                link("n0", "n2", 3.0),
                link("n0", "n3", 3.0),
                link("n1", "n2", 3.0),
                link("n1", "n3", 3.0),
            ],
        ];
        for (links, mut cluster) in
            (cases.iter()).flat_map(|l| [(l, cluster.clone()), (l, sited.clone())])
        {
            cluster.network.link = links.clone();
            for k in 2..=4 {
                let here = &nodes[..k];
                let mut brute = f64::INFINITY;
                for a in here {
                    for b in here.iter().filter(|b| *b != a) {
                        brute = brute.min(cluster.node_bandwidth(a, b));
                    }
                }
                assert_eq!(
                    cluster.slowest_inter_node(here),
                    brute,
                    "{:?}",
                    cluster.network.link
                );
            }
        }
    }

    #[test]
    fn minimal_form_and_errors() {
        let c = ClusterSpec::from_toml(
            "[[group]]\nkind = \"a100-80g\"\ncount = 8\nnode = \"n0\"\n[[group]]\nkind = \"v100\"\ncount = 8\nnode = \"n1\"\n[network]\nintra_node_gbs = 300\ninter_node_gbs = 25\n",
        )
        .unwrap();
        let d = c.devices();
        assert_eq!(d.len(), 16);
        assert_eq!(d[8].kind, "v100");
        assert_eq!(c.bandwidth(&d[0], &d[1]), 300e9);
        assert_eq!(c.bandwidth(&d[0], &d[9]), 25e9);
        let bad = ClusterSpec::from_toml(
            "[[group]]\nkind = \"a99\"\ncount = 1\n[network]\nintra_node_gbs = 1\ninter_node_gbs = 1\n",
        )
        .unwrap_err();
        assert!(
            bad.to_string().contains("group 0 (a99): unknown kind"),
            "{bad}"
        );
        let custom = ClusterSpec::from_toml(
            "[[group]]\nkind = \"custom\"\ncount = 1\ntflops_bf16 = 10\n[network]\nintra_node_gbs = 1\ninter_node_gbs = 1\n",
        )
        .unwrap_err();
        assert!(custom.to_string().contains("needs memory_gb"), "{custom}");
        assert_eq!(CATALOGUE.len(), 18);
        // A count no planner run could hold is refused by group, before any allocation.
        let huge = ClusterSpec::from_toml(
            "[[group]]\nkind = \"h100-sxm\"\ncount = 8\n[[group]]\nkind = \"a10\"\ncount = 100000000\n[network]\nintra_node_gbs = 1\ninter_node_gbs = 1\n",
        )
        .unwrap_err();
        assert_eq!(
            huge.to_string(),
            "cluster file: group 1 (a10): count 100000000 brings the cluster to 100000008 devices; the planner supports at most 131072"
        );
    }

    /// Driver names find the catalogue entry whose peak a run's MFU is stated against.
    #[test]
    fn driver_names_map_to_catalogue_peaks() {
        for (name, slug) in [
            ("NVIDIA H100 80GB HBM3", "h100-sxm"),
            ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
            ("NVIDIA H100 PCIe", "h100-pcie"),
            ("NVIDIA H200", "h200"),
            ("NVIDIA A100-SXM4-40GB", "a100-40g"),
            ("NVIDIA A100-SXM4-80GB", "a100-80g"),
            ("Tesla V100-SXM2-32GB", "v100"),
            ("NVIDIA A10", "a10"),
            ("Tesla T4", "t4"),
        ] {
            assert_eq!(catalogue_slug_for_device_name(name), Some(slug), "{name}");
        }
        assert_eq!(catalogue_slug_for_device_name("NVIDIA H100 NVL"), None);
        assert_eq!(
            catalogue_slug_for_device_name("NVIDIA GeForce GTX 1080"),
            None
        );
        let h100 = catalogue_slug_for_device_name("NVIDIA H100 80GB HBM3").and_then(catalogue);
        assert_eq!(h100.map(|d| d.tflops_bf16), Some(989.0));
    }
}
