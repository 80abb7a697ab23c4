// fused_logp CUDA implementations (schemas and semantics: ../fused_logp.cpp).
//
// Forward: one pass over each row of logits, 16-byte vector loads (a scalar head and tail where the row is not 16-byte
// aligned), online max m, s = sum 2^a, t = sum 2^a * a with a = (x - m) * log2(e) / T per thread; per-element exp in
// fp32 (ex2.approx), per-vector partial sums in fp32, running sums in double; block combine in double; lse, sum p*z,
// entropy and logp = x_y / T - lse are formed in double. When there are too few rows to fill the GPU a row is split
// over several blocks (grid.y) that write partial (m, s, t) to a small workspace, and a second kernel combines them.
// Backward: one read of logits, one write of the gradient; p = 2^(x*c - lse*log2e) with the exponent formed exactly
// (two-float constants, FMA product splitting) and the remaining low part applied as a first-order correction.
//
// Labels: a label outside [0, V) that is not ignore_index never causes an out-of-bounds read; the forward writes NaN
// for that token and atomicMin's its row into a device word. With check_labels the host reads that word back (one
// 8-byte device->host copy, which synchronises the stream) and raises naming the first offending position;
// check_labels=false skips the copy so the op stays capturable in CUDA graphs and sync-free (the NaN remains).
// A token temperature that is not finite and > 0 (of a token that is not ignored) takes the same path: NaN, the row
// in the device word, and with check_labels an error naming token_temperature at that position.
//
// Logit transforms: z = v(x) * w / T, v(x) = tanh(x * logit_scale / softcap) and w = softcap, or v(x) = x and
// w = logit_scale. The host folds w into the temperature (T / w: a logit_scale alone costs nothing per element); a
// softcap instantiates the kernels with the Softcap transform, applied to each logit where it is loaded (forward) and
// with its derivative at each gradient element (backward). Softcap kernels exist for int64 labels only (int32 labels
// are widened on the host), run the forward's gather form and the backward's per-element form: a quarter of the
// instantiations, each correct in either mode.
//
// Host code on the LibTorch stable ABI, as ../fused_logp.cpp (kernel.toml: stable_abi); the device code is unchanged.
#include <prime_kernels/stable.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <optional>
#include <type_traits>

#include "../cpu_common.h"
#include "softcap.cuh"

#ifndef FUSED_LOGP_BLOCK_THREADS
#error "FUSED_LOGP_BLOCK_THREADS must come from kernel.toml ([fused_logp.constants])"
#endif
#ifndef FUSED_LOGP_VEC_UNROLL
#error "FUSED_LOGP_VEC_UNROLL must come from kernel.toml ([fused_logp.constants])"
#endif
#ifndef FUSED_LOGP_SPLIT_MIN_ELEMS
#error "FUSED_LOGP_SPLIT_MIN_ELEMS must come from kernel.toml ([fused_logp.constants])"
#endif
#ifndef FUSED_LOGP_SOFTCAP_MIN_BLOCKS
#error "FUSED_LOGP_SOFTCAP_MIN_BLOCKS must come from kernel.toml ([fused_logp.constants])"
#endif
#ifndef FUSED_LOGP_MAX_SPLITS
#error "FUSED_LOGP_MAX_SPLITS must come from kernel.toml ([fused_logp.constants])"
#endif

namespace fused_logp_detail {
using torch::headeronly::ScalarType;
using torch::stable::Tensor;
void check_forward_args(const Tensor& logits, const Tensor& labels, double temperature,
                        const std::optional<Tensor>& token_temperature);
void check_backward_args(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                         const Tensor& logits, const Tensor& labels, double temperature,
                         const std::optional<Tensor>& token_temperature, const Tensor& stats);
[[noreturn]] void fail_bad_label(int64_t position, int64_t value, int64_t V, int64_t ignore_index);
[[noreturn]] void fail_bad_token_temperature(int64_t position, float value);
}  // namespace fused_logp_detail

namespace {

constexpr int kThreads = FUSED_LOGP_BLOCK_THREADS;
constexpr int kUnroll = FUSED_LOGP_VEC_UNROLL;
constexpr int kWarps = kThreads / 32;
// Launch bounds' minimum blocks per SM: 0 states none, which leaves ptxas its own register choice (an explicit 1
// took the plain bf16 forward from 48 to 96 registers: sm_90, nvcc 13.0).
constexpr int kSoftcapMinBlocks = FUSED_LOGP_SOFTCAP_MIN_BLOCKS;
static_assert(kThreads % 32 == 0 && kThreads >= 64 && kThreads <= 1024, "BLOCK_THREADS: a multiple of 32 in [64, 1024]");
static_assert(kUnroll >= 1 && kUnroll <= 8, "VEC_UNROLL in [1, 8]");
static_assert(kSoftcapMinBlocks >= 0 && kSoftcapMinBlocks * kThreads <= 2048,
              "SOFTCAP_MIN_BLOCKS: 0 to 2048 / BLOCK_THREADS");
static_assert(FUSED_LOGP_MAX_SPLITS >= 1 && FUSED_LOGP_MAX_SPLITS <= 65535, "MAX_SPLITS in [1, 65535]");

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;
// Exponent clamp (log2 units): 2^-256 is 0 in fp32, and a clamped -inf/NaN difference gives e = 0 and e * a = 0.
constexpr float kMinExponent = -256.f;

__device__ __forceinline__ float ex2(float a) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ---- element types: 16-byte vector <-> floats -------------------------------------------------------------------
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  __device__ __forceinline__ static float vmax(const uint4& v) {
    return fmax_nan(fmax_nan(__uint_as_float(v.x), __uint_as_float(v.y)), fmax_nan(__uint_as_float(v.z), __uint_as_float(v.w)));
  }
  __device__ __forceinline__ static float load(const float* p) { return __ldg(p); }
  __device__ __forceinline__ static void store(float* p, float v) { *p = v; }
};
// bf16 and fp16: 8 per vector; Pair supplies unpack2 / pack2 / as2 for one 32-bit word of two elements.
template <class Pair>
struct Elem16 {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float (&f)[8]) {
    Pair::unpack2(v.x, f[0], f[1]);
    Pair::unpack2(v.y, f[2], f[3]);
    Pair::unpack2(v.z, f[4], f[5]);
    Pair::unpack2(v.w, f[6], f[7]);
  }
  __device__ __forceinline__ static uint4 pack(const float (&f)[8]) {
    return make_uint4(Pair::pack2(f[0], f[1]), Pair::pack2(f[2], f[3]), Pair::pack2(f[4], f[5]),
                      Pair::pack2(f[6], f[7]));
  }
  // NaN-propagating max of the 8 values, on packed pairs (exact: max needs no rounding).
  __device__ __forceinline__ static float vmax(const uint4& v) {
    const auto m = __hmax2_nan(__hmax2_nan(Pair::as2(v.x), Pair::as2(v.y)), __hmax2_nan(Pair::as2(v.z), Pair::as2(v.w)));
    float lo, hi;
    Pair::unpack2(*reinterpret_cast<const uint32_t*>(&m), lo, hi);
    return fmax_nan(lo, hi);
  }
};
struct Bf16Pair {
  __device__ __forceinline__ static void unpack2(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static __nv_bfloat162 as2(uint32_t w) { return *reinterpret_cast<__nv_bfloat162*>(&w); }
};
struct HalfPair {
  __device__ __forceinline__ static void unpack2(uint32_t w, float& lo, float& hi) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    const float2 f = __half22float2(h);
    lo = f.x;
    hi = f.y;
  }
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static __half2 as2(uint32_t w) { return *reinterpret_cast<__half2*>(&w); }
};
template <>
struct Elem<__nv_bfloat16> : Elem16<Bf16Pair> {
  __device__ __forceinline__ static float load(const __nv_bfloat16* p) {
    const unsigned short u = __ldg(reinterpret_cast<const unsigned short*>(p));
    return __uint_as_float(static_cast<uint32_t>(u) << 16);
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
};
template <>
struct Elem<__half> : Elem16<HalfPair> {
  __device__ __forceinline__ static float load(const __half* p) { return __half2float(__ldg(p)); }
  __device__ __forceinline__ static void store(__half* p, float v) { *p = __float2half_rn(v); }
};

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

// Where a row's 16-byte-aligned body starts: elements before it are the scalar head.
template <typename T>
__device__ __forceinline__ int head_elems(const T* row, int V) {
  const int h = static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / sizeof(T));
  return h < V ? h : V;
}

