//! Tensor-parallel groups as the planner prices them: devices of one node that hold one
//! stage together, each with a share of the stage's query groups, FFN columns and
//! vocabulary rows ([`TpLayout`]). Unequal devices get unequal shares: the ones that
//! make the group's slowest member finish first, found among every share vector
//! up to [`MOST_SHARE`].

use crate::cluster::Device;
use std::collections::HashMap;
use synerfuse_plan::cp::ContextSplit;
use synerfuse_plan::tp::TpLayout;
use synerfuse_plan::ModelShape;

/// The largest share tried (shares are in lowest terms, so `[8, 1]` is the most uneven
/// split of two devices).
pub const MOST_SHARE: u32 = 8;

/// One position of a pipeline: a device alone, a tensor-parallel group, or a
/// context-parallel group (each member the whole stage on its own tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct TpGroup {
    /// Device indices in rank order (fastest first): tensor-parallel ranks, then, with
    /// context parallelism, its members' tensor-parallel groups in turn.
    pub members: Vec<usize>,
    /// Context-parallel members (1: a tensor-parallel group or a device alone).
    pub cp: usize,
    /// Each device's fraction of every sequence's tokens (its context-parallel member's;
    /// 1 without context parallelism): its activations scale with it.
    pub tokens: Vec<f64>,
    /// Shares in lowest terms (all 1: even, as Megatron splits).
    pub shares: Vec<u32>,
    /// Each member's fraction of a layer's FLOPs under the shares' whole-unit rounding.
    pub work: Vec<f64>,
    /// Each member's fraction of a layer's parameters (and, with sequence parallelism,
    /// of its activations).
    pub state: Vec<f64>,
    /// Each member's fraction of the vocabulary rows.
    pub vocab: Vec<f64>,
}

impl TpGroup {
    /// A device alone.
    pub fn single(device: usize) -> Self {
        TpGroup {
            members: vec![device],
            cp: 1,
            tokens: vec![1.0],
            shares: vec![1],
            work: vec![1.0],
            state: vec![1.0],
            vocab: vec![1.0],
        }
    }

    /// The group of `members` with `shares`, or `None` when the shares cannot split the
    /// model (a member left without a query group, or even shares that do not divide).
    pub fn new(model: &ModelShape, members: Vec<usize>, shares: Vec<u32>) -> Option<Self> {
        let even = shares.iter().all(|&s| s == shares[0]);
        let layout = TpLayout::new(
            (!even).then_some(shares.as_slice()),
            members.len(),
            model.num_kv_heads,
            model.ffn_hidden_size,
            model.vocab_size,
        )
        .and_then(|layout| match model.experts {
            Some(e) => layout.with_expert_ffn(e.ffn_hidden_size),
            None => Ok(layout),
        })
        .ok()?;
        let (attention_flops, ffn_flops) = layer_flops(model);
        let (attention_params, ffn_params) = layer_params(model);
        let (q, f, v) = (
            model.num_kv_heads as f64,
            model.ffn_hidden_size as f64,
            model.vocab_size as f64,
        );
        let part = |a: f64, b: f64, k: usize| {
            (a * layout.query_groups[k].len() as f64 / q
                + b * layout.ffn_columns[k].len() as f64 / f)
                / (a + b)
        };
        let n = members.len();
        Some(TpGroup {
            cp: 1,
            tokens: vec![1.0; n],
            work: (0..n)
                .map(|k| part(attention_flops, ffn_flops, k))
                .collect(),
            state: (0..n)
                .map(|k| part(attention_params, ffn_params, k))
                .collect(),
            vocab: (0..n)
                .map(|k| layout.vocab_rows[k].len() as f64 / v)
                .collect(),
            members,
            shares: layout.shares,
        })
    }

    /// The context-parallel group of `members` splitting every sequence of the model in
    /// `shares` (Megatron's load-balanced chunks when even, which the sequence must then
    /// divide into), or `None` when it cannot. Each member holds the whole stage's
    /// parameters; its work, activations and share of the head follow its tokens (each
    /// position pair the same attention work).
    pub fn context(model: &ModelShape, members: Vec<usize>, shares: Vec<u32>) -> Option<Self> {
        let even = shares.iter().all(|&s| s == shares[0]);
        let split = match even {
            true => ContextSplit::even(model.seq_length, members.len()),
            false => ContextSplit::in_shares(model.seq_length, &shares),
        }
        .ok()?;
        let g = gcd_all(&shares).max(1);
        let n = members.len();
        let tokens: Vec<f64> = (0..n)
            .map(|k| split.tokens(k) as f64 / model.seq_length as f64)
            .collect();
        Some(TpGroup {
            members,
            cp: n,
            shares: shares.iter().map(|s| s / g).collect(),
            work: tokens.clone(),
            state: vec![1.0; n],
            vocab: tokens.clone(),
            tokens,
        })
    }

