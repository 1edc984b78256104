//! Saving and restoring a rank's state by global name and element range: every rank
//! writes exactly what it holds (see [`crate::checkpoint`]) and reads back only what it
//! keeps, whatever plan wrote the checkpoint.

use super::save_record::{PendingSave, SaveRecord};
use super::state::Trainer;
use crate::checkpoint::region::{Region, Slice};
use crate::checkpoint::shard::{self, PieceToWrite};
use crate::checkpoint::{self, CheckpointProblem, CheckpointState, StateSource};
use crate::grads::EMBEDDING;
use crate::TrainError;
use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;
use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::Stage;
use synerfuse_plan::Precision;

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
    /// Every piece's data copied into host memory of its own (pinned when it comes from
    /// a GPU), so training may change the originals while a background thread writes.
    fn copy_to_host(&mut self) {
        for piece in self.model.iter_mut().chain(self.optimizer.iter_mut()) {
            let host = Tensor::empty([piece.data.numel() as i64], (Kind::Float, Device::Cpu));
            let mut host = match piece.data.device() {
                Device::Cuda(_) => host.pin_memory(piece.data.device()),
                _ => host,
            };
            tch::no_grad(|| host.copy_(&piece.data.reshape([-1])));
            piece.data = host;
        }
    }

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

/// Test hook: `SYNERFUSE_TEST_SAVE_DELAY_MS=N` makes every rank's write of a checkpoint
/// take N ms longer (a slow file system), so tests can see a background write overlap
/// training and a stop signal arrive during one.
fn test_delay() {
    let delay = std::env::var("SYNERFUSE_TEST_SAVE_DELAY_MS").ok();
    if let Some(ms) = delay.and_then(|d| d.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// A background save: this rank's files and fragment, then on rank 0, once every
/// rank's fragment is in, the manifest and the rename (no collective off the main
/// thread: the fragments on the shared file system say who is done).
fn write_and_commit(
    save: &Path,
    staging: &Path,
    rank: usize,
    ranks: usize,
    pieces: &RankPieces,
    state: &CheckpointState,
) -> Result<(), TrainError> {
    test_delay();
    // A panic (libtorch's, say) is a failure like an error: rank 0 must stop waiting.
    let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        checkpoint::write_rank(staging, rank, &pieces.model, &pieces.optimizer)
    }))
    .unwrap_or_else(|_| {
        let panicked = CheckpointProblem::WriterPanicked;
        Err(checkpoint::problem_at(staging, panicked))
    });
    if let Err(e) = written {
        // Best effort: rank 0 stops waiting for this rank's fragment.
        let _ = std::fs::write(staging.join(shard::failure_file(rank)), e.to_string());
        return Err(e);
    }
    if rank == 0 {
        checkpoint::wait_for_fragments(staging, ranks, crate::comm::watchdog::timeout())?;
        checkpoint::commit(save, state, ranks)?;
    }
    Ok(())
}

