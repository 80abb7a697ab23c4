// flash_moe mxfp8 on CUDA sm_90a: quantize_mxfp8 (four lanes per scale block) and the fused expert GEMMs on e4m3
// operands with e8m0 block scales (see docs/notes/flash_moe.md, "mxfp8").
//
// Hopper has no block-scaled tensor-core instruction. The kernels turn every e4m3 element into the bf16 value
// element x 2^(scale) inside the SM (exact: e4m3 x a power of two fits bf16's 8-bit mantissa and exponent) and run the
// bf16 kernel's wgmma.m64n256k16 on it. Per 32-element scale block this costs O(rows + columns) conversions, where
// promoting fp8 wgmma results costs O(rows x columns) FMAs, and it keeps HBM and L2 traffic at one byte per element,
// half of bf16's: the bf16 kernels are L2-bandwidth-bound on DeepSeek-V3 (docs/notes/flash_moe.md).
// CTA = one aligned block (BLOCK_M = 128 routed slots, one expert) x one 256-wide column tile, 384 threads:
//   warpgroup 0  producer. Loads a RAW_STAGES-deep ring of e4m3 stages (BLOCK_K bytes of K per row): the gathered A
//                rows by cp.async (row r reads x[sorted_token_ids[r] / top_k], zero-filled for padding; addresses
//                kept in registers), the B rows by TMA (two 128-row boxes issued by thread 0), the 4-byte scale words
//                of the A rows (cp.async, one per thread) and of the B rows (the blocked layout of
//                pack_scales_blocked: 16-byte cp.async, 64 threads). Once a raw stage has landed, the 128 threads
//                convert it into a STAGES-deep ring of 128-byte-swizzled bf16 tiles (16 elements of one scale block
//                per step: e4m3 bytes -> bf16 bits of element x 2^-120 by byte permutes and shifts, subnormals
//                included, then one bf16x2 multiply by 2^(scale + 120)), fence the async proxy and arrive on the bf16
//                stage's full mbarrier.
//   warpgroups 1-2  consumers, 64 rows each: the bf16 kernel's mainloop (wgmma.m64n256k16 bf16 -> fp32, one group
//                in flight, stage released on its empty mbarrier).
// Kernel 1 (gate/up): B = 128 gate rows + the matching 128 up rows; epilogue h = silu(g) * u in fp32, re-quantized to
//   mxfp8 per 32 hidden columns (amax across the 4 lanes of a quad holding one row's 32 columns; mx::scale_byte, the
//   rule quantize_mxfp8 uses) into the e4m3 intermediate [padded slots, hidden] and its row-major scales.
// Kernel 2 (down): A = intermediate rows of the block, B = w2[e]; epilogue as the bf16 kernel (float2 atomics of
//   topk_weight * y into an fp32 [M, dim] buffer, or bf16 per-slot rows for the deterministic combine).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include <prime_kernels/tma.h>

#include "../flash_moe.h"
#include "../mxfp8.h"
#include "sm90_common.cuh"

#ifndef FLASH_MOE_MXFP8_STAGES
#error "FLASH_MOE_MXFP8_STAGES must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_MXFP8_RAW_STAGES
#error "FLASH_MOE_MXFP8_RAW_STAGES must come from kernel.toml ([flash_moe.constants])"
#endif

