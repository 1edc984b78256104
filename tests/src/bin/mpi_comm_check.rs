//! Run under `mpirun -np N` (N ≥ 2): checks `synerfuse-train`'s MPI communicator on tch
//! tensors and prints `rank R of N: ok` on success. With `--fail-rank R`, rank R
//! reports a failure and aborts, and with `--panic-rank R` rank R panics while the others
//! wait in a barrier: both must take the whole job down.

use synerfuse_train::comm::{CommError, MpiCommunicator, MpiRuntime};
use tch::{Device, Kind, Tensor};

fn main() {
    tch::set_num_threads(1);
    let rank_flag = |flag: &str| {
        std::env::args()
            .skip_while(|a| a != flag)
            .nth(1)
            .and_then(|r| r.parse::<usize>().ok())
    };
    let (fail_rank, panic_rank) = (rank_flag("--fail-rank"), rank_flag("--panic-rank"));
    // Well under the launcher's 120 s: a hang names its rank, operation and group.
    synerfuse_train::comm::watchdog::set_timeout(std::time::Duration::from_secs(45));
    let runtime = MpiRuntime::init().expect("MPI init");
    let world = runtime.world();
    let rank = world.rank();
    if fail_rank == Some(rank) {
        // A rank that dies mid-job: the launcher must take the whole job down.
        say_failed(&format!(
            "rank {rank} of {}: FAILED: asked to fail with --fail-rank {rank}",
            world.size()
        ));
        world.abort(1);
    }
    if panic_rank == Some(rank) {
        panic!("rank {rank} panics on purpose (--panic-rank)");
    }
    // A failed check ends the job at once, named: the other ranks may be waiting in a
    // collective this rank will not join (a barrier first would hang it until the
    // watchdog, the failure unsaid).
    if let Err(why) = check_all(&world) {
        say_failed(&format!("rank {rank} of {}: FAILED: {why}", world.size()));
        world.abort(1);
    }
    world.barrier();
    println!("rank {rank} of {}: ok", world.size());
}

fn check_all(world: &MpiCommunicator) -> Result<(), String> {
    all_reduce_sums(world)?;
    broadcast_copies_root(world)?;
    send_recv_pair(world)?;
    gather_and_reduce_scatter(world)?;
    all_to_all_of_uneven_parts(world)?;
    collectives_in_rounds(world)?;
    gathers_in_place(world)?;
    hierarchical_reductions(world)?;
    emulated_links(world)?;
    process_groups(world)?;
    simultaneous_isends(world)?;
    Ok(())
}

/// all_gather stacks every rank's tensor in rank order; reduce_scatter_sum gives rank r
/// its block of the sum.
fn gather_and_reduce_scatter(world: &MpiCommunicator) -> Result<(), String> {
    let (rank, n) = (world.rank() as i64, world.size() as i64);
    let mine = Tensor::from_slice(&[rank, 10 * rank]);
    let all = world.all_gather(&mine).map_err(|e| e.to_string())?;
    let want =
        Tensor::from_slice(&(0..n).flat_map(|r| [r, 10 * r]).collect::<Vec<_>>()).view([n, 2]);
    if !all.equal(&want) {
        return Err(format!("all_gather gave {all:?}"));
    }
    // Every rank contributes (rank + 1) · [0, 1, ..., 2n); rank r keeps rows [2r, 2r + 2).
    let base = Tensor::arange(2 * n, (Kind::Float, Device::Cpu)).view([2 * n, 1]);
    let part = world
        .reduce_scatter_sum(&(&base * (rank + 1) as f64))
        .map_err(|e| e.to_string())?;
    let want = base.narrow(0, 2 * rank, 2) * ((n * (n + 1) / 2) as f64);
    if max_abs_diff(&part, &want) > 0.0 {
        return Err(format!("reduce_scatter_sum gave {part:?}"));
    }
    if world
        .reduce_scatter_sum(&Tensor::zeros([n + 1], (Kind::Float, Device::Cpu)))
        .is_ok()
    {
        return Err(
            "reduce_scatter_sum accepted a leading dimension not divisible by the group".into(),
        );
    }
    Ok(())
}

