//! Grid plans whose stages divide the experts over groups of their own sizes, as
//! SynerFuse's meshes each take their own expert-parallel size: a stage whose devices
//! have memory to spare keeps every expert (no all-to-all), one whose devices have not
//! divides them.

use super::{
    error::PlanningError,
    grid::{candidate_ctx, Arranged, Search},
    outcome::Candidate,
    request::PlanRequest,
    simulate::simulate_candidate,
};
use crate::cost::CostModel;

/// `best` with each stage at its own expert-parallel size (of the request's, dividing
/// the experts and the replicas), a stage at a time while that makes the simulated step
/// faster, its layers and batch split again at each; `None` where no stage is faster at
/// another size.
pub(super) fn per_stage_expert_parallel(
    cost: &CostModel,
    request: &PlanRequest,
    best: &Candidate,
) -> Result<Option<Candidate>, PlanningError> {
    let Some(shape) = cost.model.experts else {
        return Ok(None);
    };
    let (p, d) = (best.layers.len(), best.micro_batches.len());
    let mut sizes: Vec<usize> = (request.grid_options(Some(shape.num_experts)).iter())
        .map(|o| o.expert_parallel)
        .filter(|&ep| d % ep == 0)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    if p < 2 || sizes.len() < 2 {
        return Ok(None);
    }
    let variant = best.options.cost(cost);
    let first = best.expert_parallel_sizes();
    let (mut current, mut by_stage) = (best.clone(), first.clone());
    let mut improved = true;
    while improved {
        improved = false;
        for i in 0..p {
            for &ep in &sizes {
                if by_stage[i] == ep {
                    continue;
                }
                let mut trial = by_stage.clone();
                trial[i] = ep;
                let Some(c) = priced(&variant, &current, &trial, request.global_batch_size)? else {
                    continue;
                };
                if c.prediction.step_time_s < current.prediction.step_time_s * (1.0 - 1e-9) {
                    (current, by_stage, improved) = (c, trial, true);
                }
            }
        }
    }
    Ok((by_stage != first).then_some(current))
}

/// `from`'s grid with stage `i`'s experts divided over groups of `by_stage[i]`: its
/// layout and the layouts of splitting its layers and batch again, the fastest by the
/// closed form, simulated; `None` where none fits.
fn priced(
    variant: &CostModel,
    from: &Candidate,
    by_stage: &[usize],
    samples: usize,
) -> Result<Option<Candidate>, PlanningError> {
    let mut ctx = candidate_ctx(variant, from);
    let mut per_unit = vec![1; ctx.devices.len()];
    for (row, &ep) in from.devices.iter().zip(by_stage) {
        for &unit in row {
            per_unit[unit] = ep;
        }
    }
    ctx.set_expert_parallel(per_unit);
    let grid = Arranged {
        devices: &from.devices,
        arrangement: from.arrangement,
    };
    let layout = (
        from.layers.clone(),
        from.micro_batch_sizes.clone(),
        from.micro_batches.clone(),
    );
    let mut search = Search::default();
    search.consider(&mut ctx, grid, layout, from.origin)?;
    let (sizes, m) = (&from.micro_batch_sizes, from.micro_batches.clone());
    search.alternate(&mut ctx, grid, sizes, samples, m)?;
    let fastest = (search.candidates.into_iter())
        .min_by(|a, b| (a.prediction.step_time_s).total_cmp(&b.prediction.step_time_s));
    let Some(mut c) = fastest else {
        return Ok(None);
    };
    c.prediction = simulate_candidate(&mut ctx, &c)?;
    // Every stage at one size: the grid plan of that size.
    c.options.expert_parallel = by_stage.iter().copied().max().unwrap_or(1);
    if by_stage.iter().all(|&ep| ep == by_stage[0]) {
        c.stage_expert_parallel.clear();
    }
    Ok(Some(c))
}
