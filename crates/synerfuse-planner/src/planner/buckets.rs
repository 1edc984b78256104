//! The runtime's overlapped gradient reduction, priced (Megatron's
//! `--overlap-grad-reduce`): each reduction laid out from the last model piece to the
//! first (the order in which a backward makes them final) and cut into buckets, each
//! started once every member's last backward of the step has passed its lowest piece
//! and the bucket before it on each member has ended.

use super::{
    context::Ctx,
    reduction::{
        expert_allreduce_s, expert_gather_s, experts_apart, holders_collective, CollectivePrice,
    },
};
use crate::cost::StageCosts;
use synerfuse_plan::ModelShape;

/// Tensors of a decoder layer (two norms, four attention and three MLP projections):
/// the runtime never splits one, so a layer cuts into at most this many buckets.
const LAYER_TENSORS: usize = 9;

/// Each model piece's share of a rank's backward: its compute (a layer's, the
/// embedding's, the head's) rather than its parameters, since the embedding holds as
/// many as the output layer but its backward is a cheap scatter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PieceWeights {
    pub(super) embedding: f64,
    pub(super) layer: f64,
    pub(super) head: f64,
    /// The model's decoder layers (the head is piece `layers + 1`).
    pub(super) layers: usize,
}

impl PieceWeights {
    /// A stage's pieces on a rank of `costs`, in a model of `layers`.
    pub(super) fn new(costs: &StageCosts, layers: usize) -> Self {
        PieceWeights {
            embedding: costs.embedding_s,
            layer: costs.layer_s,
            head: costs.head_s,
            layers,
        }
    }

    /// The compute of pieces `from..to`.
    fn of(&self, from: usize, to: usize) -> f64 {
        let head = self.layers + 1;
        let layers = to.min(head).saturating_sub(from.max(1));
        let mut weight = layers as f64 * self.layer;
        if from == 0 && to > 0 {
            weight += self.embedding;
        }
        if from <= head && to > head {
            weight += self.head;
        }
        weight
    }
}

/// A rank's pass over its stage's pieces, spread over them in proportion to their
/// compute: its last backward of the step (from the last piece to the first, making
/// each one's gradients final as it passes), or its first forward (from the first,
/// reading each one's parameters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct StagePass {
    pub(super) start_s: f64,
    pub(super) end_s: f64,
    /// The stage's model pieces, `from..to` (embedding 0, layer l at l + 1, head L + 1).
    pub(super) pieces: (usize, usize),
    pub(super) weights: PieceWeights,
}

impl StagePass {
    /// The share of the pass spent on the stage's pieces below `piece`.
    fn below(&self, piece: usize) -> f64 {
        let (from, to) = self.pieces;
        let whole = self.weights.of(from, to);
        match whole > 0.0 {
            true => self.weights.of(from, piece.clamp(from, to)) / whole,
            false => 0.0,
        }
    }

    /// A last backward: when the gradients of `piece` and the pieces after it are final.
    pub(super) fn final_at(&self, piece: usize) -> f64 {
        self.end_s - (self.end_s - self.start_s) * self.below(piece)
    }

    /// A first forward: when it reaches `piece` and needs its parameters.
    pub(super) fn reaches(&self, piece: usize) -> f64 {
        self.start_s + (self.end_s - self.start_s) * self.below(piece)
    }
}

/// The (start, end) piece range of each stage of `layers` layers of a model of `l`.
pub(super) fn pieces_of(layers: &[usize], l: usize) -> Vec<(usize, usize)> {
    let p = layers.len();
    let mut start = 1;
    (0..p)
        .map(|i| {
            let from = if i == 0 { 0 } else { start };
            start += layers[i];
            let to = if i + 1 == p { l + 2 } else { start };
            (from, to)
        })
        .collect()
}

/// One piece's parameters in a reduction's buffer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct LaidPiece {
    pub(super) piece: usize,
    /// Elements each member sums.
    pub(super) elements: f64,
    /// Its tensors, taken as equal (a bucket holds tensors whole).
    pub(super) tensors: usize,
}

/// One gradient reduction as the runtime cuts it into buckets.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct BucketedReduction {
    /// Its pieces from the last to the first, as the buffer lays them out.
    pub(super) pieces: Vec<LaidPiece>,
    /// Seconds of one collective of no bytes, paid by every bucket.
    pub(super) fixed_s: f64,
    /// Seconds per element.
    pub(super) per_element_s: f64,
    /// Elements per bucket (`usize::MAX`: one).
    pub(super) bucket_size: usize,
    /// Under the distributed optimizer, each bucket's all-gather of the updated
    /// parameters after the step (per element each member sums); `None`: not sharded.
    pub(super) gather: Option<CollectivePrice>,
}

impl BucketedReduction {
    /// Its buckets in the order they start, each (elements, lowest piece): closed at the
    /// first tensor that brings it to the bucket size, as the runtime's (the last may
    /// be smaller).
    pub(super) fn buckets(&self) -> Vec<(f64, usize)> {
        let size = self.bucket_size as f64;
        let (mut out, mut fill, mut open) = (Vec::new(), 0.0, false);
        for p in &self.pieces {
            let tensor = p.elements / p.tensors.max(1) as f64;
            let mut left = p.tensors.max(1) as f64;
            while left > 0.0 {
                // Tensors that bring the bucket to its size (at least one).
                let need = ((size - fill) / tensor).ceil().max(1.0);
                if need > left {
                    (fill, left, open) = (fill + left * tensor, 0.0, true);
                    continue;
                }
                out.push((fill + need * tensor, p.piece));
                (fill, left, open) = (0.0, left - need, false);
            }
        }
        if let (true, Some(last)) = (open, self.pieces.last()) {
            out.push((fill, last.piece));
        }
        out
    }

