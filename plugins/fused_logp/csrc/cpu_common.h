// Helpers shared by fused_logp.cpp and linear_logp.cpp (both on the LibTorch stable ABI) and their CUDA files: templates
// over the tensor type and plain C++, so that they need no tensor header of their own. fused_logp.cpp also words its
// CUDA path's temperature error with fail_bad_token_temperature.
#pragma once

#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace fused_logp_cpu {

// c10::isFloatingType: the types a gradient (or linear_logp's bias) may come in.
inline bool is_floating(torch::headeronly::ScalarType t) {
  using torch::headeronly::ScalarType;
  switch (t) {
    case ScalarType::Double: case ScalarType::Float: case ScalarType::Half: case ScalarType::BFloat16:
    case ScalarType::Float8_e5m2: case ScalarType::Float8_e4m3fn: case ScalarType::Float8_e5m2fnuz:
    case ScalarType::Float8_e4m3fnuz: case ScalarType::Float8_e8m0fnu: case ScalarType::Float4_e2m1fn_x2:
      return true;
    default:
      return false;
  }
}

// labels: contiguous int64 or int32 (the callers' argument checks).
template <typename Tensor>
int64_t label_at(const Tensor& labels, int64_t i) {
  return labels.scalar_type() == torch::headeronly::ScalarType::Long
             ? labels.template const_data_ptr<int64_t>()[i]
             : static_cast<int64_t>(labels.template const_data_ptr<int32_t>()[i]);
}

// The message's parts streamed as TORCH_CHECK would (this header includes no torch check macro).
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());  // RuntimeError in Python, as TORCH_CHECK's c10::Error
}

[[noreturn]] inline void fail_bad_token_temperature(const char* op, int64_t position, float value) {
  fail(op, ": token_temperature[", position, "] = ", value, " must be finite and > 0 (the temperature of token ",
       position, ")");
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

// The logit transforms (both ops, CPU and CUDA): z = softcap * tanh(logit_scale * x / softcap) / T, or
// logit_scale * x / T without a softcap. Both must be positive normal float32 values: the CUDA kernels take them as
// float32, and a scale <= 0 would flip (or erase) the softmax's order, which no model does (Cohere's logit_scale and
// Granite's 1 / logits_scaling are positive).
inline void check_logit_transform(const char* op, const std::optional<double>& softcap, double logit_scale) {
  constexpr double kMin = std::numeric_limits<float>::min(), kMax = std::numeric_limits<float>::max();
  if (!(logit_scale >= kMin && logit_scale <= kMax))
    fail(op, ": logit_scale must be finite and > 0 (a normal float32, in [", kMin, ", ", kMax, "]), got ", logit_scale);
  if (softcap.has_value() && !(*softcap >= kMin && *softcap <= kMax))
    fail(op, ": softcap must be None or finite and > 0 (a normal float32, in [", kMin, ", ", kMax, "]), got ",
         *softcap);
  // The CUDA kernels form x * k (k = logit_scale / softcap) as a float pair whose low part multiplies a logit clamped
  // to +-1e30: k must be a normal float32 and that product finite.
  constexpr double kMaxSlope = 1e15;
  if (softcap.has_value() && !(logit_scale / *softcap >= kMin && logit_scale / *softcap <= kMaxSlope))
    fail(op, ": logit_scale / softcap must be in [", kMin, ", ", kMaxSlope, "], got ", logit_scale, " / ", *softcap,
         " = ", logit_scale / *softcap);
}

// The transform's weight w: z = v(x) * w / T with v(x) = tanh(x * logit_scale / softcap) (softcap) or x (none). The
// kernels fold w into the temperature (T / w), so that a logit_scale alone costs nothing per element.
inline double logit_weight(const std::optional<double>& softcap, double logit_scale) {
  return softcap.has_value() ? *softcap : logit_scale;
}

// The CUDA kernels take the effective temperature T / w (w: logit_weight) as one float32 (linear op) or form
// log2(e) w / T as a float pair (logits op): it must stay a normal float32 (checked on every device and both ops, so
// that CPU and CUDA accept the same calls).
inline void check_effective_temperature(const char* op, double temperature, const std::optional<double>& softcap,
                                        double logit_scale) {
  constexpr double kMin = std::numeric_limits<float>::min(), kMax = std::numeric_limits<float>::max();
  const double t = temperature / logit_weight(softcap, logit_scale);
  if (!(t >= kMin && t <= kMax))
    fail(op, ": temperature / ", softcap.has_value() ? "softcap" : "logit_scale", " = ", t,
         " must be a normal float32, in [", kMin, ", ", kMax, "] (the kernels' effective temperature; temperature = ",
         temperature, ")");
}

// g(x) = softcap * tanh(logit_scale * x / softcap), or logit_scale * x; and dg/dx. In double (the CPU paths).
struct LogitTransform {
  double scale = 1.0, cap = 0.0;  // cap 0: no softcap
  LogitTransform(const std::optional<double>& softcap, double logit_scale)
      : scale(logit_scale), cap(softcap.value_or(0.0)) {}
  double value(double x) const { return cap != 0.0 ? cap * std::tanh(x * scale / cap) : x * scale; }
  // 1 / cosh^2 rather than 1 - tanh^2: exact to a few ulps also where tanh saturates (cosh overflows to inf: 0).
  double slope(double x) const {
    if (cap == 0.0) return scale;
    const double ch = std::cosh(x * scale / cap);
    return scale / (ch * ch);
  }
};

}  // namespace fused_logp_cpu
