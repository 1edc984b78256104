//! The links between a job's hosts: a cluster file's `[network]`, and a plan's when its
//! run emulates them. Hosts (nodes) sit in sites (datacenters); a link between two nodes
//! is the pair's named link if there is one, else between two sites the sites' named
//! link or `inter_site_gbs`, else `inter_node_gbs`; within a node, `intra_node_gbs`.
//!
//! ```toml
//! [network]
//! intra_node_gbs = 300        # per direction
//! inter_node_gbs = 25
//! latency_us = 10             # per message (default 10)
//! inter_site_gbs = 1.25       # between sites (default: inter_node_gbs)
//! inter_site_latency_us = 2000
//! [[network.link]]            # a named link between two nodes, or two sites
//! a = "n0"
//! b = "n1"
//! gbs = 5
//! ```

use serde::{Deserialize, Serialize};

/// `[network]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// Per-direction bandwidth between devices of one node, GB/s.
    pub intra_node_gbs: f64,
    /// Per-direction bandwidth between nodes of one site, GB/s.
    pub inter_node_gbs: f64,
    /// Latency of one message, microseconds (default 10).
    #[serde(default = "default_latency")]
    pub latency_us: f64,
    /// Per-direction bandwidth between nodes of different sites, GB/s (default:
    /// `inter_node_gbs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_site_gbs: Option<f64>,
    /// Latency of one message between sites, microseconds (default: `latency_us`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_site_latency_us: Option<f64>,
    /// Named links, overriding the defaults for one pair of nodes or of sites.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub link: Vec<NodeLink>,
}

fn default_latency() -> f64 {
    10.0
}

/// An explicit link between two nodes, or between two sites.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLink {
    /// One node (or site).
    pub a: String,
    /// The other.
    pub b: String,
    /// Per-direction bandwidth in GB/s.
    pub gbs: f64,
    /// Latency of one message, microseconds (default: the network's for the pair).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<f64>,
}

/// Where a device sits: its node and its site (`""`: the default site).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host<'a> {
    /// The node (host).
    pub node: &'a str,
    /// The site (datacenter).
    pub site: &'a str,
}

/// How far apart two devices are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reach {
    /// On one node.
    Node,
    /// On two nodes of one site.
    Site,
    /// On two sites.
    Sites,
}

/// One link's speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpeed {
    /// Per-direction bandwidth, bytes/s.
    pub bytes_per_s: f64,
    /// Latency of one message, seconds.
    pub latency_s: f64,
    /// Which link it is.
    pub reach: Reach,
}

impl LinkSpeed {
    /// Seconds to carry one message of `bytes`.
    pub fn seconds(&self, bytes: f64) -> f64 {
        self.latency_s + bytes / self.bytes_per_s
    }
}

/// A `[network]` that describes no usable links.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NetworkError {
    /// A bandwidth that is not a positive number.
    #[error("[network] {field} must be positive (got {value})")]
    Bandwidth {
        /// The field (`intra_node_gbs`, `link a-b gbs`, ...).
        field: String,
        /// The value.
        value: f64,
    },
    /// A negative (or NaN) latency.
    #[error("[network] {field} must be ≥ 0 (got {value})")]
    Latency {
        /// The field.
        field: String,
        /// The value.
        value: f64,
    },
    /// One node placed in two sites.
    #[error("node {node:?} is placed in two sites, {:?} and {:?}", sites[0], sites[1])]
    NodeInTwoSites {
        /// The node.
        node: String,
        /// The first two sites it is given (`""`: none).
        sites: [String; 2],
    },
}

/// Each named node's site (`""`: none), from (node, site) pairs, or the first node given
/// two sites: a node is one host, in one datacenter.
pub fn sites_of_nodes<'a>(
    hosts: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<std::collections::BTreeMap<&'a str, &'a str>, NetworkError> {
    let mut site_of = std::collections::BTreeMap::new();
    for (node, site) in hosts {
        let first = *site_of.entry(node).or_insert(site);
        if first != site {
            let (node, sites) = (node.to_owned(), [first.to_owned(), site.to_owned()]);
            return Err(NetworkError::NodeInTwoSites { node, sites });
        }
    }
    Ok(site_of)
}

