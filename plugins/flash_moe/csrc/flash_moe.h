// Shared by the CPU and CUDA implementations of flash_moe::*: argument checks and the alignment output sizes.
// Every failure names the argument, what is needed and what was found.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#ifndef FLASH_MOE_BLOCK_M
#error "FLASH_MOE_BLOCK_M must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_DIM_ALIGN
#error "FLASH_MOE_DIM_ALIGN must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_HIDDEN_ALIGN
#error "FLASH_MOE_HIDDEN_ALIGN must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_MXFP8_SCALE_BLOCK
#error "FLASH_MOE_MXFP8_SCALE_BLOCK must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_MXFP8_ALIGN
#error "FLASH_MOE_MXFP8_ALIGN must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_MAX_EXPERTS
#error "FLASH_MOE_MAX_EXPERTS must come from kernel.toml ([flash_moe.constants])"
#endif
#ifndef FLASH_MOE_LORA_RANK_ALIGN
#error "FLASH_MOE_LORA_RANK_ALIGN must come from kernel.toml ([flash_moe.constants])"
#endif

namespace flash_moe {

constexpr int64_t kBlockM = FLASH_MOE_BLOCK_M;
constexpr int64_t kDimAlign = FLASH_MOE_DIM_ALIGN;
constexpr int64_t kHiddenAlign = FLASH_MOE_HIDDEN_ALIGN;
constexpr int64_t kMaxExperts = FLASH_MOE_MAX_EXPERTS;
constexpr int64_t kMxScaleBlock = FLASH_MOE_MXFP8_SCALE_BLOCK;
constexpr int64_t kMxAlign = FLASH_MOE_MXFP8_ALIGN;
constexpr int64_t kInt32Max = (int64_t{1} << 31) - 1;
constexpr int64_t kLoraRankAlign = FLASH_MOE_LORA_RANK_ALIGN;
static_assert(kMxAlign % kMxScaleBlock == 0 && kMxAlign % kDimAlign == 0 && kMxAlign % kHiddenAlign == 0,
              "MXFP8_ALIGN must be a multiple of MXFP8_SCALE_BLOCK, DIM_ALIGN and HIDDEN_ALIGN");

// The shape contract, worded exactly as prime_kernels_flash_moe.ops.unsupported_shape_reason words it (a test keeps
// the two in step); empty when supported.
// mxfp8: dim and hidden_dim in whole MXFP8_ALIGN = 128 (four scale blocks of 32: one 128-byte pipeline stage of e4m3
// per K step, and the blocked weight-scale layout groups 4 scale blocks).
inline std::string contract_reason(int64_t dim, int64_t hidden, bool mxfp8 = false) {
  if (dim < 1 || hidden < 1)
    return "flash_moe needs positive dim and hidden_dim, got dim=" + std::to_string(dim) +
           ", hidden_dim=" + std::to_string(hidden);
  const int64_t dim_align = mxfp8 ? kMxAlign : kDimAlign, hidden_align = mxfp8 ? kMxAlign : kHiddenAlign;
  const std::string path = mxfp8 ? " for mxfp8" : "";
  if (dim % dim_align)
    return "flash_moe needs dim (x's last dimension) to be a multiple of " + std::to_string(dim_align) + path +
           ", got " + std::to_string(dim);
  if (hidden % hidden_align)
    return "flash_moe needs hidden_dim to be a multiple of " + std::to_string(hidden_align) + path + ", got " +
           std::to_string(hidden);
  return {};
}

struct AlignPlan {
  int64_t slots;        // M * top_k
  int64_t local;        // local experts
  int64_t pad;          // block_m * bpc
  int64_t span;         // block_m * block_align: each expert's first slot is a multiple of it
  int64_t max_padded;   // length of sorted_token_ids
  int64_t max_blocks;   // length of expert_ids
};

inline AlignPlan check_align_args(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_m, int64_t bpc,
                                  int64_t expert_start, int64_t num_local_experts, int64_t block_align) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "moe_align: topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_ids.dim() == 2, "moe_align: topk_ids must be 2-D (M, top_k), got shape ", topk_ids.sizes());
  TORCH_CHECK(num_experts >= 1, "moe_align: num_experts must be positive, got ", num_experts);
  TORCH_CHECK(block_m >= 1, "moe_align: block_m must be positive, got ", block_m);
  TORCH_CHECK(bpc >= 1, "moe_align: bpc (blocks per expert pad unit) must be positive, got ", bpc);
  TORCH_CHECK(block_align >= 1, "moe_align: block_align (blocks an expert's start is aligned to) must be positive, "
              "got ", block_align);
  TORCH_CHECK(expert_start >= 0 && expert_start < num_experts, "moe_align: expert_start must be in [0, num_experts=",
              num_experts, "), got ", expert_start);
  const int64_t local = num_local_experts < 0 ? num_experts - expert_start : num_local_experts;
  TORCH_CHECK(local >= 1 && expert_start + local <= num_experts, "moe_align: num_local_experts must be in [1, ",
              num_experts - expert_start, "] (num_experts - expert_start), got ", local);
  TORCH_CHECK(local <= kMaxExperts, "moe_align: at most ", kMaxExperts, " local experts, got num_local_experts=",
              local, " (num_experts - expert_start when not given)");
  TORCH_CHECK(expert_start + local - 1 <= kInt32Max, "moe_align: the local experts [expert_start, expert_start + "
              "num_local_experts) must be int32 ids, got expert_start=", expert_start, ", num_local_experts=", local);
  AlignPlan p;
  p.slots = topk_ids.numel();
  TORCH_CHECK(p.slots < kInt32Max, "moe_align: M * top_k must fit in int32, got ", p.slots);
  p.local = local;
  // checked before multiplying: block_m * bpc could overflow int64, and the padding (so the padded length) is int32
  TORCH_CHECK(block_m <= kInt32Max / bpc, "moe_align: block_m * bpc (the pad unit) must fit in int32, got block_m=",
              block_m, ", bpc=", bpc);
  p.pad = block_m * bpc;
  TORCH_CHECK(block_align <= kInt32Max / block_m, "moe_align: block_m * block_align must fit in int32, got block_m=",
              block_m, ", block_align=", block_align);
  p.span = block_m * block_align;
  // aligning an expert's start to a whole span adds fewer than block_align empty blocks after each expert
  p.max_padded = (p.slots + local * (p.pad - 1) + p.pad - 1) / p.pad * p.pad + local * (block_align - 1) * block_m;
  TORCH_CHECK(p.max_padded < kInt32Max, "moe_align: the padded length (sorted_token_ids) must fit in int32, got ",
              p.max_padded, " for M * top_k=", p.slots, ", ", local, " local experts, block_m * bpc=", p.pad,
              ", block_align=", block_align);
  p.max_blocks = p.max_padded / block_m;
  return p;
}

