"""The ops' fake (meta) implementations and their autograd registrations: static output shapes, so torch.compile
needs no data-dependent sizes; the same checks as the C++ ops (checks.py), so traced calls fail as eager ones do."""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (the ops must exist before their fakes register)
from . import checks
from .contract import CONSTANTS


@torch.library.register_fake("flash_moe::moe_align")
def _(topk_ids, num_experts, block_m, bpc, expert_start, num_local_experts, block_align=1):
    local, n = checks.check_align_args(topk_ids, num_experts, block_m, bpc, expert_start, num_local_experts,
                                       block_align, CONSTANTS)
    return (topk_ids.new_empty(n, dtype=torch.int32), topk_ids.new_empty(n // block_m, dtype=torch.int32),
            topk_ids.new_empty(1, dtype=torch.int32))


@torch.library.register_fake("flash_moe::fused_moe_bf16")
def _(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out, top_k, block_m, block_n,
      warp_n, stages, bpc, cpc, split):
    op = "fused_moe_bf16"
    gate, up = checks.split_gate_up(op, w)
    shape = checks.check_moe_args(op, x, gate, up, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                  topk_weights, top_k, block_m, "w", CONSTANTS)
    checks.check_out(op, out, shape, x)
    return None


@torch.library.register_fake("flash_moe::moe_forward")
def _(x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, block_m,
      deterministic, save_gate_up=False, num_experts=-1, activation="swiglu", alpha=0.0, limit=0.0, b_gate=None,
      b_up=None, b2=None):
    op = "moe_forward"
    gated = checks.parse_activation(op, activation, alpha, limit)
    checks.check_experts(op, x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k,
                         block_m, num_experts, gated, b_gate, b_up, b2, CONSTANTS)
    rows = x.shape[0] * top_k if save_gate_up else 0
    return x.new_empty(x.shape), x.new_empty(rows, (2 if gated else 1) * w1.shape[1])


@torch.library.register_fake("flash_moe::moe_gate_up")
def _(x, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m, num_experts=-1, b_gate=None,
      b_up=None):
    gated = w3 is not None  # the activation itself does not enter g | u
    checks.check_experts("moe_gate_up", x, w1, w3, None, sorted_token_ids, expert_ids, num_tokens_post_padded, None,
                         top_k, block_m, num_experts, gated, b_gate, b_up, None, CONSTANTS)
    return x.new_empty((x.shape[0] * top_k, (2 if gated else 1) * w1.shape[1]))


@torch.library.register_fake("flash_moe::swiglu_backward")
def _(gate_up, grad_h, row_weights, valid):
    checks.check_swiglu_backward_args(gate_up, grad_h, row_weights, valid)
    return (grad_h.new_empty(grad_h.shape), grad_h.new_empty(grad_h.shape), grad_h.new_empty(grad_h.shape),
            row_weights.new_empty(row_weights.shape))


@torch.library.register_fake("flash_moe::moe_grad_gate_up")
def _(grad_out, w2, gate_up, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, block_m,
      num_experts=-1, activation="swiglu", alpha=0.0, limit=0.0):
    op = "moe_grad_gate_up"
    gated = checks.parse_activation(op, activation, alpha, limit)
    M, _, hidden, E = checks.check_grad_gate_up_args(op, grad_out, w2, gate_up, sorted_token_ids, expert_ids,
                                                     num_tokens_post_padded, topk_weights, top_k, block_m, CONSTANTS,
                                                     gated)
    checks.check_global_experts(op, num_experts, E)
    return (grad_out.new_empty((M * top_k, (2 if gated else 1) * hidden)), grad_out.new_empty((M * top_k, hidden)),
            topk_weights.new_empty((M, top_k)))


@torch.library.register_fake("flash_moe::moe_grad_x")
def _(grad_gate, grad_up, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m,
      deterministic, num_experts=-1):
    checks.check_grad_x_halves("moe_grad_x", grad_up, w3)
    M, dim, _, E = checks.check_grad_x_args("moe_grad_x", grad_gate, grad_gate if grad_up is None else grad_up, w1,
                                            w1 if w3 is None else w3, sorted_token_ids, expert_ids,
                                            num_tokens_post_padded, top_k, block_m, CONSTANTS)
    checks.check_global_experts("moe_grad_x", num_experts, E)
    return grad_gate.new_empty((M, dim))


@torch.library.register_fake("flash_moe::moe_grad_weight")
def _(rows, source, row_token, expert_ends, source_major, fp32=False):
    _, N, _, K, E = checks.check_grad_weight_args(rows, source, row_token, expert_ends)
    return rows.new_empty((E, K, N) if source_major else (E, N, K), dtype=torch.float32 if fp32 else rows.dtype)


@torch.library.register_fake("flash_moe::quantize_mxfp8")
def _(t, block):
    checks.check_quantize_args(t, block)
    return (t.new_empty(t.shape, dtype=torch.float8_e4m3fn),
            t.new_empty((*t.shape[:-1], t.shape[-1] // block), dtype=torch.float8_e8m0fnu))


@torch.library.register_fake("flash_moe::share_exponents_mxfp8")
def _(data, scales):
    checks.check_share_args(data, scales, CONSTANTS)
    return (data.new_empty(data.shape, dtype=torch.float8_e4m3fn),
            scales.new_empty(scales.shape, dtype=torch.float8_e8m0fnu))


@torch.library.register_fake("flash_moe::fused_moe_mxfp8")
def _(x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
      out, top_k, block_m, block_n, warp_n, stages, bpc, split):
    op = "fused_moe_mxfp8"
    shape = checks.check_mxfp8_moe_args(op, x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
                                        num_tokens_post_padded, topk_weights, top_k, block_m, CONSTANTS)
    checks.check_out(op, out, shape, x)
    return None


@torch.library.register_fake("flash_moe::moe_forward_mxfp8")
def _(x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
      top_k, block_m, deterministic):
    checks.check_mxfp8_moe_args("moe_forward_mxfp8", x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids,
                                expert_ids, num_tokens_post_padded, topk_weights, top_k, block_m, CONSTANTS)
    return x.new_empty(x.shape, dtype=torch.bfloat16)


@torch.library.register_fake("flash_moe::moe_lora_forward")
def _(x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, block_m,
      deterministic, save_gate_up, num_experts, scaling, a_gate, b_gate, a_up, b_up, a_down, b_down,
      activation="swiglu", alpha=0.0, limit=0.0, b_gate_bias=None, b_up_bias=None, b2=None):
    op = "moe_lora_forward"
    gated = checks.parse_activation(op, activation, alpha, limit)
    M, dim, hidden, E = checks.check_experts(op, x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                             topk_weights, top_k, block_m, num_experts, gated, b_gate_bias, b_up_bias,
                                             b2, CONSTANTS)
    _, r_gate, r_up, _ = checks.check_lora(op, x, scaling, E, dim, hidden, gated, a_gate, b_gate, a_up, b_up, a_down,
                                           b_down, CONSTANTS)
    rows = M * top_k
    return (x.new_empty(x.shape), x.new_empty(rows if save_gate_up else 0, (2 if gated else 1) * hidden),
            x.new_empty(rows, r_gate + r_up))


@torch.library.register_fake("flash_moe::moe_lora_gate_up")
def _(x, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m, scaling, a_gate, b_gate, a_up,
      b_up, num_experts=-1, b_gate_bias=None, b_up_bias=None):
    op = "moe_lora_gate_up"
    gated = w3 is not None  # the activation itself does not enter g | u
    M, dim, hidden, E = checks.check_experts(op, x, w1, w3, None, sorted_token_ids, expert_ids,
                                             num_tokens_post_padded, None, top_k, block_m, num_experts, gated,
                                             b_gate_bias, b_up_bias, None, CONSTANTS)
    _, r_gate, r_up, _ = checks.check_lora(op, x, scaling, E, dim, hidden, gated, a_gate, b_gate, a_up, b_up, None,
                                           None, CONSTANTS)
    return x.new_empty((M * top_k, (2 if gated else 1) * hidden)), x.new_empty((M * top_k, r_gate + r_up))


@torch.library.register_fake("flash_moe::moe_lora_grad_gate_up")
def _(grad_out, w2, gate_up, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, block_m,
      scaling, a_down, b_down, num_experts=-1, activation="swiglu", alpha=0.0, limit=0.0):
    op = "moe_lora_grad_gate_up"
    gated = checks.parse_activation(op, activation, alpha, limit)
    M, dim, hidden, E = checks.check_grad_gate_up_args(op, grad_out, w2, gate_up, sorted_token_ids, expert_ids,
                                                       num_tokens_post_padded, topk_weights, top_k, block_m,
                                                       CONSTANTS, gated)
    checks.check_global_experts(op, num_experts, E)
    _, _, _, r_down = checks.check_lora(op, grad_out, scaling, E, dim, hidden, gated, None, None, None, None, a_down,
                                        b_down, CONSTANTS, "grad_out")
    rows = M * top_k
    return (grad_out.new_empty((rows, (2 if gated else 1) * hidden)), grad_out.new_empty((rows, hidden)),
            topk_weights.new_empty((M, top_k)), grad_out.new_empty((rows, 2 * r_down)))


@torch.library.register_fake("flash_moe::moe_lora_grad_x")
def _(grad_gate, grad_up, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m,
      deterministic, scaling, a_gate, b_gate, a_up, b_up, num_experts=-1):
    op = "moe_lora_grad_x"
    checks.check_grad_x_halves(op, grad_up, w3)
    M, dim, hidden, E = checks.check_grad_x_args(op, grad_gate, grad_gate if grad_up is None else grad_up, w1,
                                                 w1 if w3 is None else w3, sorted_token_ids, expert_ids,
                                                 num_tokens_post_padded, top_k, block_m, CONSTANTS)
    checks.check_global_experts(op, num_experts, E)
    _, r_gate, r_up, _ = checks.check_lora(op, grad_gate, scaling, E, dim, hidden, w3 is not None, a_gate, b_gate,
                                           a_up, b_up, None, None, CONSTANTS, "grad_gate")
    return grad_gate.new_empty((M, dim)), grad_gate.new_empty((M * top_k, r_gate + r_up))


# ---------------------------------------------------------------------------------------------------------------
# The functional ops are forward-only. Without an autograd formula PyTorch differentiates through whatever ATen ops the
# CPU implementation records (a wrong gradient after a warning), so their backward raises instead. fused_moe_bf16 and
# fused_moe_mxfp8 write ``out`` in place, which register_autograd does not take.
def _forward_only(op_name: str, use_instead: str) -> None:
    def backward(ctx, *grads):
        raise RuntimeError(f"flash_moe::{op_name} has no derivative: {use_instead}")

    torch.library.register_autograd(f"flash_moe::{op_name}", backward)


for _op_name in ("moe_forward", "moe_forward_mxfp8"):
    _forward_only(_op_name, "for gradients call prime_kernels_flash_moe.ops.moe (the same forward, with a closed-form "
                            "backward)")
for _op_name in ("moe_lora_forward",):
    _forward_only(_op_name, "for gradients call prime_kernels_flash_moe.ops.moe with lora= (the same forward, with a "
                            "closed-form backward)")
for _op_name in ("moe_gate_up", "swiglu_backward", "moe_grad_gate_up", "moe_grad_x", "moe_lora_gate_up",
                 "moe_lora_grad_gate_up", "moe_lora_grad_x"):
    _forward_only(_op_name, "it is a piece of prime_kernels_flash_moe.ops.moe's closed-form backward, which is "
                            "first-order only (no double backward)")
_forward_only("quantize_mxfp8", "rounding to mxfp8 has none; prime_kernels_flash_moe.ops.moe(mxfp8=True) passes "
                                "gradients straight through to the bf16 weights")
