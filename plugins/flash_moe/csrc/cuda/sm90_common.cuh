// sm_90a building blocks of the flash_moe kernels (bf16 and mxfp8): the framework's shared ones
// (prime_kernels/sm90.cuh: mbarriers, cp.async, proxy fences, wgmma groups, the 128B-swizzle descriptor, verified on
// the H200 by linear_logp) plus what only these kernels use.
#pragma once

#include <prime_kernels/sm90.cuh>

namespace flash_moe {
namespace sm90 {

using namespace prime_kernels::sm90;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }
#endif

}  // namespace sm90
}  // namespace flash_moe
