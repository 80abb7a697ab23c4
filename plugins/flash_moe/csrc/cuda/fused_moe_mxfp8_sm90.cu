// flash_moe mxfp8 on CUDA sm_90a: quantize_mxfp8 (8 elements per lane), share_exponents_mxfp8 and the fused expert
// GEMMs on e4m3 operands with e8m0 block scales (see docs/notes/flash_moe.md, "mxfp8").
//
// Hopper has no block-scaled tensor-core instruction, so the scales are applied outside the tensor core: every
// wgmma.m64n128k32 e4m3 x e4m3 -> fp32 covers exactly one 32-wide scale block of K, runs into a temporary
// accumulator (scale-d = 0), and is promoted into the fp32 accumulator with both scales:
//   acc[r][c] = fma(tmp[r][c], sw[c][kb] * sx[r][kb], acc[r][c])       (both factors powers of two: exact products)
// Shared exponents (mxfp8.h): where every A row and B row of a pipeline stage carries one scale across the stage's
// 128 K (quantize_mxfp8(..., exponent_block=MXFP8_ALIGN), share_exponents_mxfp8; the producer checks each stage and
// flags it), the 4 wgmmas accumulate into tmp in the tensor core and one promotion per stage applies the scales: a
// quarter of the promotion that binds the per-32 path. Stages are flagged independently, so any mix of per-32 and
// shared scales is computed exactly as given. The intermediate's exponents are shared per 128 hidden columns between
// the two GEMMs (share_exponents_kernel), so the down projection takes the fast path wherever w2's are shared.
// Tile = one aligned block (BLOCK_M = 128 routed slots, one expert) x MXFP8_BLOCK_N = 128 columns. Persistent CTAs of
// 384 threads, one per SM (the grid: min(tiles, SMs)), each walking the tiles blockIdx.x, + gridDim.x, ... of the
// raster over the live blocks, so that an SM does not idle through each tile's prologue, pipeline fill and epilogue
// (Qwen3's 6-stage down tiles): the stage ring runs on across tiles and the routing rows are double-buffered by tile
// parity, a buffer freed (tile_free mbarrier) once every consumer warp is done with its tile:
//   warpgroup 0  producer: cp.async 16-byte copies of the e4m3 A rows (gathered through sorted_token_ids, as in the
//                bf16 kernel; their source addresses kept in registers) into a STAGES-deep ring of 128-byte-swizzled
//                tiles (BK = 128 bytes = 4 scale blocks per stage), the B tile by TMA (four boxes issued by thread 0),
//                plus one 4-byte cp.async per A row (x_scales row-major) and per B row (the blocked weight-scale
//                layout: the 4 bytes of row n at [e][kt][n]). When its copies have landed each
//                producer thread decodes its 8 scale bytes to fp32 into the stage's scale tables (laid out for the
//                consumers' accumulator fragments), the warpgroup ANDs "my 4 + 4 bytes are equal" into the stage's
//                shared-exponent flag, fences the async proxy and arrives on the stage's full mbarrier.
//   warpgroups 1-2  consumers, 64 rows of the tile each, all 128 columns: per K step 4 x (wgmma m64n128k32 into tmp,
//                wait, promote), or on a flagged stage 4 wgmmas into tmp, wait, promote once; the stage is released
//                on its empty mbarrier once its last wgmma has completed. (Four warpgroups of m64n64 were 2-3% faster
//                for the per-32 path, whose promotion binds; on flagged stages m64n128 reads A half as often per FLOP:
//                8% / 3% faster on DeepSeek-V3 / Qwen3, docs/notes/flash_moe.md.)
// Kernel 1 (gate/up): B = 32 gate rows, the matching 32 up rows, the next 32 gate rows, their 32 up rows, so that
//   each 32 hidden columns have their gate and up columns in one warpgroup; epilogue h = silu(g) * u in fp32,
//   re-quantized to mxfp8 per 32 hidden columns (amax across the 4 lanes of a quad holding one row's 32 columns;
//   mx::scale_byte, the rule quantize_mxfp8 uses) into the e4m3 intermediate [padded slots, hidden] and its row-major
//   scales.
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

#ifndef FLASH_MOE_MXFP8_BLOCK_N
#error "FLASH_MOE_MXFP8_BLOCK_N must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_MXFP8_STAGES
#error "FLASH_MOE_MXFP8_STAGES must come from kernel.toml ([flash_moe.constants])"
#endif

