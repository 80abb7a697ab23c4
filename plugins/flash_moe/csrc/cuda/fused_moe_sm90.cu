// flash_moe on CUDA sm_90a: the fused expert GEMMs (hand-written wgmma; see docs/notes/flash_moe.md).
//
// One kernel template over tiles of one aligned block of BLOCK_M = 128 routed slots (one expert) x one 256-wide column
// tile, 384 threads per CTA (gate/up: one CTA per tile, in CTA pairs, or persistent with many routed slots per expert;
// down and the backward's: persistent, one CTA per SM walking tiles, its ring and routing rows running on from tile to
// tile):
//   warpgroup 0  producer: cp.async 16-byte copies into a STAGES-deep ring of 128-byte-swizzled shared memory. The A
//                rows are gathered: row r of the block reads x[sorted_token_ids[r] / top_k] (zero-filled for -1
//                padding), so the token permutation never touches global memory. B rows are the expert's weight
//                rows. Each producer thread ends a stage with cp.async.mbarrier.arrive.noinc on the stage's "full"
//                mbarrier (128 arrivals), which fires when its copies land: the producer never waits for memory,
//                only for a free stage. Consumers fence.proxy.async after the wait (cp.async writes are generic-proxy,
//                wgmma reads through the async proxy).
//   warpgroups 1-2  consumers, 64 rows each: wgmma.m64n256k16 bf16 -> fp32 from both K-major swizzled tiles, one
//                wgmma group in flight, releasing the previous stage on its "empty" mbarrier (one arrival per warp).
// Kernel 1 (gate/up): the B tile is 128 gate rows + the 128 matching up rows, so each thread holds gate and up of
//   the same columns: h = silu(g) * u in fp32, stored as bf16 to the intermediate [padded slots, hidden].
// Kernel 2 (down): A = intermediate rows of the block, B = w2[e] rows; the epilogue either adds
//   topk_weight * y (fp32) into an fp32 [M, dim] buffer with float2 atomics (fused_moe_bf16 / moe_forward), or
//   stores y as bf16 per slot (moe_forward deterministic; the top_k slots of a token are then summed in k order).
// Kernel 3 (the backward's dH, moe_grad_gate_up; persistent like down): A = grad_out rows gathered like x's, B =
//   w2[e] read N-major (w2 is (dim, hidden): for grad_h = grad_out W2 the K dimension is dim, and 256 hidden columns
//   are four 64-column TMA boxes; wgmma's transposed-B form); the epilogue takes g | u of the slot's compact row and
//   writes the SwiGLU derivative (dg, du, p h) and each slot's partial <grad_h, h> over the tile's columns (summed
//   over the column tiles afterwards in a fixed order: deterministic). grad_h itself never reaches memory.
// Kernel 4 (the backward's dX, moe_grad_x): persistent like down; A = the block's rows of dg, then of du (compact rows
//   through dst_rows, K = 2 hidden), B = w1[e], then w3[e], N-major as in kernel 3 (they are (hidden, dim): K =
//   hidden, N = dim); the epilogue adds the fp32 result into dx [M, dim] with float2 atomics (DX_ATOMIC) or stores
//   it as bf16 per slot (DX_SLOTS: summed over a token's slots in k order afterwards, bitwise reproducible).
// Transposed weights ((E, in, out), transformers' is_transposed) are read in place with every B tile's majorness
// flipped (WEIGHTS = kInOut: N-major in the gate/up and down GEMMs, K-major in dH and dX); gate and up interleaved
// column by column in one transposed tensor (gpt-oss) are read as 256 consecutive columns, 128 (gate, up) pairs, whose
// two values land in the same thread (kInOutPairs: the gate/up epilogue pairs them); dX then runs over the one
// interleaved tensor, K = 2 hidden, against dg | du interleaved the same way.
// LoRA adapters (moe_lora_forward / moe_lora_gate_up; expert_ids then hold (expert, adapter) groups v = e n + a): the
// shrink modes compute each block's rank-r rows u = s_a z A[a, e]^T (z: x rows gathered, or the intermediate's rows),
// rounded once to bf16, into a padded-row buffer; the gate/up and down modes with LORA_EXTENSION added read them after
// their base K tiles as more K tiles, `[z | u] [W | B]^T`: A = the block's u rows by TMA, B = B[a, e]'s rows of the
// column tile by TMA (K-major whatever the base weights' form), so the epilogues see base + adapter sums unchanged.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../flash_moe.h"
#include "grid_stride.cuh"
#include "routing.cuh"
#include "sm90_common.cuh"

#include <prime_kernels/tma.h>

#ifndef FLASH_MOE_BLOCK_N_GATE_UP
#error "FLASH_MOE_BLOCK_N_GATE_UP must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_BLOCK_N_DOWN
#error "FLASH_MOE_BLOCK_N_DOWN must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_BLOCK_K
#error "FLASH_MOE_BLOCK_K must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_CLUSTER_BLOCKS
#error "FLASH_MOE_CLUSTER_BLOCKS must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_STAGES
#error "FLASH_MOE_STAGES must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_PERSISTENT_GATE_UP_MIN_SLOTS
#error "FLASH_MOE_PERSISTENT_GATE_UP_MIN_SLOTS must come from kernel.toml ([flash_moe.constants])"
#endif

namespace flash_moe {
namespace sm90 {

constexpr int BM = FLASH_MOE_BLOCK_M;
constexpr int BN_GU = FLASH_MOE_BLOCK_N_GATE_UP;
constexpr int BN_DOWN = FLASH_MOE_BLOCK_N_DOWN;
constexpr int BK = FLASH_MOE_BLOCK_K;
constexpr int STAGES = FLASH_MOE_STAGES;
constexpr int CLUSTER_BLOCKS = FLASH_MOE_CLUSTER_BLOCKS;
constexpr int64_t PERSISTENT_GATE_UP_MIN_SLOTS = FLASH_MOE_PERSISTENT_GATE_UP_MIN_SLOTS;
constexpr int BN = WGMMA_N;
static_assert(BM == 128, "BLOCK_M must be 128 (two consumer warpgroups of wgmma m64)");
static_assert(2 * BN_GU == BN && BN_DOWN == BN, "BLOCK_N_GATE_UP must be 128 and BLOCK_N_DOWN 256 (m64n256k16)");
static_assert(BK == 64, "BLOCK_K must be 64 (one 128-byte swizzle row of bf16)");
static_assert(CLUSTER_BLOCKS == kPairCtas, "CLUSTER_BLOCKS must be core's kPairCtas (weight tiles shared by CTA pairs)");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES must be 2 to 4 (shared memory)");
static_assert(kDimAlign % BK == 0 && kHiddenAlign % BK == 0, "DIM_ALIGN and HIDDEN_ALIGN must be multiples of BLOCK_K");
static_assert(BK % 32 == 0, "the epilogues access whole groups of 32 columns of dim / hidden (store_row_bf16)");

constexpr int CONSUMERS = BM / 64;  // consumer warpgroups, 64 rows each (wgmma m64)
constexpr int NUM_THREADS = 128 * (1 + CONSUMERS);
constexpr int CONSUMER_WARPS = 4 * CONSUMERS;
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
constexpr int B_BOX_ROWS = BN / 2;  // one TMA box: the gate (or up) half of a gate/up tile, half a down tile
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = 1024 /* alignment slack */ + STAGES * STAGE_BYTES + 2 * BM * 8 /* A row offsets */ +
                           2 * BM * 4 /* slots */ + (2 * STAGES + 4) * 8 /* mbarriers */ + 2 * 4 /* tile numbers */;

// GATE_UP_SAVE (the backward's recomputation): the epilogue stores the gate and up pre-activations as bf16 to row
// dst_rows[padded row] of a compact [routed slots, 2 hidden] tensor instead of h.
// GATE_UP_SAVE: the backward's recomputation; GATE_UP_AND_SAVE: the forward keeping g | u for the backward.
// DH_SWIGLU: the backward's grad_h = grad_out W2 with the SwiGLU derivative in the epilogue (kernel 3 above).
// DX_ATOMIC, DX_SLOTS: the backward's dx (kernel 4 above).
// *_PERSISTENT: the gate/up modes' persistent twins (the host picks one per call: gate_up_persistent).
// LORA_SHRINK_X: the LoRA shrink u = s_a x [A_gate; A_up]^T of the gathered x rows (gate and up adapters in the two
// halves of the B tile); LORA_SHRINK_H: u = s_a h A_down^T of the intermediate's rows; LORA_SHRINK_D (dX's):
// w = s_a [dg B_gate | du B_up] of the compact dg, du rows (K = 2 hidden as in DX, B N-major); LORA_SHRINK_G (dH's):
// v = s_a grad_out B_down of the gathered grad_out rows (B N-major); LORA_SHRINK_P (dH's): p bf16(s_a h A_down^T) of
// the compact h rows (p: the slot's routing weight). All persistent, one column tile.
enum Mode : int {
  GATE_UP = 0, DOWN_ATOMIC = 1, DOWN_SLOTS = 2, GATE_UP_SAVE = 3, GATE_UP_AND_SAVE = 4, DH_SWIGLU = 5, DX_ATOMIC = 6,
  DX_SLOTS = 7, GATE_UP_PERSISTENT = 8, GATE_UP_SAVE_PERSISTENT = 9, GATE_UP_AND_SAVE_PERSISTENT = 10,
  LORA_SHRINK_X = 11, LORA_SHRINK_H = 12, LORA_SHRINK_D = 13, LORA_SHRINK_G = 14, LORA_SHRINK_P = 15
};
// Added to a persistent gate/up, a down, a dH or a dX mode: blocks of (expert, adapter) groups, and the adapters' K
// extension (Params::ext_tiles K tiles after the base ones, possibly none). A flag rather than more modes: the base
// modes' instantiations stay what they were.
enum ModeFlag : int { LORA_EXTENSION = 16 };
constexpr int persistent_twin(int mode) {
  return mode == GATE_UP ? GATE_UP_PERSISTENT : mode == GATE_UP_SAVE ? GATE_UP_SAVE_PERSISTENT
                                              : mode == GATE_UP_AND_SAVE ? GATE_UP_AND_SAVE_PERSISTENT : mode;
}
constexpr bool lora_extension(int mode) { return (mode & LORA_EXTENSION) != 0; }
constexpr int with_lora_extension(int mode) { return mode | LORA_EXTENSION; }
// What the kernel computes: a twin's base mode (the twins differ in their launch only), without the LoRA flag.
constexpr int base_mode(int flagged) {
  const int mode = flagged & ~LORA_EXTENSION;
  return mode == GATE_UP_PERSISTENT ? GATE_UP : mode == GATE_UP_SAVE_PERSISTENT ? GATE_UP_SAVE
                                              : mode == GATE_UP_AND_SAVE_PERSISTENT ? GATE_UP_AND_SAVE : mode;
}
// The GEMMs that run persistent (one CTA per SM walking claimed tiles; see moe_gemm_kernel); the gate/up GEMMs' base
// modes run one CTA per tile in CTA pairs.
constexpr bool persistent_mode(int flagged) {
  const int mode = flagged & ~LORA_EXTENSION;
  return mode == DOWN_ATOMIC || mode == DOWN_SLOTS || mode == DX_ATOMIC || mode == DX_SLOTS || mode == DH_SWIGLU ||
         mode == GATE_UP_PERSISTENT || mode == GATE_UP_SAVE_PERSISTENT || mode == GATE_UP_AND_SAVE_PERSISTENT ||
         mode == LORA_SHRINK_X || mode == LORA_SHRINK_H || mode == LORA_SHRINK_D || mode == LORA_SHRINK_G ||
         mode == LORA_SHRINK_P;
}
// How the weights lie (the host reads it off the strides of the ops' (E, out, in) views): kOutIn, each expert's
// (out, in) rows K-contiguous for the forward (today's form); kInOut, transposed (E, in, out); kInOutPairs, transposed
// with gate and up interleaved column by column in one tensor (gate/up GEMMs only; its down and dX GEMMs read kInOut).
enum WeightForm : int { kOutIn = 0, kInOut = 1, kInOutPairs = 2 };
// The backward's N-major B tiles: atoms of 64 columns (128 bytes of bf16, the 128-byte swizzle's row), a TMA box each.
constexpr int MN_ATOMS = BN / MN_ATOM;

struct Params {
  // B tiles by TMA: 2-D maps over the weight rows (boxes of B_BOX_ROWS x BK); expert e's row n is map row
  // e * b_rows_per_expert + n. GATE_UP: tm_b0 the gate rows, tm_b1 the up rows; DOWN: tm_b0 w2's rows.
  CUtensorMap tm_b0;
  CUtensorMap tm_b1;
  int b_rows_per_expert;
  const __nv_bfloat16* a;  // x (GATE_UP) or the intermediate (DOWN)
  int64_t lda;
  int n_total;  // valid output columns: hidden (GATE_UP) or dim (DOWN)
  int k_tiles;
  int n_tiles;  // column tiles of the launch
  int blocks;   // aligned blocks of the launch
  int ctas;     // persistent launches: CTAs of the grid
  int* tile_counter;  // persistent launches: tiles claimed after each CTA's first (zero at launch)
  bool raster_runs;   // the tile order: raster_by_expert() if set, else raster() (sm90::launch sets it: raster_runs)
  int top_k;
  int num_experts;
  int num_slots;  // M * top_k: sorted entries outside [0, num_slots) are padding
  const int* sorted;
  const int* expert_ids;
  const int* ntpp;
  __nv_bfloat16* inter;  // GATE_UP(_AND_SAVE): h = silu(g) u [padded, hidden]
  int64_t ld_inter;
  __nv_bfloat16* saved;  // GATE_UP_SAVE, GATE_UP_AND_SAVE: the pre-activations g | u [slots, 2 hidden], compact rows
  int64_t ld_saved;
  const int* dst_rows;  // their row of each padded row, -1 for padding
  int dst_limit;        // rows of `saved` (M * top_k)
  const float* topk_weights;  // DOWN_ATOMIC
  float* acc32;               // DOWN_ATOMIC output [M, dim]
  __nv_bfloat16* yslots;      // DOWN_SLOTS output [M * top_k, dim]
  int64_t ld_out;             // dim
  // DH_SWIGLU: g | u in `saved` (the compact rows dst_rows names), the slot weights in topk_weights; outputs at the
  // compact rows: dg, du (row stride ld_grad: side by side in one [slots, 2 hidden] tensor), p h [slots, hidden] (row
  // stride n_total); and <grad_h, h> of each slot over each column tile, dot_partials [n_tiles, num_slots]
  __nv_bfloat16* grad_gate;
  __nv_bfloat16* grad_up;
  int64_t ld_grad;
  __nv_bfloat16* weighted_h;
  __nv_bfloat16* h_rows;  // DH_SWIGLU with LORA_EXTENSION: h itself, bf16, compact rows (row stride n_total)
  float* dot_partials;
  // DX_*: A's second half (du rows; `a` holds dg's), K tiles per half; tm_b0 / tm_b1 map w1 / w3
  const __nv_bfloat16* a2;
  int k_half;
  // Expert biases, row-major with n_total columns (nullptr: none): the gate/up GEMMs' b_gate / b_up, the down GEMM's
  // b2; the gpt_oss activation's constants
  const __nv_bfloat16* b_gate;
  const __nv_bfloat16* b_up;
  const __nv_bfloat16* b2;
  float alpha, limit;
  // LoRA (the shrink modes and those with LORA_EXTENSION): expert_ids hold groups v = e lora_n + a (num_experts: E
  // lora_n), adapter a of local expert e is group ag = a lora_experts + e of the adapter tensors' 2-D views, whose
  // rows of one group are lora_group_rows[i] (the rank for A, out for B) of map i.
  int lora_n;
  int lora_experts;
  int lora_group_rows[2];
  // The shrinks: tm_b0 / tm_b1 map the 2-D views of the two B-tile halves' A adapters (n E r, in) (boxes of B_BOX_ROWS
  // rows: rows past the rank are never stored); u = s_a acc of the first lora_rank[0] columns of half 0 and
  // lora_rank[1] of half 1, side by side, goes to row `padded row` of u_out [blocks BM, ld_u] and, where u_compact
  // is set, to the compact row (dst_rows) of u_compact [slots, ld_u].
  const float* lora_scaling;  // (n,)
  int lora_rank[2];
  __nv_bfloat16* u_out;
  __nv_bfloat16* u_compact;
  int64_t ld_u;
  // The K extension, forward (gate/up, down): ext_tiles K tiles of BK, A from tm_ua[0] (the block's BM u rows
  // [u_0 | u_1], K-major; columns past them read as zeros), the B tile's two halves from tm_ub[i] (B's 2-D view
  // (n E out, r), K-major: group rows lora_group_rows[i], boxes B_BOX_ROWS x BK) at column k + ext_shift[i]: a gated
  // gate/up tile's gate half reads B_gate at shift 0 and its up half B_up at shift -r_gate (the zeros left of column 0
  // line B_up's columns up with u_up's in A: each half multiplies its own adapter's u, one m64n256k16 per k16 as in
  // the base K tiles); a half without an adapter reads at a shift past every column (all zeros); every other tile
  // reads one B's 2 B_BOX_ROWS consecutive rows through both halves.
  // dX: the first ext_split tiles are the gate adapter's, the others the up adapter's (i = 0, 1): A from tm_ua[i] (w_i
  // of the compact rows, the block's from its first compact row; columns past r_i zeros), B N-major from tm_ub[i]
  // (A_i's 2-D view (n E r_i, dim), boxes BK rows x MN_ATOM columns; rows past r_i meet A's zero columns). dH: the
  // same with i = 0 alone (v of the compact rows against A_down, (n E r, hidden)).
  // LORA_SHRINK_D reads its N-major B from tm_b0 (the dg tiles) / tm_b1 (du) at column ext_shift[0] / ext_shift[1]
  // (B_gate at 0, B_up at -r_gate: w_up lands r_gate columns on); LORA_SHRINK_G from tm_b0 (B_down) at ext_shift[0].
  CUtensorMap tm_ua[2];
  CUtensorMap tm_ub[2];
  int ext_shift[2];
  int ext_tiles;
  int ext_split;
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void fence_acc(float* d) { fence_regs<128>(d); }

// DH_SWIGLU's epilogue for accumulator row h of a consumer thread: grad_h (unweighted, fp32) of slot `slot` over the
// columns n0 + 8 j + 2 quad + e, g | u from compact row `row`; writes dg, du, p h there (activate_backward with
// dh = p grad_h; relu2: g and dg alone), kStoreH h as well, and returns this thread's part of <grad_h, h>.
// Every access is 16 bytes per lane through quad_transpose (groups of 4 j). The g | u loads of kChunk groups are issued
// before any of their stores: the compiler cannot prove the outputs do not alias g | u, so a load after a store waits
// for it (SASS of the first version: one load pair, the math and three stores per column group, 64 DRAM round trips
// in a row per thread and tile).
constexpr int kChunk = 4;
template <int ACT, bool kStoreH>
__device__ __forceinline__ float activation_grad_row(const Params& p, const float* acc, int h, int quad, int slot,
                                                     int row, int n0) {
  constexpr bool kGated = ACT != kActRelu2;
  const float w = __ldg(p.topk_weights + slot);
  const int64_t grad_base = static_cast<int64_t>(row) * p.ld_grad + n0;
  const int64_t h_base = static_cast<int64_t>(row) * p.n_total + n0;
  const __nv_bfloat16* gate = p.saved + static_cast<int64_t>(row) * p.ld_saved + n0;
  float dot = 0.f;
#pragma unroll
  for (int g0 = 0; g0 < BN / 32; g0 += kChunk) {
    uint4 g4[kChunk] = {}, u4[kChunk] = {};
#pragma unroll
    for (int gg = 0; gg < kChunk; ++gg) {
      const int col = 32 * (g0 + gg) + 8 * quad;
      if (n0 + 32 * (g0 + gg) < p.n_total) {  // n_total: a multiple of 32 (whole groups)
        g4[gg] = *reinterpret_cast<const uint4*>(gate + col);
        if constexpr (kGated) u4[gg] = *reinterpret_cast<const uint4*>(gate + p.n_total + col);
      }
    }
#pragma unroll
    for (int gg = 0; gg < kChunk; ++gg) {
      const int g = g0 + gg;
      if (n0 + 32 * g >= p.n_total) break;
      const uint4 gt = quad_transpose(g4[gg], quad), ut = kGated ? quad_transpose(u4[gg], quad) : gt;
      const uint32_t gw[4] = {gt.x, gt.y, gt.z, gt.w}, uw[4] = {ut.x, ut.y, ut.z, ut.w};
      uint32_t dgw[4], duw[4], phw[4], hw[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 gv2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gw[k]));
        const float2 uv2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&uw[k]));
        float dg[2], du[2] = {0.f, 0.f}, ph[2], hs[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float gh = acc[4 * (4 * g + k) + 2 * h + e];
          const float hv = activate_backward<ACT>(e ? gv2.y : gv2.x, e ? uv2.y : uv2.x, gh * w, p.alpha, p.limit,
                                                  dg[e], du[e]);
          dot += gh * hv;
          ph[e] = w * hv;
          hs[e] = hv;
        }
        dgw[k] = bf16x2_bits(dg[0], dg[1]);
        duw[k] = bf16x2_bits(du[0], du[1]);
        phw[k] = bf16x2_bits(ph[0], ph[1]);
        hw[k] = bf16x2_bits(hs[0], hs[1]);
      }
      const int col = 32 * g + 8 * quad;
      *reinterpret_cast<uint4*>(p.grad_gate + grad_base + col) =
          quad_transpose(make_uint4(dgw[0], dgw[1], dgw[2], dgw[3]), quad);
      if constexpr (kGated) {
        *reinterpret_cast<uint4*>(p.grad_up + grad_base + col) =
            quad_transpose(make_uint4(duw[0], duw[1], duw[2], duw[3]), quad);
      }
      *reinterpret_cast<uint4*>(p.weighted_h + h_base + col) =
          quad_transpose(make_uint4(phw[0], phw[1], phw[2], phw[3]), quad);
      if constexpr (kStoreH) {  // the LoRA rows' h (LORA_SHRINK_P reads it)
        *reinterpret_cast<uint4*>(p.h_rows + h_base + col) =
            quad_transpose(make_uint4(hw[0], hw[1], hw[2], hw[3]), quad);
      }
    }
  }
  return dot;
}

