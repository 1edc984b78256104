//! Layers per pipeline stage.

use std::ops::Range;

/// A stage layout that cannot hold the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No stage at all.
    #[error("a pipeline needs at least one stage")]
    NoStages,
    /// A stage (or virtual chunk) without layers: it would only forward activations.
    #[error("pipeline stage {stage}{} has 0 layers; every stage needs at least one", chunk.map(|c| format!(" chunk {c}")).unwrap_or_default())]
    EmptyStage {
        /// The stage.
        stage: usize,
        /// The virtual chunk, for interleaved layouts.
        chunk: Option<usize>,
    },
    /// The stages do not hold exactly the model's layers.
    #[error("the stage layout sums to {actual} layers but the model has {expected}")]
    LayerSumMismatch {
        /// The model's layers.
        expected: usize,
        /// What the layout adds up to.
        actual: usize,
    },
    /// The uniform default cannot split the layers evenly.
    #[error("{num_layers} layers are not divisible by {stages} pipeline stages × {chunks} virtual chunks; give per-stage layer counts")]
    NotDivisible {
        /// The model's layers.
        num_layers: usize,
        /// Pipeline stages.
        stages: usize,
        /// Virtual chunks per stage.
        chunks: usize,
    },
    /// `--hetero-pipeline-stages` groups do not add up to the pipeline.
    #[error("--hetero-pipeline-stages: the groups hold {actual} stages but --pipeline-model-parallel-size is {expected}")]
    StageCountMismatch {
        /// `--pipeline-model-parallel-size`.
        expected: usize,
        /// Σ n_i.
        actual: usize,
    },
    /// A group announces more layer counts than follow it.
    #[error("--hetero-pipeline-stages: group {group} announces {announced} stages but only {given} layer counts follow")]
    IncompleteGroup {
        /// Group index.
        group: usize,
        /// Its `n_i`.
        announced: usize,
        /// Counts left.
        given: usize,
    },
    /// A group of zero devices.
    #[error("--hetero-pipeline-stages: group {group} has 0 devices")]
    EmptyGroup {
        /// Group index.
        group: usize,
    },
    /// A number that is not a count.
    #[error("{flag}: {value:?} is not a non-negative integer")]
    NotANumber {
        /// The flag.
        flag: &'static str,
        /// The value.
        value: String,
    },
    /// A virtual-chunk layout whose length is not stages × chunks.
    #[error("{given} layer counts cannot be {stages} stages × {chunks} virtual chunks")]
    ChunkShape {
        /// Counts given.
        given: usize,
        /// Stages.
        stages: usize,
        /// Chunks per stage.
        chunks: usize,
    },
}

/// How many consecutive decoder layers each pipeline stage holds, optionally in several
/// virtual chunks per stage (interleaved 1F1B).
///
/// The model is cut into `stages × chunks` consecutive pieces; piece `v · stages + p` is
/// chunk v of stage p, as in Megatron's interleaved schedule. Stages (and chunks) may hold
/// different numbers of layers, so a fast device can carry more than a slow one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "StageLayoutRepr", into = "StageLayoutRepr")]
pub struct StageLayout {
    /// Layers of each piece, in model order (`chunks` rounds of `stages` pieces).
    pieces: Vec<usize>,
    stages: usize,
}

/// The serialized form: layers per stage, or per chunk and stage.
#[derive(serde::Serialize, serde::Deserialize)]
struct StageLayoutRepr {
    /// `layers[v][p]`: layers of chunk v on stage p.
    layers: Vec<Vec<usize>>,
}

impl TryFrom<StageLayoutRepr> for StageLayout {
    type Error = LayoutError;
    fn try_from(repr: StageLayoutRepr) -> Result<Self, LayoutError> {
        let total = repr.layers.iter().flatten().sum();
        StageLayout::from_per_chunk(repr.layers, total)
    }
}

impl From<StageLayout> for StageLayoutRepr {
    fn from(layout: StageLayout) -> Self {
        StageLayoutRepr {
            layers: layout
                .pieces
                .chunks(layout.stages)
                .map(<[usize]>::to_vec)
                .collect(),
        }
    }
}

impl StageLayout {
    /// A layout from per-stage layer counts, checked against the model's layer count.
    pub fn new(layers_per_stage: Vec<usize>, num_layers: usize) -> Result<Self, LayoutError> {
        let stages = layers_per_stage.len();
        Self::interleaved(layers_per_stage, stages, num_layers)
    }