namespace flash_moe {
namespace sm90 {
namespace mxk {

constexpr int BM = FLASH_MOE_BLOCK_M;
constexpr int BN = FLASH_MOE_MXFP8_BLOCK_N;
constexpr int BN_GU = BN / 2;
constexpr int SB = FLASH_MOE_MXFP8_SCALE_BLOCK;
constexpr int BK = FLASH_MOE_MXFP8_ALIGN;  // e4m3 bytes per K step: one 128-byte swizzle row
constexpr int KB = BK / SB;                // scale blocks (wgmma k32 steps) per K step
constexpr int STAGES = FLASH_MOE_MXFP8_STAGES;
static_assert(BM == 128, "BLOCK_M must be 128 (two row halves of wgmma m64)");
static_assert(BN == 128, "MXFP8_BLOCK_N must be 128 (the N of one wgmma m64n128k32)");
static_assert(SB == 32 && BK == 128, "mxfp8 kernels: scale block 32 (= wgmma k32 of e4m3) and MXFP8_ALIGN 128");
static_assert(STAGES >= 3 && STAGES <= 5, "MXFP8_STAGES must be 3..5 (shared memory)");

constexpr int WG_M = 64, WG_N = BN;  // one consumer warpgroup's half of the tile: 64 rows, every column
constexpr int CONSUMERS = BM / WG_M;
constexpr int NUM_THREADS = 128 * (1 + CONSUMERS);
constexpr int CONSUMER_WARPS = 4 * CONSUMERS;
static_assert(CONSUMERS == 2, "the register split of sm90_common.cuh (kProducerRegs, kConsumerRegs) is for 384 threads");
constexpr int A_BYTES = BM * BK;
constexpr int B_BYTES = BN * BK;
constexpr int FA_BYTES = BM * KB * 4;  // fp32 x scales [row][kb]
// fp32 w scales [kb][quad][group][pair]: a quad lane's 32 columns contiguous, each quad's run padded to FB_QUAD floats
// so that the 4 quads of a warp, reading their runs at once (ld.shared.v4), hit 4 different bank groups (at 32 floats
// apart all four fell in the same 4 banks: a 4-way conflict on every load).
constexpr int FB_QUAD = BN / 4 + 4;
constexpr int FB_BYTES = KB * 4 * FB_QUAD * 4;
constexpr int RAW_BYTES = (BM + BN) * KB;  // e8m0 bytes as copied: A rows then B rows, 4 bytes each
// rounded up to keep the 1024-byte alignment of the 128B-swizzled tiles
constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + FA_BYTES + FB_BYTES + RAW_BYTES + 1023) / 1024 * 1024;
constexpr int LOOKAHEAD = STAGES - 1;
// one TMA box: 32 gate (or up) rows; gate/up tiles interleave them so that each scale block of the intermediate
// (32 hidden columns) has its gate and up columns in the same warpgroup
constexpr int B_BOX_ROWS = SB;
// ring, the routing rows of two tiles, the ring's and the two tile_free mbarriers, the stages' shared-exponent flags
constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + 2 * BM * (8 + 4) + (2 * STAGES + 2) * 8 + STAGES * 4;

enum Mode : int { GATE_UP = 0, DOWN_ATOMIC = 1, DOWN_SLOTS = 2 };

struct Params {
  const uint8_t* a;         // x (GATE_UP) or the intermediate (DOWN), e4m3 [rows][lda]
  const uint8_t* a_scales;  // e8m0 [rows][lda / 32]
  int64_t lda;
  // B tiles by TMA: a 2-D map over w (GATE_UP, gate rows then up rows) or w2 (DOWN), e4m3 [E * b_rows][K]; boxes of
  // B_BOX_ROWS x BK
  CUtensorMap tm_b;
  const uint8_t* b_scales;  // e8m0 [E][k_tiles][b_rows][KB]
  int b_rows;
  int up_offset;  // GATE_UP: first up row (hidden)
  int n_total;    // valid output columns: hidden (GATE_UP) or dim (DOWN)
  int k_tiles;
  int n_tiles;  // column tiles of the launch
  int blocks;   // aligned blocks of the launch
  int ctas;     // the persistent grid, = gridDim.x (ptxas spilled gridDim.x in the consumers' tile loop, not this)
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
template <int ACCUMULATE>
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "n"(ACCUMULATE));  // scale-d: tmp = A B (0) or tmp + A B (1)
}
// AND of `v` over the producer warpgroup (named barrier 1: its 128 threads only).
__device__ __forceinline__ bool producer_all(bool v) {
  uint32_t all;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.and.pred q, 1, 128, p;\nselp.u32 %0, 1, 0, q;\n}\n"
               : "=r"(all) : "r"(static_cast<uint32_t>(v)) : "memory");
  return all != 0u;
}
__device__ __forceinline__ float decode_scale(uint32_t byte) { return __uint_as_float(mx::scale_bits(byte)); }
__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 lds_f32x4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}
#endif

