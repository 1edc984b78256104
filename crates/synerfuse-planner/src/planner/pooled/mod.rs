//! Plans whose replicas are pipelines of their own shape (the general plan): the devices
//! pooled by class (group and speed), each pool cut into replicas of one depth with one
//! layer split and micro-batch size, the batch split over every replica of every pool.
//! A pool of small devices can pipeline deep while a pool of large ones keeps whole
//! replicas, which no grid (every replica the same stages) expresses.

mod balance;
mod options;
mod polish;
mod search;

pub(super) use balance::{
    balance, closed_form_step_s, fits_all, group_paces, most_micro_batches, per_member,
};
pub(super) use options::{pools, whole_groups, PoolOption};
pub(super) use polish::polish;
pub use search::plan_pooled;
pub(super) use search::plan_pooled_noting_memory;

#[cfg(test)]
mod tests;