// The shrinks' epilogue for accumulator row h of a consumer thread (padded row `row`): u = s acc, rounded once to
// bf16, of columns [0, lora_rank[0]) of the gate half and [0, lora_rank[1]) of the up half, side by side, to u_out's
// row (u_out set) and the row's compact row (u_compact set); kWeighted: bf16(weight u) instead (LORA_SHRINK_P, as the
// CPU op scales the rounded rows by the routing weight). Ranks are multiples of 8: whole bf16 pairs, 4-byte aligned.
template <bool kWeighted>
__device__ __forceinline__ void store_lora_rows(const Params& p, const float* acc, int h, int quad, int row, float s,
                                                float weight) {
  __nv_bfloat16* const padded = p.u_out != nullptr ? p.u_out + static_cast<int64_t>(row) * p.ld_u : nullptr;
  const int compact = p.u_compact != nullptr ? p.dst_rows[row] : -1;  // -1: padding
  __nv_bfloat16* const dense = compact >= 0 && compact < p.dst_limit
                                   ? p.u_compact + static_cast<int64_t>(compact) * p.ld_u : nullptr;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int rank = p.lora_rank[half], first = half ? p.lora_rank[0] : 0;
#pragma unroll
    for (int j = 0; j < BN_GU / 8; ++j) {
      const int col = 8 * j + 2 * quad;
      if (col >= rank) break;
      const int i = 4 * (j + half * BN_GU / 8) + 2 * h;
      uint32_t bits = bf16x2_bits(s * acc[i], s * acc[i + 1]);
      if constexpr (kWeighted) {
        const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
        bits = bf16x2_bits(weight * u.x, weight * u.y);
      }
      if (padded != nullptr) *reinterpret_cast<uint32_t*>(padded + first + col) = bits;
      if (dense != nullptr) *reinterpret_cast<uint32_t*>(dense + first + col) = bits;
    }
  }
}

// One ring stage's K tile as wgmma k16 steps into acc, then a wait for the previous tile's: A (K-major: 16 K = 32
// bytes a step) at a_off in the stage, B after the A tile, K-major or N-major (16 K rows = 2048 bytes a step). The
// tile's first step overwrites acc unless `accumulate` (every tile but a block's first).
template <bool kBMajorN>
__device__ __forceinline__ void mma_k_tile(float (&acc)[128], uint32_t stage, uint32_t a_off, bool accumulate) {
  const uint64_t da = smem_desc(stage + a_off);
  const uint64_t db = kBMajorN ? smem_desc_mn(stage + A_BYTES, B_BYTES / MN_ATOMS) : smem_desc(stage + A_BYTES);
  fence_acc(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    if constexpr (kBMajorN) {
      wgmma_m64n256k16_bf16_bn(acc, da + 2 * kk, db + kk * (16 * 128 >> 4), (accumulate || kk > 0) ? 1 : 0);
    } else {
      wgmma_m64n256k16_bf16(acc, da + 2 * kk, db + 2 * kk, (accumulate || kk > 0) ? 1 : 0);
    }
  }
  wgmma_commit();
  fence_acc(acc);
  wgmma_wait<1>();
  fence_acc(acc);
}
#endif

// CTA or tile number -> (aligned block, column tile) in the launch's order (Params::raster_runs).
__device__ __forceinline__ void tile_order(const Params& p, int cta, int blocks, int& block, int& n_tile) {
  if (p.raster_runs) {
    raster_by_expert(cta, p.n_tiles, blocks, p.expert_ids, block, n_tile);
  } else {
    raster(cta, p.n_tiles, blocks, block, n_tile);
  }
}

