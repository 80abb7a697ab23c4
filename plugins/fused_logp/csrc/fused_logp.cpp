// fused_logp: per-token log-probability of the label and entropy of softmax(logits / T), forward and backward.
//
// Op schemas (namespace fused_logp) and the CPU implementations. The CUDA implementations live in
// cuda/fused_logp.cu and share the argument checks defined here (fused_logp_detail::check_*).
//
//   logp_entropy(Tensor logits, Tensor labels, float temperature, Tensor? token_temperature, int ignore_index,
//                bool return_entropy, bool check_labels, bool batch_invariant=False, float? softcap=None,
//                float logit_scale=1.0) -> (Tensor logp, Tensor entropy, Tensor stats)
//     logits [N, V] (fp32/bf16/fp16, last dim stride 1, any row stride), labels [N] (int64/int32),
//     token_temperature None or fp32 [N]; the temperature of token i is temperature * token_temperature[i].
//     token_temperature[i] of a token that is not ignored must be finite and > 0: on CPU an error naming the first
//     offending position; on CUDA that token gets NaN like an out-of-range label (and check_labels raises for it).
//     z = g(logits) / T;  logp = z_y - logsumexp(z);  entropy = logsumexp(z) - sum softmax(z) * z, with the logit
//     transform g(x) = softcap * tanh(logit_scale * x / softcap) (Gemma's final_logit_softcapping after Cohere's
//     logit_scale), or logit_scale * x when softcap is None (g(x) = x by default). softcap and logit_scale: positive
//     normal float32 values (cpu_common.h, check_logit_transform).
//     logp fp32 [N]; entropy fp32 [N] (shape [0] when return_entropy is false);
//     stats float64 [N, 2] = (logsumexp(z), sum softmax(z) * z) per token, saved for the backward (the second column
//     is 0 when return_entropy is false: the backward then takes no grad_entropy).
//     Tokens with label == ignore_index: logp 0, entropy 0 (stats 0).
//     A label outside [0, V) that is not ignore_index is an error naming the first offending position. On CUDA the
//     kernel writes NaN for such a token, never reads out of bounds, and records the smallest offending position in
//     a device word; with check_labels the op reads that word back (a 8-byte device->host copy, i.e. a sync) and
//     raises. check_labels=false skips the read-back (no sync: CUDA-graph capture, no-sync training loops) and
//     leaves NaN in the outputs of such tokens. On CPU labels are always checked.
//     batch_invariant: every token's outputs (and stats) are bitwise identical whatever the other rows, their number
//     and the row's address. The CPU implementation always is (one sequential double pass per row); CUDA then runs
//     one block per row (no split-vocab) and groups a row's elements from its first element even when the row is not
//     16-byte aligned.
//
//   logp_entropy_backward(Tensor grad_logp, Tensor? grad_entropy, Tensor logits, Tensor labels, float temperature,
//                         Tensor? token_temperature, Tensor stats, int ignore_index, bool batch_invariant=False,
//                         float? softcap=None, float logit_scale=1.0) -> Tensor grad_logits
//     batch_invariant: a row's gradient the same whatever the row's address (CUDA): the default's per-vector rule
//     (the vector holding a dominant logit redone accurately) with unaligned logits rows gathered into the aligned
//     layout when V * element size is a multiple of 16 bytes, else each element one function of its logit and the
//     row's stats (1.1x the default's forward+backward on the H200).
//     grad_logits [N, V] contiguous, logits' dtype:
//       p = exp(z - lse);  grad = (g_logp * (onehot(y) - p) - g_ent * p * (z - sum_pz)) * g'(logits) / T
//     zero for ignored tokens. Reads logits once, writes the gradient once; never writes logits.
//
// Host code on the LibTorch stable ABI (kernel.toml: stable_abi), so that one build runs under every torch from its
// floor on: torch/csrc/stable and torch/headeronly only (a non-stable header is a compile error in this build).
#include <prime_kernels/stable.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/Dispatch_v2.h>

#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "cpu_common.h"

#ifndef FUSED_LOGP_MAX_VOCAB_SIZE
#error "FUSED_LOGP_MAX_VOCAB_SIZE must come from kernel.toml ([fused_logp.constants])"
#endif
#ifndef FUSED_LOGP_MAX_NUM_TOKENS
#error "FUSED_LOGP_MAX_NUM_TOKENS must come from kernel.toml ([fused_logp.constants])"
#endif

