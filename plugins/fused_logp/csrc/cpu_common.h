// CPU helpers shared by fused_logp.cpp and linear_logp.cpp; fused_logp.cpp also words its CUDA path's temperature
// error with fail_bad_token_temperature.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

namespace fused_logp_cpu {

// labels: contiguous int64 or int32 (the callers' argument checks).
inline int64_t label_at(const at::Tensor& labels, int64_t i) {
  return labels.scalar_type() == at::kLong ? labels.data_ptr<int64_t>()[i]
                                           : static_cast<int64_t>(labels.data_ptr<int32_t>()[i]);
}

[[noreturn]] inline void fail_bad_token_temperature(const char* op, int64_t position, float value) {
  TORCH_CHECK(false, op, ": token_temperature[", position, "] = ", value, " must be finite and > 0 (the temperature of "
              "token ", position, ")");
}

// Every token that is not ignored needs a temperature that is finite and > 0 (an ignored token's is never read).
// Serial, so that the first offending position is the one named.
inline void check_token_temperatures(const char* op, const at::Tensor& labels, const float* token_temperature,
                                     int64_t ignore_index) {
  for (int64_t i = 0; i < labels.size(0); ++i) {
    const float t = token_temperature[i];
    if (label_at(labels, i) != ignore_index && !(std::isfinite(t) && t > 0.f)) fail_bad_token_temperature(op, i, t);
  }
}

}  // namespace fused_logp_cpu
