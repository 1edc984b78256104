// RoPE, `x·cos + rotate_half(x)·sin` with `rotate_half(x) = [-x₂, x₁]` (x's halves along
// the head dimension), as one autograd node of two passes each way: a product, then
// each half's `addcmul` in place. Autograd over the formula runs five kernels forward
// (product, negation, concatenation, product, sum) and as many back, over copies of the
// queries and keys. Nothing but the tables is kept for the backward.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <synerfuse_shim.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// `x·cos + [-x₂·sin₁, x₁·sin₂]` (subscripts: halves of the head dimension), or with
// `transpose` its transpose `x·cos + [x₂·sin₂, -x₁·sin₁]` (the backward: the rotation
// by -θ where the halves' tables agree, as transformers' do).
at::Tensor rotate(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                  bool transpose) {
  int64_t half = x.size(-1) / 2;
  at::Tensor sin1 = sin.narrow(-1, 0, half);
  at::Tensor sin2 = sin.narrow(-1, half, half);
  at::Tensor out = x * cos;
  out.narrow(-1, 0, half)
      .addcmul_(x.narrow(-1, half, half), transpose ? sin2 : sin1, transpose ? 1 : -1);
  out.narrow(-1, half, half)
      .addcmul_(x.narrow(-1, 0, half), transpose ? sin1 : sin2, transpose ? -1 : 1);
  return out;
}

struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &cos,
                            const at::Tensor &sin) {
    TORCH_CHECK(x.size(-1) % 2 == 0 && cos.size(-1) == x.size(-1) &&
                    sin.size(-1) == x.size(-1),
                "RoPE of ", x.sizes(), " by tables ", cos.sizes(), " and ", sin.sizes(),
                ": an even head dimension, the tables' last");
    TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(),
                "RoPE's tables are constants, not differentiated");
    ctx->save_for_backward({cos, sin});
    return rotate(x, cos, sin, false);
  }

  static variable_list backward(AutogradContext *ctx, variable_list grad_outputs) {
    variable_list saved = ctx->get_saved_variables();
    return {rotate(grad_outputs[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// RoPE of `x` `[..., d]` by the tables `cos` and `sin` (broadcast to `x`, `d` last)
// into `*out` (a new tensor the caller owns), differentiable in `x`. Returns null, or
// an error.
char *synerfuse_rope(const at::Tensor *x, const at::Tensor *cos, const at::Tensor *sin,
                     at::Tensor **out) {
  return synerfuse::guarded([&] { *out = new at::Tensor(Rope::apply(*x, *cos, *sin)); });
}

}  // extern "C"