namespace fused_logp_detail {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
namespace pks = prime_kernels::stable;

using fused_logp_cpu::is_floating;

// Checks shared by the CPU and CUDA forward. Returns nothing; every failure names the argument, expected and found.
void check_forward_args(const Tensor& logits, const Tensor& labels, double temperature,
                        const std::optional<Tensor>& token_temperature) {
  pks::require_defined(logits, "fused_logp", "logits");
  pks::require_defined(labels, "fused_logp", "labels");
  PK_CHECK(logits.dim() == 2, "fused_logp: logits must be 2-D [N, V], got ", logits.dim(), "-D with shape ",
           pks::shape(logits));
  const auto st = pks::scalar_type(logits);
  PK_CHECK(st == ScalarType::Float || st == ScalarType::BFloat16 || st == ScalarType::Half,
           "fused_logp: logits dtype must be float32, bfloat16 or float16, got ", pks::dtype(logits));
  const int64_t N = logits.size(0), V = logits.size(1);
  PK_CHECK(V >= 1, "fused_logp: logits vocab size (last dim) must be >= 1, got ", V);
  PK_CHECK(V <= int64_t(FUSED_LOGP_MAX_VOCAB_SIZE), "fused_logp: logits vocab size must be <= ",
           int64_t(FUSED_LOGP_MAX_VOCAB_SIZE), ", got ", V);
  PK_CHECK(N <= int64_t(FUSED_LOGP_MAX_NUM_TOKENS), "fused_logp: number of tokens must be <= ",
           int64_t(FUSED_LOGP_MAX_NUM_TOKENS), ", got ", N);
  PK_CHECK(V == 1 || logits.stride(1) == 1, "fused_logp: logits last dim must have stride 1, got stride ",
           logits.stride(1));
  PK_CHECK(labels.dim() == 1, "fused_logp: labels must be 1-D [N], got ", labels.dim(), "-D with shape ",
           pks::shape(labels));
  PK_CHECK(pks::scalar_type(labels) == ScalarType::Long || pks::scalar_type(labels) == ScalarType::Int,
           "fused_logp: labels dtype must be int64 or int32, got ", pks::dtype(labels));
  PK_CHECK(labels.size(0) == N, "fused_logp: labels must have N = ", N, " entries (logits rows), got ",
           labels.size(0));
  PK_CHECK(labels.device() == logits.device(), "fused_logp: labels must be on logits' device ", pks::device(logits),
           ", got ", pks::device(labels));
  PK_CHECK(std::isfinite(temperature) && temperature > 0.0, "fused_logp: temperature must be finite and > 0, got ",
           temperature);
  if (token_temperature.has_value()) {
    const auto& tt = *token_temperature;
    PK_CHECK(pks::scalar_type(tt) == ScalarType::Float, "fused_logp: token_temperature dtype must be float32, got ",
             pks::dtype(tt));
    PK_CHECK(tt.dim() == 1 && tt.size(0) == N, "fused_logp: token_temperature must have shape [", N,
             "] (one per token), got ", pks::shape(tt));
    PK_CHECK(tt.device() == logits.device(), "fused_logp: token_temperature must be on logits' device ",
             pks::device(logits), ", got ", pks::device(tt));
  }
}

void check_backward_args(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                         const Tensor& logits, const Tensor& labels, double temperature,
                         const std::optional<Tensor>& token_temperature, const Tensor& stats) {
  check_forward_args(logits, labels, temperature, token_temperature);
  pks::require_defined(grad_logp, "fused_logp", "grad_logp");
  pks::require_defined(stats, "fused_logp", "stats");
  const int64_t N = logits.size(0);
  PK_CHECK(grad_logp.dim() == 1 && grad_logp.size(0) == N, "fused_logp: grad_logp must have shape [", N,
           "], got ", pks::shape(grad_logp));
  PK_CHECK(is_floating(pks::scalar_type(grad_logp)), "fused_logp: grad_logp must be floating point, got ",
           pks::dtype(grad_logp));
  PK_CHECK(grad_logp.device() == logits.device(), "fused_logp: grad_logp must be on logits' device ",
           pks::device(logits), ", got ", pks::device(grad_logp));
  if (grad_entropy.has_value()) {
    const auto& ge = *grad_entropy;
    PK_CHECK(ge.dim() == 1 && ge.size(0) == N, "fused_logp: grad_entropy must have shape [", N, "], got ",
             pks::shape(ge));
    PK_CHECK(is_floating(pks::scalar_type(ge)), "fused_logp: grad_entropy must be floating point, got ", pks::dtype(ge));
    PK_CHECK(ge.device() == logits.device(), "fused_logp: grad_entropy must be on logits' device ",
             pks::device(logits), ", got ", pks::device(ge));
  }
  PK_CHECK(pks::scalar_type(stats) == ScalarType::Double, "fused_logp: stats must be float64 (from logp_entropy), got ",
           pks::dtype(stats));
  PK_CHECK(stats.dim() == 2 && stats.size(0) == N && stats.size(1) == 2, "fused_logp: stats must have shape [",
           N, ", 2], got ", pks::shape(stats));
  PK_CHECK(stats.device() == logits.device(), "fused_logp: stats must be on logits' device ", pks::device(logits),
           ", got ", pks::device(stats));
}

[[noreturn]] void fail_bad_label(int64_t position, int64_t value, int64_t V, int64_t ignore_index) {
  pks::fail("fused_logp: labels[", position, "] = ", value, " is out of range: labels must be in [0, ", V,
              ") or equal ignore_index (", ignore_index, ")");
}

[[noreturn]] void fail_bad_token_temperature(int64_t position, float value) {
  fused_logp_cpu::fail_bad_token_temperature("fused_logp", position, value);
}

}  // namespace fused_logp_detail

