// One projection through weights kept as separate parameters (q, k and v; gate and up)
// whose rows lie end to end in one buffer: the GEMM reads that buffer as one weight, and
// the backward hands each parameter its rows of the one weight gradient. Nothing is
// concatenated per call and no joined copy is kept for the backward, which
// `linear(x, cat(weights))` would do (about 1.25 GB on a 1.1B model in bf16), as
// Megatron's `linear_qkv` and `linear_fc1` avoid by storing the weights fused.
//
// A tch `Tensor` holds an `at::Tensor*` (torch-sys's `C_tensor`). Errors come back as a
// message the caller frees with `synerfuse_model_free_error` (`shim.cpp`).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <synerfuse_shim.h>

#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether `parts` (2-D, same columns) are rows of one storage laid end to end.
bool adjacent(const std::vector<at::Tensor> &parts) {
  const at::Tensor &first = parts[0];
  if (first.dim() != 2) {
    return false;
  }
  int64_t next = first.storage_offset();
  for (const at::Tensor &p : parts) {
    bool same = p.dim() == 2 && p.is_contiguous() && p.size(1) == first.size(1) &&
                p.scalar_type() == first.scalar_type() && p.device() == first.device() &&
                p.storage().is_alias_of(first.storage()) && p.storage_offset() == next;
    if (!same) {
      return false;
    }
    next += p.numel();
  }
  return true;
}

// The adjacent `parts` as one `[rows, columns]` tensor over their storage (no copy).
at::Tensor joined(const std::vector<at::Tensor> &parts) {
  int64_t rows = 0;
  for (const at::Tensor &p : parts) {
    rows += p.size(0);
  }
  const at::Tensor &first = parts[0];
  int64_t columns = first.size(1);
  return first.detach().as_strided({rows, columns}, {columns, 1}, first.storage_offset());
}

struct JoinedLinear : public torch::autograd::Function<JoinedLinear> {
  // The inputs, in order: `x`, `bias` (an input only where present: the autograd
  // node's edges count only tensors) and each part.
  static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x,
                            const std::optional<at::Tensor> &bias, at::TensorList parts) {
    variable_list saved{x};
    saved.insert(saved.end(), parts.begin(), parts.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["bias"] = bias.has_value();
    return at::linear(x, joined(parts.vec()), bias);
  }

  static variable_list backward(AutogradContext *ctx, variable_list grad_outputs) {
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0];
    std::vector<at::Tensor> parts(saved.begin() + 1, saved.end());
    at::Tensor weight = joined(parts);
    const at::Tensor &g = grad_outputs[0];
    int64_t rows = weight.size(0);
    int64_t columns = weight.size(1);
    at::Tensor g2 = g.reshape({-1, rows});
    // One gradient per argument; `needs_input_grad` counts edges (tensors only).
    variable_list grads(2 + parts.size());
    bool has_bias = ctx->saved_data["bias"].toBool();
    if (ctx->needs_input_grad(0)) {
      grads[0] = at::matmul(g, weight);
    }
    if (has_bias && ctx->needs_input_grad(1)) {
      grads[1] = g2.sum(0);
    }
    size_t first_part_edge = has_bias ? 2 : 1;
    at::Tensor grad_weight = g2.t().mm(x.reshape({-1, columns}));
    int64_t row = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      int64_t n = parts[i].size(0);
      if (ctx->needs_input_grad(first_part_edge + i)) {
        grads[2 + i] = grad_weight.narrow(0, row, n);
      }
      row += n;
    }
    return grads;
  }
};

}  // namespace

extern "C" {

// `x·[w_0; …; w_{n-1}]ᵀ + [b_0; …; b_{n-1}]` into `*out` (a new tensor the caller owns):
// without a copy of the weights where they are adjacent rows of one buffer, else
// through their concatenation (the same value). `biases` is null or `n` tensors.
// Returns null, or an error.
char *synerfuse_joined_linear(const at::Tensor *x, at::Tensor *const *weights,
                              at::Tensor *const *biases, size_t n, at::Tensor **out) {
  return synerfuse::guarded([&] {
    std::vector<at::Tensor> parts = synerfuse::list(weights, n);
    std::optional<at::Tensor> bias;
    if (biases != nullptr) {
      bias = at::cat(synerfuse::list(biases, n), 0);
    }
    at::Tensor y = adjacent(parts) ? JoinedLinear::apply(*x, bias, at::TensorList(parts))
                                   : at::linear(*x, at::cat(parts, 0), bias);
    *out = new at::Tensor(std::move(y));
  });
}

// Whether the weights are adjacent rows of one buffer (what `synerfuse_joined_linear`
// reads without a copy).
bool synerfuse_weights_adjacent(at::Tensor *const *weights, size_t n) {
  return n > 0 && adjacent(synerfuse::list(weights, n));
}

}  // extern "C"
