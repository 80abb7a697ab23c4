// linear_logp: per-token log-probability of the label and entropy of softmax((hidden @ weight^T + bias) / T), straight
// from the hidden states and the lm_head weight, without materialising the [N, V] logits.
//
// Op schemas (namespace fused_logp, a fragment of csrc/fused_logp.cpp's library) and the CPU implementations. The
// CUDA implementations live in cuda/linear_logp_{fwd,bwd}.cu and share the argument checks defined here.
//
//   linear_logp_entropy(Tensor hidden, Tensor weight, Tensor labels, float temperature, Tensor? token_temperature,
//                       Tensor? bias, int ignore_index, bool return_entropy, bool batch_invariant=False,
//                       float? softcap=None, float logit_scale=1.0) -> (Tensor logp, Tensor entropy, Tensor stats)
//     hidden [N, H], weight [V, H] (same dtype: bfloat16, float16; float32 on CPU only), labels [N] int64/int32,
//     token_temperature None or fp32 [N] (temperature of token i = temperature * token_temperature[i]), bias None or
//     floating [V]. z = g(hidden @ weight^T + bias) / T with the logit transform g(x) = softcap * tanh(logit_scale * x
//     / softcap), or logit_scale * x when softcap is None (as fused_logp's logp_entropy); logp = z_y - logsumexp(z);
//     entropy = logsumexp(z) - sum p z. logp fp32 [N]; entropy fp32 [N] ([0] when return_entropy is false); stats
//     float64 [N, 2] = (logsumexp(z), sum softmax(z) z) for the backward (float64, as the logits op's: the backward's p
//     = exp(z - lse) is then exactly 1 where the forward's was, e.g. every gradient is exactly 0 at V = 1). Ignored tokens: 0 everywhere. A label outside [0, V) that is not
//     ignore_index is an error on CPU; on CUDA it gives NaN logp and entropy (no device sync). Likewise a
//     token_temperature[i] that is not finite and > 0 (of a token that is not ignored): an error naming the first such
//     position on CPU (forward and backward); on CUDA NaN logp, entropy and stats (so its gradients are NaN too).
//
//   linear_logp_entropy_backward(Tensor grad_logp, Tensor? grad_entropy, Tensor hidden, Tensor weight, Tensor labels,
//       float temperature, Tensor? token_temperature, Tensor? bias, Tensor stats, int ignore_index, bool[3] output_mask,
//       bool grad_weight_fp32, bool batch_invariant=False, float? softcap=None, float logit_scale=1.0)
//       -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)
//     dZ = [g_logp (onehot(y) - p) - g_ent p (z - sum_pz)] g'(logits) / T, recomputed from hidden and weight with the
//     saved stats;
//     grad_hidden = dZ @ weight (hidden's dtype), grad_weight = dZ^T @ hidden (hidden's dtype, or fp32 with
//     grad_weight_fp32), grad_bias = sum_rows dZ (bias dtype), each accumulated in fp32 or wider. An output whose
//     output_mask entry is false (or grad_bias without a bias) is returned as an empty tensor of shape [0].
//     A label outside [0, V) that is not ignore_index adds no onehot term (no column matches): the vocabulary-parallel
//     backward passes V for tokens whose label another rank owns.
//
//   batch_invariant (both ops): a token's logp, entropy, stats and grad_hidden row are bitwise identical whatever the
//   other tokens and their number; grad_weight / grad_bias are reproducible run to run in every mode (fixed order, no
//   atomics). The CPU implementation always is (double accumulation in a fixed order per row and per vocab row). CUDA:
//   the forward's split count and the backward's chunking and GEMM shapes then come from V (and H) alone
//   (cuda/linear_logp_fwd.cu, cuda/linear_logp_bwd.cu, docs/notes/batch_invariance.md).
// Host code on the LibTorch stable ABI (kernel.toml: stable_abi), in fused_logp's module _C_stable: torch/csrc/stable
// and torch/headeronly only, as csrc/fused_logp.cpp.
#include <prime_kernels/stable.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_common.h"

