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

#include "grid_stride.cuh"

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

// raster() with groups that never mix experts: each window of RASTER_BLOCKS consecutive blocks splits into its runs of
// one expert id, blocks fastest within a run. With few blocks per expert (DeepSeek-V3: 2-3) a block's column tiles are
// then claimed 2-3 tiles apart instead of RASTER_BLOCKS, close enough in time for its A rows to still be in L2, and an
// expert's weight columns are never split between two groups (Nsight Compute, H100, session 22: the dH GEMM read 18.8
// GB from HBM where its weights, A rows and g | u are 8.2 GB; an L2 model of the claim order puts raster()'s at 17.3
// GB and this one's at 8.8; measured in session 23: 18.1 -> 13.5 GB). The host picks it per launch (fused_moe_sm90.cu,
// raster_runs). A bijection over [0, blocks x n_tiles) whatever expert_ids holds: run r of a window takes
// the tiles [first block of r, last block of r + 1) x n_tiles, and t / n_tiles names a block of the run holding t.
__device__ __forceinline__ void raster_by_expert(int cta, int n_tiles, int blocks, const int* expert_ids, int& block,
                                                 int& n_tile) {
  static_assert(RASTER_BLOCKS >= 1 && RASTER_BLOCKS <= 63,
                "RASTER_BLOCKS must be in [1, 63] (a window and its end bit in one 64-bit mask)");
  const int b = cta / n_tiles;
  const int first = b / RASTER_BLOCKS * RASTER_BLOCKS;
  const int in_window = min(RASTER_BLOCKS, blocks - first);
  const int expert = __ldg(expert_ids + b);
  uint64_t other = 1ull << in_window;  // bit j: block first + j is past the window or runs another expert id
#pragma unroll
  for (int j = 0; j < RASTER_BLOCKS; ++j) {
    if (j < in_window && __ldg(expert_ids + first + j) != expert) other |= 1ull << j;
  }
  const int local = b - first;
  const uint64_t below = other & ((1ull << local) - 1ull);
  const int start = below ? 64 - __clzll(static_cast<long long>(below)) : 0;
  const int end = local + __ffsll(static_cast<long long>(other >> local)) - 1;  // bit 0 (block b itself) is clear
  const int run = end - start;
  const int r = cta - (first + start) * n_tiles;
  block = first + start + r % run;
  n_tile = r / run;
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
    grid = std::min<int64_t>(ctas, current_device_sms());
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

// The N of the bf16 kernels' wgmma (m64n256k16), and the columns of one 128-byte swizzle row of bf16 (an MN-major
// atom of smem_desc_mn's layout, one TMA box wide).
constexpr int WGMMA_N = 256;
constexpr int MN_ATOM = 64;

// A tensor the kernels read by cp.async or TMA: on the GPU, 16-byte aligned.
inline void check_cuda_operand(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, " (CUDA): ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0, op, " (CUDA): ", name,
              " must be 16-byte aligned (cp.async, TMA), got data pointer ", t.const_data_ptr());
}

// Registers of the warp-specialised GEMM CTAs (one producer warpgroup and two consumer warpgroups: 384 threads). A CTA
// holds what it was launched with (384 x 168 of the 64 K register file) and setmaxnreg only moves registers within
// it: the consumers' increase must fit in what the producer gives back, or it waits forever. Producer 56: its per-tile
// set-up (routing rows, gathered row addresses) spilled at 48 (the mxfp8 gate/up kernel); consumers 224: a 64 x 256
// (bf16) or two 64 x 128 (mxfp8) fp32 accumulators and their operands.
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(128 * (kProducerRegs + 2 * kConsumerRegs) <= 384 * (65536 / 384 / 8 * 8),
              "setmaxnreg: the consumers' registers must come from the producer's");

