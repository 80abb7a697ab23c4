// Shared by the CPU and CUDA implementations of flash_moe::*: argument checks and the alignment output sizes.
// Every failure names the argument, what is needed and what was found.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

#ifndef FLASH_MOE_BLOCK_M
#error "FLASH_MOE_BLOCK_M must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_DIM_ALIGN
#error "FLASH_MOE_DIM_ALIGN must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_HIDDEN_ALIGN
#error "FLASH_MOE_HIDDEN_ALIGN must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_MAX_EXPERTS
#error "FLASH_MOE_MAX_EXPERTS must come from kernel.toml ([flash_moe.constants])"
#endif

namespace flash_moe {

constexpr int64_t kBlockM = FLASH_MOE_BLOCK_M;
constexpr int64_t kDimAlign = FLASH_MOE_DIM_ALIGN;
constexpr int64_t kHiddenAlign = FLASH_MOE_HIDDEN_ALIGN;
constexpr int64_t kMaxExperts = FLASH_MOE_MAX_EXPERTS;

// The shape contract, worded exactly as prime_kernels_flash_moe.ops.unsupported_shape_reason words it (a test keeps
// the two in step); empty when supported.
inline std::string contract_reason(int64_t dim, int64_t hidden) {
  if (dim < 1 || hidden < 1)
    return "flash_moe needs positive dim and hidden_dim, got dim=" + std::to_string(dim) +
           ", hidden_dim=" + std::to_string(hidden);
  if (dim % kDimAlign)
    return "flash_moe needs dim (x's last dimension) to be a multiple of " + std::to_string(kDimAlign) + ", got " +
           std::to_string(dim);
  if (hidden % kHiddenAlign)
    return "flash_moe needs hidden_dim to be a multiple of " + std::to_string(kHiddenAlign) + ", got " +
           std::to_string(hidden);
  return {};
}

struct AlignPlan {
  int64_t slots;        // M * top_k
  int64_t local;        // local experts
  int64_t pad;          // block_m * bpc
  int64_t max_padded;   // length of sorted_token_ids
  int64_t max_blocks;   // length of expert_ids
};

inline AlignPlan check_align_args(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_m, int64_t bpc,
                                  int64_t expert_start, int64_t num_local_experts) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt, "moe_align: topk_ids must be int32, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_ids.dim() == 2, "moe_align: topk_ids must be 2-D (M, top_k), got shape ", topk_ids.sizes());
  TORCH_CHECK(num_experts >= 1, "moe_align: num_experts must be positive, got ", num_experts);
  TORCH_CHECK(block_m >= 1, "moe_align: block_m must be positive, got ", block_m);
  TORCH_CHECK(bpc >= 1, "moe_align: bpc (blocks per expert pad unit) must be positive, got ", bpc);
  TORCH_CHECK(expert_start >= 0 && expert_start < num_experts, "moe_align: expert_start must be in [0, num_experts=",
              num_experts, "), got ", expert_start);
  const int64_t local = num_local_experts < 0 ? num_experts - expert_start : num_local_experts;
  TORCH_CHECK(local >= 1 && expert_start + local <= num_experts, "moe_align: num_local_experts must be in [1, ",
              num_experts - expert_start, "] (num_experts - expert_start), got ", local);
  TORCH_CHECK(local <= kMaxExperts, "moe_align: at most ", kMaxExperts, " local experts, got ", local);
  AlignPlan p;
  p.slots = topk_ids.numel();
  TORCH_CHECK(p.slots < (int64_t{1} << 31) - 1, "moe_align: M * top_k must fit in int32, got ", p.slots);
  p.local = local;
  p.pad = block_m * bpc;
  p.max_padded = (p.slots + local * (p.pad - 1) + p.pad - 1) / p.pad * p.pad;
  p.max_blocks = p.max_padded / block_m;
  return p;
}

struct MoeShape {
  int64_t M, dim, hidden, E, top_k, blocks;
};