    /// Seconds of a bucket of `elements`.
    pub(super) fn seconds(&self, elements: f64) -> f64 {
        self.fixed_s + self.per_element_s * elements
    }
}

/// When each queue's (a member's) buckets end: `reductions` in the plan's global
/// order, each over its members' queues, every bucket starting once each member's last
/// backward (`backward`, per queue) has made its lowest piece final and the member's
/// previous bucket has ended (0 for a queue without any).
pub(super) fn reductions_end_s(
    reductions: &[(Vec<usize>, BucketedReduction)],
    backward: &[StagePass],
) -> Vec<f64> {
    let mut free = vec![0.0f64; backward.len()];
    for (members, reduction) in reductions {
        for (elements, lowest) in reduction.buckets() {
            let ready = (members.iter())
                .map(|&m| backward[m].final_at(lowest))
                .fold(0.0, f64::max);
            let start = members.iter().map(|&m| free[m]).fold(ready, f64::max);
            let end = start + reduction.seconds(elements);
            for &m in members {
                free[m] = end;
            }
        }
    }
    free
}

/// What each of `queues` (a member's) waits for the distributed optimizer's parameter
/// gathers, s after its step: every gather starts once the optimizer has (all at once,
/// the optimizer waits for the global gradient norm), `reductions` in the plan's global
/// order, each's buckets from its first piece's, one after another on each member.
/// Without `--overlap-param-gather` (`forwards` `None`) a member waits for its last;
/// with it the next step's first forward on a member (`forwards`, per queue, from the
/// same start) waits at each bucket's lowest piece until the bucket has arrived.
pub(super) fn gather_waits_s(
    reductions: &[(Vec<usize>, BucketedReduction)],
    queues: usize,
    forwards: Option<&[StagePass]>,
) -> Vec<f64> {
    let (mut free, mut wait) = (vec![0.0f64; queues], vec![0.0f64; queues]);
    for (members, reduction) in reductions {
        let Some(gather) = reduction.gather else {
            continue;
        };
        for (elements, lowest) in reduction.buckets().into_iter().rev() {
            let start = members.iter().map(|&m| free[m]).fold(0.0, f64::max);
            let end = start + gather.seconds(elements);
            for &m in members {
                free[m] = end;
                let needed = forwards.map_or(0.0, |f| f[m].reaches(lowest));
                wait[m] = wait[m].max(end - needed);
            }
        }
    }
    wait
}

/// The reductions of pieces `from..to` (holding `layers` decoder layers) held by
/// `units`, one per replica, in the runtime's order: the parameters, then under expert
/// parallelism the experts over their holders (priced whole, once the pieces are final:
/// they follow the parameters' last bucket).
pub(super) fn held_reductions(
    ctx: &Ctx<'_>,
    units: &[usize],
    (from, to): (usize, usize),
    layers: f64,
) -> Vec<BucketedReduction> {
    let collective = holders_collective(ctx, units);
    let apart = experts_apart(ctx, units);
    let model = &ctx.cost.model;
    let bucket_size = match collective.whole {
        true => usize::MAX,
        false => ctx.cost.bucket_size(collective.members),
    };
    let reduction = collective.reduction();
    let mut out = vec![BucketedReduction {
        pieces: laid_out(model, (from, to), apart, collective.share),
        fixed_s: reduction.fixed_s,
        per_element_s: reduction.per_element_s,
        bucket_size,
        gather: collective.gather(),
    }];
    let experts = expert_allreduce_s(ctx, units, layers);
    let gathered = expert_gather_s(ctx, units, layers);
    if experts > 0.0 {
        out.push(BucketedReduction {
            pieces: vec![LaidPiece {
                piece: from,
                elements: 0.0,
                tensors: 1,
            }],
            fixed_s: experts,
            per_element_s: 0.0,
            bucket_size: usize::MAX,
            gather: (gathered > 0.0).then_some(CollectivePrice {
                fixed_s: gathered,
                per_element_s: 0.0,
            }),
        });
    }
    out
}

/// Every reduction of a grid of units (per stage, per replica) holding `layers` layers
/// per stage, each over its stage's queues (stage `i`, replica `r`: queue i·d + r).
pub(super) fn grid_reductions(
    ctx: &Ctx<'_>,
    grid: &[Vec<usize>],
    layers: &[usize],
) -> Vec<(Vec<usize>, BucketedReduction)> {
    let d = grid[0].len();
    let pieces = pieces_of(layers, ctx.cost.model.num_layers);
    (0..grid.len())
        .flat_map(|i| {
            let held = held_reductions(ctx, &grid[i], pieces[i], layers[i] as f64);
            held.into_iter()
                .map(move |b| ((i * d..(i + 1) * d).collect(), b))
        })
        .collect()
}

/// Pieces `from..to` from the last to the first, each `share` of its parameters (those
/// of the experts left out where they reduce `apart`).
fn laid_out(
    model: &ModelShape,
    (from, to): (usize, usize),
    apart: bool,
    share: f64,
) -> Vec<LaidPiece> {
    let head = model.num_layers + 1;
    let experts = match apart {
        true => model.expert_layer_params(),
        false => 0.0,
    };
    (from..to)
        .rev()
        .map(|piece| {
            let (params, tensors) = match piece {
                0 => (model.embedding_params(), 1),
                // The final norm and the output layer.
                x if x == head => (model.embedding_params() + model.hidden_size as f64, 2),
                _ => (model.layer_params() - experts, LAYER_TENSORS),
            };
            LaidPiece {
                piece,
                elements: params * share,
                tensors,
            }
        })
        .collect()
}