// Vector v of a row (elements v * kVec ... v * kVec + kVec - 1). An aligned row loads it in one 16-byte __ldg; a row
// that is not 16-byte aligned (odd V, strided rows) is gathered element by element into the same register layout,
// so that a batch-invariant forward adds every element in the same vector, chain and order wherever the row sits.
template <typename T, int kVec>
__device__ __forceinline__ uint4 load_vec(const T* x, const uint4* xv, int v, bool gather) {
  if (!gather) return __ldg(xv + v);
  using U = std::conditional_t<sizeof(T) == 4, unsigned int, unsigned short>;
  static_assert(sizeof(T) * kVec == 16, "a vector is 16 bytes");
  U u[kVec];
  const U* src = reinterpret_cast<const U*>(x) + static_cast<int64_t>(v) * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) u[k] = __ldg(src + k);
  uint4 r;
  memcpy(&r, u, 16);
  return r;
}

// 2^(hi + lo), |lo| << 1, to about 1 ulp: range reduction by rint, degree-7 Taylor polynomial of 2^f on |f| <= 1/2
// (truncation < 1e-8 relative). Used for fp32 logits, whose fp32 gradient shows ex2.approx's ~2-ulp error (e.g. at a
// dominant logit, where p rounds to 1; bf16/fp16 gradients round far above that, so they keep ex2.approx), and by
// accurate_tanh.
__device__ __forceinline__ float exp2_accurate(float hi, float lo) {
  const bool under = hi < -200.f;  // result 0 (false for NaN, which stays NaN)
  hi = fmax_nan(hi, -200.f);
  const float j = rintf(hi);
  const float f = under ? 0.f : __fadd_rn(__fsub_rn(hi, j), lo);  // hi - j is exact
  float q = 1.5252733804059841e-05f;         // ln2^7 / 7!
  q = fmaf(q, f, 1.5403530393381606e-04f);   // ln2^6 / 6!
  q = fmaf(q, f, 1.3333558146428443e-03f);   // ln2^5 / 5!
  q = fmaf(q, f, 9.6181291076284772e-03f);   // ln2^4 / 4!
  q = fmaf(q, f, 5.5504108664821580e-02f);   // ln2^3 / 3!
  q = fmaf(q, f, 2.4022650695910071e-01f);   // ln2^2 / 2!
  q = fmaf(q, f, 6.9314718055994531e-01f);   // ln2
  q = fmaf(q, f, 1.0f);
  const int ji = static_cast<int>(j);
  const float scale = ji < -126 ? 0.f : __int_as_float((ji + 127) << 23);  // p <= 1: ji <= 0 here (-200 when under)
  return q * scale;
}

// tanh(x k) for the logits op's softcap, k = k_hi + k_lo: 0.25 ulp mean error, 1.1 at most (emulated in float32 with
// exact FMAs against float64: 10^7 bf16-valued logits at k = 1/60 ... 1), where CUDA's tanhf is within 2 ulps and its
// error, times c = log2(e) softcap / T in every exponent, dominated the op's logp error (H200, session 14:
// docs/notes/fused_logp.md). u = x k as an unevaluated pair uh + ul. |u| < kTanhSeriesBound: tanh_series. Beyond:
// 1 - q, q = 2E / (1 + E), E = 2^(-2 log2(e) |u|) from exp2_accurate on the pair, the quotient corrected once.
// +-inf logits give +-1 (|u| >= 16 rounds to 1), NaN stays NaN.
constexpr float kTanhSeriesBound = 0.625f;
__device__ __forceinline__ void tanh_argument(float x, float k_hi, float k_lo, float ph, float& uh, float& ul) {
  const float sl = fmaf(x, k_lo, fmaf(x, k_hi, -ph));  // x k_hi = ph + its FMA residual, exactly
  uh = __fadd_rn(ph, sl);
  ul = __fadd_rn(__fsub_rn(ph, uh), sl);
}
// u + u^3 P(u^2), P a degree-4 minimax fit on |u| < kTanhSeriesBound (relative error 1.3e-7; the correction is at
// most 12 % of t), ul carried as ul (1 - u^2).
__device__ __forceinline__ float tanh_series(float uh, float ul) {
  const float s = __fmul_rn(uh, uh);
  float p = -0.00609693f;
  p = fmaf(p, s, 0.02099735f);
  p = fmaf(p, s, -0.05385095f);
  p = fmaf(p, s, 0.13332771f);
  p = fmaf(p, s, -0.33333328f);
  return __fadd_rn(uh, fmaf(__fmul_rn(uh, s), p, fmaf(-ul, s, ul)));
}
// tanh(|u|) past the series' range, sign restored: 1 - q as above. NaN for NaN or infinite uh.
__device__ __forceinline__ float tanh_exp_form(float uh, float ul) {
  constexpr double kTwoLog2e = 2.0 * kLog2e;
  constexpr float kC_hi = static_cast<float>(kTwoLog2e);
  constexpr float kC_lo = static_cast<float>(kTwoLog2e - static_cast<double>(kC_hi));
  const float a = fabsf(uh);
  const float al = uh < 0.f ? -ul : ul;  // |u| = a + al
  const float yh = __fmul_rn(-kC_hi, a);
  const float yl = __fadd_rn(fmaf(-kC_hi, a, -yh), fmaf(-kC_hi, al, __fmul_rn(-kC_lo, a)));
  const float e = exp2_accurate(yh, yl);
  const float d = __fadd_rn(1.f, e);
  const float dl = __fadd_rn(__fsub_rn(1.f, d), e);  // 1 + e = d + dl exactly (e <= 1)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  r = fmaf(r, fmaf(-d, r, 1.f), r);
  const float h = __fmul_rn(e, r);  // e / (1 + e) = q / 2, corrected by its residual below
  const float residual = fmaf(-h, dl, fmaf(-h, d, e));
  return copysignf(__fsub_rn(1.f, __fmul_rn(2.f, fmaf(r, residual, h))), uh);
}
// t where the argument's high part ph = x k_hi is finite and below 16; +-1 beyond, NaN for NaN.
__device__ __forceinline__ float tanh_saturated(float ph, float t) {
  return fabsf(ph) < 16.f ? t : (ph != ph ? ph : copysignf(1.f, ph));
}
__device__ __forceinline__ float accurate_tanh(float x, float k_hi, float k_lo) {
  const float ph = __fmul_rn(x, k_hi);
  float uh, ul;
  tanh_argument(x, k_hi, k_lo, ph, uh, ul);
  return tanh_saturated(ph, fabsf(uh) < kTanhSeriesBound ? tanh_series(uh, ul) : tanh_exp_form(uh, ul));
}

