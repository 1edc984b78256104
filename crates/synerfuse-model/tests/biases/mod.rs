//! Non-zero biases for the parallel tests: `init_by_name` zeroes them (as Megatron
//! does), and a zero bias added on the wrong ranks, or twice, changes nothing.

use synerfuse_model::tch::{self, Device, Kind, Tensor};
use synerfuse_model::Stage;

/// Redraws every bias of `stage` from a generator seeded by its name, whole, and copies
/// in this shard's slice: every split of the model gets the same biases. Uses libtorch's
/// global generator (call it where `init_by_name` is called).
pub fn randomize_biases(stage: &Stage) {
    for (name, mut var) in stage.var_store().variables() {
        if !name.ends_with(".bias") {
            continue;
        }
        let seed = (name.bytes()).fold(17i64, |h, b| h.wrapping_mul(31).wrapping_add(i64::from(b)));
        tch::manual_seed(seed);
        let shape = stage.whole_shape(&name, &var.size());
        let whole = Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.1;
        let value = stage.local_slice(&name, &whole);
        tch::no_grad(|| var.copy_(&value));
    }
}