// Accumulator register i of a consumer thread: row warp * 16 + lane / 4 + 8 * ((i / 2) % 2) of its warpgroup's 64
// rows, column 8 * (i / 4) + 2 * (lane % 4) + i % 2 of its 64.
template <int MODE>
__global__ void __launch_bounds__(NUM_THREADS, 1) moe_mxfp8_kernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // The tiles: the live blocks (block * BM < num_tokens_post_padded, read here: no host sync) x the column tiles, in
  // raster order. 32-bit tile numbers: the host keeps blocks x n_tiles below 2^31, so t + p.ctas cannot wrap.
  const int ntpp = __ldg(p.ntpp);
  const int live = ntpp <= 0 ? 0 : min(p.blocks, (ntpp - 1) / BM + 1);
  const uint32_t tiles = static_cast<uint32_t>(live) * p.n_tiles;
  if (blockIdx.x >= tiles) return;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const gbase = smem_raw + (base - raw);
  // the routing rows of two tiles (tile number i in buffer i & 1): the producer writes tile i + 1's while the
  // consumers still read tile i's
  int64_t* const a_rows = reinterpret_cast<int64_t*>(gbase + STAGES * STAGE_BYTES);
  int* const slot_rows = reinterpret_cast<int*>(gbase + STAGES * STAGE_BYTES + 2 * BM * 8);
  const uint32_t bars = base + STAGES * STAGE_BYTES + 2 * BM * 12;
  auto full_bar = [&](int s) { return bars + 8u * s; };
  auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
  auto tile_free_bar = [&](int b) { return bars + 8u * (2 * STAGES + b); };
  // per stage: 1 when every A row's and B row's 4 scales of the stage are equal (the shared-exponent fast path)
  int* const shared_stage = reinterpret_cast<int*>(gbase + STAGES * STAGE_BYTES + 2 * BM * 12 + (2 * STAGES + 2) * 8);
  auto fa_ptr = [&](int s) { return reinterpret_cast<float*>(gbase + s * STAGE_BYTES + A_BYTES + B_BYTES); };
  auto fb_ptr = [&](int s) { return reinterpret_cast<float*>(gbase + s * STAGE_BYTES + A_BYTES + B_BYTES + FA_BYTES); };
  constexpr int RAW_OFF = A_BYTES + B_BYTES + FA_BYTES + FB_BYTES;

  if (threadIdx.x == 0) {
    init_ring<STAGES>(bars, CONSUMER_WARPS);
    // a routing-row buffer is free again once each consumer warp is done with its tile (epilogue or padding pass)
    for (int b = 0; b < 2; ++b) mbar_init(tile_free_bar(b), CONSUMER_WARPS);
    fence_mbarrier_init();
  }
  __syncthreads();

  // This CTA's tiles: blockIdx.x, + gridDim.x, ... A tile whose expert lies outside the launch is skipped by every
  // warp alike, so the tile number i (its routing-row buffer, its tile_free phase) agrees across warps.
  auto for_each_tile = [&](auto&& body) {
    int i = 0;
    for (uint32_t t = blockIdx.x; t < tiles; t += p.ctas) {
      int block, n_tile;
      raster(static_cast<int>(t), p.n_tiles, live, block, n_tile);
      const int expert = __ldg(p.expert_ids + block);
      if (expert < 0 || expert >= p.num_experts) continue;
      body(i++, block, n_tile * (MODE == GATE_UP ? BN_GU : BN), expert);
    }
  };

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {  // ------------------------------- producer -------------------------------
    producer_registers();
    const int tid = threadIdx.x;
    const int c = tid & 7, r0 = tid >> 3;
    // this thread's own (landed) scale bytes of stage s -> fp32 tables, and whether the stage's tile shares one
    // exponent per row and column across its 4 scale blocks (all 128 producer threads take part)
    auto publish = [&](int s) {
      const uint8_t* rs = gbase + s * STAGE_BYTES + RAW_OFF;
      const uint32_t ra = *reinterpret_cast<const uint32_t*>(rs + 4 * tid);
      const uint32_t rb = *reinterpret_cast<const uint32_t*>(rs + 4 * BM + 4 * tid);
      const bool shared = producer_all(ra == (ra & 0xFFu) * 0x01010101u && rb == (rb & 0xFFu) * 0x01010101u);
      if (tid == 0) shared_stage[s] = shared;
      *reinterpret_cast<float4*>(fa_ptr(s) + KB * tid) =
          make_float4(decode_scale(ra & 0xFF), decode_scale((ra >> 8) & 0xFF), decode_scale((ra >> 16) & 0xFF),
                      decode_scale(ra >> 24));
      float* fb = fb_ptr(s);
      const int g = tid >> 3, q = (tid >> 1) & 3, pr = tid & 1;  // column tid = 8 g + 2 q + pr
#pragma unroll
      for (int j = 0; j < KB; ++j) fb[(j * 4 + q) * FB_QUAD + g * 2 + pr] = decode_scale((rb >> (8 * j)) & 0xFF);
    };
    // K steps issued before this tile, over all earlier tiles, modulo 2 STAGES: the ring runs on across tiles (stage
    // ks % STAGES, phase parity (ks / STAGES) & 1), and the counter never wraps
    uint32_t ks = 0;
    for_each_tile([&](int i, int block, int n_base, int expert) {
      // Tile i's routing rows (row tid, as many rows as producer threads) replace tile i - 2's once all consumer
      // warps are done with those; the producer's own reads of them precede tile i - 1's bar.sync.
      static_assert(BM == 128, "one routing row per producer thread");
      if (i >= 2) mbar_wait(tile_free_bar(i & 1), ((i - 2) / 2) & 1);
      int64_t* const a_row = a_rows + (i & 1) * BM;
      routing_row<BM, MODE == GATE_UP>(p, block, tid, a_row, slot_rows + (i & 1) * BM);
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warps only: each reads others' rows below
      // Row of w (w2) that lands in tile row r: GATE_UP boxes of gate rows and their up rows in turn, DOWN the 128
      // rows of w2 in order. The shape contract (dim, hidden in whole MXFP8_ALIGN) makes every tile full.
      auto weight_row = [&](int r) {
        if constexpr (MODE == GATE_UP) {
          const int box = r / B_BOX_ROWS;
          return n_base + (box / 2) * B_BOX_ROWS + r % B_BOX_ROWS + (box % 2 ? p.up_offset : 0);
        } else {
          return n_base + r;
        }
      };
      const int b_row0 = expert * p.b_rows;
      // this thread's scales: those of B tile row `tid` (its column) and of A row `tid`
      const int s_row = weight_row(tid);
      const uint8_t* const bsc = p.b_scales + static_cast<int64_t>(expert) * p.k_tiles * p.b_rows * KB +
                                 static_cast<int64_t>(s_row) * KB;
      const int64_t a_off = a_row[tid];
      const uint8_t* const asc = p.a_scales + (a_off >= 0 ? a_off / SB : 0);
      // The A rows this thread copies, kept in registers across the K loop; padding rows copy 0 bytes (zero fill)
      // from an in-bounds address.
      const uint8_t* a_src[BM / 16];
      uint32_t a_valid = 0;
#pragma unroll
      for (int r = 0; r < BM / 16; ++r) {
        const int64_t off = a_row[r0 + 16 * r];
        a_src[r] = p.a + (off >= 0 ? off : 0) + c * 16;
        a_valid |= (off >= 0 ? 1u : 0u) << r;
      }
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        const uint32_t k = ks + kt;
        const int stage = acquire_stage<STAGES>(bars, k);
        const uint32_t st = base + stage * STAGE_BYTES;
        const int kofs = kt * BK;
        if (tid == 0) {
          mbar_expect_tx(full_bar(stage), B_BYTES);
#pragma unroll
          for (int box = 0; box < BN / B_BOX_ROWS; ++box)
            tma_load_2d(st + A_BYTES + box * B_BOX_ROWS * BK, &p.tm_b, full_bar(stage), kofs,
                        b_row0 + weight_row(box * B_BOX_ROWS));
        }
#pragma unroll
        for (int r = 0; r < BM / 16; ++r)
          cp_async_16(st + swz(r0 + 16 * r, c), a_src[r] + kofs, (a_valid >> r) & 1u ? 16u : 0u);
        cp_async_4(st + RAW_OFF + 4 * tid, a_off >= 0 ? asc + kt * KB : p.a_scales, a_off >= 0 ? 4u : 0u);
        cp_async_4(st + RAW_OFF + 4 * BM + 4 * tid, bsc + static_cast<int64_t>(kt) * p.b_rows * KB, 4u);
        cp_async_commit();
        if (kt >= LOOKAHEAD - 1) {
          cp_async_wait<LOOKAHEAD - 1>();
          const int done = (k - (LOOKAHEAD - 1)) % STAGES;
          publish(done);
          fence_proxy_async();
          mbar_arrive(full_bar(done));
        }
      }
      // the tile's last copies: drained here, so the next tile starts from an empty cp.async queue
      cp_async_wait<0>();
      const int tail = max(0, p.k_tiles - (LOOKAHEAD - 1));
      for (int kt = tail; kt < p.k_tiles; ++kt) publish((ks + kt) % STAGES);
      fence_proxy_async();
      for (int kt = tail; kt < p.k_tiles; ++kt) mbar_arrive(full_bar((ks + kt) % STAGES));
      ks = (ks + p.k_tiles) % (2 * STAGES);
    });
    return;
  }
  consumer_registers();

  // ------------------------------- consumers -------------------------------
  const int wg = warpgroup - 1;
  const int wg_row = WG_M * wg, wg_col = 0;  // the warpgroup's half of the tile
  const int ctid = threadIdx.x - 128 * warpgroup;
  const int warp = ctid / 32, lane = ctid % 32, quad = lane & 3;
  const int row0 = wg_row + warp * 16 + (lane >> 2);  // the thread's rows: row0 and row0 + 8
  const uint32_t a_off = wg_row * BK, b_off = A_BYTES + wg_col * BK;
  RingPosition<STAGES> ring;  // in step with the producer's ks
  for_each_tile([&](int i, int block, int n_base, int /*expert*/) {
    const int* const slot_of = slot_rows + (i & 1) * BM;
    // The tile's routing rows are in place once its first stage is full: the producer wrote them before any of its
    // arrivals on that barrier (p.k_tiles >= 1: dim and hidden are positive multiples of MXFP8_ALIGN).
    mbar_wait(full_bar(ring.stage), ring.phase);
    // Padding rows (sorted_token_ids -1) end an expert's last block, and the promotion binds this kernel: a warpgroup
    // whose 64 rows are all padding only keeps the ring turning (its wgmmas leave the tensor cores to the others), a
    // warp whose 16 rows are all padding skips its promotion (DeepSeek-V3: ~20% of the rows of the grid are padding).
    if (__all_sync(0xffffffffu, slot_of[wg_row + lane] < 0 && slot_of[wg_row + 32 + lane] < 0)) {
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        mbar_wait(full_bar(ring.stage), ring.phase);
        if (lane == 0) mbar_arrive(empty_bar(ring.stage));
        ring.advance();
      }
      // nothing to store: GATE_UP leaves these rows of the intermediate unwritten, DOWN never reads them
    } else {
      const bool warp_live = __any_sync(0xffffffffu, slot_of[wg_row + 16 * warp + lane % 16] >= 0);
      float acc[WG_N / 2], tmp[WG_N / 2];
#pragma unroll
      for (int r = 0; r < WG_N / 2; ++r) acc[r] = 0.f;
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        mbar_wait(full_bar(ring.stage), ring.phase);
        const uint32_t st = base + ring.stage * STAGE_BYTES;
        const uint64_t da = smem_desc(st + a_off), db = smem_desc(st + b_off);
        const uint32_t fa = st + A_BYTES + B_BYTES + 4 * KB * row0;  // x scales of the thread's rows
        // w scales of its columns: from group wg_col / 8 of its quad's run
        const uint32_t fb = st + A_BYTES + B_BYTES + FA_BYTES + 4 * (quad * FB_QUAD + wg_col / 4);
        auto promote = [&](int j) {  // acc += tmp * sx * sw with the scales of scale block j
          const float s0 = lds_f32(fa + 4 * j), s1 = lds_f32(fa + 4 * (8 * KB + j));  // rows row0 and row0 + 8
          const uint32_t fbj = fb + 4 * (j * 4 * FB_QUAD);
#pragma unroll
          for (int g = 0; g < WG_N / 8; g += 2) {
            const float4 sw = lds_f32x4(fbj + 4 * (2 * g));  // columns of groups g and g + 1
            acc[4 * g + 0] = fmaf(tmp[4 * g + 0], sw.x * s0, acc[4 * g + 0]);
            acc[4 * g + 1] = fmaf(tmp[4 * g + 1], sw.y * s0, acc[4 * g + 1]);
            acc[4 * g + 2] = fmaf(tmp[4 * g + 2], sw.x * s1, acc[4 * g + 2]);
            acc[4 * g + 3] = fmaf(tmp[4 * g + 3], sw.y * s1, acc[4 * g + 3]);
            acc[4 * g + 4] = fmaf(tmp[4 * g + 4], sw.z * s0, acc[4 * g + 4]);
            acc[4 * g + 5] = fmaf(tmp[4 * g + 5], sw.w * s0, acc[4 * g + 5]);
            acc[4 * g + 6] = fmaf(tmp[4 * g + 6], sw.z * s1, acc[4 * g + 6]);
            acc[4 * g + 7] = fmaf(tmp[4 * g + 7], sw.w * s1, acc[4 * g + 7]);
          }
        };
        if (*reinterpret_cast<volatile int*>(shared_stage + ring.stage)) {
          // one exponent per row and column over the stage's 128 K: the 4 wgmmas accumulate in the tensor core
          // (fp32) and one promotion applies the scales: a quarter of the promotion work that binds the per-32 path
          fence_regs<WG_N / 2>(tmp);
          wgmma_fence();
          wgmma_m64n128k32_e4m3<0>(tmp, da, db);
#pragma unroll
          for (int j = 1; j < KB; ++j) wgmma_m64n128k32_e4m3<1>(tmp, da + 2 * j, db + 2 * j);
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs<WG_N / 2>(tmp);
          if (warp_live) promote(0);
        } else {
#pragma unroll
          for (int j = 0; j < KB; ++j) {
            fence_regs<WG_N / 2>(tmp);
            wgmma_fence();
            wgmma_m64n128k32_e4m3<0>(tmp, da + 2 * j, db + 2 * j);  // k32 = 32 bytes = 2 descriptor units
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs<WG_N / 2>(tmp);
            if (warp_live) promote(j);
          }
        }
        if (lane == 0) mbar_arrive(empty_bar(ring.stage));  // all wgmmas of the stage completed; scales are in registers
        ring.advance();
      }

      // ------------------------------- epilogue -------------------------------
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int lr = row0 + 8 * h;
        if constexpr (MODE == GATE_UP) {
          // the warpgroup's columns: per scale block b of the intermediate (32 hidden columns) the gate (groups 8 b ..
          // 8 b + 3) and up (8 b + 4 .. 8 b + 7) of those columns, across the 4 lanes of the quad
          static_assert(WG_N % (2 * SB) == 0, "a consumer's gate/up columns must be whole scale blocks of h");
          const int64_t grow = static_cast<int64_t>(block) * BM + lr;
#pragma unroll
          for (int hb = 0; hb < WG_N / (2 * SB); ++hb) {
            const int hid0 = n_base + wg_col / 2 + hb * SB;
            const float* const ga = acc + 32 * hb;  // 8 groups of 4 registers per scale block
            float hv[8];
            uint32_t amax = 0;
#pragma unroll
            for (int g = 0; g < 4; ++g) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                hv[2 * g + e] = silu_mul(ga[4 * g + 2 * h + e], ga[4 * (g + 4) + 2 * h + e]);
                amax = max(amax, __float_as_uint(hv[2 * g + e]) & 0x7FFFFFFFu);
              }
            }
            amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
            amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
            const uint32_t sb = mx::scale_byte(amax);
            const float inv = __uint_as_float(sb == mx::kNanScale ? 0u : mx::inv_scale_bits(sb));
            if (hid0 < p.n_total) {
              uint8_t* dst = p.inter + grow * p.ld_inter + hid0;
#pragma unroll
              for (int g = 0; g < 4; ++g) {
                const uint16_t v = sb == mx::kNanScale
                                       ? static_cast<uint16_t>(0x7F7F)
                                       : static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(
                                             make_float2(hv[2 * g] * inv, hv[2 * g + 1] * inv), __NV_SATFINITE,
                                             __NV_E4M3));
                *reinterpret_cast<uint16_t*>(dst + 8 * g + 2 * quad) = v;
              }
              if (quad == 0) p.inter_scales[grow * (p.ld_inter / SB) + hid0 / SB] = static_cast<uint8_t>(sb);
            }
          }
        } else {
          const int slot = slot_of[lr];
          if (slot < 0) continue;
          store_down_row<WG_N, MODE == DOWN_ATOMIC>(p, acc, h, quad, slot, n_base + wg_col);
        }
      }
    }
    // every lane's reads of the tile's routing rows are done before lane 0 frees them for tile i + 2
    __syncwarp();
    if (lane == 0) mbar_arrive(tile_free_bar(i & 1));
  });
