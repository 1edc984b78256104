//! Which member of an expert-parallel group holds which experts: by each member's pace
//! and memory, and by how many tokens each expert takes (measured in a run, from
//! `--log-json`'s tokens per expert, or equal).
//!
//! A member's expert time is its experts' tokens over its speed; the placement minimises
//! the slowest member's, each member holding at least one expert and no more than its
//! memory allows. Exact (a branch-and-bound search, heaviest experts first) where the
//! search is small, else the longest-processing-time rule for machines of unequal speed
//! (each expert, heaviest first, to the member that would finish it first).

/// One member of an expert-parallel group, as the placement sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertMember {
    /// Relative compute speed (any unit shared by the group).
    pub speed: f64,
    /// The most experts (of every MoE layer of its stage) its memory holds.
    pub capacity: usize,
}

/// A placement that cannot be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    /// Fewer experts than members, or more than their memory holds.
    #[error("{experts} experts over {members} members holding at most {capacities:?}: each member needs one expert at least and its memory room for the ones it holds")]
    Infeasible {
        /// Experts to place.
        experts: usize,
        /// Members.
        members: usize,
        /// Each member's capacity.
        capacities: Vec<usize>,
    },
    /// A speed or load that is not a positive (or, for a load, non-negative) number.
    #[error("speeds must be positive and loads non-negative, finite numbers")]
    BadNumber,
}

/// Searches exactly up to this many partial assignments, else the greedy rule.
const EXACT_LIMIT: u64 = 1 << 20;

/// Experts `0..load.len()` (each with its `load`, e.g. tokens per step) over `members`:
/// each member's experts, ascending, in member order.
pub fn place_experts(
    load: &[f64],
    members: &[ExpertMember],
) -> Result<Vec<Vec<usize>>, PlacementError> {
    let infeasible = || PlacementError::Infeasible {
        experts: load.len(),
        members: members.len(),
        capacities: members.iter().map(|m| m.capacity).collect(),
    };
    let room: usize = members.iter().map(|m| m.capacity).sum();
    if members.is_empty()
        || load.len() < members.len()
        || room < load.len()
        || members.iter().any(|m| m.capacity == 0)
    {
        return Err(infeasible());
    }
    let bad_speed = members
        .iter()
        .any(|m| !(m.speed > 0.0 && m.speed.is_finite()));
    if bad_speed || load.iter().any(|l| !(*l >= 0.0 && l.is_finite())) {
        return Err(PlacementError::BadNumber);
    }
    let mut order: Vec<usize> = (0..load.len()).collect();
    order.sort_by(|&a, &b| load[b].total_cmp(&load[a]).then(a.cmp(&b)));
    let search = (members.len() as u64).checked_pow(load.len() as u32);
    let owner = match search.is_some_and(|n| n <= EXACT_LIMIT) {
        true => exact(load, members, &order),
        false => greedy(load, members, &order),
    }
    .ok_or_else(infeasible)?;
    let mut placement = vec![Vec::new(); members.len()];
    for (expert, &member) in owner.iter().enumerate() {
        placement[member].push(expert);
    }
    Ok(placement)
}

/// The slowest member's time of a placement `owner` (expert → member).
pub fn slowest_time(load: &[f64], members: &[ExpertMember], owner: &[Vec<usize>]) -> f64 {
    (owner.iter().zip(members))
        .map(|(experts, m)| experts.iter().map(|&e| load[e]).sum::<f64>() / m.speed)
        .fold(0.0, f64::max)
}

/// Branch and bound over the experts in `order`: the best owner of each expert.
fn exact(load: &[f64], members: &[ExpertMember], order: &[usize]) -> Option<Vec<usize>> {
    struct Search<'a> {
        load: &'a [f64],
        members: &'a [ExpertMember],
        order: &'a [usize],
        times: Vec<f64>,
        counts: Vec<usize>,
        owner: Vec<usize>,
        best: Option<(f64, Vec<usize>)>,
    }
    impl Search<'_> {
        fn go(&mut self, at: usize) {
            let worst = self.times.iter().copied().fold(0.0, f64::max);
            if self.best.as_ref().is_some_and(|(b, _)| worst >= *b) {
                return;
            }
            // Members still empty need one of the experts left each.
            let empty = self.counts.iter().filter(|&&c| c == 0).count();
            if empty > self.order.len() - at {
                return;
            }
            if at == self.order.len() {
                self.best = Some((worst, self.owner.clone()));
                return;
            }
            let e = self.order[at];
            for m in 0..self.members.len() {
                if self.counts[m] == self.members[m].capacity {
                    continue;
                }
                let add = self.load[e] / self.members[m].speed;
                self.times[m] += add;
                self.counts[m] += 1;
                self.owner[e] = m;
                self.go(at + 1);
                self.times[m] -= add;
                self.counts[m] -= 1;
            }
        }
    }
    let mut search = Search {
        load,
        members,
        order,
        times: vec![0.0; members.len()],
        counts: vec![0; members.len()],
        owner: vec![0; load.len()],
        best: None,
    };
    search.go(0);
    search.best.map(|(_, owner)| owner)
}

