// linear_logp forward on CUDA (sm_90a): the fused GEMM + online logsumexp/entropy kernel (linear_logp.cuh,
// BWD = false) over (token tile x vocab split), then linear_logp_combine merging the per-split partials.
// Host code on the LibTorch stable ABI, as csrc/linear_logp.cpp.
#include <prime_kernels/stable.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>

#include "../cpu_common.h"
#include "linear_logp.cuh"

namespace linear_logp_detail {
using torch::stable::Tensor;
void check_forward_args(const Tensor& hidden, const Tensor& weight, const Tensor& labels, double temperature,
                        const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias);
void check_cuda_contract(const Tensor& hidden, const Tensor& weight);
}  // namespace linear_logp_detail

namespace linear_logp {

// Merge the S per-split partials of each row (in split order: deterministic) into logp, entropy and stats.
__global__ void linear_logp_combine(Params p, int N, float* logp, float* entropy, double* stats) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const int64_t y = p.labels[i];
  if (y == p.ignore_index) {
    logp[i] = 0.f;
    if (entropy) entropy[i] = 0.f;
    stats[2 * i] = 0.0;
    stats[2 * i + 1] = 0.0;
    return;
  }
  float m = -INFINITY, s = 0.f, u = 0.f;
  for (int k = 0; k < p.splits; ++k) {
    const int64_t idx = static_cast<int64_t>(k) * N + i;
    merge_state(m, s, u, p.part_m[idx], p.part_s[idx], p.part_u[idx]);
  }
  const float log2s = log2f(s);
  const float lse2 = m + log2s;
  const float mean_dev = u / s;  // sum p (z - m), log2 units
  const float temp = p.temperature * (p.token_temperature ? p.token_temperature[i] : 1.f);  // as the kernel forms it
  const bool bad_temperature = !(temp > 0.f && temp < INFINITY);  // a per-token temperature of 0, < 0, inf or NaN
  const bool bad = bad_temperature || y < 0 || y >= p.vocab;
  logp[i] = bad ? NAN : ((p.zy[i] - m) - log2s) * LN2;
  if (entropy) entropy[i] = bad ? NAN : (log2s - mean_dev) * LN2;
  // NaN stats make that token's gradients NaN as well; a bad label keeps them: the vocabulary-parallel backward
  // passes labels outside [0, V) on purpose.
  stats[2 * i] = bad_temperature ? NAN : static_cast<double>(lse2) * kLn2D;
  stats[2 * i + 1] = bad_temperature ? NAN : static_cast<double>(m + mean_dev) * kLn2D;
}

}  // namespace linear_logp

namespace {

using linear_logp_detail::Tensor;
using torch::headeronly::ScalarType;
namespace pks = prime_kernels::stable;

std::tuple<Tensor, Tensor, Tensor> linear_logp_entropy_cuda(
    const Tensor& hidden, const Tensor& weight, const Tensor& labels_in, double temperature,
    const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias, int64_t ignore_index,
    bool return_entropy, bool batch_invariant, std::optional<double> softcap, double logit_scale) {
  using namespace linear_logp;
  linear_logp_detail::check_forward_args(hidden, weight, labels_in, temperature, token_temperature, bias);
  fused_logp_cpu::check_logit_transform("linear_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("linear_logp", temperature, softcap, logit_scale);
  linear_logp_detail::check_cuda_contract(hidden, weight);
  PK_CHECK(hidden.is_cuda(), "linear_logp: CUDA implementation got hidden on ", pks::device(hidden));
  const int device = hidden.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  Tensor logp = pks::empty(hidden, {N}, ScalarType::Float);
  Tensor entropy = pks::empty(hidden, {return_entropy ? N : 0}, ScalarType::Float);
  Tensor stats = pks::empty(hidden, {N, 2}, ScalarType::Double);
  if (N == 0) return {logp, entropy, stats};

  const Tensor labels = pks::contiguous(pks::to(labels_in, ScalarType::Long));
  std::optional<Tensor> tt, b32;
  if (token_temperature.has_value()) tt = pks::contiguous(*token_temperature);
  if (bias.has_value()) b32 = pks::contiguous(pks::to(*bias, ScalarType::Float));

  const bool bf16 = hidden.scalar_type() == ScalarType::BFloat16;
  CUtensorMap tm_h, tm_w;
  PK_CHECK(make_tmap(&tm_h, hidden.data_ptr(), bf16, N, H, hidden.stride(0), BN) == 0,
           "linear_logp: cuTensorMapEncodeTiled failed for hidden");
  // weight boxes of half a vocab tile: a pair of CTAs loads one half each for both (linear_logp.cuh)
  PK_CHECK(make_tmap(&tm_w, weight.data_ptr(), bf16, V, H, weight.stride(0), BV / 2) == 0,
           "linear_logp: cuTensorMapEncodeTiled failed for weight");

  const int sms = pks::multiprocessor_count(device);
  Params p{};
  p.n_rows = static_cast<int>(N);
  p.row0 = 0;
  p.vocab = static_cast<int>(V);
  p.k_tiles = ceil_div(H, BK);
  p.vt_begin = 0;
  p.vt_end = ceil_div(V, BV);
  p.token_tiles = ceil_div(N, BN);
  // A row's logp depends on the split count (its partials are merged in split order): the batch-invariant forward
  // takes it from V alone; the default picks it from the number of token tiles to fill the GPU.
  p.tiles_per_split = batch_invariant ? invariant_tiles_per_split(p.vt_end, LINEAR_LOGP_MAX_SPLITS)
                                      : choose_tiles_per_split(p.token_tiles, p.vt_end, sms, LINEAR_LOGP_MAX_SPLITS);
  p.splits = ceil_div(p.vt_end, p.tiles_per_split);
  p.group = LINEAR_LOGP_GROUP_TOKEN_TILES;
  p.labels = labels.const_data_ptr<int64_t>();
  p.token_temperature = tt ? tt->const_data_ptr<float>() : nullptr;
  p.bias = b32 ? b32->const_data_ptr<float>() : nullptr;
  set_transform(p, temperature, softcap, logit_scale);
  p.ignore_index = ignore_index;
  // workspace: 3 partials per (split, row) + the label logit per row
  Tensor ws = pks::empty(hidden, {(3 * static_cast<int64_t>(p.splits) + 1) * N}, ScalarType::Float);
  float* w = ws.mutable_data_ptr<float>();
  p.part_m = w;
  p.part_s = w + p.splits * N;
  p.part_u = w + 2 * p.splits * N;
  p.zy = w + 3 * p.splits * N;

  const cudaStream_t stream = pks::current_cuda_stream(device);
  launch_for<false>(bf16, softcap.has_value(), tm_h, tm_w, p, stream);
  linear_logp_combine<<<ceil_div(N, 256), 256, 0, stream>>>(p, static_cast<int>(N), logp.mutable_data_ptr<float>(),
                                                            return_entropy ? entropy.mutable_data_ptr<float>() : nullptr,
                                                            stats.mutable_data_ptr<double>());
  STD_CUDA_KERNEL_LAUNCH_CHECK();
  return {logp, entropy, stats};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_logp, CUDA, m) { m.impl("linear_logp_entropy", TORCH_BOX(&linear_logp_entropy_cuda)); }