    /// The context-parallel group of `cp_shares.len()` members, each a tensor-parallel
    /// group of `members.len() / cp_shares.len()` devices with `tp_shares` (`members`
    /// member by member, Megatron's tp-cp order): a device's work, activations and head
    /// rows are its member's tokens of its tensor-parallel share, its state the share.
    /// `None` when the sequence or the model cannot be so split.
    pub fn context_of_tensor(
        model: &ModelShape,
        members: Vec<usize>,
        cp_shares: Vec<u32>,
        tp_shares: Vec<u32>,
    ) -> Option<Self> {
        let (c, t) = (cp_shares.len(), tp_shares.len());
        if c * t != members.len() || c == 0 {
            return None;
        }
        let context = Self::context(model, (0..c).collect(), cp_shares)?;
        if t == 1 {
            return Some(TpGroup { members, ..context });
        }
        let tensor = Self::new(model, (0..t).collect(), tp_shares)?;
        let device = |d: usize| (d / t, d % t);
        let each = |f: &dyn Fn(usize, usize) -> f64| -> Vec<f64> {
            (0..c * t).map(device).map(|(m, j)| f(m, j)).collect()
        };
        Some(TpGroup {
            members,
            cp: c,
            tokens: each(&|m, _| context.tokens[m]),
            shares: context.shares.clone(),
            work: each(&|m, j| context.tokens[m] * tensor.work[j]),
            state: each(&|_, j| tensor.state[j]),
            vocab: each(&|m, j| context.tokens[m] * tensor.vocab[j]),
        })
    }

    /// Devices of the unit.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Tensor-parallel size.
    pub fn tp_size(&self) -> usize {
        self.members.len() / self.cp
    }

    /// The largest fraction of every sequence's tokens a member holds.
    pub fn token_fraction(&self) -> f64 {
        self.tokens.iter().copied().fold(0.0, f64::max)
    }

    /// The layer time of the group's slowest member, given each member's whole-layer
    /// time.
    pub fn layer_s(&self, member_layer_s: &[f64]) -> f64 {
        (self.work.iter().zip(member_layer_s))
            .map(|(w, t)| w * t)
            .fold(0.0, f64::max)
    }
}

/// Forward FLOPs of a layer per token: attention (projections and scores, split by
/// query groups) and FFN (split by columns).
fn layer_flops(model: &ModelShape) -> (f64, f64) {
    let (h, f, s) = (
        model.hidden_size as f64,
        model.ffn_hidden_size as f64,
        model.seq_length as f64,
    );
    let kv = (model.hidden_size * model.num_kv_heads / model.num_heads.max(1)) as f64;
    (
        2.0 * (2.0 * h * h + 2.0 * h * kv) + 4.0 * s * h,
        6.0 * h * f,
    )
}

/// A layer's parameters split by query groups and by FFN columns (the norms, replicated,
/// are left out).
fn layer_params(model: &ModelShape) -> (f64, f64) {
    let (h, f) = (model.hidden_size as f64, model.ffn_hidden_size as f64);
    let kv = (model.hidden_size * model.num_kv_heads / model.num_heads.max(1)) as f64;
    (2.0 * h * h + 2.0 * h * kv, 3.0 * h * f)
}

/// The shares for `members` (each with its whole-layer time in `layer_s`, fastest
/// first) under which the slowest member finishes first (a faster device never gets
/// less), ties to the smallest total: among every non-increasing share vector in lowest
/// terms up to [`MOST_SHARE`] for groups of at most that many members, else among even
/// shares and the speeds rounded at each scale up to it. `None` when no shares split the
/// model (more members than query groups, or a member left without one).
pub fn best_group(model: &ModelShape, members: &[usize], layer_s: &[f64]) -> Option<TpGroup> {
    // Every member needs a query group.
    if members.len() > model.num_kv_heads {
        return None;
    }
    best_of(members, layer_s, layer_s, |m, s| TpGroup::new(model, m, s))
}

/// [`best_group`] for a context-parallel group: the token shares under which the slowest
/// member finishes first (`None` when the sequence cannot be so split).
pub fn best_context_group(
    model: &ModelShape,
    members: &[usize],
    layer_s: &[f64],
) -> Option<TpGroup> {
    best_of(members, layer_s, layer_s, |m, s| {
        TpGroup::context(model, m, s)
    })
}

