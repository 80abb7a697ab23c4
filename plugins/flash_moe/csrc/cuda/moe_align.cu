// flash_moe::moe_align on CUDA: a stable counting sort of the routed slots by local expert, in three kernels.
//   1. count:   one CTA per chunk of ALIGN_CHUNK slots, a shared-memory histogram -> counts[chunk][expert].
//   2. scan:    one CTA, a thread per expert: per-chunk exclusive prefixes (in place), the padded size of each expert
//               (ceil(count / (block_m * bpc)) * block_m * bpc), an exclusive scan over experts of that size rounded
//               up to whole spans of block_m * block_align and num_tokens_post_padded; then every thread labels
//               blocks with their expert id.
//   3. scatter: one warp per chunk walks its slots in order, 32 at a time; lanes with the same expert get their rank
//               from __match_any_sync, so the order within an expert is the slot order (stable).
// sorted_token_ids and expert_ids are pre-filled with -1 (padding and the unused tail). Ids outside the local range
// (including -1) are skipped; unlike the CPU implementation, ids >= num_experts or < -1 (int64 ids outside int32
// included) are skipped silently (no host sync).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../flash_moe.h"

#ifndef FLASH_MOE_ALIGN_CHUNK
#error "FLASH_MOE_ALIGN_CHUNK must come from kernel.toml ([flash_moe.constants])"
#endif