#else
  __trap();
#endif
}

template <int MODE>
void launch(const Params& p, int n_tiles, int64_t blocks, cudaStream_t stream) {
  launch_rastered<moe_mxfp8_kernel<MODE>, NUM_THREADS, SMEM_BYTES, 1, true>(p, n_tiles, blocks, stream);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// Shared exponents (mxfp8.h) over every BK elements of rows of K, in place: share_exponents_mxfp8, and the
// intermediate between the two GEMMs (its routed rows only: `sorted` given), so that the down projection takes its
// shared-exponent path wherever w2's scales are shared too. Eight lanes per group (16 bytes each, within one block).
constexpr int SHARE_LANES = BK / 16;

__global__ void share_exponents_kernel(uint8_t* __restrict__ data, uint8_t* __restrict__ scales, int64_t K,
                                       int64_t rows, const int* __restrict__ sorted, const int* __restrict__ ntpp,
                                       int num_slots) {
  const int64_t lane_id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t groups = K / BK;
  const int64_t row = lane_id / SHARE_LANES / groups, group = lane_id / SHARE_LANES % groups;
  const int part = static_cast<int>(lane_id % SHARE_LANES);
  if (row >= rows) return;
  if (sorted != nullptr) {  // the intermediate: rows past the routed ones, and padding rows, are never read
    if (row >= __ldg(ntpp)) return;
    const int slot = __ldg(sorted + row);
    if (slot < 0 || slot >= num_slots) return;  // the group's 8 lanes leave together
  }
  uint32_t* const sc = reinterpret_cast<uint32_t*>(scales + row * (K / SB) + group * KB);
  const uint32_t four = *sc;
  const uint32_t mine = (four >> (8 * (part * 16 / SB))) & 0xFFu;
  uint32_t shared = 0;
#pragma unroll
  for (int j = 0; j < KB; ++j) shared = max(shared, (four >> (8 * j)) & 0xFFu);
  __syncwarp(0xFFu << (threadIdx.x % 32 / SHARE_LANES * SHARE_LANES));  // all 8 read the scales before lane 0 writes
  if (part == 0) *sc = shared * 0x01010101u;
  if (shared == mine && shared != mx::kNanScale) return;
  uint4* const chunk = reinterpret_cast<uint4*>(data + row * K + group * BK + part * 16);
  uint4 v = *chunk;
  uint32_t* const words = reinterpret_cast<uint32_t*>(&v);
  // mx::share_element's rounding by the hardware conversions (the CPU op's bytes, tested): e4m3 -> f16 -> f32 exact,
  // times 2^-d exact (or 0 once d >= mx::kShareFlushShift), one RNE back to e4m3; NaN bytes kept.
  const uint32_t d = shared - mine;
  const float factor = d >= mx::kShareFlushShift ? 0.f : __uint_as_float((127u - d) << 23);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if (shared == mx::kNanScale) {
      words[w] = 0x01010101u * mx::kNanElement;
      continue;
    }
    uint32_t out = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint16_t pair = static_cast<uint16_t>(words[w] >> (16 * h));
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      out |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(f.x * factor, f.y * factor), __NV_SATFINITE,
                                                             __NV_E4M3)) << (16 * h);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // NaN elements under a finite scale stay as they were
      const uint32_t byte = (words[w] >> (8 * i)) & 0xFFu;
      if ((byte & 0x7Fu) == mx::kNanElement) out = (out & ~(0xFFu << (8 * i))) | byte << (8 * i);
    }
    words[w] = out;
  }
  *chunk = v;
}