/// [`best_context_group`] for `members.len() / tp` context-parallel members, each an
/// evenly shared tensor-parallel group of `tp` devices (Megatron's flags): the token
/// shares under which the slowest device finishes first.
pub fn best_context_tensor_group(
    model: &ModelShape,
    members: &[usize],
    layer_s: &[f64],
    tp: usize,
) -> Option<TpGroup> {
    if tp <= 1 {
        return best_context_group(model, members, layer_s);
    }
    let tensor = TpGroup::new(model, (0..tp).collect(), vec![1; tp])?;
    // A member's pace: its slowest device on its tensor-parallel share.
    let member_s: Vec<f64> = (layer_s.chunks(tp))
        .map(|devices| tensor.layer_s(devices))
        .collect();
    best_of(members, layer_s, &member_s, |m, s| {
        TpGroup::context_of_tensor(model, m, s, vec![1; tp])
    })
}

/// The group `build` makes of `members` (each device's whole-layer time in `layer_s`)
/// with the candidate shares for units at `share_s` whose slowest device finishes first,
/// ties to the smallest total.
fn best_of(
    members: &[usize],
    layer_s: &[f64],
    share_s: &[f64],
    build: impl Fn(Vec<usize>, Vec<u32>) -> Option<TpGroup>,
) -> Option<TpGroup> {
    let mut best: Option<(f64, u32, TpGroup)> = None;
    for shares in candidate_shares(share_s) {
        let Some(group) = build(members.to_vec(), shares) else {
            continue;
        };
        let (time, total) = (group.layer_s(layer_s), group.shares.iter().sum::<u32>());
        let better = best.as_ref().is_none_or(|(t, n, _)| {
            time < t * (1.0 - 1e-12) || (time <= t * (1.0 + 1e-12) && total < *n)
        });
        if better {
            best = Some((time, total, group));
        }
    }
    best.map(|(_, _, g)| g)
}

/// The share vectors tried: every non-increasing one in lowest terms up to [`MOST_SHARE`]
/// for groups of at most [`MOST_SHARE`] (6,435 for eight); for larger groups, whose count
/// would explode, even shares and the speeds rounded at each scale up to it.
fn candidate_shares(layer_s: &[f64]) -> Vec<Vec<u32>> {
    let n = layer_s.len();
    if n > MOST_SHARE as usize {
        let fastest = layer_s.iter().copied().fold(f64::INFINITY, f64::min);
        let mut out = vec![vec![1; n]];
        for scale in 1..=MOST_SHARE {
            let shares: Vec<u32> = (layer_s.iter())
                .map(|&t| ((f64::from(scale) * fastest / t).round() as u32).max(1))
                .collect();
            out.push(shares);
        }
        return out;
    }
    let mut out = Vec::new();
    let mut shares = vec![MOST_SHARE; n];
    loop {
        if gcd_all(&shares) == 1 || shares.iter().all(|&s| s == 1) {
            out.push(shares.clone());
        }
        if !next_non_increasing(&mut shares) {
            return out;
        }
    }
}

/// The next non-increasing vector with entries in 1..=MOST_SHARE, counting down from
/// all MOST_SHARE; false after all ones.
fn next_non_increasing(shares: &mut [u32]) -> bool {
    let Some(k) = shares.iter().rposition(|&s| s > 1) else {
        return false;
    };
    shares[k] -= 1;
    let top = shares[k];
    for s in &mut shares[k + 1..] {
        *s = top;
    }
    true
}

fn gcd_all(shares: &[u32]) -> u32 {
    fn gcd(a: u32, b: u32) -> u32 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    shares.iter().fold(0, |a, &b| gcd(a, b))
}

/// Devices cut into tensor-parallel groups of `size` within each node (in the order
/// `order` lists them, fastest first), each with its best shares; `None` when a node's
/// device count is not a multiple of `size` or some group's shares cannot split the
/// model. Size 1: every device alone.
pub fn tp_groups(
    model: &ModelShape,
    devices: &[Device],
    order: &[usize],
    layer_s: &[f64],
    size: usize,
) -> Option<Vec<TpGroup>> {
    node_groups(devices, order, layer_s, size, |members, times| {
        best_group(model, members, times)
    })
}

