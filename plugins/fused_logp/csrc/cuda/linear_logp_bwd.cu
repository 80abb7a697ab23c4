// linear_logp backward on CUDA (sm_90a). Per vocab chunk (and token chunk when N is very large) of at most
// LINEAR_LOGP_DZ_CHUNK_ELEMS logits: the fused kernel (linear_logp.cuh, BWD = true) recomputes the logits tiles
// from hidden and weight with wgmma and writes dZ = dL/d(hidden @ weight^T + bias) in the input dtype into one
// reused chunk buffer; cuBLAS then accumulates grad_hidden += dZ @ W_chunk (fp32 accumulator) and forms
// grad_weight[chunk] = dZ^T @ hidden (fp32 accumulate inside the GEMM; across token chunks in an fp32 buffer).
// No atomics: the result is deterministic for a given GPU and library version.
// batch_invariant: a row's grad_hidden must not depend on the other rows. dZ is elementwise; its accumulation over
// vocab chunks (fp32, in chunk order) needs chunk boundaries that do not depend on N, and cuBLAS may pick another
// kernel (tile shape, split-K, instruction) for another row count M, changing a row's summation order. So the
// invariant backward uses vocab chunks of INVARIANT_DZ_CHUNK_TILES tiles, token chunks of whole blocks, and runs the
// grad_hidden GEMM in blocks of exactly INVARIANT_GEMM_ROWS rows (the last block padded): every GEMM call of chunk c
// has the same shape, strides and dtypes whatever N, so cuBLAS runs the same kernel, whose output row depends only on
// its own dZ row. (Not covered: a kernel that splits K differently by tile position, e.g. stream-K.)
// Host code on the LibTorch stable ABI, as csrc/linear_logp.cpp; the GEMMs in linear_logp_gemm.h.
#include <prime_kernels/stable.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../cpu_common.h"
#include "linear_logp.cuh"
#include "linear_logp_gemm.h"

#ifndef LINEAR_LOGP_DZ_CHUNK_ELEMS
#error "LINEAR_LOGP_DZ_CHUNK_ELEMS must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_INVARIANT_DZ_CHUNK_TILES
#error "LINEAR_LOGP_INVARIANT_DZ_CHUNK_TILES must come from kernel.toml ([linear_logp.constants])"
#endif
#ifndef LINEAR_LOGP_INVARIANT_GEMM_ROWS
#error "LINEAR_LOGP_INVARIANT_GEMM_ROWS must come from kernel.toml ([linear_logp.constants])"
#endif

namespace linear_logp_detail {
using torch::stable::Tensor;
void check_backward_args(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& hidden,
                         const Tensor& weight, const Tensor& labels, double temperature,
                         const std::optional<Tensor>& token_temperature, const std::optional<Tensor>& bias,
                         const Tensor& stats);
void check_cuda_contract(const Tensor& hidden, const Tensor& weight);
}  // namespace linear_logp_detail

namespace {

using namespace linear_logp;
using linear_logp_detail::Tensor;
using linear_logp_gemm::addmm_f32;
using linear_logp_gemm::mm_out;
using torch::headeronly::ScalarType;
using torch::stable::narrow;
using torch::stable::transpose;
namespace pks = prime_kernels::stable;

// t.narrow(dim, start, length) of a tensor held const (torch 2.11's torch::stable::narrow takes a mutable reference).
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  Tensor view = t;
  return narrow(view, dim, start, length);
}

