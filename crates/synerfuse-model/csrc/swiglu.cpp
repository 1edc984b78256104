// SwiGLU, `silu(gate) · up`, as one autograd node that keeps only its inputs for the
// backward. Autograd over `silu(gate) * up` also keeps SiLU's output (one more
// `[tokens, ffn]` tensor per layer: about 180 MB per layer of a 1.1B model's micro-batch
// of 16k tokens in bf16); the backward here recomputes it instead. Over a joined gate/up
// projection (one GEMM's output, `[..., 2·ffn]`) the backward writes both halves of the
// input's gradient in place, where autograd concatenates them: four elementwise passes
// either way. The same libtorch kernels on every device (SiLU, its backward, products),
// so values and gradients are the formula's.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <synerfuse_shim.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The gradients of `silu(gate) · up` from `grad`, written into `grad_gate` and
// `grad_up` (either undefined where not wanted).
void swiglu_grads(const at::Tensor &grad, const at::Tensor &gate, const at::Tensor &up,
                  at::Tensor grad_gate, at::Tensor grad_up) {
  at::Tensor scratch = at::silu(gate);
  if (grad_up.defined()) {
    at::mul_out(grad_up, grad, scratch);
  }
  if (grad_gate.defined()) {
    at::mul_out(scratch, grad, up);
    at::silu_backward_out(grad_gate, scratch, gate);
  }
}

// Gate and up apart (an expert's two projections).
struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(AutogradContext *ctx, const at::Tensor &gate, const at::Tensor &up) {
    TORCH_CHECK(gate.sizes() == up.sizes(), "SwiGLU's gate ", gate.sizes(), " and up ",
                up.sizes(), " differ in shape");
    ctx->save_for_backward({gate, up});
    return at::silu(gate) * up;
  }

  static variable_list backward(AutogradContext *ctx, variable_list grad_outputs) {
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &grad = grad_outputs[0];
    variable_list grads(2);
    if (ctx->needs_input_grad(0)) {
      grads[0] = at::empty_like(saved[0]);
    }
    if (ctx->needs_input_grad(1)) {
      grads[1] = at::empty_like(saved[1]);
    }
    swiglu_grads(grad, saved[0], saved[1], grads[0], grads[1]);
    return grads;
  }
};

// The gate and up halves of one `[..., 2·ffn]` projection.
struct JoinedSwiGlu : public torch::autograd::Function<JoinedSwiGlu> {
  static at::Tensor forward(AutogradContext *ctx, const at::Tensor &gate_up) {
    TORCH_CHECK(gate_up.dim() > 0 && gate_up.size(-1) % 2 == 0, "SwiGLU's joined gate/up ",
                gate_up.sizes(), " has no two equal halves");
    ctx->save_for_backward({gate_up});
    int64_t ffn = gate_up.size(-1) / 2;
    return at::silu(gate_up.narrow(-1, 0, ffn)) * gate_up.narrow(-1, ffn, ffn);
  }

  static variable_list backward(AutogradContext *ctx, variable_list grad_outputs) {
    at::Tensor gate_up = ctx->get_saved_variables()[0];
    int64_t ffn = gate_up.size(-1) / 2;
    at::Tensor grad = at::empty_like(gate_up, at::MemoryFormat::Contiguous);
    swiglu_grads(grad_outputs[0], gate_up.narrow(-1, 0, ffn), gate_up.narrow(-1, ffn, ffn),
                 grad.narrow(-1, 0, ffn), grad.narrow(-1, ffn, ffn));
    return {grad};
  }
};

}  // namespace

extern "C" {

// `silu(gate) · up` into `*out` (a new tensor the caller owns), differentiable in both,
// keeping only `gate` and `up` for the backward. Returns null, or an error.
char *synerfuse_swiglu(const at::Tensor *gate, const at::Tensor *up, at::Tensor **out) {
  return synerfuse::guarded([&] { *out = new at::Tensor(SwiGlu::apply(*gate, *up)); });
}

// `silu(gate) · up` of the halves of `gate_up` `[..., 2·ffn]` into `*out`, keeping only
// `gate_up` for the backward, which writes its gradient's halves in place. Returns
// null, or an error.
char *synerfuse_joined_swiglu(const at::Tensor *gate_up, at::Tensor **out) {
  return synerfuse::guarded([&] { *out = new at::Tensor(JoinedSwiGlu::apply(*gate_up)); });
}

}  // extern "C"
