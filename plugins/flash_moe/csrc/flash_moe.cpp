// flash_moe: the op schemas and their CPU implementations (always built, so the ops exist and are testable anywhere).
//
//   moe_align       counting sort of the routed slots (token t, choice k) -> flat slot t * top_k + k by local expert,
//                   stable within an expert, every expert padded to block_m * bpc with -1, one expert id per block;
//                   each expert's first block is a multiple of block_align (empty blocks, expert id -1, between).
//   fused_moe_bf16  out[t] = sum_k topk_weights[t, k] * (silu(x_t Wg^T) * (x_t Wu^T)) W2^T over the slots of the
//                   aligned blocks, with w = [Wg; Wu] (E, 2 hidden, dim); writes every row of `out` (zeroes unrouted).
//   moe_forward     the same for any family (flash_moe.h's Activation: `activation`, alpha, limit), the gate and up
//                   weights as two (E, hidden, dim) views (w3 None when not gated), the optional expert biases
//                   b_gate, b_up (E, hidden) and b2 (E, dim) (y = act(x Wg^T + bg, x Wu^T + bu) W2^T + b2, the slot
//                   weight multiplying y with its bias), returning out; the `deterministic` flag selects a
//                   fixed-order combine on CUDA (the CPU combine is always fixed-order). With save_gate_up it also
//                   returns what moe_gate_up would (the gate/up kernel stores it beside h), else an empty one.
//   moe_gate_up     moe()'s backward, recomputation: [x_t W1^T + bg | x_t W3^T + bu] (fp32 accumulation, bf16; the
//                   gate half alone without w3) of the routed slots in sorted order (compact: padding dropped), zero
//                   rows past them.
//   swiglu_backward moe()'s backward, elementwise: from g | u, grad_h = dL/dy W2 (unweighted) and the slot weights p:
//                   dg and du with dh = p grad_h, du = dh silu(g), dg = dh u sig(g) (1 + g (1 - sig(g))); p h; and
//                   dL/dp = sum_j grad_h h. Rows with valid = false give zeros.
//   moe_grad_gate_up moe()'s backward, fused: grad_h = grad_out_t W2[e] of each routed slot (fp32, never stored) and
//                   from it and g | u (moe_gate_up's rows) the activation's dg | du (swiglu_backward's for SwiGLU;
//                   dg alone when not gated) side by side in one
//                   (M * top_k, 2 hidden) tensor (g | u's layout: a stacked [W1; W3] takes its gradient from it in one
//                   GEMM, no concatenation), p h (compact rows, zero past the routed ones) and dL/dp (M, top_k) (zero
//                   for unrouted slots).
//   moe_grad_x      moe()'s backward: dx[t] = sum over t's routed slots in k order of dg W1[e] + du W3[e] (dg W1[e]
//                   alone with grad_up and w3 None; dg, du:
//                   moe_grad_gate_up's rows, e.g. the two halves of its dg | du), fp32 accumulation, rounded once to
//                   bf16; `deterministic` selects the fixed-order sum on CUDA (else fp32 atomics; the CPU sum is
//                   always in k order).
//
//   quantize_mxfp8  t (..., K) -> (e4m3 data (..., K), e8m0 scales (..., K / block)), the rule in mxfp8.h.
//   share_exponents_mxfp8  mxfp8 (..., K) -> the same values with every MXFP8_ALIGN elements' scales shared
//                   (mxfp8.h, "Shared exponents"): the form the CUDA kernels' fast path needs.
//   fused_moe_mxfp8 / moe_forward_mxfp8  the same two expert ops on mxfp8 x, w, w2 (weight scales in
//                   pack_scales_blocked's layout); the SwiGLU output is re-quantized to mxfp8 per 32 hidden elements,
//                   then the scales of every MXFP8_ALIGN hidden elements shared (mxfp8.h), before the down projection.
//
// CPU numerics (mxfp8): x, w, w2 dequantized exactly to fp32, fp32 GEMMs, SwiGLU in fp32, h re-quantized with
// quantize_mxfp8's rule, its exponents shared per MXFP8_ALIGN, and dequantized, down in fp32, combine as below.
// CPU numerics: bf16 inputs, fp32 GEMM accumulation, SwiGLU in fp32, the intermediate rounded to bf16 (as the CUDA
// kernels store it), per-slot expert outputs in fp32, combined in k order in fp32, rounded once to bf16.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "flash_moe.h"
#include "mxfp8.h"

#include <algorithm>
#include <c10/util/Float8_e4m3fn.h>
#include <cstring>
#include <functional>