namespace flash_moe {
namespace {

constexpr int kChunk = FLASH_MOE_ALIGN_CHUNK;
constexpr int kScanThreads = 1024;
static_assert(kMaxExperts <= kScanThreads, "the scan kernel runs one thread per local expert");

__device__ __forceinline__ int local_expert(int id, int expert_start, int local) {
  const int loc = id - expert_start;
  return (id >= 0 && loc >= 0 && loc < local) ? loc : -1;
}

__global__ void align_count_kernel(const int* __restrict__ ids, int slots, int expert_start, int local,
                                   int* __restrict__ counts) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < local; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int begin = blockIdx.x * kChunk, end = min(begin + kChunk, slots);
  for (int s = begin + threadIdx.x; s < end; s += blockDim.x) {
    const int loc = local_expert(ids[s], expert_start, local);
    if (loc >= 0) atomicAdd(&hist[loc], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < local; e += blockDim.x) counts[static_cast<int64_t>(blockIdx.x) * local + e] = hist[e];
}

__global__ void __launch_bounds__(kScanThreads)
    align_scan_kernel(int* __restrict__ counts, int chunks, int local, int block_m, int pad, int span,
                      int* __restrict__ base, int* __restrict__ expert_ids, int* __restrict__ ntpp) {
  __shared__ int warp_sums[kScanThreads / 32];
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  int total = 0;
  if (e < local) {
    for (int c = 0; c < chunks; ++c) {  // per-chunk counts -> exclusive prefixes within the expert
      int* p = counts + static_cast<int64_t>(c) * local + e;
      const int n = *p;
      *p = total;
      total += n;
    }
  }
  const int padded = (total + pad - 1) / pad * pad;
  const int spanned = (padded + span - 1) / span * span;  // its blocks past `padded` stay empty (expert id -1)
  int incl = spanned;  // inclusive scan over experts: warps, then warp sums
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += v;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int start = incl - spanned + (warp > 0 ? warp_sums[warp - 1] : 0);
  // Each expert's blocks [first, end) (non-decreasing: experts >= local get empty ranges at the end). The blocks are
  // labelled by all threads, each finding its blocks' expert by binary search: a thread per expert writing its own
  // blocks took 0.147 ms at block_m = 1 (Qwen3-30B-A3B's ~1024 slots per expert, H100, session 21).
  __shared__ int first_block[kScanThreads], end_block[kScanThreads];
  first_block[e] = start / block_m;
  end_block[e] = (start + padded) / block_m;
  if (e < local) base[e] = start;
  if (e == kScanThreads - 1) *ntpp = start + spanned;  // experts >= local contribute 0
  __syncthreads();
  const int blocks = warp_sums[kScanThreads / 32 - 1] / block_m;
  for (int b = e; b < blocks; b += kScanThreads) {
    // the last expert whose first block is at most b (an expert without slots has an empty range at the next one's
    // first block, so it is never picked over that one)
    int lo = 0, hi = local - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first_block[mid] <= b) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    if (b < end_block[lo]) expert_ids[b] = lo;  // else an empty block of the alignment span: stays -1
  }
}

__global__ void align_scatter_kernel(const int* __restrict__ ids, int slots, int expert_start, int local,
                                     const int* __restrict__ counts, const int* __restrict__ base,
                                     int* __restrict__ sorted) {
  extern __shared__ int cursor[];
  const int lane = threadIdx.x;
  for (int e = lane; e < local; e += 32) cursor[e] = base[e] + counts[static_cast<int64_t>(blockIdx.x) * local + e];
  __syncwarp();
  const int begin = blockIdx.x * kChunk, end = min(begin + kChunk, slots);
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int s0 = begin; s0 < end; s0 += 32) {
    const int s = s0 + lane;
    const int loc = s < end ? local_expert(ids[s], expert_start, local) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, loc);
    int pos = 0;
    if (loc >= 0) pos = cursor[loc] + __popc(peers & lt_mask);
    __syncwarp();
    if (loc >= 0) {
      if ((peers & lt_mask) == 0) cursor[loc] += __popc(peers);  // the group's lowest lane advances the cursor
      sorted[pos] = s;
    }
    __syncwarp();
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_align_cuda(const at::Tensor& topk_ids, int64_t num_experts,
                                                              int64_t block_m, int64_t bpc, int64_t expert_start,
                                                              int64_t num_local_experts, int64_t block_align) {
  const AlignPlan p = check_align_args(topk_ids, num_experts, block_m, bpc, expert_start, num_local_experts,
                                       block_align);
  TORCH_CHECK(topk_ids.is_cuda(), "moe_align (CUDA): topk_ids must be a CUDA tensor, got ", topk_ids.device());
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  // int64 ids outside int32 are out of range like ids >= num_experts, so skipped as those are (no host sync)
  const auto ids = (topk_ids.scalar_type() == at::kInt
                        ? topk_ids
                        : at::where(topk_ids.ge(-1).logical_and_(topk_ids.le(kInt32Max)), topk_ids, -1).to(at::kInt))
                       .contiguous();
  const auto opts = ids.options().dtype(at::kInt);
  auto sorted = at::full({p.max_padded}, -1, opts);
  auto eids = at::full({p.max_blocks}, -1, opts);
  auto ntpp = at::empty({1}, opts);
  const int slots = static_cast<int>(p.slots), local = static_cast<int>(p.local);
  const int chunks = (slots + kChunk - 1) / kChunk;
  auto counts = at::empty({std::max(chunks, 1), local}, opts);
  auto base = at::empty({local}, opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const size_t hist_bytes = sizeof(int) * local;
  if (chunks > 0) {
    align_count_kernel<<<chunks, 256, hist_bytes, stream>>>(ids.const_data_ptr<int>(), slots,
                                                            static_cast<int>(expert_start), local,
                                                            counts.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  align_scan_kernel<<<1, kScanThreads, 0, stream>>>(counts.mutable_data_ptr<int>(), chunks, local,
                                                    static_cast<int>(block_m), static_cast<int>(p.pad),
                                                    static_cast<int>(p.span), base.mutable_data_ptr<int>(),
                                                    eids.mutable_data_ptr<int>(), ntpp.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (chunks > 0) {
    align_scatter_kernel<<<chunks, 32, hist_bytes, stream>>>(ids.const_data_ptr<int>(), slots,
                                                             static_cast<int>(expert_start), local,
                                                             counts.const_data_ptr<int>(), base.const_data_ptr<int>(),
                                                             sorted.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {sorted, eids, ntpp};
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY_IMPL(flash_moe, CUDA, m) { m.impl("moe_align", &flash_moe::moe_align_cuda); }