// A stage is full once each of the 128 producer threads has arrived (its A copies landed) and thread 0's expect_tx
// arrival has seen the B tile's TMA bytes: both GEMM kernels (bf16 and mxfp8) fill their stages this way.
constexpr int kFullArrivals = 128 + 1;

// The expert activations of flash_moe.h (Activation), a compile-time choice of the kernels (host code picks one).
enum : int { kActSwiGLU = 0, kActGptOss = 1, kActRelu2 = 2 };

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void producer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
}
__device__ __forceinline__ void consumer_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
}
// A producer thread's end: it leaves once its last cp.async copies have landed.
__device__ __forceinline__ void drain_cp_async() {
  cp_async_commit();
  cp_async_wait<0>();
}

// MN-major (N contiguous) operand tile with 128-byte swizzle, the layout a TMA box of 64 N elements x K rows writes:
// each K row is 128 bytes (64 bf16 of N), 8-row K groups 1024 bytes apart (SBO), 64-wide N atoms `atom_bytes` apart
// (LBO). The K-major descriptor is core's smem_desc.
__device__ __forceinline__ uint64_t smem_desc_mn(uint32_t addr, uint32_t atom_bytes) {
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((atom_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

// wgmma m64n256k16 bf16 -> fp32 with B N-major (imm-trans-b = 1: the weight stored (K, N) with N contiguous, as w2 is
// for the backward's grad_out x W2) and A K-major, or M-major with kTransA (the weight gradients: both operands are
// slot rows, K = slots); core's wgmma_m64n256k16_bf16 is the all-K-major form.
template <int kTransA = 0>
__device__ __forceinline__ void wgmma_m64n256k16_bf16_bn(float* d, uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d), "n"(kTransA));
}

// sigmoid(x) = 1 / (1 + 2^(-x log2 e)) in two MUFU operations (ex2.approx.ftz, rcp.approx.ftz: a few ulp of fp32,
// far below the bf16 rounding of every result it feeds). The IEEE division and the non-ftz ex2 that `1.f / (1.f +
// __expf(-x))` compiles to add ~12 instructions per element (range fix-ups, a branch to a slow-path call), and the
// SwiGLU epilogues run it once per accumulator element. Limits: x -> -inf gives 0 (2^+inf = inf), x -> +inf 1.
__device__ __forceinline__ float fast_sigmoid(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-1.4426950408889634f * x));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return r;
}
__device__ __forceinline__ float silu_mul(float g, float u) { return g * fast_sigmoid(g) * u; }

// h from the pre-activations g, u (fp32, biases included) for activation ACT (kAct*); relu2 reads no u.
template <int ACT>
__device__ __forceinline__ float activate(float g, float u, float alpha, float limit) {
  if constexpr (ACT == kActSwiGLU) {
    return silu_mul(g, u);
  } else if constexpr (ACT == kActGptOss) {
    const float gc = fminf(g, limit);
    return (fminf(fmaxf(u, -limit), limit) + 1.f) * gc * fast_sigmoid(alpha * gc);
  } else {
    const float r = fmaxf(g, 0.f);
    return r * r;
  }
}
// h and the gradients of the pre-activations from dh = dL/dh: the clamps pass the gradient inside their closed ranges
// and none outside (torch.clamp's rule, as the CPU ops); du is left alone for relu2.
template <int ACT>
__device__ __forceinline__ float activate_backward(float g, float u, float dh, float alpha, float limit, float& dg,
                                                   float& du) {
  if constexpr (ACT == kActSwiGLU) {
    const float sig = fast_sigmoid(g), a = g * sig;
    du = dh * a;
    dg = dh * u * sig * (1.f + g * (1.f - sig));
    return a * u;
  } else if constexpr (ACT == kActGptOss) {
    const float gc = fminf(g, limit), up1 = fminf(fmaxf(u, -limit), limit) + 1.f;
    const float sig = fast_sigmoid(alpha * gc), glu = gc * sig;
    dg = g <= limit ? dh * up1 * sig * (1.f + alpha * gc * (1.f - sig)) : 0.f;
    du = fabsf(u) <= limit ? dh * glu : 0.f;
    return up1 * glu;
  } else {
    const float r = fmaxf(g, 0.f);
    dg = 2.f * dh * r;
    return r * r;
  }
}
// A bias element as fp32, 0 without a bias (bias: the expert's row, from the tile's first column).
__device__ __forceinline__ float bias_at(const __nv_bfloat16* bias, int col) {
  return bias != nullptr ? __bfloat162float(bias[col]) : 0.f;
}

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