// ---- logit transforms (see the top): applied to each logit as it is loaded ----------------------------------------
struct NoTransform {
  __device__ __forceinline__ explicit NoTransform(double) {}
  __device__ __forceinline__ float operator()(float x) const { return x; }
  template <int N>
  __device__ __forceinline__ void apply(float (&)[N]) const {}
  // The gradient w.r.t. the loaded logit, from grad_at(v), the gradient w.r.t. the transformed one.
  template <class G>
  __device__ __forceinline__ float grad(float x, G&& grad_at) const { return grad_at(x); }
  template <int N, class G>
  __device__ __forceinline__ void grad_apply(float (&f)[N], G&& grad_at) const {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = grad_at(f[k]);
  }
};
// v = tanh(x k), k = logit_scale / softcap; monotone, so the max of v is v of the max. The backward's row constants
// carry the factor k of dv/dx (k1, k2), grad multiplies the rest, 1 / cosh^2(x k).
struct Softcap {
  float k_hi, k_lo;
  __device__ __forceinline__ explicit Softcap(double k) {
    k_hi = static_cast<float>(k);
    k_lo = static_cast<float>(k - static_cast<double>(k_hi));
  }
  __device__ __forceinline__ float operator()(float x) const { return accurate_tanh(x, k_hi, k_lo); }
  // A vector in place, bitwise as operator() per element: the series for every element without a branch; where an
  // element is past kTanhSeriesBound (or inf / NaN), behind one branch per vector, the exp form for every element,
  // selected. A branch per element serialized the elements' dependency chains: the forward ran 1.9x tanhf's (H200,
  // session 15), and a warp's 256 bf16 logits leave the series together often. True when the series covered all.
  template <int N>
  __device__ __forceinline__ bool apply(float (&f)[N]) const {
    float v[N];
    bool in_series[N], series = true;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float uh, ul;
      tanh_argument(f[k], k_hi, k_lo, __fmul_rn(f[k], k_hi), uh, ul);
      v[k] = tanh_series(uh, ul);
      in_series[k] = fabsf(uh) < kTanhSeriesBound;  // false for NaN
      series &= in_series[k];
    }
    if (!series) {
#pragma unroll
      for (int k = 0; k < N; ++k) {  // the argument recomputed, not kept live from the loop above (registers)
        const float ph = __fmul_rn(f[k], k_hi);
        float uh, ul;
        tanh_argument(f[k], k_hi, k_lo, ph, uh, ul);
        const float t = tanh_saturated(ph, tanh_exp_form(uh, ul));
        v[k] = in_series[k] ? v[k] : t;
      }
    }
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = v[k];
    return series;
  }
  template <class G>
  __device__ __forceinline__ float grad(float x, G&& grad_at) const {
    const float v = (*this)(x);
    return grad_at(v) * fused_logp_softcap::slope_of(x, v, k_hi, k_lo);
  }
  // grad per element of a vector in place, bitwise as grad: within the series' range |t| < tanh(kTanhSeriesBound)
  // < 3/4, where slope_of is fma(-t, t, 1).
  template <int N, class G>
  __device__ __forceinline__ void grad_apply(float (&f)[N], G&& grad_at) const {
    float v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = f[k];
    if (apply(v)) {
#pragma unroll
      for (int k = 0; k < N; ++k) f[k] = grad_at(v[k]) * fmaf(-v[k], v[k], 1.f);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) f[k] = grad_at(v[k]) * fused_logp_softcap::slope_of(f[k], v[k], k_hi, k_lo);
    }
  }
};
template <bool kSoftcap>
using TransformOf = std::conditional_t<kSoftcap, Softcap, NoTransform>;

// The label's transformed logit as the row's sums see it (the same float tanh), in double: the forward's z_y * T. A
// double tanh here would let logp exceed 0 (V = 1: logp = (tanh - its float) softcap / T, ~1e-6 with tanhf) and
// leave the backward's p != 1 there; its accuracy measured no better (H200, session 14).
template <bool kSoftcap>
__device__ __forceinline__ double label_logit(float x, double softcap_k) {
  return static_cast<double>(TransformOf<kSoftcap>(softcap_k)(x));
}

// ---- forward ----------------------------------------------------------------------------------------------------
// Per-thread online state: m the running max (of the transformed logits v), s = sum 2^a, t = sum 2^a * a,
// a = (v - m) * c, c = log2(e) / T. A NaN logit turns s and t into NaN and m into +inf (so later vectors take the fast
// path).
struct Acc {
  float m;
  double s, t;
};

template <bool kWithT>
__device__ __forceinline__ void acc_rescale(Acc& A, float mn, float c_hi, float c_lo) {
  if (mn != mn) {
    A.s = A.t = __longlong_as_double(0x7ff8000000000000ll);
    A.m = __int_as_float(0x7f800000);
    return;
  }
  if (A.m != __int_as_float(0xff800000)) {  // s, t are 0 while m is -inf: nothing to rescale
    const float dm = A.m - mn;
    const float a = fmaf(dm, c_hi, dm * c_lo);
    const double r = static_cast<double>(ex2(a));
    if (kWithT) A.t = r * (A.t + static_cast<double>(a) * A.s);
    A.s = r * A.s;
  }
  A.m = mn;
}

// Clamped update: exact for every input (-inf logits, a row whose max is still -inf, NaN).
template <int kN, bool kWithT>
__device__ __forceinline__ void acc_update_clamped(Acc& A, const float (&f)[kN], float c_hi, float c_lo) {
  float vm = f[0];
#pragma unroll
  for (int k = 1; k < kN; ++k) vm = fmax_nan(vm, f[k]);
  const float mn = fmax_nan(A.m, vm);
  if (mn != A.m) acc_rescale<kWithT>(A, mn, c_hi, c_lo);
  float sv = 0.f, tv = 0.f;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float d = f[k] - A.m;
    const float a = fmaxf(fmaf(d, c_hi, d * c_lo), kMinExponent);  // -inf/NaN difference -> e = 0, e * a = 0
    const float e = ex2(a);
    sv += e;
    if (kWithT) tv = fmaf(e, a, tv);
  }
  A.s += static_cast<double>(sv);
  if (kWithT) A.t += static_cast<double>(tv);
}

