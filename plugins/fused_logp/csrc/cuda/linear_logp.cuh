// linear_logp: shared device code of the fused lm_head + log-softmax kernels (sm_90a: TMA + wgmma, warp-specialised).
//
// One CTA owns one token tile (BLOCK_N rows of hidden) and a contiguous range of vocab tiles (BLOCK_V rows of the
// weight). For each vocab tile it computes the logits tile hidden_tile @ weight_tile^T with wgmma (fp32 accumulate)
// over H in BLOCK_K steps, fed by a STAGES-deep TMA ring (warpgroup 0 produces, warpgroups 1 and 2 consume 64 rows
// each), then runs the epilogue on the accumulator registers:
//   forward:  per-row online (max, sum exp, sum exp * (z - max)) in log2 units and the label logit, flushed once per
//             CTA as per-split partials that linear_logp_combine merges;
//   backward: dZ = [g_logp (onehot - p) - g_ent p (z - sum_pz)] g'(x) / T written as a bf16/fp16 tile of a bounded
//             chunk buffer that the host then multiplies with cuBLAS (grad_hidden += dZ W_chunk, grad_W_chunk = dZ^T h).
// Logit transforms: a logit_scale alone is folded into the temperature (T / logit_scale: no work per element); a
// softcap (kSoftcap) makes z = tanh(x * logit_scale / softcap) * softcap / T, the tanh applied to the accumulator in
// the epilogue, and its derivative multiplied into dZ there.
#pragma once

#include <prime_kernels/stable.h>
#include <torch/csrc/stable/macros.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include <prime_kernels/sm90.cuh>
#include <prime_kernels/tma.h>

#include "softcap.cuh"

#ifndef LINEAR_LOGP_BLOCK_N
#error "LINEAR_LOGP_BLOCK_N must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_BLOCK_V
#error "LINEAR_LOGP_BLOCK_V must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_BLOCK_K
#error "LINEAR_LOGP_BLOCK_K must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_STAGES
#error "LINEAR_LOGP_STAGES must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_INVARIANT_TILES_PER_SPLIT
#error "LINEAR_LOGP_INVARIANT_TILES_PER_SPLIT must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_GROUP_TOKEN_TILES
#error "LINEAR_LOGP_GROUP_TOKEN_TILES must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_MAX_SPLITS
#error "LINEAR_LOGP_MAX_SPLITS must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_HIDDEN_ALIGN
#error "LINEAR_LOGP_HIDDEN_ALIGN must come from kernel.toml ([linear_logp.constants])"
#endif