// The expert activations (moe()'s `activation`), on the gate and up pre-activations g, u (fp32, biases included):
//   swiglu   h = silu(g) u
//   gpt_oss  h = (clamp(u, -limit, limit) + 1) gc sigmoid(alpha gc) with gc = min(g, limit) (gpt-oss's experts)
//   relu2    h = relu(g)^2: not gated (no up projection: w3 absent; Nemotron-H's experts)
enum class Activation : int { kSwiGLU = 0, kGptOss = 1, kRelu2 = 2 };
struct ActivationSpec {
  Activation kind;
  float alpha, limit;  // gpt_oss only
  bool gated() const { return kind != Activation::kRelu2; }
};

inline ActivationSpec parse_activation(const char* op, c10::string_view name, double alpha, double limit) {
  ActivationSpec a{Activation::kSwiGLU, static_cast<float>(alpha), static_cast<float>(limit)};
  if (name == "swiglu") {
    a.kind = Activation::kSwiGLU;
  } else if (name == "gpt_oss") {
    a.kind = Activation::kGptOss;
  } else if (name == "relu2") {
    a.kind = Activation::kRelu2;
  } else {
    TORCH_CHECK(false, op, ": activation must be 'swiglu', 'gpt_oss' or 'relu2', got '", std::string(name), "'");
  }
  TORCH_CHECK(a.kind != Activation::kGptOss || (std::isfinite(alpha) && std::isfinite(limit) && limit > 0), op,
              ": activation 'gpt_oss' needs a finite alpha and a finite positive limit, got alpha=", alpha,
              ", limit=", limit);
  return a;
}

// fused_moe_bf16's and the mxfp8 ops' activation (SwiGLU has no constants).
constexpr ActivationSpec kSwiGLU{Activation::kSwiGLU, 0.f, 0.f};

// The up weights (and the other up-side operands) exist for the gated activations only.
inline void check_gated(const char* op, const ActivationSpec& a, bool has_up, const char* up_name) {
  TORCH_CHECK(has_up == a.gated(), op, ": ", up_name, a.gated() ? " is required for a gated activation" :
              " must be None for activation 'relu2' (not gated: w1 alone)", ", got ", has_up ? "a tensor" : "None");
}