#ifndef LINEAR_LOGP_CPU_BLOCK_V
#error "LINEAR_LOGP_CPU_BLOCK_V must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_HIDDEN_ALIGN
#error "LINEAR_LOGP_HIDDEN_ALIGN must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_PTR_ALIGN_BYTES
#error "LINEAR_LOGP_PTR_ALIGN_BYTES must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_MAX_VOCAB_SIZE
#error "LINEAR_LOGP_MAX_VOCAB_SIZE must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_MAX_NUM_TOKENS
#error "LINEAR_LOGP_MAX_NUM_TOKENS must come from kernel.toml ([linear_logp.constants])"
#endif

namespace linear_logp_detail {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
namespace pks = prime_kernels::stable;

static void check_same_device(const Tensor& t, const Tensor& hidden, const char* name) {
  pks::require_defined(t, "linear_logp", name);
  PK_CHECK(t.device() == hidden.device(), "linear_logp: ", name, " must be on hidden's device ", pks::device(hidden),
           ", got ", pks::device(t));
}

void check_forward_args(const Tensor& hidden, const Tensor& weight, const Tensor& labels, double temperature,
                        const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias) {
  pks::require_defined(hidden, "linear_logp", "hidden");
  pks::require_defined(weight, "linear_logp", "weight");
  pks::require_defined(labels, "linear_logp", "labels");
  PK_CHECK(hidden.dim() == 2, "linear_logp: hidden must be 2-D [N, H], got ", hidden.dim(), "-D with shape ",
           pks::shape(hidden));
  PK_CHECK(weight.dim() == 2, "linear_logp: weight must be 2-D [V, H], got ", weight.dim(), "-D with shape ",
           pks::shape(weight));
  const auto st = pks::scalar_type(hidden);
  PK_CHECK(st == ScalarType::BFloat16 || st == ScalarType::Half || st == ScalarType::Float,
           "linear_logp: hidden dtype must be bfloat16 or float16 (float32 on CPU), got ", pks::dtype(hidden));
  PK_CHECK(pks::scalar_type(weight) == st, "linear_logp: weight dtype must equal hidden's (", pks::dtype(hidden),
           "), got ", pks::dtype(weight));
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  PK_CHECK(weight.size(1) == H, "linear_logp: weight must have H = ", H, " columns (hidden's last dim), got shape ",
           pks::shape(weight));
  PK_CHECK(H >= 1, "linear_logp: hidden size (last dim of hidden) must be >= 1, got ", H);
  PK_CHECK(V >= 1, "linear_logp: weight vocab size (rows) must be >= 1, got ", V);
  PK_CHECK(V <= int64_t(LINEAR_LOGP_MAX_VOCAB_SIZE), "linear_logp: weight vocab size must be <= ",
           int64_t(LINEAR_LOGP_MAX_VOCAB_SIZE), ", got ", V);
  PK_CHECK(N <= int64_t(LINEAR_LOGP_MAX_NUM_TOKENS), "linear_logp: number of tokens must be <= ",
           int64_t(LINEAR_LOGP_MAX_NUM_TOKENS), ", got ", N);
  check_same_device(weight, hidden, "weight");
  PK_CHECK(labels.dim() == 1, "linear_logp: labels must be 1-D [N], got ", labels.dim(), "-D with shape ",
           pks::shape(labels));
  PK_CHECK(pks::scalar_type(labels) == ScalarType::Long || pks::scalar_type(labels) == ScalarType::Int,
           "linear_logp: labels dtype must be int64 or int32, got ", pks::dtype(labels));
  PK_CHECK(labels.size(0) == N, "linear_logp: labels must have N = ", N, " entries (hidden rows), got ",
           labels.size(0));
  check_same_device(labels, hidden, "labels");
  PK_CHECK(std::isfinite(temperature) && temperature > 0.0, "linear_logp: temperature must be finite and > 0, got ",
           temperature);
  // The CUDA kernels take it as a float32, which must not become 0, a denormal or inf.
  constexpr double kFloatMin = std::numeric_limits<float>::min(), kFloatMax = std::numeric_limits<float>::max();
  PK_CHECK(temperature >= kFloatMin && temperature <= kFloatMax,
           "linear_logp: temperature must be a normal float32, in [", kFloatMin, ", ", kFloatMax, "], got ",
           temperature);
  if (token_temperature.has_value()) {
    const auto& tt = *token_temperature;
    PK_CHECK(pks::scalar_type(tt) == ScalarType::Float, "linear_logp: token_temperature dtype must be float32, got ",
             pks::dtype(tt));
    PK_CHECK(tt.dim() == 1 && tt.size(0) == N, "linear_logp: token_temperature must have shape [", N,
             "] (one per token), got ", pks::shape(tt));
    check_same_device(tt, hidden, "token_temperature");
  }
  if (bias.has_value()) {
    const auto& b = *bias;
    PK_CHECK(fused_logp_cpu::is_floating(pks::scalar_type(b)), "linear_logp: bias must be floating point, got ",
             pks::dtype(b));
    PK_CHECK(b.dim() == 1 && b.size(0) == V, "linear_logp: bias must have shape [", V, "] (weight rows), got ",
             pks::shape(b));
    check_same_device(b, hidden, "bias");
  }
}

void check_backward_args(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& hidden,
                         const Tensor& weight, const Tensor& labels, double temperature,
                         const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias,
                         const Tensor& stats) {
  check_forward_args(hidden, weight, labels, temperature, token_temperature, bias);
  pks::require_defined(grad_logp, "linear_logp", "grad_logp");
  pks::require_defined(stats, "linear_logp", "stats");
  const int64_t N = hidden.size(0);
  PK_CHECK(grad_logp.dim() == 1 && grad_logp.size(0) == N, "linear_logp: grad_logp must have shape [", N,
           "], got ", pks::shape(grad_logp));
  PK_CHECK(fused_logp_cpu::is_floating(pks::scalar_type(grad_logp)),
           "linear_logp: grad_logp must be floating point, got ", pks::dtype(grad_logp));
  check_same_device(grad_logp, hidden, "grad_logp");
  if (grad_entropy.has_value()) {
    const auto& ge = *grad_entropy;
    PK_CHECK(ge.dim() == 1 && ge.size(0) == N, "linear_logp: grad_entropy must have shape [", N, "], got ",
             pks::shape(ge));
    PK_CHECK(fused_logp_cpu::is_floating(pks::scalar_type(ge)),
             "linear_logp: grad_entropy must be floating point, got ", pks::dtype(ge));
    check_same_device(ge, hidden, "grad_entropy");
  }
  PK_CHECK(pks::scalar_type(stats) == ScalarType::Double,
           "linear_logp: stats must be float64 (from linear_logp_entropy), got ", pks::dtype(stats));
  PK_CHECK(stats.dim() == 2 && stats.size(0) == N && stats.size(1) == 2, "linear_logp: stats must have shape [",
           N, ", 2], got ", pks::shape(stats));
  check_same_device(stats, hidden, "stats");
}

// The CUDA kernels' shape contract (mirrored by linear_ops.unsupported_shape_reason): TMA needs 16-byte aligned base
// pointers and row strides, the dtype is 16-bit, the last dim is contiguous.
void check_cuda_contract(const Tensor& hidden, const Tensor& weight) {
  const auto st = hidden.scalar_type();
  PK_CHECK(st == ScalarType::BFloat16 || st == ScalarType::Half, "linear_logp: on CUDA hidden and weight must be "
           "bfloat16 or float16, got ", pks::dtype(hidden));
  const int64_t H = hidden.size(1);
  PK_CHECK(H % LINEAR_LOGP_HIDDEN_ALIGN == 0, "linear_logp: hidden size H = ", H, " must be a multiple of ",
           LINEAR_LOGP_HIDDEN_ALIGN, " on CUDA (16-byte rows for TMA)");
  for (const auto* t : {&hidden, &weight}) {
    const char* name = t == &hidden ? "hidden" : "weight";
    PK_CHECK(t->size(0) <= 1 || t->stride(0) % LINEAR_LOGP_HIDDEN_ALIGN == 0, "linear_logp: ", name,
             " row stride must be a multiple of ", LINEAR_LOGP_HIDDEN_ALIGN, " elements on CUDA, got ", t->stride(0));
    PK_CHECK(t->stride(1) == 1, "linear_logp: ", name, " last dim must have stride 1 on CUDA, got ", t->stride(1));
    PK_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % LINEAR_LOGP_PTR_ALIGN_BYTES == 0, "linear_logp: ", name,
             " data pointer must be ", LINEAR_LOGP_PTR_ALIGN_BYTES, "-byte aligned on CUDA");
  }
}

}  // namespace linear_logp_detail

