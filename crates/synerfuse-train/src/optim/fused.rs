//! libtorch's fused AdamW kernel (`torch.optim.AdamW(fused=True)`) through the C++ shim
//! in `csrc/fused_adamw.cpp`: tch 0.24 binds neither `_fused_adamw_` nor the
//! `_foreach_` operators. One call updates many fp32 tensors of one device, reading each
//! element, its gradient and moments once; the per-tensor update it replaced ran about a
//! dozen elementwise kernels per tensor (measured on this project's CPU bench: see the
//! README's optimizer figures).

use std::ffi::{c_char, CStr};

use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

use super::config::AdamWConfig;

extern "C" {
    fn synerfuse_fused_adamw(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        step: *const C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> *mut c_char;
    fn synerfuse_free_error(error: *mut c_char);
}

/// What libtorch's fused AdamW refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("fused AdamW on {device:?} over {tensors} tensors: {message}")]
pub struct FusedAdamError {
    /// The device of the refused group.
    pub device: Device,
    /// How many tensors it held.
    pub tensors: usize,
    /// libtorch's message.
    pub message: String,
}

/// One tensor's update: the fp32 value, its fp32 gradient and its two moments, and
/// whether it decays.
pub(crate) struct AdamTensor<'a> {
    pub value: &'a Tensor,
    pub grad: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    pub decay: bool,
}

/// Updates every tensor in place at step `step` (already counted) and learning rate `lr`:
/// torch's AdamW (decoupled decay of the tensors that decay, then the bias-corrected
/// step), one kernel call per device and decay group.
pub(crate) fn adamw_step(
    config: &AdamWConfig,
    tensors: &[AdamTensor<'_>],
    step: u64,
    lr: f64,
) -> Result<(), FusedAdamError> {
    let mut groups: Vec<(Device, bool, Vec<&AdamTensor<'_>>)> = Vec::new();
    for t in tensors {
        let key = (t.value.device(), t.decay && config.weight_decay != 0.0);
        match groups.iter_mut().find(|(d, w, _)| (*d, *w) == key) {
            Some((_, _, members)) => members.push(t),
            None => groups.push((key.0, key.1, vec![t])),
        }
    }
    for (device, decay, members) in groups {
        let weight_decay = if decay { config.weight_decay } else { 0.0 };
        let count = Tensor::from_slice(&[step as f32]).to_device(device);
        fused_call(config, &members, &count, lr, weight_decay)?;
    }
    Ok(())
}

fn fused_call(
    c: &AdamWConfig,
    members: &[&AdamTensor<'_>],
    step: &Tensor,
    lr: f64,
    weight_decay: f64,
) -> Result<(), FusedAdamError> {
    let pointers = |pick: fn(&AdamTensor<'_>) -> *const C_tensor| -> Vec<*mut C_tensor> {
        members.iter().map(|t| pick(t) as *mut C_tensor).collect()
    };
    let values = pointers(|t| t.value.as_ptr());
    let grads = pointers(|t| t.grad.as_ptr());
    let exp_avgs = pointers(|t| t.exp_avg.as_ptr());
    let exp_avg_sqs = pointers(|t| t.exp_avg_sq.as_ptr());
    debug_assert!(members.iter().all(|t| t.value.kind() == Kind::Float));
    // SAFETY: every pointer is a live tensor borrowed for the call's duration; the
    // kernel writes values and moments in place, as their owners expect of a step.
    let error = unsafe {
        synerfuse_fused_adamw(
            values.as_ptr(),
            grads.as_ptr(),
            exp_avgs.as_ptr(),
            exp_avg_sqs.as_ptr(),
            step.as_ptr(),
            members.len(),
            lr,
            c.beta1,
            c.beta2,
            weight_decay,
            c.eps,
        )
    };
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null result is a NUL-terminated message the shim allocated.
    let message = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: the shim allocated it with malloc; freed once, after it was copied.
    unsafe { synerfuse_free_error(error) };
    Err(FusedAdamError {
        device: step.device(),
        tensors: members.len(),
        message,
    })
}