// Hot path for kNV vectors (kNV * kVec elements): one max test and at most one rescale, fp32 partial sums over all
// of them in kChains chains, one double add. No per-element clamp: a -inf logit gives e = 0 and e * a = NaN, which
// the check at the end catches, redoing these vectors through the clamped path (rare). The partial sums add at most
// kNV * kVec / kChains terms <= 1 per chain, each already carrying ex2.approx's ~2-ulp error.
template <class E, int kNV, bool kWithT, class Xf>
__device__ __forceinline__ void acc_update(Acc& A, const uint4 (&r)[kNV], float c_hi, float c_lo, const Xf& xf) {
  constexpr int kVec = E::kVec;
  constexpr int kChains = kNV * kVec >= 16 ? 4 : 2;
  float vm = E::vmax(r[0]);
#pragma unroll
  for (int u = 1; u < kNV; ++u) vm = fmax_nan(vm, E::vmax(r[u]));
  const float mn = fmax_nan(A.m, xf(vm));  // xf is monotone
  if (mn != A.m) acc_rescale<kWithT>(A, mn, c_hi, c_lo);
  const float m = A.m;
  float s[kChains], t[kChains];
#pragma unroll
  for (int u = 0; u < kNV; ++u) {
    float f[kVec];
    E::unpack(r[u], f);
    xf.apply(f);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int i = u * kVec + k, chain = i % kChains;
      const float d = f[k] - m;  // exact for logits within 2^24 ulps of the max
      const float a = fmaf(d, c_hi, d * c_lo);
      const float e = ex2(a);
      if (i < kChains) {  // start each chain without adding to 0 (which the compiler may not fold away)
        s[chain] = e;
        if (kWithT) t[chain] = e * a;
      } else {
        s[chain] += e;
        if (kWithT) t[chain] = fmaf(e, a, t[chain]);
      }
    }
  }
#pragma unroll
  for (int c = 1; c < kChains; ++c) {
    s[0] += s[c];
    if (kWithT) t[0] += t[c];
  }
  const float chk = kWithT ? s[0] + t[0] : s[0];
  if (chk != chk) {
    float f[kNV * kVec];
#pragma unroll
    for (int u = 0; u < kNV; ++u) {
      float g[kVec];
      E::unpack(r[u], g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f[u * kVec + k] = xf(g[k]);
    }
    acc_update_clamped<kNV * kVec, kWithT>(A, f, c_hi, c_lo);
    return;
  }
  A.s += static_cast<double>(s[0]);
  if (kWithT) A.t += static_cast<double>(t[0]);
}

template <typename label_t>
struct FwdParams {
  const void* logits;
  int64_t row_stride;
  int V;
  int splits;
  int vec_per_split;
  const label_t* labels;
  const float* token_temperature;  // nullable
  double temperature;  // T / w (the transform's weight: see the top)
  int64_t ignore_index;
  float* logp;
  float* entropy;  // nullable
  double* stats;   // [N, 2]
  double* partial; // [N, splits, 3] when splits > 1
  unsigned long long* bad;  // nullable: smallest row with an out-of-range label or temperature
  double softcap_k;  // logit_scale / softcap, 0 without a softcap
};

__device__ __forceinline__ double row_temperature(double temperature, const float* tt, int64_t row) {
  return tt ? temperature * static_cast<double>(tt[row]) : temperature;
}

// Final per-row outputs from (M, s, t) relative to M.
template <typename scalar_t, typename label_t, bool kSoftcap>
__device__ void finalize_row(const FwdParams<label_t>& p, int64_t row, int64_t y, double M, double s, double t,
                             double T) {
  const double nan = __longlong_as_double(0x7ff8000000000000ll);
  const double inf = __longlong_as_double(0x7ff0000000000000ll);
  const bool bad_label = y < 0 || y >= p.V;  // not ignore_index (checked by the caller): never read out of bounds
  const bool bad_temperature = !(T > 0.0 && T < inf);  // a per-token temperature of 0, < 0, inf or NaN
  if (bad_label || bad_temperature) {
    p.logp[row] = static_cast<float>(nan);
    if (p.entropy) p.entropy[row] = static_cast<float>(nan);
    p.stats[2 * row] = nan;
    p.stats[2 * row + 1] = nan;
    if (p.bad) atomicMin(p.bad, static_cast<unsigned long long>(row));
    return;
  }
  double lse, spz, ent;
  if (M == inf || s != s) {  // NaN or +inf logit in the row
    lse = spz = ent = nan;
  } else if (s == 0.0) {  // every logit -inf
    lse = -inf;
    spz = ent = nan;
  } else {
    const double ls = log(s);
    const double mean = kLn2 * t / s;  // sum p (z - M/T)
    lse = M / T + ls;
    spz = p.entropy ? M / T + mean : 0.0;  // t is only tracked when entropy is requested
    ent = ls - mean;
  }
  const scalar_t* x = reinterpret_cast<const scalar_t*>(p.logits) + row * p.row_stride;
  const double zy = label_logit<kSoftcap>(Elem<scalar_t>::load(x + y), p.softcap_k) / T;
  p.logp[row] = static_cast<float>(zy - lse);
  if (p.entropy) p.entropy[row] = static_cast<float>(ent);
  p.stats[2 * row] = lse;
  p.stats[2 * row + 1] = spz;
}

template <typename scalar_t, typename label_t>
__device__ __forceinline__ void write_ignored(const FwdParams<label_t>& p, int64_t row) {
  p.logp[row] = 0.f;
  if (p.entropy) p.entropy[row] = 0.f;
  p.stats[2 * row] = 0.0;
  p.stats[2 * row + 1] = 0.0;
}