// Accumulator register i of a consumer thread holds row (warp * 16 + lane / 4 + 8 * ((i / 2) % 2)) and column
// (8 * (i / 4) + 2 * (lane % 4) + i % 2) of its warpgroup's 64 x 256 tile.
// ACT: the activation (sm90_common.cuh) of the gate/up and dH modes' epilogues; relu2's gate/up tiles are BN
// consecutive w1 rows (no up half), its h columns all BN of them.
// WEIGHTS: their WeightForm; kPairs (the gate/up modes with kInOutPairs): column pair 4 j + quad of a tile holds gate
// (register 4 j + 2 h) and up (+ 1).
template <int MODE, int ACT, int WEIGHTS>
__global__ void __launch_bounds__(NUM_THREADS, 1) moe_gemm_kernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kMode = base_mode(MODE);  // a persistent twin computes what its base mode does
  constexpr bool kGateUp = kMode == GATE_UP || kMode == GATE_UP_SAVE || kMode == GATE_UP_AND_SAVE;
  static_assert(WEIGHTS != kInOutPairs || (kGateUp && ACT != kActRelu2), "column pairs: the gated gate/up GEMMs only");
  constexpr bool kPairs = WEIGHTS == kInOutPairs;
  // shrinks with K-major B in the B tile's two halves, and with N-major B (4 atoms, shifted columns)
  constexpr bool kShrink = kMode == LORA_SHRINK_X || kMode == LORA_SHRINK_H || kMode == LORA_SHRINK_P;
  constexpr bool kShrinkN = kMode == LORA_SHRINK_D || kMode == LORA_SHRINK_G;
  constexpr bool kDx = kMode == DX_ATOMIC || kMode == DX_SLOTS;
  // the LoRA K extension after the base K tiles (LORA_EXTENSION)
  constexpr bool kExtension = lora_extension(MODE);
  static_assert(!kExtension || (persistent_mode(MODE) && (kGateUp || kMode == DOWN_ATOMIC || kMode == DOWN_SLOTS ||
                                                          kDx || kMode == DH_SWIGLU)),
                "the LoRA extension: persistent gate/up, down, dH and dX GEMMs");
  static_assert(!(kShrink || kShrinkN) || WEIGHTS == kOutIn, "the shrinks read the adapters in their own layout");
  // expert_ids hold (expert, adapter) groups
  constexpr bool kGroups = kExtension || kShrink || kShrinkN;
  // A's rows: compact rows (dX: of dg, then du, K = 2 hidden)
  constexpr bool kCompactRows = kDx || kMode == LORA_SHRINK_D || kMode == LORA_SHRINK_P;
  // B tile: BN_GU gate rows (or columns) + the same BN_GU up ones; the shrinks: the gate and up adapters' A rows
  constexpr bool kHalves = (kGateUp && ACT != kActRelu2 && !kPairs) || kShrink;
  constexpr bool kDh = kMode == DH_SWIGLU;
  // A rows gathered from a [tokens, dim] tensor, K = dim
  constexpr bool kGather = kGateUp || kDh || kMode == LORA_SHRINK_X || kMode == LORA_SHRINK_G;
  // B read N-major (wgmma's transposed B): where the weights' out dimension is the contiguous one for this GEMM's N
  // (LORA_SHRINK_D: B_gate, B_up are (hidden, r), K rows)
  constexpr bool kMajorN = ((kDh || kDx) != (WEIGHTS != kOutIn)) || kShrinkN;
  // the extension's B: the adapters' own layout, N-major for dX and dH (A_gate, A_up: (r, dim); A_down (r, hidden)),
  // else K-major
  constexpr bool kExtMajorN = kDx || kDh;
  // The down GEMMs run persistent: one CTA per SM, its producer filling the ring with the next tile while the
  // consumers finish the last: their K (hidden: 12 k tiles at Qwen3, 32 at DeepSeek-V3) is too short to hide a CTA's
  // launch, ring fill and epilogue. A CTA's first tile is blockIdx.x, the next ones are claimed from a counter, so the
  // tiles in flight stay close in raster order (the L2 reuse of the experts' weight tiles) and a CTA that drew cheap
  // tiles (padding) takes more: with a fixed stride, DeepSeek-V3's down GEMM took 6.7 ms instead of 4.5. The gate/up
  // GEMMs (K = dim) run persistent with many routed slots per expert (the *_PERSISTENT twins; kernel.toml:
  // PERSISTENT_GATE_UP_MIN_SLOTS), else one CTA per tile, in CTA pairs that share weight tiles (what an expert's few
  // blocks gain most from). The backward's dH (K = dim too) runs persistent: 3-18% faster than in CTA pairs at 5 of 6
  // benchmark shapes (4.6% slower at DeepSeek-V3; its epilogue moves 10 bytes per element, which pairs do not overlap
  // with anything).
  constexpr bool kPersistent = persistent_mode(MODE);
  const int ntpp = __ldg(p.ntpp);
  // Persistent: the tiles of the live blocks (block * BM < num_tokens_post_padded, read here: no host sync) in raster
  // order; 32-bit tile numbers (the host keeps blocks x n_tiles below 2^31, so t + p.ctas cannot wrap).
  const int live = kPersistent ? (ntpp <= 0 ? 0 : min(p.blocks, (ntpp - 1) / BM + 1)) : p.blocks;
  const uint32_t tiles = static_cast<uint32_t>(live) * p.n_tiles;
  if (blockIdx.x >= tiles) return;  // also the CTAs that round the grid up to whole clusters
  // K tiles per tile: the base ones, then the LoRA extension's. Read from the parameters at each use, as the base
  // modes always did: a local holding it changed their code (80-150 more instructions per kernel, measured).
  auto k_total = [&] {
    if constexpr (kExtension) {
      return p.k_tiles + p.ext_tiles;
    } else {
      return p.k_tiles;
    }
  };
  // a block's group id -> its expert (the base weights' index)
  auto expert_of = [&](int group) { return kGroups ? group / p.lora_n : group; };
  // One CTA per tile: the cluster's other CTA (blockIdx.x ^ 1), when it runs the same expert's same column tile, loads
  // half of each weight tile for both (TMA multicast), halving the weight traffic from L2 (where DeepSeek-V3's
  // kernels were bound: 96% L2 throughput). Both CTAs reach the same decision; a CTA that left never pairs.
  int own_block = 0, own_tile = 0, own_expert = -1;
  bool paired = false;
  const uint32_t rank = kPersistent ? 0u : cluster_ctarank();
  if constexpr (!kPersistent) {
    tile_order(p, static_cast<int>(blockIdx.x), p.blocks, own_block, own_tile);
    if (own_block * BM >= ntpp) return;  // past the routed blocks: the whole CTA leaves
    own_expert = __ldg(p.expert_ids + own_block);
    if (own_expert < 0 || own_expert >= p.num_experts) return;
    if ((blockIdx.x ^ 1u) < tiles) {
      int peer_block, peer_tile;
      tile_order(p, static_cast<int>(blockIdx.x ^ 1u), p.blocks, peer_block, peer_tile);
      paired = peer_tile == own_tile && peer_block * BM < ntpp && __ldg(p.expert_ids + peer_block) == own_expert;
    }
  }
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const gbase = smem_raw + (base - raw);
  // the routing rows of two tiles (tile i in buffer i & 1): the producer writes tile i + 1's while the consumers still
  // read tile i's
  int64_t* const a_rows = reinterpret_cast<int64_t*>(gbase + STAGES * STAGE_BYTES);
  int* const slot_rows = reinterpret_cast<int*>(gbase + STAGES * STAGE_BYTES + 2 * BM * 8);
  const uint32_t bars = base + STAGES * STAGE_BYTES + 2 * BM * 12;
  auto full_bar = [&](int s) { return bars + 8u * s; };
  auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
  auto tile_free_bar = [&](int b) { return bars + 8u * (2 * STAGES + b); };
  auto rows_ready_bar = [&](int b) { return bars + 8u * (2 * STAGES + 2 + b); };
  // the tile of routing-row buffer b as block x n_tiles + column tile (decoded once, by the claiming thread), -1 once
  // the CTA's tiles are done
  int* const tile_of = reinterpret_cast<int*>(gbase + STAGES * STAGE_BYTES + 2 * BM * 12 + (2 * STAGES + 4) * 8);
  if (threadIdx.x == 0) {
    // paired: a stage is free once the consumers of both CTAs released it (the peer's TMA writes into it too)
    init_ring<STAGES>(bars, (paired ? 2 : 1) * CONSUMER_WARPS);
    // a routing-row buffer is free again once each consumer warp is done with its tile
    for (int b = 0; b < 2; ++b) mbar_init(tile_free_bar(b), CONSUMER_WARPS);
    // and holds the next tile's rows once each producer thread wrote its row (and thread 0 the tile number)
    for (int b = 0; b < 2; ++b) mbar_init(rows_ready_bar(b), 128);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (paired) cluster_sync();  // both rings initialised before either CTA's copies or arrivals reach the other
  // Releasing stage s after k tile j: this CTA's empty barrier, and the peer's while the peer will still wait on it
  // (its producer waits for k tiles j < k_tiles - STAGES only; an arrival after the peer may have exited is not
  // allowed).
  auto release = [&](int s, int j) {
    mbar_arrive(empty_bar(s));
    if (paired && j < k_total() - STAGES) mbar_arrive_cluster(mapa_shared(empty_bar(s), rank ^ 1u));
  };

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {  // ------------------------------- producer -------------------------------
    producer_registers();
    static_assert(BM == 128, "one routing row per producer thread");
    const int c = threadIdx.x & 7;    // 16-byte chunk of the 128-byte K slice
    const int r0 = threadIdx.x >> 3;  // rows r0 + 16 i
    // k tiles issued before this tile, over all earlier tiles, modulo 2 STAGES: the ring runs on across tiles (stage
    // ks % STAGES, phase parity (ks / STAGES) & 1)
    uint32_t ks = 0;
    for (int i = 0;; ++i) {
      const int buf = i & 1;
      // Tile i's routing rows replace tile i - 2's once every consumer warp is done with those.
      if (i >= 2) mbar_wait(tile_free_bar(buf), ((i - 2) / 2) & 1);
      if (threadIdx.x == 0) {  // tile i: the first (own or claimed) one whose block runs an expert of the launch
        int t = -1;
        if constexpr (kPersistent) {
          uint32_t cand = i == 0 ? blockIdx.x : p.ctas + atomicAdd(p.tile_counter, 1);
          for (; cand < tiles; cand = p.ctas + atomicAdd(p.tile_counter, 1)) {
            int block, n_tile;
            tile_order(p, static_cast<int>(cand), live, block, n_tile);
            const int expert = __ldg(p.expert_ids + block);
            if (expert >= 0 && expert < p.num_experts) {
              t = block * p.n_tiles + n_tile;
              break;
            }
          }
        } else {
          t = i == 0 ? own_block * p.n_tiles + own_tile : -1;
        }
        tile_of[buf] = t;
      }
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warps only
      const int t = tile_of[buf];
      const int block = t >= 0 ? t / p.n_tiles : 0, n_tile = t >= 0 ? t % p.n_tiles : 0;
      if (t >= 0) {
        if constexpr (kCompactRows) {  // A's row: the slot's compact row of dg / du, -1 (zero-filled) for padding
          const int row = block * BM + threadIdx.x;
          const int slot = routed_slot(p, row);
          const int compact = slot >= 0 ? p.dst_rows[row] : -1;
          slot_rows[buf * BM + threadIdx.x] = slot;
          a_rows[buf * BM + threadIdx.x] =
              compact >= 0 && compact < p.dst_limit ? static_cast<int64_t>(compact) * p.lda : -1;
        } else {
          routing_row<BM, kGather>(p, block, threadIdx.x, a_rows + buf * BM, slot_rows + buf * BM);
        }
      }
      mbar_arrive(rows_ready_bar(buf));  // the consumers read this thread's row (and the tile number) after it
      if (t < 0) break;                  // the consumers stop at the -1
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // each producer thread reads the others' rows below
      // This thread's A rows' offsets, in registers for the whole tile: loaded from shared memory in the k loop, each
      // load would wait for the previous row's cp.async (the asm's memory clobber orders them), ~8 dependent loads
      // between a stage's release and its copies (Nsight Compute: a quarter of the producer's time).
      int64_t row_off[BM / 16];
#pragma unroll
      for (int r = 0; r < BM / 16; ++r) row_off[r] = a_rows[buf * BM + r0 + 16 * r];
      const int group = __ldg(p.expert_ids + block), expert = expert_of(group);
      // the adapter tensors' group of (adapter, expert)
      const int adapter_group = kGroups ? (group - expert * p.lora_n) * p.lora_experts + expert : 0;

      // N-major B: the expert's first weight row (the k tile adds its rows); else its first row of this column tile
      const int b_row = expert * p.b_rows_per_expert + (kMajorN ? 0 : n_tile * (kHalves ? BN_GU : BN_DOWN));
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        const uint32_t k = ks + kt;
        const int stage = acquire_stage<STAGES>(bars, k);
        const uint32_t st = base + stage * STAGE_BYTES;
        // DX: the first k_half tiles read dg and w1, the others du and w3, each from its own K offset 0
        const bool second = kCompactRows && kt >= p.k_half;
        const int kofs = (second ? kt - p.k_half : kt) * BK;
        const __nv_bfloat16* const a_src = second ? p.a2 : p.a;
        // the weight map of this k tile: DX's second half reads w3's
        const CUtensorMap* const map = second ? &p.tm_b1 : &p.tm_b0;
        if (kMajorN && threadIdx.x == 0) {  // the B tile: MN_ATOMS boxes of weight rows kofs.., 64 columns each
          static_assert(!kMajorN || kPersistent, "N-major B tiles are loaded per CTA (no CTA-pair multicast)");
          mbar_expect_tx(full_bar(stage), B_BYTES);
#pragma unroll
          for (int q = 0; q < MN_ATOMS; ++q) {  // halves: the gate columns' boxes, then the same up columns'
            constexpr int kHalfAtoms = MN_ATOMS / 2;
            const bool up_half = kHalves && q >= kHalfAtoms;
            const int col = kHalves ? n_tile * BN_GU + (q % kHalfAtoms) * MN_ATOM : n_tile * BN + q * MN_ATOM;
            if constexpr (kShrinkN) {  // the group's B_gate (dg tiles) or B_up (du tiles) or B_down rows, shifted
              tma_load_2d(st + A_BYTES + q * (B_BYTES / MN_ATOMS), map, full_bar(stage),
                          col + p.ext_shift[second ? 1 : 0], adapter_group * p.lora_group_rows[second ? 1 : 0] + kofs);
            } else {
              tma_load_2d(st + A_BYTES + q * (B_BYTES / MN_ATOMS), up_half ? &p.tm_b1 : map, full_bar(stage), col,
                          b_row + kofs);
            }
          }
        }
        if (!kMajorN && threadIdx.x == 0) {  // the B tile: two TMA boxes (halves: gate rows, then the same up rows)
          mbar_expect_tx(full_bar(stage), B_BYTES);  // paired: half from this CTA's copy, half from the peer's
          const CUtensorMap* box1 = kHalves ? &p.tm_b1 : map;
          int row0 = b_row, row1 = kHalves ? b_row : b_row + B_BOX_ROWS;
          if constexpr (kShrink) {  // the two halves' adapters' rows of the group
            row0 = adapter_group * p.lora_group_rows[0];
            row1 = adapter_group * p.lora_group_rows[1];
          }
          if (paired) {
            tma_load_2d_multicast(st + A_BYTES + rank * (B_BYTES / 2), rank ? box1 : map, full_bar(stage), kofs,
                                  rank ? row1 : row0, kPairMask);
          } else {
            tma_load_2d(st + A_BYTES, map, full_bar(stage), kofs, row0);
            tma_load_2d(st + A_BYTES + B_BYTES / 2, box1, full_bar(stage), kofs, row1);
          }
        }
#pragma unroll
        for (int r = 0; r < BM / 16; ++r) {
          const int64_t off = row_off[r];
          cp_async_16(st + swz(r0 + 16 * r, c), a_src + (off >= 0 ? off + kofs + c * 8 : 0), off >= 0 ? 16u : 0u);
        }
        cp_async_mbar_arrive_noinc(full_bar(stage));  // fires when this thread's copies of the stage have landed
      }
      if constexpr (kExtension) {
        // The LoRA K tiles: the block's u rows and the B rows of the column tile, all by TMA (thread 0); the other
        // threads' arrivals complete the stage's count (they copy nothing). dX, dH: the block's rows of w (v) start at
        // its first compact row (its routed rows are consecutive compact rows)
        const int first_compact = kExtMajorN && threadIdx.x == 0 ? p.dst_rows[block * BM] : 0;
        for (int c = 0; c < p.ext_tiles; ++c) {
          const int stage = acquire_stage<STAGES>(bars, ks + p.k_tiles + c);
          const uint32_t st = base + stage * STAGE_BYTES;
          if (threadIdx.x == 0) {
            mbar_expect_tx(full_bar(stage), A_BYTES + B_BYTES);
            if constexpr (kExtMajorN) {  // w_i's (dH: v's) tile cc of the block; A_i's rows cc BK.. x 256 columns
              const int i = c < p.ext_split ? 0 : 1, cc = i ? c - p.ext_split : c;
              tma_load_2d(st, &p.tm_ua[i], full_bar(stage), cc * BK, first_compact);
#pragma unroll
              for (int q = 0; q < MN_ATOMS; ++q) {
                tma_load_2d(st + A_BYTES + q * (B_BYTES / MN_ATOMS), &p.tm_ub[i], full_bar(stage),
                            n_tile * BN + q * MN_ATOM, adapter_group * p.lora_group_rows[i] + cc * BK);
              }
            } else {
              tma_load_2d(st, &p.tm_ua[0], full_bar(stage), c * BK, block * BM);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                const int row = adapter_group * p.lora_group_rows[i] + (kHalves ? n_tile * BN_GU
                                                                                 : n_tile * BN + i * B_BOX_ROWS);
                tma_load_2d(st + A_BYTES + i * (B_BYTES / 2), &p.tm_ub[i], full_bar(stage),
                            c * BK + p.ext_shift[i], row);
              }
            }
          }
          cp_async_mbar_arrive_noinc(full_bar(stage));
        }
      }
      ks = (ks + k_total()) % (2 * STAGES);
    }
    drain_cp_async();
    return;
  }
  consumer_registers();

  // ------------------------------- consumers -------------------------------
  const int wg = warpgroup - 1;
  const int ctid = threadIdx.x - 128 * warpgroup;
  const int warp = ctid / 32, lane = ctid % 32, quad = lane & 3;
  const uint32_t a_off = wg * 64 * 128;
  RingPosition<STAGES> ring;  // in step with the producer's ks
  for (int i = 0;; ++i) {
    const int buf = i & 1;
    mbar_wait(rows_ready_bar(buf), (i / 2) & 1);
    const int t = tile_of[buf];
    if (t < 0) break;
    const int block = t / p.n_tiles, n_tile = t % p.n_tiles;
    const int* const slot_of = slot_rows + buf * BM;
    // When this warpgroup's 64 rows are all padding it only keeps the ring turning, and the other warpgroup's wgmmas
    // get the tensor cores (DeepSeek-V3: 256 ± 16 slots per expert, so about half the experts end in a block of <= 64
    // routed rows). The skip sits outside the mainloop: a `continue` inside it made ptxas serialise the wgmmas.
    if (__all_sync(0xffffffffu, slot_of[wg * 64 + lane] < 0 && slot_of[wg * 64 + 32 + lane] < 0)) {
      for (int kt = 0; kt < k_total(); ++kt) {
        mbar_wait(full_bar(ring.stage), ring.phase);
        if (lane == 0) release(ring.stage, kt);
        ring.advance();
      }
      // nothing to store: GATE_UP leaves these rows of the intermediate unwritten, DOWN never reads them
    } else {
      float acc[128];
      int prev = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        mbar_wait(full_bar(ring.stage), ring.phase);
        fence_proxy_async();  // the stage was written by cp.async (generic proxy); wgmma reads it through the async proxy
        mma_k_tile<kMajorN>(acc, base + ring.stage * STAGE_BYTES, a_off, kt > 0);
        if (kt > 0 && lane == 0) release(prev, kt - 1);
        prev = ring.stage;
        ring.advance();
      }
      if constexpr (kExtension) {
        // The LoRA K tiles (TMA-written: no proxy fence), B in the adapters' layout whatever the base weights' form
        for (int x = 0; x < p.ext_tiles; ++x) {
          mbar_wait(full_bar(ring.stage), ring.phase);
          mma_k_tile<kExtMajorN>(acc, base + ring.stage * STAGE_BYTES, a_off, true);
          if (lane == 0) release(prev, p.k_tiles + x - 1);
          prev = ring.stage;
          ring.advance();
        }
      }
      wgmma_wait<0>();
      fence_acc(acc);
      if (lane == 0) release(prev, k_total() - 1);  // the ring's next turn (persistent: the next tile) may refill it
      // ------------------------------- epilogue -------------------------------
      // the tile's output columns n0 + 8 j + 2 quad + e: of each half (gate, up) with halves, else of the whole tile;
      // kPairs: n0 + 4 j + quad, gate and up alike
      constexpr bool kGated = kHalves || kPairs;
      constexpr int kCols = kGated ? BN_GU : BN;
      const int n0 = n_tile * kCols;
      const int group = __ldg(p.expert_ids + block);
      const int64_t bias_row = static_cast<int64_t>(expert_of(group)) * p.n_total + n0;
      const __nv_bfloat16* const bias_gate = p.b_gate != nullptr ? p.b_gate + bias_row : nullptr;
      const __nv_bfloat16* const bias_up = p.b_up != nullptr ? p.b_up + bias_row : nullptr;
      // the pre-activations with their biases: gate (or relu2's only) and up
      auto pre_gate = [&](int h, int j, int e) {
        return kPairs ? acc[4 * j + 2 * h] + bias_at(bias_gate, 4 * j + quad)
                      : acc[4 * j + 2 * h + e] + bias_at(bias_gate, 8 * j + 2 * quad + e);
      };
      auto pre_up = [&](int h, int j, int e) {
        return kPairs ? acc[4 * j + 2 * h + 1] + bias_at(bias_up, 4 * j + quad)
                      : acc[4 * (j + BN_GU / 8) + 2 * h + e] + bias_at(bias_up, 8 * j + 2 * quad + e);
      };
      // a row of the tile's output columns as bf16 from dst (its column n0), value(j, e) as pre_gate's
      auto store_cols = [&](__nv_bfloat16* dst, auto value) {
        if constexpr (kPairs) {
          store_pairs_row_bf16<kCols>(dst, n0, p.n_total, quad, [&](int j) { return value(j, 0); });
        } else {
          store_row_bf16<kCols>(dst, n0, p.n_total, quad, value);
        }
      };
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int lr = wg * 64 + warp * 16 + (lane >> 2) + 8 * h;
        if constexpr (kMode == GATE_UP || kMode == GATE_UP_AND_SAVE) {
          store_cols(p.inter + static_cast<int64_t>(block * BM + lr) * p.ld_inter + n0, [&](int j, int e) {
            return activate<ACT>(pre_gate(h, j, e), kGated ? pre_up(h, j, e) : 0.f, p.alpha, p.limit);
          });
        }
        if constexpr (kMode == GATE_UP_SAVE || kMode == GATE_UP_AND_SAVE) {
          const int dst_row = p.dst_rows[block * BM + lr];
          if (dst_row >= 0 && dst_row < p.dst_limit) {
            __nv_bfloat16* dst = p.saved + static_cast<int64_t>(dst_row) * p.ld_saved + n0;
            // gate columns, then (gated) the up columns hidden (n_total) further
            store_cols(dst, [&](int j, int e) { return pre_gate(h, j, e); });
            if constexpr (kGated) store_cols(dst + p.n_total, [&](int j, int e) { return pre_up(h, j, e); });
          }
        }
        if constexpr (kShrink || kShrinkN) {
          const int slot = slot_of[lr];
          const float weight = kMode == LORA_SHRINK_P && slot >= 0 ? __ldg(p.topk_weights + slot) : 1.f;
          store_lora_rows<kMode == LORA_SHRINK_P>(p, acc, h, quad, block * BM + lr,
                                                  __ldg(p.lora_scaling + group % p.lora_n), weight);
        }
        if constexpr (kDh) {
          const int slot = slot_of[lr];
          const int row = slot >= 0 ? p.dst_rows[block * BM + lr] : -1;
          const bool routed = row >= 0 && row < p.dst_limit;
          float dot = routed ? activation_grad_row<ACT, kExtension>(p, acc, h, quad, slot, row, n_tile * BN) : 0.f;
          // the 4 lanes of a quad hold the row's columns: every lane takes part in the shuffles
          dot += __shfl_xor_sync(0xffffffffu, dot, 1);
          dot += __shfl_xor_sync(0xffffffffu, dot, 2);
          if (routed && quad == 0) p.dot_partials[static_cast<int64_t>(n_tile) * p.num_slots + slot] = dot;
        }
        if constexpr (!kGather && !kShrink && !kShrinkN) {
          const int slot = slot_of[lr];
          if (slot < 0) continue;
          if constexpr (kDx) {  // dx: unweighted (dg and du carry the slot weight)
            store_down_row<BN_DOWN, kMode == DX_ATOMIC, false>(p, acc, h, quad, slot, n_tile * BN_DOWN);
          } else {  // y + b2, weighted
            store_down_row<BN_DOWN, kMode == DOWN_ATOMIC>(p, acc, h, quad, slot, n_tile * BN_DOWN,
                                                          p.b2 != nullptr ? p.b2 + bias_row : nullptr);
          }
        }
      }
    }
    // every lane's reads of the tile's routing rows are done before lane 0 frees them for tile i + 2
    __syncwarp();
    if (lane == 0) mbar_arrive(tile_free_bar(buf));
  }
