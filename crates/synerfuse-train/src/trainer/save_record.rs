//! The saves a trainer keeps track of: the one a background thread is writing, and the
//! record of each finished one until it is logged. Fields of the trainer and read by the
//! log ([`super::report`]), apart from the saving itself ([`super::save`]).

use crate::TrainError;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// A save being written by a background thread.
pub(super) struct PendingSave {
    pub(super) iteration: u64,
    pub(super) staging: PathBuf,
    pub(super) started: Instant,
    /// Seconds the training loop waited while it was started.
    pub(super) blocked_s: f64,
    pub(super) handle: std::thread::JoinHandle<(Result<(), TrainError>, Instant)>,
    /// The iterations whose steps started while it was still being written.
    pub(super) steps_during_write: Vec<u64>,
}

/// A finished save, as the JSON log records it (`save`).
#[derive(Debug, Clone, Serialize)]
pub struct SaveRecord {
    /// The iteration saved.
    pub iteration: u64,
    /// Whether it was written in the background (`--async-save`).
    pub async_save: bool,
    /// Milliseconds the training loop stopped for it when it started (the whole write
    /// when not in the background).
    pub blocked_ms: f64,
    /// Milliseconds the training loop later waited for it to finish (at the next save or
    /// the end of the run).
    pub waited_ms: f64,
    /// Milliseconds from its start until its checkpoint was complete.
    pub write_ms: f64,
    /// The iterations whose steps started while it was being written.
    pub steps_during_write: Vec<u64>,
}