// kGather (batch-invariant forward over rows that are not all 16-byte aligned): vectors start at row offset 0 whatever
// the row's address, rows that are not aligned gathered element-wise (load_vec), so that a row's sums never depend on
// where it sits in memory. Otherwise a scalar head up to the row's first 16-byte boundary (aligned rows have none).
template <typename scalar_t, typename label_t, bool kWithT, bool kGather, bool kSoftcap = false>
__global__ void __launch_bounds__(kThreads, kSoftcap ? kSoftcapMinBlocks : 0)
    fused_logp_fwd_kernel(const FwdParams<label_t> p) {
  using E = Elem<scalar_t>;
  const TransformOf<kSoftcap> xf(p.softcap_k);
  constexpr int kVec = E::kVec;
  const int64_t row = blockIdx.x;
  const int split = blockIdx.y;
  const int tid = threadIdx.x;
  const int64_t y = static_cast<int64_t>(p.labels[row]);
  if (y == p.ignore_index) {  // ignored token: no read of its logits at all
    if (p.splits == 1 && tid == 0) write_ignored<scalar_t>(p, row);
    return;
  }
  const double T = row_temperature(p.temperature, p.token_temperature, row);
  const double c = kLog2e / T;
  const float c_hi = static_cast<float>(c);
  const float c_lo = static_cast<float>(c - static_cast<double>(c_hi));
  const int V = p.V;
  const scalar_t* x = reinterpret_cast<const scalar_t*>(p.logits) + row * p.row_stride;
  const int aligned_head = head_elems(x, V);
  const bool gather = kGather && aligned_head != 0;
  const int head = kGather ? 0 : aligned_head;
  const int nvec = (V - head) / kVec;
  const int tail0 = head + nvec * kVec;

  Acc A{__int_as_float(0xff800000), 0.0, 0.0};
  if (split == 0 && tid < head) {
    const float f[1] = {xf(E::load(x + tid))};
    acc_update_clamped<1, kWithT>(A, f, c_hi, c_lo);
  }
  if (split == p.splits - 1 && tid < V - tail0) {
    const float f[1] = {xf(E::load(x + tail0 + tid))};
    acc_update_clamped<1, kWithT>(A, f, c_hi, c_lo);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x + head);
  const int vb = split * p.vec_per_split;
  const int ve = min(nvec, vb + p.vec_per_split);
  int v = vb + tid;
  for (; v + (kUnroll - 1) * kThreads < ve; v += kUnroll * kThreads) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = load_vec<scalar_t, kVec>(x, xv, v + u * kThreads, gather);
    acc_update<E, kUnroll, kWithT>(A, r, c_hi, c_lo, xf);
  }
  for (; v < ve; v += kThreads) {
    const uint4 r[1] = {load_vec<scalar_t, kVec>(x, xv, v, gather)};
    acc_update<E, 1, kWithT>(A, r, c_hi, c_lo, xf);
  }

  // Block combine: the max first, then every thread rescales its (s, t) to it once (double), then two sums.
  __shared__ float sh_m[kWarps];
  __shared__ double sh_s[kWarps], sh_t[kWarps];
  const int lane = tid & 31, warp = tid >> 5;
  float M = A.m;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmax_nan(M, __shfl_xor_sync(0xffffffffu, M, o));
  if (lane == 0) sh_m[warp] = M;
  __syncthreads();
  M = sh_m[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) M = fmax_nan(M, sh_m[w]);
  double s = 0.0, t = 0.0;
  if (A.m != __int_as_float(0xff800000)) {  // else this thread saw only -inf (or nothing): contributes 0
    if (M == __int_as_float(0x7f800000)) {
      s = t = __longlong_as_double(0x7ff8000000000000ll);
    } else {
      const double da = (static_cast<double>(A.m) - static_cast<double>(M)) * c;  // <= 0, log2 units
      const double r = exp2(da);
      s = r * A.s;
      if (kWithT) t = r * (A.t + da * A.s);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    if (kWithT) t += __shfl_xor_sync(0xffffffffu, t, o);
  }
  if (lane == 0) {
    sh_s[warp] = s;
    sh_t[warp] = t;
  }
  __syncthreads();
  if (tid == 0) {
    s = sh_s[0];
    t = sh_t[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      s += sh_s[w];
      t += sh_t[w];
    }
    if (p.splits == 1) {
      finalize_row<scalar_t, label_t, kSoftcap>(p, row, y, static_cast<double>(M), s, t, T);
    } else {
      double* q = p.partial + (row * p.splits + split) * 3;
      q[0] = static_cast<double>(M);
      q[1] = s;
      q[2] = t;
    }
  }
}

// Split-vocab combine: one thread per row merges the row's partial (M, s, t).
template <typename scalar_t, typename label_t, bool kWithT, bool kSoftcap = false>
__global__ void __launch_bounds__(128) fused_logp_combine_kernel(const FwdParams<label_t> p, int64_t N) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= N) return;
  const int64_t y = static_cast<int64_t>(p.labels[row]);
  if (y == p.ignore_index) {
    write_ignored<scalar_t>(p, row);
    return;
  }
  const double T = row_temperature(p.temperature, p.token_temperature, row);
  const double c = kLog2e / T;
  const double* q = p.partial + row * p.splits * 3;
  double M = q[0];
  for (int k = 1; k < p.splits; ++k) M = fmax(M, q[3 * k]);  // partial maxima are never NaN (NaN -> +inf)
  const double inf = __longlong_as_double(0x7ff0000000000000ll);
  double s = 0.0, t = 0.0;
  if (M == inf) {
    s = t = __longlong_as_double(0x7ff8000000000000ll);
  } else {
    for (int k = 0; k < p.splits; ++k) {
      const double mk = q[3 * k];
      if (mk == -inf) continue;
      const double da = (mk - M) * c;
      const double r = exp2(da);
      s += r * q[3 * k + 1];
      if (kWithT) t += r * (q[3 * k + 2] + da * q[3 * k + 1]);
    }
  }
  finalize_row<scalar_t, label_t, kSoftcap>(p, row, y, M, s, t, T);
}

// ---- backward ---------------------------------------------------------------------------------------------------
template <typename label_t>
struct BwdParams {
  const void* logits;
  int64_t row_stride;
  void* grad;  // [N, V] contiguous
  int V;
  int splits;
  int vec_per_split;
  const label_t* labels;
  const float* token_temperature;
  double temperature;  // T / w, as the forward's
  int64_t ignore_index;
  const float* grad_logp;
  const float* grad_entropy;  // nullable
  const double* stats;
  double softcap_k;  // as the forward's
};

// Per-row constants of the backward, all in fp32 pairs: exponent of p is x * c - L, with c = c_hi + c_lo and
// L = lse * log2(e) = L_hi + L_lo; the entropy factor (z - sum_pz) * log2(e) is x * c - S likewise.
struct BwdRow {
  float c_hi, c_lo, L_hi, L_lo, S_hi, S_lo, k1, k2;  // k1 = g_logp / T, k2 = g_ent * ln2 / T
};

// Exponents above this (p > 2^-1.5 ~ 0.35: at most two elements of a row) take the accurate exp2 even for bf16/fp16:
// there ex2.approx's ~2-ulp error would show in 1 - p at the label and in p at a dominant logit.
constexpr float kAccurateAbove = -1.5f;

// One element's gradient; hi_out: its exponent (log2 p). kAccurateExp: always the accurate exp2 (fp32 logits, the
// label). kPerElement: bf16/fp16 take the accurate exp2 exactly where p > ~0.35, a function of the element alone, so a
// row's gradient never depends on its alignment (batch invariance of unaligned rows); otherwise the caller redoes
// a whole vector accurately when one of its elements is there (fewer instructions per element: 9% faster fwd+bwd at
// 16384 x 151936 bf16 on the H200).
template <bool kWithEnt, bool kAccurateExp, bool kIsLabel = false, bool kPerElement = false>
__device__ __forceinline__ float grad_elem(const BwdRow& R, float x_in, float& hi_out) {
  // A -inf logit becomes -1e30 (p = 0 exactly, every intermediate finite). NaN needs no care here: a NaN logit made
  // the row's lse NaN in the forward, so the whole row's gradient is NaN anyway.
  const float x = fmaxf(x_in, -1.0e30f);
  // Exponent x*c - L as an unevaluated pair hi + lo, exact to ~2^-48 relative: x*c_hi = ph + pl exactly (FMA), then
  // TwoSum(ph, -L_hi). Without it, hi's rounding (|hi| * 2^-25) makes small p as inexact as log_softmax's rounded
  // logp does, and bf16/fp16 gradients then misround as often as the fp32 PyTorch path's.
  // (__fmul_rn / __fadd_rn / __fsub_rn: no contraction into FMAs, which would break the error-free transforms.)
  const float ph = __fmul_rn(x, R.c_hi);
  const float pl = fmaf(x, R.c_hi, -ph);
  const float w = fmaf(x, R.c_lo, pl);
  const float hi = __fsub_rn(ph, R.L_hi);
  const float bv = __fsub_rn(hi, ph);
  const float err = __fadd_rn(__fsub_rn(ph, __fsub_rn(hi, bv)), __fsub_rn(-R.L_hi, bv));
  const float lo = (w - R.L_lo) + err;
  hi_out = hi;
  float p;
  if (kAccurateExp || (kPerElement && hi > kAccurateAbove)) {
    p = exp2_accurate(hi, lo);
  } else {
    const float p0 = ex2(hi);
    p = fmaf(p0, lo * static_cast<float>(kLn2), p0);
  }
  if (kIsLabel) {  // k1 (1 - p) - k2 p b, with 1 - p exact for p >= 1/2
    const float q = kWithEnt ? p * fmaxf((ph - R.S_hi) + (w - R.S_lo), -3.0e38f) : 0.f;
    return fmaf(R.k1, 1.f - p, -R.k2 * q);
  }
  if (!kWithEnt) return -R.k1 * p;
  const float b = fmaxf((ph - R.S_hi) + (w - R.S_lo), -3.0e38f);  // -inf logit: p = 0 and p * b = 0
  return -fmaf(R.k2, p * b, R.k1 * p);
}