namespace linear_logp {

constexpr int BN = LINEAR_LOGP_BLOCK_N;
constexpr int BV = LINEAR_LOGP_BLOCK_V;
constexpr int BK = LINEAR_LOGP_BLOCK_K;
constexpr int STAGES = LINEAR_LOGP_STAGES;
// The code below is written for these tile numbers: two consumer warpgroups of wgmma.m64n256k16, K tiles of
// 64 16-bit elements = one 128-byte swizzle row.
static_assert(BN == 128, "BLOCK_N must be 128 (two consumer warpgroups of 64 rows)");
static_assert(BV == 256, "BLOCK_V must be 256 (wgmma m64n256k16)");
static_assert(BK == 64, "BLOCK_K must be 64 (one 128-byte swizzle row of 16-bit elements)");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES must be in [2, 4] (shared memory)");

constexpr int NUM_THREADS = 384;
constexpr int A_BYTES = BN * BK * 2;
constexpr int B_BYTES = BV * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024 /* alignment slack */ + 2 * STAGES * 8 /* mbarriers */;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr double kLog2eD = 1.4426950408889634074;
constexpr double kLn2D = 0.69314718055994530942;

struct Params {
  // shapes
  int n_rows;         // rows of hidden handled by this launch: [row0, row0 + n_rows)
  int row0;
  int vocab;          // V
  int k_tiles;        // ceil(H / BK)
  int vt_begin;       // vocab tiles handled by this launch: [vt_begin, vt_end)
  int vt_end;
  int tiles_per_split;
  int splits;         // S
  int token_tiles;    // ceil(n_rows / BN)
  int group;          // token tiles per rasterisation group
  // per-token inputs (indexed by absolute row)
  const int64_t* labels;
  const float* token_temperature;  // nullable
  const float* bias;               // nullable, fp32 [V]
  float temperature;  // the effective temperature: T / softcap, or T / logit_scale without a softcap
  int64_t ignore_index;
  // forward outputs: partials [S, n_rows] (log2 units) and the label logit (log2 units) [n_rows]
  float* part_m;
  float* part_s;
  float* part_u;
  float* zy;
  // backward inputs/outputs
  const double* stats;      // [N, 2] (lse, sum_pz), natural units
  const float* grad_logp;   // [N] fp32
  const float* grad_ent;    // [N] fp32, nullable
  void* dz;                 // [n_rows, ldz] of the input dtype; column c holds vocab vt_begin * BV + c
  int64_t ldz;
  float softcap_k;  // kSoftcap: logit_scale / softcap
};

// ---------------------------------------------------------------------------------------------------------------
// PTX wrappers (the shared ones come from prime_kernels/sm90.cuh)
using namespace prime_kernels::sm90;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* d, uint64_t a, uint64_t b, int scale_d) {
    wgmma_m64n256k16_bf16(d, a, b, scale_d);
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void store1(void* p, float x) { *static_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(x); }
};
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float* d, uint64_t a, uint64_t b, int scale_d) {
    wgmma_m64n256k16_f16(d, a, b, scale_d);
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void store1(void* p, float x) { *static_cast<__half*>(p) = __float2half_rn(x); }
};

// Merge the online state (m, s, u) = (max, sum 2^(z-m), sum 2^(z-m) (z-m)) (log2 units) with another one.
// An empty state is (-inf, 0, 0); s > 0 implies m finite.
__device__ __forceinline__ void merge_state(float& m, float& s, float& u, float m2, float s2, float u2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;
  const float d1 = s > 0.f ? m - M : 0.f;
  const float d2 = s2 > 0.f ? m2 - M : 0.f;
  const float a1 = ex2(d1), a2 = ex2(d2);
  u = a1 * (u + d1 * s) + a2 * (u2 + d2 * s2);
  s = a1 * s + a2 * s2;
  m = M;
}