// An expert bias: (E, n) bfloat16 on x's device (any strides: the halves of gpt-oss's interleaved bias are views).
inline void check_bias(const char* op, const char* name, const std::optional<at::Tensor>& b, int64_t E, int64_t n,
                       const at::Tensor& x) {
  if (!b.has_value()) return;
  TORCH_CHECK(b->scalar_type() == at::kBFloat16, op, ": ", name, " must be bfloat16, got ", b->scalar_type());
  TORCH_CHECK(b->dim() == 2 && b->size(0) == E && b->size(1) == n, op, ": ", name, " must have shape (E, ", n,
              ") = (", E, ", ", n, "), got ", b->sizes());
  TORCH_CHECK(b->device() == x.device(), op, ": ", name, " must be on x's device ", x.device(), ", got ",
              b->device());
}

// E: the local experts (the weights' first dimension); global_experts: all experts of an expert-parallel run, which
// the CUDA launch rules spread the M * top_k routed slots over (set_global_experts; E unless given).
struct MoeShape {
  int64_t M, dim, hidden, E, top_k, blocks, global_experts;
};

// The ops' num_experts: the global expert count, for the CUDA launch rules' estimate of the routed slots per local
// expert (M * top_k / num_experts, from the shapes: no sync); -1: the local count E (no expert parallelism, or every
// slot of x routed to a local expert).
inline void set_global_experts(const char* op, int64_t num_experts, MoeShape& s) {
  TORCH_CHECK(num_experts == -1 || (num_experts >= s.E && num_experts <= kInt32Max), op,
              ": num_experts (the global expert count) must be -1 or in [E, 2^31 - 1] (E=", s.E,
              " local experts), got ", num_experts);
  s.global_experts = num_experts == -1 ? s.E : num_experts;
}

// gate, up: (E, hidden, dim) views (possibly halves of one (E, 2 hidden, dim) tensor); w2: (E, dim, hidden), or
// nullptr for the ops without a down projection.
inline MoeShape check_moe_args(const char* op, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                               const at::Tensor* w2, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                               const at::Tensor& num_tokens_post_padded, const at::Tensor* topk_weights,
                               int64_t top_k, int64_t block_m, const char* w_name,
                               at::ScalarType dtype = at::kBFloat16, const char* x_name = "x") {
  const bool mxfp8 = dtype == at::kFloat8_e4m3fn;
  const char* dname = mxfp8 ? "float8_e4m3fn" : "bfloat16";
  TORCH_CHECK(x.scalar_type() == dtype, op, ": x must be ", dname, ", got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (M, dim), got shape ", x.sizes());
  TORCH_CHECK(gate.scalar_type() == dtype && up.scalar_type() == dtype, op, ": ", w_name, " must be ", dname,
              ", got ", gate.scalar_type(), " / ", up.scalar_type());
  TORCH_CHECK(gate.dim() == 3 && up.dim() == 3, op, ": ", w_name, " must be 3-D expert weights, got shapes ",
              gate.sizes(), " / ", up.sizes());
  MoeShape s;
  s.M = x.size(0);
  s.dim = x.size(1);
  s.E = gate.size(0);
  s.global_experts = s.E;
  s.hidden = gate.size(1);
  s.top_k = top_k;
  TORCH_CHECK(up.sizes() == gate.sizes(), op, ": the gate and up weights must have one shape (E, hidden, dim), got ",
              gate.sizes(), " and ", up.sizes(), " (", w_name, ")");
  TORCH_CHECK(gate.size(2) == s.dim, op, ": ", w_name, "'s last dimension must be dim=", s.dim,
              " (x's last dimension), got ", gate.size(2));
  if (w2 != nullptr) {
    TORCH_CHECK(w2->scalar_type() == dtype, op, ": w2 must be ", dname, ", got ", w2->scalar_type());
    TORCH_CHECK(w2->dim() == 3, op, ": w2 must be 3-D (E, dim, hidden), got shape ", w2->sizes());
    TORCH_CHECK(w2->size(0) == s.E, op, ": w2 must have E=", s.E, " experts (", w_name, "'s first dimension), got ",
                w2->size(0));
    TORCH_CHECK(w2->size(1) == s.dim && w2->size(2) == s.hidden, op, ": w2 must have shape (E, dim, hidden) = (",
                s.E, ", ", s.dim, ", ", s.hidden, "), got ", w2->sizes());
    TORCH_CHECK(w2->device() == x.device(), op, ": w2 must be on ", x_name, "'s device ", x.device(), ", got ",
                w2->device());
  }
  const std::string reason = contract_reason(s.dim, s.hidden, mxfp8);
  TORCH_CHECK(reason.empty(), op, ": ", reason, " (hidden_dim: ", w_name, "'s second dimension)");
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
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{w_name, &gate}, {w_name, &up},
                         {"sorted_token_ids", &sorted_token_ids}, {"expert_ids", &expert_ids},
                         {"num_tokens_post_padded", &num_tokens_post_padded}}) {
    TORCH_CHECK(t->device() == x.device(), op, ": ", name, " must be on ", x_name, "'s device ", x.device(),
                ", got ", t->device());
  }
  if (topk_weights != nullptr)
    TORCH_CHECK(topk_weights->device() == x.device(), op, ": topk_weights must be on ", x_name, "'s device ",
                x.device(), ", got ", topk_weights->device());
  return s;
}

