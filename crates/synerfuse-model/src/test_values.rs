//! Inputs for the autograd nodes' tests against their formulas.

use tch::{Device, Kind, Tensor};

/// fp32 values of `shape` within ±`scale` that depend on `seed` only (not on libtorch's
/// generator, which the tests' threads share).
pub(crate) fn seeded(shape: &[i64], seed: f64, scale: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    let values = Tensor::arange(n, (Kind::Float, Device::Cpu)) * (0.37 * seed + 0.1);
    (values.sin() * scale).view(shape)
}

/// `seeded` as a leaf that keeps its gradient.
pub(crate) fn leaf(shape: &[i64], seed: f64, scale: f64) -> Tensor {
    seeded(shape, seed, scale).set_requires_grad(true)
}