// kGather (batch-invariant backward of a launch whose gradient rows are 16-byte aligned, i.e. V * element size a
// multiple of 16): a logits row that is not aligned is gathered element-wise into the aligned vector layout, so its
// elements share vectors, and head / tail, exactly as in an aligned row, and the per-vector rule stays invariant.
template <typename scalar_t, typename label_t, bool kWithEnt, bool kPerElement, bool kSoftcap = false,
          bool kGather = false>
__global__ void __launch_bounds__(kThreads, kSoftcap ? kSoftcapMinBlocks : 0)
    fused_logp_bwd_kernel(const BwdParams<label_t> p) {
  using E = Elem<scalar_t>;
  const TransformOf<kSoftcap> xf(p.softcap_k);
  constexpr int kVec = E::kVec;
  const int64_t row = blockIdx.x;
  const int split = blockIdx.y;
  const int tid = threadIdx.x;
  const int V = p.V;
  const scalar_t* x = reinterpret_cast<const scalar_t*>(p.logits) + row * p.row_stride;
  scalar_t* g = reinterpret_cast<scalar_t*>(p.grad) + row * static_cast<int64_t>(V);
  const int64_t y64 = static_cast<int64_t>(p.labels[row]);
  const bool ignored = (y64 == p.ignore_index);
  const bool bad = !ignored && (y64 < 0 || y64 >= V);
  const int y = (ignored || bad) ? -1 : static_cast<int>(y64);

  BwdRow R;
  double T = 1.0;
  if (!ignored) {
    T = row_temperature(p.temperature, p.token_temperature, row);
    const double c = kLog2e / T;
    R.c_hi = static_cast<float>(c);
    R.c_lo = static_cast<float>(c - static_cast<double>(R.c_hi));
    const double L = p.stats[2 * row] * kLog2e, S = p.stats[2 * row + 1] * kLog2e;
    R.L_hi = static_cast<float>(L);
    R.L_lo = static_cast<float>(L - static_cast<double>(R.L_hi));
    R.S_hi = static_cast<float>(S);
    R.S_lo = static_cast<float>(S - static_cast<double>(R.S_hi));
    const double nan = __longlong_as_double(0x7ff8000000000000ll);
    // With a softcap, dv/dx = k / cosh^2(x k): the factor k here (Softcap::grad multiplies the rest).
    const double k = kSoftcap ? p.softcap_k : 1.0;
    R.k1 = static_cast<float>(bad ? nan : static_cast<double>(p.grad_logp[row]) / T * k);
    R.k2 = kWithEnt ? static_cast<float>(static_cast<double>(p.grad_entropy[row]) * kLn2 / T * k) : 0.f;
  }
  // fp32 logits always take the accurate exp2; bf16/fp16 ex2.approx except near p > ~0.35 (grad_elem).
  constexpr bool kAlwaysAccurate = std::is_same<scalar_t, float>::value;
  // The scalar head/tail: per element as the vector body when kPerElement, else always accurate (a few elements).
  // fp32 logits: the label's gradient in double, (g_logp (1 - p) - g_ent p (z - sum p z)) g'(x) / T from the float64
  // stats, rounded once. With p spread it holds nearly all of a row's gradient norm, and formed in float (k1 rounded,
  // 1 - p from a float p) it was at parity with the fp32 PyTorch path's error, not below it (H200, session 14:
  // docs/notes/fused_logp.md). Once per row; 16-bit gradients round far above either.
  auto label_exact = [&](float x_loaded) -> float {
    const double xd = fmax(static_cast<double>(x_loaded), -1.0e30);  // -inf: p = 0, the product below stays 0
    const double z = static_cast<double>(xf(static_cast<float>(xd))) / T;  // the forward's z_y (label_logit)
    const double pr = exp(z - p.stats[2 * row]);
    double grad = static_cast<double>(p.grad_logp[row]) * (1.0 - pr);
    if (kWithEnt) grad -= static_cast<double>(p.grad_entropy[row]) * pr * (z - p.stats[2 * row + 1]);
    if (kSoftcap) {
      const double ch = cosh(xd * p.softcap_k);
      grad *= p.softcap_k / (ch * ch);
    }
    return static_cast<float>(grad / T);
  };
  auto one = [&](int j, float x_loaded) -> float {
    const bool is_label = j == y;  // outside the transform's lambda: the default kernels' SASS stays main's
    if constexpr (kAlwaysAccurate) {
      if (is_label) return label_exact(x_loaded);
    }
    return xf.grad(x_loaded, [&](float xv) {
      float hi;
      return is_label ? grad_elem<kWithEnt, true, true>(R, xv, hi)
                      : grad_elem<kWithEnt, kPerElement ? kAlwaysAccurate : true, false, kPerElement>(R, xv, hi);
    });
  };

  const bool gather = kGather && (reinterpret_cast<uintptr_t>(x) & 15u) != 0 &&
                      (reinterpret_cast<uintptr_t>(g) & 15u) == 0;
  const int head = gather ? 0 : head_elems(x, V);
  if (!gather && (reinterpret_cast<uintptr_t>(x) & 15u) != (reinterpret_cast<uintptr_t>(g) & 15u)) {
    // Input and output rows differ in 16-byte alignment (strided logits): scalar path over this split's range.
    const int64_t span = static_cast<int64_t>(p.vec_per_split) * kVec;
    const int64_t lo = imin64(V, split * span);
    const int64_t hi = split == p.splits - 1 ? V : imin64(V, (split + 1) * span);
    for (int64_t j = lo + tid; j < hi; j += kThreads)
      E::store(g + j, ignored ? 0.f : one(static_cast<int>(j), E::load(x + j)));
    return;
  }
  const int nvec = (V - head) / kVec;
  const int tail0 = head + nvec * kVec;
  if (split == 0 && tid < head) E::store(g + tid, ignored ? 0.f : one(tid, E::load(x + tid)));
  if (split == p.splits - 1 && tid < V - tail0)
    E::store(g + tail0 + tid, ignored ? 0.f : one(tail0 + tid, E::load(x + tail0 + tid)));
  const uint4* xv = reinterpret_cast<const uint4*>(x + head);
  uint4* gv = reinterpret_cast<uint4*>(g + head);
  const int vb = split * p.vec_per_split;
  const int ve = min(nvec, vb + p.vec_per_split);
  if (ignored) {
    for (int v = vb + tid; v < ve; v += kThreads) gv[v] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  auto process = [&](int v, const uint4& r) {
    float f[kVec];
    E::unpack(r, f);
    float hmax = -3.0e38f;
    xf.grad_apply(f, [&](float xv) {
      float hi;
      const float gx = grad_elem<kWithEnt, kAlwaysAccurate, false, kPerElement>(R, xv, hi);
      hmax = fmaxf(hmax, hi);
      return gx;
    });
    // Without kPerElement, bf16/fp16 redo accurately the (at most one per row) vector holding a probability above
    // ~0.35, where ex2.approx's ~2-ulp error would show in 1 - p at the label and in p at a dominant logit.
    if (!kPerElement && !kAlwaysAccurate && hmax > kAccurateAbove) {
      E::unpack(r, f);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float hi;
        f[k] = xf.grad(f[k], [&](float xv) { return grad_elem<kWithEnt, true>(R, xv, hi); });
      }
    }
    const int j0 = head + v * kVec;
    if (static_cast<unsigned>(y - j0) < static_cast<unsigned>(kVec)) {
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        if (j0 + k == y) {
          float xk[kVec], hi;
          E::unpack(r, xk);
          if constexpr (kAlwaysAccurate)
            f[k] = label_exact(xk[k]);
          else
            f[k] = xf.grad(xk[k], [&](float xv) { return grad_elem<kWithEnt, true, true>(R, xv, hi); });
        }
    }
    __stcs(gv + v, E::pack(f));
  };
  int v = vb + tid;
  for (; v + (kUnroll - 1) * kThreads < ve; v += kUnroll * kThreads) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = load_vec<scalar_t, kVec>(x, xv, v + u * kThreads, gather);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) process(v + u * kThreads, r[u]);
  }
  for (; v < ve; v += kThreads) process(v, load_vec<scalar_t, kVec>(x, xv, v, gather));
}