impl Network {
    /// Checks every bandwidth is positive and every latency non-negative.
    pub fn check(&self) -> Result<(), NetworkError> {
        let mut bandwidths = vec![
            ("intra_node_gbs".to_owned(), Some(self.intra_node_gbs)),
            ("inter_node_gbs".to_owned(), Some(self.inter_node_gbs)),
            ("inter_site_gbs".to_owned(), self.inter_site_gbs),
        ];
        let mut latencies = vec![
            ("latency_us".to_owned(), Some(self.latency_us)),
            (
                "inter_site_latency_us".to_owned(),
                self.inter_site_latency_us,
            ),
        ];
        for l in &self.link {
            bandwidths.push((format!("link {}-{} gbs", l.a, l.b), Some(l.gbs)));
            latencies.push((format!("link {}-{} latency_us", l.a, l.b), l.latency_us));
        }
        for (field, value) in bandwidths {
            if let Some(value) = value.filter(|v| !(*v > 0.0 && v.is_finite())) {
                return Err(NetworkError::Bandwidth { field, value });
            }
        }
        for (field, value) in latencies {
            if let Some(value) = value.filter(|v| !(*v >= 0.0 && v.is_finite())) {
                return Err(NetworkError::Latency { field, value });
            }
        }
        Ok(())
    }

