// How the CUDA kernels read an alignment (moe_align's sorted_token_ids, expert_ids, num_tokens_post_padded): one rule
// for the GEMM kernels' compact rows and the deterministic combine, so that every row one writes the other reads.
#pragma once

#include <cstdint>

namespace flash_moe {

// The slot of padded entry i, or -1: an entry of a live block (block * block_m < num_tokens_post_padded) whose expert
// id is in [0, num_experts), its value in [0, num_slots). Other entries (padding, out-of-range values, blocks skipped
// for their expert id or past the routed ones) route nothing.
__device__ __forceinline__ int routed_slot(const int* __restrict__ sorted, const int* __restrict__ expert_ids,
                                           int64_t live_rows, int64_t i, int block_m, int num_experts,
                                           int num_slots) {
  const int64_t block = i / block_m;
  if (block * block_m >= live_rows) return -1;
  const int expert = __ldg(expert_ids + block), slot = __ldg(sorted + i);
  return expert >= 0 && expert < num_experts && slot >= 0 && slot < num_slots ? slot : -1;
}

}  // namespace flash_moe
