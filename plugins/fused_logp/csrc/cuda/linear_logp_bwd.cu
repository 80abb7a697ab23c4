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
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "../cpu_common.h"
#include "linear_logp.cuh"

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
void check_backward_args(const at::Tensor& grad_logp, const std::optional<at::Tensor>& grad_entropy,
                         const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                         double temperature, const std::optional<at::Tensor>& token_temperature,
                         const std::optional<at::Tensor>& bias, const at::Tensor& stats);
void check_cuda_contract(const at::Tensor& hidden, const at::Tensor& weight);
}  // namespace linear_logp_detail

namespace {

using namespace linear_logp;

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logp_entropy_backward_cuda(
    const at::Tensor& grad_logp, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& labels_in, double temperature,
    const std::optional<at::Tensor>& token_temperature, const std::optional<at::Tensor>& bias,
    const at::Tensor& stats_in, int64_t ignore_index, std::array<bool, 3> output_mask, bool grad_weight_fp32,
    bool batch_invariant, std::optional<double> softcap, double logit_scale) {
  linear_logp_detail::check_backward_args(grad_logp, grad_entropy, hidden, weight, labels_in, temperature,
                                          token_temperature, bias, stats_in);
  fused_logp_cpu::check_logit_transform("linear_logp", softcap, logit_scale);
  fused_logp_cpu::check_effective_temperature("linear_logp", temperature, softcap, logit_scale);
  linear_logp_detail::check_cuda_contract(hidden, weight);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const bool need_h = output_mask[0], need_w = output_mask[1], need_b = output_mask[2] && bias.has_value();
  const auto dtype = hidden.scalar_type();
  const auto f32 = hidden.options().dtype(at::kFloat);

  at::Tensor grad_w = need_w ? at::empty({V, H}, hidden.options().dtype(grad_weight_fp32 ? at::kFloat : dtype))
                             : at::empty({0}, hidden.options());
  // Invariant: grad_hidden's GEMMs run on whole blocks of GEMM_ROWS rows; the accumulator has the padded rows.
  const int64_t gemm_rows = LINEAR_LOGP_INVARIANT_GEMM_ROWS;
  static_assert(LINEAR_LOGP_INVARIANT_GEMM_ROWS % BN == 0, "INVARIANT_GEMM_ROWS: a multiple of BLOCK_N");
  const int64_t n_alloc = batch_invariant ? ceil_div(N, gemm_rows) * gemm_rows : N;
  at::Tensor gh32 = need_h ? at::zeros({n_alloc, H}, f32) : at::Tensor();
  at::Tensor gb32 = need_b ? at::zeros({V}, f32) : at::Tensor();
  auto finish = [&] {
    at::Tensor gh = need_h ? gh32.narrow(0, 0, N).to(dtype) : at::empty({0}, hidden.options());
    at::Tensor gb = need_b ? gb32.to(bias->scalar_type()) : at::empty({0}, hidden.options());
    return std::make_tuple(gh, grad_w, gb);
  };
  if (need_w && N == 0) grad_w.zero_();
  if (N == 0 || !(need_h || need_w || need_b)) return finish();

  const at::Tensor labels = labels_in.to(at::kLong).contiguous();
  const at::Tensor stats = stats_in.contiguous();
  const at::Tensor glp = grad_logp.to(at::kFloat).contiguous();
  std::optional<at::Tensor> gent, tt, b32;
  if (grad_entropy.has_value()) gent = grad_entropy->to(at::kFloat).contiguous();
  if (token_temperature.has_value()) tt = token_temperature->contiguous();
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();

  const bool bf16 = dtype == at::kBFloat16;
  CUtensorMap tm_h, tm_w;
  TORCH_CHECK(make_tmap(&tm_h, hidden.data_ptr(), bf16, N, H, hidden.stride(0), BN) == 0,
              "linear_logp: cuTensorMapEncodeTiled failed for hidden");
  // weight boxes of half a vocab tile: a pair of CTAs loads one half each for both (linear_logp.cuh)
  TORCH_CHECK(make_tmap(&tm_w, weight.data_ptr(), bf16, V, H, weight.stride(0), BV / 2) == 0,
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
  at::Tensor dz = batch_invariant ? at::zeros({ceil_div(dz_rows, gemm_rows) * gemm_rows, vc_max}, hidden.options())
                                  : at::empty({dz_rows, vc_max}, hidden.options());
  const bool token_chunked = rows_per_chunk < N;
  at::Tensor gw32 = (need_w && token_chunked && !grad_weight_fp32) ? at::empty({vc_max, H}, f32) : at::Tensor();

  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Params p{};
  p.vocab = static_cast<int>(V);
  p.k_tiles = ceil_div(H, BK);
  p.group = LINEAR_LOGP_GROUP_TOKEN_TILES;
  p.labels = labels.data_ptr<int64_t>();
  p.token_temperature = tt ? tt->data_ptr<float>() : nullptr;
  p.bias = b32 ? b32->data_ptr<float>() : nullptr;
  set_transform(p, temperature, softcap, logit_scale);
  p.ignore_index = ignore_index;
  p.stats = stats.data_ptr<double>();
  p.grad_logp = glp.data_ptr<float>();
  p.grad_ent = gent ? gent->data_ptr<float>() : nullptr;
  p.dz = dz.data_ptr();
  p.ldz = vc_max;

  for (int64_t vt = 0; vt < vocab_tiles; vt += tiles_per_chunk) {
    const int64_t vt_end = std::min(vt + tiles_per_chunk, vocab_tiles);
    const int64_t v_start = vt * BV, vc = std::min(vt_end * BV, V) - v_start;
    const at::Tensor w_chunk = weight.narrow(0, v_start, vc);
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

      const at::Tensor dzc = dz.narrow(0, 0, nr).narrow(1, 0, vc);
      const at::Tensor h_rows = hidden.narrow(0, r0, nr);
      if (need_h && batch_invariant) {
        for (int64_t b0 = 0; b0 < nr; b0 += gemm_rows) {
          at::Tensor acc = gh32.narrow(0, r0 + b0, gemm_rows);
          at::addmm_out(acc, acc, dz.narrow(0, b0, gemm_rows).narrow(1, 0, vc), w_chunk, at::kFloat, 1, 1);
        }
      } else if (need_h) {
        at::Tensor acc = gh32.narrow(0, r0, nr);
        at::addmm_out(acc, acc, dzc, w_chunk, at::kFloat, 1, 1);
      }
      if (need_w) {
        at::Tensor target = grad_w.narrow(0, v_start, vc);
        if (!token_chunked) {
          if (grad_weight_fp32)
            at::mm_out(target, dzc.t(), h_rows, at::kFloat);
          else
            at::mm_out(target, dzc.t(), h_rows);
        } else {
          at::Tensor acc = grad_weight_fp32 ? target : gw32.narrow(0, 0, vc);
          at::addmm_out(acc, acc, dzc.t(), h_rows, at::kFloat, r0 > 0 ? 1 : 0, 1);
        }
      }
      if (need_b) gb32.narrow(0, v_start, vc).add_(dzc.sum(0, false, at::kFloat));
    }
    if (need_w && token_chunked && !grad_weight_fp32) grad_w.narrow(0, v_start, vc).copy_(gw32.narrow(0, 0, vc));
  }
  return finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_logp, CUDA, m) { m.impl("linear_logp_entropy_backward", &linear_logp_entropy_backward_cuda); }