namespace {

using fused_logp_cpu::check_token_temperatures;
using fused_logp_cpu::label_at;

using fused_logp_detail::check_backward_args;
using fused_logp_detail::check_forward_args;
using fused_logp_detail::ScalarType;
using fused_logp_detail::Tensor;
namespace pks = prime_kernels::stable;

template <typename label_t>
int64_t first_bad_label(const label_t* lab, int64_t N, int64_t V, int64_t ignore_index) {
  for (int64_t i = 0; i < N; ++i) {
    const int64_t y = static_cast<int64_t>(lab[i]);
    if (y != ignore_index && (y < 0 || y >= V)) return i;
  }
  return -1;
}

int64_t cpu_check_labels(const Tensor& labels, int64_t V, int64_t ignore_index) {
  const int64_t N = labels.size(0);
  int64_t bad = -1;
  if (labels.scalar_type() == ScalarType::Long)
    bad = first_bad_label(labels.const_data_ptr<int64_t>(), N, V, ignore_index);
  else
    bad = first_bad_label(labels.const_data_ptr<int32_t>(), N, V, ignore_index);
  return bad;
}

// double -> logits' dtype with one correct rounding: for bf16/fp16 round to odd in float first (float has more than
// two extra bits), so the second rounding cannot double-round.
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

template <typename scalar_t>
inline scalar_t round_from_double(double d) {
  float f = static_cast<float>(d);
  if constexpr (!std::is_same_v<scalar_t, float>) {
    if (static_cast<double>(f) != d && std::isfinite(f) && (float_bits(f) & 1u) == 0)
      f = std::nextafter(f, static_cast<float>(d > static_cast<double>(f) ? INFINITY : -INFINITY));
  }
  return static_cast<scalar_t>(f);
}

std::tuple<Tensor, Tensor, Tensor> logp_entropy_cpu(const Tensor& logits_in, const Tensor& labels_in,
                                                    double temperature, const std::optional<Tensor>& token_temperature,
                                                                int64_t ignore_index, bool return_entropy,
                                                                bool /*check_labels: always checked on CPU*/,
                                                                bool /*batch_invariant: the CPU path always is*/,
                                                                std::optional<double> softcap, double logit_scale) {
  check_forward_args(logits_in, labels_in, temperature, token_temperature);
  fused_logp_cpu::check_logit_transform("fused_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("fused_logp", temperature, softcap, logit_scale);
  const fused_logp_cpu::LogitTransform g(softcap, logit_scale);
  PK_CHECK(logits_in.is_cpu(), "fused_logp: CPU implementation got logits on ", pks::device(logits_in));
  const int64_t N = logits_in.size(0), V = logits_in.size(1);
  const Tensor labels = pks::contiguous(labels_in);
  const int64_t bad = cpu_check_labels(labels, V, ignore_index);
  if (bad >= 0) fused_logp_detail::fail_bad_label(bad, label_at(labels, bad), V, ignore_index);

  Tensor logp = pks::empty(logits_in, {N}, ScalarType::Float);
  Tensor entropy = pks::empty(logits_in, {return_entropy ? N : 0}, ScalarType::Float);
  Tensor stats = pks::empty(logits_in, {N, 2}, ScalarType::Double);
  if (N == 0) return {logp, entropy, stats};

  const Tensor logits = V == 1 ? pks::contiguous(logits_in) : logits_in;  // V == 1 may come with any stride
  Tensor tt;
  if (token_temperature.has_value()) tt = pks::contiguous(*token_temperature);
  const float* ttp = tt.defined() ? tt.const_data_ptr<float>() : nullptr;
  if (ttp) check_token_temperatures("fused_logp", labels, ttp, ignore_index);
  float* lp = logp.mutable_data_ptr<float>();
  float* ep = return_entropy ? entropy.mutable_data_ptr<float>() : nullptr;
  double* sp = stats.mutable_data_ptr<double>();
  const int64_t rs = logits.stride(0);
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();

  THO_DISPATCH_V2(logits.scalar_type(), "fused_logp_forward_cpu", AT_WRAP([&] {
    const scalar_t* x0 = logits.const_data_ptr<scalar_t>();
    torch::stable::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t y = label_at(labels, i);
        if (y == ignore_index) {
          lp[i] = 0.f;
          if (ep) ep[i] = 0.f;
          sp[2 * i] = 0.0;
          sp[2 * i + 1] = 0.0;
          continue;
        }
        const double T = temperature * (ttp ? static_cast<double>(ttp[i]) : 1.0);
        const scalar_t* x = x0 + i * rs;
        // Max of z (NaN-propagating), then s = sum exp(z - m), t = sum exp(z - m) (z - m), all in double.
        double m = -inf;
        bool has_nan = false;
        for (int64_t j = 0; j < V; ++j) {
          const double z = g.value(static_cast<float>(x[j]));
          if (std::isnan(z)) has_nan = true;
          if (z > m) m = z;
        }
        double lse, spz;
        if (has_nan) {
          lse = spz = nan;
        } else if (m == -inf) {  // every logit is -inf: softmax undefined
          lse = -inf;
          spz = nan;
        } else if (m == inf) {
          lse = spz = nan;
        } else {
          double s = 0.0, t = 0.0;
          for (int64_t j = 0; j < V; ++j) {
            const double d = (g.value(static_cast<float>(x[j])) - m) / T;
            const double e = std::exp(d);
            if (e != 0.0) {
              s += e;
              t += e * d;
            }
          }
          lse = m / T + std::log(s);
          spz = m / T + t / s;
        }
        const double zy = g.value(static_cast<float>(x[y])) / T;
        lp[i] = static_cast<float>(zy - lse);
        if (ep) ep[i] = static_cast<float>(lse - spz);
        sp[2 * i] = lse;
        sp[2 * i + 1] = ep ? spz : 0.0;  // like CUDA, which tracks sum p*z only when entropy is requested
      }
    });
  }), AT_EXPAND(AT_FLOATING_TYPES), ScalarType::BFloat16, ScalarType::Half);
  return {logp, entropy, stats};
}