namespace flash_moe {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_align_cpu(const at::Tensor& topk_ids, int64_t num_experts,
                                                             int64_t block_m, int64_t bpc, int64_t expert_start,
                                                             int64_t num_local_experts, int64_t block_align) {
  const AlignPlan p = check_align_args(topk_ids, num_experts, block_m, bpc, expert_start, num_local_experts,
                                       block_align);
  TORCH_CHECK(topk_ids.device().is_cpu(), "moe_align (CPU): topk_ids must be a CPU tensor, got ", topk_ids.device());
  // read as int64, so an int64 id past int32 is out of range rather than truncated into range
  const auto ids_c = topk_ids.to(at::kLong).contiguous();
  const int64_t* ids = ids_c.const_data_ptr<int64_t>();
  const auto opts = topk_ids.options().dtype(at::kInt);
  auto sorted = at::full({p.max_padded}, -1, opts);
  auto eids = at::full({p.max_blocks}, -1, opts);
  auto ntpp = at::zeros({1}, opts);
  std::vector<int64_t> count(p.local, 0), cursor(p.local, 0);
  for (int64_t s = 0; s < p.slots; ++s) {
    const int64_t id = ids[s];
    TORCH_CHECK(id >= -1 && id < num_experts, "moe_align: topk_ids must be in [-1, num_experts=", num_experts,
                ") (-1: not routed), got ", id, " at flat slot ", s);
    const int64_t loc = id - expert_start;
    if (id >= 0 && loc >= 0 && loc < p.local) ++count[loc];
  }
  int64_t total = 0;
  int32_t* ep = eids.mutable_data_ptr<int32_t>();
  for (int64_t e = 0; e < p.local; ++e) {
    cursor[e] = total;
    const int64_t padded = (count[e] + p.pad - 1) / p.pad * p.pad;
    for (int64_t b = total / block_m; b < (total + padded) / block_m; ++b) ep[b] = static_cast<int32_t>(e);
    total += (padded + p.span - 1) / p.span * p.span;  // the blocks up to the next span stay -1 (empty)
  }
  int32_t* sp = sorted.mutable_data_ptr<int32_t>();
  for (int64_t s = 0; s < p.slots; ++s) {
    const int64_t loc = ids[s] - expert_start;
    if (ids[s] >= 0 && loc >= 0 && loc < p.local) sp[cursor[loc]++] = static_cast<int32_t>(s);
  }
  ntpp.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(total);
  return {sorted, eids, ntpp};
}

// Calls fn(group, slots) for each aligned block of a group in [0, groups) (`groups_name`: the range's name in errors),
// with the block's routed slots in order (the values of sorted_token_ids that are not -1), after checking the
// alignment tensors' values; read on the host (device tensors are copied: a sync).
void for_each_group_block(const char* op, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                          const at::Tensor& num_tokens_post_padded, int64_t slots, int64_t groups,
                          const char* groups_name, int64_t block_m,
                          const std::function<void(int64_t, const std::vector<int64_t>&)>& fn) {
  const int64_t ntp = num_tokens_post_padded.to(at::kCPU).item<int32_t>();
  TORCH_CHECK(ntp >= 0 && ntp <= sorted_token_ids.numel() && ntp % block_m == 0, op,
              ": num_tokens_post_padded must be a multiple of block_m=", block_m, " in [0, ",
              sorted_token_ids.numel(), "] (len(sorted_token_ids)), got ", ntp);
  const auto sorted_c = sorted_token_ids.to(at::kCPU).contiguous();
  const auto eids_c = expert_ids.to(at::kCPU).contiguous();
  const int32_t* sp = sorted_c.const_data_ptr<int32_t>();
  const int32_t* ep = eids_c.const_data_ptr<int32_t>();
  std::vector<int64_t> slot_list;
  for (int64_t b = 0; b < ntp / block_m; ++b) {
    const int64_t g = ep[b];
    TORCH_CHECK(g >= -1 && g < groups, op, ": expert_ids must be in [-1, ", groups_name, "=", groups, "), got ", g,
                " for block ", b);
    if (g < 0) continue;
    slot_list.clear();
    for (int64_t r = 0; r < block_m; ++r) {
      const int64_t slot = sp[b * block_m + r];
      TORCH_CHECK(slot >= -1 && slot < slots, op, ": sorted_token_ids must be in [-1, M * top_k=", slots, "), got ",
                  slot, " at position ", b * block_m + r);
      if (slot >= 0) slot_list.push_back(slot);
    }
    if (!slot_list.empty()) fn(g, slot_list);
  }
}

// for_each_group_block over the local experts.
void for_each_block(const char* op, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, const MoeShape& s, int64_t block_m,
                    const std::function<void(int64_t, const std::vector<int64_t>&)>& fn) {
  for_each_group_block(op, sorted_token_ids, expert_ids, num_tokens_post_padded, s.M * s.top_k, s.E, "E", block_m,
                       fn);
}

// h from the pre-activations g, u (fp32; u undefined when not gated): flash_moe.h's Activation.
at::Tensor activate(const ActivationSpec& a, const at::Tensor& g, const at::Tensor& u) {
  switch (a.kind) {
    case Activation::kSwiGLU:
      return at::silu(g) * u;
    case Activation::kGptOss: {
      const auto gc = g.clamp_max(a.limit);
      return (u.clamp(-a.limit, a.limit) + 1) * gc * at::sigmoid(gc * a.alpha);
    }
    case Activation::kRelu2:
      return at::relu(g).square();
  }
  TORCH_CHECK(false, "flash_moe: unknown activation");
}

// (dL/dg, dL/du) from dL/dh (fp32). The clamps pass the gradient inside their closed ranges (torch.clamp's rule) and
// none outside; du is undefined when not gated.
std::pair<at::Tensor, at::Tensor> activate_backward(const ActivationSpec& a, const at::Tensor& g, const at::Tensor& u,
                                                    const at::Tensor& dh) {
  switch (a.kind) {
    case Activation::kSwiGLU: {
      const auto sig = at::sigmoid(g);
      return {dh * u * sig * (1 + g * (1 - sig)), dh * g * sig};
    }
    case Activation::kGptOss: {
      const auto gc = g.clamp_max(a.limit), uc = u.clamp(-a.limit, a.limit);
      const auto sig = at::sigmoid(gc * a.alpha);
      const auto zero = at::zeros({}, g.options());
      const auto dg = at::where(g.le(a.limit), dh * (uc + 1) * sig * (1 + gc * a.alpha * (1 - sig)), zero);
      const auto du = at::where(u.abs().le(a.limit), dh * gc * sig, zero);
      return {dg, du};
    }
    case Activation::kRelu2:
      return {dh * 2 * at::relu(g), at::Tensor()};
  }
  TORCH_CHECK(false, "flash_moe: unknown activation");
}

// An expert's bias row as fp32 (n,), or an undefined tensor (no bias): added to the fp32 GEMM results.
at::Tensor bias_row(const std::optional<at::Tensor>& b, int64_t e) {
  return b.has_value() ? (*b)[e].to(at::kFloat) : at::Tensor();
}
at::Tensor plus(const at::Tensor& t, const at::Tensor& bias) { return bias.defined() ? t + bias : t; }

// The fp32 pre-activations (g, u) of expert e for the rows xb (fp32), biases included; u undefined when not gated.
std::pair<at::Tensor, at::Tensor> gate_up_rows(const Experts& w, int64_t e, const at::Tensor& xb) {
  const auto g = plus(xb.mm(w.gate[e].to(at::kFloat).t()), bias_row(w.b_gate, e));
  if (!w.act.gated()) return {g, at::Tensor()};
  return {g, plus(xb.mm(w.up[e].to(at::kFloat).t()), bias_row(w.b_up, e))};
}

// Per-slot expert outputs y[slot] = act(x_t Wg^T + bg, x_t Wu^T + bu) W2^T + b2 in fp32, zero for slots no block
// covers.
at::Tensor slot_outputs_cpu(const char* op, const at::Tensor& x, const Experts& w,
                            const at::Tensor& w2, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                            const at::Tensor& num_tokens_post_padded, const MoeShape& s, int64_t block_m,
                            const std::function<at::Tensor(const at::Tensor&)>& round_h) {
  TORCH_CHECK(x.device().is_cpu(), op, " (CPU): x must be a CPU tensor, got ", x.device());
  auto y = at::zeros({s.M * s.top_k, s.dim}, x.options().dtype(at::kFloat));
  for_each_block(op, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m,
                 [&](int64_t e, const std::vector<int64_t>& slot_list) {
                   const auto slot_t = at::tensor(slot_list, x.options().dtype(at::kLong));
                   const int64_t n = slot_t.numel();
                   // Every block's GEMMs run on block_m rows (zero padding): at::mm's per-row result depends on the
                   // row count for small counts (other kernels at M <= 8, measured), which would make a token's
                   // output depend on how many other slots its experts got (batch invariance).
                   const auto xb = at::constant_pad_nd(
                       x.index_select(0, at::floor_divide(slot_t, s.top_k)).to(at::kFloat), {0, 0, 0, block_m - n});
                   const auto [g, u] = gate_up_rows(w, e, xb);
                   const auto h = round_h(activate(w.act, g, u));
                   y.index_copy_(0, slot_t, plus(h.mm(w2[e].to(at::kFloat).t()), bias_row(w.b2, e)).narrow(0, 0, n));
                 });
  return y;
}

at::Tensor round_bf16(const at::Tensor& h) { return h.to(at::kBFloat16).to(at::kFloat); }

// topk_weights with zero for every slot no aligned block routes: a NaN or inf weight on a slot that is not routed
// (id -1, another rank's expert) must contribute nothing, and its weight times the slot's zero output would not.
at::Tensor routed_weights_cpu(const char* op, const at::Tensor& topk_weights, const at::Tensor& sorted_token_ids,
                              const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
                              const MoeShape& s, int64_t block_m) {
  auto routed = at::zeros({s.M, s.top_k}, topk_weights.options().dtype(at::kBool));
  bool* r = routed.mutable_data_ptr<bool>();
  for_each_block(op, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m,
                 [&](int64_t, const std::vector<int64_t>& slot_list) {
                   for (const int64_t slot : slot_list) r[slot] = true;
                 });
  return at::where(routed, topk_weights, at::zeros({}, topk_weights.options()));
}

// ------------------------------------------------------------------------------------------------------------------
// mxfp8
std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_cpu(const at::Tensor& t, int64_t block) {
  const char* op = "quantize_mxfp8";
  TORCH_CHECK(t.device().is_cpu(), op, " (CPU): t must be a CPU tensor, got ", t.device());
  check_quantize_args(t, block);
  const auto f = t.contiguous().to(at::kFloat);
  auto data = at::empty(t.sizes(), t.options().dtype(at::kFloat8_e4m3fn));
  auto scale_sizes = t.sizes().vec();
  scale_sizes.back() /= block;
  auto scales = at::empty(scale_sizes, t.options().dtype(at::kFloat8_e8m0fnu));
  const float* in = f.const_data_ptr<float>();
  auto* q = reinterpret_cast<uint8_t*>(data.mutable_data_ptr());
  auto* sc = reinterpret_cast<uint8_t*>(scales.mutable_data_ptr());
  const int64_t blocks = scales.numel();
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = in + b * block;
    uint32_t amax = 0;
    for (int64_t i = 0; i < block; ++i) {
      uint32_t bits;
      std::memcpy(&bits, v + i, 4);
      amax = std::max(amax, bits & 0x7FFFFFFFu);
    }
    const uint32_t sb = mx::scale_byte(amax);
    sc[b] = static_cast<uint8_t>(sb);
    const uint32_t inv_bits = sb == mx::kNanScale ? 0u : mx::inv_scale_bits(sb);
    float inv;
    std::memcpy(&inv, &inv_bits, 4);
    for (int64_t i = 0; i < block; ++i) {
      if (sb == mx::kNanScale) {
        q[b * block + i] = mx::kNanElement;
        continue;
      }
      const float y = std::min(448.f, std::max(-448.f, v[i] * inv));
      q[b * block + i] = c10::Float8_e4m3fn(y).x;
    }
  }
  return {data, scales};
}

