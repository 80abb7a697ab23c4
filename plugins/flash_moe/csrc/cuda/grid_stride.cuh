// Launch size of the grid-stride elementwise kernels (routing flags, compact rows, zero fills, the combine): enough
// blocks to cover `items`, at most 16 per SM; the kernels' loops take whatever remains, so any grid is correct.
#pragma once

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>

namespace flash_moe {

inline unsigned grid_stride_blocks(int64_t items, int threads) {
  const int64_t cap = int64_t{16} * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::clamp<int64_t>((items + threads - 1) / threads, 1, cap));
}

}  // namespace flash_moe