// ---- host -------------------------------------------------------------------------------------------------------
using fused_logp_detail::ScalarType;
using fused_logp_detail::Tensor;
namespace pks = prime_kernels::stable;

template <typename F>
void dispatch_scalar(ScalarType st, F&& f) {
  switch (st) {
    case ScalarType::Float: f(float{}); break;
    case ScalarType::BFloat16: f(__nv_bfloat16{}); break;
    case ScalarType::Half: f(__half{}); break;
    default: pks::fail("fused_logp: unsupported logits dtype ", st);
  }
}
template <typename F>
void dispatch_label(ScalarType st, F&& f) {
  if (st == ScalarType::Long)
    f(int64_t{});
  else
    f(int32_t{});
}

// Blocks per row: 1 when the rows alone fill the GPU (two waves of resident blocks), else enough splits for that,
// each at least SPLIT_MIN_ELEMS logits, at most MAX_SPLITS. The forward's sums depend on the split count, so the
// batch-invariant forward always takes the large-N choice, one block per row: the same kernel where rows fill the GPU,
// and measured no slower at N = 1024 and 5 (V = 151936, H200; the splits from V alone it replaced cost 1.19x at
// 16384 x 151936). (The backward's elements do not depend on it: any split count gives the same gradient.)
int choose_splits(int64_t N, int64_t V, bool batch_invariant, int device) {
  if (batch_invariant) return 1;
  const int sms = pks::multiprocessor_count(device);
  const int64_t target = 2LL * sms * (2048 / kThreads);
  if (N >= target) return 1;
  int64_t s = (target + N - 1) / N;
  s = std::min<int64_t>(s, FUSED_LOGP_MAX_SPLITS);
  s = std::min<int64_t>(s, std::max<int64_t>(1, V / FUSED_LOGP_SPLIT_MIN_ELEMS));
  return static_cast<int>(std::max<int64_t>(1, s));
}

// tensor.flatten()[index].item<T>(): one element copied to the host on ``stream``, which it synchronises.
template <typename T>
T read_back(const Tensor& tensor, int64_t index, cudaStream_t stream) {
  T value;
  STD_CUDA_CHECK(cudaMemcpyAsync(&value, static_cast<const T*>(tensor.const_data_ptr()) + index, sizeof(T),
                                 cudaMemcpyDeviceToHost, stream));
  STD_CUDA_CHECK(cudaStreamSynchronize(stream));
  return value;
}

std::tuple<Tensor, Tensor, Tensor> logp_entropy_cuda(const Tensor& logits_in, const Tensor& labels_in,
                                                     double temperature, const std::optional<Tensor>& token_temperature,
                                                     int64_t ignore_index, bool return_entropy, bool check_labels,
                                                     bool batch_invariant, std::optional<double> softcap,
                                                     double logit_scale) {
  fused_logp_detail::check_forward_args(logits_in, labels_in, temperature, token_temperature);
  fused_logp_cpu::check_logit_transform("fused_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("fused_logp", temperature, softcap, logit_scale);
  PK_CHECK(logits_in.is_cuda(), "fused_logp: CUDA implementation got logits on ", pks::device(logits_in));
  const int device = logits_in.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const int64_t N = logits_in.size(0), V = logits_in.size(1);
  Tensor logp = pks::empty(logits_in, {N}, ScalarType::Float);
  Tensor entropy = pks::empty(logits_in, {return_entropy ? N : 0}, ScalarType::Float);
  Tensor stats = pks::empty(logits_in, {N, 2}, ScalarType::Double);
  if (N == 0) return {logp, entropy, stats};

  const Tensor logits = V == 1 ? pks::contiguous(logits_in) : logits_in;
  const Tensor labels = pks::contiguous(softcap ? pks::to(labels_in, ScalarType::Long) : labels_in);
  Tensor tt;
  if (token_temperature.has_value()) tt = pks::contiguous(*token_temperature);
  const cudaStream_t stream = pks::current_cuda_stream(device);

  Tensor bad;
  if (check_labels) {
    bad = pks::empty(logits, {1}, ScalarType::Long);
    STD_CUDA_CHECK(cudaMemsetAsync(bad.data_ptr(), 0xff, sizeof(int64_t), stream));  // "none" = all ones
  }
  const int splits = choose_splits(N, V, batch_invariant, device);
  // Every row 16-byte aligned: the invariant forward runs the same kernel as the default (no gather path).
  const bool rows_aligned = reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0 &&
                            (N == 1 || (logits.stride(0) * logits.element_size()) % 16 == 0);
  const bool gather = batch_invariant && !rows_aligned;
  Tensor partial;
  if (splits > 1) partial = pks::empty(logits, {N, splits, 3}, ScalarType::Double);

  dispatch_scalar(logits.scalar_type(), [&](auto s_tag) {
    using scalar_t = decltype(s_tag);
    constexpr int kVec = Elem<scalar_t>::kVec;
    dispatch_label(labels.scalar_type(), [&](auto l_tag) {
      using label_t = decltype(l_tag);
      FwdParams<label_t> p;
      p.logits = logits.data_ptr();
      p.row_stride = logits.stride(0);
      p.V = static_cast<int>(V);
      p.splits = splits;
      p.vec_per_split = static_cast<int>((V / kVec + splits - 1) / splits);
      p.labels = labels.const_data_ptr<label_t>();
      p.token_temperature = tt.defined() ? tt.const_data_ptr<float>() : nullptr;
      p.temperature = temperature / fused_logp_cpu::logit_weight(softcap, logit_scale);
      p.softcap_k = softcap ? logit_scale / *softcap : 0.0;
      p.ignore_index = ignore_index;
      p.logp = logp.mutable_data_ptr<float>();
      p.entropy = return_entropy ? entropy.mutable_data_ptr<float>() : nullptr;
      p.stats = stats.mutable_data_ptr<double>();
      p.partial = splits > 1 ? partial.mutable_data_ptr<double>() : nullptr;
      p.bad = check_labels ? reinterpret_cast<unsigned long long*>(bad.mutable_data_ptr<int64_t>()) : nullptr;
      const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(splits));
      // The entropy gradient needs sum p*z, so t is tracked whenever entropy is requested.
      auto run = [&](auto with_t, auto gather, auto softcap_tag) {
        fused_logp_fwd_kernel<scalar_t, label_t, with_t(), gather(), softcap_tag()><<<grid, kThreads, 0, stream>>>(p);
        STD_CUDA_KERNEL_LAUNCH_CHECK();
        if (splits > 1) {
          fused_logp_combine_kernel<scalar_t, label_t, with_t(), softcap_tag()>
              <<<static_cast<unsigned>((N + 127) / 128), 128, 0, stream>>>(p, N);
          STD_CUDA_KERNEL_LAUNCH_CHECK();
        }
      };
      using yes = std::true_type;
      using no = std::false_type;
      if (softcap) {
        if constexpr (std::is_same_v<label_t, int64_t>)
          return_entropy ? run(yes{}, yes{}, yes{}) : run(no{}, yes{}, yes{});
        else
          pks::fail("fused_logp: the softcap kernels take int64 labels (widened on the host), got int32");
      } else if (return_entropy) {
        gather ? run(yes{}, yes{}, no{}) : run(yes{}, no{}, no{});
      } else {
        gather ? run(no{}, yes{}, no{}) : run(no{}, no{}, no{});
      }
    });
  });

  if (check_labels) {
    const int64_t first = read_back<int64_t>(bad, 0, stream);  // one 8-byte device->host copy: synchronises
    if (first != -1) {
      const int64_t y = labels.scalar_type() == ScalarType::Long ? read_back<int64_t>(labels, first, stream)
                                                                 : read_back<int32_t>(labels, first, stream);
      if (y < 0 || y >= V) fused_logp_detail::fail_bad_label(first, y, V, ignore_index);
      // The label is in range: the row was flagged for its temperature.
      fused_logp_detail::fail_bad_token_temperature(first, read_back<float>(tt, first, stream));
    }
  }
  return {logp, entropy, stats};
}