/// all_to_all (expert parallelism's token exchange): rank r sends rank d `r + d` rows of
/// `[r, d]` pairs (none to itself when both are 0), and gets each rank's in rank order,
/// in fp32, bf16 and int64.
fn all_to_all_of_uneven_parts(world: &MpiCommunicator) -> Result<(), String> {
    let (rank, n) = (world.rank() as i64, world.size() as i64);
    let rows = |from: i64, to: i64| {
        Tensor::from_slice(&[from as f32, to as f32])
            .view([1, 2])
            .repeat([from + to, 1])
    };
    for kind in [Kind::Float, Kind::BFloat16, Kind::Int64] {
        let parts: Vec<Tensor> = (0..n).map(|d| rows(rank, d).to_kind(kind)).collect();
        let got = world.all_to_all(&parts).map_err(|e| e.to_string())?;
        for (from, part) in got.iter().enumerate() {
            let want = rows(from as i64, rank).to_kind(kind);
            if part.size() != want.size() || !part.equal(&want) {
                return Err(format!(
                    "all_to_all from rank {from} gave {part:?} ({kind:?})"
                ));
            }
        }
    }
    // Checked before any message: every rank refuses alike, none waits.
    let zeros = |shape: &[i64]| Tensor::zeros(shape, (Kind::Float, Device::Cpu));
    let mixed: Vec<Tensor> = (0..n)
        .map(|d| if d == 0 { zeros(&[1, 2]) } else { zeros(&[1]) })
        .collect();
    if world.all_to_all(&mixed).is_ok() || world.all_to_all(&mixed[..1]).is_ok() {
        return Err("all_to_all accepted parts of different row shapes, or too few".into());
    }
    Ok(())
}

/// The distributed optimizer's reduce-scatter (uneven pieces) and all-gather give the
/// same result in one call and in rounds of a few elements (as tensors past MPI's `int`
/// counts are sent).
fn collectives_in_rounds(world: &MpiCommunicator) -> Result<(), String> {
    let (rank, n) = (world.rank(), world.size());
    let counts: Vec<usize> = (0..n).map(|r| 3 * r + 2).collect();
    let numel: usize = counts.iter().sum();
    let start: usize = counts[..rank].iter().sum();
    let mine = Tensor::arange(numel as i64, (Kind::Float, Device::Cpu)) * (rank + 1) as f64;
    let total = Tensor::arange(numel as i64, (Kind::Float, Device::Cpu)) * (n * (n + 1) / 2) as f64;
    let want = total.narrow(0, start as i64, counts[rank] as i64);
    for max_per_call in [1 << 30, 7, 1] {
        let tensor = mine.copy();
        let pending = world
            .start_reduce_scatter_sum_in_rounds(&tensor, &counts, max_per_call)
            .map_err(|e| e.to_string())?;
        pending.wait();
        let got = tensor.narrow(0, start as i64, counts[rank] as i64);
        if max_abs_diff(&got, &want) > 0.0 {
            return Err(format!(
                "reduce-scatter in rounds of {max_per_call} gave {got:?}"
            ));
        }
        let gathered = world
            .all_gather_in_rounds(&mine.view([-1, 1]), max_per_call)
            .map_err(|e| e.to_string())?;
        let stacked = Tensor::stack(
            &(0..n)
                .map(|r| Tensor::arange(numel as i64, (Kind::Float, Device::Cpu)) * (r + 1) as f64)
                .collect::<Vec<_>>(),
            0,
        )
        .view([n as i64, -1, 1]);
        if max_abs_diff(&gathered, &stacked) > 0.0 {
            return Err(format!(
                "all_gather in rounds of {max_per_call} gave {gathered:?}"
            ));
        }
    }
    Ok(())
}