namespace {

using linear_logp_detail::check_backward_args;
using linear_logp_detail::check_forward_args;
using linear_logp_detail::ScalarType;
using linear_logp_detail::Tensor;
namespace pks = prime_kernels::stable;
using fused_logp_cpu::label_at;
using fused_logp_cpu::LogitTransform;

constexpr int64_t kBlockV = LINEAR_LOGP_CPU_BLOCK_V;

struct Inputs {
  Tensor h, w, b, labels, tt;  // fp32 contiguous copies (bias may be undefined)
  int64_t N, H, V;
  double temperature;
  LogitTransform transform{std::nullopt, 1.0};
  double T(int64_t i) const {
    return temperature * (tt.defined() ? static_cast<double>(tt.const_data_ptr<float>()[i]) : 1.0);
  }
};

Inputs prepare(const Tensor& hidden, const Tensor& weight, const Tensor& labels, double temperature,
               const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias,
               const std::optional<double>& softcap, double logit_scale) {
  Inputs in;
  in.transform = LogitTransform(softcap, logit_scale);
  in.h = pks::contiguous(pks::to(hidden, ScalarType::Float));
  in.w = pks::contiguous(pks::to(weight, ScalarType::Float));
  if (bias.has_value()) in.b = pks::contiguous(pks::to(*bias, ScalarType::Float));
  in.labels = pks::contiguous(labels);
  if (token_temperature.has_value()) in.tt = pks::contiguous(*token_temperature);
  in.N = hidden.size(0);
  in.H = hidden.size(1);
  in.V = weight.size(0);
  in.temperature = temperature;
  return in;
}

void check_token_temperatures(const Inputs& in, int64_t ignore_index) {
  if (in.tt.defined()) fused_logp_cpu::check_token_temperatures("linear_logp", in.labels, in.tt.const_data_ptr<float>(),
                                                                ignore_index);
}

// z[j - j0] for j in [j0, j1) of token i, in double; slope (nullable): the transform's derivative at each logit.
void logits_block(const Inputs& in, int64_t i, int64_t j0, int64_t j1, double invT, double* z,
                  double* slope = nullptr) {
  const float* h = in.h.const_data_ptr<float>() + i * in.H;
  const float* w = in.w.const_data_ptr<float>();
  const float* b = in.b.defined() ? in.b.const_data_ptr<float>() : nullptr;
  for (int64_t j = j0; j < j1; ++j) {
    const float* wr = w + j * in.H;
    double acc = 0.0;
    for (int64_t k = 0; k < in.H; ++k) acc += static_cast<double>(h[k]) * static_cast<double>(wr[k]);
    if (b) acc += b[j];
    if (slope) slope[j - j0] = in.transform.slope(acc);
    z[j - j0] = in.transform.value(acc) * invT;
  }
}

std::tuple<Tensor, Tensor, Tensor> linear_logp_entropy_cpu(
    const Tensor& hidden, const Tensor& weight, const Tensor& labels, double temperature,
    const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias, int64_t ignore_index,
    bool return_entropy, bool /*batch_invariant: the CPU path always is*/, std::optional<double> softcap,
    double logit_scale) {
  check_forward_args(hidden, weight, labels, temperature, token_temperature, bias);
  fused_logp_cpu::check_logit_transform("linear_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("linear_logp", temperature, softcap, logit_scale);
  const Inputs in = prepare(hidden, weight, labels, temperature, token_temperature, bias, softcap, logit_scale);
  const int64_t N = in.N, V = in.V;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t y = label_at(in.labels, i);
    PK_CHECK(y == ignore_index || (y >= 0 && y < V), "linear_logp: labels[", i, "] = ", y,
                " is out of range: labels must be in [0, ", V, ") or equal ignore_index (", ignore_index, ")");
  }
  check_token_temperatures(in, ignore_index);
  Tensor logp = pks::empty(hidden, {N}, ScalarType::Float);
  Tensor entropy = pks::empty(hidden, {return_entropy ? N : 0}, ScalarType::Float);
  Tensor stats = pks::empty(hidden, {N, 2}, ScalarType::Double);
  float* lp = logp.mutable_data_ptr<float>();
  float* ep = return_entropy ? entropy.mutable_data_ptr<float>() : nullptr;
  double* sp = stats.mutable_data_ptr<double>();
  torch::stable::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> z(kBlockV);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t y = label_at(in.labels, i);
      if (y == ignore_index) {
        lp[i] = 0.f;
        if (ep) ep[i] = 0.f;
        sp[2 * i] = sp[2 * i + 1] = 0.0;
        continue;
      }
      const double invT = 1.0 / in.T(i);
      // online over vocab blocks: m = running max, s = sum exp(z - m), u = sum exp(z - m) (z - m)
      double m = -std::numeric_limits<double>::infinity(), s = 0.0, u = 0.0, zy = 0.0;
      for (int64_t j0 = 0; j0 < V; j0 += kBlockV) {
        const int64_t j1 = std::min(V, j0 + kBlockV);
        logits_block(in, i, j0, j1, invT, z.data());
        double bm = m;
        for (int64_t j = j0; j < j1; ++j) bm = std::max(bm, z[j - j0]);
        if (y >= j0 && y < j1) zy = z[y - j0];
        if (bm == -std::numeric_limits<double>::infinity()) continue;
        if (s > 0.0) {
          const double d = m - bm, a = std::exp(d);
          u = a * (u + d * s);
          s *= a;
        }
        m = bm;
        for (int64_t j = j0; j < j1; ++j) {
          const double x = z[j - j0] - m;
          const double e = std::exp(x);
          s += e;
          if (e > 0.0) u += e * x;
        }
      }
      const double lse = m + std::log(s);
      const double mean = u / s;
      lp[i] = static_cast<float>(zy - lse);
      if (ep) ep[i] = static_cast<float>(std::log(s) - mean);
      sp[2 * i] = lse;
      sp[2 * i + 1] = m + mean;
    }
  });
  return {logp, entropy, stats};
}

