// flash_moe: the op schemas and their CPU implementations (always built, so the ops exist and are testable anywhere).
//
//   moe_align       counting sort of the routed slots (token t, choice k) -> flat slot t * top_k + k by local expert,
//                   stable within an expert, every expert padded to block_m * bpc with -1, one expert id per block.
//   fused_moe_bf16  out[t] = sum_k topk_weights[t, k] * (silu(x_t Wg^T) * (x_t Wu^T)) W2^T over the slots of the
//                   aligned blocks, with w = [Wg; Wu] (E, 2 hidden, dim); writes every row of `out` (zeroes unrouted).
//   moe_forward     the same with the gate and up weights as two tensors (E, hidden, dim), returning out; the
//                   `deterministic` flag selects a fixed-order combine on CUDA (the CPU combine is always fixed-order).
//
// CPU numerics: bf16 inputs, fp32 GEMM accumulation, SwiGLU in fp32, the intermediate rounded to bf16 (as the CUDA
// kernels store it), per-slot expert outputs in fp32, combined in k order in fp32, rounded once to bf16.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "flash_moe.h"

namespace flash_moe {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_align_cpu(const at::Tensor& topk_ids, int64_t num_experts,
                                                             int64_t block_m, int64_t bpc, int64_t expert_start,
                                                             int64_t num_local_experts) {
  const AlignPlan p = check_align_args(topk_ids, num_experts, block_m, bpc, expert_start, num_local_experts);
  TORCH_CHECK(topk_ids.device().is_cpu(), "moe_align (CPU): topk_ids must be a CPU tensor, got ", topk_ids.device());
  const auto ids_c = topk_ids.contiguous();
  const int32_t* ids = ids_c.const_data_ptr<int32_t>();
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
    total += padded;
  }
  int32_t* sp = sorted.mutable_data_ptr<int32_t>();
  for (int64_t s = 0; s < p.slots; ++s) {
    const int64_t loc = static_cast<int64_t>(ids[s]) - expert_start;
    if (ids[s] >= 0 && loc >= 0 && loc < p.local) sp[cursor[loc]++] = static_cast<int32_t>(s);
  }
  ntpp.mutable_data_ptr<int32_t>()[0] = static_cast<int32_t>(total);
  return {sorted, eids, ntpp};
}

// Per-slot expert outputs y[slot] = (silu(x_t Wg^T) * (x_t Wu^T)) W2^T in fp32, zero for slots no block covers.
at::Tensor slot_outputs_cpu(const char* op, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                            const at::Tensor& w2, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                            const at::Tensor& num_tokens_post_padded, const MoeShape& s, int64_t block_m) {
  TORCH_CHECK(x.device().is_cpu(), op, " (CPU): x must be a CPU tensor, got ", x.device());
  const int64_t slots = s.M * s.top_k;
  auto y = at::zeros({slots, s.dim}, x.options().dtype(at::kFloat));
  const int64_t ntp = num_tokens_post_padded.item<int32_t>();
  TORCH_CHECK(ntp >= 0 && ntp <= sorted_token_ids.numel() && ntp % block_m == 0, op,
              ": num_tokens_post_padded must be a multiple of block_m=", block_m, " in [0, ",
              sorted_token_ids.numel(), "] (len(sorted_token_ids)), got ", ntp);
  const auto sorted_c = sorted_token_ids.contiguous();
  const auto eids_c = expert_ids.contiguous();
  const int32_t* sp = sorted_c.const_data_ptr<int32_t>();
  const int32_t* ep = eids_c.const_data_ptr<int32_t>();
  std::vector<int64_t> slot_list;
  for (int64_t b = 0; b < ntp / block_m; ++b) {
    const int64_t e = ep[b];
    TORCH_CHECK(e >= -1 && e < s.E, op, ": expert_ids must be in [-1, E=", s.E, "), got ", e, " for block ", b);
    if (e < 0) continue;
    slot_list.clear();
    for (int64_t r = 0; r < block_m; ++r) {
      const int64_t slot = sp[b * block_m + r];
      TORCH_CHECK(slot >= -1 && slot < slots, op, ": sorted_token_ids must be in [-1, M * top_k=", slots, "), got ",
                  slot, " at position ", b * block_m + r);
      if (slot >= 0) slot_list.push_back(slot);
    }
    if (slot_list.empty()) continue;
    const auto slot_t = at::tensor(slot_list, x.options().dtype(at::kLong));
    const auto xb = x.index_select(0, at::floor_divide(slot_t, s.top_k)).to(at::kFloat);
    const auto g = xb.mm(gate[e].to(at::kFloat).t());
    const auto u = xb.mm(up[e].to(at::kFloat).t());
    const auto h = (at::silu(g) * u).to(at::kBFloat16).to(at::kFloat);
    y.index_copy_(0, slot_t, h.mm(w2[e].to(at::kFloat).t()));
  }
  return y;
}

void fused_moe_bf16_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w2,
                        const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                        const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor out,
                        int64_t top_k, int64_t block_m, int64_t /*block_n*/, int64_t /*warp_n*/, int64_t /*stages*/,
                        int64_t /*bpc*/, int64_t /*cpc*/, bool /*split*/) {
  const char* op = "fused_moe_bf16";
  TORCH_CHECK(w.dim() == 3 && w.size(1) % 2 == 0, op,
              ": w must be 3-D (E, 2 * hidden, dim) with gate rows [0, hidden) and up rows [hidden, 2 * hidden), got "
              "shape ", w.sizes());
  const int64_t hidden = w.size(1) / 2;
  const auto gate = w.narrow(1, 0, hidden), up = w.narrow(1, hidden, hidden);
  const MoeShape s = check_moe_args(op, x, gate, up, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                    &topk_weights, top_k, block_m, "w");
  check_out(op, out, s, x);
  const auto y = slot_outputs_cpu(op, x, gate, up, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m);
  out.copy_((y.view({s.M, top_k, s.dim}) * topk_weights.unsqueeze(-1)).sum(1));
}

at::Tensor moe_forward_cpu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                           const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                           const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, int64_t top_k,
                           int64_t block_m, bool /*deterministic: the CPU combine is always in k order*/) {
  const char* op = "moe_forward";
  const MoeShape s = check_moe_args(op, x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                    &topk_weights, top_k, block_m, "w1/w3");
  const auto y = slot_outputs_cpu(op, x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, s, block_m);
  return (y.view({s.M, top_k, s.dim}) * topk_weights.unsqueeze(-1)).sum(1).to(at::kBFloat16);
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY(flash_moe, m) {
  m.def("moe_align(Tensor topk_ids, int num_experts, int block_m, int bpc, int expert_start, int num_local_experts)"
        " -> (Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded)");
  m.def("fused_moe_bf16(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, Tensor topk_weights, Tensor(a!) out, int top_k, int block_m, int block_n, "
        "int warp_n, int stages, int bpc, int cpc, bool split) -> ()");
  m.def("moe_forward(Tensor x, Tensor w1, Tensor w3, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded, Tensor topk_weights, int top_k, int block_m, bool deterministic) -> Tensor");
}

TORCH_LIBRARY_IMPL(flash_moe, CPU, m) {
  m.impl("moe_align", &flash_moe::moe_align_cpu);
  m.impl("fused_moe_bf16", &flash_moe::fused_moe_bf16_cpu);
  m.impl("moe_forward", &flash_moe::moe_forward_cpu);
}
