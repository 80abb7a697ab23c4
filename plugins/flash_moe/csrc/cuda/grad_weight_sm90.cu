// flash_moe on CUDA sm_90a: the backward's weight gradients (moe_grad_weight; docs/notes/flash_moe.md).
//
// out[e] = sum over expert e's slots r of rows[r]^T source[token of r] (or its transpose, source_major): dW1 / dW3
// from dg / du and x, dW2 from p h and grad_out. The K of these GEMMs is the expert's slots (varlen: the rows
// [expert_ends[e - 1], expert_ends[e]) of the compact, expert-sorted per-slot tensors the dH kernel writes), so both
// operands are slot rows with their features contiguous: wgmma reads both MN-major (imm-trans-a = imm-trans-b = 1).
// Persistent CTAs of 384 threads (one per SM) claim tiles of 128 source columns (M) x 256 row columns (N) of one
// expert:
//   warpgroup 0  producer: A, the source rows, gathered by cp.async (16-byte chunks, the tile's 128 columns of one
//                source row per 16 lanes, zero-filled past the expert's slots or for an invalid token; a warp loads
//                its 16 rows' tokens one K step ahead with one instruction and shuffles them out), so no gathered
//                copy of x or grad_out exists; B, the slot rows, by TMA (boxes of BLOCK_K rows x 64 columns) except
//                in an expert's last, partial K step, where they are copied by cp.async with the rows past the expert
//                zero-filled (a TMA box would read the next expert's rows, and 0 x inf there would be NaN).
//   warpgroups 1-2  consumers, 64 M each: wgmma.m64n256k16 bf16 -> fp32, stored once per tile (bf16 or fp32), as C
//                or transposed (dW1 / dW3: lanes 4 apart swap a value so each stores 4 bytes of an output row). An
//                expert without slots gets zeros.
// Deterministic: each output element is one fp32 sum in slot order.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include "../flash_moe.h"
#include "sm90_common.cuh"

#ifndef FLASH_MOE_BLOCK_K
#error "FLASH_MOE_BLOCK_K must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_GRAD_WEIGHT_STAGES
#error "FLASH_MOE_GRAD_WEIGHT_STAGES must come from kernel.toml ([flash_moe.constants])"
#endif