/// Each expert of `order` to the member that would finish it first, with room, keeping
/// one expert for every member still empty.
fn greedy(load: &[f64], members: &[ExpertMember], order: &[usize]) -> Option<Vec<usize>> {
    let mut times = vec![0.0; members.len()];
    let mut counts = vec![0usize; members.len()];
    let mut owner = vec![0; load.len()];
    for (at, &e) in order.iter().enumerate() {
        let left = order.len() - at;
        let empty = counts.iter().filter(|&&c| c == 0).count();
        let m = (0..members.len())
            .filter(|&m| counts[m] < members[m].capacity)
            .filter(|&m| left > empty || counts[m] == 0)
            .min_by(|&a, &b| {
                let finish = |m: usize| times[m] + load[e] / members[m].speed;
                finish(a).total_cmp(&finish(b)).then(a.cmp(&b))
            })?;
        times[m] += load[e] / members[m].speed;
        counts[m] += 1;
        owner[e] = m;
    }
    Some(owner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member(speed: f64, capacity: usize) -> ExpertMember {
        ExpertMember { speed, capacity }
    }

    #[test]
    fn a_slow_member_holds_fewer_experts_and_a_full_one_no_more_than_it_can() {
        let equal = [1.0; 8];
        let pair = [member(1.0, 8), member(0.5, 8)];
        let pace = place_experts(&equal, &pair).unwrap();
        // [6, 2] and [5, 3] both take 6 (even [4, 4]: 8).
        assert_eq!(slowest_time(&equal, &pair, &pace), 6.0);
        assert!(pace[1].len() < pace[0].len(), "{pace:?}");
        // The slow member has memory for two experts only.
        let small = place_experts(&equal, &[member(1.0, 8), member(0.5, 2)]).unwrap();
        assert_eq!(small[1].len(), 2);
        // Measured loads: the two hot experts go to different members.
        let hot = [10.0, 1.0, 1.0, 10.0, 1.0, 1.0, 1.0, 1.0];
        let even = place_experts(&hot, &[member(1.0, 8), member(1.0, 8)]).unwrap();
        assert!(
            even.iter().all(|m| m.contains(&0) != m.contains(&3)),
            "{even:?}"
        );
        assert!(place_experts(&equal, &[member(1.0, 3), member(1.0, 4)]).is_err());
        assert!(place_experts(&[1.0], &[member(1.0, 3), member(1.0, 4)]).is_err());
        assert!(place_experts(&equal, &[member(0.0, 8)]).is_err());
    }

    /// Every way of giving each expert a member, for the brute force.
    fn all_placements(experts: usize, members: &[ExpertMember]) -> Vec<Vec<Vec<usize>>> {
        let n = members.len();
        (0..n.pow(experts as u32))
            .filter_map(|mut code| {
                let mut placement = vec![Vec::new(); n];
                for e in 0..experts {
                    placement[code % n].push(e);
                    code /= n;
                }
                let fits = (placement.iter().zip(members))
                    .all(|(p, m)| !p.is_empty() && p.len() <= m.capacity);
                fits.then_some(placement)
            })
            .collect()
    }

    proptest! {
        /// Exact on small cases (against every placement), and always a placement: each
        /// expert once, every member at least one and within its memory.
        #[test]
        fn placements_are_whole_and_optimal_where_searched(
            load in prop::collection::vec(0.0f64..10.0, 2..7),
            members in prop::collection::vec((0.1f64..2.0, 1usize..6), 1..4),
        ) {
            let members: Vec<ExpertMember> = members.iter().map(|&(s, c)| member(s, c)).collect();
            let all = all_placements(load.len(), &members);
            match place_experts(&load, &members) {
                Err(_) => prop_assert!(all.is_empty()),
                Ok(placement) => {
                    let mut seen: Vec<usize> = placement.iter().flatten().copied().collect();
                    seen.sort_unstable();
                    prop_assert_eq!(seen, (0..load.len()).collect::<Vec<_>>());
                    let best = (all.iter())
                        .map(|p| slowest_time(&load, &members, p))
                        .fold(f64::INFINITY, f64::min);
                    let ours = slowest_time(&load, &members, &placement);
                    prop_assert!(ours <= best + 1e-9, "{} vs {}", ours, best);
                }
            }
        }

        /// The greedy rule (large groups) places every expert within the members' room.
        #[test]
        fn the_greedy_rule_places_every_expert(
            load in prop::collection::vec(0.0f64..10.0, 8..40),
            speeds in prop::collection::vec(0.1f64..2.0, 2..6),
        ) {
            let members: Vec<ExpertMember> = speeds.iter().map(|&s| member(s, load.len())).collect();
            let mut order: Vec<usize> = (0..load.len()).collect();
            order.sort_by(|&a, &b| load[b].total_cmp(&load[a]));
            let owner = greedy(&load, &members, &order).unwrap();
            for m in 0..members.len() {
                prop_assert!(owner.contains(&m));
            }
        }
    }
}