/// The distributed optimizer's gather of uneven pieces into every copy (one rank's piece
/// empty), blocking and non-blocking, in fp32 and bf16 (carried as raw bits): every rank
/// ends with every piece, and only its own piece of its tensor is read.
fn gathers_in_place(world: &MpiCommunicator) -> Result<(), String> {
    let (rank, n) = (world.rank(), world.size());
    let counts: Vec<usize> = (0..n).map(|r| if r == 1 { 0 } else { 2 * r + 3 }).collect();
    let numel: usize = counts.iter().sum();
    let start: usize = counts[..rank].iter().sum();
    let want = Tensor::arange(numel as i64, (Kind::Float, Device::Cpu)) / 8.0;
    for kind in [Kind::Float, Kind::BFloat16] {
        for blocking in [true, false] {
            // Garbage outside this rank's own piece: it must be overwritten.
            let mut tensor = Tensor::full([numel as i64], -7.0, (kind, Device::Cpu));
            let own = want
                .narrow(0, start as i64, counts[rank] as i64)
                .to_kind(kind);
            tensor
                .narrow(0, start as i64, counts[rank] as i64)
                .copy_(&own);
            let gathered = match blocking {
                true => world.all_gather_in_place(&mut tensor, &counts),
                false => (world.start_all_gather_in_place(&tensor, &counts)).map(|p| p.wait()),
            };
            gathered.map_err(|e| e.to_string())?;
            if max_abs_diff(
                &tensor.to_kind(Kind::Float),
                &want.to_kind(kind).to_kind(Kind::Float),
            ) > 0.0
            {
                return Err(format!(
                    "{kind:?} gather in place (blocking {blocking}) gave {tensor:?}"
                ));
            }
        }
    }
    Ok(())
}

/// Groups whose members sit on two hosts (named as a plan names them) reduce over their
/// islands: islands of 2 + 2, 2 + 1, 1 + 2 and 1 + 3 of 4 ranks, all-reduce blocking and
/// in flight (two at once, waited for in reverse) and the distributed optimizer's
/// reduce-scatter of uneven shards (one empty): every member gets the sum within fp32
/// rounding, the holders of an element the same bits, and a shard's outside is left alone.
fn hierarchical_reductions(world: &MpiCommunicator) -> Result<(), String> {
    use synerfuse_train::comm::SetGroups;
    let (rank, n) = (world.rank(), world.size());
    if n != 4 {
        return Ok(());
    }
    let err = |e: CommError| e.to_string();
    let numel = 5003;
    let of = |r: usize, salt: i64| {
        let base = Tensor::arange(numel, (Kind::Float, Device::Cpu));
        ((base * (0.37 + r as f64) + salt as f64).sin() * (1.0 + r as f64)).contiguous()
    };
    let node = |name: &str| Some(name.to_owned());
    let layouts: [(&[usize], [Option<String>; 4]); 4] = [
        (&[0, 1, 2, 3], [node("a"), node("a"), node("b"), node("b")]),
        (&[0, 1, 2], [node("a"), node("a"), node("b"), node("b")]),
        (&[1, 2, 3], [node("a"), node("a"), node("b"), node("b")]),
        (&[0, 1, 2, 3], [node("a"), node("b"), node("b"), node("b")]),
    ];
    for (k, (members, nodes)) in layouts.iter().enumerate() {
        let groups = SetGroups::new(
            world,
            Device::Cpu,
            [members.to_vec()],
            &Default::default(),
            &synerfuse_train::comm::PlannedHosts {
                nodes: nodes.to_vec(),
                hierarchical: true,
                ..Default::default()
            },
        )
        .map_err(err)?;
        let Some(group) = groups.get(members) else {
            continue;
        };
        if group.islands().is_none() {
            return Err(format!(
                "layout {k}: {members:?} over {nodes:?} has no islands"
            ));
        }
        let want = |salt: i64| {
            (members.iter()).fold(
                Tensor::zeros([numel], (Kind::Float, Device::Cpu)),
                |sum, &r| sum + of(r, salt),
            )
        };
        let me = members.iter().position(|&r| r == rank).expect("a member");
        // Blocking.
        let mut blocking = of(rank, 0);
        group.all_reduce_sum(&mut blocking).map_err(err)?;
        let close =
            |got: &Tensor, want: &Tensor| max_abs_diff(got, want) <= 1e-5 * members.len() as f64;
        if !close(&blocking, &want(0)) {
            return Err(format!(
                "layout {k}: hierarchical all_reduce_sum is {}",
                max_abs_diff(&blocking, &want(0))
            ));
        }
        // Two in flight, waited for in reverse.
        let (first, second) = (of(rank, 1), of(rank, 2));
        let a = group.start_all_reduce_sum(&first).map_err(err)?;
        let b = group.start_all_reduce_sum(&second).map_err(err)?;
        b.wait().map_err(err)?;
        a.wait().map_err(err)?;
        if !close(&first, &want(1)) || !close(&second, &want(2)) {
            return Err(format!(
                "layout {k}: hierarchical reductions in flight differ"
            ));
        }
        // Every member the same bits.
        let all = group.all_gather(&blocking).map_err(err)?;
        if !all.equal(&blocking.unsqueeze(0).expand_as(&all)) {
            return Err(format!("layout {k}: members' sums differ in their bits"));
        }
        // Uneven shards, the second member's empty.
        let m = members.len();
        let mut shards: Vec<usize> = (0..m)
            .map(|i| if i == 1 { 0 } else { 1000 + 37 * i })
            .collect();
        shards[0] += numel as usize - shards.iter().sum::<usize>();
        let start: usize = shards[..me].iter().sum();
        let original = of(rank, 3);
        let scattered = original.copy();
        group
            .start_reduce_scatter_sum(&scattered, &shards)
            .map_err(err)?
            .wait()
            .map_err(err)?;
        let (s, c) = (start as i64, shards[me] as i64);
        if c > 0 && !close(&scattered.narrow(0, s, c), &want(3).narrow(0, s, c)) {
            return Err(format!(
                "layout {k}: hierarchical reduce-scatter, shard {me} differs"
            ));
        }
        let outside = Tensor::cat(
            &[
                scattered.narrow(0, 0, s),
                scattered.narrow(0, s + c, numel - s - c),
            ],
            0,
        );
        let left = Tensor::cat(
            &[
                original.narrow(0, 0, s),
                original.narrow(0, s + c, numel - s - c),
            ],
            0,
        );
        if !outside.equal(&left) {
            return Err(format!(
                "layout {k}: hierarchical reduce-scatter wrote outside shard {me}"
            ));
        }
    }
    Ok(())
}