namespace flash_moe {
namespace sm90 {
namespace grad_weight {

constexpr int BM = FLASH_MOE_BLOCK_M;  // M rows per tile: two consumer warpgroups of wgmma m64
constexpr int BN = WGMMA_N;
constexpr int BK = FLASH_MOE_BLOCK_K;  // slots per pipeline stage
constexpr int STAGES = FLASH_MOE_GRAD_WEIGHT_STAGES;
static_assert(BM == 128 && BK == 64, "BLOCK_M must be 128 and BLOCK_K 64 (64-row MN-major swizzle atoms)");
constexpr int ATOM_BYTES = BK * 128;       // one atom: BK slot rows of 128 bytes
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int CONSUMER_WARPS = 8;
constexpr int NUM_THREADS = 384;
// bf16 output: the tile is staged here (128B-swizzled boxes of 64 columns) and stored by TMA while the next tile's
// mainloop runs
constexpr int STAGING_BYTES = BM * BN * 2;
constexpr int SMEM_BYTES = 1024 /* alignment slack */ + STAGES * STAGE_BYTES + STAGING_BYTES +
                           (2 * STAGES + 4) * 8 /* mbarriers */ + 2 * 4 /* tile numbers */;
static_assert(SMEM_BYTES <= 227 * 1024, "GRAD_WEIGHT_STAGES: the ring and the staging tile exceed shared memory");

struct Params {
  CUtensorMap tm_rows;  // the per-slot operand [S, row_cols]: boxes of BK rows x MN_ATOM columns
  // bf16 output by TMA: a 3-D map over out (per expert, so a partial tile is clipped at its expert's edge), boxes of
  // 128 rows (m) x MN_ATOM columns (n), or, transposed, of 256 rows (n) x MN_ATOM columns (m)
  CUtensorMap tm_out;
  const __nv_bfloat16* rows;
  int ld_rows;  // row strides in 32 bits (checked on the host): one wide multiply per copied row
  int row_cols;
  const __nv_bfloat16* source;  // the per-token operand [tokens, source_cols]
  int ld_source;
  int source_cols;
  int tokens;
  const int* row_token;    // [S]: the source row of each slot row
  const int* expert_ends;  // [E]: expert e owns rows [ends[e - 1], ends[e])
  int num_rows;            // S
  void* out;               // [E, m_total, n_total] (or its transpose), bf16 or fp32
  int m_total, n_total, m_tiles;  // m: the source's columns, n: the rows' columns
  // launch_rastered's: the raster runs over blocks = E x m_tiles (expert-major) x n_tiles
  int n_tiles, blocks, ctas;
  int* tile_counter;
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Slot rows [0, BK) of one operand's stage tile, W columns from col0 (W / MN_ATOM atoms of BK rows x 128 bytes,
// 128B swizzle: what a TMA box of MN_ATOM columns writes), by the 128 producer threads: W / 8 consecutive lanes copy
// one row's W columns (whole 32-byte sectors per instruction), pass i of thread tid covers tile row
// tid / (W / 8) + i * 1024 / W.
// Pass i's row is row row_of(i) of `src` (row stride ld), -1 for zeros; columns past n_cols are zeros.
template <int W>
struct RowsMN {
  static constexpr int kChunks = W / 8;  // 16-byte chunks per row
  static constexpr int kRowsPerPass = 128 / kChunks;
  static constexpr int kPasses = BK / kRowsPerPass;
  static constexpr int kRowsPerWarp = 32 / kChunks;  // per pass
  // The 16 tile rows a producer warp copies: lane l < 16 names the row of pass l / kRowsPerWarp of the threads
  // l % kRowsPerWarp rows into the warp's part (so a warp loads its rows' tokens with one instruction).
  static __device__ __forceinline__ int warp_row(int warp, int l) {
    return warp * kRowsPerWarp + l % kRowsPerWarp + kRowsPerPass * (l / kRowsPerWarp);
  }
  // ... and the lane that holds pass i's row of thread tid
  static __device__ __forceinline__ int lane_of(int tid, int i) { return i * kRowsPerWarp + (tid % 32) / kChunks; }
  template <class RowOf>
  static __device__ __forceinline__ void copy(uint32_t tile, int tid, const __nv_bfloat16* src, int ld, int col0,
                                              int n_cols, RowOf row_of) {
    const int j = tid % kChunks, r0 = tid / kChunks;
    const int col = col0 + 8 * j;
    const uint32_t dst = tile + (j / 8) * ATOM_BYTES;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      // the address of row 0 where there is no row (zero-filled: nothing is read): selects, not a branch around
      // the address arithmetic, so the compiler can overlap the passes' shuffles and multiplies
      const int row = row_of(i);
      const bool ok = row >= 0 && col < n_cols;
      const uint64_t at = static_cast<uint64_t>(static_cast<uint32_t>(ok ? row : 0)) * static_cast<uint32_t>(ld) +
                          static_cast<uint32_t>(ok ? col : 0);  // row, ld, col >= 0: one 32 x 32 -> 64 multiply-add
      cp_async_16(dst + swz(r0 + kRowsPerPass * i, j % 8), src + at, ok ? 16u : 0u);
    }
  }
};
static_assert(RowsMN<BM>::kPasses * RowsMN<BM>::kRowsPerWarp == 16 &&
                  RowsMN<BN>::kPasses * RowsMN<BN>::kRowsPerWarp == 16,
              "a producer warp copies 16 rows of each operand per K step");
#endif

// A = the gathered source (M = its columns, 128 per tile), B = the slot rows (N = their columns, 256 per tile):
// C = source^T rows, stored as out[e] = C, or as out[e] = C^T = rows^T source with kTransposeOut. (The other
// orientation, A = the slot rows and B = the source gathered 256 columns wide, doubled the cp.async bytes per stage
// and ran 15-35 % slower on the H200: docs/notes/flash_moe.md.)
template <bool kTransposeOut, bool kFp32Out>
__global__ void __launch_bounds__(NUM_THREADS, 1) grad_weight_kernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint32_t tiles = static_cast<uint32_t>(p.blocks) * p.n_tiles;
  if (blockIdx.x >= tiles) return;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const gbase = smem_raw + (base - raw);
  const uint32_t staging = base + STAGES * STAGE_BYTES;
  const uint32_t bars = staging + STAGING_BYTES;
  auto full_bar = [&](int s) { return bars + 8u * s; };
  auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };
  auto tile_free_bar = [&](int b) { return bars + 8u * (2 * STAGES + b); };
  auto tile_ready_bar = [&](int b) { return bars + 8u * (2 * STAGES + 2 + b); };
  int* const tile_of = reinterpret_cast<int*>(gbase + STAGES * STAGE_BYTES + STAGING_BYTES + (2 * STAGES + 4) * 8);
  if (threadIdx.x == 0) {
    init_ring<STAGES>(bars, CONSUMER_WARPS);
    for (int b = 0; b < 2; ++b) {
      mbar_init(tile_free_bar(b), CONSUMER_WARPS);  // each consumer warp has read the tile number
      mbar_init(tile_ready_bar(b), 1);              // producer thread 0 wrote it
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  // tile t: aligned "block" (expert, M tile) and N tile by the raster; the expert's slot rows and K steps
  auto decode = [&](int t, int& expert, int& m_tile, int& n_tile, int& first, int& count) {
    int block;
    raster(t, p.n_tiles, p.blocks, block, n_tile);
    expert = block / p.m_tiles;
    m_tile = block - expert * p.m_tiles;
    // clamped into [0, S], never decreasing: the CPU op raises on such ends, the kernel reads no row outside
    const int end = min(max(__ldg(p.expert_ends + expert), 0), p.num_rows);
    first = expert > 0 ? min(max(__ldg(p.expert_ends + expert - 1), 0), end) : 0;
    count = end - first;
  };

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {  // ------------------------------- producer -------------------------------
    producer_registers();
    const int tid = threadIdx.x;
    uint32_t ks = 0;  // k steps issued over all earlier tiles, modulo 2 STAGES (the ring runs on across tiles)
    for (int i = 0;; ++i) {
      const int buf = i & 1;
      if (i >= 2) mbar_wait(tile_free_bar(buf), ((i - 2) / 2) & 1);
      if (tid == 0) {  // the CTA's first tile is blockIdx.x, the next ones are claimed in raster order
        const uint32_t cand = i == 0 ? blockIdx.x : p.ctas + atomicAdd(p.tile_counter, 1);
        tile_of[buf] = cand < tiles ? static_cast<int>(cand) : -1;
        mbar_arrive(tile_ready_bar(buf));
      }
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warps only
      const int t = tile_of[buf];
      if (t < 0) break;
      int expert, m_tile, n_tile, first, count;
      decode(t, expert, m_tile, n_tile, first, count);
      const int k_steps = (count + BK - 1) / BK;
      const int m0 = m_tile * BM, n0 = n_tile * BN;
      using RowsTile = RowsMN<BN>;
      using SourceTile = RowsMN<BM>;
      const int rows_col0 = n0, source_col0 = m0;
      // The source row (token) of this lane's row of K step kt, -1 for none: loaded a K step ahead and checked
      // against the token count only in the K step that copies it, so that no K step waits for a load (checked where
      // it loads, the compare sat right after the stage's barrier wait and stalled every K step: Nsight Compute).
      auto token_of = [&](int kt) {
        const int r = SourceTile::warp_row(tid / 32, tid % 32), row = kt * BK + r;
        return tid % 32 < 16 && kt < k_steps && row < count ? __ldg(p.row_token + first + row) : -1;
      };
      int loaded = token_of(0);
      for (int kt = 0; kt < k_steps; ++kt) {
        const int token = loaded < p.tokens ? loaded : -1;  // negative: zeros
        const int next_token = token_of(kt + 1);
        const uint32_t k = ks + kt;
        const int stage = acquire_stage<STAGES>(bars, k);
        const uint32_t st = base + stage * STAGE_BYTES;
        const int row0 = first + kt * BK, valid = min(BK, count - kt * BK);
        const uint32_t rows_tile = st + A_BYTES, source_tile = st;
        if (valid == BK) {  // a whole K step: the slot rows by TMA
          if (tid == 0) {
            mbar_expect_tx(full_bar(stage), RowsTile::kChunks * 16 * BK);
#pragma unroll
            for (int q = 0; q < RowsTile::kChunks / 8; ++q)
              tma_load_2d(rows_tile + q * ATOM_BYTES, &p.tm_rows, full_bar(stage), rows_col0 + q * MN_ATOM, row0);
          }
        } else {  // the expert's last K step: rows past it zero-filled
          if (tid == 0) mbar_arrive(full_bar(stage));
          RowsTile::copy(rows_tile, tid, p.rows, p.ld_rows, rows_col0, p.row_cols, [&](int i) {
            const int r = tid / RowsTile::kChunks + RowsTile::kRowsPerPass * i;
            return r < valid ? row0 + r : -1;
          });
        }
        SourceTile::copy(source_tile, tid, p.source, p.ld_source, source_col0, p.source_cols, [&](int i) {
          return __shfl_sync(0xffffffffu, token, SourceTile::lane_of(tid, i));
        });
        cp_async_mbar_arrive_noinc(full_bar(stage));  // fires when this thread's copies of the stage have landed
        loaded = next_token;
      }
      ks = (ks + k_steps) % (2 * STAGES);
    }
    drain_cp_async();
    return;
  }
  consumer_registers();

  // ------------------------------- consumers -------------------------------
  const int wg = warpgroup - 1;
  const int ctid = threadIdx.x - 128 * warpgroup;
  const int warp = ctid / 32, lane = ctid % 32, quad = lane & 3;
  RingPosition<STAGES> ring;  // in step with the producer's ks
  for (int i = 0;; ++i) {
    const int buf = i & 1;
    mbar_wait(tile_ready_bar(buf), (i / 2) & 1);
    const int t = tile_of[buf];
    __syncwarp();
    if (lane == 0) mbar_arrive(tile_free_bar(buf));
    if (t < 0) break;
    int expert, m_tile, n_tile, first, count;
    decode(t, expert, m_tile, n_tile, first, count);
    const int k_steps = (count + BK - 1) / BK;
    float acc[128];
#pragma unroll
    for (int r = 0; r < 128; ++r) acc[r] = 0.f;  // an expert without slots: zeros
    int prev = 0;
    for (int kt = 0; kt < k_steps; ++kt) {
      mbar_wait(full_bar(ring.stage), ring.phase);
      fence_proxy_async();  // parts of the stage were written by cp.async (generic proxy); wgmma reads the async proxy
      const uint32_t st = base + ring.stage * STAGE_BYTES;
      // both operands MN-major: this warpgroup's 64 M columns are one atom of A; a k16 step is 16 slot rows (2048 B)
      const uint64_t da = smem_desc_mn(st + wg * ATOM_BYTES, ATOM_BYTES);
      const uint64_t db = smem_desc_mn(st + A_BYTES, ATOM_BYTES);
      fence_regs<128>(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_m64n256k16_bf16_bn<1>(acc, da + kk * (16 * 128 >> 4), db + kk * (16 * 128 >> 4), 1);
      wgmma_commit();
      fence_regs<128>(acc);
      wgmma_wait<1>();
      fence_regs<128>(acc);
      if (kt > 0 && lane == 0) mbar_arrive(empty_bar(prev));
      prev = ring.stage;
      ring.advance();
    }
    wgmma_wait<0>();
    fence_regs<128>(acc);
    if (k_steps > 0 && lane == 0) mbar_arrive(empty_bar(prev));
    // ------------------------------- epilogue: C's rows m, columns n -------------------------------
    const int m_local = wg * 64 + warp * 16 + (lane >> 2);  // + 8 h
    if constexpr (kFp32Out) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m_tile * BM + m_local + 8 * h;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int n = n_tile * BN + 8 * j + 2 * quad;  // n_total is a multiple of 8: n + 1 is valid with n
          const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];  // C[m][n], C[m][n + 1]
          if constexpr (kTransposeOut) {
            // out[n][m]: lanes 4 apart hold rows m and m + 1 (m_total is a multiple of 8 too); they swap one value
            // so the even one stores C[m..m+1][n] and the odd one C[m-1..m][n+1]
            const bool odd = (lane >> 2) & 1;
            const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
            const int row_n = odd ? n + 1 : n, col_m = odd ? m - 1 : m;
            if (col_m >= p.m_total || n >= p.n_total) continue;
            const int64_t at = (static_cast<int64_t>(expert) * p.n_total + row_n) * p.m_total + col_m;
            *reinterpret_cast<float2*>(static_cast<float*>(p.out) + at) =
                odd ? make_float2(other, v1) : make_float2(v0, other);
          } else {
            if (m >= p.m_total || n >= p.n_total) continue;
            const int64_t at = (static_cast<int64_t>(expert) * p.m_total + m) * p.n_total + n;
            *reinterpret_cast<float2*>(static_cast<float*>(p.out) + at) = make_float2(v0, v1);
          }
        }
      }
    } else {
      // bf16: the tile into the staging boxes (4-byte stores, 8 rows x 16 bytes per warp instruction: conflict-free
      // through the swizzle), then one thread stores them by TMA; the previous tile's stores have read the staging
      // boxes before anyone rewrites them
      const bool storer = threadIdx.x == 128;
      if (storer) bulk_wait_read<0>();
      asm volatile("bar.sync 2, 256;\n" ::: "memory");  // the consumer warps only
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m_local + 8 * h;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];  // C[m][n], C[m][n + 1], n = 8 j + 2 quad
          uint32_t at;
          __nv_bfloat162 pair;
          if constexpr (kTransposeOut) {
            // C^T: boxes of 256 n rows x 64 m columns (m / 64 = wg); lanes 4 apart hold rows m and m + 1 and swap
            // one value, so the even one writes C[m..m+1][n] and the odd one C[m-1..m][n+1]
            const bool odd = (lane >> 2) & 1;
            const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
            const int row_n = 8 * j + 2 * quad + (odd ? 1 : 0), col_m = (m & 63) - (odd ? 1 : 0);
            at = wg * (BN * 128) + swz(row_n, col_m / 8) + (col_m % 8) * 2;
            pair = odd ? __floats2bfloat162_rn(other, v1) : __floats2bfloat162_rn(v0, other);
          } else {
            // C: boxes of 128 m rows x 64 n columns (n / 64 = j / 8)
            at = (j / 8) * (BM * 128) + swz(m, j % 8) + quad * 4;
            pair = __floats2bfloat162_rn(v0, v1);
          }
          *reinterpret_cast<__nv_bfloat162*>(gbase + (staging - base) + at) = pair;
        }
      }
      fence_proxy_async();  // the TMA store reads the boxes through the async proxy
      asm volatile("bar.sync 2, 256;\n" ::: "memory");
      if (storer) {
        if constexpr (kTransposeOut) {
          for (int q = 0; q < BM / MN_ATOM; ++q)
            if (m_tile * BM + q * MN_ATOM < p.m_total)
              tma_store_3d(&p.tm_out, staging + q * (BN * 128), m_tile * BM + q * MN_ATOM, n_tile * BN, expert);
        } else {
          for (int q = 0; q < BN / MN_ATOM; ++q)
            if (n_tile * BN + q * MN_ATOM < p.n_total)
              tma_store_3d(&p.tm_out, staging + q * (BM * 128), n_tile * BN + q * MN_ATOM, m_tile * BM, expert);
        }
        bulk_commit();
      }
    }
  }
  if (threadIdx.x == 128) bulk_wait<0>();  // the last tile's stores have landed before the CTA leaves