#else
  __trap();  // compiled for an arch other than sm_90a: the host side never launches it there
#endif
}
// Runs of one expert (raster_by_expert) where the routed slots per local expert (M * top_k over the global experts,
// from the shapes: no sync) average under half a raster group, i.e. a group holds more than two experts; else
// raster(), whose groups then keep a block's A rows in L2 as well and whose decode reads no expert ids (kernel.toml,
// RASTER_BLOCKS).
bool raster_runs(const MoeShape& s) {
  return 2 * s.M * s.top_k < static_cast<int64_t>(RASTER_BLOCKS) * BM * s.global_experts;
}

template <int MODE, int ACT = kActSwiGLU, int WEIGHTS = kOutIn>
void launch(Params p, int n_tiles, const MoeShape& s, cudaStream_t stream) {
  constexpr bool kPersistent = persistent_mode(MODE);
  static_assert(kPersistent || WEIGHTS == kOutIn, "transposed weights: N-major B tiles, persistent launches only");
  p.raster_runs = raster_runs(s);
  launch_rastered<moe_gemm_kernel<MODE, ACT, WEIGHTS>, NUM_THREADS, SMEM_BYTES, kPersistent ? 1 : CLUSTER_BLOCKS, kPersistent>(
      p, n_tiles, s.blocks, stream);
}

}  // namespace sm90

namespace {

// Whether TMA reads the (E, rows, cols) view w in place with `cols` contiguous: 16-byte row pitch, whole rows between
// experts.
bool tma_rows(const at::Tensor& w) {
  return w.stride(2) == 1 && w.stride(1) % 8 == 0 && w.stride(0) % w.stride(1) == 0;
}

// The WeightForm of an (E, out, in) weight view (as the ops take them) that TMA reads in place, -1 for none.
int weight_form(const at::Tensor& w) {
  if (tma_rows(w)) return sm90::kOutIn;
  if (tma_rows(w.transpose(1, 2))) return sm90::kInOut;
  return -1;
}

// A map over an (E, out, in) view of the form weight_form gave: the GEMM's B tile reads `in` as K when the form is
// kOutIn and `n_major` is false (boxes of B_BOX_ROWS out rows x BK), or as N when both are (a GEMM with K = out: boxes
// of BK out rows x MN_ATOM in columns); transposed (kInOut) the other way round. Sets b_rows_per_expert.
void expert_map(const char* op, const char* name, CUtensorMap* map, const at::Tensor& w, int form, bool n_major,
                int& b_rows_per_expert) {
  const at::Tensor rows_view = form == sm90::kOutIn ? w : w.transpose(1, 2);  // its last dimension contiguous
  b_rows_per_expert = static_cast<int>(rows_view.stride(0) / rows_view.stride(1));
  const int box_rows = n_major ? sm90::BK : sm90::B_BOX_ROWS, box_cols = n_major ? sm90::MN_ATOM : sm90::BK;
  sm90::expert_weight_map(op, name, map, rows_view, rows_view.size(1), rows_view.size(2),
                          CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, box_rows, box_cols);
}

// gate and up (E, hidden, dim) as the interleaved halves of one weight (gpt-oss's gate_up_proj, its columns (or rows)
// alternating gate, up): that weight as (E, 2 hidden, dim), else an undefined tensor.
at::Tensor interleaved_base(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t half_step = gate.stride(1) / 2;
  if (gate.strides() != up.strides() || gate.stride(1) % 2 != 0 || half_step == 0 ||
      static_cast<const __nv_bfloat16*>(up.const_data_ptr()) !=
          static_cast<const __nv_bfloat16*>(gate.const_data_ptr()) + half_step) {
    return {};
  }
  return gate.as_strided({gate.size(0), 2 * gate.size(1), gate.size(2)}, {gate.stride(0), half_step, gate.stride(2)});
}

// dg and du (slots, hidden) as the interleaved column halves of one (slots, 2 hidden) tensor with contiguous rows of
// whole 16-byte units: that tensor, else an undefined one.
at::Tensor interleaved_grads(const at::Tensor& dg, const at::Tensor& du) {
  if (dg.strides() != du.strides() || dg.stride(1) != 2 || dg.stride(0) % 8 != 0 ||
      static_cast<const __nv_bfloat16*>(du.const_data_ptr()) !=
          static_cast<const __nv_bfloat16*>(dg.const_data_ptr()) + 1) {
    return {};
  }
  return dg.as_strided({dg.size(0), 2 * dg.size(1)}, {dg.stride(0), 1});
}

// An optional bias as a contiguous tensor (kept alive in `keep`) and its pointer, nullptr without one: (E, n) bias rows
// are small (a copy per call costs nothing next to the GEMMs), and the epilogues read them row-major.
const __nv_bfloat16* bias_pointer(const char* op, const char* name, const std::optional<at::Tensor>& b,
                                  std::vector<at::Tensor>& keep) {
  if (!b.has_value()) return nullptr;
  keep.push_back(b->contiguous());
  sm90::check_cuda_operand(op, name, keep.back());
  return reinterpret_cast<const __nv_bfloat16*>(keep.back().const_data_ptr());
}

// The gate/up GEMM's parameters for gate/up views (E, hidden, dim) (up: gate again when not gated; it is never read
// then) and the biases; the contiguous copies it needed stay in `keep` (x, gate, up, sorted, expert ids first).
// `form`: how the kernels read the weights (sm90::WeightForm): in place where TMA can, else from contiguous copies.
sm90::Params gate_up_params(const char* op, const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& up_in,
                            const at::Tensor& sorted, const at::Tensor& eids, const at::Tensor& ntpp,
                            const MoeShape& s, const Experts& w, std::vector<at::Tensor>& keep, int& form) {
  sm90::check_sm90(op, x_in);
  const auto x = x_in.contiguous();
  auto gate = gate_in, up = up_in;
  const at::Tensor pairs = w.act.gated() ? interleaved_base(gate, up) : at::Tensor();
  form = gate.strides() == up.strides() ? weight_form(gate) : -1;
  if (pairs.defined() && weight_form(pairs) == sm90::kInOut) {
    form = sm90::kInOutPairs;
    gate = up = pairs;  // read through one map over the pairs (up's own view starts mid-row, not TMA-aligned)
  } else if (form < 0) {
    gate = gate.contiguous();
    up = up.contiguous();
    form = sm90::kOutIn;
  }
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"x", &x}, {"gate weight", &gate},
                         {"up weight", &up}}) {
    sm90::check_cuda_operand(op, name, *t);
  }
  keep = {x, gate, up, sorted.contiguous(), eids.contiguous()};
  sm90::Params p{};
  p.top_k = static_cast<int>(s.top_k);
  p.num_experts = static_cast<int>(s.E);
  p.num_slots = static_cast<int>(s.M * s.top_k);
  p.sorted = keep[3].const_data_ptr<int>();
  p.expert_ids = keep[4].const_data_ptr<int>();
  p.ntpp = ntpp.const_data_ptr<int>();
  p.a = reinterpret_cast<const __nv_bfloat16*>(x.const_data_ptr());
  p.lda = s.dim;
  if (form == sm90::kInOutPairs) {  // one map over the pairs' columns (N-major)
    expert_map(op, "the gate/up weight", &p.tm_b0, pairs, sm90::kInOut, true, p.b_rows_per_expert);
  } else {
    const bool n_major = form == sm90::kInOut;
    expert_map(op, "the gate weight", &p.tm_b0, gate, form, n_major, p.b_rows_per_expert);
    expert_map(op, "the up weight", &p.tm_b1, up, form, n_major, p.b_rows_per_expert);
  }
  p.n_total = static_cast<int>(s.hidden);
  p.k_tiles = static_cast<int>(s.dim / sm90::BK);
  p.alpha = w.act.alpha;
  p.limit = w.act.limit;
  p.b_gate = bias_pointer(op, "b_gate", w.b_gate, keep);
  p.b_up = bias_pointer(op, "b_up", w.b_up, keep);
  return p;
}

