// sm_90a building blocks of the flash_moe kernels (bf16 and mxfp8): the framework's shared ones
// (prime_kernels/sm90.cuh: mbarriers, cp.async, proxy fences, wgmma groups, the 128B-swizzle descriptor, verified on
// the H200 by linear_logp) plus what only these kernels use.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <prime_kernels/sm90.cuh>
#include <prime_kernels/tma.h>

#include <algorithm>
#include <cstdint>

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
// `cta` < blocks * n_tiles (blockIdx.x, a cluster peer's, or a tile number of a persistent CTA).
__device__ __forceinline__ void raster(int cta, int n_tiles, int blocks, int& block, int& n_tile) {
  const int per_group = RASTER_BLOCKS * n_tiles;
  const int group = cta / per_group;
  const int first = group * RASTER_BLOCKS;
  const int in_group = min(RASTER_BLOCKS, blocks - first);
  const int r = cta - group * per_group;
  block = first + r % in_group;
  n_tile = r / in_group;
}

// One launch of a GEMM kernel over blocks x n_tiles CTAs (the raster above decodes blockIdx.x), in clusters of
// kCluster consecutive CTAs (the grid rounded up to whole clusters: CTAs past blocks x n_tiles leave at once); each
// kernel (each mode) gets its shared-memory size once. kPersistent: a grid of min(blocks x n_tiles, SMs) CTAs instead
// (p.ctas), each walking the tiles blockIdx.x, + p.ctas, ... itself: for kernels of one resident CTA per SM.
template <auto kKernel, int kThreads, int kSmemBytes, int kCluster = 1, bool kPersistent = false, class Params>
void launch_rastered(Params p, int n_tiles, int64_t blocks, cudaStream_t stream) {
  static_assert(!kPersistent || kCluster == 1, "persistent launches run without clusters");
  static const bool configured = [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)configured;
  const int64_t ctas = blocks * n_tiles;
  TORCH_CHECK(ctas + kCluster <= 0x7FFFFFFF, "flash_moe: ", blocks, " blocks x ", n_tiles,
              " column tiles exceed one launch");
  p.n_tiles = n_tiles;
  p.blocks = static_cast<int>(blocks);
  int64_t grid = (ctas + kCluster - 1) / kCluster * kCluster;
  if constexpr (kPersistent) {
    int device = 0, sms = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    grid = std::min<int64_t>(ctas, sms);
    p.ctas = static_cast<int>(grid);
  }
  C10_CUDA_CHECK(prime_kernels::sm90::launch_in_clusters(kKernel, static_cast<unsigned>(grid), kThreads, kSmemBytes,
                                                         stream, kCluster, p));
}

// The kernels are sm_90a code: a clear error on any other device instead of a launch failure.
inline void check_sm90(const char* op, const at::Tensor& x) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, x.get_device()));
  TORCH_CHECK(major == 9 && minor == 0, op, " (CUDA): the kernels are built for sm_90a; device ", x.get_device(),
              " is sm_", major, minor);
}

// The TMA map over an (E, rows, K) expert weight view with unit K stride and whole rows between experts (bf16 views
// of w, or the e4m3 bytes of a contiguous weight): map rows (E - 1) * (stride(0) / stride(1)) + rows (exactly the
// memory the view spans), boxes of box_rows x box_k. A tile's rows past `rows` read the next expert's rows or zeros
// past the end: columns the epilogue never stores.
inline void expert_weight_map(const char* op, const char* name, CUtensorMap* map, const at::Tensor& w, int64_t rows,
                              int64_t K, CUtensorMapDataType dtype, int box_rows, int box_k) {
  const int64_t per_expert = w.stride(0) / w.stride(1);
  const int rc = prime_kernels::make_tmap_2d(map, w.const_data_ptr(), dtype, (w.size(0) - 1) * per_expert + rows, K,
                                             w.stride(1), box_rows, box_k);
  TORCH_CHECK(rc == 0, op, " (CUDA): cuTensorMapEncodeTiled failed for ", name, " (CUresult ", rc, ")");
}