// A wgmma accumulator row is spread over the 4 lanes of a quad: lane q holds columns 8 j + 2 q, + 1 for every j. A
// warp's 32-bit access per j then touches 8 rows x 16 bytes (8 cache lines for 128 bytes); the epilogues instead
// exchange within the quad so that each lane accesses 16 contiguous bytes (8 rows x 64 bytes per instruction).
// quad_transpose: the quad's 4 x 4 words, x[k] of lane q = the bf16 pair of columns 8 (j0 + k) + 2 q, + 1, become
// lane q's pairs of group j0 + q in column order (8 contiguous bf16); its own inverse (a 16-byte load per lane, then
// this, gives each lane its accumulator-layout pairs). Every lane of the quad must call it (they share one row).
// The shuffle mask of this lane's quad.
__device__ __forceinline__ unsigned quad_mask() { return 0xFu << (threadIdx.x & 28u); }
__device__ __forceinline__ uint4 quad_transpose(uint4 v, int quad) {
  uint32_t x[4] = {v.x, v.y, v.z, v.w};
  const unsigned mask = quad_mask();
#pragma unroll
  for (int d = 2; d >= 1; d >>= 1) {
    const bool upper = (quad & d) != 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k & d) continue;
      const uint32_t recv = __shfl_xor_sync(mask, upper ? x[k] : x[k | d], d);
      x[k] = upper ? recv : x[k];
      x[k | d] = upper ? x[k | d] : recv;
    }
  }
  return make_uint4(x[0], x[1], x[2], x[3]);
}
// One bf16 pair as its 32 bits. Not bf16x8.cuh's pack8 over an 8-float array: in the dH epilogue that compiled to 320
// bf16 conversions instead of 192 (SASS, session 25).
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// Stores a quad's row of COLS accumulator-layout values as bf16 to dst (the row's first column, 16-byte aligned):
// value(j, e) is column 8 j + 2 quad + e. Columns from n_total on (a multiple of 32: whole groups) are left alone.
template <int COLS, class Value>
__device__ __forceinline__ void store_row_bf16(__nv_bfloat16* dst, int n0, int n_total, int quad, Value value) {
  static_assert(COLS % 32 == 0, "whole groups of 4 j (32 columns)");
#pragma unroll
  for (int g = 0; g < COLS / 32; ++g) {
    if (n0 + 32 * g >= n_total) break;
    uint4 w;
    w.x = bf16x2_bits(value(4 * g, 0), value(4 * g, 1));
    w.y = bf16x2_bits(value(4 * g + 1, 0), value(4 * g + 1, 1));
    w.z = bf16x2_bits(value(4 * g + 2, 0), value(4 * g + 2, 1));
    w.w = bf16x2_bits(value(4 * g + 3, 0), value(4 * g + 3, 1));
    *reinterpret_cast<uint4*>(dst + 32 * g + 8 * quad) = quad_transpose(w, quad);
  }
}

