//! `synerfuse topology`: every communication group Megatron would build for these sizes.

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Map, Value};
use synerfuse_plan::{Dim, GroupKind, Topology, DEFAULT_ORDER, TP_PP_DP_ORDER};

/// `synerfuse topology`.
#[derive(Args, Debug)]
pub struct TopologyArgs {
    /// Number of ranks
    #[arg(long, value_parser = crate::values::positive_count)]
    world_size: usize,
    /// Tensor-parallel size (--tensor-model-parallel-size)
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 1)]
    tp: usize,
    /// Pipeline-parallel size (--pipeline-model-parallel-size)
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 1)]
    pp: usize,
    /// Context-parallel size
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 1)]
    cp: usize,
    /// Expert-parallel size
    #[arg(long, value_parser = crate::values::positive_count, default_value_t = 1)]
    ep: usize,
    /// Rank order, fastest dimension first [default: tp-cp-ep-dp-pp]
    #[arg(long)]
    order: Option<String>,
    /// SynerFuse's tp-pp-dp order: each data-parallel replica is a contiguous block of ranks
    #[arg(long)]
    use_tp_pp_dp_mapping: bool,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
}

pub fn run_topology(args: TopologyArgs) -> Result<()> {
    let order = match (&args.order, args.use_tp_pp_dp_mapping) {
        (Some(_), true) => bail!("--order and --use-tp-pp-dp-mapping cannot be combined"),
        (Some(order), false) => order.as_str(),
        (None, true) => TP_PP_DP_ORDER,
        (None, false) => DEFAULT_ORDER,
    };
    let topology = Topology::new(args.world_size, args.tp, args.pp, args.cp, args.ep, order)?;
    let mut groups = Map::new();
    for kind in GroupKind::ALL {
        groups.insert(kind.name().to_owned(), json!(topology.groups(kind)));
    }
    let ranks: Vec<Value> = (0..topology.world_size())
        .map(|r| {
            let c = topology.coordinates(r).expect("rank in the world");
            json!({"rank": r, "tp": c.tp, "cp": c.cp, "ep": c.ep, "dp": c.dp, "pp": c.pp})
        })
        .collect();
    if args.json {
        println!(
            "{}",
            json!({
                "world_size": topology.world_size(),
                "order": order,
                "sizes": {
                    "tp": topology.size(Dim::Tp), "cp": topology.size(Dim::Cp),
                    "ep": topology.size(Dim::Ep), "dp": topology.size(Dim::Dp),
                    "pp": topology.size(Dim::Pp),
                },
                "groups": groups,
                "ranks": ranks,
            })
        );
        return Ok(());
    }
    println!(
        "world {} = tp {} × cp {} × dp {} × pp {} (ep {}), order {order}",
        topology.world_size(),
        topology.size(Dim::Tp),
        topology.size(Dim::Cp),
        topology.size(Dim::Dp),
        topology.size(Dim::Pp),
        topology.size(Dim::Ep)
    );
    for kind in GroupKind::ALL {
        let rendered: Vec<String> = topology
            .groups(kind)
            .iter()
            .map(|g| format!("{g:?}"))
            .collect();
        println!("{:>20}: {}", kind.name(), rendered.join(" "));
    }
    Ok(())
}