impl<'w> Trainer<'w> {
    /// Writes a checkpoint of the current iteration (collective): every rank writes its
    /// own pieces in parallel, rank 0 then merges their fragments into the manifest and
    /// renames the directory into place. Under `--async-save` the pieces are copied to
    /// host memory here and written by a background thread while training goes on (the
    /// returned directory appears when it is done; [`Self::finish_saves`] waits for it).
    /// A save still in flight is finished first.
    pub fn save(&mut self) -> Result<PathBuf, TrainError> {
        let save = (self.config.checkpoint.save.clone()).ok_or(TrainError::NoSaveDir)?;
        self.settle_parameters()?;
        self.finish_saves()?;
        let started = Instant::now();
        let rank = self.world.rank();
        let staging = checkpoint::staging_dir(&save, self.iteration);
        let prepared = match rank {
            0 => checkpoint::prepare(&save, self.iteration).map(drop),
            _ => Ok(()),
        };
        self.agree(prepared, &staging)?;
        let dir = save.join(checkpoint::iteration_dir(self.iteration));
        let mut pieces = self.checkpoint_pieces();
        let (state, ranks) = (self.checkpoint_state(), self.world.size());
        if self.config.checkpoint.async_save {
            pieces.copy_to_host();
            let writing = staging.clone();
            let spawned = std::thread::Builder::new()
                .name("checkpoint-writer".into())
                .spawn(move || {
                    let result = write_and_commit(&save, &writing, rank, ranks, &pieces, &state);
                    (result, Instant::now())
                })
                .map_err(|e| checkpoint::problem_at(&staging, e));
            // Every rank has a save in flight, or none has.
            let handle = self.agree(spawned, &staging)?;
            self.pending_save = Some(PendingSave {
                iteration: self.iteration,
                staging,
                started,
                blocked_s: started.elapsed().as_secs_f64(),
                handle,
                steps_during_write: Vec::new(),
            });
            return Ok(dir);
        }
        test_delay();
        let watch = crate::memory::PeakWatch::start();
        let written = checkpoint::write_rank(&staging, rank, &pieces.model, &pieces.optimizer);
        drop(pieces);
        self.agree(written, &staging)?;
        let committed = match rank {
            0 => checkpoint::commit(&save, &state, ranks).map(drop),
            _ => Ok(()),
        };
        self.agree(committed, &staging)?;
        if let Some((resident, peak)) = watch.map(crate::memory::PeakWatch::finish) {
            tracing::info!(
                "checkpoint save: resident {resident} B at its start, peak {peak} B while saving (+{} B)",
                peak - resident
            );
        }
        let elapsed = started.elapsed().as_secs_f64();
        self.log_saved(&dir, None, elapsed);
        self.finished_saves.push(SaveRecord {
            iteration: self.iteration,
            async_save: false,
            blocked_ms: elapsed * 1e3,
            waited_ms: 0.0,
            write_ms: elapsed * 1e3,
            steps_during_write: Vec::new(),
        });
        Ok(dir)
    }

    /// Waits for a background save in flight, if any, and checks with every rank that
    /// it was written and committed (collective when one is in flight, on every rank
    /// alike).
    pub fn finish_saves(&mut self) -> Result<(), TrainError> {
        let Some(pending) = self.pending_save.take() else {
            return Ok(());
        };
        let waiting = Instant::now();
        // Bounded beyond the writer's own bounded waits (rank 0's for the others'
        // fragments ends in an error naming the missing rank): twice the timeout.
        let writer = crate::comm::watchdog::waiting_on(
            "waiting for the background checkpoint writer",
            &pending.staging.display().to_string(),
            crate::comm::watchdog::timeout(),
        );
        let joined = pending.handle.join();
        drop(writer);
        let (result, ended) = joined.unwrap_or_else(|_| {
            (
                Err(checkpoint::problem_at(
                    &pending.staging,
                    CheckpointProblem::WriterPanicked,
                )),
                Instant::now(),
            )
        });
        self.agree(result, &pending.staging)?;
        let write_s = ended.duration_since(pending.started).as_secs_f64();
        let waited_s = waiting.elapsed().as_secs_f64();
        let save = self.config.checkpoint.save.clone().unwrap_or_default();
        let dir = save.join(checkpoint::iteration_dir(pending.iteration));
        self.log_saved(&dir, Some(pending.iteration), write_s);
        self.finished_saves.push(SaveRecord {
            iteration: pending.iteration,
            async_save: true,
            blocked_ms: pending.blocked_s * 1e3,
            waited_ms: waited_s * 1e3,
            write_ms: write_s * 1e3,
            steps_during_write: pending.steps_during_write,
        });
        Ok(())
    }

    /// Notes that a step starts: one a background save is still writing during counts.
    pub(super) fn note_step_start(&mut self) {
        let next = self.iteration + 1;
        if let Some(pending) = &mut self.pending_save {
            if !pending.handle.is_finished() {
                pending.steps_during_write.push(next);
            }
        }
    }