// The expert operands of the forward ops beyond x: gate and up (E, hidden, dim) views (up is gate again when not
// gated, never read then), the activation and the optional biases.
struct Experts {
  at::Tensor gate, up;
  ActivationSpec act;
  std::optional<at::Tensor> b_gate, b_up, b2;
};

// moe_gate_up / moe_forward's expert operands, checked: w1 (gate), w3 (up, absent when not gated), w2 (nullptr for
// moe_gate_up), the biases; up's checks run on w1 when it is absent.
inline Experts check_experts(const char* op, const at::Tensor& x, const at::Tensor& w1,
                             const std::optional<at::Tensor>& w3, const at::Tensor* w2,
                             const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                             const at::Tensor& num_tokens_post_padded, const at::Tensor* topk_weights, int64_t top_k,
                             int64_t block_m, int64_t num_experts, const ActivationSpec& act,
                             const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                             const std::optional<at::Tensor>& b2, MoeShape& s) {
  check_gated(op, act, w3.has_value(), "w3");
  s = check_moe_args(op, x, w1, w3.value_or(w1), w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                     topk_weights, top_k, block_m, "w1/w3");
  set_global_experts(op, num_experts, s);
  check_bias(op, "b_gate", b_gate, s.E, s.hidden, x);
  TORCH_CHECK(act.gated() || !b_up.has_value(), op, ": b_up must be None for activation 'relu2' (not gated)");
  check_bias(op, "b_up", b_up, s.E, s.hidden, x);
  check_bias(op, "b2", b2, s.E, s.dim, x);
  return Experts{w1, w3.value_or(w1), act, b_gate, b_up, b2};
}

// moe_gate_up's operands: no down projection and no routing weights; gated exactly when w3 is given (the activation
// itself does not enter g | u).
inline Experts check_gate_up_experts(const char* op, const at::Tensor& x, const at::Tensor& w1,
                                     const std::optional<at::Tensor>& w3, const at::Tensor& sorted_token_ids,
                                     const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
                                     int64_t top_k, int64_t block_m, int64_t num_experts,
                                     const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                                     MoeShape& s) {
  const ActivationSpec act{w3.has_value() ? Activation::kSwiGLU : Activation::kRelu2, 0.f, 0.f};
  return check_experts(op, x, w1, w3, nullptr, sorted_token_ids, expert_ids, num_tokens_post_padded, nullptr, top_k,
                       block_m, num_experts, act, b_gate, b_up, std::nullopt, s);
}

// The mxfp8 ops take e4m3 / e8m0 tensors or their uint8 bytes (same layout; torch.library.opcheck's schema check
// compares inputs with allclose, which float8 types lack on CPU, so the conformance samples pass bytes).
inline at::Tensor as_bits_of(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == at::kByte ? t.view(dtype) : t;
}

// quantize_mxfp8's argument checks, the same on every device (each implementation checks the device itself).
inline void check_quantize_args(const at::Tensor& t, int64_t block) {
  const char* op = "quantize_mxfp8";
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, op,
              ": t must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1, op, ": t must have at least one dimension");
  TORCH_CHECK(block >= 1, op, ": block must be positive, got ", block);
  TORCH_CHECK(t.size(-1) % block == 0, op, ": the last dimension must be a multiple of block=", block, ", got ",
              t.size(-1));
}

// share_exponents_mxfp8's argument checks (each implementation checks the device itself).
inline void check_share_args(const at::Tensor& data, const at::Tensor& scales) {
  const char* op = "share_exponents_mxfp8";
  TORCH_CHECK(data.scalar_type() == at::kFloat8_e4m3fn, op, ": data must be float8_e4m3fn, got ", data.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat8_e8m0fnu, op, ": scales must be float8_e8m0fnu, got ",
              scales.scalar_type());
  TORCH_CHECK(data.dim() >= 1 && data.size(-1) % kMxAlign == 0, op, ": data's last dimension must be a multiple of ",
              "MXFP8_ALIGN=", kMxAlign, ", got shape ", data.sizes());
  auto want = data.sizes().vec();
  want.back() /= kMxScaleBlock;
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(want), op, ": scales must have shape (..., K / ", kMxScaleBlock,
              ") = ", at::IntArrayRef(want), ", got ", scales.sizes());
  TORCH_CHECK(scales.device() == data.device(), op, ": scales must be on data's device ", data.device(), ", got ",
              scales.device());
}

