// Eight bf16 in one 16-byte access, to and from fp32: the vector unit of flash_moe's elementwise kernels.
#pragma once
#include <cuda_bf16.h>

namespace flash_moe {

constexpr int kVec = 8;  // bf16 per 16-byte access

__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const auto* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(b[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 v;
  auto* b = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

}  // namespace flash_moe
