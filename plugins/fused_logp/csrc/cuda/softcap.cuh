// The softcap logit transform on the device, shared by the logits op (fused_logp.cu) and the lm_head op
// (linear_logp.cuh) so that both form z = tanh(x * k) * softcap / T with the same instructions, forward and backward.
// k = logit_scale / softcap, passed as an unevaluated float pair (k_hi + k_lo): a single rounded float would scale every
// logit by the same relative error, a systematic shift of the temperature.
#pragma once

#include <cuda_runtime.h>

namespace fused_logp_softcap {

// x clamped to [-1e30, 1e30], NaN kept (fminf / fmaxf would turn a NaN logit into a bound: a silent finite result).
__device__ __forceinline__ float clamp_keep_nan(float x) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(-1e30f));
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(r), "f"(1e30f));
  return r;
}

// tanh(x * k); +-inf logits give +-1 (x clamped first: inf * k_lo would be NaN for k_lo = 0, or inf - inf), NaN stays
// NaN.
__device__ __forceinline__ float tanh_of(float x, float k_hi, float k_lo) {
  const float xc = clamp_keep_nan(x);
  return tanhf(fmaf(xc, k_hi, xc * k_lo));
}

// d tanh(x k) / dx / k = 1 - t^2 = 1 / cosh^2(x k), t = tanh_of(x): fma(-t, t, 1) while |t| < 3/4 (1 - t^2 rounded
// once, as exact as t), else 4 E / (1 + E)^2 with E = exp(-2 |x k|), where 1 - t^2 cancels (tanh saturates: the
// fp32 PyTorch path's 1 - t * t is off by 3e-4 relative at |x k| = 5) and this stays within a few ulps (emulated in
// float32 against float64: <= 4.2e-7 relative for |x k| < 2, 1.7e-6 up to 12); 0 once E underflows.
__device__ __forceinline__ float slope_of(float x, float t, float k_hi, float k_lo) {
  const float xc = clamp_keep_nan(x);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-2.8853900817779268f * fabsf(fmaf(xc, k_hi, xc * k_lo))));
  const float d = 1.f + e;
  const float saturated = __fdividef(4.f * e, d * d);  // d * d in [1, 4]: the fast division is within 2 ulps there
  return fabsf(t) < 0.75f ? fmaf(-t, t, 1.f) : saturated;
}

// The float pair of k (host side).
inline void split(double k, float& k_hi, float& k_lo) {
  k_hi = static_cast<float>(k);
  k_lo = static_cast<float>(k - static_cast<double>(k_hi));
}

}  // namespace fused_logp_softcap