Tensor logp_entropy_backward_cuda(const Tensor& grad_logp_in, const std::optional<Tensor>& grad_entropy_in,
                                  const Tensor& logits_in, const Tensor& labels_in, double temperature,
                                  const std::optional<Tensor>& token_temperature, const Tensor& stats_in,
                                  int64_t ignore_index, bool batch_invariant, std::optional<double> softcap,
                                  double logit_scale) {
  fused_logp_detail::check_backward_args(grad_logp_in, grad_entropy_in, logits_in, labels_in, temperature,
                                         token_temperature, stats_in);
  fused_logp_cpu::check_logit_transform("fused_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("fused_logp", temperature, softcap, logit_scale);
  PK_CHECK(logits_in.is_cuda(), "fused_logp: CUDA implementation got logits on ", pks::device(logits_in));
  const int device = logits_in.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const int64_t N = logits_in.size(0), V = logits_in.size(1);
  Tensor grad = pks::empty(logits_in, {N, V}, logits_in.scalar_type());
  if (N == 0) return grad;
  const Tensor logits = V == 1 ? pks::contiguous(logits_in) : logits_in;
  const Tensor labels = pks::contiguous(softcap ? pks::to(labels_in, ScalarType::Long) : labels_in);
  const Tensor g = pks::contiguous(pks::to(grad_logp_in, ScalarType::Float));
  Tensor ge;
  if (grad_entropy_in.has_value()) ge = pks::contiguous(pks::to(*grad_entropy_in, ScalarType::Float));
  const Tensor stats = pks::contiguous(stats_in);
  Tensor tt;
  if (token_temperature.has_value()) tt = pks::contiguous(*token_temperature);
  const cudaStream_t stream = pks::current_cuda_stream(device);
  const int splits = choose_splits(N, V, false, device);  // any split count gives the same gradient (see `one`)

  dispatch_scalar(logits.scalar_type(), [&](auto s_tag) {
    using scalar_t = decltype(s_tag);
    constexpr int kVec = Elem<scalar_t>::kVec;
    dispatch_label(labels.scalar_type(), [&](auto l_tag) {
      using label_t = decltype(l_tag);
      BwdParams<label_t> p;
      p.logits = logits.data_ptr();
      p.row_stride = logits.stride(0);
      p.grad = grad.data_ptr();
      p.V = static_cast<int>(V);
      p.splits = splits;
      p.vec_per_split = static_cast<int>((V / kVec + splits - 1) / splits);
      p.labels = labels.const_data_ptr<label_t>();
      p.token_temperature = tt.defined() ? tt.const_data_ptr<float>() : nullptr;
      p.temperature = temperature / fused_logp_cpu::logit_weight(softcap, logit_scale);
      p.softcap_k = softcap ? logit_scale / *softcap : 0.0;
      p.ignore_index = ignore_index;
      p.grad_logp = g.const_data_ptr<float>();
      p.grad_entropy = ge.defined() ? ge.const_data_ptr<float>() : nullptr;
      p.stats = stats.const_data_ptr<double>();
      const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(splits));
      auto launch = [&](auto with_entropy, auto per_element, auto softcap_tag, auto gather) {
        fused_logp_bwd_kernel<scalar_t, label_t, decltype(with_entropy)::value, decltype(per_element)::value,
                              decltype(softcap_tag)::value, decltype(gather)::value><<<grid, kThreads, 0, stream>>>(p);
      };
      // Invariant: the per-vector rule with unaligned logits rows gathered where the gradient rows are aligned (a
      // function of V and the dtype alone: the same form for every batch), else the per-element rule (measured 1.11x
      // the default's forward+backward at 16384 x 151936 bf16 on the H200).
      const bool invariant_per_vector = batch_invariant && (V * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0;
      using yes = std::true_type;
      using no = std::false_type;
      if (softcap) {
        if constexpr (std::is_same_v<label_t, int64_t>)
          ge.defined() ? launch(yes{}, yes{}, yes{}, no{}) : launch(no{}, yes{}, yes{}, no{});
        else
          pks::fail("fused_logp: the softcap kernels take int64 labels (widened on the host), got int32");
      } else if (invariant_per_vector) {
        ge.defined() ? launch(yes{}, no{}, no{}, yes{}) : launch(no{}, no{}, no{}, yes{});
      } else if (ge.defined()) {
        batch_invariant ? launch(yes{}, yes{}, no{}, no{}) : launch(yes{}, no{}, no{}, no{});
      } else {
        batch_invariant ? launch(no{}, yes{}, no{}, no{}) : launch(no{}, no{}, no{}, no{});
      }
      STD_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_logp, CUDA, m) {
  m.impl("logp_entropy", TORCH_BOX(&logp_entropy_cuda));
  m.impl("logp_entropy_backward", TORCH_BOX(&logp_entropy_backward_cuda));
}
