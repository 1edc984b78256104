// libtorch's fused AdamW kernel (`torch.optim.AdamW(fused=True)`), which tch does not
// bind: one call updates a list of fp32 tensors on one device, reading each element,
// its gradient and its two moments once.
//
// A tch `Tensor` holds an `at::Tensor*` (torch-sys's `C_tensor`); the lists arrive as
// arrays of those pointers. Errors (a list of mixed devices or dtypes, an unsupported
// device) come back as a message the caller frees with `synerfuse_free_error`.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw.h>
#include <synerfuse_shim.h>

#include <cstdlib>
#include <vector>

using synerfuse::list;

extern "C" {

// Updates `n` parameters in place: decoupled decay by `lr * weight_decay`, then the
// bias-corrected Adam step of step number `*step` (a float tensor on their device,
// incremented by the caller, as torch's optimizer does). Returns null, or an error.
char *synerfuse_fused_adamw(at::Tensor *const *params, at::Tensor *const *grads,
                            at::Tensor *const *exp_avgs, at::Tensor *const *exp_avg_sqs,
                            const at::Tensor *step, size_t n, double lr, double beta1,
                            double beta2, double weight_decay, double eps) {
  return synerfuse::guarded([&] {
    std::vector<at::Tensor> steps(n, *step);
    at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n),
                      list(exp_avg_sqs, n), {}, steps, lr, beta1, beta2, weight_decay,
                      eps, /*amsgrad=*/false, /*maximize=*/false);
  });
}

void synerfuse_free_error(char *error) { std::free(error); }

}  // extern "C"