std::tuple<Tensor, Tensor, Tensor> linear_logp_entropy_backward_cpu(
    const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& hidden,
    const Tensor& weight, const Tensor& labels, double temperature,
    const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias, const Tensor& stats,
    int64_t ignore_index, const std::vector<bool>& output_mask, bool grad_weight_fp32,
    bool /*batch_invariant: the CPU path always is*/, std::optional<double> softcap, double logit_scale) {
  check_backward_args(grad_logp, grad_entropy, hidden, weight, labels, temperature, token_temperature, bias, stats);
  fused_logp_cpu::check_logit_transform("linear_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("linear_logp", temperature, softcap, logit_scale);
  const Inputs in = prepare(hidden, weight, labels, temperature, token_temperature, bias, softcap, logit_scale);
  const int64_t N = in.N, H = in.H, V = in.V;
  check_token_temperatures(in, ignore_index);
  const bool need_h = output_mask[0], need_w = output_mask[1], need_b = output_mask[2] && bias.has_value();
  const auto dtype = hidden.scalar_type();
  const Tensor glp = pks::contiguous(pks::to(grad_logp, ScalarType::Double));
  const Tensor ge = grad_entropy.has_value() ? pks::contiguous(pks::to(*grad_entropy, ScalarType::Double)) : Tensor();
  const Tensor st = pks::contiguous(stats);
  const double* gp = glp.const_data_ptr<double>();
  const double* gep = ge.defined() ? ge.const_data_ptr<double>() : nullptr;
  const double* sp = st.const_data_ptr<double>();
  const float* h = in.h.const_data_ptr<float>();
  const float* w = in.w.const_data_ptr<float>();

  Tensor gh = pks::empty(hidden, {need_h ? N : 0, need_h ? H : 0}, ScalarType::Double);
  Tensor gw = pks::empty(hidden, {need_w ? V : 0, need_w ? H : 0}, ScalarType::Double);
  Tensor gb = pks::empty(hidden, {need_b ? V : 0}, ScalarType::Double);
  double* ghp = gh.mutable_data_ptr<double>();
  std::fill(ghp, ghp + gh.numel(), 0.0);
  std::vector<double> dz(N * kBlockV), slopes(N * kBlockV);
  if (need_h || need_w || need_b) {
    for (int64_t j0 = 0; j0 < V; j0 += kBlockV) {
      const int64_t j1 = std::min(V, j0 + kBlockV), nb = j1 - j0;
      // dZ block [N, nb]
      torch::stable::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          double* d = dz.data() + i * kBlockV;
          const int64_t y = label_at(in.labels, i);
          if (y == ignore_index) {
            std::fill(d, d + nb, 0.0);
            continue;
          }
          const double T = in.T(i);
          double* slope = slopes.data() + i * kBlockV;
          logits_block(in, i, j0, j1, 1.0 / T, d, slope);
          const double lse = sp[2 * i], spz = sp[2 * i + 1];
          const double k1 = gp[i] / T, k2 = gep ? gep[i] / T : 0.0;
          for (int64_t j = j0; j < j1; ++j) {
            const double z = d[j - j0];
            const double p = std::exp(z - lse);
            double g = (p == 0.0) ? 0.0 : -p * (k1 + k2 * (z - spz));  // never p * (log p + H)
            if (j == y) g += k1;
            d[j - j0] = g * slope[j - j0];
          }
        }
      });
      if (need_h) {
        torch::stable::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            double* out = ghp + i * H;
            for (int64_t j = 0; j < nb; ++j) {
              const double g = dz[i * kBlockV + j];
              if (g == 0.0) continue;
              const float* wr = w + (j0 + j) * H;
              for (int64_t k = 0; k < H; ++k) out[k] += g * wr[k];
            }
          }
        });
      }
      if (need_w || need_b) {
        double* gwp = need_w ? gw.mutable_data_ptr<double>() : nullptr;
        double* gbp = need_b ? gb.mutable_data_ptr<double>() : nullptr;
        torch::stable::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
          std::vector<double> row(H);
          for (int64_t j = begin; j < end; ++j) {
            std::fill(row.begin(), row.end(), 0.0);
            double sb = 0.0;
            for (int64_t i = 0; i < N; ++i) {
              const double g = dz[i * kBlockV + j];
              sb += g;
              if (!gwp || g == 0.0) continue;
              const float* hr = h + i * H;
              for (int64_t k = 0; k < H; ++k) row[k] += g * hr[k];
            }
            if (gwp) std::copy(row.begin(), row.end(), gwp + (j0 + j) * H);
            if (gbp) gbp[j0 + j] = sb;
          }
        });
      }
    }
  }
  // hidden's dtype is never float64, so pks::to copies: no result aliases these float64 buffers.
  Tensor grad_h = need_h ? pks::to(gh, dtype) : pks::empty(hidden, {0}, dtype);
  Tensor grad_w = need_w ? pks::to(gw, grad_weight_fp32 ? ScalarType::Float : dtype) : pks::empty(hidden, {0}, dtype);
  Tensor grad_b = need_b ? pks::to(gb, bias->scalar_type()) : pks::empty(hidden, {0}, dtype);
  return {grad_h, grad_w, grad_b};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(fused_logp, m) {
  m.def(
      "linear_logp_entropy(Tensor hidden, Tensor weight, Tensor labels, float temperature, Tensor? token_temperature, "
      "Tensor? bias, int ignore_index, bool return_entropy, bool batch_invariant=False, float? softcap=None, "
      "float logit_scale=1.0) -> (Tensor logp, Tensor entropy, Tensor stats)");
  m.def(
      "linear_logp_entropy_backward(Tensor grad_logp, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor labels, float temperature, Tensor? token_temperature, Tensor? bias, Tensor stats, int ignore_index, "
      "bool[3] output_mask, bool grad_weight_fp32, bool batch_invariant=False, float? softcap=None, "
      "float logit_scale=1.0) -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

STABLE_TORCH_LIBRARY_IMPL(fused_logp, CPU, m) {
  m.impl("linear_logp_entropy", TORCH_BOX(&linear_logp_entropy_cpu));
  m.impl("linear_logp_entropy_backward", TORCH_BOX(&linear_logp_entropy_backward_cpu));
}