    /// An interleaved layout: `pieces` lists the layers of chunk v of stage p at index
    /// `v · stages + p` (model order).
    pub fn interleaved(
        pieces: Vec<usize>,
        stages: usize,
        num_layers: usize,
    ) -> Result<Self, LayoutError> {
        if stages == 0 || pieces.is_empty() {
            return Err(LayoutError::NoStages);
        }
        if pieces.len() % stages != 0 {
            return Err(LayoutError::ChunkShape {
                given: pieces.len(),
                stages,
                chunks: pieces.len().div_ceil(stages),
            });
        }
        let chunks = pieces.len() / stages;
        if let Some(i) = pieces.iter().position(|&n| n == 0) {
            return Err(LayoutError::EmptyStage {
                stage: i % stages,
                chunk: (chunks > 1).then_some(i / stages),
            });
        }
        let actual: usize = pieces.iter().sum();
        if actual != num_layers {
            return Err(LayoutError::LayerSumMismatch {
                expected: num_layers,
                actual,
            });
        }
        Ok(Self { pieces, stages })
    }

    /// A layout from `layers[v][p]`, the layers of chunk v on stage p (every chunk with
    /// one count per stage), checked against the model's layer count.
    pub fn from_per_chunk(layers: Vec<Vec<usize>>, num_layers: usize) -> Result<Self, LayoutError> {
        let stages = layers.first().map_or(0, Vec::len);
        let chunks = layers.len();
        let pieces: Vec<usize> = layers.into_iter().flatten().collect();
        if pieces.len() != stages * chunks {
            return Err(LayoutError::ChunkShape {
                given: pieces.len(),
                stages,
                chunks,
            });
        }
        Self::interleaved(pieces, stages, num_layers)
    }

    /// Megatron's default: the same number of layers on every stage.
    pub fn uniform(num_layers: usize, stages: usize) -> Result<Self, LayoutError> {
        Self::uniform_interleaved(num_layers, stages, 1)
    }

    /// The same number of layers in every chunk of every stage.
    pub fn uniform_interleaved(
        num_layers: usize,
        stages: usize,
        chunks: usize,
    ) -> Result<Self, LayoutError> {
        if stages == 0 || chunks == 0 {
            return Err(LayoutError::NoStages);
        }
        if num_layers % (stages * chunks) != 0 {
            return Err(LayoutError::NotDivisible {
                num_layers,
                stages,
                chunks,
            });
        }
        Self::interleaved(
            vec![num_layers / (stages * chunks); stages * chunks],
            stages,
            num_layers,
        )
    }

    /// SynerFuse's `--hetero-pipeline-stages n0 l0_0 .. l0_{n0-1} n1 l1_0 ...`: `n_i`
    /// devices in group i, then one layer count per device (pipeline stage). Unlike
    /// SynerFuse, a trailing incomplete group is an error, as is any sum that is off.
    pub fn from_hetero_pipeline_stages(
        values: &[usize],
        pipeline_size: usize,
        num_layers: usize,
    ) -> Result<Self, LayoutError> {
        let mut layers = Vec::new();
        let mut rest = values;
        let mut group = 0;
        while let Some((&n, tail)) = rest.split_first() {
            if n == 0 {
                return Err(LayoutError::EmptyGroup { group });
            }
            if tail.len() < n {
                return Err(LayoutError::IncompleteGroup {
                    group,
                    announced: n,
                    given: tail.len(),
                });
            }
            layers.extend_from_slice(&tail[..n]);
            rest = &tail[n..];
            group += 1;
        }
        if layers.len() != pipeline_size {
            return Err(LayoutError::StageCountMismatch {
                expected: pipeline_size,
                actual: layers.len(),
            });
        }
        Self::new(layers, num_layers)
    }

    /// Parses whitespace- or comma-separated counts (`"5 5 3 3"`, `"5,5,3,3"`) for `flag`.
    pub fn parse_counts(text: &str, flag: &'static str) -> Result<Vec<usize>, LayoutError> {
        text.split(|c: char| c == ',' || c.is_whitespace())
            .filter(|t| !t.is_empty())
            .map(|t| {
                t.parse().map_err(|_| LayoutError::NotANumber {
                    flag,
                    value: t.to_owned(),
                })
            })
            .collect()
    }

    /// The SynerFuse flag values for this layout: one group per run of equal counts is
    /// not needed, so every stage is its own group of one (`1 l0 1 l1 ...`).
    pub fn to_hetero_pipeline_stages(&self) -> Vec<usize> {
        self.layers().iter().flat_map(|&l| [1, l]).collect()
    }