// mxfp8 scales: x_scales row-major (M, dim / 32); w_scales / w2_scales in pack_scales_blocked's layout
// (E, K / MXFP8_ALIGN, N, MXFP8_ALIGN / 32): for each expert and each 128-wide K step, the N rows' 4 scale bytes.
inline void check_mx_scales(const char* op, const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w_scales,
                            const at::Tensor& w2_scales, const MoeShape& s) {
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"x_scales", &x_scales}, {"w_scales", &w_scales},
                         {"w2_scales", &w2_scales}}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat8_e8m0fnu, op, ": ", name, " must be float8_e8m0fnu, got ",
                t->scalar_type());
    TORCH_CHECK(t->device() == x.device(), op, ": ", name, " must be on x's device ", x.device(), ", got ",
                t->device());
  }
  const int64_t g = kMxAlign / kMxScaleBlock;
  TORCH_CHECK(x_scales.dim() == 2 && x_scales.size(0) == s.M && x_scales.size(1) == s.dim / kMxScaleBlock, op,
              ": x_scales must have shape (M, dim / ", kMxScaleBlock, ") = (", s.M, ", ", s.dim / kMxScaleBlock,
              "), got ", x_scales.sizes());
  TORCH_CHECK(w_scales.dim() == 4 && w_scales.size(0) == s.E && w_scales.size(1) == s.dim / kMxAlign &&
                  w_scales.size(2) == 2 * s.hidden && w_scales.size(3) == g,
              op, ": w_scales must be pack_scales_blocked's layout (E, dim / ", kMxAlign, ", 2 * hidden, ", g, ") = (",
              s.E, ", ", s.dim / kMxAlign, ", ", 2 * s.hidden, ", ", g, "), got ", w_scales.sizes());
  TORCH_CHECK(w2_scales.dim() == 4 && w2_scales.size(0) == s.E && w2_scales.size(1) == s.hidden / kMxAlign &&
                  w2_scales.size(2) == s.dim && w2_scales.size(3) == g,
              op, ": w2_scales must be pack_scales_blocked's layout (E, hidden / ", kMxAlign, ", dim, ", g, ") = (",
              s.E, ", ", s.hidden / kMxAlign, ", ", s.dim, ", ", g, "), got ", w2_scales.sizes());
}

// The original flash_moe's concatenated weight: w (E, 2 * hidden, dim), gate rows [0, hidden), up rows [hidden, 2 * hidden).
inline std::pair<at::Tensor, at::Tensor> split_gate_up(const char* op, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.size(1) % 2 == 0, op,
              ": w must be 3-D (E, 2 * hidden, dim) with gate rows [0, hidden) and up rows [hidden, 2 * hidden), got "
              "shape ", w.sizes());
  const int64_t hidden = w.size(1) / 2;
  return {w.narrow(1, 0, hidden), w.narrow(1, hidden, hidden)};
}

// The deterministic combine of per-slot expert outputs y [M * top_k, dim] (any float dtype): out[t] = sum over
// k = 0..top_k-1 of topk_weights[t, k] * y[t * top_k + k], accumulated in fp32 in k order, rounded once to bf16.
// The CPU ops pass the weights of the routed slots only (routed_weights_cpu: the others zero).
inline at::Tensor combine_in_k_order(const at::Tensor& y, const at::Tensor& topk_weights, const MoeShape& s) {
  const auto slots = y.view({s.M, s.top_k, s.dim});
  auto acc = at::zeros({s.M, s.dim}, y.options().dtype(at::kFloat));
  for (int64_t k = 0; k < s.top_k; ++k) acc.addcmul_(slots.select(1, k), topk_weights.select(1, k).unsqueeze(1));
  return acc.to(at::kBFloat16);
}

// The same combine on CUDA in one pass (csrc/cuda/combine.cu): y bf16 on the current device; only the slots the
// alignment routes contribute (the weights of the others, which may be NaN or inf, are never read).
at::Tensor combine_in_k_order_cuda(const at::Tensor& y, const at::Tensor& topk_weights, const at::Tensor& sorted,
                                   const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
                                   const MoeShape& s);

inline void check_out(const char* op, const at::Tensor& out, const MoeShape& s, const at::Tensor& x) {
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, op, ": out must be bfloat16, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == s.M && out.size(1) == s.dim, op, ": out must have shape (M, dim) = (",
              s.M, ", ", s.dim, "), got ", out.sizes());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous (it is written in place), got strides ",
              out.strides());
  TORCH_CHECK(out.device() == x.device(), op, ": out must be on x's device ", x.device(), ", got ", out.device());
}