// quantize_mxfp8 (the same mx:: rule as the CPU op: bit-identical results). Blocks of 32 (the fused ops' scale
// block) or MXFP8_ALIGN (quantize_mxfp8's shared exponents): LANES = block / 8 lanes per block, 8 elements each, so
// that a warp reads whole blocks in one coalesced sweep (16-byte loads of bf16 / fp16, two of fp32) and writes their
// e4m3 bytes as 8-byte stores; the block's amax meets across its lanes by shuffles. Other block sizes, or inputs not
// 16-byte aligned: one thread per block.
constexpr int Q_ELEMS = 8;

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

template <typename T, int LANES>
__global__ void quantize_lanes_kernel(const T* __restrict__ in, uint8_t* __restrict__ data,
                                      uint8_t* __restrict__ scales, int64_t blocks) {
  constexpr int block = LANES * Q_ELEMS;
  const int64_t lane_id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b = lane_id / LANES;
  const int part = static_cast<int>(lane_id % LANES);
  const bool valid = b < blocks;  // the last warp's spare lanes still take part in the shuffles
  float v[Q_ELEMS] = {};
  if (valid) load8(in + b * block + part * Q_ELEMS, v);
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < Q_ELEMS; ++i) amax = max(amax, __float_as_uint(v[i]) & 0x7FFFFFFFu);
#pragma unroll
  for (int m = 1; m < LANES; m *= 2) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, m));
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
  *reinterpret_cast<uint2*>(data + b * block + part * Q_ELEMS) = q;
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

