//! Saving and restoring a rank's state by global name and element range: every rank
//! writes exactly what it holds (see [`crate::checkpoint`]) and reads back only what it
//! keeps, whatever plan wrote the checkpoint.

use super::Trainer;
use crate::checkpoint::region::{Region, Slice};
use crate::checkpoint::shard::PieceToWrite;
use crate::checkpoint::{self, CheckpointProblem, CheckpointState, StateSource};
use crate::grads::EMBEDDING;
use crate::TrainError;
use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use synerfuse_model::tch::{self, Tensor};
use synerfuse_model::Stage;

/// The region of the whole tensor `name` that `stage`'s shard holds as a tensor of
/// shape `local`, and the whole shape.
fn held_region(stage: &Stage, name: &str, local: &[i64]) -> (Region, Vec<i64>) {
    let whole = stage.whole_shape(name, local);
    let slice = (stage.shard_of(name)).map(|(dim, r)| Slice {
        dim,
        start: r.start,
        end: r.end,
    });
    (Region::of_slice(&whole, slice), whole)
}

/// A rank's pieces of a checkpoint: parameters, and optimizer moments.
#[derive(Default)]
pub(super) struct RankPieces {
    pub(super) model: Vec<PieceToWrite>,
    pub(super) optimizer: Vec<PieceToWrite>,
}

impl RankPieces {
    /// The parameter `name` (held as shape `local`): elements `elements` of its local
    /// flattening (all when `None`) with their value and moments.
    fn push(
        &mut self,
        stage: &Stage,
        name: &str,
        local: &[i64],
        elements: Option<Range<i64>>,
        [value, exp_avg, exp_avg_sq]: [Tensor; 3],
    ) {
        let (mut region, shape) = held_region(stage, name, local);
        if let Some(elements) = elements {
            region = region.narrowed(elements);
        }
        let piece = |name: String, data: Tensor| PieceToWrite {
            name,
            shape: shape.clone(),
            region: region.clone(),
            data: data.detach(),
        };
        self.optimizer
            .push(piece(format!("{name}.exp_avg"), exp_avg));
        self.optimizer
            .push(piece(format!("{name}.exp_avg_sq"), exp_avg_sq));
        self.model.push(piece(name.to_owned(), value));
    }
}

impl<'w> Trainer<'w> {
    /// Writes a checkpoint of the current iteration (collective): every rank writes its
    /// own pieces in parallel, rank 0 then merges their fragments into the manifest and
    /// renames the directory into place.
    pub fn save(&mut self) -> Result<PathBuf, TrainError> {
        let save = (self.config.checkpoint.save.clone()).ok_or(TrainError::NoSaveDir)?;
        let rank = self.world.rank();
        if rank == 0 {
            checkpoint::prepare(&save, self.iteration)?;
        }
        self.world.barrier();
        let staging = checkpoint::staging_dir(&save, self.iteration);
        let pieces = self.checkpoint_pieces();
        let written = checkpoint::write_rank(&staging, rank, &pieces.model, &pieces.optimizer);
        drop(pieces);
        self.agree(written, &staging)?;
        let committed = match rank {
            0 => checkpoint::commit(&save, &self.checkpoint_state(), self.world.size()).map(drop),
            _ => Ok(()),
        };
        self.agree(committed, &staging)?;
        let dir = save.join(checkpoint::iteration_dir(self.iteration));
        if rank == 0 {
            tracing::info!(
                "saved checkpoint {} (iteration {})",
                dir.display(),
                self.iteration
            );
        }
        Ok(dir)
    }

    /// `result` on this rank, once every rank has said whether its own succeeded (so a
    /// rank that failed does not leave the others waiting): a failure elsewhere is an
    /// error naming the rank.
    fn agree<T>(&self, result: Result<T, TrainError>, staging: &Path) -> Result<T, TrainError> {
        let mine = match &result {
            Ok(_) => 0.0,
            Err(_) => (self.world.rank() + 1) as f64,
        };
        let failed = self.world_max(mine)?;
        match result {
            Ok(_) if failed > 0.0 => {
                let rank = failed as usize - 1;
                let problem = CheckpointProblem::RankFailed { rank };
                Err(checkpoint::problem_at(staging, problem))
            }
            other => other,
        }
    }

