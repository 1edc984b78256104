//! Which ranks reduce which gradients under a general plan: the model's pieces cut at
//! the union of every replica's chunk boundaries, each segment summed over the ranks
//! that hold it, in one global order.

use super::Plan;
use crate::ExpertShape;
use crate::StageLayout;
use std::collections::BTreeMap;
use std::ops::Range;

/// A contiguous run of model pieces (0 = embedding, 1..=L layers, L + 1 = final norm and
/// output layer) that one stage of every replica holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradientSegment {
    /// The pieces.
    pub pieces: Range<usize>,
    /// The ranks of the stage of each replica that holds them (its tensor-parallel group
    /// in order, or one rank), in replica order; under context parallelism each
    /// member's group in turn (Megatron's dp-cp group: each member's gradients are of
    /// its own tokens).
    pub holders: Vec<Vec<usize>>,
    /// Each holder's tensor-parallel shares in lowest terms.
    pub shares: Vec<Vec<u32>>,
    /// The stage of each replica that holds them, in replica order.
    pub stages: Vec<usize>,
}

/// The parameters one gradient reduction sums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReducedParameters {
    /// The parameters of these model pieces (a tied embedding excepted).
    Pieces(Range<usize>),
    /// The embedding tied to the output layer: every copy, on the first and the last
    /// stage of every replica, summed together (the two copies are one parameter).
    TiedEmbedding,
    /// These experts of the MoE layers of these pieces, over the replicas that hold
    /// them (expert parallelism: Megatron's expert-data-parallel group).
    Experts {
        /// The pieces.
        pieces: Range<usize>,
        /// The experts.
        experts: Vec<usize>,
    },
}

/// One all-reduce of a step: what it sums, over which ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradientReduction {
    /// The parameters.
    pub parameters: ReducedParameters,
    /// The ranks that take part, ascending (the communicator's order).
    pub members: Vec<usize>,
    /// Whether it sums whole tensors: its holders split them differently (tensor-parallel
    /// stages of other sizes or shares), so each member adds its slices into the whole
    /// tensors and takes its slices of the sum back. Otherwise every member holds the
    /// same slices (one reduction per shard index) and sums them in place.
    pub whole: bool,
}

impl GradientReduction {
    /// What it sums, for people: `embedding, layers 0..4 over ranks [0, 1]` (layers as
    /// global index ranges of a model of `num_layers`; with `tied_embeddings` the
    /// embedding and output layer are the tied reduction's, not their segments').
    pub fn describe(&self, num_layers: usize, tied_embeddings: bool) -> String {
        let what = match &self.parameters {
            ReducedParameters::TiedEmbedding => "the tied embedding and output layer".to_owned(),
            ReducedParameters::Experts { pieces, experts } => {
                let layers = pieces.start.max(1) - 1..(pieces.end - 1).min(num_layers);
                format!(
                    "experts {experts:?} of layers {}..{}",
                    layers.start, layers.end
                )
            }
            ReducedParameters::Pieces(pieces) => {
                let mut parts = Vec::new();
                if pieces.start == 0 && !tied_embeddings {
                    parts.push("embedding".to_owned());
                }
                let layers = pieces.start.max(1) - 1..(pieces.end - 1).min(num_layers);
                if !layers.is_empty() {
                    parts.push(format!("layers {}..{}", layers.start, layers.end));
                }
                if pieces.end == num_layers + 2 {
                    parts.push(match tied_embeddings {
                        true => "final norm".to_owned(),
                        false => "final norm and output layer".to_owned(),
                    });
                }
                parts.join(", ")
            }
        };
        let whole = match self.whole {
            true => " (whole tensors: the holders split them differently)",
            false => "",
        };
        format!("{what} over ranks {:?}{whole}", self.members)
    }
}