    /// Layers per stage (all chunks of a stage together).
    pub fn layers(&self) -> Vec<usize> {
        (0..self.stages)
            .map(|p| self.pieces.iter().skip(p).step_by(self.stages).sum())
            .collect()
    }

    /// Pipeline stages.
    pub fn num_stages(&self) -> usize {
        self.stages
    }

    /// Virtual chunks per stage (1 without interleaving).
    pub fn num_chunks(&self) -> usize {
        self.pieces.len() / self.stages
    }

    /// Decoder layers over all stages.
    pub fn num_layers(&self) -> usize {
        self.pieces.iter().sum()
    }

    /// The global indices of the layers that chunk `chunk` of stage `stage` holds, or
    /// `None` if there is no such stage or chunk.
    pub fn chunk_range(&self, stage: usize, chunk: usize) -> Option<Range<usize>> {
        if stage >= self.stages || chunk >= self.num_chunks() {
            return None;
        }
        let piece = chunk * self.stages + stage;
        let start: usize = self.pieces[..piece].iter().sum();
        Some(start..start + self.pieces[piece])
    }

    /// The global indices of the layers that stage `stage` holds (its first chunk when
    /// interleaved).
    ///
    /// # Panics
    /// If `stage >= self.num_stages()`.
    pub fn layer_range(&self, stage: usize) -> Range<usize> {
        self.chunk_range(stage, 0).expect("stage within the layout")
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
            Err(LayoutError::EmptyStage {
                stage: 1,
                chunk: None
            })
        );
        assert_eq!(
            StageLayout::uniform(10, 4),
            Err(LayoutError::NotDivisible {
                num_layers: 10,
                stages: 4,
                chunks: 1
            })
        );
    }

    /// SynerFuse's `--hetero-pipeline-stages` examples and its two silent failures, now loud.
    #[test]
    fn hetero_pipeline_stages_flag() {
        let l = StageLayout::from_hetero_pipeline_stages(&[1, 6, 1, 2], 2, 8).unwrap();
        assert_eq!(l.layers(), [6, 2]);
        let l = StageLayout::from_hetero_pipeline_stages(&[2, 5, 5, 2, 3, 3], 4, 16).unwrap();
        assert_eq!(l.layers(), [5, 5, 3, 3]);
        assert_eq!(l.layer_range(3), 13..16);
        assert_eq!(
            StageLayout::from_hetero_pipeline_stages(&[2, 5, 5, 2, 3], 4, 16),
            Err(LayoutError::IncompleteGroup {
                group: 1,
                announced: 2,
                given: 1
            })
        );
        assert_eq!(
            StageLayout::from_hetero_pipeline_stages(&[2, 5, 5, 1, 6], 4, 16),
            Err(LayoutError::StageCountMismatch {
                expected: 4,
                actual: 3
            })
        );
        assert_eq!(
            StageLayout::from_hetero_pipeline_stages(&[2, 5, 5, 2, 3, 2], 4, 16),
            Err(LayoutError::LayerSumMismatch {
                expected: 16,
                actual: 15
            })
        );
        let flags = l.to_hetero_pipeline_stages();
        assert_eq!(
            StageLayout::from_hetero_pipeline_stages(&flags, 4, 16).unwrap(),
            l
        );
        assert_eq!(
            StageLayout::parse_counts("5, 5 3,3", "--x").unwrap(),
            [5, 5, 3, 3]
        );
        assert!(StageLayout::parse_counts("5 x", "--x").is_err());
    }

    #[test]
    fn interleaved_chunks_follow_megatrons_order() {
        // 8 layers, 2 stages, 2 chunks: stage 0 holds 0-1 and 4-5, stage 1 2-3 and 6-7.
        let l = StageLayout::uniform_interleaved(8, 2, 2).unwrap();
        assert_eq!(l.chunk_range(0, 1), Some(4..6));
        assert_eq!(l.chunk_range(1, 0), Some(2..4));
        assert_eq!(l.chunk_range(2, 0), None);
        let l = StageLayout::interleaved(vec![3, 1, 2, 2], 2, 8).unwrap();
        assert_eq!(l.layers(), [5, 3]);
        assert_eq!(l.chunk_range(1, 1), Some(6..8));
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(json, r#"{"layers":[[3,1],[2,2]]}"#);
        assert_eq!(serde_json::from_str::<StageLayout>(&json).unwrap(), l);
        assert!(serde_json::from_str::<StageLayout>(r#"{"layers":[[3,0]]}"#).is_err());
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