namespace flash_moe {
namespace sm90 {
namespace mxk {

constexpr int BM = FLASH_MOE_BLOCK_M;
constexpr int BN = 256;  // wgmma N: a gate/up tile's gate and up columns, or a down tile
constexpr int BN_GU = FLASH_MOE_BLOCK_N_GATE_UP;
constexpr int BN_DOWN = FLASH_MOE_BLOCK_N_DOWN;
constexpr int SB = FLASH_MOE_MXFP8_SCALE_BLOCK;
constexpr int BK = FLASH_MOE_BLOCK_K;            // K per stage: e4m3 bytes of a raw row, bf16 elements of a tile row
constexpr int WORD_K = FLASH_MOE_MXFP8_ALIGN;    // K covered by one 4-byte scale word (4 scale blocks)
constexpr int STAGES = FLASH_MOE_MXFP8_STAGES;
constexpr int RAW_STAGES = FLASH_MOE_MXFP8_RAW_STAGES;
static_assert(BM == 128, "BLOCK_M must be 128 (two consumer warpgroups of wgmma m64)");
static_assert(2 * BN_GU == BN && BN_DOWN == BN, "BLOCK_N_GATE_UP must be 128 and BLOCK_N_DOWN 256 (m64n256k16)");
static_assert(BK == 64 && SB == 32 && WORD_K == 128,
              "mxfp8 kernels: BLOCK_K 64 (one swizzle row of bf16), scale block 32, MXFP8_ALIGN 128 (a scale word)");
static_assert(STAGES >= 2 && RAW_STAGES >= 2, "MXFP8_STAGES and MXFP8_RAW_STAGES must be at least 2");

constexpr int PRODUCER_WARPGROUPS = 1;
constexpr int PRODUCER_THREADS = 128 * PRODUCER_WARPGROUPS, PRODUCER_WARPS = PRODUCER_THREADS / 32;
constexpr int NUM_THREADS = PRODUCER_THREADS + 256;
constexpr int CONSUMER_WARPS = 8;
// Registers: the CTA keeps what it was launched with (NUM_THREADS x LAUNCH_REGS) and setmaxnreg only moves registers
// within it: the consumers' increase must fit in what the producer gives back, or it waits forever.
constexpr int LAUNCH_REGS = 65536 / NUM_THREADS / 8 * 8;
constexpr int PRODUCER_REGS = 104, CONSUMER_REGS = 200;
static_assert(PRODUCER_THREADS * PRODUCER_REGS + 256 * CONSUMER_REGS <= NUM_THREADS * LAUNCH_REGS,
              "setmaxnreg: the consumers' registers must come from the producer's");
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
// raw stage: e4m3 rows, unswizzled (a warp reads 8 rows x 64 contiguous bytes: no bank conflict), then the scale words
constexpr int RAW_A = BM * BK, RAW_B = BN * BK, RAW_SA = BM * 4, RAW_SB = BN * 4;
constexpr int RAW_BYTES = RAW_A + RAW_B + RAW_SA + RAW_SB;
static_assert(RAW_BYTES % 128 == 0, "raw stages keep TMA's 128-byte alignment");
constexpr int B_BOX_ROWS = 128;  // one TMA box: the gate (or up) rows of a gate/up tile, half a down tile
constexpr int STAGES_PER_WORD = WORD_K / BK;
constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + RAW_STAGES * RAW_BYTES + BM * 8 + BM * 4 +
                           (2 * STAGES + 2 * RAW_STAGES) * 8;

enum Mode : int { GATE_UP = 0, DOWN_ATOMIC = 1, DOWN_SLOTS = 2 };

struct Params {
  const uint8_t* a;         // x (GATE_UP) or the intermediate (DOWN), e4m3 [rows][lda]
  const uint8_t* a_scales;  // e8m0 [rows][lda / 32]
  int64_t lda;
  // B tiles by TMA: a 2-D map over w (GATE_UP, gate rows then up rows) or w2 (DOWN), e4m3 [E * b_rows][K], unswizzled
  // boxes of B_BOX_ROWS x BK
  CUtensorMap tm_b;
  const uint8_t* b_scales;  // e8m0 [E][K / 128][b_rows][4] (pack_scales_blocked)
  int b_rows;
  int up_offset;  // GATE_UP: first up row (hidden)
  int n_total;    // valid output columns: hidden (GATE_UP) or dim (DOWN)
  int k_tiles;
  int n_tiles;  // column tiles of the launch
  int blocks;   // aligned blocks of the launch
  int top_k;
  int num_experts;
  int num_slots;  // M * top_k: sorted entries outside [0, num_slots) are padding
  const int* sorted;
  const int* expert_ids;
  const int* ntpp;
  uint8_t* inter;         // GATE_UP output e4m3 [padded, hidden]
  uint8_t* inter_scales;  // GATE_UP output e8m0 [padded, hidden / 32]
  int64_t ld_inter;
  const float* topk_weights;
  float* acc32;
  __nv_bfloat16* yslots;
  int64_t ld_out;
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint4 lds_u32x4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts_u32x4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The bf16 multipliers for scale byte s (2^(s - 127)) applied to values held as element x 2^-120: 2^(s - 7) when that is
// a bf16 normal (s <= 134), else 2^127 then 2^(s - 134) (`second`, 0 when unused); the NaN scale gives NaN.
__device__ __forceinline__ void scale_multipliers(uint32_t s, uint32_t& first, uint32_t& second) {
  first = s <= 134u ? (s + 120u) * 0x00800080u : (s == mx::kNanScale ? 0x7FC07FC0u : 0x7F007F00u);
  second = s > 134u && s != mx::kNanScale ? (s - 7u) * 0x00800080u : 0u;
}

// Two e4m3 bytes placed at bits 8-15 and 24-31 of u -> bf16x2 of element x 2^-120: the sign in place, the 4 exponent and
// 3 mantissa bits shifted onto bf16's bits 4-10, so e4m3 exponent field e becomes bf16 exponent field e (bias 127
// instead of 7) and the e4m3 subnormals (e = 0) become bf16 subnormals of the same value x 2^-120.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_scaled_down(uint32_t u) {
  return ((u >> 4) & 0x07F007F0u) | (u & 0x80008000u);
}

// 16 e4m3 bytes of one scale block -> 16 bf16 (8 words) times the block's first multiplier. Returns nonzero when a
// byte is an e4m3 NaN (0x7F, 0xFF), which exact_rare_cases below must then fix.
__device__ __forceinline__ uint32_t e4m3x16_to_bf16(const uint4 q, uint32_t first, uint32_t* o) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  uint32_t nan_probe = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = bf16x2_mul(e4m3x2_to_bf16x2_scaled_down(__byte_perm(w[i], 0u, 0x1404)), first);
    o[2 * i + 1] = bf16x2_mul(e4m3x2_to_bf16x2_scaled_down(__byte_perm(w[i], 0u, 0x3424)), first);
    nan_probe |= (w[i] & 0x7F7F7F7Fu) + 0x01010101u;  // bit 7 of a byte set iff its low 7 bits were all ones
  }
  return nan_probe & 0x80808080u;
}

// The cases the fast path leaves out: the second multiplier of scales above 2^7, and e4m3 NaN bytes -> bf16 NaN.
__device__ __forceinline__ void exact_rare_cases(const uint4 q, uint32_t second, uint32_t* o) {
  if (second != 0u) {
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = bf16x2_mul(o[i], second);
  }
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    if (((w[e / 4] >> (8 * (e % 4))) & 0x7Fu) == 0x7Fu) o[e / 2] |= 0x7FC0u << (16 * (e % 2));
  }
}
#endif

