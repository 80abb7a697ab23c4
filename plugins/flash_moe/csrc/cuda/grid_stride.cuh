// Launch sizes from the current device's SM count (cached by ATen): the persistent GEMM grids (sm90_common.cuh's
// launch_rastered) and the grid-stride elementwise kernels (routing flags, compact rows, zero fills, the combine).
#pragma once

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>

namespace flash_moe {

inline int64_t current_device_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Enough blocks to cover `items`, at most 16 per SM; the kernels' loops take whatever remains, so any grid is correct.
inline unsigned grid_stride_blocks(int64_t items, int threads) {
  const int64_t cap = 16 * current_device_sms();
  return static_cast<unsigned>(std::clamp<int64_t>((items + threads - 1) / threads, 1, cap));
}

}  // namespace flash_moe
