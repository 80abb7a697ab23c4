// The softcap logit transform on the device: v = tanh(x * k), k = logit_scale / softcap, and its derivative, for the
// logits op (fused_logp.cu: accurate_tanh, k as an unevaluated float pair k_hi + k_lo, since a single rounded float
// would scale every logit by the same relative error, a systematic shift of its double-exact temperature) and the
// lm_head op (linear_logp.cuh: a cheaper tanh from one exp2 and one reciprocal). Each op runs the same instructions in
// its forward and backward, so both see the same z: the lm_head op's arithmetic is spelled out with __fmul_rn /
// __fsub_rn, since the compiler may contract a * b + c into an FMA in one kernel and not in the other (V = 1 then had
// p != 1 in the backward and a nonzero gradient, measured on the H200).
#pragma once

#include <cuda_runtime.h>

namespace fused_logp_softcap {

// x k as fma(x, k_hi, x' k_lo): exact to ~2^-48 for finite x; x' = x clamped to +-1e30 in the low part only, so that
// +-inf gives +-inf (inf * k_lo alone would be NaN for k_lo = 0) while a NaN logit stays NaN (through x k_hi).
__device__ __forceinline__ float scaled(float x, float k_hi, float k_lo) {
  return fmaf(x, k_hi, fminf(fmaxf(x, -1e30f), 1e30f) * k_lo);
}

// The logits op's d tanh(x k) / dx / k = 1 - t^2 = 1 / cosh^2(x k), t = its tanh(x k), for fp32 gradients too:
// fma(-t, t, 1) while |t| < 3/4 (1 - t^2 rounded once: 5e-8 relative below |x k| = 0.5, 1.3e-7 below 0.97), else
// 4 E / (1 + E)^2 with E = exp(-2 |x k|), where 1 - t^2 cancels (tanh saturates: the fp32 PyTorch path's 1 - t * t
// is off by 3e-4 relative at |x k| = 5) and this stays within 4.2e-7 below |x k| = 2 and 1.7e-6 up to 12 (emulated in
// float32 against float64); 0 once E underflows.
__device__ __forceinline__ float slope_of(float x, float t, float k_hi, float k_lo) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-2.8853900817779268f * fabsf(scaled(x, k_hi, k_lo))));
  const float r = 1.f / (1.f + e);
  const float saturated = 4.f * e * r * r;
  return fabsf(t) < 0.75f ? fmaf(-t, t, 1.f) : saturated;
}

// The lm_head op's tanh(x k) (and, when asked, 1 / cosh^2(x k)) from one ex2.approx and one rcp.approx: with
// E = exp(-2 |x k|), tanh = (1 - E) / (1 + E) and 1 / cosh^2 = 4 E / (1 + E)^2; below |x k| = 1/16, where 1 - E
// cancels, the odd series to x^5 (truncation < 4e-9 relative). k is one float here: the op's temperature
// constant c is one float too, so the pair would not make the logits more exact (and +-inf x k needs no clamp then).
// Emulated in float32 against float64 (exact exp2 and reciprocal; the .approx instructions add ~2 ulps): tanh within
// 5.3e-7 relative just above 1/16 and 4e-7 from 1/8 on, 1 / cosh^2 within 1.7e-6 up to |x k| = 12; CUDA's tanhf is
// within 2 ulps but costs ~8 more instructions per logit, with the tensor cores idle during the epilogue. The op's
// 16-bit inputs carry far more (the PyTorch path rounds every logit to bf16). Forward and backward run the same
// instructions, so both see the same z.
__device__ __forceinline__ float fast_tanh_of(float x, float k, float* sech2 = nullptr) {
  const float u = __fmul_rn(x, k), a = fabsf(u);
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(-2.8853900817779268f, a)));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(1.f, e)));
  const float u2 = __fmul_rn(u, u);
  const float series = __fmul_rn(a, fmaf(u2, fmaf(u2, 0.13333333333333333f, -0.3333333333333333f), 1.f));
  if (sech2) *sech2 = 4.f * e * r * r;
  // NaN: e, r and the result NaN; +-inf: +-1
  return copysignf(a < 0.0625f ? series : __fmul_rn(__fsub_rn(1.f, e), r), u);
}

}  // namespace fused_logp_softcap