// Accumulator register i of a consumer thread holds row (warp * 16 + lane / 4 + 8 * ((i / 2) % 2)) and column
// (8 * (i / 4) + 2 * (lane % 4) + i % 2) of its warpgroup's 64 x 256 tile.
template <int MODE>
__global__ void __launch_bounds__(NUM_THREADS, 1) moe_mxfp8_kernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kGateUp = MODE == GATE_UP;
  int block, n_tile;
  raster(static_cast<int>(blockIdx.x), p.n_tiles, p.blocks, block, n_tile);
  if (block * BM >= __ldg(p.ntpp)) return;
  const int expert = __ldg(p.expert_ids + block);
  if (expert < 0 || expert >= p.num_experts) return;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const gbase = smem_raw + (base - raw);
  const uint32_t raw_base = base + STAGES * STAGE_BYTES;
  constexpr int ROWS_OFF = STAGES * STAGE_BYTES + RAW_STAGES * RAW_BYTES;
  int64_t* const a_row = reinterpret_cast<int64_t*>(gbase + ROWS_OFF);
  int* const slot_of = reinterpret_cast<int*>(gbase + ROWS_OFF + BM * 8);
  // raw ring barriers (full = the producer threads' copies + thread 0's expect_tx, empty = the producer threads after
  // converting), then the bf16 ring's (full = the producer threads, empty = the 8 consumer warps)
  const uint32_t raw_bars = base + ROWS_OFF + BM * 12;
  const uint32_t bars = raw_bars + 2 * RAW_STAGES * 8;
  auto raw_full = [&](int s) { return raw_bars + 8u * s; };
  auto raw_empty = [&](int s) { return raw_bars + 8u * (RAW_STAGES + s); };
  auto full_bar = [&](int s) { return bars + 8u * s; };
  auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
  const int n_base = n_tile * (kGateUp ? BN_GU : BN_DOWN);

  if (threadIdx.x == 0) {
    for (int s = 0; s < RAW_STAGES; ++s) {
      mbar_init(raw_full(s), PRODUCER_THREADS + 1);
      mbar_init(raw_empty(s), PRODUCER_THREADS);
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(s), PRODUCER_THREADS);
      mbar_init(empty_bar(s), CONSUMER_WARPS);
    }
  }
  block_prologue<BM, 0, kGateUp>(p, block, a_row, slot_of, raw_bars);  // routing rows; the barriers are set above

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup < PRODUCER_WARPGROUPS) {  // ------------------------------- producer -------------------------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // This thread's 16-byte chunk c of rows 8 (warp + PRODUCER_WARPS i) + lane / 4: a warp covers 8 whole 64-byte rows
    // per step.
    const int c = lane & 3, row8 = lane >> 2;
    auto tile_row = [&](int i) { return 8 * (warp + PRODUCER_WARPS * i) + row8; };
    // the chunk's two 16-byte halves in the swizzled bf16 tile (tile rows are = row8 mod 8)
    const uint32_t dst_lo = static_cast<uint32_t>(((2 * c) ^ row8) << 4);
    const uint32_t dst_hi = static_cast<uint32_t>(((2 * c + 1) ^ row8) << 4);
    // Row of w (w2) that lands in B tile row r: GATE_UP the gate rows, then the same up rows; DOWN the w2 rows in order.
    auto weight_row = [&](int r) {
      if constexpr (kGateUp) {
        return r < BN_GU ? n_base + r : p.up_offset + n_base + r - BN_GU;
      } else {
        return n_base + r;
      }
    };
    // copies: A rows of this thread's chunks (source addresses in registers; padding rows copy 0 bytes, zero fill),
    // the scale word of A row `tid` (threads < BM), and (threads < 64) the scale words of B rows 4 tid .. 4 tid + 3
    constexpr int A_STEPS = BM / (8 * PRODUCER_WARPS), B_STEPS = BN / (8 * PRODUCER_WARPS);
    static_assert(A_STEPS * 8 * PRODUCER_WARPS == BM && B_STEPS * 8 * PRODUCER_WARPS == BN, "whole rows per thread");
    const uint8_t* a_src[A_STEPS];
    uint32_t a_valid = 0;
#pragma unroll
    for (int i = 0; i < A_STEPS; ++i) {
      const int64_t off = a_row[tile_row(i)];
      a_src[i] = p.a + (off >= 0 ? off : 0) + c * 16;
      a_valid |= (off >= 0 ? 1u : 0u) << i;
    }
    const int64_t my_row = tid < BM ? a_row[tid] : -1;
    const uint8_t* const a_scale_src = p.a_scales + (my_row >= 0 ? my_row / SB : 0);
    const int word_groups = p.k_tiles / STAGES_PER_WORD;
    const int sb_row = weight_row(4 * (tid & 63));
    const bool sb_valid = tid < 64 && sb_row < p.b_rows;
    const uint8_t* const b_scale_src =
        p.b_scales + (static_cast<int64_t>(expert) * word_groups * p.b_rows + (sb_valid ? sb_row : 0)) * 4;
    const int b_row0 = expert * p.b_rows;

    auto issue = [&](int kt) {
      const int s = kt % RAW_STAGES;
      mbar_wait(raw_empty(s), ((kt / RAW_STAGES) & 1) ^ 1);
      const uint32_t rs = raw_base + s * RAW_BYTES;
      const int kofs = kt * BK, word = kt / STAGES_PER_WORD;
      if (tid == 0) {
        mbar_expect_tx(raw_full(s), RAW_B);
#pragma unroll
        for (int box = 0; box < BN / B_BOX_ROWS; ++box)
          tma_load_2d(rs + RAW_A + box * B_BOX_ROWS * BK, &p.tm_b, raw_full(s), kofs,
                      b_row0 + weight_row(box * B_BOX_ROWS));
      }
#pragma unroll
      for (int i = 0; i < A_STEPS; ++i)
        cp_async_16(rs + tile_row(i) * BK + c * 16, a_src[i] + kofs, (a_valid >> i) & 1u ? 16u : 0u);
      if (tid < BM)
        cp_async_4(rs + RAW_A + RAW_B + 4 * tid, my_row >= 0 ? a_scale_src + 4 * word : p.a_scales,
                   my_row >= 0 ? 4u : 0u);
      if (tid < 64)
        cp_async_16(rs + RAW_A + RAW_B + RAW_SA + 16 * tid,
                    sb_valid ? b_scale_src + static_cast<int64_t>(word) * p.b_rows * 4 : p.b_scales,
                    sb_valid ? 16u : 0u);
      cp_async_mbar_arrive_noinc(raw_full(s));  // fires when this thread's copies of the stage have landed
    };
    // A stage's chunks (A_STEPS of the A tile, then B_STEPS of the B tile): raw e4m3 + scale word -> the swizzled bf16
    // tile. All raw loads go first (one shared-memory latency per stage, not one per chunk), then the conversions and
    // stores. The fast pass leaves scales above 2^7 and e4m3 NaN bytes to an exact pass over the stage (rare; no branch
    // inside the fast pass, so its chunks interleave).
    constexpr int CHUNKS = A_STEPS + B_STEPS;
    auto chunk_row = [&](int j) { return j < A_STEPS ? tile_row(j) : tile_row(j - A_STEPS); };
    auto chunk_raw = [&](int j) { return (j < A_STEPS ? 0 : RAW_A) + chunk_row(j) * BK + c * 16; };
    auto chunk_word = [&](int j) { return RAW_A + RAW_B + (j < A_STEPS ? 0 : RAW_SA) + 4 * chunk_row(j); };
    auto chunk_dst = [&](int j) { return (j < A_STEPS ? 0 : A_BYTES) + chunk_row(j) * 128; };
    auto convert = [&]<bool kExact>(uint32_t rs, uint32_t st, uint32_t byte_sel, int stage, int phase) {
      uint4 q[CHUNKS];
      uint32_t scale[CHUNKS];
#pragma unroll
      for (int j = 0; j < CHUNKS; ++j) {
        q[j] = lds_u32x4(rs + chunk_raw(j));
        scale[j] = lds_u32(rs + chunk_word(j));
      }
      if constexpr (!kExact) mbar_wait(empty_bar(stage), phase);
      uint32_t rare = 0;
#pragma unroll
      for (int j = 0; j < CHUNKS; ++j) {
        const uint32_t sb = __byte_perm(scale[j], 0u, byte_sel);
        uint32_t o[8];
        if constexpr (kExact) {
          uint32_t first, second;
          scale_multipliers(sb, first, second);
          e4m3x16_to_bf16(q[j], first, o);
          exact_rare_cases(q[j], second, o);
        } else {  // first multiplier of scales up to 2^7; larger ones (and NaN, 0xFF) are rare
          rare |= e4m3x16_to_bf16(q[j], (sb + 120u) * 0x00800080u, o) | ((sb + 121u) & 0x100u);
        }
        sts_u32x4(st + chunk_dst(j) + dst_lo, o[0], o[1], o[2], o[3]);
        sts_u32x4(st + chunk_dst(j) + dst_hi, o[4], o[5], o[6], o[7]);
      }
      return rare;
    };
    for (int kt = 0; kt < min(RAW_STAGES - 1, p.k_tiles); ++kt) issue(kt);
    for (int kt = 0; kt < p.k_tiles; ++kt) {
      if (kt + RAW_STAGES - 1 < p.k_tiles) issue(kt + RAW_STAGES - 1);
      const int rs_i = kt % RAW_STAGES, stage = kt % STAGES;
      mbar_wait(raw_full(rs_i), (kt / RAW_STAGES) & 1);
      const uint32_t rs = raw_base + rs_i * RAW_BYTES, st = base + stage * STAGE_BYTES;
      // the byte of a row's scale word that holds the scale block of chunk c in stage kt, as a byte_perm selector
      const uint32_t byte_sel = 0x4440u | static_cast<uint32_t>((kt % STAGES_PER_WORD) * (BK / SB) + c * 16 / SB);
      if (convert.template operator()<false>(rs, st, byte_sel, stage, ((kt / STAGES) & 1) ^ 1) != 0u)
        convert.template operator()<true>(rs, st, byte_sel, stage, 0);
      fence_proxy_async();  // generic-proxy stores, read by wgmma through the async proxy
      mbar_arrive(full_bar(stage));
      mbar_arrive(raw_empty(rs_i));
    }
    cp_async_wait<0>();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));

  // ------------------------------- consumers -------------------------------
  const int wg = warpgroup - PRODUCER_WARPGROUPS;
  const int ctid = threadIdx.x - 128 * warpgroup;
  const int warp = ctid / 32, lane = ctid % 32, quad = lane & 3;
  float acc[128];
  int prev = 0;
  const uint32_t a_off = wg * 64 * 128;
  // A warpgroup whose 64 rows are all padding only keeps the ring turning (its tensor-core time goes to the other).
  if (__all_sync(0xffffffffu, slot_of[wg * 64 + lane] < 0 && slot_of[wg * 64 + 32 + lane] < 0)) {
    for (int kt = 0; kt < p.k_tiles; ++kt) {
      mbar_wait(full_bar(kt % STAGES), (kt / STAGES) & 1);
      if (lane == 0) mbar_arrive(empty_bar(kt % STAGES));
    }
    return;  // nothing to store: GATE_UP leaves these rows of the intermediate unwritten, DOWN never reads them
  }
  for (int kt = 0; kt < p.k_tiles; ++kt) {
    const int stage = kt % STAGES;
    mbar_wait(full_bar(stage), (kt / STAGES) & 1);
    const uint32_t st = base + stage * STAGE_BYTES;
    const uint64_t da = smem_desc(st + a_off), db = smem_desc(st + A_BYTES);
    fence_regs<128>(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) wgmma_m64n256k16_bf16(acc, da + 2 * kk, db + 2 * kk, (kt > 0 || kk > 0) ? 1 : 0);
    wgmma_commit();
    fence_regs<128>(acc);
    wgmma_wait<1>();
    fence_regs<128>(acc);
    if (kt > 0 && lane == 0) mbar_arrive(empty_bar(prev));
    prev = stage;
  }
  wgmma_wait<0>();
  fence_regs<128>(acc);

  // ------------------------------- epilogue -------------------------------
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int lr = wg * 64 + warp * 16 + (lane >> 2) + 8 * h;
    if constexpr (kGateUp) {
      // 32 hidden columns (one scale block of the intermediate) = groups 4 m .. 4 m + 3 across the 4 lanes of a quad
      const int64_t grow = static_cast<int64_t>(block) * BM + lr;
#pragma unroll
      for (int m = 0; m < BN_GU / SB; ++m) {
        float hv[8];
        uint32_t amax = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const int j = 4 * m + g;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            hv[2 * g + e] = silu_mul(acc[4 * j + 2 * h + e], acc[4 * (j + BN_GU / 8) + 2 * h + e]);
            amax = max(amax, __float_as_uint(hv[2 * g + e]) & 0x7FFFFFFFu);
          }
        }
        amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        const uint32_t sb = mx::scale_byte(amax);
        const float inv = __uint_as_float(sb == mx::kNanScale ? 0u : mx::inv_scale_bits(sb));
        const int hid0 = n_base + SB * m;
        if (hid0 < p.n_total) {
          uint8_t* dst = p.inter + grow * p.ld_inter + n_base;
#pragma unroll
          for (int g = 0; g < 4; ++g) {
            const int j = 4 * m + g;
            const uint16_t v = sb == mx::kNanScale
                                   ? static_cast<uint16_t>(0x7F7F)
                                   : static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(
                                         make_float2(hv[2 * g] * inv, hv[2 * g + 1] * inv), __NV_SATFINITE, __NV_E4M3));
            *reinterpret_cast<uint16_t*>(dst + 8 * j + 2 * quad) = v;
          }
          if (quad == 0) p.inter_scales[grow * (p.ld_inter / SB) + hid0 / SB] = static_cast<uint8_t>(sb);
        }
      }
    } else {
      const int slot = slot_of[lr];
      if (slot < 0) continue;
      store_down_row<BN_DOWN, MODE == DOWN_ATOMIC>(p, acc, h, quad, slot, n_base);
    }
  }
