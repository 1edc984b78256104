//! A plan checked against the model it trains: what `Plan::new` cannot know because it
//! depends on the model's sizes. The trainer runs this check before it builds anything,
//! and `synerfuse train` maps its errors to the flags behind them.

use super::{Plan, PlanError};
use crate::ModelShape;
use crate::TpLayout;

impl Plan {
    /// Checks that this plan can train `model`: its stages hold the model's layers, every
    /// chunk at least one, each tensor-parallel group's shares divide the model (query
    /// groups, FFN columns, vocabulary rows), each context-parallel group can split the
    /// sequence in its shares and, under sequence parallelism, each member's tokens
    /// divide over its tensor-parallel group.
    pub fn check(&self, model: &ModelShape, sequence_parallel: bool) -> Result<(), PlanError> {
        if self.num_layers() != model.num_layers {
            return Err(PlanError::LayerCount {
                plan: self.num_layers(),
                model: model.num_layers,
            });
        }
        for (replica, r) in self.replicas().iter().enumerate() {
            let stages = &r.stages;
            for (stage, chunk) in
                (0..stages.num_stages()).flat_map(|s| (0..stages.num_chunks()).map(move |c| (s, c)))
            {
                if stages
                    .chunk_range(stage, chunk)
                    .is_none_or(|l| l.is_empty())
                {
                    return Err(PlanError::EmptyChunk {
                        replica,
                        stage,
                        chunk,
                    });
                }
            }
            for stage in 0..stages.num_stages() {
                let tokens: Vec<usize> = match r.cp_size(stage) {
                    1 => vec![model.seq_length],
                    _ => {
                        let split =
                            (r.context_split(stage, model.seq_length)).map_err(|source| {
                                PlanError::ContextSplit {
                                    replica,
                                    stage,
                                    source,
                                }
                            })?;
                        (0..split.ranks()).map(|m| split.tokens(m)).collect()
                    }
                };
                let size = r.tp_size(stage);
                if size == 1 {
                    continue;
                }
                self.tp_layout(model, replica, stage)?;
                let uneven = tokens.into_iter().find(|&t| t % size != 0);
                if let Some(sequence) = uneven.filter(|_| sequence_parallel) {
                    return Err(PlanError::SequenceParallel {
                        replica,
                        stage,
                        size,
                        sequence,
                    });
                }
            }
        }
        self.check_experts(model)
    }

    /// Expert placements only for a model with experts, in groups that hold them all.
    fn check_experts(&self, model: &ModelShape) -> Result<(), PlanError> {
        let split: Vec<usize> = (self.replicas().iter().enumerate())
            .filter(|(_, r)| r.splits_experts())
            .map(|(i, _)| i)
            .collect();
        match (&model.experts, split.is_empty()) {
            (_, true) => Ok(()),
            (None, false) => Err(PlanError::ExpertGroup {
                replicas: split,
                problem: "they hold some experts each, but the model has none (a dense model: --num-experts)".into(),
            }),
            (Some(experts), false) => self.expert_groups(experts.num_experts).map(drop),
        }
    }

    /// How the tensor-parallel group of `replica`'s `stage` divides `model` (one rank
    /// holding everything when the stage has no group).
    pub fn tp_layout(
        &self,
        model: &ModelShape,
        replica: usize,
        stage: usize,
    ) -> Result<TpLayout, PlanError> {
        let shares = self.replicas()[replica].shares(stage);
        TpLayout::new(
            Some(&shares),
            shares.len(),
            model.num_kv_heads,
            model.ffn_hidden_size,
            model.vocab_size,
        )
        .and_then(|layout| match model.experts {
            Some(e) => layout.with_expert_ffn(e.ffn_hidden_size),
            None => Ok(layout),
        })
        .map_err(|source| PlanError::TensorParallelSplit {
            replica,
            stage,
            source,
        })
    }
}