// Accumulator register i of a thread holds row (warp * 16 + lane / 4 + 8 * ((i / 2) % 2)) and column
// (8 * (i / 4) + 2 * (lane % 4) + i % 2) of its warpgroup's 64 x 256 tile.
template <typename T, bool BWD, bool kSoftcap>
__global__ void __launch_bounds__(NUM_THREADS, 1)
    linear_logp_kernel(const __grid_constant__ CUtensorMap tm_h, const __grid_constant__ CUtensorMap tm_w,
                       const Params p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + STAGES * STAGE_BYTES;
  auto full_bar = [&](int s) { return bars + 8u * s; };
  auto empty_bar = [&](int s) { return bars + 8u * (STAGES + s); };

  // Grouped rasterisation: consecutive CTAs take `group` token tiles x all splits, so the CTAs resident together
  // share a few hidden tiles (re-read from L2 for every vocab tile) and stream the same weight tiles.
  const int ctas = p.token_tiles * p.splits;
  const int b = blockIdx.x;
  if (b >= ctas) return;  // rounds the grid up to whole clusters
  const int group_size = p.group * p.splits;
  auto tile_of = [&](int cta, int& tok, int& spl) {
    const int first = (cta / group_size) * p.group;
    const int r = cta % group_size;
    const int gcur = min(p.group, p.token_tiles - first);
    tok = first + r % gcur;
    spl = r / gcur;
  };
  int tok_tile, split;
  tile_of(b, tok_tile, split);
  // Clusters of 2 CTAs: two token tiles of one split stream the same weight tiles in the same order, so each loads
  // one half of every weight tile for both (TMA multicast), halving the weight traffic from L2. Both reach the same
  // decision (a split boundary inside the pair, or the odd last CTA: each loads its own).
  const uint32_t rank = cluster_ctarank();
  bool paired = false;
  if ((b ^ 1) < ctas) {
    int peer_tok, peer_split;
    tile_of(b ^ 1, peer_tok, peer_split);
    paired = peer_split == split;
  }
  const int vt0 = p.vt_begin + split * p.tiles_per_split;
  const int vt1 = min(vt0 + p.tiles_per_split, p.vt_end);
  const int row_tile = p.row0 + tok_tile * BN;

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(s), 1);
      // lane 0 of each of the 8 consumer warps; paired, the peer's 8 too (its copies write into this stage as well)
      mbar_init(empty_bar(s), paired ? 16 : 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_h)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_w)) : "memory");
  }
  __syncthreads();
  if (paired) cluster_sync();  // both rings initialised before either CTA's copies or arrivals reach the other
  // Pipeline steps (vocab tile, k tile) in order; the producer waits for the release of step i - STAGES only, so a
  // release of the last STAGES steps is not sent to the peer (which may have exited by then).
  const int steps = (vt1 - vt0) * p.k_tiles;
  auto release = [&](int s, int step) {
    mbar_arrive(empty_bar(s));
    if (paired && step < steps - STAGES) mbar_arrive_cluster(mapa_shared(empty_bar(s), rank ^ 1u));
  };

  if (warpgroup == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int vt = vt0; vt < vt1; ++vt) {
        for (int k = 0; k < p.k_tiles; ++k) {
          mbar_wait(empty_bar(stage), phase ^ 1u);
          mbar_expect_tx(full_bar(stage), STAGE_BYTES);  // paired: half the weight tile comes from the peer's copy
          const uint32_t a = base + stage * STAGE_BYTES;
          tma_load_2d(a, &tm_h, full_bar(stage), k * BK, row_tile);
          if (paired) {
            tma_load_2d_multicast(a + A_BYTES + rank * (B_BYTES / 2), &tm_w, full_bar(stage), k * BK,
                                  vt * BV + rank * (BV / 2), kPairMask);
          } else {
            tma_load_2d(a + A_BYTES, &tm_w, full_bar(stage), k * BK, vt * BV);
            tma_load_2d(a + A_BYTES + B_BYTES / 2, &tm_w, full_bar(stage), k * BK, vt * BV + BV / 2);
          }
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");

  const int ctid = threadIdx.x - 128 * warpgroup;
  const int warp = ctid / 32, lane = ctid % 32, quad = lane & 3;
  const int row_end = p.row0 + p.n_rows;

  int row[2];
  bool row_ok[2];
  float c[2];      // log2(e) / T (T the effective temperature): z (log2 units) = (acc + bias) * c, or tanh(...) * c
  int64_t y[2];
  float lse2[2], spz2[2], k1[2], k2[2];  // backward only
  float m[2], s[2], u[2];                 // forward only
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = row_tile + (warpgroup - 1) * 64 + warp * 16 + (lane >> 2) + 8 * h;
    row_ok[h] = row[h] < row_end;
    const int rr = row_ok[h] ? row[h] : p.row0;
    const float temp = p.temperature * (p.token_temperature ? p.token_temperature[rr] : 1.f);
    c[h] = LOG2E / temp;
    y[h] = p.labels[rr];
    m[h] = -INFINITY;
    s[h] = 0.f;
    u[h] = 0.f;
    if constexpr (BWD) {
      if (!row_ok[h] || y[h] == p.ignore_index) {
        lse2[h] = INFINITY;  // p = 0 and dZ = 0 on the whole row
        spz2[h] = 0.f;
        k1[h] = 0.f;
        k2[h] = 0.f;
      } else {
        // from the float64 stats: back to exactly the forward's float m + log2(s) where that is exact (e.g. V = 1)
        lse2[h] = static_cast<float>(p.stats[2 * rr] * kLog2eD);
        k1[h] = p.grad_logp[rr] / temp;
        spz2[h] = p.grad_ent ? static_cast<float>(p.stats[2 * rr + 1] * kLog2eD) : 0.f;
        k2[h] = p.grad_ent ? p.grad_ent[rr] * (LN2 / temp) : 0.f;
        if constexpr (kSoftcap) {  // dz/dx = k / cosh^2(x k) * softcap / T: k here, 1 / cosh^2 per element
          k1[h] *= p.softcap_k;
          k2[h] *= p.softcap_k;
        }
      }
    }
  }

  float acc[128];
  int stage = 0;
  uint32_t phase = 0;
  const uint32_t a_off = (warpgroup - 1) * 64 * BK * 2;
  for (int vt = vt0; vt < vt1; ++vt) {
    int prev = 0;
    const int step0 = (vt - vt0) * p.k_tiles;
    for (int k = 0; k < p.k_tiles; ++k) {
      mbar_wait(full_bar(stage), phase);
      const uint32_t st = base + stage * STAGE_BYTES;
      const uint64_t da = smem_desc(st + a_off), db = smem_desc(st + A_BYTES);
      fence_regs<128>(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) Mma<T>::run(acc, da + 2 * kk, db + 2 * kk, (k > 0 || kk > 0) ? 1 : 0);
      wgmma_commit();
      fence_regs<128>(acc);
      wgmma_wait<1>();
      fence_regs<128>(acc);
      if (k > 0 && lane == 0) release(prev, step0 + k - 1);
      prev = stage;
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1u;
      }
    }
    wgmma_wait<0>();
    fence_regs<128>(acc);
    if (lane == 0) release(prev, step0 + p.k_tiles - 1);

    // ---------------- epilogue on the 64 x 256 fp32 tile of this warpgroup ----------------
    const int v0 = vt * BV;
    const bool partial = v0 + BV > p.vocab;
    const int lim = p.vocab - v0;  // columns >= lim are outside the vocabulary
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < BV / 8; ++j) {
      const int col = 8 * j + 2 * quad;
      float b0 = 0.f, b1 = 0.f;
      if (p.bias) {
        if (!partial) {
          const float2 bb = *reinterpret_cast<const float2*>(p.bias + v0 + col);
          b0 = bb.x;
          b1 = bb.y;
        } else {
          b0 = col < lim ? p.bias[v0 + col] : 0.f;
          b1 = col + 1 < lim ? p.bias[v0 + col + 1] : 0.f;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // the softcap's backward keeps the logit x (its tanh and slope are formed per element below)
        auto logit2 = [&](float x) {
          if constexpr (!kSoftcap) return x * c[h];
          else if constexpr (BWD) return x;
          else return __fmul_rn(fused_logp_softcap::fast_tanh_of(x, p.softcap_k), c[h]);
        };
        float z0 = logit2(acc[4 * j + 2 * h] + b0);
        float z1 = logit2(acc[4 * j + 2 * h + 1] + b1);
        if (partial) {
          z0 = col < lim ? z0 : -INFINITY;
          z1 = col + 1 < lim ? z1 : -INFINITY;
        }
        acc[4 * j + 2 * h] = z0;
        acc[4 * j + 2 * h + 1] = z1;
        tmax[h] = fmaxf(tmax[h], fmaxf(z0, z1));
      }
    }

    if constexpr (!BWD) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // the label logit: exactly one thread of the whole grid holds it
        const int64_t ly = y[h] - v0;
        if (row_ok[h] && ly >= 0 && ly < BV && ((ly >> 1) & 3) == quad) {
          const int jj = static_cast<int>(ly >> 3), e = static_cast<int>(ly & 1);
          float val = 0.f;
#pragma unroll
          for (int j = 0; j < BV / 8; ++j)
            if (j == jj) val = e ? acc[4 * j + 2 * h + 1] : acc[4 * j + 2 * h];
          p.zy[row[h] - p.row0] = val;
        }
        const float m_new = fmaxf(m[h], tmax[h]);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float d = s[h] > 0.f ? m[h] - m_use : 0.f;
        const float alpha = ex2(d);
        u[h] = alpha * (u[h] + d * s[h]);
        s[h] *= alpha;
        m[h] = m_new;
        float s0 = 0.f, s1 = 0.f, u0 = 0.f, u1 = 0.f;
#pragma unroll
        for (int j = 0; j < BV / 8; ++j) {
          const float x0 = acc[4 * j + 2 * h] - m_use, x1 = acc[4 * j + 2 * h + 1] - m_use;
          const float e0 = ex2(x0), e1 = ex2(x1);
          s0 += e0;
          s1 += e1;
          // -inf logits (masked columns, -inf bias) have e = 0 and must add 0, not 0 * -inf
          u0 = fmaf(e0, fmaxf(x0, -1e30f), u0);
          u1 = fmaf(e1, fmaxf(x1, -1e30f), u1);
        }
        s[h] += s0 + s1;
        u[h] += u0 + u1;
      }
    } else {
      const int col_base = v0 - p.vt_begin * BV;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!row_ok[h]) continue;
        const int64_t ly64 = y[h] - v0;
        const int ly = (ly64 >= 0 && ly64 < BV) ? static_cast<int>(ly64) : -1;
        char* out = static_cast<char*>(p.dz) + 2 * ((row[h] - p.row0) * p.ldz + col_base);
