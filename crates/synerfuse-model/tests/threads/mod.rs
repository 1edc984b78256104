//! Collectives between threads, one per rank, over shared memory: what the model's
//! parallel tests run their groups on.

use std::sync::{Arc, Barrier, Mutex};
use synerfuse_model::tch::Tensor;
use synerfuse_model::tp::{CollectiveError, TpCollectives};

/// One member of a group of threads: every member puts its tensor in a slot, all read all.
pub struct ThreadGroup {
    rank: usize,
    slots: Arc<Mutex<Vec<Option<Tensor>>>>,
    barrier: Arc<Barrier>,
}

/// The members of a group of `n` threads, in rank order.
pub fn thread_groups(n: usize) -> Vec<ThreadGroup> {
    let slots = Arc::new(Mutex::new((0..n).map(|_| None).collect()));
    let barrier = Arc::new(Barrier::new(n));
    (0..n)
        .map(|rank| ThreadGroup {
            rank,
            slots: slots.clone(),
            barrier: barrier.clone(),
        })
        .collect()
}

impl TpCollectives for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.slots.lock().unwrap().len()
    }

    fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        let sum = self.all_reduce_sum(tensor)?;
        let n = sum.size()[0] / self.size() as i64;
        Ok(sum.narrow(0, self.rank as i64 * n, n))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        self.slots.lock().unwrap()[self.rank] = Some(tensor.detach().copy());
        self.barrier.wait();
        let all = {
            let slots = self.slots.lock().unwrap();
            let tensors: Vec<&Tensor> = slots.iter().map(|s| s.as_ref().unwrap()).collect();
            Tensor::stack(&tensors, 0)
        };
        self.barrier.wait();
        Ok(all)
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError> {
        Ok(self
            .all_gather(tensor)?
            .sum_dim_intlist(0, false, tensor.kind()))
    }

    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError> {
        synerfuse_model::tp::all_to_all_by_gather(self, parts)
    }
}