// Column tiles of the gate/up GEMM: BN_GU hidden columns (gate and up halves), or BN when not gated.
int gate_up_tiles(const MoeShape& s, bool gated) {
  const int64_t cols = gated ? sm90::BN_GU : sm90::BN;
  return static_cast<int>((s.hidden + cols - 1) / cols);
}

// Whether the gate/up GEMM runs persistent rather than in CTA pairs: the routed slots per local expert (as in
// raster_runs) against kernel.toml's PERSISTENT_GATE_UP_MIN_SLOTS.
bool gate_up_persistent(const MoeShape& s) {
  return s.M * s.top_k >= sm90::PERSISTENT_GATE_UP_MIN_SLOTS * s.global_experts;
}

// fn(std::integral_constant<int, FORM>) for a runtime sm90::WeightForm.
template <class Fn>
void with_weight_form(int form, Fn&& fn) {
  switch (form) {
    case sm90::kOutIn:
      return fn(std::integral_constant<int, sm90::kOutIn>{});
    case sm90::kInOut:
      return fn(std::integral_constant<int, sm90::kInOut>{});
    default:
      return fn(std::integral_constant<int, sm90::kInOutPairs>{});
  }
}

// The gate/up GEMM in MODE with weights of `form`, or in MODE's persistent twin, which claims tiles from a counter
// that must be zero at launch: where gate_up_persistent, and for transposed weights (N-major B tiles, which the CTA
// pairs' multicast does not load).
template <int MODE, int ACT>
void launch_gate_up(sm90::Params& p, int form, const at::Tensor& sorted, const MoeShape& s, cudaStream_t stream) {
  const int n_tiles = gate_up_tiles(s, ACT != sm90::kActRelu2);
  if (form == sm90::kOutIn && !gate_up_persistent(s)) {
    sm90::launch<MODE, ACT>(p, n_tiles, s, stream);
    return;
  }
  const auto tile_counter = at::zeros({1}, sorted.options().dtype(at::kInt));
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  with_weight_form(form, [&](auto f) {
    constexpr int kForm = decltype(f)::value;
    if constexpr (kForm == sm90::kInOutPairs && ACT == sm90::kActRelu2) {
      TORCH_CHECK(false, "flash_moe: relu2 has no gate/up pairs");  // gate_up_params never pairs a relu2 weight
    } else {
      sm90::launch<sm90::persistent_twin(MODE), ACT, kForm>(p, n_tiles, s, stream);
    }
  });
}

// w2 (E, dim, hidden) as TMA reads it: its WeightForm, from a contiguous copy (in `keep`) where it cannot in place.
int w2_form(const at::Tensor& w2_in, at::Tensor& w2) {
  const int form = weight_form(w2_in);
  w2 = form < 0 ? w2_in.contiguous() : w2_in;
  return form < 0 ? sm90::kOutIn : form;
}

// fn(std::integral_constant<int, ACT>) for the activation's compile-time ACT (sm90_common.cuh).
template <class Fn>
void with_activation(const ActivationSpec& a, Fn&& fn) {
  switch (a.kind) {
    case Activation::kSwiGLU:
      return fn(std::integral_constant<int, sm90::kActSwiGLU>{});
    case Activation::kGptOss:
      return fn(std::integral_constant<int, sm90::kActGptOss>{});
    case Activation::kRelu2:
      return fn(std::integral_constant<int, sm90::kActRelu2>{});
  }
}

// The flag of each padded row: 1 where it routes a slot (routing.cuh: the rows the GEMM kernels fill), else 0.
__global__ void routed_flags_kernel(const int* __restrict__ sorted, const int* __restrict__ eids,
                                    const int* __restrict__ ntpp, int64_t padded, int slots, int experts,
                                    int* __restrict__ flags) {
  const int64_t live_rows = __ldg(ntpp);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < padded; i += int64_t{gridDim.x} * blockDim.x) {
    flags[i] = routed_slot(sorted, eids, live_rows, i, sm90::BM, experts, slots) >= 0;
  }
}

// `rows` holds the flags' inclusive prefix sums: each routed row's compact row (its sum - 1), -1 elsewhere; the last
// sum, the routed count, into *count.
__global__ void compact_rows_kernel(const int* __restrict__ flags, int* __restrict__ rows, int64_t padded,
                                    int* __restrict__ count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < padded; i += int64_t{gridDim.x} * blockDim.x) {
    if (i == padded - 1) *count = rows[i];
    rows[i] = flags[i] ? rows[i] - 1 : -1;
  }
}

// Each padded row's compact row (the routed rows numbered in sorted order, -1 for the others): where the gate/up kernel
// stores g | u and the dH kernel reads it and writes dg / du / p h (p.dst_rows points into `rows`), and their count
// (int32 [1], on the device).
struct CompactRows {
  at::Tensor rows, count;
};