#else
  __trap();
#endif
}

template <int MODE>
void launch(const Params& p, int n_tiles, int64_t blocks, cudaStream_t stream) {
  launch_rastered<moe_mxfp8_kernel<MODE>, NUM_THREADS, SMEM_BYTES>(p, n_tiles, blocks, stream);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// quantize_mxfp8 (the same mx:: rule as the CPU op: bit-identical results). Blocks of MXFP8_SCALE_BLOCK elements,
// the fused ops' layout: four lanes per block, 8 elements each, so that a warp reads 8 whole blocks in one coalesced
// sweep (16-byte loads of bf16 / fp16, two of fp32) and writes their 256 e4m3 bytes as 8-byte stores; the block's
// amax meets across the quad by two shuffles. Other block sizes, or inputs not 16-byte aligned: one thread per block.
constexpr int Q_LANES = 4;
constexpr int Q_ELEMS = SB / Q_LANES;
static_assert(Q_ELEMS == 8, "quantize_mxfp8: 8 elements (one 16-byte load of bf16) per lane");

__device__ __forceinline__ void load8(const float* p, float* v) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = to_f32(e[i]);
}

template <typename T>
__global__ void quantize_block32_kernel(const T* __restrict__ in, uint8_t* __restrict__ data,
                                        uint8_t* __restrict__ scales, int64_t blocks) {
  const int64_t lane_id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b = lane_id / Q_LANES;
  const int part = static_cast<int>(lane_id % Q_LANES);
  const bool valid = b < blocks;  // the last warp's spare lanes still take part in the shuffles
  float v[Q_ELEMS] = {};
  if (valid) load8(in + b * SB + part * Q_ELEMS, v);
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < Q_ELEMS; ++i) amax = max(amax, __float_as_uint(v[i]) & 0x7FFFFFFFu);
  amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  if (!valid) return;
  const uint32_t sb = mx::scale_byte(amax);
  if (part == 0) scales[b] = static_cast<uint8_t>(sb);
  uint2 q;
  if (sb == mx::kNanScale) {
    q.x = q.y = 0x01010101u * mx::kNanElement;
  } else {
    const float inv = __uint_as_float(mx::inv_scale_bits(sb));
    uint32_t pairs[Q_ELEMS / 2];
#pragma unroll
    for (int i = 0; i < Q_ELEMS / 2; ++i)
      pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i] * inv, v[2 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
    q.x = pairs[0] | pairs[1] << 16;
    q.y = pairs[2] | pairs[3] << 16;
  }
  *reinterpret_cast<uint2*>(data + b * SB + part * Q_ELEMS) = q;
}