#pragma unroll
        for (int j = 0; j < BV / 8; ++j) {
          const int col = 8 * j + 2 * quad;
          float g[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float z = acc[4 * j + 2 * h + e], slope = 1.f;
            if constexpr (kSoftcap) {  // z held the logit x: its tanh and slope now (x dead after this)
              z = __fmul_rn(fused_logp_softcap::fast_tanh_of(z, p.softcap_k, &slope), c[h]);
            }
            const float pr = ex2(z - lse2[h]);
            const float t = fmaxf(z - spz2[h], -1e30f);
            g[e] = -pr * fmaf(k2[h], t, k1[h]);
            if (col + e == ly) g[e] += k1[h];
            if constexpr (kSoftcap) g[e] *= slope;
          }
          if (!partial) {
            *reinterpret_cast<uint32_t*>(out + 2 * col) = Mma<T>::pack(g[0], g[1]);
          } else {
            if (col < lim) Mma<T>::store1(out + 2 * col, g[0]);
            if (col + 1 < lim) Mma<T>::store1(out + 2 * col + 2, g[1]);
          }
        }
      }
    }
  }

  if constexpr (!BWD) {
    // merge the 4 lanes holding a row, then one lane writes this split's partial for the row
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m[h], off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s[h], off);
        const float u2 = __shfl_xor_sync(0xffffffffu, u[h], off);
        merge_state(m[h], s[h], u[h], m2, s2, u2);
      }
      if (quad == 0 && row_ok[h]) {
        const int64_t idx = static_cast<int64_t>(split) * p.n_rows + (row[h] - p.row0);
        p.part_m[idx] = m[h];
        p.part_s[idx] = s[h];
        p.part_u[idx] = u[h];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host helpers (header-only: both translation units include them).
// The 2-D map of hidden / weight: boxes of box_rows x BK, 128-byte swizzle, zero-filled past the edges (the partial
// token/vocab/K tiles rely on it). Returns a CUresult (0 on success).
inline int make_tmap(CUtensorMap* map, const void* ptr, bool bf16, int64_t rows, int64_t cols, int64_t row_stride,
                     int box_rows) {
  // A map of at most one row never steps by its row stride, so the shape contract leaves that stride unchecked; the
  // encoder still wants a multiple of 16 bytes, which the padded row length is.
  constexpr int64_t kAlign = LINEAR_LOGP_HIDDEN_ALIGN;
  const int64_t stride = rows <= 1 ? (cols + kAlign - 1) / kAlign * kAlign : row_stride;
  return prime_kernels::make_tmap_2d(map, ptr, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                     rows, cols, stride, box_rows, BK);
}

// One launch of the kernel (forward, or the backward's dZ pass): token_tiles x splits CTAs.
template <typename T, bool kBackward, bool kSoftcap>
void launch(const CUtensorMap& tm_h, const CUtensorMap& tm_w, const Params& p, cudaStream_t stream) {
  auto kernel = linear_logp_kernel<T, kBackward, kSoftcap>;
  const bool configured =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES) == cudaSuccess;
  PK_CHECK(configured, "linear_logp: cannot reserve ", SMEM_BYTES, " bytes of shared memory for the ",
           kBackward ? "backward" : "forward", " kernel");
  // CTA pairs (the kernel pairs CTA b with b ^ 1); the grid rounded up to whole pairs
  const int64_t grid = (static_cast<int64_t>(p.token_tiles) * p.splits + kPairCtas - 1) / kPairCtas * kPairCtas;
  STD_CUDA_CHECK(launch_in_clusters(kernel, static_cast<unsigned>(grid), NUM_THREADS, SMEM_BYTES, stream, kPairCtas,
                                    tm_h, tm_w, p));
}