// gate, up: (E, hidden, dim) views (possibly halves of one (E, 2 hidden, dim) tensor); w2: (E, dim, hidden).
inline MoeShape check_moe_args(const char* op, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                               const at::Tensor& w2, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                               const at::Tensor& num_tokens_post_padded, const at::Tensor* topk_weights,
                               int64_t top_k, int64_t block_m, const char* w_name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (M, dim), got shape ", x.sizes());
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16, op, ": ", w_name,
              " must be bfloat16, got ", gate.scalar_type(), " / ", up.scalar_type());
  TORCH_CHECK(w2.scalar_type() == at::kBFloat16, op, ": w2 must be bfloat16, got ", w2.scalar_type());
  TORCH_CHECK(gate.dim() == 3 && up.dim() == 3, op, ": ", w_name, " must be 3-D expert weights, got shapes ",
              gate.sizes(), " / ", up.sizes());
  TORCH_CHECK(w2.dim() == 3, op, ": w2 must be 3-D (E, dim, hidden), got shape ", w2.sizes());
  MoeShape s;
  s.M = x.size(0);
  s.dim = x.size(1);
  s.E = gate.size(0);
  s.hidden = gate.size(1);
  s.top_k = top_k;
  TORCH_CHECK(up.sizes() == gate.sizes(), op, ": the gate and up weights must have one shape (E, hidden, dim), got ",
              gate.sizes(), " and ", up.sizes());
  TORCH_CHECK(gate.size(2) == s.dim, op, ": ", w_name, "'s last dimension must be dim=", s.dim,
              " (x's last dimension), got ", gate.size(2));
  TORCH_CHECK(w2.size(0) == s.E, op, ": w2 must have E=", s.E, " experts (", w_name, "'s first dimension), got ",
              w2.size(0));
  TORCH_CHECK(w2.size(1) == s.dim && w2.size(2) == s.hidden, op, ": w2 must have shape (E, dim, hidden) = (", s.E,
              ", ", s.dim, ", ", s.hidden, "), got ", w2.sizes());
  const std::string reason = contract_reason(s.dim, s.hidden);
  TORCH_CHECK(reason.empty(), op, ": ", reason);
  TORCH_CHECK(top_k >= 1, op, ": top_k must be positive, got ", top_k);
  TORCH_CHECK(block_m == kBlockM, op, ": block_m must be BLOCK_M=", kBlockM,
              " (the tile the kernels are compiled for; align with the same block_m), got ", block_m);
  TORCH_CHECK(sorted_token_ids.scalar_type() == at::kInt && sorted_token_ids.dim() == 1, op,
              ": sorted_token_ids must be a 1-D int32 tensor, got ", sorted_token_ids.scalar_type(), " of shape ",
              sorted_token_ids.sizes());
  TORCH_CHECK(sorted_token_ids.numel() % block_m == 0, op, ": sorted_token_ids' length must be a multiple of block_m=",
              block_m, ", got ", sorted_token_ids.numel());
  s.blocks = sorted_token_ids.numel() / block_m;
  TORCH_CHECK(expert_ids.scalar_type() == at::kInt && expert_ids.dim() == 1 && expert_ids.numel() == s.blocks, op,
              ": expert_ids must be a 1-D int32 tensor of ", s.blocks, " blocks (len(sorted_token_ids) / block_m), got ",
              expert_ids.scalar_type(), " of shape ", expert_ids.sizes());
  TORCH_CHECK(num_tokens_post_padded.scalar_type() == at::kInt && num_tokens_post_padded.numel() == 1, op,
              ": num_tokens_post_padded must be an int32 tensor of one element, got ",
              num_tokens_post_padded.scalar_type(), " of shape ", num_tokens_post_padded.sizes());
  TORCH_CHECK(s.M * top_k < (int64_t{1} << 31) - 1, op, ": M * top_k must fit in int32, got ", s.M * top_k);
  if (topk_weights != nullptr) {
    TORCH_CHECK(topk_weights->scalar_type() == at::kFloat, op, ": topk_weights must be float32, got ",
                topk_weights->scalar_type());
    TORCH_CHECK(topk_weights->dim() == 2 && topk_weights->size(0) == s.M && topk_weights->size(1) == top_k, op,
                ": topk_weights must have shape (M, top_k) = (", s.M, ", ", top_k, "), got ", topk_weights->sizes());
  }
  for (const at::Tensor* t : {&gate, &up, &w2, &sorted_token_ids, &expert_ids, &num_tokens_post_padded}) {
    TORCH_CHECK(t->device() == x.device(), op, ": every tensor must be on x's device ", x.device(), ", got one on ",
                t->device());
  }
  if (topk_weights != nullptr)
    TORCH_CHECK(topk_weights->device() == x.device(), op, ": topk_weights must be on x's device ", x.device(),
                ", got ", topk_weights->device());
  return s;
}

inline void check_out(const char* op, const at::Tensor& out, const MoeShape& s, const at::Tensor& x) {
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, op, ": out must be bfloat16, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == s.M && out.size(1) == s.dim, op, ": out must have shape (M, dim) = (",
              s.M, ", ", s.dim, "), got ", out.sizes());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous (it is written in place), got strides ",
              out.strides());
  TORCH_CHECK(out.device() == x.device(), op, ": out must be on x's device ", x.device(), ", got ", out.device());
}

}  // namespace flash_moe
