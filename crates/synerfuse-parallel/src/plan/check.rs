//! A plan checked against the model it trains: what `Plan::new` cannot know because it
//! depends on the model's sizes. The trainer runs this check before it builds anything,
//! and `synerfuse train` maps its errors to the flags behind them.

use super::{Plan, PlanError};
use crate::cost::ModelShape;
use crate::TpLayout;

impl Plan {
    /// Checks that this plan can train `model`: its stages hold the model's layers, every
    /// chunk at least one, each tensor-parallel group's shares divide the model (query
    /// groups, FFN columns, vocabulary rows) and, under sequence parallelism, the sequence
    /// divides over every group.
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
            for stage in (0..stages.num_stages()).filter(|&s| r.tp_size(s) > 1) {
                self.tp_layout(model, replica, stage)?;
                let (sequence, size) = (model.seq_length, r.tp_size(stage));
                if sequence_parallel && sequence % size != 0 {
                    return Err(PlanError::SequenceParallel {
                        replica,
                        stage,
                        size,
                        sequence,
                    });
                }
            }
        }
        Ok(())
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
        .map_err(|source| PlanError::TensorParallelSplit {
            replica,
            stage,
            source,
        })
    }
}