// moe_grad_gate_up: grad_out (M, dim) bf16, w2 (E, dim, hidden) bf16, gate_up (M * top_k, 2 hidden) bf16 (what
// moe_gate_up returns; (M * top_k, hidden) when not gated), the alignment, topk_weights (M, top_k) float32, all on
// grad_out's device.
inline MoeShape check_grad_gate_up_args(const char* op, const at::Tensor& grad_out, const at::Tensor& w2,
                                        const at::Tensor& gate_up, const at::Tensor& sorted_token_ids,
                                        const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
                                        const at::Tensor& topk_weights, int64_t top_k, int64_t block_m,
                                        bool gated = true) {
  TORCH_CHECK(w2.scalar_type() == at::kBFloat16, op, ": w2 must be bfloat16, got ", w2.scalar_type());
  TORCH_CHECK(w2.dim() == 3, op, ": w2 must be 3-D (E, dim, hidden), got shape ", w2.sizes());
  TORCH_CHECK(grad_out.scalar_type() == at::kBFloat16, op, ": grad_out must be bfloat16, got ",
              grad_out.scalar_type());
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(1) == w2.size(1), op,
              ": grad_out must be 2-D (M, dim) with dim = w2's second dimension ", w2.size(1), ", got shape ",
              grad_out.sizes());
  // the gate/up argument checks on w2's (E, hidden, dim) view: grad_out plays x's part
  const auto w2_t = w2.transpose(1, 2);
  const MoeShape s = check_moe_args(op, grad_out, w2_t, w2_t, &w2, sorted_token_ids, expert_ids,
                                    num_tokens_post_padded, &topk_weights, top_k, block_m, "w2 (as (E, hidden, dim))",
                                    at::kBFloat16, "grad_out");
  const int64_t width = gated ? 2 * s.hidden : s.hidden;  // g | u, or g alone (relu2)
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.size(0) == s.M * top_k &&
                  gate_up.size(1) == width,
              op, ": gate_up must be bfloat16 of shape (M * top_k, ", gated ? "2 * hidden" : "hidden", ") = (",
              s.M * top_k, ", ", width, "), got ", gate_up.scalar_type(), " of shape ", gate_up.sizes());
  TORCH_CHECK(gate_up.device() == grad_out.device(), op, ": gate_up must be on grad_out's device ", grad_out.device(),
              ", got ", gate_up.device());
  return s;
}

// moe_grad_x's up-side operands: both given (gated) or both None (relu2: dx from dg and w1 alone).
inline void check_grad_x_halves(const char* op, const std::optional<at::Tensor>& grad_up,
                                const std::optional<at::Tensor>& w3) {
  TORCH_CHECK(grad_up.has_value() == w3.has_value(), op,
              ": grad_up and w3 must both be tensors (a gated activation) or both None (relu2), got grad_up ",
              grad_up.has_value() ? "a tensor" : "None", " and w3 ", w3.has_value() ? "a tensor" : "None");
}

// moe_grad_x: grad_gate, grad_up (M * top_k, hidden) bf16 (the halves of what moe_grad_gate_up returns, or any two
// such tensors), w1 / w3 (E, hidden, dim)
// bf16, the alignment, all on grad_gate's device. M = rows / top_k.
inline MoeShape check_grad_x_args(const char* op, const at::Tensor& grad_gate, const at::Tensor& grad_up,
                                  const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& sorted_token_ids,
                                  const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
                                  int64_t top_k, int64_t block_m) {
  TORCH_CHECK(top_k >= 1, op, ": top_k must be positive, got ", top_k);
  TORCH_CHECK(w1.dim() == 3, op, ": w1/w3 must be 3-D expert weights (E, hidden, dim), got shape ", w1.sizes());
  TORCH_CHECK(grad_gate.scalar_type() == at::kBFloat16 && grad_gate.dim() == 2 && grad_gate.size(0) % top_k == 0 &&
                  grad_gate.size(1) == w1.size(1),
              op, ": grad_gate must be bfloat16 of shape (M * top_k, hidden) with hidden = w1's second dimension ",
              w1.size(1), ", got ", grad_gate.scalar_type(), " of shape ", grad_gate.sizes());
  TORCH_CHECK(grad_up.scalar_type() == at::kBFloat16 && grad_up.sizes() == grad_gate.sizes(), op,
              ": grad_up must be bfloat16 of grad_gate's shape ", grad_gate.sizes(), ", got ", grad_up.scalar_type(),
              " of shape ", grad_up.sizes());
  TORCH_CHECK(grad_up.device() == grad_gate.device(), op, ": grad_up must be on grad_gate's device ",
              grad_gate.device(), ", got ", grad_up.device());
  // the gate/up argument checks with a stand-in for x (M, dim) on grad_gate's device: no memory behind it
  const auto x = at::empty({1, 1}, grad_gate.options()).expand({grad_gate.size(0) / top_k, w1.size(2)});
  return check_moe_args(op, x, w1, w3, nullptr, sorted_token_ids, expert_ids, num_tokens_post_padded, nullptr, top_k,
                        block_m, "w1/w3", at::kBFloat16, "grad_gate");
}