// store_row_bf16 for a quad's row of COLS values of which each lane holds every fourth: value(j) is column 4 j + quad
// (the (gate, up) column pairs' outputs). Per 32 columns, the 4 x 4 words of value(8 g + k) (low half) and
// value(8 g + 4 + k) (high half) go through quad_transpose: lane q then holds columns 32 g + 4 q .. + 3 in the low
// halves and the same 16 columns further in the high ones, two 8-byte stores.
template <int COLS, class Value>
__device__ __forceinline__ void store_pairs_row_bf16(__nv_bfloat16* dst, int n0, int n_total, int quad, Value value) {
  static_assert(COLS % 32 == 0, "whole groups of 8 j (32 columns)");
#pragma unroll
  for (int g = 0; g < COLS / 32; ++g) {
    if (n0 + 32 * g >= n_total) break;
    uint4 w;
    w.x = bf16x2_bits(value(8 * g), value(8 * g + 4));
    w.y = bf16x2_bits(value(8 * g + 1), value(8 * g + 5));
    w.z = bf16x2_bits(value(8 * g + 2), value(8 * g + 6));
    w.w = bf16x2_bits(value(8 * g + 3), value(8 * g + 7));
    const uint4 t = quad_transpose(w, quad);
    const uint2 low = make_uint2(__byte_perm(t.x, t.y, 0x5410), __byte_perm(t.z, t.w, 0x5410));
    const uint2 high = make_uint2(__byte_perm(t.x, t.y, 0x7632), __byte_perm(t.z, t.w, 0x7632));
    *reinterpret_cast<uint2*>(dst + 32 * g + 4 * quad) = low;
    *reinterpret_cast<uint2*>(dst + 32 * g + 16 + 4 * quad) = high;
  }
}

// The down GEMMs' epilogue for accumulator row h (0 or 1) of a consumer thread holding COLS columns of slot `slot`
// (register 4 j + 2 h + e is column 8 j + 2 quad + e, from column n0): kAtomic adds topk_weight * y (kWeighted; else
// y) into the fp32 [M, dim] buffer, else y is stored as bf16 to the slot's row. The atomics go 16 bytes at a time
// (red.global.add.v4.f32, sm_90): lanes q and q ^ 1 swap a float2 of j and j + 1 so that the even lane adds columns
// 4 (q / 2) .. + 3 of group j and the odd lane the same of group j + 1.
template <int COLS, bool kAtomic, bool kWeighted = true, class Params>
__device__ __forceinline__ void store_down_row(const Params& p, const float* acc, int h, int quad, int slot, int n0,
                                               const __nv_bfloat16* bias = nullptr) {
  // y = acc + the expert's bias (b2: the routing weight multiplies both), column 8 j + 2 quad + e of the tile
  auto y = [&](int j, int e) { return acc[4 * j + 2 * h + e] + bias_at(bias, 8 * j + 2 * quad + e); };
  if constexpr (kAtomic) {
    static_assert(COLS % 16 == 0, "pairs of j (16 columns)");
    const float w = kWeighted ? __ldg(p.topk_weights + slot) : 1.f;
    float* dst = p.acc32 + static_cast<int64_t>(slot / p.top_k) * p.ld_out + n0;
    const unsigned mask = quad_mask();
    const bool odd = (quad & 1) != 0;
#pragma unroll
    for (int j = 0; j < COLS / 8; j += 2) {
      if (n0 + 8 * j >= p.n_total) break;  // n_total: a multiple of 16
      const float2 a = make_float2(w * y(j, 0), w * y(j, 1));
      const float2 b = make_float2(w * y(j + 1, 0), w * y(j + 1, 1));
      const float2 give = odd ? a : b;
      const float2 got = make_float2(__shfl_xor_sync(mask, give.x, 1), __shfl_xor_sync(mask, give.y, 1));
      const float4 v = odd ? make_float4(got.x, got.y, b.x, b.y) : make_float4(a.x, a.y, got.x, got.y);
      atomicAdd(reinterpret_cast<float4*>(dst + 8 * (j + odd) + 4 * (quad >> 1)), v);
    }
  } else {
    store_row_bf16<COLS>(p.yslots + static_cast<int64_t>(slot) * p.ld_out + n0, n0, p.n_total, quad, y);
  }
}
#endif

}  // namespace sm90
}  // namespace flash_moe