void share_exponents(uint8_t* data, uint8_t* scales, int64_t K, int64_t rows, const int* sorted, const int* ntpp,
                     int num_slots, cudaStream_t stream) {
  const int64_t lanes = rows * (K / BK) * SHARE_LANES;
  if (lanes == 0) return;
  share_exponents_kernel<<<static_cast<unsigned>((lanes + 255) / 256), 256, 0, stream>>>(data, scales, K, rows, sorted,
                                                                                      ntpp, num_slots);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One launch of either kernel above for `blocks` scale blocks of `block` elements of `in`.
template <typename T>
void quantize(const T* in, uint8_t* data, uint8_t* scales, int64_t blocks, int block, cudaStream_t stream) {
  constexpr int threads = 256;
  const bool aligned = reinterpret_cast<uintptr_t>(in) % 16 == 0;
  if (block == SB && aligned) {
    const auto grid = static_cast<unsigned>((blocks * (SB / Q_ELEMS) + threads - 1) / threads);
    quantize_lanes_kernel<T, SB / Q_ELEMS><<<grid, threads, 0, stream>>>(in, data, scales, blocks);
  } else if (block == BK && aligned) {
    const auto grid = static_cast<unsigned>((blocks * (BK / Q_ELEMS) + threads - 1) / threads);
    quantize_lanes_kernel<T, BK / Q_ELEMS><<<grid, threads, 0, stream>>>(in, data, scales, blocks);
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

std::tuple<at::Tensor, at::Tensor> share_exponents_mxfp8_cuda(const at::Tensor& data, const at::Tensor& scales) {
  const char* op = "share_exponents_mxfp8";
  const auto d = as_bits_of(data, at::kFloat8_e4m3fn), s = as_bits_of(scales, at::kFloat8_e8m0fnu);
  check_share_args(d, s);
  TORCH_CHECK(d.is_cuda(), op, " (CUDA): data must be a CUDA tensor, got ", d.device());
  const c10::cuda::CUDAGuard guard(d.device());
  auto q = d.contiguous().clone();
  auto sc = s.contiguous().clone();
  const int64_t K = d.size(-1);
  sm90::mxk::share_exponents(reinterpret_cast<uint8_t*>(q.mutable_data_ptr()),
                             reinterpret_cast<uint8_t*>(sc.mutable_data_ptr()), K, K ? q.numel() / K : 0, nullptr,
                             nullptr, 0, c10::cuda::getCurrentCUDAStream());
  return {q, sc};
}

const uint8_t* bytes(const at::Tensor& t) { return reinterpret_cast<const uint8_t*>(t.const_data_ptr()); }

void weight_map(const char* op, const char* name, CUtensorMap* map, const at::Tensor& w, int64_t rows, int64_t K) {
  sm90::expert_weight_map(op, name, map, w, rows, K, CU_TENSOR_MAP_DATA_TYPE_UINT8, sm90::mxk::B_BOX_ROWS,
                          sm90::mxk::BK);
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
  // DOWN_SLOTS: only the routed slots' rows are written and read (as in the bf16 forward: not zeroed)
  at::Tensor result = mode == sm90::mxk::DOWN_ATOMIC ? at::zeros({s.M, s.dim}, x.options().dtype(at::kFloat))
                                                     : at::empty({s.M * top_k, s.dim}, x.options().dtype(at::kBFloat16));
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
  sm90::mxk::share_exponents(p.inter, p.inter_scales, s.hidden, padded, p.sorted, p.ntpp, p.num_slots, stream);
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
  const int n_tiles = static_cast<int>((s.dim + sm90::mxk::BN - 1) / sm90::mxk::BN);
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
  return deterministic ? combine_in_k_order_cuda(result, topk_weights, sorted_token_ids, expert_ids,
                                                num_tokens_post_padded, s)
                       : result.to(at::kBFloat16);
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY_IMPL(flash_moe, CUDA, m) {
  m.impl("quantize_mxfp8", &flash_moe::quantize_mxfp8_cuda);
  m.impl("share_exponents_mxfp8", &flash_moe::share_exponents_mxfp8_cuda);
  m.impl("fused_moe_mxfp8", &flash_moe::fused_moe_mxfp8_cuda);
  m.impl("moe_forward_mxfp8", &flash_moe::moe_forward_mxfp8_cuda);
}
