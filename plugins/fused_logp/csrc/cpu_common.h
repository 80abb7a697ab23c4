// CPU helpers shared by fused_logp.cpp (LibTorch stable ABI) and linear_logp.cpp (exact ABI): templates over the
// tensor type, so that neither build sees the other's headers. fused_logp.cpp also words its CUDA path's temperature
// error with fail_bad_token_temperature.
#pragma once

#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>

namespace fused_logp_cpu {

// labels: contiguous int64 or int32 (the callers' argument checks).
template <typename Tensor>
int64_t label_at(const Tensor& labels, int64_t i) {
  return labels.scalar_type() == torch::headeronly::ScalarType::Long
             ? labels.template const_data_ptr<int64_t>()[i]
             : static_cast<int64_t>(labels.template const_data_ptr<int32_t>()[i]);
}

[[noreturn]] inline void fail_bad_token_temperature(const char* op, int64_t position, float value) {
  std::ostringstream message;
  message << op << ": token_temperature[" << position << "] = " << value << " must be finite and > 0 (the temperature "
          << "of token " << position << ")";
  throw std::runtime_error(message.str());  // RuntimeError in Python, as TORCH_CHECK's c10::Error
}

// Every token that is not ignored needs a temperature that is finite and > 0 (an ignored token's is never read).
// Serial, so that the first offending position is the one named.
template <typename Tensor>
void check_token_temperatures(const char* op, const Tensor& labels, const float* token_temperature,
                              int64_t ignore_index) {
  for (int64_t i = 0; i < labels.size(0); ++i) {
    const float t = token_temperature[i];
    if (label_at(labels, i) != ignore_index && !(std::isfinite(t) && t > 0.f)) fail_bad_token_temperature(op, i, t);
  }
}

}  // namespace fused_logp_cpu