/// Every rank sends 4 MB to both neighbours before receiving (what 1F1B neighbours do):
/// with blocking sends above MPI's eager limit this deadlocks; `isend` must not.
fn simultaneous_isends(world: &MpiCommunicator) -> Result<(), String> {
    let (rank, n) = (world.rank(), world.size());
    if n < 2 {
        return Ok(());
    }
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let payload = |from: usize| Tensor::full([1 << 20], from as f64, (Kind::Float, Device::Cpu));
    let a = world
        .isend(&payload(rank), next, 7)
        .map_err(|e| e.to_string())?;
    let b = world
        .isend(&payload(rank), prev, 8)
        .map_err(|e| e.to_string())?;
    let mut from_prev = Tensor::zeros([1 << 20], (Kind::Float, Device::Cpu));
    let mut from_next = Tensor::zeros([1 << 20], (Kind::Float, Device::Cpu));
    world
        .recv(&mut from_prev, prev, 7)
        .map_err(|e| e.to_string())?;
    world
        .recv(&mut from_next, next, 8)
        .map_err(|e| e.to_string())?;
    a.wait();
    b.wait();
    if max_abs_diff(&from_prev, &payload(prev)) != 0.0
        || max_abs_diff(&from_next, &payload(next)) != 0.0
    {
        return Err(format!("rank {rank}: isend payloads differ"));
    }
    Ok(())
}

/// One sub-communicator per group kind, members in Megatron's order: summing the global
/// rank over a group gives the sum of its members, and sub-rank i is member i.
fn process_groups(world: &MpiCommunicator) -> Result<(), String> {
    use synerfuse_plan::{GroupKind, Topology, TP_PP_DP_ORDER};
    use synerfuse_train::comm::ProcessGroups;
    if world.size() != 4 {
        return Ok(());
    }
    for order in ["tp-cp-ep-dp-pp", TP_PP_DP_ORDER] {
        let topology = Topology::new(4, 1, 2, 1, 1, order).map_err(|e| e.to_string())?;
        let groups = ProcessGroups::new(world, &topology).map_err(|e| e.to_string())?;
        for kind in GroupKind::ALL {
            let expected = topology.group_of(kind, world.rank());
            let (Some(comm), Some(members)) = (groups.get(kind), groups.members(kind)) else {
                if expected.is_some() {
                    return Err(format!(
                        "{order}: no {kind} communicator on rank {}",
                        world.rank()
                    ));
                }
                continue;
            };
            if Some(members.to_vec()) != expected || members[comm.rank()] != world.rank() {
                return Err(format!(
                    "{order}: {kind} members {members:?}, sub-rank {}",
                    comm.rank()
                ));
            }
            let mut t = Tensor::from_slice(&[world.rank() as i64]);
            comm.all_reduce_sum(&mut t).map_err(|e| e.to_string())?;
            let want: i64 = members.iter().map(|&r| r as i64).sum();
            if t.int64_value(&[0]) != want {
                return Err(format!(
                    "{order}: {kind} sum {} != {want}",
                    t.int64_value(&[0])
                ));
            }
        }
    }
    Ok(())
}