// moe_grad_weight: rows (S, N) bf16 (a per-slot tensor in the alignment's compact, expert-sorted order: dg, du or
// p h), source (T, K) bf16 (a per-token tensor: x or grad_out), row_token (S,) int32 (the source row of each slot
// row), expert_ends (E,) int32 (expert e owns rows [expert_ends[e - 1], expert_ends[e])), all on rows' device.
struct GradWeightShape {
  int64_t S, N, T, K, E;
};
inline GradWeightShape check_grad_weight_args(const at::Tensor& rows, const at::Tensor& source,
                                              const at::Tensor& row_token, const at::Tensor& expert_ends) {
  const char* op = "moe_grad_weight";
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && rows.dim() == 2, op,
              ": rows must be a 2-D bfloat16 tensor (S, N), got ", rows.scalar_type(), " of shape ", rows.sizes());
  TORCH_CHECK(source.scalar_type() == at::kBFloat16 && source.dim() == 2, op,
              ": source must be a 2-D bfloat16 tensor (T, K), got ", source.scalar_type(), " of shape ",
              source.sizes());
  GradWeightShape s{rows.size(0), rows.size(1), source.size(0), source.size(1), expert_ends.numel()};
  // whole 16-byte units per row: the kernel copies rows in 16-byte pieces
  TORCH_CHECK(s.N % 8 == 0 && s.K % 8 == 0, op, ": rows' and source's widths must be multiples of 8, got N=", s.N,
              ", K=", s.K);
  TORCH_CHECK(s.S <= kInt32Max && s.T <= kInt32Max && s.N <= kInt32Max && s.K <= kInt32Max, op,
              ": rows and source must have fewer than 2^31 rows and columns, got ", rows.sizes(), " and ",
              source.sizes());
  TORCH_CHECK(row_token.scalar_type() == at::kInt && row_token.dim() == 1 && row_token.size(0) == s.S, op,
              ": row_token must be a 1-D int32 tensor of S=", s.S, " entries (rows' first dimension), got ",
              row_token.scalar_type(), " of shape ", row_token.sizes());
  TORCH_CHECK(expert_ends.scalar_type() == at::kInt && expert_ends.dim() == 1 && s.E >= 1, op,
              ": expert_ends must be a 1-D int32 tensor with one entry per expert, got ", expert_ends.scalar_type(),
              " of shape ", expert_ends.sizes());
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"source", &source}, {"row_token", &row_token},
                         {"expert_ends", &expert_ends}}) {
    TORCH_CHECK(t->device() == rows.device(), op, ": ", name, " must be on rows' device ", rows.device(), ", got ",
                t->device());
  }
  return s;
}

// swiglu_backward: gate_up (S, 2 hidden) bf16, grad_h (S, hidden) bf16, row_weights (S) float32, valid (S) bool, all
// on one device; returns hidden.
inline int64_t check_swiglu_backward_args(const at::Tensor& gate_up, const at::Tensor& grad_h,
                                          const at::Tensor& row_weights, const at::Tensor& valid) {
  const char* op = "swiglu_backward";
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op,
              ": gate_up must be a 2-D bfloat16 tensor (S, 2 * hidden), got ", gate_up.scalar_type(), " of shape ",
              gate_up.sizes());
  const int64_t rows = gate_up.size(0), hidden = gate_up.size(1) / 2;
  TORCH_CHECK(rows < (int64_t{1} << 31) - 1, op, ": gate_up must have at most 2^31 - 2 rows, got ", rows);
  TORCH_CHECK(grad_h.scalar_type() == at::kBFloat16 && grad_h.dim() == 2 && grad_h.size(0) == rows &&
                  grad_h.size(1) == hidden,
              op, ": grad_h must be bfloat16 of shape (S, hidden) = (", rows, ", ", hidden, "), got ",
              grad_h.scalar_type(), " of shape ", grad_h.sizes());
  TORCH_CHECK(row_weights.scalar_type() == at::kFloat && row_weights.dim() == 1 && row_weights.size(0) == rows, op,
              ": row_weights must be float32 of shape (S,) = (", rows, ",), got ", row_weights.scalar_type(),
              " of shape ", row_weights.sizes());
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 1 && valid.size(0) == rows, op,
              ": valid must be bool of shape (S,) = (", rows, ",), got ", valid.scalar_type(), " of shape ",
              valid.sizes());
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_h", &grad_h}, {"row_weights", &row_weights},
                         {"valid", &valid}}) {
    TORCH_CHECK(t->device() == gate_up.device(), op, ": ", name, " must be on gate_up's device ", gate_up.device(),
                ", got ", t->device());
  }
  return hidden;
}

