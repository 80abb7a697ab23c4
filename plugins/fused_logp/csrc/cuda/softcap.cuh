// The lm_head op's softcap transform on the device (linear_logp.cuh): v = tanh(x * k), k = logit_scale / softcap, and
// its derivative, from one exp2 and one reciprocal (the logits op's, exact to ~0.25 ulp on average, is accurate_tanh
// in fused_logp.cu). The op runs the same instructions in its forward and backward, so both see the same z: the
// arithmetic is spelled out with __fmul_rn / __fsub_rn, since the compiler may contract a * b + c into an FMA in one
// kernel and not in the other (V = 1 then had p != 1 in the backward and a nonzero gradient, measured on the H200).
#pragma once

#include <cuda_runtime.h>

namespace fused_logp_softcap {

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
