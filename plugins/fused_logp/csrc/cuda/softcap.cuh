// The softcap logit transform on the device, shared by the logits op (fused_logp.cu) and the lm_head op
// (linear_logp.cuh) so that both form z = tanh(x * k) * softcap / T with the same instructions, forward and backward.
// k = logit_scale / softcap, passed as an unevaluated float pair (k_hi + k_lo): a single rounded float would scale every
// logit by the same relative error, a systematic shift of the temperature.
#pragma once

#include <cuda_runtime.h>

namespace fused_logp_softcap {

// x k as fma(x, k_hi, x' k_lo): exact to ~2^-48 for finite x; x' = x clamped to +-1e30 in the low part only, so that
// +-inf gives +-inf (inf * k_lo alone would be NaN for k_lo = 0) while a NaN logit stays NaN (through x k_hi).
__device__ __forceinline__ float scaled(float x, float k_hi, float k_lo) {
  return fmaf(x, k_hi, fminf(fmaxf(x, -1e30f), 1e30f) * k_lo);
}

// tanh(x k): +-inf logits give +-1, NaN stays NaN.
__device__ __forceinline__ float tanh_of(float x, float k_hi, float k_lo) { return tanhf(scaled(x, k_hi, k_lo)); }

// d tanh(x k) / dx / k = 1 / cosh^2(x k) = 4 E / (1 + E)^2 with E = exp(-2 |x k|): no cancellation where tanh
// saturates (the fp32 PyTorch path's 1 - t * t is off by 3e-4 relative at |x k| = 5), 0 once E underflows; emulated
// in float32 against float64 <= 1.8e-7 relative below |x k| = 0.5 (ex2.approx's own ~2 ulps on top here), 4.2e-7
// below 2, 1.7e-6 up to 12. Enough for 16-bit gradients (the lm_head op's dZ).
__device__ __forceinline__ float sech2_of(float x, float k_hi, float k_lo) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-2.8853900817779268f * fabsf(scaled(x, k_hi, k_lo))));
  const float r = 1.f / (1.f + e);
  return 4.f * e * r * r;
}

// The same for fp32 gradients (the logits op), t = tanh_of(x): fma(-t, t, 1) while |t| < 3/4 (1 - t^2 rounded once:
// 5e-8 relative below |x k| = 0.5, 1.3e-7 below 0.97), sech2_of where tanh saturates.
__device__ __forceinline__ float slope_of(float x, float t, float k_hi, float k_lo) {
  const float saturated = sech2_of(x, k_hi, k_lo);
  return fabsf(t) < 0.75f ? fmaf(-t, t, 1.f) : saturated;
}

// The float pair of k (host side).
inline void split(double k, float& k_hi, float& k_lo) {
  k_hi = static_cast<float>(k);
  k_lo = static_cast<float>(k - static_cast<double>(k_hi));
}

}  // namespace fused_logp_softcap