// e4m3 data (..., K) with row-major e8m0 scales (..., K / 32) -> fp32 (exact).
at::Tensor dequantize_cpu(const at::Tensor& data, const at::Tensor& scales) {
  return data.to(at::kFloat) * scales.to(at::kFloat).repeat_interleave(kMxScaleBlock, -1);
}

// pack_scales_blocked's layout (E, K / 128, N, 4) -> row-major (E, N, K / 32).
at::Tensor unpack_scales(const at::Tensor& packed) {
  const auto b = packed.view(at::kByte);
  return b.permute({0, 2, 1, 3}).reshape({b.size(0), b.size(2), b.size(1) * b.size(3)}).view(at::kFloat8_e8m0fnu);
}

// Every group of kMxAlign / 32 blocks along the last dimension takes the group's largest scale (mxfp8.h, "Shared
// exponents"), in place.
void share_exponents_cpu(at::Tensor& data, at::Tensor& scales) {
  auto* q = reinterpret_cast<uint8_t*>(data.mutable_data_ptr());
  auto* sc = reinterpret_cast<uint8_t*>(scales.mutable_data_ptr());
  constexpr int64_t group = kMxAlign / kMxScaleBlock;
  for (int64_t g = 0; g < scales.numel() / group; ++g) {
    uint8_t* gs = sc + g * group;
    const uint32_t shared = *std::max_element(gs, gs + group);
    for (int64_t b = 0; b < group; ++b) {
      uint8_t* block = q + (g * group + b) * kMxScaleBlock;
      for (int64_t i = 0; i < kMxScaleBlock; ++i)
        block[i] = shared == mx::kNanScale ? mx::kNanElement : mx::share_element(block[i], gs[b], shared);
      gs[b] = static_cast<uint8_t>(shared);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> share_exponents_mxfp8_cpu(const at::Tensor& data, const at::Tensor& scales) {
  const char* op = "share_exponents_mxfp8";
  const auto d = as_bits_of(data, at::kFloat8_e4m3fn), s = as_bits_of(scales, at::kFloat8_e8m0fnu);
  check_share_args(d, s);
  TORCH_CHECK(d.device().is_cpu(), op, " (CPU): data must be a CPU tensor, got ", d.device());
  auto q = d.contiguous().clone();
  auto sc = s.contiguous().clone();
  share_exponents_cpu(q, sc);
  return {q, sc};
}

// h's rounding before the down projection: mxfp8 with exponents shared per kMxAlign hidden columns (as the CUDA op).
at::Tensor round_mxfp8(const at::Tensor& h) {
  auto [q, sc] = quantize_mxfp8_cpu(h, kMxScaleBlock);
  share_exponents_cpu(q, sc);
  return dequantize_cpu(q, sc);
}

at::Tensor mxfp8_slot_outputs_cpu(const char* op, const at::Tensor& x_in, const at::Tensor& xs_in,
                                  const at::Tensor& w_in, const at::Tensor& ws_in, const at::Tensor& w2_in,
                                  const at::Tensor& w2s_in, const at::Tensor& sorted_token_ids,
                                  const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
                                  const at::Tensor* topk_weights, int64_t top_k, int64_t block_m, MoeShape& s) {
  const auto x = as_bits_of(x_in, at::kFloat8_e4m3fn), w = as_bits_of(w_in, at::kFloat8_e4m3fn);
  const auto w2 = as_bits_of(w2_in, at::kFloat8_e4m3fn);
  const auto x_scales = as_bits_of(xs_in, at::kFloat8_e8m0fnu), w_scales = as_bits_of(ws_in, at::kFloat8_e8m0fnu);
  const auto w2_scales = as_bits_of(w2s_in, at::kFloat8_e8m0fnu);
  const auto [gate, up] = split_gate_up(op, w);
  s = check_moe_args(op, x, gate, up, &w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k,
                     block_m, "w", at::kFloat8_e4m3fn);
  check_mx_scales(op, x, x_scales, w_scales, w2_scales, s);
  TORCH_CHECK(x.device().is_cpu(), op, " (CPU): x must be a CPU tensor, got ", x.device());
  const auto xf = dequantize_cpu(x, x_scales);
  const auto wf = dequantize_cpu(w, unpack_scales(w_scales));
  const auto w2f = dequantize_cpu(w2, unpack_scales(w2_scales));
  const auto [gate_f, up_f] = split_gate_up(op, wf);
  return slot_outputs_cpu(op, xf, Experts{gate_f, up_f, kSwiGLU}, w2f, sorted_token_ids, expert_ids,
                          num_tokens_post_padded, s, block_m, round_mxfp8);
}

void fused_moe_mxfp8_cpu(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                         const at::Tensor& w_scales, const at::Tensor& w2, const at::Tensor& w2_scales,
                         const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                         const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor out,
                         int64_t top_k, int64_t block_m, int64_t /*block_n*/, int64_t /*warp_n*/, int64_t /*stages*/,
                         int64_t /*bpc*/, bool /*split*/) {
  const char* op = "fused_moe_mxfp8";
  MoeShape s{};
  const auto y = mxfp8_slot_outputs_cpu(op, x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
                                        num_tokens_post_padded, &topk_weights, top_k, block_m, s);
  check_out(op, out, s, x);
  out.copy_(combine_in_k_order(
      y, routed_weights_cpu(op, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m), s));
}

at::Tensor moe_forward_mxfp8_cpu(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                                 const at::Tensor& w_scales, const at::Tensor& w2, const at::Tensor& w2_scales,
                                 const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                                 const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights,
                                 int64_t top_k, int64_t block_m, bool /*deterministic: always k order on CPU*/) {
  const char* op = "moe_forward_mxfp8";
  MoeShape s{};
  const auto y = mxfp8_slot_outputs_cpu(op, x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
                                        num_tokens_post_padded, &topk_weights, top_k, block_m, s);
  return combine_in_k_order(
      y, routed_weights_cpu(op, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m), s);
}

void fused_moe_bf16_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w2,
                        const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                        const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor out,
                        int64_t top_k, int64_t block_m, int64_t /*block_n*/, int64_t /*warp_n*/, int64_t /*stages*/,
                        int64_t /*bpc*/, int64_t /*cpc*/, bool /*split*/) {
  const char* op = "fused_moe_bf16";
  const auto [gate, up] = split_gate_up(op, w);
  const MoeShape s = check_moe_args(op, x, gate, up, &w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                    &topk_weights, top_k, block_m, "w");
  check_out(op, out, s, x);
  const auto y = slot_outputs_cpu(op, x, Experts{gate, up, kSwiGLU}, w2, sorted_token_ids, expert_ids,
                                  num_tokens_post_padded, s, block_m, round_bf16);
  out.copy_(combine_in_k_order(
      y, routed_weights_cpu(op, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m), s));
}

// ------------------------------------------------------------------------------------------------------------------
// the pieces of moe()'s closed-form backward
// [g | u] (g alone when not gated) of the routed slots in sorted order, compact, fp32 accumulation, biases included,
// rounded to bf16; zero rows past them.
at::Tensor gate_up_cpu(const char* op, const at::Tensor& x, const Experts& w, const at::Tensor& sorted_token_ids,
                       const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, const MoeShape& s,
                       int64_t block_m) {
  TORCH_CHECK(x.device().is_cpu(), op, " (CPU): x must be a CPU tensor, got ", x.device());
  auto out = at::zeros({s.M * s.top_k, (w.act.gated() ? 2 : 1) * s.hidden}, x.options());
  int64_t row = 0;
  for_each_block(op, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m,
                 [&](int64_t e, const std::vector<int64_t>& slot_list) {
                   const int64_t n = static_cast<int64_t>(slot_list.size());
                   TORCH_CHECK(row + n <= s.M * s.top_k, op, ": sorted_token_ids routes more than M * top_k=",
                               s.M * s.top_k, " slots");
                   const auto slot_t = at::tensor(slot_list, x.options().dtype(at::kLong));
                   const auto xb = x.index_select(0, at::floor_divide(slot_t, s.top_k)).to(at::kFloat);
                   const auto [g, u] = gate_up_rows(w, e, xb);
                   out.narrow(0, row, n).copy_(w.act.gated() ? at::cat({g, u}, 1) : g);
                   row += n;
                 });
  return out;
}

at::Tensor moe_gate_up_cpu(const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& w3,
                           const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                           const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_m,
                           int64_t num_experts, const std::optional<at::Tensor>& b_gate,
                           const std::optional<at::Tensor>& b_up) {
  const char* op = "moe_gate_up";
  MoeShape s;
  const Experts w = check_gate_up_experts(op, x, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                                          block_m, num_experts, b_gate, b_up, s);
  return gate_up_cpu(op, x, w, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m);
}

std::tuple<at::Tensor, at::Tensor> moe_forward_cpu(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& w3, const at::Tensor& w2,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    const at::Tensor& topk_weights, int64_t top_k, int64_t block_m,
    bool /*deterministic: the CPU combine is always in k order*/, bool save_gate_up, int64_t num_experts,
    c10::string_view activation, double alpha, double limit, const std::optional<at::Tensor>& b_gate,
    const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b2) {
  const char* op = "moe_forward";
  MoeShape s;
  const Experts w = check_experts(op, x, w1, w3, &w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                  &topk_weights, top_k, block_m, num_experts,
                                  parse_activation(op, activation, alpha, limit), b_gate, b_up, b2, s);
  const auto y = slot_outputs_cpu(op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m,
                                  round_bf16);
  return {combine_in_k_order(y, routed_weights_cpu(op, topk_weights, sorted_token_ids, expert_ids,
                                                  num_tokens_post_padded, s, block_m),
                             s),
          save_gate_up ? gate_up_cpu(op, x, w, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m)
                       : at::empty({0, (w.act.gated() ? 2 : 1) * s.hidden}, x.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& gate_up,
                                                                   const at::Tensor& grad_h,
                                                                   const at::Tensor& row_weights,
                                                                   const at::Tensor& valid) {
  const int64_t hidden = check_swiglu_backward_args(gate_up, grad_h, row_weights, valid);
  TORCH_CHECK(gate_up.device().is_cpu(), "swiglu_backward (CPU): gate_up must be a CPU tensor, got ",
              gate_up.device());
  const auto ok = valid.unsqueeze(1);
  const auto zero = at::zeros({}, row_weights.options());
  // rows past the routed ones may hold anything (NaN and inf too): selected away, never multiplied by zero
  const auto g = at::where(ok, gate_up.narrow(1, 0, hidden).to(at::kFloat), zero);
  const auto u = at::where(ok, gate_up.narrow(1, hidden, hidden).to(at::kFloat), zero);
  const auto d = at::where(ok, grad_h.to(at::kFloat), zero);
  const auto p = at::where(valid, row_weights, zero).unsqueeze(1);
  const auto h = activate(kSwiGLU, g, u);
  const auto [dg, du] = activate_backward(kSwiGLU, g, u, d * p);
  return {dg.to(at::kBFloat16), du.to(at::kBFloat16), (h * p).to(at::kBFloat16), (d * h).sum(1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_grad_gate_up_cpu(
    const at::Tensor& grad_out, const at::Tensor& w2, const at::Tensor& gate_up, const at::Tensor& sorted_token_ids,
    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights,
    int64_t top_k, int64_t block_m, int64_t num_experts, c10::string_view activation, double alpha, double limit) {
  const char* op = "moe_grad_gate_up";
  const ActivationSpec act = parse_activation(op, activation, alpha, limit);
  MoeShape s = check_grad_gate_up_args(op, grad_out, w2, gate_up, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                       topk_weights, top_k, block_m, act.gated());
  set_global_experts(op, num_experts, s);
  TORCH_CHECK(grad_out.device().is_cpu(), op, " (CPU): grad_out must be a CPU tensor, got ", grad_out.device());
  const int64_t slots = s.M * s.top_k;
  const int64_t halves = act.gated() ? 2 : 1;
  auto grad_gate_up = at::zeros({slots, halves * s.hidden}, grad_out.options());
  auto weighted_h = at::zeros({slots, s.hidden}, grad_out.options());
  auto grad_weights = at::zeros({slots}, topk_weights.options());
  const auto flat_weights = topk_weights.reshape({slots});
  int64_t row = 0;
  for_each_block(op, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m,
                 [&](int64_t e, const std::vector<int64_t>& slot_list) {
                   const int64_t n = static_cast<int64_t>(slot_list.size());
                   TORCH_CHECK(row + n <= slots, op, ": sorted_token_ids routes more than M * top_k=", slots,
                               " slots");
                   const auto slot_t = at::tensor(slot_list, grad_out.options().dtype(at::kLong));
                   // grad_h = grad_out_t W2[e], unweighted, in fp32 (never rounded: the CUDA kernel keeps it in its
                   // accumulators)
                   const auto gh = grad_out.index_select(0, at::floor_divide(slot_t, s.top_k))
                                       .to(at::kFloat)
                                       .mm(w2[e].to(at::kFloat));
                   const auto gu = gate_up.narrow(0, row, n).to(at::kFloat);
                   const auto g = gu.narrow(1, 0, s.hidden);
                   const auto u = act.gated() ? gu.narrow(1, s.hidden, s.hidden) : at::Tensor();
                   const auto pw = flat_weights.index_select(0, slot_t).unsqueeze(1);
                   const auto h = activate(act, g, u);
                   const auto [dg, du] = activate_backward(act, g, u, gh * pw);
                   grad_gate_up.narrow(0, row, n).copy_(act.gated() ? at::cat({dg, du}, 1) : dg);
                   weighted_h.narrow(0, row, n).copy_(h * pw);
                   grad_weights.index_copy_(0, slot_t, (gh * h).sum(1));
                   row += n;
                 });
  return {grad_gate_up, weighted_h, grad_weights.view({s.M, s.top_k})};
}

at::Tensor moe_grad_x_cpu(const at::Tensor& grad_gate, const std::optional<at::Tensor>& grad_up,
                          const at::Tensor& w1, const std::optional<at::Tensor>& w3,
                          const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                          const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_m,
                          bool /*deterministic: always k order on CPU*/, int64_t num_experts) {
  const char* op = "moe_grad_x";
  check_grad_x_halves(op, grad_up, w3);
  MoeShape s = check_grad_x_args(op, grad_gate, grad_up.value_or(grad_gate), w1, w3.value_or(w1), sorted_token_ids,
                                 expert_ids, num_tokens_post_padded, top_k, block_m);
  set_global_experts(op, num_experts, s);
  TORCH_CHECK(grad_gate.device().is_cpu(), op, " (CPU): grad_gate must be a CPU tensor, got ", grad_gate.device());
  auto per_slot = at::zeros({s.M * s.top_k, s.dim}, grad_gate.options().dtype(at::kFloat));
  int64_t row = 0;
  for_each_block(op, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m,
                 [&](int64_t e, const std::vector<int64_t>& slot_list) {
                   const int64_t n = static_cast<int64_t>(slot_list.size());
                   TORCH_CHECK(row + n <= s.M * s.top_k, op, ": sorted_token_ids routes more than M * top_k=",
                               s.M * s.top_k, " slots");
                   const auto slot_t = at::tensor(slot_list, grad_gate.options().dtype(at::kLong));
                   auto dx = grad_gate.narrow(0, row, n).to(at::kFloat).mm(w1[e].to(at::kFloat));
                   if (w3.has_value()) dx += grad_up->narrow(0, row, n).to(at::kFloat).mm((*w3)[e].to(at::kFloat));
                   per_slot.index_copy_(0, slot_t, dx);
                   row += n;
                 });
  // a token's slots summed in k order in fp32 (unrouted slots are zero rows), rounded once
  return per_slot.view({s.M, s.top_k, s.dim}).sum(1).to(at::kBFloat16);
}

// The reference: per expert, its rows and their gathered source rows in fp32, one product, rounded once.
at::Tensor moe_grad_weight_cpu(const at::Tensor& rows, const at::Tensor& source, const at::Tensor& row_token,
                               const at::Tensor& expert_ends, bool source_major, bool fp32) {
  const char* op = "moe_grad_weight";
  const GradWeightShape s = check_grad_weight_args(rows, source, row_token, expert_ends);
  TORCH_CHECK(rows.device().is_cpu(), op, " (CPU): rows must be a CPU tensor, got ", rows.device());
  auto out = at::zeros(source_major ? at::IntArrayRef{s.E, s.K, s.N} : at::IntArrayRef{s.E, s.N, s.K},
                       rows.options().dtype(at::kFloat));
  const auto ends = expert_ends.contiguous();
  const auto tokens = row_token.to(at::kLong);
  const int* end_of = ends.const_data_ptr<int>();
  int64_t first = 0;
  for (int64_t e = 0; e < s.E; ++e) {
    const int64_t end = end_of[e];
    TORCH_CHECK(end >= first && end <= s.S, op, ": expert_ends must be non-decreasing within [0, S=", s.S,
                "], got expert_ends[", e, "]=", end, " after ", first);
    const int64_t n = end - first;
    if (n == 0) continue;
    const auto tok = tokens.narrow(0, first, n);
    const auto bad = tok.lt(-1).logical_or_(tok.ge(s.T));
    TORCH_CHECK(!bad.any().item<bool>(), op, ": row_token must hold source rows in [0, T=", s.T,
                ") or -1 (no source row), got ", tok.masked_select(bad)[0].item<int64_t>());
    const auto valid = tok.ge(0).unsqueeze(1);
    // selected, not multiplied: a -1 row contributes zeros even where source holds NaN or inf
    const auto src = at::where(valid, source.index_select(0, tok.clamp_min(0)).to(at::kFloat), 0.f);
    const auto r = rows.narrow(0, first, n).to(at::kFloat);
    out[e].copy_(source_major ? src.t().mm(r) : r.t().mm(src));
    first = end;
  }
  return fp32 ? out : out.to(at::kBFloat16);
}


// ------------------------------------------------------------------------------------------------------------------
// LoRA adapters (flash_moe.h, "LoRA adapters on the experts"): the unfused composition in ATen calls, the CPU
// implementation and the definition of the numerics, which the fused CUDA ops (csrc/cuda/fused_moe_sm90.cu) compute
// with the same rounding points (docs/notes/flash_moe.md, "LoRA adapters"). Per aligned block of group v = e * n + a:
// expert e's base GEMMs in fp32 as the base ops compute them, plus per adapted projection the rank-r rows
// u = s_a (rows A[a, e]^T) rounded to bf16 (the operand the fused kernels append to the GEMM's K) and u B[a, e]^T in
// fp32.

struct LoraBlock {
  int64_t expert, adapter;
  at::Tensor slots;  // the block's routed slots in order (int64, on the operands' device)
  int64_t row;       // its first compact row (the routed slots in aligned order, padding dropped)
};

// The aligned blocks of the E * n groups (for_each_group_block: read on the host, the unfused path synchronizes).
std::vector<LoraBlock> lora_blocks(const char* op, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                                   const at::Tensor& num_tokens_post_padded, int64_t slots, int64_t E, int64_t n,
                                   int64_t block_m, const at::Device& device) {
  std::vector<LoraBlock> blocks;
  int64_t row = 0;
  for_each_group_block(op, sorted_token_ids, expert_ids, num_tokens_post_padded, slots, E * n,
                       "E * n_adapters", block_m,
                       [&](int64_t v, const std::vector<int64_t>& slot_list) {
                         const int64_t count = static_cast<int64_t>(slot_list.size());
                         TORCH_CHECK(row + count <= slots, op, ": sorted_token_ids routes more than M * top_k=", slots,
                                     " slots");
                         blocks.push_back({v / n, v % n,
                                           at::tensor(slot_list, at::TensorOptions().dtype(at::kLong)).to(device),
                                           row});
                         row += count;
                       });
  return blocks;
}

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat); }

// u = s_a rows A[a, e]^T, rounded to bf16 (fp32 values), or undefined when the projection has no adapter.
at::Tensor lora_shrink(const Lora& l, const LoraPair& p, const LoraBlock& b, const at::Tensor& rows) {
  if (!p.present()) return {};
  return round_bf16(rows.mm(f32(p.a[b.adapter][b.expert]).t()) * l.scaling[b.adapter]);
}

// rows (dL/d of a projection's output) -> s_a rows B[a, e], rounded to bf16: the shrink of the backward's K-extension.
at::Tensor lora_shrink_grad(const Lora& l, const LoraPair& p, const LoraBlock& b, const at::Tensor& rows) {
  if (!p.present()) return {};
  return round_bf16(rows.mm(f32(p.b[b.adapter][b.expert])) * l.scaling[b.adapter]);
}

// t + u B[a, e]^T: the adapter's term of a projection (t itself without an adapter).
at::Tensor lora_expand(const at::Tensor& t, const LoraPair& p, const LoraBlock& b, const at::Tensor& u) {
  return p.present() ? t + u.mm(f32(p.b[b.adapter][b.expert]).t()) : t;
}

// The rank-r rows of the adapted projections side by side (rows x the sum of their ranks; zero columns when none).
at::Tensor side_by_side(std::vector<at::Tensor> parts, int64_t rows, const at::TensorOptions& options) {
  std::vector<at::Tensor> present;
  for (auto& t : parts)
    if (t.defined()) present.push_back(t.narrow(0, 0, rows));
  return present.empty() ? at::empty({rows, 0}, options) : at::cat(present, 1);
}

// The block's x rows in fp32, zero-padded to block_m rows (slot_outputs_cpu's rule: a row's result does not depend
// on how many slots share its block).
at::Tensor block_x_rows(const at::Tensor& x, const LoraBlock& b, int64_t top_k, int64_t block_m) {
  return at::constant_pad_nd(f32(x.index_select(0, at::floor_divide(b.slots, top_k))),
                             {0, 0, 0, block_m - b.slots.numel()});
}

// A block's fp32 pre-activations with the gate/up adapters and their rank-r rows [u_gate | u_up].
std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_gate_up_rows(const Experts& w, const Lora& l, const LoraBlock& b,
                                                                 const at::Tensor& xb) {
  auto [g, u] = gate_up_rows(w, b.expert, xb);
  const auto u_gate = lora_shrink(l, l.gate, b, xb), u_up = lora_shrink(l, l.up, b, xb);
  g = lora_expand(g, l.gate, b, u_gate);
  if (u.defined()) u = lora_expand(u, l.up, b, u_up);
  return {g, u, side_by_side({u_gate, u_up}, xb.size(0), xb.options())};
}

// moe_lora_gate_up's and moe_lora_forward's [g | u] (no rows unless `keep_gate_up`) and [u_gate | u_up] of the routed
// slots in aligned order (compact, zero rows past them): both bf16.
std::pair<at::Tensor, at::Tensor> lora_gate_up_outputs(const at::Tensor& x, const MoeShape& s, const Lora& l,
                                                       bool gated, bool keep_gate_up) {
  const int64_t slots = s.M * s.top_k;
  return {at::zeros({keep_gate_up ? slots : 0, (gated ? 2 : 1) * s.hidden}, x.options()),
          at::zeros({slots, l.gate.rank + l.up.rank}, x.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_lora_forward_impl(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& w3, const at::Tensor& w2,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    const at::Tensor& topk_weights, int64_t top_k, int64_t block_m, bool /*deterministic: always k order here*/,
    bool save_gate_up, int64_t num_experts, const at::Tensor& scaling, const std::optional<at::Tensor>& a_gate,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& a_up,
    const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& a_down,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, double alpha, double limit,
    const std::optional<at::Tensor>& bias_gate, const std::optional<at::Tensor>& bias_up,
    const std::optional<at::Tensor>& b2) {
  const char* op = "moe_lora_forward";
  MoeShape s;
  const Experts w = check_experts(op, x, w1, w3, &w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                  &topk_weights, top_k, block_m, num_experts,
                                  parse_activation(op, activation, alpha, limit), bias_gate, bias_up, b2, s);
  const Lora l = check_lora(op, x, scaling, s.E, s.dim, s.hidden, w.act.gated(), a_gate, b_gate, a_up, b_up, a_down,
                            b_down);
  const int64_t slots = s.M * s.top_k;
  auto y = at::zeros({slots, s.dim}, x.options().dtype(at::kFloat));
  auto routed = at::zeros({slots}, x.options().dtype(at::kBool));
  auto [gate_up, lora_rows] = lora_gate_up_outputs(x, s, l, w.act.gated(), save_gate_up);
  for (const auto& b : lora_blocks(op, sorted_token_ids, expert_ids, num_tokens_post_padded, slots, s.E, l.n, block_m,
                                   x.device())) {
    const int64_t n = b.slots.numel();
    const auto [g, u, u_gate_up] = lora_gate_up_rows(w, l, b, block_x_rows(x, b, s.top_k, block_m));
    const auto h = round_bf16(activate(w.act, g, u));
    const auto base = plus(h.mm(f32(w2[b.expert]).t()), bias_row(w.b2, b.expert));
    y.index_copy_(0, b.slots, lora_expand(base, l.down, b, lora_shrink(l, l.down, b, h)).narrow(0, 0, n));
    routed.index_fill_(0, b.slots, true);
    if (save_gate_up) gate_up.narrow(0, b.row, n).copy_((u.defined() ? at::cat({g, u}, 1) : g).narrow(0, 0, n));
    lora_rows.narrow(0, b.row, n).copy_(u_gate_up.narrow(0, 0, n));
  }
  const auto weights = at::where(routed.view({s.M, s.top_k}), topk_weights, at::zeros({}, topk_weights.options()));
  return {combine_in_k_order(y, weights, s), gate_up, lora_rows};
}

std::tuple<at::Tensor, at::Tensor> moe_lora_gate_up_impl(
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
  auto [gate_up, lora_rows] = lora_gate_up_outputs(x, s, l, w.act.gated(), true);
  for (const auto& b : lora_blocks(op, sorted_token_ids, expert_ids, num_tokens_post_padded, s.M * s.top_k, s.E, l.n,
                                   block_m, x.device())) {
    const int64_t n = b.slots.numel();
    const auto [g, u, u_gate_up] = lora_gate_up_rows(w, l, b, block_x_rows(x, b, s.top_k, block_m));
    gate_up.narrow(0, b.row, n).copy_((u.defined() ? at::cat({g, u}, 1) : g).narrow(0, 0, n));
    lora_rows.narrow(0, b.row, n).copy_(u_gate_up.narrow(0, 0, n));
  }
  return {gate_up, lora_rows};
}

// dH with the down adapter: grad_h = grad_out_t W2[e] + v A_down[a, e] with v = s_a grad_out_t B_down[a, e] (the
// backward's K-extension), then moe_grad_gate_up's epilogue; lora_rows = [v | p u_down] with u_down = s_a h A_down^T
// (h rounded to bf16, as the forward's down GEMM read it): the rows of the down adapter's gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_lora_grad_gate_up_impl(
    const at::Tensor& grad_out, const at::Tensor& w2, const at::Tensor& gate_up, const at::Tensor& sorted_token_ids,
    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights,
    int64_t top_k, int64_t block_m, const at::Tensor& scaling, const std::optional<at::Tensor>& a_down,
    const std::optional<at::Tensor>& b_down, int64_t num_experts, c10::string_view activation, double alpha,
    double limit) {
  const char* op = "moe_lora_grad_gate_up";
  const ActivationSpec act = parse_activation(op, activation, alpha, limit);
  MoeShape s = check_grad_gate_up_args(op, grad_out, w2, gate_up, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                       topk_weights, top_k, block_m, act.gated());
  set_global_experts(op, num_experts, s);
  const Lora l = check_lora(op, grad_out, scaling, s.E, s.dim, s.hidden, act.gated(), std::nullopt, std::nullopt,
                            std::nullopt, std::nullopt, a_down, b_down, "grad_out");
  const int64_t slots = s.M * s.top_k;
  auto grad_gate_up = at::zeros({slots, (act.gated() ? 2 : 1) * s.hidden}, grad_out.options());
  auto weighted_h = at::zeros({slots, s.hidden}, grad_out.options());
  auto grad_weights = at::zeros({slots}, topk_weights.options());
  auto lora_rows = at::zeros({slots, 2 * l.down.rank}, grad_out.options());
  const auto flat_weights = topk_weights.reshape({slots});
  for (const auto& b : lora_blocks(op, sorted_token_ids, expert_ids, num_tokens_post_padded, slots, s.E, l.n, block_m,
                                   grad_out.device())) {
    const int64_t n = b.slots.numel();
    const auto go = f32(grad_out.index_select(0, at::floor_divide(b.slots, s.top_k)));
    const auto v = lora_shrink_grad(l, l.down, b, go);
    auto gh = go.mm(f32(w2[b.expert]));
    if (v.defined()) gh = gh + v.mm(f32(l.down.a[b.adapter][b.expert]));
    const auto gu = f32(gate_up.narrow(0, b.row, n));
    const auto g = gu.narrow(1, 0, s.hidden);
    const auto u = act.gated() ? gu.narrow(1, s.hidden, s.hidden) : at::Tensor();
    const auto pw = flat_weights.index_select(0, b.slots).unsqueeze(1);
    const auto h = activate(act, g, u);
    const auto [dg, du] = activate_backward(act, g, u, gh * pw);
    grad_gate_up.narrow(0, b.row, n).copy_(act.gated() ? at::cat({dg, du}, 1) : dg);
    weighted_h.narrow(0, b.row, n).copy_(h * pw);
    grad_weights.index_copy_(0, b.slots, (gh * h).sum(1));
    if (v.defined())
      lora_rows.narrow(0, b.row, n).copy_(at::cat({v, lora_shrink(l, l.down, b, round_bf16(h)) * pw}, 1));
  }
  return {grad_gate_up, weighted_h, grad_weights.view({s.M, s.top_k}), lora_rows};
}

// dX with the gate/up adapters: per slot dg W1[e] + du W3[e] + w_gate A_gate[a, e] + w_up A_up[a, e] with
// w = s_a dg B[a, e] (the K-extension), summed over a token's slots in k order in fp32; lora_rows = [w_gate | w_up]
// (the rows of the gate/up A gradients).
std::tuple<at::Tensor, at::Tensor> moe_lora_grad_x_impl(
    const at::Tensor& grad_gate, const std::optional<at::Tensor>& grad_up, const at::Tensor& w1,
    const std::optional<at::Tensor>& w3, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
    const at::Tensor& num_tokens_post_padded, int64_t top_k, int64_t block_m, bool /*deterministic: k order here*/,
    const at::Tensor& scaling, const std::optional<at::Tensor>& a_gate, const std::optional<at::Tensor>& b_gate,
    const std::optional<at::Tensor>& a_up, const std::optional<at::Tensor>& b_up, int64_t num_experts) {
  const char* op = "moe_lora_grad_x";
  check_grad_x_halves(op, grad_up, w3);
  MoeShape s = check_grad_x_args(op, grad_gate, grad_up.value_or(grad_gate), w1, w3.value_or(w1), sorted_token_ids,
                                 expert_ids, num_tokens_post_padded, top_k, block_m);
  set_global_experts(op, num_experts, s);
  const Lora l = check_lora(op, grad_gate, scaling, s.E, s.dim, s.hidden, w3.has_value(), a_gate, b_gate, a_up, b_up,
                            std::nullopt, std::nullopt, "grad_gate");
  const int64_t slots = s.M * s.top_k;
  auto per_slot = at::zeros({slots, s.dim}, grad_gate.options().dtype(at::kFloat));
  auto lora_rows = at::zeros({slots, l.gate.rank + l.up.rank}, grad_gate.options());
  for (const auto& b : lora_blocks(op, sorted_token_ids, expert_ids, num_tokens_post_padded, slots, s.E, l.n, block_m,
                                   grad_gate.device())) {
    const int64_t n = b.slots.numel();
    const auto dg = f32(grad_gate.narrow(0, b.row, n));
    const auto w_gate = lora_shrink_grad(l, l.gate, b, dg);
    auto dx = dg.mm(f32(w1[b.expert]));
    if (w_gate.defined()) dx += w_gate.mm(f32(l.gate.a[b.adapter][b.expert]));
    at::Tensor w_up;
    if (w3.has_value()) {
      const auto du = f32(grad_up->narrow(0, b.row, n));
      w_up = lora_shrink_grad(l, l.up, b, du);
      dx += du.mm(f32((*w3)[b.expert]));
      if (w_up.defined()) dx += w_up.mm(f32(l.up.a[b.adapter][b.expert]));
    }
    per_slot.index_copy_(0, b.slots, dx);
    lora_rows.narrow(0, b.row, n).copy_(side_by_side({w_gate, w_up}, n, dg.options()));
  }
  return {per_slot.view({s.M, s.top_k, s.dim}).sum(1).to(at::kBFloat16), lora_rows};
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY(flash_moe, m) {
  m.def("moe_align(Tensor topk_ids, int num_experts, int block_m, int bpc, int expert_start, int num_local_experts, "
        "int block_align=1) -> (Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded)");
  m.def("fused_moe_bf16(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, Tensor topk_weights, Tensor(a!) out, int top_k, int block_m, int block_n, "
        "int warp_n, int stages, int bpc, int cpc, bool split) -> ()");
  m.def("moe_forward(Tensor x, Tensor w1, Tensor? w3, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, Tensor topk_weights, int top_k, int block_m, bool deterministic, "
        "bool save_gate_up=False, int num_experts=-1, str activation=\"swiglu\", float alpha=0., float limit=0., "
        "Tensor? b_gate=None, Tensor? b_up=None, Tensor? b2=None) -> (Tensor out, Tensor gate_up)");
  m.def("moe_gate_up(Tensor x, Tensor w1, Tensor? w3, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, int top_k, int block_m, int num_experts=-1, Tensor? b_gate=None, "
        "Tensor? b_up=None) -> Tensor");
  m.def("swiglu_backward(Tensor gate_up, Tensor grad_h, Tensor row_weights, Tensor valid) -> (Tensor grad_gate, "
        "Tensor grad_up, Tensor weighted_h, Tensor grad_row_weights)");
  m.def("moe_grad_gate_up(Tensor grad_out, Tensor w2, Tensor gate_up, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, Tensor topk_weights, int top_k, int block_m, int num_experts=-1, "
        "str activation=\"swiglu\", float alpha=0., float limit=0.) -> "
        "(Tensor grad_gate_up, Tensor weighted_h, Tensor grad_topk_weights)");
  m.def("moe_grad_x(Tensor grad_gate, Tensor? grad_up, Tensor w1, Tensor? w3, Tensor sorted_token_ids, "
        "Tensor expert_ids, Tensor num_tokens_post_padded, int top_k, int block_m, bool deterministic, "
        "int num_experts=-1) -> Tensor");
  m.def("moe_grad_weight(Tensor rows, Tensor source, Tensor row_token, Tensor expert_ends, bool source_major, "
        "bool fp32=False) -> Tensor");
  m.def("quantize_mxfp8(Tensor t, int block) -> (Tensor data, Tensor scales)");
  m.def("share_exponents_mxfp8(Tensor data, Tensor scales) -> (Tensor data, Tensor scales)");
  m.def("fused_moe_mxfp8(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales, Tensor w2, Tensor w2_scales, "
        "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, "
        "Tensor(a!) out, int top_k, int block_m, int block_n, int warp_n, int stages, int bpc, bool split) -> ()");
  m.def("moe_forward_mxfp8(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales, Tensor w2, Tensor w2_scales, "
        "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, int top_k, "
        "int block_m, bool deterministic) -> Tensor");
  m.def("moe_lora_forward(Tensor x, Tensor w1, Tensor? w3, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, Tensor topk_weights, int top_k, int block_m, bool deterministic, "
        "bool save_gate_up, int num_experts, Tensor scaling, Tensor? a_gate, Tensor? b_gate, Tensor? a_up, "
        "Tensor? b_up, Tensor? a_down, Tensor? b_down, str activation=\"swiglu\", float alpha=0., float limit=0., "
        "Tensor? b_gate_bias=None, Tensor? b_up_bias=None, Tensor? b2=None) -> "
        "(Tensor out, Tensor gate_up, Tensor lora_rows)");
  m.def("moe_lora_gate_up(Tensor x, Tensor w1, Tensor? w3, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, int top_k, int block_m, Tensor scaling, Tensor? a_gate, Tensor? b_gate, "
        "Tensor? a_up, Tensor? b_up, int num_experts=-1, Tensor? b_gate_bias=None, Tensor? b_up_bias=None) -> "
        "(Tensor gate_up, Tensor lora_rows)");
  m.def("moe_lora_grad_gate_up(Tensor grad_out, Tensor w2, Tensor gate_up, Tensor sorted_token_ids, "
        "Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, int top_k, int block_m, "
        "Tensor scaling, Tensor? a_down, Tensor? b_down, int num_experts=-1, str activation=\"swiglu\", "
        "float alpha=0., float limit=0.) -> "
        "(Tensor grad_gate_up, Tensor weighted_h, Tensor grad_topk_weights, Tensor lora_rows)");
  m.def("moe_lora_grad_x(Tensor grad_gate, Tensor? grad_up, Tensor w1, Tensor? w3, Tensor sorted_token_ids, "
        "Tensor expert_ids, Tensor num_tokens_post_padded, int top_k, int block_m, bool deterministic, "
        "Tensor scaling, Tensor? a_gate, Tensor? b_gate, Tensor? a_up, Tensor? b_up, int num_experts=-1) -> "
        "(Tensor grad_x, Tensor lora_rows)");
}

TORCH_LIBRARY_IMPL(flash_moe, CPU, m) {
  m.impl("moe_align", &flash_moe::moe_align_cpu);
  m.impl("fused_moe_bf16", &flash_moe::fused_moe_bf16_cpu);
  m.impl("moe_forward", &flash_moe::moe_forward_cpu);
  m.impl("moe_gate_up", &flash_moe::moe_gate_up_cpu);
  m.impl("swiglu_backward", &flash_moe::swiglu_backward_cpu);
  m.impl("moe_grad_gate_up", &flash_moe::moe_grad_gate_up_cpu);
  m.impl("moe_grad_x", &flash_moe::moe_grad_x_cpu);
  m.impl("moe_grad_weight", &flash_moe::moe_grad_weight_cpu);
  m.impl("quantize_mxfp8", &flash_moe::quantize_mxfp8_cpu);
  m.impl("share_exponents_mxfp8", &flash_moe::share_exponents_mxfp8_cpu);
  m.impl("fused_moe_mxfp8", &flash_moe::fused_moe_mxfp8_cpu);
  m.impl("moe_forward_mxfp8", &flash_moe::moe_forward_mxfp8_cpu);
  m.impl("moe_lora_forward", &flash_moe::moe_lora_forward_impl);
  m.impl("moe_lora_gate_up", &flash_moe::moe_lora_gate_up_impl);
  m.impl("moe_lora_grad_gate_up", &flash_moe::moe_lora_grad_gate_up_impl);
  m.impl("moe_lora_grad_x", &flash_moe::moe_lora_grad_x_impl);
}