Tensor logp_entropy_backward_cpu(const Tensor& grad_logp_in, const std::optional<Tensor>& grad_entropy_in,
                                 const Tensor& logits_in, const Tensor& labels_in, double temperature,
                                 const std::optional<Tensor>& token_temperature, const Tensor& stats_in,
                                 int64_t ignore_index, bool /*batch_invariant: the CPU backward is elementwise*/,
                                 std::optional<double> softcap, double logit_scale) {
  check_backward_args(grad_logp_in, grad_entropy_in, logits_in, labels_in, temperature, token_temperature, stats_in);
  fused_logp_cpu::check_logit_transform("fused_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("fused_logp", temperature, softcap, logit_scale);
  const fused_logp_cpu::LogitTransform tf(softcap, logit_scale);
  PK_CHECK(logits_in.is_cpu(), "fused_logp: CPU implementation got logits on ", pks::device(logits_in));
  const int64_t N = logits_in.size(0), V = logits_in.size(1);
  Tensor grad = pks::empty(logits_in, {N, V}, logits_in.scalar_type());
  if (N == 0) return grad;
  const Tensor labels = pks::contiguous(labels_in);
  const int64_t bad = cpu_check_labels(labels, V, ignore_index);
  if (bad >= 0) fused_logp_detail::fail_bad_label(bad, label_at(labels, bad), V, ignore_index);
  const Tensor logits = V == 1 ? pks::contiguous(logits_in) : logits_in;
  const Tensor g = pks::contiguous(pks::to(grad_logp_in, ScalarType::Double));
  Tensor ge;
  if (grad_entropy_in.has_value()) ge = pks::contiguous(pks::to(*grad_entropy_in, ScalarType::Double));
  const Tensor stats = pks::contiguous(stats_in);
  Tensor tt;
  if (token_temperature.has_value()) tt = pks::contiguous(*token_temperature);
  const float* ttp = tt.defined() ? tt.const_data_ptr<float>() : nullptr;
  if (ttp) check_token_temperatures("fused_logp", labels, ttp, ignore_index);
  const double* gp = g.const_data_ptr<double>();
  const double* gep = ge.defined() ? ge.const_data_ptr<double>() : nullptr;
  const double* sp = stats.const_data_ptr<double>();
  const int64_t rs = logits.stride(0);

  THO_DISPATCH_V2(logits.scalar_type(), "fused_logp_backward_cpu", AT_WRAP([&] {
    const scalar_t* x0 = logits.const_data_ptr<scalar_t>();
    scalar_t* g0 = grad.mutable_data_ptr<scalar_t>();
    torch::stable::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* gr = g0 + i * V;
        const int64_t y = label_at(labels, i);
        if (y == ignore_index) {
          for (int64_t j = 0; j < V; ++j) gr[j] = scalar_t(0.f);
          continue;
        }
        const scalar_t* x = x0 + i * rs;
        const double T = temperature * (ttp ? static_cast<double>(ttp[i]) : 1.0);
        const double lse = sp[2 * i], spz = sp[2 * i + 1];
        const double k1 = gp[i] / T;
        const double k2 = gep ? gep[i] / T : 0.0;
        for (int64_t j = 0; j < V; ++j) {
          const double xj = static_cast<float>(x[j]);
          const double z = tf.value(xj) / T;
          const double p = std::exp(z - lse);
          // Entropy term as p * (z - sum_pz): exactly 0 where p == 0 (z = -inf), never p * (log p + H).
          const double ent = (gep == nullptr || p == 0.0) ? 0.0 : k2 * p * (z - spz);
          double gv = -k1 * p - ent;
          if (j == y) gv += k1;
          gr[j] = round_from_double<scalar_t>(gv * tf.slope(xj));
        }
      }
    });
  }), AT_EXPAND(AT_FLOATING_TYPES), ScalarType::BFloat16, ScalarType::Half);
  return grad;
}

}  // namespace

STABLE_TORCH_LIBRARY(fused_logp, m) {
  m.def(
      "logp_entropy(Tensor logits, Tensor labels, float temperature, Tensor? token_temperature, int ignore_index, "
      "bool return_entropy, bool check_labels, bool batch_invariant=False, float? softcap=None, "
      "float logit_scale=1.0) -> (Tensor logp, Tensor entropy, Tensor stats)");
  m.def(
      "logp_entropy_backward(Tensor grad_logp, Tensor? grad_entropy, Tensor logits, Tensor labels, float temperature, "
      "Tensor? token_temperature, Tensor stats, int ignore_index, bool batch_invariant=False, float? softcap=None, "
      "float logit_scale=1.0) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(fused_logp, CPU, m) {
  m.impl("logp_entropy", TORCH_BOX(&logp_entropy_cpu));
  m.impl("logp_entropy_backward", TORCH_BOX(&logp_entropy_backward_cpu));
}