CompactRows compact_rows(sm90::Params& p, const at::Tensor& sorted, const at::Tensor& eids, const at::Tensor& ntpp,
                         const MoeShape& s) {
  const int64_t padded = sorted.numel();
  CompactRows c{at::empty({padded}, sorted.options()), at::zeros({1}, sorted.options())};
  p.dst_rows = c.rows.const_data_ptr<int>();
  p.dst_limit = static_cast<int>(s.M * s.top_k);
  if (padded == 0) return c;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto flags = at::empty({padded}, sorted.options());
  routed_flags_kernel<<<grid_stride_blocks(padded, 256), 256, 0, stream>>>(
      sorted.const_data_ptr<int>(), eids.const_data_ptr<int>(), ntpp.const_data_ptr<int>(), padded,
      static_cast<int>(s.M * s.top_k), static_cast<int>(s.E), flags.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::cumsum_out(c.rows, flags, 0);
  compact_rows_kernel<<<grid_stride_blocks(padded, 256), 256, 0, stream>>>(flags.const_data_ptr<int>(),
                                                                     c.rows.mutable_data_ptr<int>(), padded,
                                                                     c.count.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c;
}

// Zeroes rows [*routed, rows) of a bf16 [rows, width] tensor (width a multiple of 8): the compact rows no slot fills
// (their count is on the device; reading it on the host would sync), instead of zeroing the whole tensor first.
__global__ void zero_rows_past_kernel(uint4* out, const int* routed, int64_t rows, int64_t vecs) {
  const int64_t first = min(max(int64_t{*routed}, int64_t{0}), rows) * vecs, total = rows * vecs;
  for (int64_t i = first + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}

// `routed`: compact_rows' count.
void zero_rows_past(at::Tensor& tensor, const at::Tensor& routed) {
  const int64_t rows = tensor.size(0), vecs = tensor.size(1) / 8, total = rows * vecs;
  if (total == 0) return;
  zero_rows_past_kernel<<<grid_stride_blocks(total, 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<uint4*>(tensor.mutable_data_ptr()), routed.const_data_ptr<int>(), rows, vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The pre-activations g | u of the routed slots, [M * top_k, 2 hidden] in moe_align's order (what moe_gate_up
// returns): p.saved points at the returned tensor, p.dst_rows into `rows` (compact_rows).
at::Tensor saved_gate_up(sm90::Params& p, const at::Tensor& sorted, const at::Tensor& eids, const at::Tensor& ntpp,
                         const MoeShape& s, bool gated, CompactRows& rows) {
  const int64_t width = (gated ? 2 : 1) * s.hidden;  // g | u, or g alone
  auto saved = at::empty({s.M * s.top_k, width}, sorted.options().dtype(at::kBFloat16));
  rows = compact_rows(p, sorted, eids, ntpp, s);
  zero_rows_past(saved, rows.count);
  p.saved = reinterpret_cast<__nv_bfloat16*>(saved.mutable_data_ptr());
  p.ld_saved = width;
  return saved;
}

// Both GEMMs of the forward with activation ACT; with `gate_up` non-null the gate/up kernel also keeps g | u there for
// the backward. Mode DOWN_ATOMIC adds into `result` = acc32 [M, dim] (zeroed here); DOWN_SLOTS writes `result` =
// yslots [M * top_k, dim] at the routed slots' rows only, and those alone are read (combine_in_k_order_cuda: the same
// routing rule), so it is not zeroed (a 537 MB fill, 0.163 ms, at Qwen3-30B-A3B's 16384 tokens: H100 timeline).
template <int ACT>
void run(const char* op, const at::Tensor& x, const Experts& w, const at::Tensor& w2_in, const at::Tensor& sorted,
         const at::Tensor& eids, const at::Tensor& ntpp, const at::Tensor& topk_weights, const MoeShape& s, int mode,
         at::Tensor& result, at::Tensor* gate_up) {
  std::vector<at::Tensor> keep;
  int form;
  sm90::Params p = gate_up_params(op, x, w.gate, w.up, sorted, eids, ntpp, s, w, keep, form);
  at::Tensor w2;
  const int down_form = w2_form(w2_in, w2);
  sm90::check_cuda_operand(op, "w2", w2);
  const auto tw = topk_weights.contiguous();
  if (mode == sm90::DOWN_ATOMIC) {
    result = at::zeros({s.M, s.dim}, x.options().dtype(at::kFloat));
  } else {
    result = at::empty({s.M * s.top_k, s.dim}, x.options());
  }
  CompactRows rows;
  if (gate_up != nullptr) *gate_up = saved_gate_up(p, keep[3], keep[4], ntpp, s, w.act.gated(), rows);
  if (s.blocks == 0 || s.M == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // gate/up + activation
  auto inter = at::empty({s.blocks * sm90::BM, s.hidden}, x.options());
  p.inter = reinterpret_cast<__nv_bfloat16*>(inter.mutable_data_ptr());
  p.ld_inter = s.hidden;
  if (gate_up != nullptr) {
    launch_gate_up<sm90::GATE_UP_AND_SAVE, ACT>(p, form, keep[3], s, stream);
  } else {
    launch_gate_up<sm90::GATE_UP, ACT>(p, form, keep[3], s, stream);
  }
  // down + b2 + combine
  p.b_gate = p.b_up = nullptr;
  p.b2 = bias_pointer(op, "b2", w.b2, keep);
  p.a = reinterpret_cast<const __nv_bfloat16*>(inter.const_data_ptr());
  p.lda = s.hidden;
  expert_map(op, "w2", &p.tm_b0, w2, down_form, down_form == sm90::kInOut, p.b_rows_per_expert);
  p.n_total = static_cast<int>(s.dim);
  p.k_tiles = static_cast<int>(s.hidden / sm90::BK);
  p.ld_out = s.dim;
  const int n_tiles = static_cast<int>((s.dim + sm90::BN_DOWN - 1) / sm90::BN_DOWN);
  const auto tile_counter = at::zeros({1}, sorted.options().dtype(at::kInt));
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  with_weight_form(down_form, [&](auto f) {
    constexpr int kForm = decltype(f)::value;
    if constexpr (kForm != sm90::kInOutPairs) {  // w2_form: never pairs
      if (mode == sm90::DOWN_ATOMIC) {
        p.topk_weights = tw.const_data_ptr<float>();
        p.acc32 = result.mutable_data_ptr<float>();
        sm90::launch<sm90::DOWN_ATOMIC, sm90::kActSwiGLU, kForm>(p, n_tiles, s, stream);
      } else {
        p.yslots = reinterpret_cast<__nv_bfloat16*>(result.mutable_data_ptr());
        sm90::launch<sm90::DOWN_SLOTS, sm90::kActSwiGLU, kForm>(p, n_tiles, s, stream);
      }
    }
  });
}

at::Tensor moe_gate_up_cuda(const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& w3,
                            const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                            const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_m,
                            int64_t num_experts, const std::optional<at::Tensor>& b_gate,
                            const std::optional<at::Tensor>& b_up) {
  const char* op = "moe_gate_up";
  MoeShape s;
  const Experts w = check_gate_up_experts(op, x, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                                          block_m, num_experts, b_gate, b_up, s);
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> keep;
  int form;
  sm90::Params p = gate_up_params(op, x, w.gate, w.up, sorted_token_ids, expert_ids, num_tokens_post_padded, s, w,
                                  keep, form);
  CompactRows rows;
  auto result = saved_gate_up(p, keep[3], keep[4], num_tokens_post_padded, s, w.act.gated(), rows);
  if (s.blocks == 0 || s.M == 0) return result;
  with_activation(w.act, [&](auto a) {
    launch_gate_up<sm90::GATE_UP_SAVE, decltype(a)::value>(p, form, keep[3], s, c10::cuda::getCurrentCUDAStream());
  });
  return result;
}

void fused_moe_bf16_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w2,
                         const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                         const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor out,
                         int64_t top_k, int64_t block_m, int64_t /*block_n*/, int64_t /*warp_n*/, int64_t /*stages*/,
                         int64_t /*bpc*/, int64_t /*cpc*/, bool /*split*/) {
  const char* op = "fused_moe_bf16";
  const auto [gate, up] = split_gate_up(op, w.contiguous());
  const MoeShape s = check_moe_args(op, x, gate, up, &w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                    &topk_weights, top_k, block_m, "w");
  check_out(op, out, s, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor acc32;
  const Experts experts{gate, up, kSwiGLU};
  run<sm90::kActSwiGLU>(op, x, experts, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, s,
                        sm90::DOWN_ATOMIC, acc32, nullptr);
  out.copy_(acc32);
}

std::tuple<at::Tensor, at::Tensor> moe_forward_cuda(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& w3, const at::Tensor& w2,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    const at::Tensor& topk_weights, int64_t top_k, int64_t block_m, bool deterministic, bool save_gate_up,
    int64_t num_experts, c10::string_view activation, double alpha, double limit,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b2) {
  const char* op = "moe_forward";
  const ActivationSpec act = parse_activation(op, activation, alpha, limit);
  MoeShape s;
  const Experts w = check_experts(op, x, w1, w3, &w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                 &topk_weights, top_k, block_m, num_experts, act, b_gate, b_up, b2, s);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor result, gate_up = at::empty({0, (act.gated() ? 2 : 1) * s.hidden}, x.options());
  with_activation(act, [&](auto a) {
    run<decltype(a)::value>(op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, s,
                            deterministic ? sm90::DOWN_SLOTS : sm90::DOWN_ATOMIC, result,
                            save_gate_up ? &gate_up : nullptr);
  });
  return {deterministic ? combine_in_k_order_cuda(result, topk_weights, sorted_token_ids, expert_ids,
                                                 num_tokens_post_padded, s)
                        : result.to(at::kBFloat16),
          gate_up};
}

// ------------------------------------------------------------------------------------------------------------------
// LoRA adapters, fused (the moe_lora_* ops; the CPU ops in flash_moe.cpp define the numerics). Per adapted GEMM of
// the forward: a shrink kernel (LORA_SHRINK_X over the gathered x rows, LORA_SHRINK_H over the intermediate's rows)
// writes u = s_a z A[a, e]^T, rounded once to bf16, into a padded-row buffer (blocks BM rows, zeroed: rows of
// all-padding warpgroups stay zero, TMA reads whole blocks), then the base GEMM with LORA_EXTENSION reads it as more
// K tiles against B[a, e]. dX (moe_lora_grad_x) and dH (moe_lora_grad_gate_up) likewise, their shrinks over dg | du
// (LORA_SHRINK_D) and grad_out (LORA_SHRINK_G) writing the compact rank-r rows the extension then reads (a block's
// routed rows are consecutive compact rows), their extensions N-major; dH's rows p s h A_down^T by LORA_SHRINK_P.

// The alignment's shape over the (expert, adapter) groups: the kernels' expert-id range and the launch rules' routed
// slots per (group) run.
MoeShape group_shape(const MoeShape& s, int64_t n) {
  MoeShape g = s;
  g.E = s.E * n;
  g.global_experts = s.global_experts * n;
  return g;
}

// An adapter tensor (n, E, rows, cols) as the kernels read it: contiguous (kept alive in `keep`), on the GPU.
at::Tensor adapter_operand(const char* op, const char* name, const at::Tensor& t, std::vector<at::Tensor>& keep) {
  keep.push_back(t.contiguous());
  sm90::check_cuda_operand(op, name, keep.back());
  return keep.back();
}

// A map over an adapter tensor's 2-D view (n E rows, cols): boxes of box_rows x box_cols (K-major B tiles: B_BOX_ROWS
// x BK; N-major: BK x MN_ATOM), the columns past `cols` (the rank of a B, or past an A's `in`) read as zeros.
void adapter_map(const char* op, const char* name, CUtensorMap* map, const at::Tensor& t,
                 int box_rows = sm90::B_BOX_ROWS, int box_cols = sm90::BK) {
  const int rc = prime_kernels::make_tmap_2d(map, t.const_data_ptr(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                             t.size(0) * t.size(1) * t.size(2), t.size(3), t.size(3), box_rows,
                                             box_cols);
  TORCH_CHECK(rc == 0, op, " (CUDA): cuTensorMapEncodeTiled failed for ", name, " (CUresult ", rc, ")");
}

// The K extension's A: a map over the padded-row buffer u [blocks BM, r]: boxes of one block's BM rows x BK columns,
// the columns past r zeros; its K tiles.
void extension_rows(const char* op, sm90::Params& p, const at::Tensor& u) {
  const int rc = prime_kernels::make_tmap_2d(&p.tm_ua[0], u.const_data_ptr(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                             u.size(0), u.size(1), u.size(1), sm90::BM, sm90::BK);
  TORCH_CHECK(rc == 0, op, " (CUDA): cuTensorMapEncodeTiled failed for the LoRA rank-r rows (CUresult ", rc, ")");
  p.ext_tiles = static_cast<int>((u.size(1) + sm90::BK - 1) / sm90::BK);
}

// A B-tile half's columns shifted past any rank: all zeros (a gated tile's half without an adapter).
constexpr int kAbsentShift = 1 << 20;

// Half i of the K extension's B tile: B (n, E, out, r) read from column k + shift; both halves the same B (its two
// B_BOX_ROWS row boxes) for a tile that is not split into gate and up.
void extension_b(const char* op, sm90::Params& p, int i, const at::Tensor& b, int shift) {
  adapter_map(op, "a LoRA B", &p.tm_ub[i], b);
  p.lora_group_rows[i] = static_cast<int>(b.size(2));
  p.ext_shift[i] = shift;
}

// The launch parameters every LoRA kernel shares: the groups and the scaling (kept alive in `keep`).
void lora_params(sm90::Params& p, const Lora& l, const MoeShape& s, std::vector<at::Tensor>& keep) {
  keep.push_back(l.scaling.contiguous());
  p.lora_n = static_cast<int>(l.n);
  p.lora_experts = static_cast<int>(s.E);
  p.lora_scaling = keep.back().const_data_ptr<float>();
  p.ext_tiles = p.ext_split = 0;
}

// The shrink kernel over the launch's A rows (`p`: a gate/up or down GEMM's parameters, copied) against the A
// adapters `a0` (columns [0, r0) of u) and `a1` (r1 more; undefined: none): u [blocks BM, r0 + r1] (zeroed) and, with
// `compact` defined, its routed rows in compact order there too.
template <int MODE>
at::Tensor lora_shrink(const char* op, sm90::Params p, const at::Tensor& a0, const at::Tensor& a1,
                       const at::Tensor& compact, const at::Tensor& sorted, const MoeShape& g, cudaStream_t stream) {
  const int64_t r0 = a0.size(2), r1 = a1.defined() ? a1.size(2) : 0;
  auto u = at::zeros({g.blocks * sm90::BM, r0 + r1}, a0.options());
  adapter_map(op, "a LoRA A", &p.tm_b0, a0);
  adapter_map(op, "a LoRA A", &p.tm_b1, a1.defined() ? a1 : a0);  // read, never stored, without a second adapter
  p.lora_group_rows[0] = static_cast<int>(r0);
  p.lora_group_rows[1] = static_cast<int>(a1.defined() ? r1 : r0);
  p.lora_rank[0] = static_cast<int>(r0);
  p.lora_rank[1] = static_cast<int>(r1);
  p.u_out = reinterpret_cast<__nv_bfloat16*>(u.mutable_data_ptr());
  p.u_compact = compact.defined() ? reinterpret_cast<__nv_bfloat16*>(compact.mutable_data_ptr()) : nullptr;
  p.ld_u = r0 + r1;
  p.b_gate = p.b_up = p.b2 = nullptr;
  const auto tile_counter = at::zeros({1}, sorted.options().dtype(at::kInt));
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  sm90::launch<MODE>(p, 1, g, stream);
  return u;
}

// B_gate and B_up as one (n, E, 2 hidden, r_gate + r_up) tensor whose rows alternate gate, up (gpt-oss's column
// pairs, one extension over all the pairs' columns): gate row j = [B_gate[j] | 0], up row j = [0 | B_up[j]].
at::Tensor paired_adapter_b(const Lora& l, int64_t E, int64_t hidden, const at::TensorOptions& options) {
  const int64_t rg = l.gate.rank, ru = l.up.rank;
  auto b = at::zeros({l.n, E, hidden, 2, rg + ru}, options);
  if (l.gate.present()) b.select(3, 0).narrow(3, 0, rg).copy_(l.gate.b);
  if (l.up.present()) b.select(3, 1).narrow(3, rg, ru).copy_(l.up.b);
  return b.view({l.n, E, 2 * hidden, rg + ru});
}

// The gate/up GEMM with the gate and up adapters, in MODE's persistent twin with LORA_EXTENSION (`p`, `form`:
// gate_up_params'; the compact rows computed): the shrink writes [u_gate | u_up] of the routed rows into `lora_rows`
// (compact, rows past them zeroed), then the GEMM reads u as its K extension.
template <int MODE, int ACT>
void lora_gate_up(const char* op, sm90::Params& p, int form, const Lora& l, const MoeShape& s, const MoeShape& g,
                  const CompactRows& rows, at::Tensor& lora_rows, std::vector<at::Tensor>& keep,
                  cudaStream_t stream) {
  const int64_t rg = l.gate.rank, ru = l.up.rank;
  lora_rows = at::empty({s.M * s.top_k, rg + ru}, keep[0].options());
  if (rg + ru > 0) zero_rows_past(lora_rows, rows.count);
  if (s.blocks == 0 || s.M == 0) return;
  lora_params(p, l, s, keep);
  if (rg + ru > 0) {
    const at::Tensor a0 = adapter_operand(op, "a_gate", l.gate.present() ? l.gate.a : l.up.a, keep);
    const at::Tensor a1 = l.gate.present() && l.up.present() ? adapter_operand(op, "a_up", l.up.a, keep)
                                                               : at::Tensor();
    keep.push_back(lora_shrink<sm90::LORA_SHRINK_X>(op, p, a0, a1, lora_rows, keep[3], g, stream));
    extension_rows(op, p, keep.back());
    if (form == sm90::kInOutPairs) {  // one B over the pairs' columns
      keep.push_back(paired_adapter_b(l, s.E, s.hidden, keep.back().options()));
      for (int i = 0; i < 2; ++i) extension_b(op, p, i, keep.back(), 0);
    } else if (ACT == sm90::kActRelu2) {  // gate alone, 2 B_BOX_ROWS rows of it
      const at::Tensor b = adapter_operand(op, "b_gate", l.gate.b, keep);
      for (int i = 0; i < 2; ++i) extension_b(op, p, i, b, 0);
    } else {  // the gate half: B_gate against u_gate; the up half: B_up against u_up, r_gate columns on
      const at::Tensor bg = l.gate.present() ? adapter_operand(op, "b_gate", l.gate.b, keep) : at::Tensor();
      const at::Tensor bu = l.up.present() ? adapter_operand(op, "b_up", l.up.b, keep) : at::Tensor();
      extension_b(op, p, 0, bg.defined() ? bg : bu, bg.defined() ? 0 : kAbsentShift);
      extension_b(op, p, 1, bu.defined() ? bu : bg, bu.defined() ? -static_cast<int>(rg) : kAbsentShift);
    }
  }
  const int n_tiles = gate_up_tiles(s, ACT != sm90::kActRelu2);
  const auto tile_counter = at::zeros({1}, keep[3].options().dtype(at::kInt));
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  with_weight_form(form, [&](auto f) {
    constexpr int kForm = decltype(f)::value;
    if constexpr (kForm == sm90::kInOutPairs && ACT == sm90::kActRelu2) {
      TORCH_CHECK(false, "flash_moe: relu2 has no gate/up pairs");  // gate_up_params never pairs a relu2 weight
    } else {
      sm90::launch<sm90::with_lora_extension(sm90::persistent_twin(MODE)), ACT, kForm>(p, n_tiles, g, stream);
    }
  });
}

// The compact g | u rows a gate/up GEMM keeps (p.saved), their rows past the routed ones zeroed.
at::Tensor saved_rows(sm90::Params& p, const CompactRows& rows, const MoeShape& s, bool gated,
                      const at::TensorOptions& options) {
  const int64_t width = (gated ? 2 : 1) * s.hidden;
  auto saved = at::empty({s.M * s.top_k, width}, options);
  zero_rows_past(saved, rows.count);
  p.saved = reinterpret_cast<__nv_bfloat16*>(saved.mutable_data_ptr());
  p.ld_saved = width;
  return saved;
}

// run() with the adapters: the gate/up GEMM (lora_gate_up), then the down shrink over h and the down GEMM with its
// extension; `lora_rows`: [u_gate | u_up] of the routed slots, compact.
template <int ACT>
void run_lora(const char* op, const at::Tensor& x, const Experts& w, const at::Tensor& w2_in, const Lora& l,
              const at::Tensor& sorted, const at::Tensor& eids, const at::Tensor& ntpp,
              const at::Tensor& topk_weights, const MoeShape& s, int mode, at::Tensor& result, at::Tensor* gate_up,
              at::Tensor& lora_rows) {
  const MoeShape g = group_shape(s, l.n);
  std::vector<at::Tensor> keep;
  int form;
  sm90::Params p = gate_up_params(op, x, w.gate, w.up, sorted, eids, ntpp, g, w, keep, form);
  at::Tensor w2;
  const int down_form = w2_form(w2_in, w2);
  sm90::check_cuda_operand(op, "w2", w2);
  const auto tw = topk_weights.contiguous();
  result = mode == sm90::DOWN_ATOMIC ? at::zeros({s.M, s.dim}, x.options().dtype(at::kFloat))
                                     : at::empty({s.M * s.top_k, s.dim}, x.options());
  const CompactRows rows = compact_rows(p, keep[3], keep[4], ntpp, g);
  if (gate_up != nullptr) *gate_up = saved_rows(p, rows, s, w.act.gated(), x.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto inter = at::empty({s.blocks * sm90::BM, s.hidden}, x.options());
  p.inter = reinterpret_cast<__nv_bfloat16*>(inter.mutable_data_ptr());
  p.ld_inter = s.hidden;
  if (gate_up != nullptr) {
    lora_gate_up<sm90::GATE_UP_AND_SAVE, ACT>(op, p, form, l, s, g, rows, lora_rows, keep, stream);
  } else {
    lora_gate_up<sm90::GATE_UP, ACT>(op, p, form, l, s, g, rows, lora_rows, keep, stream);
  }
  if (s.blocks == 0 || s.M == 0) return;
  // down + its adapter + b2 + combine
  p.b_gate = p.b_up = nullptr;
  p.b2 = bias_pointer(op, "b2", w.b2, keep);
  p.a = reinterpret_cast<const __nv_bfloat16*>(inter.const_data_ptr());
  p.lda = s.hidden;
  expert_map(op, "w2", &p.tm_b0, w2, down_form, down_form == sm90::kInOut, p.b_rows_per_expert);
  p.n_total = static_cast<int>(s.dim);
  p.k_tiles = static_cast<int>(s.hidden / sm90::BK);
  p.ld_out = s.dim;
  p.ext_tiles = 0;
  if (l.down.present()) {
    const at::Tensor a_down = adapter_operand(op, "a_down", l.down.a, keep);
    keep.push_back(lora_shrink<sm90::LORA_SHRINK_H>(op, p, a_down, at::Tensor(), at::Tensor(), keep[3], g, stream));
    extension_rows(op, p, keep.back());
    const at::Tensor b = adapter_operand(op, "b_down", l.down.b, keep);
    for (int i = 0; i < 2; ++i) extension_b(op, p, i, b, 0);
  }
  const int n_tiles = static_cast<int>((s.dim + sm90::BN_DOWN - 1) / sm90::BN_DOWN);
  const auto tile_counter = at::zeros({1}, keep[3].options().dtype(at::kInt));
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  with_weight_form(down_form, [&](auto f) {
    constexpr int kForm = decltype(f)::value;
    if constexpr (kForm != sm90::kInOutPairs) {  // w2_form: never pairs
      if (mode == sm90::DOWN_ATOMIC) {
        p.topk_weights = tw.const_data_ptr<float>();
        p.acc32 = result.mutable_data_ptr<float>();
        sm90::launch<sm90::with_lora_extension(sm90::DOWN_ATOMIC), sm90::kActSwiGLU, kForm>(p, n_tiles, g, stream);
      } else {
        p.yslots = reinterpret_cast<__nv_bfloat16*>(result.mutable_data_ptr());
        sm90::launch<sm90::with_lora_extension(sm90::DOWN_SLOTS), sm90::kActSwiGLU, kForm>(p, n_tiles, g, stream);
      }
    }
  });
}

// dH's K extension (`p`: the dH GEMM's parameters): LORA_SHRINK_G writes v = s_a grad_out B_down (B_down N-major) into
// lora_rows' first r columns, then the GEMM reads v (from the compact rows) against A_down (N-major).
void grad_gate_up_extension(const char* op, sm90::Params& p, const Lora& l, const MoeShape& s, at::Tensor& lora_rows,
                            const at::Tensor& sorted, const MoeShape& g, std::vector<at::Tensor>& keep,
                            cudaStream_t stream) {
  const int64_t r = l.down.rank;
  sm90::Params q = p;
  adapter_map(op, "b_down", &q.tm_b0, adapter_operand(op, "b_down", l.down.b, keep), sm90::BK, sm90::MN_ATOM);
  q.tm_b1 = q.tm_b0;
  q.lora_group_rows[0] = q.lora_group_rows[1] = static_cast<int>(s.dim);
  q.ext_shift[0] = q.ext_shift[1] = 0;
  q.lora_rank[0] = static_cast<int>(r);
  q.lora_rank[1] = 0;
  q.u_out = nullptr;
  q.u_compact = reinterpret_cast<__nv_bfloat16*>(lora_rows.mutable_data_ptr());
  q.ld_u = 2 * r;
  const auto tile_counter = at::zeros({1}, sorted.options().dtype(at::kInt));
  q.tile_counter = tile_counter.mutable_data_ptr<int>();
  sm90::launch<sm90::LORA_SHRINK_G>(q, 1, g, stream);
  const int rc = prime_kernels::make_tmap_2d(&p.tm_ua[0], lora_rows.const_data_ptr(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                             lora_rows.size(0), r, lora_rows.size(1), sm90::BM, sm90::BK);
  TORCH_CHECK(rc == 0, op, " (CUDA): cuTensorMapEncodeTiled failed for the LoRA rank-r rows (CUresult ", rc, ")");
  adapter_map(op, "a_down", &p.tm_ub[0], adapter_operand(op, "a_down", l.down.a, keep), sm90::BK, sm90::MN_ATOM);
  p.lora_group_rows[0] = static_cast<int>(r);
  p.ext_tiles = p.ext_split = static_cast<int>((r + sm90::BK - 1) / sm90::BK);
}

// lora_rows' other r columns: p bf16(s_a h A_down^T) of the routed rows, by LORA_SHRINK_P over the compact rows of
// `h_rows` (bf16 h, from the dH epilogue; `p`: the dH GEMM's parameters, copied).
void lora_weighted_h_rows(const char* op, sm90::Params p, const at::Tensor& h_rows, const Lora& l, const MoeShape& s,
                          at::Tensor& lora_rows, const at::Tensor& sorted, const MoeShape& g,
                          std::vector<at::Tensor>& keep, cudaStream_t stream) {
  const int64_t r = l.down.rank;
  p.a = reinterpret_cast<const __nv_bfloat16*>(h_rows.const_data_ptr());
  p.a2 = p.a;
  p.lda = s.hidden;
  p.k_tiles = p.k_half = static_cast<int>(s.hidden / sm90::BK);
  const at::Tensor a_down = adapter_operand(op, "a_down", l.down.a, keep);
  adapter_map(op, "a_down", &p.tm_b0, a_down);
  p.tm_b1 = p.tm_b0;
  p.lora_group_rows[0] = p.lora_group_rows[1] = static_cast<int>(r);
  p.lora_rank[0] = static_cast<int>(r);
  p.lora_rank[1] = 0;
  p.u_out = nullptr;
  p.u_compact = reinterpret_cast<__nv_bfloat16*>(lora_rows.mutable_data_ptr()) + r;
  p.ld_u = 2 * r;
  const auto tile_counter = at::zeros({1}, sorted.options().dtype(at::kInt));
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  sm90::launch<sm90::LORA_SHRINK_P>(p, 1, g, stream);
}

// moe_grad_gate_up, or with the down adapter (`lora_args`: scaling, a_down, b_down; `lora_rows` set)
// moe_lora_grad_gate_up: the dH GEMM with its activation-backward epilogue and, with adapters, its K extension: the
// LORA_SHRINK_G kernel writes v = s_a grad_out B_down of the routed rows (compact, bf16) into lora_rows' first r
// columns, the dH GEMM reads v against A_down (N-major) after its base K tiles and stores h = bf16(activation(g, u))
// of the saved g | u beside p h (what the CPU op recomputes), and LORA_SHRINK_P writes p bf16(s_a h A_down^T) into
// the other r columns.
struct LoraDownArgs {
  const at::Tensor& scaling;
  const std::optional<at::Tensor>&a_down, &b_down;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_gate_up(
    const char* op, const at::Tensor& grad_out, const at::Tensor& w2_in, const at::Tensor& gate_up,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    const at::Tensor& topk_weights, int64_t top_k, int64_t block_m, int64_t num_experts, c10::string_view activation,
    double alpha, double limit, const LoraDownArgs* lora_args, at::Tensor* lora_rows) {
  const ActivationSpec act = parse_activation(op, activation, alpha, limit);
  MoeShape s = check_grad_gate_up_args(op, grad_out, w2_in, gate_up, sorted_token_ids, expert_ids,
                                       num_tokens_post_padded, topk_weights, top_k, block_m, act.gated());
  set_global_experts(op, num_experts, s);
  const std::optional<Lora> l =
      lora_args == nullptr ? std::nullopt
                           : std::optional<Lora>(check_lora(op, grad_out, lora_args->scaling, s.E, s.dim, s.hidden,
                                                            act.gated(), std::nullopt, std::nullopt, std::nullopt,
                                                            std::nullopt, lora_args->a_down, lora_args->b_down,
                                                            "grad_out"));
  const MoeShape g = l ? group_shape(s, l->n) : s;  // the alignment's groups
  const c10::cuda::CUDAGuard guard(grad_out.device());
  sm90::check_sm90(op, grad_out);
  const auto go = grad_out.contiguous(), gu = gate_up.contiguous(), tw = topk_weights.contiguous();
  at::Tensor w2;
  const int form = w2_form(w2_in, w2);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_out", &go}, {"w2", &w2},
                         {"gate_up", &gu}}) {
    sm90::check_cuda_operand(op, name, *t);
  }
  const auto sorted = sorted_token_ids.contiguous(), eids = expert_ids.contiguous();
  const int64_t slots = s.M * s.top_k;
  const int64_t width = (act.gated() ? 2 : 1) * s.hidden;  // dg | du, or dg alone (g | u's layout)
  auto grad_gate_up = at::empty({slots, width}, go.options());
  auto weighted_h = at::empty({slots, s.hidden}, go.options());
  const int n_tiles = static_cast<int>((s.hidden + sm90::BN - 1) / sm90::BN);
  auto partials = at::zeros({n_tiles, slots}, go.options().dtype(at::kFloat));
  const auto tile_counter = at::zeros({1}, sorted_token_ids.options().dtype(at::kInt));
  sm90::Params p{};
  const CompactRows rows = compact_rows(p, sorted, eids, num_tokens_post_padded, g);
  const int64_t r_down = l ? l->down.rank : 0;
  if (l) {
    *lora_rows = at::empty({slots, 2 * r_down}, go.options());
    if (r_down > 0) zero_rows_past(*lora_rows, rows.count);
  }
  p.saved = const_cast<__nv_bfloat16*>(reinterpret_cast<const __nv_bfloat16*>(gu.const_data_ptr()));
  p.ld_saved = width;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  zero_rows_past(grad_gate_up, rows.count);
  zero_rows_past(weighted_h, rows.count);
  if (s.blocks > 0 && s.M > 0) {
    p.top_k = static_cast<int>(s.top_k);
    p.num_experts = static_cast<int>(g.E);
    p.num_slots = static_cast<int>(slots);
    p.sorted = sorted.const_data_ptr<int>();
    p.expert_ids = eids.const_data_ptr<int>();
    p.ntpp = num_tokens_post_padded.const_data_ptr<int>();
    p.a = reinterpret_cast<const __nv_bfloat16*>(go.const_data_ptr());
    p.lda = s.dim;
    // K = dim, N = hidden: w2's rows (K) x hidden columns, N-major, or transposed its hidden rows (N), K-major;
    // columns past hidden read as zeros
    expert_map(op, "w2", &p.tm_b0, w2, form, form == sm90::kOutIn, p.b_rows_per_expert);
    p.n_total = static_cast<int>(s.hidden);
    p.k_tiles = static_cast<int>(s.dim / sm90::BK);
    p.topk_weights = tw.const_data_ptr<float>();
    p.grad_gate = reinterpret_cast<__nv_bfloat16*>(grad_gate_up.mutable_data_ptr());
    p.grad_up = act.gated() ? p.grad_gate + s.hidden : nullptr;
    p.ld_grad = width;
    p.alpha = act.alpha;
    p.limit = act.limit;
    p.weighted_h = reinterpret_cast<__nv_bfloat16*>(weighted_h.mutable_data_ptr());
    p.dot_partials = partials.mutable_data_ptr<float>();
    p.tile_counter = tile_counter.mutable_data_ptr<int>();
    std::vector<at::Tensor> keep;
    at::Tensor h_rows;  // the LoRA rows' h, compact, from the dH epilogue
    if (l) {
      lora_params(p, *l, s, keep);
      if (r_down > 0) {
        grad_gate_up_extension(op, p, *l, s, *lora_rows, sorted, g, keep, stream);
        h_rows = at::empty({slots, s.hidden}, go.options());
        p.h_rows = reinterpret_cast<__nv_bfloat16*>(h_rows.mutable_data_ptr());
      }
    }
    with_activation(act, [&](auto a) {
      with_weight_form(form, [&](auto f) {
        constexpr int kForm = decltype(f)::value;
        if constexpr (kForm != sm90::kInOutPairs) {  // w2_form: never pairs
          if (l) {
            sm90::launch<sm90::with_lora_extension(sm90::DH_SWIGLU), decltype(a)::value, kForm>(p, n_tiles, g,
                                                                                                stream);
          } else {
            sm90::launch<sm90::DH_SWIGLU, decltype(a)::value, kForm>(p, n_tiles, s, stream);
          }
        }
      });
    });
    if (l && r_down > 0) lora_weighted_h_rows(op, p, h_rows, *l, s, *lora_rows, sorted, g, keep, stream);
  }
  // the column tiles' partial sums in tile order: the same bits on every run
  return {grad_gate_up, weighted_h, partials.sum(0).view({s.M, s.top_k})};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_grad_gate_up_cuda(
    const at::Tensor& grad_out, const at::Tensor& w2, const at::Tensor& gate_up, const at::Tensor& sorted_token_ids,
    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights,
    int64_t top_k, int64_t block_m, int64_t num_experts, c10::string_view activation, double alpha, double limit) {
  return grad_gate_up("moe_grad_gate_up", grad_out, w2, gate_up, sorted_token_ids, expert_ids, num_tokens_post_padded,
                      topk_weights, top_k, block_m, num_experts, activation, alpha, limit, nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_lora_grad_gate_up_cuda(
    const at::Tensor& grad_out, const at::Tensor& w2, const at::Tensor& gate_up, const at::Tensor& sorted_token_ids,
    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights,
    int64_t top_k, int64_t block_m, const at::Tensor& scaling, const std::optional<at::Tensor>& a_down,
    const std::optional<at::Tensor>& b_down, int64_t num_experts, c10::string_view activation, double alpha,
    double limit) {
  const LoraDownArgs lora{scaling, a_down, b_down};
  at::Tensor lora_rows;
  auto [grad_gate_up_rows, weighted_h, grad_weights] =
      grad_gate_up("moe_lora_grad_gate_up", grad_out, w2, gate_up, sorted_token_ids, expert_ids,
                   num_tokens_post_padded, topk_weights, top_k, block_m, num_experts, activation, alpha, limit, &lora,
                   &lora_rows);
  return {grad_gate_up_rows, weighted_h, grad_weights, lora_rows};
}



// LORA_SHRINK_D over dX's A rows (`p`: its parameters, copied; compact rows of dg, then du, or of the interleaved
// dg | du with `one_gemm`): w = s_a [dg B_gate | du B_up] into the compact `lora_rows` (B N-major: B_gate's rows in
// the dg K tiles, B_up's r_gate columns on in the du ones; gpt-oss's pairs: one B whose rows alternate gate, up).
void lora_shrink_d(const char* op, sm90::Params p, const Lora& l, const MoeShape& s, bool one_gemm,
                   at::Tensor& lora_rows, const at::Tensor& sorted, const MoeShape& g, std::vector<at::Tensor>& keep,
                   cudaStream_t stream) {
  const int64_t rg = l.gate.rank, ru = l.up.rank;
  if (one_gemm) {
    keep.push_back(paired_adapter_b(l, s.E, s.hidden, lora_rows.options()));
    adapter_map(op, "the LoRA B pairs", &p.tm_b0, keep.back(), sm90::BK, sm90::MN_ATOM);
    p.tm_b1 = p.tm_b0;
    p.lora_group_rows[0] = p.lora_group_rows[1] = static_cast<int>(2 * s.hidden);
    p.ext_shift[0] = p.ext_shift[1] = 0;
  } else {
    const at::Tensor bg = l.gate.present() ? adapter_operand(op, "b_gate", l.gate.b, keep) : at::Tensor();
    const at::Tensor bu = l.up.present() ? adapter_operand(op, "b_up", l.up.b, keep) : at::Tensor();
    adapter_map(op, "b_gate", &p.tm_b0, bg.defined() ? bg : bu, sm90::BK, sm90::MN_ATOM);
    adapter_map(op, "b_up", &p.tm_b1, bu.defined() ? bu : bg, sm90::BK, sm90::MN_ATOM);
    p.lora_group_rows[0] = p.lora_group_rows[1] = static_cast<int>(s.hidden);
    p.ext_shift[0] = bg.defined() ? 0 : kAbsentShift;
    p.ext_shift[1] = bu.defined() ? -static_cast<int>(rg) : kAbsentShift;
  }
  p.lora_rank[0] = static_cast<int>(rg + ru);
  p.lora_rank[1] = 0;
  p.u_out = nullptr;
  p.u_compact = reinterpret_cast<__nv_bfloat16*>(lora_rows.mutable_data_ptr());
  p.ld_u = rg + ru;
  const auto tile_counter = at::zeros({1}, sorted.options().dtype(at::kInt));
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  sm90::launch<sm90::LORA_SHRINK_D>(p, 1, g, stream);
}

// dX's K extension: w_gate (then w_up) of the compact `lora_rows` against A_gate (A_up), N-major.
void grad_x_extension(const char* op, sm90::Params& p, const Lora& l, const at::Tensor& lora_rows,
                      std::vector<at::Tensor>& keep) {
  const int64_t rg = l.gate.rank;
  int tiles[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const LoraPair& pair = i ? l.up : l.gate;
    if (!pair.present()) continue;
    const int rc = prime_kernels::make_tmap_2d(
        &p.tm_ua[i], static_cast<const __nv_bfloat16*>(lora_rows.const_data_ptr()) + (i ? rg : 0),
        CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, lora_rows.size(0), pair.rank, lora_rows.size(1), sm90::BM, sm90::BK);
    TORCH_CHECK(rc == 0, op, " (CUDA): cuTensorMapEncodeTiled failed for the LoRA rank-r rows (CUresult ", rc, ")");
    adapter_map(op, i ? "a_up" : "a_gate", &p.tm_ub[i], adapter_operand(op, i ? "a_up" : "a_gate", pair.a, keep),
                sm90::BK, sm90::MN_ATOM);
    p.lora_group_rows[i] = static_cast<int>(pair.rank);
    tiles[i] = static_cast<int>((pair.rank + sm90::BK - 1) / sm90::BK);
  }
  p.ext_split = tiles[0];
  p.ext_tiles = tiles[0] + tiles[1];
}

// moe_grad_x, or with adapters (`lora_args`: scaling, a_gate, b_gate, a_up, b_up; `lora_rows` set) moe_lora_grad_x:
// the dX GEMM over dg | du against w1 | w3 and, with adapters, its K extension: the LORA_SHRINK_D kernel writes
// w = s_a [dg B_gate | du B_up] of the routed rows (compact, rounded once to bf16) into *lora_rows, then the dX GEMM
// reads w_gate and w_up against A_gate and A_up (N-major) after its base K tiles.
struct LoraArgs {
  const at::Tensor& scaling;
  const std::optional<at::Tensor>&a_gate, &b_gate, &a_up, &b_up;
};

at::Tensor grad_x(const char* op, const at::Tensor& grad_gate, const std::optional<at::Tensor>& grad_up_in,
                  const at::Tensor& w1_in, const std::optional<at::Tensor>& w3_opt, const at::Tensor& sorted_token_ids,
                  const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, int64_t top_k,
                  int64_t block_m, bool deterministic, int64_t num_experts, const LoraArgs* lora_args,
                  at::Tensor* lora_rows) {
  check_grad_x_halves(op, grad_up_in, w3_opt);
  // not gated (relu2): dx from dg and w1 alone, the up half's operands standing in for checks and never read
  const bool gated = w3_opt.has_value();
  const at::Tensor &grad_up = gated ? *grad_up_in : grad_gate, &w3_in = gated ? *w3_opt : w1_in;
  MoeShape s = check_grad_x_args(op, grad_gate, grad_up, w1_in, w3_in, sorted_token_ids, expert_ids,
                                 num_tokens_post_padded, top_k, block_m);
  set_global_experts(op, num_experts, s);
  const std::optional<Lora> l =
      lora_args == nullptr ? std::nullopt
                           : std::optional<Lora>(check_lora(op, grad_gate, lora_args->scaling, s.E, s.dim, s.hidden,
                                                            gated, lora_args->a_gate, lora_args->b_gate,
                                                            lora_args->a_up, lora_args->b_up, std::nullopt,
                                                            std::nullopt, "grad_gate"));
  const MoeShape g = l ? group_shape(s, l->n) : s;  // the alignment's groups
  const c10::cuda::CUDAGuard guard(grad_gate.device());
  sm90::check_sm90(op, grad_gate);
  // dg, du and w1, w3 each the interleaved halves of one tensor (gpt-oss's gate_up_proj): one GEMM over those, K =
  // 2 hidden in their column order
  const at::Tensor grad_pairs = gated ? interleaved_grads(grad_gate, grad_up) : at::Tensor();
  const at::Tensor weight_pairs = grad_pairs.defined() ? interleaved_base(w1_in, w3_in) : at::Tensor();
  const bool one_gemm = weight_pairs.defined() && weight_form(weight_pairs) >= 0;
  // else read in place when their rows are whole 16-byte units at one row stride (the halves of moe_grad_gate_up's
  // dg | du: row stride 2 hidden), else as contiguous copies
  const bool in_place = one_gemm || (grad_gate.stride(1) == 1 && grad_up.stride(1) == 1 &&
                                     grad_gate.stride(0) == grad_up.stride(0) && grad_gate.stride(0) % 8 == 0);
  // one GEMM: du and w3 are never read (their views start mid-row): the pairs stand in for them
  const auto dg = one_gemm ? grad_pairs : in_place ? grad_gate : grad_gate.contiguous();
  const auto du = one_gemm ? grad_pairs : in_place ? grad_up : grad_up.contiguous();
  // the weights read in place when TMA can (whole 16-byte rows, whole rows between experts), K-major when transposed
  int form = one_gemm ? weight_form(weight_pairs) : w1_in.strides() == w3_in.strides() ? weight_form(w1_in) : -1;
  const auto w1 = one_gemm ? weight_pairs : form < 0 ? w1_in.contiguous() : w1_in;
  const auto w3 = one_gemm ? weight_pairs : form < 0 ? w3_in.contiguous() : w3_in;
  if (form < 0) form = sm90::kOutIn;
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_gate", &dg}, {"grad_up", &du},
                         {"w1", &w1}, {"w3", &w3}}) {
    sm90::check_cuda_operand(op, name, *t);
  }
  const auto sorted = sorted_token_ids.contiguous(), eids = expert_ids.contiguous();
  // per slot: the combine reads the routed slots' rows only, all of which the kernel writes
  at::Tensor result = deterministic ? at::empty({s.M * s.top_k, s.dim}, dg.options())
                                    : at::zeros({s.M, s.dim}, dg.options().dtype(at::kFloat));
  sm90::Params p{};
  const CompactRows rows = compact_rows(p, sorted, eids, num_tokens_post_padded, g);
  const auto tile_counter = at::zeros({1}, sorted.options().dtype(at::kInt));
  const int64_t r_gate = l ? l->gate.rank : 0, r_up = l ? l->up.rank : 0;
  if (l) {
    *lora_rows = at::empty({s.M * s.top_k, r_gate + r_up}, dg.options());
    if (r_gate + r_up > 0) zero_rows_past(*lora_rows, rows.count);
  }
  if (s.blocks > 0 && s.M > 0) {
    p.top_k = static_cast<int>(s.top_k);
    p.num_experts = static_cast<int>(g.E);
    p.num_slots = static_cast<int>(s.M * s.top_k);
    p.sorted = sorted.const_data_ptr<int>();
    p.expert_ids = eids.const_data_ptr<int>();
    p.ntpp = num_tokens_post_padded.const_data_ptr<int>();
    p.a = reinterpret_cast<const __nv_bfloat16*>(dg.const_data_ptr());
    p.a2 = reinterpret_cast<const __nv_bfloat16*>(du.const_data_ptr());
    p.lda = dg.stride(0);
    // K = hidden, N = dim: the weights' hidden rows (K) x dim columns, N-major, or transposed their dim rows (N),
    // K-major; columns past dim read as zeros. One GEMM: w1 is the pairs' (E, 2 hidden, dim), its K tiles all first.
    expert_map(op, "w1", &p.tm_b0, w1, form, form == sm90::kOutIn, p.b_rows_per_expert);
    if (!one_gemm) expert_map(op, "w3", &p.tm_b1, w3, form, form == sm90::kOutIn, p.b_rows_per_expert);
    p.k_tiles = static_cast<int>((gated ? 2 : 1) * s.hidden / sm90::BK);
    p.k_half = one_gemm || !gated ? p.k_tiles : p.k_tiles / 2;
    p.n_total = static_cast<int>(s.dim);
    p.ld_out = s.dim;
    p.tile_counter = tile_counter.mutable_data_ptr<int>();
    const int n_tiles = static_cast<int>((s.dim + sm90::BN_DOWN - 1) / sm90::BN_DOWN);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    std::vector<at::Tensor> keep;
    if (l) {
      lora_params(p, *l, s, keep);
      if (r_gate + r_up > 0) {
        lora_shrink_d(op, p, *l, s, one_gemm, *lora_rows, sorted, g, keep, stream);
        grad_x_extension(op, p, *l, *lora_rows, keep);
      }
    }
    with_weight_form(form, [&](auto f) {
      constexpr int kForm = decltype(f)::value;
      if constexpr (kForm != sm90::kInOutPairs) {  // weight_form: never pairs
        if (deterministic) {
          p.yslots = reinterpret_cast<__nv_bfloat16*>(result.mutable_data_ptr());
          if (l) {
            sm90::launch<sm90::with_lora_extension(sm90::DX_SLOTS), sm90::kActSwiGLU, kForm>(p, n_tiles, g, stream);
          } else {
            sm90::launch<sm90::DX_SLOTS, sm90::kActSwiGLU, kForm>(p, n_tiles, s, stream);
          }
        } else {
          p.acc32 = result.mutable_data_ptr<float>();
          if (l) {
            sm90::launch<sm90::with_lora_extension(sm90::DX_ATOMIC), sm90::kActSwiGLU, kForm>(p, n_tiles, g, stream);
          } else {
            sm90::launch<sm90::DX_ATOMIC, sm90::kActSwiGLU, kForm>(p, n_tiles, s, stream);
          }
        }
      }
    });
  }
  if (!deterministic) return result.to(at::kBFloat16);
  // a token's slots summed in k order (fp32), the routed ones only
  const auto ones = at::ones({s.M, s.top_k}, dg.options().dtype(at::kFloat));
  return combine_in_k_order_cuda(result, ones, sorted, eids, num_tokens_post_padded, g);
}

at::Tensor moe_grad_x_cuda(const at::Tensor& grad_gate, const std::optional<at::Tensor>& grad_up,
                           const at::Tensor& w1, const std::optional<at::Tensor>& w3,
                           const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                           const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_m,
                           bool deterministic, int64_t num_experts) {
  return grad_x("moe_grad_x", grad_gate, grad_up, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                block_m, deterministic, num_experts, nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor> moe_lora_grad_x_cuda(
    const at::Tensor& grad_gate, const std::optional<at::Tensor>& grad_up, const at::Tensor& w1,
    const std::optional<at::Tensor>& w3, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
    const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_m, bool deterministic,
    const at::Tensor& scaling, const std::optional<at::Tensor>& a_gate, const std::optional<at::Tensor>& b_gate,
    const std::optional<at::Tensor>& a_up, const std::optional<at::Tensor>& b_up, int64_t num_experts) {
  const LoraArgs lora{scaling, a_gate, b_gate, a_up, b_up};
  at::Tensor lora_rows;
  at::Tensor dx = grad_x("moe_lora_grad_x", grad_gate, grad_up, w1, w3, sorted_token_ids, expert_ids,
                         num_tokens_post_padded, top_k, block_m, deterministic, num_experts, &lora, &lora_rows);
  return {dx, lora_rows};
}



std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_lora_forward_cuda(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& w3, const at::Tensor& w2,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    const at::Tensor& topk_weights, int64_t top_k, int64_t block_m, bool deterministic, bool save_gate_up,
    int64_t num_experts, const at::Tensor& scaling, const std::optional<at::Tensor>& a_gate,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& a_up,
    const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& a_down,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, double alpha, double limit,
    const std::optional<at::Tensor>& bias_gate, const std::optional<at::Tensor>& bias_up,
    const std::optional<at::Tensor>& b2) {
  const char* op = "moe_lora_forward";
  const ActivationSpec act = parse_activation(op, activation, alpha, limit);
  MoeShape s;
  const Experts w = check_experts(op, x, w1, w3, &w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                  &topk_weights, top_k, block_m, num_experts, act, bias_gate, bias_up, b2, s);
  const Lora l = check_lora(op, x, scaling, s.E, s.dim, s.hidden, act.gated(), a_gate, b_gate, a_up, b_up, a_down,
                            b_down);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor result, lora_rows, gate_up = at::empty({0, (act.gated() ? 2 : 1) * s.hidden}, x.options());
  with_activation(act, [&](auto a) {
    run_lora<decltype(a)::value>(op, x, w, w2, l, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
                                 s, deterministic ? sm90::DOWN_SLOTS : sm90::DOWN_ATOMIC, result,
                                 save_gate_up ? &gate_up : nullptr, lora_rows);
  });
  return {deterministic ? combine_in_k_order_cuda(result, topk_weights, sorted_token_ids, expert_ids,
                                                 num_tokens_post_padded, group_shape(s, l.n))
                        : result.to(at::kBFloat16),
          gate_up, lora_rows};
}

std::tuple<at::Tensor, at::Tensor> moe_lora_gate_up_cuda(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& w3, const at::Tensor& sorted_token_ids,
    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_m,
    const at::Tensor& scaling, const std::optional<at::Tensor>& a_gate, const std::optional<at::Tensor>& b_gate,
    const std::optional<at::Tensor>& a_up, const std::optional<at::Tensor>& b_up, int64_t num_experts,
    const std::optional<at::Tensor>& bias_gate, const std::optional<at::Tensor>& bias_up) {
  const char* op = "moe_lora_gate_up";
  MoeShape s;
  const Experts w = check_gate_up_experts(op, x, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                                          block_m, num_experts, bias_gate, bias_up, s);
  const Lora l = check_lora(op, x, scaling, s.E, s.dim, s.hidden, w.act.gated(), a_gate, b_gate, a_up, b_up,
                            std::nullopt, std::nullopt);
  const c10::cuda::CUDAGuard guard(x.device());
  const MoeShape g = group_shape(s, l.n);
  std::vector<at::Tensor> keep;
  int form;
  sm90::Params p = gate_up_params(op, x, w.gate, w.up, sorted_token_ids, expert_ids, num_tokens_post_padded, g, w,
                                  keep, form);
  const CompactRows rows = compact_rows(p, keep[3], keep[4], num_tokens_post_padded, g);
  at::Tensor gate_up = saved_rows(p, rows, s, w.act.gated(), x.options()), lora_rows;
  with_activation(w.act, [&](auto a) {
    lora_gate_up<sm90::GATE_UP_SAVE, decltype(a)::value>(op, p, form, l, s, g, rows, lora_rows, keep,
                                                         c10::cuda::getCurrentCUDAStream());
  });
  return {gate_up, lora_rows};
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY_IMPL(flash_moe, CUDA, m) {
  m.impl("fused_moe_bf16", &flash_moe::fused_moe_bf16_cuda);
  m.impl("moe_forward", &flash_moe::moe_forward_cuda);
  m.impl("moe_gate_up", &flash_moe::moe_gate_up_cuda);
  m.impl("moe_grad_gate_up", &flash_moe::moe_grad_gate_up_cuda);
  m.impl("moe_grad_x", &flash_moe::moe_grad_x_cuda);
  m.impl("moe_lora_forward", &flash_moe::moe_lora_forward_cuda);
  m.impl("moe_lora_gate_up", &flash_moe::moe_lora_gate_up_cuda);
  m.impl("moe_lora_grad_x", &flash_moe::moe_lora_grad_x_cuda);
  m.impl("moe_lora_grad_gate_up", &flash_moe::moe_lora_grad_gate_up_cuda);
}