template <typename T>
__global__ void quantize_kernel(const T* __restrict__ in, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                                int64_t blocks, int block) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  const T* v = in + b * block;
  uint32_t amax = 0;
  for (int i = 0; i < block; ++i) amax = max(amax, __float_as_uint(to_f32(v[i])) & 0x7FFFFFFFu);
  const uint32_t sb = mx::scale_byte(amax);
  scales[b] = static_cast<uint8_t>(sb);
  uint8_t* q = data + b * block;
  if (sb == mx::kNanScale) {
    for (int i = 0; i < block; ++i) q[i] = mx::kNanElement;
    return;
  }
  const float inv = __uint_as_float(mx::inv_scale_bits(sb));
  for (int i = 0; i < block; ++i)
    q[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(to_f32(v[i]) * inv, __NV_SATFINITE, __NV_E4M3));
}

// One launch of either kernel above for `blocks` scale blocks of `block` elements of `in`.
template <typename T>
void quantize(const T* in, uint8_t* data, uint8_t* scales, int64_t blocks, int block, cudaStream_t stream) {
  constexpr int threads = 256;
  if (block == SB && reinterpret_cast<uintptr_t>(in) % 16 == 0) {
    const auto grid = static_cast<unsigned>((blocks * Q_LANES + threads - 1) / threads);
    quantize_block32_kernel<T><<<grid, threads, 0, stream>>>(in, data, scales, blocks);
  } else {
    const auto grid = static_cast<unsigned>((blocks + threads - 1) / threads);
    quantize_kernel<T><<<grid, threads, 0, stream>>>(in, data, scales, blocks, block);
  }
}

}  // namespace mxk
}  // namespace sm90