// The forward or backward launch for the input dtype, with or without the softcap epilogue.
template <bool kBackward>
void launch_for(bool bf16, bool softcap, const CUtensorMap& tm_h, const CUtensorMap& tm_w, const Params& p,
                cudaStream_t stream) {
  if (bf16)
    softcap ? launch<__nv_bfloat16, kBackward, true>(tm_h, tm_w, p, stream)
            : launch<__nv_bfloat16, kBackward, false>(tm_h, tm_w, p, stream);
  else
    softcap ? launch<__half, kBackward, true>(tm_h, tm_w, p, stream)
            : launch<__half, kBackward, false>(tm_h, tm_w, p, stream);
}

// Host side of the transforms: the effective temperature T / w and the softcap's k = logit_scale / softcap as a
// float pair (the kernels' arguments were checked by check_logit_transform / check_effective_temperature).
inline void set_transform(Params& p, double temperature, const std::optional<double>& softcap, double logit_scale) {
  p.temperature = static_cast<float>(temperature / (softcap.has_value() ? *softcap : logit_scale));
  p.softcap_k = static_cast<float>(softcap.has_value() ? logit_scale / *softcap : 0.0);
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Vocab tiles per CTA of the batch-invariant forward: from the vocabulary alone (the partials and their merge order
// follow the split), INVARIANT_TILES_PER_SPLIT tiles per split, more where that would exceed max_splits.
inline int invariant_tiles_per_split(int vocab_tiles, int max_splits) {
  return std::max(LINEAR_LOGP_INVARIANT_TILES_PER_SPLIT, ceil_div(vocab_tiles, max_splits));
}

// Vocab tiles per CTA for `token_tiles` x `vocab_tiles` work on `sms` SMs: the split count (<= max_splits) that
// minimises waves x tiles per CTA (ties: fewer splits, i.e. fewer partials).
inline int choose_tiles_per_split(int token_tiles, int vocab_tiles, int sms, int max_splits) {
  int best_tpc = vocab_tiles;
  int64_t best_cost = INT64_MAX;
  for (int s = 1; s <= vocab_tiles && s <= max_splits; ++s) {
    const int tpc = ceil_div(vocab_tiles, s);
    const int se = ceil_div(vocab_tiles, tpc);
    const int64_t waves = ceil_div(static_cast<int64_t>(token_tiles) * se, sms);
    const int64_t cost = waves * tpc;
    if (cost < best_cost) {
      best_cost = cost;
      best_tpc = tpc;
    }
  }
  return best_tpc;
}

}  // namespace linear_logp
