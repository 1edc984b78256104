//! Link emulation: a plan that carries a `[network]` runs its ranks as if they sat on
//! the nodes and sites its placements name, on one machine, as device speeds emulate
//! slower devices. Each transfer between two emulated nodes completes no sooner than its
//! bytes over the link's bandwidth plus its latency after it could start; transfers
//! within a node run at the machine's own speed (MPI over shared memory).
//!
//! Each rank's outgoing transfers queue behind each other, one at a time, in two queues
//! (as the planner prices them): the gradient reductions' (their collectives and
//! exchanges, bucket after bucket) and the pipeline's (activations and their gradients).
//! A pipeline's small messages do not wait for a reduction's whole piece to cross: on a
//! real link they would share it, packet by packet.
//!
//! - A point-to-point message (a pipeline link, a hierarchical exchange) leaves when the
//!   sender's link is free; the sender stamps it with its arrival time (a message of its
//!   own before the data, on one machine's monotonic clock), and the receiver holds the
//!   data until then.
//! - An MPI collective (a flat reduction, a gather) is charged as the ring its bytes
//!   would take: each step one chunk over every link of the ring at once, waiting for the
//!   slowest that crosses nodes; it completes no sooner than that after this rank
//!   started it and its link was free. Every member runs the ring, so every member waits.
//!
//! The bytes this rank sent across nodes and across sites are counted, per kind of link:
//! what a step carried over the slow links.

use super::CommError;
use std::cell::Cell;
use synerfuse_plan::{Host, LinkSpeed, Network, Reach};

/// Seconds on the machine's monotonic clock, which every process of it shares.
pub fn monotonic_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC is always available.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Sleeps until `deadline` on [`monotonic_s`]'s clock.
pub fn wait_until(deadline: f64) {
    let left = deadline - monotonic_s();
    if left > 0.0 {
        std::thread::sleep(std::time::Duration::from_secs_f64(left));
    }
}

/// Sleeps until `done`, if it is given.
pub fn wait_for(done: Option<f64>) {
    if let Some(done) = done {
        wait_until(done);
    }
}

/// What a transfer carries: which of a rank's queues it waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traffic {
    /// A gradient reduction's or parameter gather's.
    Reduction = 0,
    /// A pipeline's activations and their gradients.
    Pipeline = 1,
}

/// Bytes this rank has sent over emulated links since the start.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CrossedBytes {
    /// Between two nodes of one site.
    pub across_nodes: f64,
    /// Between two sites.
    pub across_sites: f64,
}

impl std::ops::Sub for CrossedBytes {
    type Output = CrossedBytes;

    fn sub(self, before: CrossedBytes) -> CrossedBytes {
        CrossedBytes {
            across_nodes: self.across_nodes - before.across_nodes,
            across_sites: self.across_sites - before.across_sites,
        }
    }
}

/// Where each world rank sits as the plan names it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlannedHosts {
    /// Each world rank's node (`None`: the machine it runs on).
    pub nodes: Vec<Option<String>>,
    /// Each world rank's site (`""`: the default one).
    pub sites: Vec<String>,
    /// The links between them that the run emulates, if any.
    pub network: Option<Network>,
    /// Whether MPI groups that span nodes reduce hierarchically (over their islands) or
    /// flat.
    pub hierarchical: bool,
}

impl PlannedHosts {
    /// The hosts of `plan`'s ranks, with its network, reducing hierarchically.
    pub fn of(plan: &synerfuse_plan::Plan) -> Self {
        let hosts = plan.hosts();
        PlannedHosts {
            nodes: (hosts.iter())
                .map(|h| (!h.node.is_empty()).then(|| h.node.to_owned()))
                .collect(),
            sites: hosts.iter().map(|h| h.site.to_owned()).collect(),
            network: plan.network().cloned(),
            hierarchical: true,
        }
    }

    fn host(&self, rank: usize) -> Host<'_> {
        Host {
            node: self
                .nodes
                .get(rank)
                .and_then(|n| n.as_deref())
                .unwrap_or(""),
            site: self.sites.get(rank).map_or("", String::as_str),
        }
    }
}

/// This rank's emulated links.
#[derive(Debug)]
pub struct LinkEmulation {
    network: Network,
    hosts: PlannedHosts,
    me: usize,
    /// When this rank's outgoing link is free of reductions, and of pipeline messages
    /// ([`monotonic_s`]).
    free_at: [Cell<f64>; 2],
    crossed: Cell<CrossedBytes>,
}

impl LinkEmulation {
    /// The links of `hosts` as world rank `me` sees them, or `None` where the plan has
    /// no network or names one node only. `machines` are the ranks' real hosts (any
    /// values, equal for one machine): the stamps compare clocks, so every rank must run
    /// on one machine.
    pub fn new(
        hosts: &PlannedHosts,
        me: usize,
        machines: &[i64],
    ) -> Result<Option<Self>, CommError> {
        let Some(network) = hosts.network.clone() else {
            return Ok(None);
        };
        let world = machines.len();
        let spans = (0..world).any(|r| hosts.host(r) != hosts.host(0));
        if !spans {
            return Ok(None);
        }
        if let Some(other) = (0..world).find(|&r| machines[r] != machines[0]) {
            return Err(CommError::Shape {
                rank: me,
                op: "link emulation",
                problem: format!(
                    "the plan's [network] is emulated on one machine, but ranks 0 and {other} run on different hosts; drop the plan's [network] (and its nodes) to train on real hosts"
                ),
            });
        }
        Ok(Some(LinkEmulation {
            network,
            hosts: hosts.clone(),
            me,
            free_at: [Cell::new(0.0), Cell::new(0.0)],
            crossed: Cell::new(CrossedBytes::default()),
        }))
    }