    /// What this rank writes: replica 0 its slice of every parameter of the replicated
    /// optimizer (a tensor every rank of its tensor-parallel group holds whole from rank
    /// 0 only, the last stage's copy of a tied embedding not at all), and every holder
    /// its own shard of the distributed optimizer's masters and moments.
    pub(super) fn checkpoint_pieces(&self) -> RankPieces {
        let stage = &self.chunks[0];
        let skip_tied = self.holds_tied_copy();
        let mut pieces = RankPieces::default();
        if self.replica == 0 {
            for (name, value, m, v) in self.optimizer.state() {
                if (skip_tied && name == EMBEDDING) || !stage.holds_unique(name) {
                    continue;
                }
                let state = [value, m, v].map(Tensor::shallow_clone);
                pieces.push(stage, name, &value.size(), None, state);
            }
        }
        for held in self.zero.iter().flat_map(|z| z.held_pieces()) {
            if stage.holds_unique(&held.name) {
                let (name, shape) = (&held.name, &held.local_shape);
                pieces.push(stage, name, shape, Some(held.elements), held.state);
            }
        }
        pieces
    }

    /// Where the run is, as a checkpoint records it.
    pub(super) fn checkpoint_state(&self) -> CheckpointState {
        CheckpointState {
            iteration: self.iteration,
            consumed_samples: self.consumed_samples,
            optimizer_steps: self.optimizer.steps(),
            seed: self.config.batch.seed,
            rng_seed: self.config.batch.seed.wrapping_add(self.iteration),
            model: serde_json::from_str(&self.config.model.to_hf_json())
                .unwrap_or(serde_json::Value::Null),
            plan: self.config.parallel.plan.clone(),
            bf16: self.config.compute.bf16,
        }
    }

    /// Takes this rank's parameters, moments and the run's position from `source`, by
    /// global name and element range (whatever plan wrote them): its tensor-parallel
    /// slice of each parameter, and of the moments only the elements it keeps.
    pub(super) fn restore(&mut self, source: &dyn StateSource) -> Result<(), TrainError> {
        let sharded: BTreeSet<String> = (self.zero.as_ref()).map(|z| z.names()).unwrap_or_default();
        let stage = &self.chunks[0];
        let read = |name: &str, local: &[i64], elements: Option<Range<i64>>| {
            let (mut region, whole) = held_region(stage, name, local);
            if let Some(elements) = elements {
                region = region.narrowed(elements);
            }
            source.read(name, &whole, &region)
        };
        let variables: Vec<(String, Tensor)> = (self.chunks.iter())
            .flat_map(|c| c.var_store().variables())
            .collect();
        let mut restored = BTreeSet::new();
        for (name, mut var) in variables {
            let local = var.size();
            let value = read(&name, &local, None)?.view(local.as_slice());
            if sharded.contains(&name) {
                // The parameter itself here; its master and moments in the shards below.
                tch::no_grad(|| var.copy_(&value.to_kind(var.kind()).to_device(var.device())));
                continue;
            }
            if !restored.insert(name.clone()) {
                continue;
            }
            let moment = |which: &str| {
                let moment = format!("{name}.{which}");
                Ok::<_, TrainError>(read(&moment, &local, None)?.view(local.as_slice()))
            };
            let (m, v) = (moment("exp_avg")?, moment("exp_avg_sq")?);
            self.optimizer
                .load_param(&name, &value, Some(&m), Some(&v))
                .map_err(|e| checkpoint::problem_at(source.origin(), e))?;
        }
        if let Some(zero) = &mut self.zero {
            zero.load_pieces(|name, local, elements| {
                let part =
                    |suffix: &str| read(&format!("{name}{suffix}"), local, Some(elements.clone()));
                Ok::<_, TrainError>([part("")?, part(".exp_avg")?, part(".exp_avg_sq")?])
            })?;
        }
        let state = source.state();
        self.optimizer.set_steps(state.optimizer_steps);
        if let Some(zero) = &mut self.zero {
            zero.set_steps(state.optimizer_steps);
        }
        self.iteration = state.iteration;
        self.consumed_samples = state.consumed_samples;
        tch::manual_seed(state.rng_seed as i64);
        Ok(())
    }
}
