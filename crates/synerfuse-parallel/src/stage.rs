//! Layers per pipeline stage.

use std::ops::Range;

/// A stage layout that cannot hold the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No stage at all.
    #[error("a pipeline needs at least one stage")]
    NoStages,
    /// A stage without layers: it would only forward activations.
    #[error("pipeline stage {stage} has 0 layers; every stage needs at least one")]
    EmptyStage { stage: usize },
    /// The stages do not hold exactly the model's layers.
    #[error("the stage layout sums to {actual} layers but --num-layers is {expected}")]
    LayerSumMismatch { expected: usize, actual: usize },
    /// The uniform default cannot split the layers evenly.
    #[error("--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {stages}; give per-stage layer counts")]
    NotDivisible { num_layers: usize, stages: usize },
}

/// How many consecutive decoder layers each pipeline stage holds.
///
/// Stage `p` holds global layers `Σ_{q<p} layers[q] ..` onwards, so a layout is fully
/// described by its per-stage counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StageLayout {
    layers: Vec<usize>,
}

impl StageLayout {
    /// A layout from per-stage layer counts, checked against the model's layer count.
    pub fn new(layers_per_stage: Vec<usize>, num_layers: usize) -> Result<Self, LayoutError> {
        if layers_per_stage.is_empty() {
            return Err(LayoutError::NoStages);
        }
        if let Some(stage) = layers_per_stage.iter().position(|&n| n == 0) {
            return Err(LayoutError::EmptyStage { stage });
        }
        let actual: usize = layers_per_stage.iter().sum();
        if actual != num_layers {
            return Err(LayoutError::LayerSumMismatch {
                expected: num_layers,
                actual,
            });
        }
        Ok(Self {
            layers: layers_per_stage,
        })
    }

    /// Megatron's default: the same number of layers on every stage.
    pub fn uniform(num_layers: usize, stages: usize) -> Result<Self, LayoutError> {
        if stages == 0 {
            return Err(LayoutError::NoStages);
        }
        if num_layers % stages != 0 {
            return Err(LayoutError::NotDivisible { num_layers, stages });
        }
        Self::new(vec![num_layers / stages; stages], num_layers)
    }

    /// Layers per stage.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Pipeline stages.
    pub fn num_stages(&self) -> usize {
        self.layers.len()
    }

    /// Decoder layers over all stages.
    pub fn num_layers(&self) -> usize {
        self.layers.iter().sum()
    }

    /// The global indices of the layers that stage `stage` holds.
    ///
    /// # Panics
    /// If `stage >= self.num_stages()`.
    pub fn layer_range(&self, stage: usize) -> Range<usize> {
        let start: usize = self.layers[..stage].iter().sum();
        start..start + self.layers[stage]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_examples() {
        let layout = StageLayout::new(vec![6, 2], 8).unwrap();
        assert_eq!(layout.layer_range(0), 0..6);
        assert_eq!(layout.layer_range(1), 6..8);
        let layout = StageLayout::new(vec![5, 5, 3, 3], 16).unwrap();
        let starts: Vec<usize> = (0..4).map(|p| layout.layer_range(p).start).collect();
        assert_eq!(starts, vec![0, 5, 10, 13]);
    }

    #[test]
    fn loud_errors() {
        assert_eq!(
            StageLayout::new(vec![5, 5, 3], 16),
            Err(LayoutError::LayerSumMismatch {
                expected: 16,
                actual: 13
            })
        );
        assert_eq!(StageLayout::new(vec![], 0), Err(LayoutError::NoStages));
        assert_eq!(
            StageLayout::new(vec![4, 0, 4], 8),
            Err(LayoutError::EmptyStage { stage: 1 })
        );
        assert_eq!(
            StageLayout::uniform(10, 4),
            Err(LayoutError::NotDivisible {
                num_layers: 10,
                stages: 4
            })
        );
    }

    #[test]
    fn ranges_tile_the_model() {
        for layers in [vec![1], vec![3, 1, 2], vec![2, 2, 2, 2, 7]] {
            let total = layers.iter().sum();
            let layout = StageLayout::new(layers, total).unwrap();
            let mut next = 0;
            for p in 0..layout.num_stages() {
                let range = layout.layer_range(p);
                assert_eq!(range.start, next);
                next = range.end;
            }
            assert_eq!(next, layout.num_layers());
        }
    }
}