    /// The emulated link from world rank `a` to `b`, `None` within one node.
    pub fn link(&self, a: usize, b: usize) -> Option<LinkSpeed> {
        let link = self.network.between(self.hosts.host(a), self.hosts.host(b));
        (link.reach != Reach::Node).then_some(link)
    }

    /// Whether world rank `r` sits on another node than this rank.
    pub fn crosses_to(&self, r: usize) -> bool {
        self.link(self.me, r).is_some()
    }

    /// Whether `members` (world ranks) sit on more than one node.
    pub fn spans(&self, members: &[usize]) -> bool {
        let first = members.first().map(|&r| self.hosts.host(r));
        members.iter().any(|&r| Some(self.hosts.host(r)) != first)
    }

    /// Bytes sent over emulated links so far.
    pub fn crossed(&self) -> CrossedBytes {
        self.crossed.get()
    }

    fn count(&self, reach: Reach, bytes: f64) {
        let mut crossed = self.crossed.get();
        match reach {
            Reach::Node => {}
            Reach::Site => crossed.across_nodes += bytes,
            Reach::Sites => crossed.across_sites += bytes,
        }
        self.crossed.set(crossed);
    }

    /// Queues `seconds` on this rank's link from now: when they end.
    fn occupy(&self, traffic: Traffic, seconds: f64) -> f64 {
        let queue = &self.free_at[traffic as usize];
        let end = queue.get().max(monotonic_s()) + seconds;
        queue.set(end);
        end
    }

    /// A message of `bytes` from this rank to world rank `peer` leaves when its queue
    /// on the link is free: its arrival time, `None` within one node.
    pub fn send(&self, traffic: Traffic, peer: usize, bytes: f64) -> Option<f64> {
        let link = self.link(self.me, peer)?;
        self.count(link.reach, bytes);
        Some(self.occupy(traffic, link.seconds(bytes)))
    }

    /// A ring collective over `members` (world ranks, in ring order) of `steps` steps of
    /// `chunk` bytes each: when it completes here, `None` when no ring link crosses nodes.
    pub fn ring(&self, members: &[usize], steps: usize, chunk: f64) -> Option<f64> {
        let n = members.len();
        let hop = |i: usize| self.link(members[i], members[(i + 1) % n]);
        let step = (0..n)
            .filter_map(hop)
            .map(|l| l.seconds(chunk))
            .fold(None, |a: Option<f64>, s| Some(a.map_or(s, |a| a.max(s))))?;
        if let Some(at) = members.iter().position(|&r| r == self.me) {
            if let Some(out) = hop(at) {
                self.count(out.reach, steps as f64 * chunk);
            }
        }
        Some(self.occupy(Traffic::Reduction, steps as f64 * step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> PlannedHosts {
        let network = Network {
            intra_node_gbs: 100.0,
            inter_node_gbs: 0.001,
            latency_us: 0.0,
            inter_site_gbs: Some(0.0001),
            inter_site_latency_us: None,
            link: Vec::new(),
        };
        PlannedHosts {
            nodes: ["a", "a", "b", "b"].map(|n| Some(n.to_owned())).to_vec(),
            sites: vec![String::new(), String::new(), String::new(), "far".into()],
            network: Some(network),
            hierarchical: true,
        }
    }

    #[test]
    fn rings_wait_for_their_slowest_crossing_and_count_their_own_bytes() {
        let hosts = hosts();
        let me = LinkEmulation::new(&hosts, 1, &[7; 4]).unwrap().unwrap();
        // Ring 0 → 1 → 2 → 3 → 0: 1 → 2 crosses nodes (1 MB/s), 3 → 0 crosses sites
        // (100 kB/s): each of 2 steps of 1 kB waits 10 ms.
        let start = monotonic_s();
        let end = me.ring(&[0, 1, 2, 3], 2, 1000.0).unwrap();
        assert!((end - start - 0.02).abs() < 0.005, "{}", end - start);
        assert_eq!(me.crossed().across_nodes, 2000.0);
        // Within node a, nothing is emulated.
        assert_eq!(me.ring(&[0, 1], 2, 1000.0), None);
        assert_eq!(me.send(Traffic::Reduction, 0, 1000.0), None);
        // A reduction's message queues behind the ring on this rank's link; a
        // pipeline's does not.
        let arrival = me.send(Traffic::Reduction, 2, 1000.0).unwrap();
        assert!((arrival - end - 0.001).abs() < 1e-9);
        let sent = monotonic_s();
        let arrival = me.send(Traffic::Pipeline, 2, 1000.0).unwrap();
        assert!(arrival - sent < 0.0015, "{}", arrival - sent);
        assert!(me.crosses_to(3) && !me.crosses_to(0));
        assert!(me.spans(&[0, 2]) && !me.spans(&[0, 1]));
    }

    #[test]
    fn one_node_or_no_network_emulates_nothing_and_many_machines_are_refused() {
        let mut hosts = hosts();
        let err = LinkEmulation::new(&hosts, 0, &[1, 1, 2, 2]).unwrap_err();
        assert!(
            err.to_string()
                .contains("ranks 0 and 2 run on different hosts"),
            "{err}"
        );
        hosts.nodes = vec![None; 4];
        hosts.sites = vec![String::new(); 4];
        assert!(LinkEmulation::new(&hosts, 0, &[1, 1, 2, 2])
            .unwrap()
            .is_none());
        let mut hosts = self::hosts();
        hosts.network = None;
        assert!(LinkEmulation::new(&hosts, 0, &[1; 4]).unwrap().is_none());
    }
}