impl Plan {
    /// The gradient segments: the model's pieces (embedding, layers, head) cut at the
    /// union of every replica's chunk boundaries; each segment is held by one rank per
    /// replica and reduced over exactly those. In model order.
    pub fn segments(&self) -> Vec<GradientSegment> {
        let pieces = self.num_layers() + 2;
        let mut cuts = vec![0, pieces];
        for replica in &self.replicas {
            for (_, range) in chunk_pieces(&replica.stages) {
                cuts.extend([range.start, range.end]);
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        cuts.windows(2)
            .map(|w| {
                let stages: Vec<usize> = self
                    .replicas
                    .iter()
                    .map(|replica| {
                        chunk_pieces(&replica.stages)
                            .into_iter()
                            .find(|(_, range)| range.contains(&w[0]))
                            .map(|(stage, _)| stage)
                            .expect("the chunks cover every piece")
                    })
                    .collect();
                let (holders, shares) = (self.replicas.iter().zip(&stages))
                    .flat_map(|(replica, &stage)| {
                        let shares = replica.shares(stage);
                        (replica.tp_groups(stage)).map(move |g| (g.to_vec(), shares.clone()))
                    })
                    .unzip();
                GradientSegment {
                    pieces: w[0]..w[1],
                    holders,
                    shares,
                    stages,
                }
            })
            .collect()
    }

    /// Every gradient reduction of a step, in the one global order each rank issues its
    /// own in (so no two ranks wait on each other): the segments from the output layer
    /// back to the embedding, the order in which backwards finish them, then the tied
    /// embedding when `tied_embeddings`. A segment held by tensor-parallel stages is
    /// reduced once per shard index, over the ranks of that index, when its holders split
    /// it alike; otherwise once, whole, over all of them (likewise the tied embedding
    /// over the first and last stages).
    pub fn gradient_reductions(&self, tied_embeddings: bool) -> Vec<GradientReduction> {
        self.gradient_reductions_with_experts(tied_embeddings, None)
    }

    /// [`Self::gradient_reductions`] of a model with `experts`: under expert
    /// parallelism, after each segment's, one reduction per set of replicas holding the
    /// same experts of its MoE layers, over just those replicas' holders.
    pub fn gradient_reductions_with_experts(
        &self,
        tied_embeddings: bool,
        experts: Option<&ExpertShape>,
    ) -> Vec<GradientReduction> {
        let segments = self.segments();
        let mut out = Vec::new();
        for segment in segments.iter().rev() {
            let parameters = ReducedParameters::Pieces(segment.pieces.clone());
            out.extend(reductions(parameters, &segment.holders, &segment.shares));
            if let Some(experts) = experts {
                out.extend(self.expert_reductions(segment, experts));
            }
        }
        if tied_embeddings {
            let (first, last) = (&segments[0], &segments[segments.len() - 1]);
            let holders: Vec<Vec<usize>> =
                first.holders.iter().chain(&last.holders).cloned().collect();
            let shares: Vec<Vec<u32>> = first.shares.iter().chain(&last.shares).cloned().collect();
            out.extend(reductions(
                ReducedParameters::TiedEmbedding,
                &holders,
                &shares,
            ));
        }
        out
    }

    /// The reductions of `segment`'s experts when some replica holds only some: one per
    /// set of replicas holding the same experts (none for a segment without MoE layers).
    fn expert_reductions(
        &self,
        segment: &GradientSegment,
        shape: &ExpertShape,
    ) -> Vec<GradientReduction> {
        let layers = segment.pieces.start.max(1) - 1..segment.pieces.end - 1;
        let moe = layers
            .clone()
            .any(|l| l < self.num_layers() && l % shape.layer_freq.max(1) == 0);
        let split = (self.replicas.iter().zip(&segment.stages))
            .any(|(r, &stage)| r.experts(stage, shape.num_experts).is_some());
        if !moe || !split {
            return Vec::new();
        }
        // Each expert's holder replicas; experts with the same holders reduce together.
        let mut by_holders: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
        for e in 0..shape.num_experts {
            let holders = (self.replicas.iter().zip(&segment.stages).enumerate())
                .filter(|(_, (r, &stage))| {
                    r.experts(stage, shape.num_experts)
                        .is_none_or(|held| held.contains(&e))
                })
                .map(|(i, _)| i)
                .collect();
            by_holders.entry(holders).or_default().push(e);
        }
        let mut out = Vec::new();
        // An expert nobody holds is the plan check's to refuse.
        by_holders.remove(&Vec::new());
        for (replicas, experts) in by_holders {
            let (holders, shares): (Vec<Vec<usize>>, Vec<Vec<u32>>) = (replicas.iter())
                .flat_map(|&i| {
                    let (r, stage) = (&self.replicas[i], segment.stages[i]);
                    let shares = r.shares(stage);
                    (r.tp_groups(stage)).map(move |g| (g.to_vec(), shares.clone()))
                })
                .unzip();
            let parameters = ReducedParameters::Experts {
                pieces: segment.pieces.clone(),
                experts,
            };
            out.extend(reductions(parameters, &holders, &shares));
        }
        out
    }

    /// The model pieces of each chunk `rank` holds, in chunk order (empty for a rank
    /// outside the plan).
    pub fn chunk_pieces(&self, rank: usize) -> Vec<Range<usize>> {
        let Some((replica, stage)) = self.position(rank) else {
            return Vec::new();
        };
        chunk_pieces(&self.replicas[replica].stages)
            .into_iter()
            .filter(|(s, _)| *s == stage)
            .map(|(_, pieces)| pieces)
            .collect()
    }
}

/// The reductions of `parameters` held by `holders` (each a stage's tensor-parallel
/// group) split by `shares`: one per shard index when every holder splits alike, else
/// one of the whole tensors over every holder.
fn reductions(
    parameters: ReducedParameters,
    holders: &[Vec<usize>],
    shares: &[Vec<u32>],
) -> Vec<GradientReduction> {
    if shares.iter().all(|s| s == &shares[0]) {
        return (0..shares[0].len())
            .map(|j| GradientReduction {
                parameters: parameters.clone(),
                members: sorted(holders.iter().map(|h| h[j]).collect()),
                whole: false,
            })
            .collect();
    }
    vec![GradientReduction {
        parameters,
        members: sorted(holders.iter().flatten().copied().collect()),
        whole: true,
    }]
}

fn sorted(mut ranks: Vec<usize>) -> Vec<usize> {
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// (stage, model pieces) of every chunk of `stages`, in chunk-major order: the first
/// chunk of stage 0 also holds the embedding (piece 0), the last chunk of the last stage
/// the final norm and output layer (piece L + 1).
pub(super) fn chunk_pieces(stages: &StageLayout) -> Vec<(usize, Range<usize>)> {
    let last_stage = stages.num_stages() - 1;
    let last_chunk = stages.num_chunks() - 1;
    let mut out = Vec::new();
    for chunk in 0..stages.num_chunks() {
        for stage in 0..stages.num_stages() {
            let layers = stages
                .chunk_range(stage, chunk)
                .expect("stage and chunk within the layout");
            let start = if stage == 0 && chunk == 0 {
                0
            } else {
                layers.start + 1
            };
            let end = if stage == last_stage && chunk == last_chunk {
                layers.end + 2
            } else {
                layers.end + 1
            };
            out.push((stage, start..end));
        }
    }
    out
}

/// The name of the embedding, which the last stage also holds as its output layer when
/// the two are tied.
pub const EMBEDDING: &str = "model.embed_tokens.weight";

/// The model piece a parameter belongs to (0 = embedding, 1..=L layers, L + 1 = final
/// norm and output layer), for a chunk that holds `pieces`: the embedding's name on a
/// chunk without piece 0 is the tied output layer's copy. `None` for a name of no piece.
pub fn parameter_piece(name: &str, pieces: &Range<usize>, num_layers: usize) -> Option<usize> {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        let index: usize = rest.split('.').next()?.parse().ok()?;
        return (index < num_layers).then_some(index + 1);
    }
    match name {
        EMBEDDING if pieces.start == 0 => Some(0),
        EMBEDDING | "model.norm.weight" | "lm_head.weight" => Some(num_layers + 1),
        _ => None,
    }
}

/// The decoder layer a parameter belongs to (`model.layers.L.…`).
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The expert a parameter belongs to (`model.layers.L.block_sparse_moe.experts.E.…`).
pub fn expert_of(name: &str) -> Option<usize> {
    let (_, rest) = name.split_once(".block_sparse_moe.experts.")?;
    rest.split('.').next()?.parse().ok()
}

/// Which of `reductions` (one rank's, in global order) sums the parameter `name` of a
/// chunk holding `pieces`: an expert's its experts' reduction when there is one, else its
/// piece's; `None` if none does (a plan that does not cover the model).
pub fn reduction_of(
    name: &str,
    pieces: &Range<usize>,
    num_layers: usize,
    reductions: &[GradientReduction],
) -> Option<usize> {
    let tied = reductions
        .iter()
        .position(|r| r.parameters == ReducedParameters::TiedEmbedding);
    if let (Some(index), EMBEDDING) = (tied, name) {
        return Some(index);
    }
    let piece = parameter_piece(name, pieces, num_layers)?;
    let expert = expert_of(name);
    let of_expert = (reductions.iter()).position(|r| match (&r.parameters, expert) {
        (ReducedParameters::Experts { pieces, experts }, Some(e)) => {
            pieces.contains(&piece) && experts.contains(&e)
        }
        _ => false,
    });
    of_expert.or_else(|| {
        reductions.iter().position(
            |r| matches!(&r.parameters, ReducedParameters::Pieces(p) if p.contains(&piece)),
        )
    })
}
