//! Calls into the model's C++ shim (`csrc/`, built against libtorch by `synerfuse-build`)
//! for what tch does not bind: custom autograd functions. Each returns a new tensor, or a
//! message for what libtorch refused, never an exception across the C boundary.

use std::ffi::{c_char, CStr};

use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    fn synerfuse_model_free_error(error: *mut c_char);
}

/// The tch tensors' `at::Tensor*` handles, for an array argument.
pub(crate) fn pointers(tensors: &[&Tensor]) -> Vec<*mut C_tensor> {
    tensors
        .iter()
        .map(|t| t.as_ptr() as *mut C_tensor)
        .collect()
}

/// The tensor `call` writes into its argument, owned by the caller.
///
/// Panics, as tch's own operators do, with `what` and libtorch's reason when the shim
/// returns an error: the shapes come from the configuration, checked when the stage is
/// built, so a refusal is a bug here, not bad input.
///
/// # Safety
/// `call` must return null after writing a tensor the shim allocated for the caller to
/// own, or a NUL-terminated message the shim allocated with `malloc`, writing nothing.
pub(crate) unsafe fn new_tensor(
    what: impl FnOnce() -> String,
    call: impl FnOnce(*mut *mut C_tensor) -> *mut c_char,
) -> Tensor {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let error = call(&mut out);
    if !error.is_null() {
        // SAFETY: a non-null result is a NUL-terminated message the shim allocated.
        let message = unsafe { CStr::from_ptr(error) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: the shim allocated it with malloc; freed once, after it was copied.
        unsafe { synerfuse_model_free_error(error) };
        panic!("{}: {message}", what());
    }
    // SAFETY: on success `out` is a tensor the shim allocated for us to own (the
    // caller's contract).
    unsafe { Tensor::from_ptr(out) }
}
