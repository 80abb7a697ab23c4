// sm_90a building blocks of the flash_moe kernels (bf16 and mxfp8): the framework's shared ones
// (prime_kernels/sm90.cuh: mbarriers, cp.async, proxy fences, wgmma groups, the 128B-swizzle descriptor, verified on
// the H200 by linear_logp) plus what only these kernels use.
#pragma once

#include <c10/util/Exception.h>
#include <prime_kernels/sm90.cuh>

namespace flash_moe {
namespace sm90 {

using namespace prime_kernels::sm90;

#ifndef FLASH_MOE_RASTER_BLOCKS
#error "FLASH_MOE_RASTER_BLOCKS must come from kernel.toml ([flash_moe.constants])"
#endif
constexpr int RASTER_BLOCKS = FLASH_MOE_RASTER_BLOCKS;

// CTA blockIdx.x -> (aligned block, column tile) over a 1-D grid of blocks x n_tiles: groups of RASTER_BLOCKS
// consecutive blocks, blocks fastest within a group, so the CTAs resident at one time share their A rows and their
// experts' weight columns in L2 (with the column tile fastest, a large expert's weights stream from HBM once per block).
__device__ __forceinline__ void raster(int n_tiles, int blocks, int& block, int& n_tile) {
  const int per_group = RASTER_BLOCKS * n_tiles;
  const int group = static_cast<int>(blockIdx.x) / per_group;
  const int first = group * RASTER_BLOCKS;
  const int in_group = min(RASTER_BLOCKS, blocks - first);
  const int r = static_cast<int>(blockIdx.x) - group * per_group;
  block = first + r % in_group;
  n_tile = r / in_group;
}

// One launch of blocks x n_tiles CTAs (the raster above decodes blockIdx.x).
inline dim3 raster_grid(int n_tiles, int64_t blocks) {
  const int64_t ctas = blocks * n_tiles;
  TORCH_CHECK(ctas <= 0x7FFFFFFF, "flash_moe: ", blocks, " blocks x ", n_tiles, " column tiles exceed one launch");
  return dim3(static_cast<unsigned>(ctas));
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }
#endif

}  // namespace sm90
}  // namespace flash_moe