namespace {

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_cuda(const at::Tensor& t, int64_t block) {
  const char* op = "quantize_mxfp8";
  TORCH_CHECK(t.is_cuda(), op, " (CUDA): t must be a CUDA tensor, got ", t.device());
  check_quantize_args(t, block);
  const c10::cuda::CUDAGuard guard(t.device());
  const auto tc = t.contiguous();
  auto data = at::empty(t.sizes(), t.options().dtype(at::kFloat8_e4m3fn));
  auto scale_sizes = t.sizes().vec();
  scale_sizes.back() /= block;
  auto scales = at::empty(scale_sizes, t.options().dtype(at::kFloat8_e8m0fnu));
  const int64_t blocks = scales.numel();
  if (blocks == 0) return {data, scales};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* q = reinterpret_cast<uint8_t*>(data.mutable_data_ptr());
  auto* sc = reinterpret_cast<uint8_t*>(scales.mutable_data_ptr());
  const int blk = static_cast<int>(block);
  if (t.scalar_type() == at::kFloat) {
    sm90::mxk::quantize(tc.const_data_ptr<float>(), q, sc, blocks, blk, stream);
  } else if (t.scalar_type() == at::kBFloat16) {
    sm90::mxk::quantize(reinterpret_cast<const __nv_bfloat16*>(tc.const_data_ptr()), q, sc, blocks, blk, stream);
  } else {
    sm90::mxk::quantize(reinterpret_cast<const __half*>(tc.const_data_ptr()), q, sc, blocks, blk, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {data, scales};
}

const uint8_t* bytes(const at::Tensor& t) { return reinterpret_cast<const uint8_t*>(t.const_data_ptr()); }

void weight_map(const char* op, const char* name, CUtensorMap* map, const at::Tensor& w, int64_t rows, int64_t K) {
  sm90::expert_weight_map(op, name, map, w, rows, K, CU_TENSOR_MAP_DATA_TYPE_UINT8, sm90::mxk::B_BOX_ROWS,
                          sm90::mxk::BK, CU_TENSOR_MAP_SWIZZLE_NONE);
}

// gate/up (+ re-quantization) then down; mode DOWN_ATOMIC fills an fp32 [M, dim] buffer, DOWN_SLOTS bf16 per-slot rows.
at::Tensor run_mx(const char* op, const at::Tensor& x_b, const at::Tensor& xs_b, const at::Tensor& w_b,
                  const at::Tensor& ws_b, const at::Tensor& w2_b, const at::Tensor& w2s_b,
                  const at::Tensor& sorted, const at::Tensor& eids, const at::Tensor& ntpp,
                  const at::Tensor& topk_weights, int64_t top_k, int64_t block_m, int mode, MoeShape& s) {
  const auto x_in = as_bits_of(x_b, at::kFloat8_e4m3fn), w_in = as_bits_of(w_b, at::kFloat8_e4m3fn);
  const auto w2_in = as_bits_of(w2_b, at::kFloat8_e4m3fn);
  const auto xs_in = as_bits_of(xs_b, at::kFloat8_e8m0fnu), ws_in = as_bits_of(ws_b, at::kFloat8_e8m0fnu);
  const auto w2s_in = as_bits_of(w2s_b, at::kFloat8_e8m0fnu);
  const auto [gate_in, up_in] = split_gate_up(op, w_in);
  s = check_moe_args(op, x_in, gate_in, up_in, &w2_in, sorted, eids, ntpp,
                     &topk_weights, top_k, block_m, "w", at::kFloat8_e4m3fn);
  check_mx_scales(op, x_in, xs_in, ws_in, w2s_in, s);
  TORCH_CHECK(x_in.is_cuda(), op, " (CUDA): x must be a CUDA tensor, got ", x_in.device());
  sm90::check_sm90(op, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous(), xs = xs_in.contiguous(), w = w_in.contiguous(), ws = ws_in.contiguous();
  const auto w2 = w2_in.contiguous(), w2s = w2s_in.contiguous();
  const auto sorted_c = sorted.contiguous(), eids_c = eids.contiguous(), tw = topk_weights.contiguous();
  for (const at::Tensor* t : {&x, &w, &w2}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 == 0, op,
                " (CUDA): x, w and w2 must be 16-byte aligned (cp.async, TMA)");
  }
  for (const at::Tensor* t : {&xs, &ws, &w2s}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 4 == 0, op,
                " (CUDA): the scale tensors must be 4-byte aligned (cp.async)");
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t padded = s.blocks * sm90::mxk::BM;
  const auto byte_opts = x.options().dtype(at::kByte);
  auto inter = at::empty({std::max<int64_t>(padded, 1), s.hidden}, byte_opts);
  auto inter_s = at::empty({std::max<int64_t>(padded, 1), s.hidden / kMxScaleBlock}, byte_opts);
  at::Tensor result = mode == sm90::mxk::DOWN_ATOMIC ? at::zeros({s.M, s.dim}, x.options().dtype(at::kFloat))
                                                     : at::zeros({s.M * top_k, s.dim}, x.options().dtype(at::kBFloat16));
  if (s.blocks == 0 || s.M == 0) return result;

  sm90::mxk::Params p{};
  p.top_k = static_cast<int>(top_k);
  p.num_experts = static_cast<int>(s.E);
  p.num_slots = static_cast<int>(s.M * top_k);
  p.sorted = sorted_c.const_data_ptr<int>();
  p.expert_ids = eids_c.const_data_ptr<int>();
  p.ntpp = ntpp.const_data_ptr<int>();
  // gate/up + SwiGLU + re-quantization
  p.a = bytes(x);
  p.a_scales = bytes(xs);
  p.lda = s.dim;
  weight_map(op, "w", &p.tm_b, w, 2 * s.hidden, s.dim);
  p.b_scales = bytes(ws);
  p.b_rows = static_cast<int>(2 * s.hidden);
  p.up_offset = static_cast<int>(s.hidden);
  p.n_total = static_cast<int>(s.hidden);
  p.k_tiles = static_cast<int>(s.dim / sm90::mxk::BK);
  p.inter = inter.mutable_data_ptr<uint8_t>();
  p.inter_scales = inter_s.mutable_data_ptr<uint8_t>();
  p.ld_inter = s.hidden;
  sm90::mxk::launch<sm90::mxk::GATE_UP>(p, static_cast<int>((s.hidden + sm90::mxk::BN_GU - 1) / sm90::mxk::BN_GU),
                                        s.blocks, stream);
  // down + combine
  p.a = inter.const_data_ptr<uint8_t>();
  p.a_scales = inter_s.const_data_ptr<uint8_t>();
  p.lda = s.hidden;
  weight_map(op, "w2", &p.tm_b, w2, s.dim, s.hidden);
  p.b_scales = bytes(w2s);
  p.b_rows = static_cast<int>(s.dim);
  p.up_offset = 0;
  p.n_total = static_cast<int>(s.dim);
  p.k_tiles = static_cast<int>(s.hidden / sm90::mxk::BK);
  p.ld_out = s.dim;
  const int n_tiles = static_cast<int>((s.dim + sm90::mxk::BN_DOWN - 1) / sm90::mxk::BN_DOWN);
  if (mode == sm90::mxk::DOWN_ATOMIC) {
    p.topk_weights = tw.const_data_ptr<float>();
    p.acc32 = result.mutable_data_ptr<float>();
    sm90::mxk::launch<sm90::mxk::DOWN_ATOMIC>(p, n_tiles, s.blocks, stream);
  } else {
    p.yslots = reinterpret_cast<__nv_bfloat16*>(result.mutable_data_ptr());
    sm90::mxk::launch<sm90::mxk::DOWN_SLOTS>(p, n_tiles, s.blocks, stream);
  }
  return result;
}

void fused_moe_mxfp8_cuda(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                          const at::Tensor& w_scales, const at::Tensor& w2, const at::Tensor& w2_scales,
                          const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                          const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor out,
                          int64_t top_k, int64_t block_m, int64_t /*block_n*/, int64_t /*warp_n*/,
                          int64_t /*stages*/, int64_t /*bpc*/, bool /*split*/) {
  const char* op = "fused_moe_mxfp8";
  MoeShape s{};
  const auto acc32 = run_mx(op, x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
                            num_tokens_post_padded, topk_weights, top_k, block_m, sm90::mxk::DOWN_ATOMIC, s);
  check_out(op, out, s, x);
  out.copy_(acc32);
}

at::Tensor moe_forward_mxfp8_cuda(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                                  const at::Tensor& w_scales, const at::Tensor& w2, const at::Tensor& w2_scales,
                                  const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                                  const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights,
                                  int64_t top_k, int64_t block_m, bool deterministic) {
  MoeShape s{};
  const auto result = run_mx("moe_forward_mxfp8", x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids,
                             expert_ids, num_tokens_post_padded, topk_weights, top_k, block_m,
                             deterministic ? sm90::mxk::DOWN_SLOTS : sm90::mxk::DOWN_ATOMIC, s);
  return deterministic ? combine_in_k_order_cuda(result, topk_weights, s) : result.to(at::kBFloat16);
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY_IMPL(flash_moe, CUDA, m) {
  m.impl("quantize_mxfp8", &flash_moe::quantize_mxfp8_cuda);
  m.impl("fused_moe_mxfp8", &flash_moe::fused_moe_mxfp8_cuda);
  m.impl("moe_forward_mxfp8", &flash_moe::moe_forward_mxfp8_cuda);
}
