// What every synerfuse C++ shim shares: a libtorch call's failure handed to Rust as a
// message (malloc'd, freed by the shim's own `*_free_error`), never as an exception
// crossing the C boundary. Put on the include path by `compile_against_libtorch`.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

namespace synerfuse {

inline char *copy_message(const char *message) {
  char *out = static_cast<char *>(std::malloc(std::strlen(message) + 1));
  if (out != nullptr) {
    std::strcpy(out, message);
  }
  return out;
}

// The `n` tensors an array of tch tensors (`at::Tensor*`, torch-sys's `C_tensor`) holds.
inline std::vector<at::Tensor> list(at::Tensor *const *tensors, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(*tensors[i]);
  }
  return out;
}

// Runs `body`: null, or the message of what it threw.
template <typename Body>
char *guarded(Body &&body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error &e) {
    return copy_message(e.what_without_backtrace());
  } catch (const std::exception &e) {
    return copy_message(e.what());
  } catch (...) {
    return copy_message("unknown C++ exception");
  }
}

}  // namespace synerfuse