#else
  __trap();  // compiled for an arch other than sm_90a: the host side never launches it there
#endif
}

template <bool kTransposeOut, bool kFp32Out>
void launch(const Params& p, int n_tiles, int64_t blocks, cudaStream_t stream) {
  launch_rastered<grad_weight_kernel<kTransposeOut, kFp32Out>, NUM_THREADS, SMEM_BYTES, 1, true>(p, n_tiles, blocks,
                                                                                              stream);
}

}  // namespace grad_weight
}  // namespace sm90

namespace {

at::Tensor moe_grad_weight_cuda(const at::Tensor& rows_in, const at::Tensor& source_in, const at::Tensor& row_token,
                                const at::Tensor& expert_ends, bool source_major, bool fp32) {
  const char* op = "moe_grad_weight";
  const GradWeightShape s = check_grad_weight_args(rows_in, source_in, row_token, expert_ends);
  TORCH_CHECK(rows_in.is_cuda(), op, " (CUDA): rows must be a CUDA tensor, got ", rows_in.device());
  const c10::cuda::CUDAGuard guard(rows_in.device());
  sm90::check_sm90(op, rows_in);
  namespace gw = sm90::grad_weight;
  // rows read in place when TMA can (unit column stride, 16-byte row stride)
  const auto rows = rows_in.stride(1) == 1 && rows_in.stride(0) % 8 == 0 ? rows_in : rows_in.contiguous();
  const auto source = source_in.stride(1) == 1 && source_in.stride(0) % 8 == 0 ? source_in : source_in.contiguous();
  sm90::check_cuda_operand(op, "rows", rows);
  sm90::check_cuda_operand(op, "source", source);
  TORCH_CHECK(rows.stride(0) <= INT32_MAX && source.stride(0) <= INT32_MAX, op,
              " (CUDA): rows' and source's row strides must fit in 32 bits, got ", rows.stride(0), " and ",
              source.stride(0));
  const auto tokens = row_token.contiguous(), ends = expert_ends.contiguous();
  const int64_t m_total = s.K, n_total = s.N;
  auto out = at::empty(source_major ? at::IntArrayRef{s.E, s.K, s.N} : at::IntArrayRef{s.E, s.N, s.K},
                       rows.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
  if (s.S == 0 || m_total == 0 || n_total == 0) return out.zero_();  // no slot rows (the kernel needs a TMA map)
  gw::Params p{};
  const int rc = prime_kernels::make_tmap_2d(&p.tm_rows, rows.const_data_ptr(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, s.S,
                                             s.N, rows.stride(0), gw::BK, sm90::MN_ATOM);
  TORCH_CHECK(rc == 0, op, " (CUDA): cuTensorMapEncodeTiled failed for rows (CUresult ", rc, ")");
  p.rows = reinterpret_cast<const __nv_bfloat16*>(rows.const_data_ptr());
  p.ld_rows = static_cast<int>(rows.stride(0));
  p.row_cols = static_cast<int>(s.N);
  p.source = reinterpret_cast<const __nv_bfloat16*>(source.const_data_ptr());
  p.ld_source = static_cast<int>(source.stride(0));
  p.source_cols = static_cast<int>(s.K);
  p.tokens = static_cast<int>(s.T);
  p.row_token = tokens.const_data_ptr<int>();
  p.expert_ends = ends.const_data_ptr<int>();
  p.num_rows = static_cast<int>(s.S);
  p.out = out.mutable_data_ptr();
  if (!fp32) {  // C, or C^T for dW1 / dW3: (E, rows, cols) with boxes of a tile's rows x 64 columns
    const int64_t rows = source_major ? s.K : s.N, cols = source_major ? s.N : s.K;
    const int rc_out = prime_kernels::make_tmap_3d(&p.tm_out, p.out, s.E, rows, cols, cols, rows * cols,
                                                   source_major ? gw::BM : gw::BN, sm90::MN_ATOM);
    TORCH_CHECK(rc_out == 0, op, " (CUDA): cuTensorMapEncodeTiled failed for the output (CUresult ", rc_out, ")");
  }
  p.m_total = static_cast<int>(m_total);
  p.n_total = static_cast<int>(n_total);
  p.m_tiles = static_cast<int>((m_total + gw::BM - 1) / gw::BM);
  const auto tile_counter = at::zeros({1}, tokens.options());
  p.tile_counter = tile_counter.mutable_data_ptr<int>();
  const int n_tiles = static_cast<int>((n_total + gw::BN - 1) / gw::BN);
  const int64_t blocks = s.E * p.m_tiles;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (source_major) {
    fp32 ? gw::launch<false, true>(p, n_tiles, blocks, stream) : gw::launch<false, false>(p, n_tiles, blocks, stream);
  } else {
    fp32 ? gw::launch<true, true>(p, n_tiles, blocks, stream) : gw::launch<true, false>(p, n_tiles, blocks, stream);
  }
  return out;
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY_IMPL(flash_moe, CUDA, m) { m.impl("moe_grad_weight", &flash_moe::moe_grad_weight_cuda); }