// A stage is full once each of the 128 producer threads has arrived (its A copies landed) and thread 0's expect_tx
// arrival has seen the B tile's TMA bytes: both GEMM kernels (bf16 and mxfp8) fill their stages this way.
constexpr int kFullArrivals = 128 + 1;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// sorted_token_ids[row], or padding (-1) for an entry outside [0, p.num_slots): such an entry would gather past x and
// write past the output, and checking the values on the host would cost a sync.
template <class Params>
__device__ __forceinline__ int routed_slot(const Params& p, int row) {
  const int entry = p.sorted[row];
  return entry < p.num_slots ? entry : -1;
}

// Routing row r of aligned block `block` into shared memory: slot_of[r] = routed_slot(p, block * BM + r) and
// a_row[r] = the element offset of A's row r: x's row slot / top_k for the gate/up GEMMs, the intermediate's row
// block * BM + r for the down GEMMs; -1 (zero fill) for padding in both. The gate/up kernels leave the intermediate's
// rows of all-padding warpgroups unwritten: read as A, their garbage scales broke the mxfp8 down kernel's
// tile-wide shared-exponent flag at random, so routed rows took the per-32 rounding in some runs and not in others.
template <int BM, bool kGatherX, class Params>
__device__ __forceinline__ void routing_row(const Params& p, int block, int r, int64_t* a_row, int* slot_of) {
  const int row = block * BM + r;
  const int slot = routed_slot(p, row);
  slot_of[r] = slot;
  if (slot < 0) {
    a_row[r] = -1;
  } else if constexpr (kGatherX) {
    a_row[r] = static_cast<int64_t>(slot / p.top_k) * p.lda;
  } else {
    a_row[r] = static_cast<int64_t>(row) * p.lda;
  }
}

// The stage ring's mbarriers (one thread): "full" completes on kFullArrivals arrivals, "empty" on empty_arrivals.
// The caller makes them visible with fence_mbarrier_init() and a CTA barrier before any other thread uses them.
template <int STAGES>
__device__ __forceinline__ void init_ring(uint32_t bars, uint32_t empty_arrivals) {
  for (int s = 0; s < STAGES; ++s) {
    mbar_init(bars + 8u * s, kFullArrivals);
    mbar_init(bars + 8u * (STAGES + s), empty_arrivals);
  }
}
// The ring runs on across tiles. The producer counts its k steps k (modulo 2 STAGES): stage k % STAGES, free again
// once the consumers released its previous turn.
template <int STAGES>
__device__ __forceinline__ int acquire_stage(uint32_t bars, uint32_t k) {
  const int stage = k % STAGES;
  mbar_wait(bars + 8u * (STAGES + stage), ((k / STAGES) & 1) ^ 1);
  return stage;
}
// A consumer's place in the same ring: the stage it waits on next and that turn's full-barrier phase parity.
template <int STAGES>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
};
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The down GEMMs' epilogue for accumulator row h (0 or 1) of a consumer thread holding COLS columns of slot `slot`
// (register 4 j + 2 h + e is column 8 j + 2 quad + e, from column n0): kAtomic adds topk_weight * y into the fp32
// [M, dim] buffer with float2 reductions, else y is stored as bf16 to the slot's row.
template <int COLS, bool kAtomic, class Params>
__device__ __forceinline__ void store_down_row(const Params& p, const float* acc, int h, int quad, int slot, int n0) {
  if constexpr (kAtomic) {
    const float w = __ldg(p.topk_weights + slot);
    float* dst = p.acc32 + static_cast<int64_t>(slot / p.top_k) * p.ld_out + n0;
#pragma unroll
    for (int j = 0; j < COLS / 8; ++j) {
      const int col = 8 * j + 2 * quad;
      if (n0 + col < p.n_total)
        atomicAdd(reinterpret_cast<float2*>(dst + col), make_float2(w * acc[4 * j + 2 * h], w * acc[4 * j + 2 * h + 1]));
    }
  } else {
    __nv_bfloat16* dst = p.yslots + static_cast<int64_t>(slot) * p.ld_out + n0;
#pragma unroll
    for (int j = 0; j < COLS / 8; ++j) {
      const int col = 8 * j + 2 * quad;
      if (n0 + col < p.n_total)
        *reinterpret_cast<__nv_bfloat162*>(dst + col) = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}
#endif

}  // namespace sm90
}  // namespace flash_moe