std::tuple<Tensor, Tensor, Tensor> linear_logp_entropy_backward_cuda(
    const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& hidden, const Tensor& weight,
    const Tensor& labels_in, double temperature, const std::optional<Tensor>& token_temperature,
    const std::optional<Tensor>& bias, const Tensor& stats_in, int64_t ignore_index,
    const std::vector<bool>& output_mask, bool grad_weight_fp32, bool batch_invariant, std::optional<double> softcap,
    double logit_scale) {
  linear_logp_detail::check_backward_args(grad_logp, grad_entropy, hidden, weight, labels_in, temperature,
                                          token_temperature, bias, stats_in);
  fused_logp_cpu::check_logit_transform("linear_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("linear_logp", temperature, softcap, logit_scale);
  linear_logp_detail::check_cuda_contract(hidden, weight);
  PK_CHECK(hidden.is_cuda(), "linear_logp: CUDA implementation got hidden on ", pks::device(hidden));
  const int device = hidden.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const bool need_h = output_mask[0], need_w = output_mask[1], need_b = output_mask[2] && bias.has_value();
  const auto dtype = hidden.scalar_type();
  constexpr auto f32 = ScalarType::Float;

  Tensor grad_w = need_w ? pks::empty(hidden, {V, H}, grad_weight_fp32 ? f32 : dtype) : pks::empty(hidden, {0}, dtype);
  // Invariant: grad_hidden's GEMMs run on whole blocks of GEMM_ROWS rows; the accumulator has the padded rows.
  const int64_t gemm_rows = LINEAR_LOGP_INVARIANT_GEMM_ROWS;
  static_assert(LINEAR_LOGP_INVARIANT_GEMM_ROWS % BN == 0, "INVARIANT_GEMM_ROWS: a multiple of BLOCK_N");
  const int64_t n_alloc = batch_invariant ? ceil_div(N, gemm_rows) * gemm_rows : N;
  Tensor gh32 = need_h ? torch::stable::new_zeros(hidden, {n_alloc, H}, f32) : Tensor();
  Tensor gb32 = need_b ? torch::stable::new_zeros(hidden, {V}, f32) : Tensor();
  auto finish = [&] {
    Tensor gh = need_h ? pks::to(slice(gh32, 0, 0, N), dtype) : pks::empty(hidden, {0}, dtype);
    Tensor gb = need_b ? pks::to(gb32, bias->scalar_type()) : pks::empty(hidden, {0}, dtype);
    return std::make_tuple(gh, grad_w, gb);
  };
  if (need_w && N == 0) torch::stable::zero_(grad_w);
  if (N == 0 || !(need_h || need_w || need_b)) return finish();

  const Tensor labels = pks::contiguous(pks::to(labels_in, ScalarType::Long));
  const Tensor stats = pks::contiguous(stats_in);
  const Tensor glp = pks::contiguous(pks::to(grad_logp, f32));
  std::optional<Tensor> gent, tt, b32;
  if (grad_entropy.has_value()) gent = pks::contiguous(pks::to(*grad_entropy, f32));
  if (token_temperature.has_value()) tt = pks::contiguous(*token_temperature);
  if (bias.has_value()) b32 = pks::contiguous(pks::to(*bias, f32));

  const bool bf16 = dtype == ScalarType::BFloat16;
  CUtensorMap tm_h, tm_w;
  PK_CHECK(make_tmap(&tm_h, hidden.data_ptr(), bf16, N, H, hidden.stride(0), BN) == 0,
           "linear_logp: cuTensorMapEncodeTiled failed for hidden");
  // weight boxes of half a vocab tile: a pair of CTAs loads one half each for both (linear_logp.cuh)
  PK_CHECK(make_tmap(&tm_w, weight.data_ptr(), bf16, V, H, weight.stride(0), BV / 2) == 0,
           "linear_logp: cuTensorMapEncodeTiled failed for weight");

  // Chunking: the dZ buffer holds at most DZ_CHUNK_ELEMS elements. Whole token range and as many vocab tiles as fit;
  // token chunks (multiples of BN) only when even one vocab tile of all tokens does not fit.
  // Invariant: INVARIANT_DZ_CHUNK_TILES vocab tiles per chunk and as many whole GEMM blocks of tokens as fit.
  const int64_t budget = LINEAR_LOGP_DZ_CHUNK_ELEMS;
  const int64_t vocab_tiles = ceil_div(V, BV);
  int64_t rows_per_chunk = N;
  int64_t tiles_per_chunk = std::max<int64_t>(1, budget / (N * BV));
  if (N * BV > budget) rows_per_chunk = std::max<int64_t>(BN, budget / BV / BN * BN);
  if (batch_invariant) {
    tiles_per_chunk = LINEAR_LOGP_INVARIANT_DZ_CHUNK_TILES;
    rows_per_chunk = std::max<int64_t>(gemm_rows, budget / (tiles_per_chunk * BV) / gemm_rows * gemm_rows);
  }
  tiles_per_chunk = std::min(tiles_per_chunk, vocab_tiles);
  const int64_t vc_max = tiles_per_chunk * BV;
  const int64_t dz_rows = std::min(rows_per_chunk, N);
  // the invariant GEMMs read whole blocks: rows past the chunk's tokens are zero (or an earlier chunk's dZ), and they
  // only reach the accumulator's padding rows
  const Tensor dz = batch_invariant
                        ? torch::stable::new_zeros(hidden, {ceil_div(dz_rows, gemm_rows) * gemm_rows, vc_max}, dtype)
                        : pks::empty(hidden, {dz_rows, vc_max}, dtype);
  const bool token_chunked = rows_per_chunk < N;
  const Tensor gw32 = (need_w && token_chunked && !grad_weight_fp32) ? pks::empty(hidden, {vc_max, H}, f32) : Tensor();

  const int sms = pks::multiprocessor_count(device);
  const cudaStream_t stream = pks::current_cuda_stream(device);
  Params p{};
  p.vocab = static_cast<int>(V);
  p.k_tiles = ceil_div(H, BK);
  p.group = LINEAR_LOGP_GROUP_TOKEN_TILES;
  p.labels = labels.const_data_ptr<int64_t>();
  p.token_temperature = tt ? tt->const_data_ptr<float>() : nullptr;
  p.bias = b32 ? b32->const_data_ptr<float>() : nullptr;
  set_transform(p, temperature, softcap, logit_scale);
  p.ignore_index = ignore_index;
  p.stats = stats.const_data_ptr<double>();
  p.grad_logp = glp.const_data_ptr<float>();
  p.grad_ent = gent ? gent->const_data_ptr<float>() : nullptr;
  p.dz = dz.mutable_data_ptr();
  p.ldz = vc_max;

  for (int64_t vt = 0; vt < vocab_tiles; vt += tiles_per_chunk) {
    const int64_t vt_end = std::min(vt + tiles_per_chunk, vocab_tiles);
    const int64_t v_start = vt * BV, vc = std::min(vt_end * BV, V) - v_start;
    const Tensor w_chunk = slice(weight, 0, v_start, vc);
    for (int64_t r0 = 0; r0 < N; r0 += rows_per_chunk) {
      const int64_t nr = std::min(rows_per_chunk, N - r0);
      p.row0 = static_cast<int>(r0);
      p.n_rows = static_cast<int>(nr);
      p.token_tiles = ceil_div(nr, BN);
      p.vt_begin = static_cast<int>(vt);
      p.vt_end = static_cast<int>(vt_end);
      p.tiles_per_split =
          choose_tiles_per_split(p.token_tiles, static_cast<int>(vt_end - vt), sms, LINEAR_LOGP_MAX_SPLITS);
      p.splits = ceil_div(vt_end - vt, p.tiles_per_split);
      launch_for<true>(bf16, softcap.has_value(), tm_h, tm_w, p, stream);

      const Tensor dzc = slice(slice(dz, 0, 0, nr), 1, 0, vc);
      const Tensor dzc_t = transpose(dzc, 0, 1);
      const Tensor h_rows = slice(hidden, 0, r0, nr);
      if (need_h && batch_invariant) {
        for (int64_t b0 = 0; b0 < nr; b0 += gemm_rows) {
          Tensor acc = slice(gh32, 0, r0 + b0, gemm_rows);
          addmm_f32(acc, slice(slice(dz, 0, b0, gemm_rows), 1, 0, vc), w_chunk, 1.f);
        }
      } else if (need_h) {
        Tensor acc = slice(gh32, 0, r0, nr);
        addmm_f32(acc, dzc, w_chunk, 1.f);
      }
      if (need_w) {
        Tensor target = slice(grad_w, 0, v_start, vc);
        if (!token_chunked) {
          mm_out(target, dzc_t, h_rows, grad_weight_fp32 ? std::optional<ScalarType>(f32) : std::nullopt);
        } else {
          Tensor acc = grad_weight_fp32 ? target : slice(gw32, 0, 0, vc);
          addmm_f32(acc, dzc_t, h_rows, r0 > 0 ? 1.f : 0.f);
        }
      }
      if (need_b) {
        // gb32[chunk] += column sums (aten::add_ takes a Scalar alpha, out of the stable dispatcher's reach:
        // subtract's C shim with alpha -1 is the same add, then copied back)
        Tensor target = slice(gb32, 0, v_start, vc);
        const Tensor sums = torch::stable::sum(dzc, std::vector<int64_t>{0}, false, f32);
        torch::stable::copy_(target, torch::stable::subtract(target, sums, -1.0));
      }
    }
    if (need_w && token_chunked && !grad_weight_fp32) {
      Tensor target = slice(grad_w, 0, v_start, vc);
      torch::stable::copy_(target, slice(gw32, 0, 0, vc));
    }
  }
  return finish();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_logp, CUDA, m) {
  m.impl("linear_logp_entropy_backward", TORCH_BOX(&linear_logp_entropy_backward_cuda));
}