    /// The link between devices on `a` and `b`.
    pub fn between(&self, a: Host<'_>, b: Host<'_>) -> LinkSpeed {
        let reach = match (a.node == b.node, a.site == b.site) {
            (true, _) => Reach::Node,
            (false, true) => Reach::Site,
            (false, false) => Reach::Sites,
        };
        let (gbs, latency_us) = match reach {
            Reach::Node => (self.intra_node_gbs, self.latency_us),
            Reach::Site => (self.inter_node_gbs, self.latency_us),
            Reach::Sites => (
                self.inter_site_gbs.unwrap_or(self.inter_node_gbs),
                self.inter_site_latency_us.unwrap_or(self.latency_us),
            ),
        };
        let named = |x: &str, y: &str| {
            (self.link.iter()).find(|l| (l.a == x && l.b == y) || (l.a == y && l.b == x))
        };
        let link = match reach {
            Reach::Node => None,
            Reach::Site => named(a.node, b.node),
            Reach::Sites => named(a.node, b.node).or_else(|| named(a.site, b.site)),
        };
        let (gbs, latency_us) = link.map_or((gbs, latency_us), |l| {
            (l.gbs, l.latency_us.unwrap_or(latency_us))
        });
        LinkSpeed {
            bytes_per_s: gbs * 1e9,
            latency_s: latency_us * 1e-6,
            reach,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_has_one_site() {
        let ok = sites_of_nodes([("a", "east"), ("b", ""), ("a", "east")]).unwrap();
        assert_eq!(ok.get("a"), Some(&"east"));
        assert_eq!(ok.get("b"), Some(&""));
        let err = sites_of_nodes([("a", "east"), ("b", "west"), ("a", "")]).unwrap_err();
        assert_eq!(
            err,
            NetworkError::NodeInTwoSites {
                node: "a".into(),
                sites: ["east".into(), "".into()]
            }
        );
        assert!(
            err.to_string().contains("\"a\" is placed in two sites"),
            "{err}"
        );
    }

    fn host<'a>(node: &'a str, site: &'a str) -> Host<'a> {
        Host { node, site }
    }

    #[test]
    fn links_between_nodes_sites_and_named_pairs() {
        let network: Network = toml::from_str(
            "intra_node_gbs = 100\ninter_node_gbs = 10\nlatency_us = 5\ninter_site_gbs = 1\ninter_site_latency_us = 1000\n\
             [[link]]\na = \"n1\"\nb = \"n0\"\ngbs = 4\n\
             [[link]]\na = \"east\"\nb = \"west\"\ngbs = 0.5\nlatency_us = 3000\n",
        )
        .unwrap();
        network.check().unwrap();
        let speed = |a, b| {
            let l = network.between(a, b);
            (l.bytes_per_s / 1e9, l.latency_s * 1e6, l.reach)
        };
        let (n0, n1, n2) = (host("n0", "east"), host("n1", "east"), host("n2", "east"));
        assert_eq!(speed(n0, n0), (100.0, 5.0, Reach::Node));
        assert_eq!(speed(n0, n2), (10.0, 5.0, Reach::Site));
        assert_eq!(speed(n0, n1), (4.0, 5.0, Reach::Site));
        assert_eq!(speed(n2, host("m0", "west")), (0.5, 3000.0, Reach::Sites));
        assert_eq!(speed(n2, host("m0", "north")), (1.0, 1000.0, Reach::Sites));
        assert!((network.between(n0, n2).seconds(1e9) - (0.1 + 5e-6)).abs() < 1e-12);
    }

    /// A plan file's network, nodes and sites: read, each rank's host, written back the
    /// same; a node in two sites and a bad number refused by name.
    #[test]
    fn plan_files_carry_the_network_nodes_and_sites() {
        let text = "[network]\nintra_node_gbs = 100\ninter_node_gbs = 10\ninter_site_gbs = 1\n\n\
            [[replica]]\nlayers = [1, 1]\nmicro_batch_size = 1\nnum_micro_batches = 2\n\
            nodes = [\"a\", \"b\"]\nsites = [\"east\", \"west\"]\n\n\
            [[replica]]\nlayers = [2]\nmicro_batch_size = 1\nnum_micro_batches = 2\nnodes = [\"a\"]\nsites = [\"east\"]\n";
        let plan = crate::Plan::from_toml(text, None).unwrap();
        assert_eq!(plan.network().and_then(|n| n.inter_site_gbs), Some(1.0));
        let hosts = plan.hosts();
        assert_eq!(
            hosts,
            [host("a", "east"), host("b", "west"), host("a", "east")]
        );
        for (rank, h) in hosts.iter().enumerate() {
            let p = plan.placement(rank).unwrap();
            assert_eq!(
                (p.node.as_deref(), p.site.as_deref()),
                (Some(h.node), Some(h.site))
            );
        }
        let again = crate::Plan::from_toml(&plan.to_toml().unwrap(), None).unwrap();
        assert_eq!(again, plan);
        let two_sites = text.replace("sites = [\"east\"]", "sites = [\"west\"]");
        let err = crate::Plan::from_toml(&two_sites, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("node \"a\" is placed in two sites"), "{err}");
        let bad = text.replace("inter_node_gbs = 10", "inter_node_gbs = -1");
        let err = crate::Plan::from_toml(&bad, None).unwrap_err().to_string();
        assert!(err.contains("inter_node_gbs must be positive"), "{err}");
    }

    #[test]
    fn bad_numbers_are_named() {
        let mut network = Network {
            intra_node_gbs: 100.0,
            inter_node_gbs: 10.0,
            latency_us: 10.0,
            inter_site_gbs: Some(0.0),
            inter_site_latency_us: None,
            link: Vec::new(),
        };
        let err = network.check().unwrap_err().to_string();
        assert!(err.contains("inter_site_gbs must be positive"), "{err}");
        network.inter_site_gbs = None;
        network.link.push(NodeLink {
            a: "x".into(),
            b: "y".into(),
            gbs: 1.0,
            latency_us: Some(-1.0),
        });
        let err = network.check().unwrap_err().to_string();
        assert!(err.contains("link x-y latency_us must be ≥ 0"), "{err}");
    }
}