/// Over emulated links (hosts a, a, b, b, 1 MB/s between them), a flat all-reduce of
/// 5000 fp32 elements takes at least its ring's time (6 steps of 5000 bytes: 30 ms) and a
/// hierarchical one at least its exchange's (one piece of 10,000 bytes: 10 ms); both sum
/// right, and each rank counts what it sent across: a flat ring's crossing ranks (1 and
/// 3) 30,000 bytes each, every rank 10,000 hierarchically.
fn emulated_links(world: &MpiCommunicator) -> Result<(), String> {
    use synerfuse_train::comm::{PlannedHosts, SetGroups};
    let (rank, n) = (world.rank(), world.size());
    if n != 4 {
        return Ok(());
    }
    let network = synerfuse_plan::Network {
        intra_node_gbs: 100.0,
        inter_node_gbs: 0.001,
        latency_us: 0.0,
        inter_site_gbs: None,
        inter_site_latency_us: None,
        link: Vec::new(),
    };
    let members = vec![0, 1, 2, 3];
    let of = |r: usize| (Tensor::arange(5000, (Kind::Float, Device::Cpu)) * (r as f64 + 1.0)).sin();
    let want = (0..4).fold(Tensor::zeros([5000], (Kind::Float, Device::Cpu)), |a, r| {
        a + of(r)
    });
    for (hierarchical, least_s, sent) in [
        (false, 0.030, [0.0, 3e4, 0.0, 3e4]),
        (true, 0.010, [1e4; 4]),
    ] {
        let hosts = PlannedHosts {
            nodes: ["a", "a", "b", "b"].map(|x| Some(x.to_owned())).to_vec(),
            sites: Vec::new(),
            network: Some(network.clone()),
            hierarchical,
        };
        let groups = SetGroups::new(
            world,
            Device::Cpu,
            [members.clone()],
            &Default::default(),
            &hosts,
        )
        .map_err(|e| e.to_string())?;
        let group = groups.get(&members).ok_or("no group")?;
        let mut sum = of(rank);
        world.barrier();
        let started = std::time::Instant::now();
        group.all_reduce_sum(&mut sum).map_err(|e| e.to_string())?;
        let took = started.elapsed().as_secs_f64();
        let what = if hierarchical { "hierarchical" } else { "flat" };
        if took < least_s * 0.999 {
            return Err(format!(
                "{what} all-reduce over emulated links took {took} s, under {least_s} s"
            ));
        }
        if max_abs_diff(&sum, &want) > 1e-4 {
            return Err(format!("{what} all-reduce over emulated links: wrong sum"));
        }
        let crossed = groups.link_emulation().ok_or("no emulation")?.crossed();
        if crossed.across_nodes != sent[rank] {
            return Err(format!(
                "{what}: rank {rank} sent {} bytes across, not {}",
                crossed.across_nodes, sent[rank]
            ));
        }
    }
    Ok(())
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// Rank r holds r+1 times a fixed pattern; the sum over n ranks is n(n+1)/2 times it.
fn all_reduce_sums(world: &MpiCommunicator) -> Result<(), String> {
    let (rank, n) = (world.rank() as f64, world.size() as f64);
    let pattern = Tensor::arange(12, (Kind::Double, Device::Cpu)).reshape([3, 4]);
    let expected = &pattern * (n * (n + 1.0) / 2.0);
    for kind in [
        Kind::Float,
        Kind::Double,
        Kind::Int64,
        Kind::Int,
        Kind::BFloat16,
    ] {
        let mut t = (&pattern * (rank + 1.0)).to_kind(kind);
        world.all_reduce_sum(&mut t).map_err(|e| e.to_string())?;
        let diff = max_abs_diff(&t, &expected);
        if t.kind() != kind || diff > 0.0 {
            return Err(format!("all_reduce_sum {kind:?}: off by {diff}"));
        }
    }
    // A non-contiguous view is staged and written back in place.
    let mut transposed = (&pattern * (rank + 1.0)).to_kind(Kind::Float).tr();
    world
        .all_reduce_sum(&mut transposed)
        .map_err(|e| e.to_string())?;
    let diff = max_abs_diff(&transposed, &expected.tr());
    if diff > 0.0 {
        return Err(format!(
            "all_reduce_sum of a transposed view: off by {diff}"
        ));
    }
    match world.all_reduce_sum(&mut Tensor::ones([2], (Kind::Bool, Device::Cpu))) {
        Err(CommError::UnsupportedDtype { .. }) => Ok(()),
        other => Err(format!(
            "all_reduce_sum of bool should be refused, got {other:?}"
        )),
    }
}

fn broadcast_copies_root(world: &MpiCommunicator) -> Result<(), String> {
    let root = world.size() - 1;
    let mut t = Tensor::full([5], world.rank() as f64, (Kind::Float, Device::Cpu));
    world.broadcast(&mut t, root).map_err(|e| e.to_string())?;
    let diff = max_abs_diff(
        &t,
        &Tensor::full([5], root as f64, (Kind::Double, Device::Cpu)),
    );
    if diff > 0.0 {
        return Err(format!("broadcast from rank {root}: off by {diff}"));
    }
    match world.broadcast(&mut t, world.size()) {
        Err(CommError::InvalidPeer { .. }) => Ok(()),
        other => Err(format!(
            "broadcast from a missing rank should be refused, got {other:?}"
        )),
    }
}

/// Rank 0 sends an activation-shaped tensor to rank 1, which sends it back doubled;
/// rank 1 also refuses a message of the wrong size.
fn send_recv_pair(world: &MpiCommunicator) -> Result<(), String> {
    let activation = Tensor::arange(2 * 3 * 4, (Kind::Float, Device::Cpu)).reshape([2, 3, 4]) / 7.0;
    match world.rank() {
        0 => {
            world.send(&activation, 1, 11).map_err(|e| e.to_string())?;
            let mut back = Tensor::zeros([2, 3, 4], (Kind::Float, Device::Cpu));
            world.recv(&mut back, 1, 12).map_err(|e| e.to_string())?;
            let diff = max_abs_diff(&back, &(&activation * 2.0));
            if diff > 0.0 {
                return Err(format!("send/recv round trip: off by {diff}"));
            }
            world
                .send(&Tensor::ones([7], (Kind::Float, Device::Cpu)), 1, 13)
                .map_err(|e| e.to_string())?;
            world
                .send(&Tensor::ones([5], (Kind::Float, Device::Cpu)), 1, 13)
                .map_err(|e| e.to_string())?;
        }
        1 => {
            let mut received = Tensor::zeros([2, 3, 4], (Kind::Float, Device::Cpu));
            world
                .recv(&mut received, 0, 11)
                .map_err(|e| e.to_string())?;
            let diff = max_abs_diff(&received, &activation);
            if diff > 0.0 {
                return Err(format!("recv from rank 0: off by {diff}"));
            }
            world
                .send(&(received * 2.0), 0, 12)
                .map_err(|e| e.to_string())?;
            let mut wrong = Tensor::zeros([5], (Kind::Float, Device::Cpu));
            match world.recv(&mut wrong, 0, 13) {
                Err(CommError::SizeMismatch {
                    expected: 5,
                    got: 7,
                    ..
                }) => {}
                other => {
                    return Err(format!(
                        "a 7-element message into 5 should be refused, got {other:?}"
                    ))
                }
            }
            // The refused message is still pending; the next one fits.
            let mut pending = Tensor::zeros([7], (Kind::Float, Device::Cpu));
            world.recv(&mut pending, 0, 13).map_err(|e| e.to_string())?;
            world.recv(&mut wrong, 0, 13).map_err(|e| e.to_string())?;
        }
        _ => {}
    }
    Ok(())
}

/// `line` on stderr in one write, so that mpirun's own messages about the abort cannot
/// land inside it (`eprintln!` writes a line in pieces).
fn say_failed(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}