// ------------------------------------------------------------------------------------------------------------------
// LoRA adapters on the experts (the moe_lora_* ops). n adapters, each with one low-rank pair per adapted projection:
// A (n, E, r, in), B (n, E, out, r), bf16, and a per-adapter scaling (n,) float32. The routed slots are aligned over
// E * n groups, expert-major: group v = e * n + adapter (one adapter's rows of one expert per aligned block, an
// expert's adapters adjacent), so expert_ids holds group ids in [-1, E * n).
struct LoraPair {
  at::Tensor a, b;  // undefined: the projection has no adapter
  int64_t rank = 0;
  bool present() const { return a.defined(); }
};
struct Lora {
  int64_t n;
  at::Tensor scaling;
  LoraPair gate, up, down;
};

// One projection's pair: both given or both None, A (n, E, r, in) and B (n, E, out, r) bfloat16 with one rank r, a
// multiple of LORA_RANK_ALIGN, on x's device.
inline LoraPair check_lora_pair(const char* op, const char* a_name, const char* b_name,
                                const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b, int64_t n,
                                int64_t E, int64_t in, int64_t out, const at::Tensor& x, const char* x_name) {
  TORCH_CHECK(a.has_value() == b.has_value(), op, ": ", a_name, " and ", b_name,
              " must both be tensors (the projection has an adapter) or both None, got ", a_name, " ",
              a.has_value() ? "a tensor" : "None", " and ", b_name, " ", b.has_value() ? "a tensor" : "None");
  if (!a.has_value()) return {};
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{a_name, &*a}, {b_name, &*b}}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, op, ": ", name, " must be bfloat16 (the weights' dtype), got ",
                t->scalar_type());
    TORCH_CHECK(t->device() == x.device(), op, ": ", name, " must be on ", x_name, "'s device ", x.device(), ", got ",
                t->device());
  }
  TORCH_CHECK(a->dim() == 4 && a->size(0) == n && a->size(1) == E && a->size(3) == in, op, ": ", a_name,
              " must have shape (n_adapters, E, r, in) = (", n, ", ", E, ", r, ", in, "), got ", a->sizes());
  const int64_t r = a->size(2);
  TORCH_CHECK(r >= 1 && r % kLoraRankAlign == 0, op, ": ", a_name, "'s rank (third dimension) must be a positive "
              "multiple of LORA_RANK_ALIGN=", kLoraRankAlign, ", got ", r);
  TORCH_CHECK(b->dim() == 4 && b->size(0) == n && b->size(1) == E && b->size(2) == out && b->size(3) == r, op, ": ",
              b_name, " must have shape (n_adapters, E, out, r) = (", n, ", ", E, ", ", out, ", ", r, ") (r: ", a_name,
              "'s rank), got ", b->sizes());
  return {*a, *b, r};
}

// The adapters of the projections an op reads (gate/up: dim -> hidden; down: hidden -> dim), on the device of its first
// operand (x_name); the alignment's groups (expert_ids' range) are then E * n.
inline Lora check_lora(const char* op, const at::Tensor& x, const at::Tensor& scaling, int64_t E, int64_t dim,
                       int64_t hidden, bool gated, const std::optional<at::Tensor>& a_gate,
                       const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& a_up,
                       const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& a_down,
                       const std::optional<at::Tensor>& b_down, const char* x_name = "x") {
  TORCH_CHECK(scaling.scalar_type() == at::kFloat && scaling.dim() == 1 && scaling.size(0) >= 1, op,
              ": scaling must be a 1-D float32 tensor of one factor per adapter, got ", scaling.scalar_type(),
              " of shape ", scaling.sizes());
  TORCH_CHECK(scaling.device() == x.device(), op, ": scaling must be on ", x_name, "'s device ", x.device(), ", got ",
              scaling.device());
  Lora l;
  l.n = scaling.size(0);
  TORCH_CHECK(E * l.n <= kInt32Max, op, ": E * n_adapters (the aligned groups) must fit in int32, got E=", E,
              ", n_adapters=", l.n);
  l.scaling = scaling;
  l.gate = check_lora_pair(op, "a_gate", "b_gate", a_gate, b_gate, l.n, E, dim, hidden, x, x_name);
  TORCH_CHECK(gated || !a_up.has_value(), op, ": a_up and b_up must be None without w3 (activation 'relu2': no up "
              "projection), got a tensor");
  l.up = check_lora_pair(op, "a_up", "b_up", a_up, b_up, l.n, E, dim, hidden, x, x_name);
  l.down = check_lora_pair(op, "a_down", "b_down", a_down, b_down, l.n, E, hidden, dim, x, x_name);
  return l;
}

}  // namespace flash_moe