/// [`tp_groups`] for context-parallel groups of `size` members, each a tensor-parallel
/// group of `tp` devices (even shares), with their best token shares.
pub fn context_groups(
    model: &ModelShape,
    devices: &[Device],
    order: &[usize],
    layer_s: &[f64],
    (size, tp): (usize, usize),
) -> Option<Vec<TpGroup>> {
    node_groups(devices, order, layer_s, size * tp, |members, times| {
        best_context_tensor_group(model, members, times, tp)
    })
}

/// Devices cut into groups of `size` within each node (fastest first), each made by
/// `group` from its members and their layer times (searched once per speed vector).
fn node_groups(
    devices: &[Device],
    order: &[usize],
    layer_s: &[f64],
    size: usize,
    group: impl Fn(&[usize], &[f64]) -> Option<TpGroup>,
) -> Option<Vec<TpGroup>> {
    if size <= 1 {
        return Some(order.iter().map(|&i| TpGroup::single(i)).collect());
    }
    // Nodes in order of their first device in `order`.
    let mut nodes: Vec<(&str, Vec<usize>)> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for &i in order {
        let node = devices[i].node.as_str();
        let k = *index.entry(node).or_insert_with(|| {
            nodes.push((node, Vec::new()));
            nodes.len() - 1
        });
        nodes[k].1.push(i);
    }
    // Groups of the same speeds take the same shares: searched once.
    let mut found: HashMap<Vec<u64>, Option<TpGroup>> = HashMap::new();
    let mut groups = Vec::new();
    for (_, members) in nodes {
        if members.len() % size != 0 {
            return None;
        }
        for chunk in members.chunks(size) {
            let times: Vec<f64> = chunk.iter().map(|&i| layer_s[i]).collect();
            let key = times.iter().map(|t| t.to_bits()).collect();
            let alike = found
                .entry(key)
                .or_insert_with(|| group(chunk, &times))
                .clone()?;
            groups.push(TpGroup {
                members: chunk.to_vec(),
                ..alike
            });
        }
    }
    Some(groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model(kv_heads: usize, ffn: usize) -> ModelShape {
        ModelShape {
            num_layers: 4,
            hidden_size: 64 * kv_heads,
            num_heads: 2 * kv_heads,
            num_kv_heads: kv_heads,
            ffn_hidden_size: ffn,
            vocab_size: 1000,
            seq_length: 256,
            tied: false,
            experts: None,
        }
    }

    /// The least slowest-member time over every share vector in 1..=MOST_SHARE.
    fn brute_force(model: &ModelShape, layer_s: &[f64]) -> Option<f64> {
        let t = layer_s.len();
        let mut best: Option<f64> = None;
        let mut shares = vec![1u32; t];
        loop {
            let members: Vec<usize> = (0..t).collect();
            if let Some(g) = TpGroup::new(model, members, shares.clone()) {
                let time = g.layer_s(layer_s);
                best = Some(best.map_or(time, |b: f64| b.min(time)));
            }
            let Some(k) = shares.iter().position(|&s| s < MOST_SHARE) else {
                return best;
            };
            shares[k] += 1;
            shares[..k].fill(1);
        }
    }

    #[test]
    fn unequal_devices_take_unequal_shares() {
        let model = model(8, 512);
        // A device twice as fast as the other takes two thirds of the layer.
        let group = best_group(&model, &[0, 1], &[1.0, 2.0]).unwrap();
        assert_eq!(group.shares, [2, 1]);
        let even = TpGroup::new(&model, vec![0, 1], vec![1, 1]).unwrap();
        assert!(group.layer_s(&[1.0, 2.0]) < 0.75 * even.layer_s(&[1.0, 2.0]));
        // Equal devices split evenly, as Megatron.
        assert_eq!(
            best_group(&model, &[0, 1], &[1.0, 1.0]).unwrap().shares,
            [1, 1]
        );
        // Two query groups cannot give three devices one each.
        assert!(best_group(&super::tests::model(2, 512), &[0, 1, 2], &[1.0; 3]).is_none());
    }

    /// A context-parallel pair splits every sequence by speed: a device twice as fast
    /// takes two thirds of the tokens (position pairs: its attention too); equal devices
    /// take Megatron's even chunks; a sequence that does not cut is refused.
    #[test]
    fn unequal_devices_take_unequal_token_shares() {
        let model = model(8, 512);
        let group = best_context_group(&model, &[0, 1], &[1.0, 2.0]).unwrap();
        assert_eq!((group.cp, group.shares.as_slice()), (2, &[2, 1][..]));
        assert!(
            (group.tokens[0] - 2.0 / 3.0).abs() < 0.01,
            "{:?}",
            group.tokens
        );
        assert_eq!(group.state, [1.0, 1.0]);
        assert!(group.layer_s(&[1.0, 2.0]) < 0.7);
        let even = best_context_group(&model, &[0, 1], &[1.0, 1.0]).unwrap();
        assert_eq!(
            (even.shares.as_slice(), even.tokens.as_slice()),
            (&[1, 1][..], &[0.5, 0.5][..])
        );
        let odd = ModelShape {
            seq_length: 250,
            ..model
        };
        assert!(TpGroup::context(&odd, vec![0, 1], vec![1, 1]).is_none());
    }

    /// A context-parallel pair of tensor-parallel pairs, one pair twice as fast: it takes
    /// two thirds of the tokens, each device half of its member's, so every device
    /// finishes together; state follows the tensor-parallel share alone.
    #[test]
    fn context_parallel_members_may_be_tensor_parallel_groups() {
        let model = model(8, 512);
        let layer_s = [1.0, 1.0, 2.0, 2.0];
        let group = best_context_tensor_group(&model, &[0, 1, 2, 3], &layer_s, 2).unwrap();
        assert_eq!((group.cp, group.tp_size()), (2, 2));
        assert_eq!(group.shares, [2, 1]);
        let third = 1.0 / 3.0;
        for (d, (w, s)) in group.work.iter().zip(&group.state).enumerate() {
            let tokens = if d < 2 { 2.0 * third } else { third };
            assert!((w - tokens / 2.0).abs() < 0.01, "{d}: {w}");
            assert!((s - 0.5).abs() < 1e-9 && (group.tokens[d] - tokens).abs() < 0.01);
        }
        assert!((group.layer_s(&layer_s) - third).abs() < 0.01);
        // Members that cannot split the model (three devices, eight query groups) or
        // the sequence do not form.
        assert!(TpGroup::context_of_tensor(&model, vec![0, 1, 2], vec![1], vec![1; 3]).is_none());
        assert!(TpGroup::context_of_tensor(&model, vec![0, 1], vec![1, 1], vec![1]).is_some());
    }

    #[test]
    fn groups_stay_within_a_node() {
        let toml = "[[group]]\nkind = \"a100-80g\"\ncount = 3\nnode = \"n0\"\n[[group]]\nkind = \"v100\"\ncount = 1\nnode = \"n0\"\n[[group]]\nkind = \"t4\"\ncount = 2\nnode = \"n1\"\n[network]\nintra_node_gbs = 300\ninter_node_gbs = 25\n";
        let devices = crate::cluster::ClusterSpec::from_toml(toml)
            .unwrap()
            .devices();
        let model = model(8, 512);
        let layer_s = [1.0, 1.0, 1.0, 2.5, 5.0, 5.0];
        let order: Vec<usize> = (0..6).collect();
        let groups = tp_groups(&model, &devices, &order, &layer_s, 2).unwrap();
        let members: Vec<&[usize]> = groups.iter().map(|g| g.members.as_slice()).collect();
        assert_eq!(members, [&[0, 1][..], &[2, 3], &[4, 5]]);
        assert_eq!(groups[0].shares, [1, 1]);
        assert!(
            groups[1].shares[0] > groups[1].shares[1],
            "{:?}",
            groups[1].shares
        );
        // Node n0's four devices do not cut into groups of three.
        assert!(tp_groups(&model, &devices, &order, &layer_s, 3).is_none());
    }

    proptest! {
        /// The shares found are as fast as the best of every share vector up to
        /// MOST_SHARE (the non-increasing ones in lowest terms lose nothing).
        #[test]
        fn best_shares_match_brute_force(
            kv_heads in prop::sample::select(vec![1usize, 2, 4, 8]),
            ffn in prop::sample::select(vec![96usize, 128, 344, 512]),
            speeds in prop::collection::vec(1u32..=8, 1..=3),
        ) {
            let model = model(kv_heads, ffn);
            let mut layer_s: Vec<f64> = speeds.iter().map(|&s| 1.0 / f64::from(s)).collect();
            layer_s.sort_by(f64::total_cmp);
            let members: Vec<usize> = (0..layer_s.len()).collect();
            let found = best_group(&model, &members, &layer_s).map(|g| g.layer_s(&layer_s));
            let brute = brute_force(&model, &layer_s);
            match (found, brute) {
                (Some(a), Some(b)) => prop_assert!((a - b).abs() <= 1e-12 * b, "{} vs {}", a, b),
                (a, b) => prop_assert_eq!(a.is_some(), b.is_some()),
            }
        }
    }
}