    fn log_saved(&self, dir: &Path, background: Option<u64>, write_s: f64) {
        if self.world.rank() != 0 {
            return;
        }
        match background {
            Some(iteration) => tracing::info!(
                "saved checkpoint {} (iteration {iteration}, written in the background in {write_s:.3} s)",
                dir.display()
            ),
            None => tracing::info!(
                "saved checkpoint {} (iteration {}, in {write_s:.3} s)",
                dir.display(),
                self.iteration
            ),
        }
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

    /// What this rank writes: replica 0 (its first context-parallel member; of an
    /// expert, the lowest replica holding it) its slice of every parameter of the
    /// replicated
    /// optimizer (a tensor every rank of its tensor-parallel group holds whole from rank
    /// 0 only, the last stage's copy of a tied embedding not at all), and every holder
    /// its own shard of the distributed optimizer's masters and moments.
    pub(super) fn checkpoint_pieces(&self) -> RankPieces {
        let stage = &self.chunks[0];
        let skip_tied = self.holds_tied_copy();
        let mut pieces = RankPieces::default();
        if self.context_first() {
            for (name, value, m, v) in self.optimizer.state() {
                let counted = self.counts_once(name) && stage.holds_unique(name);
                if (skip_tied && name == EMBEDDING) || !counted {
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
            bf16: self.config.compute.precision == Precision::Bf16,
            precision: Some(self.config.compute.precision),
            loss_scale: self.scaler.scales().then(|| self.scaler.state()),
            skipped_samples: self.skipped_samples,
        }
    }

    /// Takes this rank's parameters, moments and the run's position from `source`, by
    /// global name and element range (whatever plan wrote them): its tensor-parallel
    /// slice of each parameter, and of the moments only the elements it keeps.
    pub(super) fn restore(&mut self, source: &dyn StateSource) -> Result<(), TrainError> {
        let sharded: BTreeSet<String> = (self.zero.as_ref()).map(|z| z.names()).unwrap_or_default();
        let stage = &self.chunks[0];
        // `suffix`: "" for the value, ".exp_avg" and ".exp_avg_sq" for the moments, which
        // share the parameter's region.
        let read = |name: &str, suffix: &str, local: &[i64], elements: Option<Range<i64>>| {
            let (mut region, whole) = held_region(stage, name, local);
            if let Some(elements) = elements {
                region = region.narrowed(elements);
            }
            source.read(&format!("{name}{suffix}"), &whole, &region)
        };
        let variables: Vec<(String, Tensor)> = (self.chunks.iter())
            .flat_map(|c| c.var_store().variables())
            .collect();
        let mut restored = BTreeSet::new();
        for (name, mut var) in variables {
            let local = var.size();
            let whole = |suffix| {
                Ok::<_, TrainError>(read(&name, suffix, &local, None)?.view(local.as_slice()))
            };
            let value = whole("")?;
            if sharded.contains(&name) {
                // The parameter itself here; its master and moments in the shards below.
                tch::no_grad(|| var.copy_(&value.to_kind(var.kind()).to_device(var.device())));
                continue;
            }
            if !restored.insert(name.clone()) {
                continue;
            }
            let (m, v) = (whole(".exp_avg")?, whole(".exp_avg_sq")?);
            self.optimizer
                .load_param(&name, &value, Some(&m), Some(&v))
                .map_err(|e| checkpoint::problem_at(source.origin(), e))?;
        }
        if let Some(zero) = &mut self.zero {
            zero.load_pieces(|name, local, elements| {
                let part = |suffix| read(name, suffix, local, Some(elements.clone()));
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
        self.skipped_samples = state.skipped_samples;
        if let Some(scale) = state.loss_scale {
            self.scaler.restore(scale);
        }
        tch::manual_seed(state.rng_seed as i64);
        Ok(())
    }
}
