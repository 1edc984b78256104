//! Megatron's `--overlap-param-gather`: the distributed optimizer's all-gather of the
//! updated parameters, started bucket by bucket after the optimizer step and waited for
//! only when the next forward reaches the first model piece that reads them (each
//! bucket before the lowest piece it holds). The gathers of a reduction start from its
//! first model piece's bucket, the order in which the forward needs them; every member
//! starts the same gathers in the same order (the plan's global order of reductions), so
//! the collectives match on every communicator.

use crate::comm::{CommError, PendingReduction};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use synerfuse_model::tch::Tensor;

/// The gathers of one bucket of a reduction, in flight.
pub(crate) struct BucketGather {
    /// The stage chunk whose parameters it writes.
    pub(crate) chunk: usize,
    /// The lowest model piece among its parameters: the forward waits for it there.
    pub(crate) min_piece: usize,
    /// One gather per parameter, straight into its storage.
    pub(crate) gathers: Vec<PendingReduction>,
    /// (gathered copy, parameter) for a parameter whose elements are not contiguous,
    /// written back once gathered.
    pub(crate) write_back: Vec<(Tensor, Tensor)>,
}

impl BucketGather {
    /// Waits for every gather (all of them, even after an error: they write into the
    /// parameters), then writes the copies back.
    fn wait(self) -> Result<(), CommError> {
        let mut first_error = None;
        for pending in self.gathers {
            if let Err(e) = pending.wait() {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        for (flat, param) in self.write_back {
            let shape = param.size();
            synerfuse_model::tch::no_grad(|| {
                param.shallow_clone().copy_(&flat.view(shape.as_slice()))
            });
        }
        Ok(())
    }
}

/// The parameter gathers still in flight on this rank, in the order they started, and
/// how long the rank has waited for them.
#[derive(Default)]
pub struct ParamGathers {
    in_flight: RefCell<VecDeque<BucketGather>>,
    waited: Cell<Duration>,
}

impl ParamGathers {
    pub(crate) fn push(&self, bucket: BucketGather) {
        self.in_flight.borrow_mut().push_back(bucket);
    }

    /// Buckets whose gathers are in flight.
    pub fn buckets(&self) -> usize {
        self.in_flight.borrow().len()
    }

    /// Whether no gather is in flight.
    pub fn is_empty(&self) -> bool {
        self.in_flight.borrow().is_empty()
    }

    /// Whether some gather of `chunk` must end before its model piece `piece` runs.
    pub fn holds(&self, chunk: usize, piece: usize) -> bool {
        (self.in_flight.borrow().iter()).any(|b| b.chunk == chunk && b.min_piece <= piece)
    }

    /// Waits for the gathers of `chunk` whose buckets hold a parameter of a model piece
    /// up to `piece`: what its forward reads up to and including that piece.
    pub fn wait_for(&self, chunk: usize, piece: usize) -> Result<(), CommError> {
        let due = {
            let mut in_flight = self.in_flight.borrow_mut();
            let (due, rest): (Vec<_>, Vec<_>) = (in_flight.drain(..))
                .partition(|b: &BucketGather| b.chunk == chunk && b.min_piece <= piece);
            *in_flight = rest.into();
            due
        };
        self.wait(due)
    }

    /// Waits for every gather in flight (before anything but the next step's forward
    /// reads the parameters: evaluation, a checkpoint, a re-plan, the end of training).
    pub fn wait_all(&self) -> Result<(), CommError> {
        let due = self.in_flight.borrow_mut().drain(..).collect();
        self.wait(due)
    }

    /// Waits for every one of `due` (the first error is returned once all have ended),
    /// counting the time.
    fn wait(&self, due: Vec<BucketGather>) -> Result<(), CommError> {
        let started = Instant::now();
        let result = (due.into_iter())
            .map(BucketGather::wait)
            .fold(Ok(()), Result::and);
        self.waited.set(self.waited.get() + started.elapsed());
        result
    }

    /// Lets the gathers progress (MPI moves only inside MPI calls).
    pub fn progress(&self) {
        for bucket in self.in_flight.borrow_mut().iter_mut() {
            for pending in &mut bucket.gathers {
                pending.progress();
            }
        }
    }

    /// The time spent waiting since the last call.
    pub fn take_waited(&self) -> Duration {
        self.waited.replace(Duration::ZERO)
    }
}
