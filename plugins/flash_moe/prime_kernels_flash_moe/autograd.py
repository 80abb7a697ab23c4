"""moe()'s autograd: the forward through the fused kernels, the backward in closed form through the backward's
kernels (bf16), and the mxfp8 forward with its straight-through bf16 backward."""
from __future__ import annotations

import torch

from . import _C  # noqa: F401
from .contract import BLOCK_M, CONSTANTS, MXFP8_ALIGN
from .layouts import ExpertLayout, Family, expert_views, join_pairs, split_pairs
from .lora import ADAPTER_INPUTS, LoraOperands, adapter_grads
from .mxfp8 import dequantize_mxfp8, quantize_mxfp8, unpack_scales_blocked


class _FirstOrderOnly(torch.autograd.Function):
    """Passes moe's gradients through unchanged and raises if they are differentiated: the closed-form backward is
    first-order only. Anchored on the tensors the gradients depend on (``anchors``), so the error comes from the
    second backward itself, not from create_graph=True alone."""

    @staticmethod
    def forward(ctx, n_grads, *tensors):
        return tensors[:n_grads]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("moe: double backward is not supported: its closed-form backward is first-order only "
                           "(differentiate moe's gradients elsewhere, or use a PyTorch MoE for second derivatives)")


def _first_order_only(grads, anchors):
    """``grads`` (tensors or None), differentiable into the error above when a second backward is being recorded
    (``anchors``: the inputs they depend on; None, an absent w3, is passed by)."""
    anchors = [a for a in anchors if a is not None]
    if not torch.is_grad_enabled() or not any(a.requires_grad for a in anchors):
        return grads
    present = [g for g in grads if g is not None]
    wrapped = iter(_FirstOrderOnly.apply(len(present), *present, *anchors))
    return tuple(None if g is None else next(wrapped) for g in grads)


def gate_and_up(w1, w3):
    """The gate and up weights (E, hidden, dim): w1 and w3, or the two halves of a stacked w1 (E, 2 hidden, dim) when
    w3 is None (views: the kernels read them in place)."""
    if w3 is not None:
        return w1, w3
    hidden = w1.shape[1] // 2
    return w1[:, :hidden], w1[:, hidden:]


# The gradients _closed_form_backward computes, in the order of MoE.forward's tensor inputs (the LoRA scaling is not
# differentiated).
GRAD_INPUTS = ("x", "w1", "w2", "w3", "b1", "b2", "topk_ids", "topk_weights", "lora_scaling", *ADAPTER_INPUTS)


class MoE(torch.autograd.Function):
    """moe() in bf16 through the fused ops. The family travels as plain values (activation, alpha, limit, gate_up,
    transposed), which torch.compile traces as constants. With LoRA adapters (``lora_scaling`` a tensor), topk_ids are
    the slots' (expert, adapter) groups (lora.group_ids: expert_start 0, num_experts E * n_adapters) and the
    moe_lora_* ops run in place of the base ones."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, b1, b2, topk_ids, topk_weights, lora_scaling, a_gate, b_gate, a_up, b_up, a_down,
                b_down, activation, alpha, limit, gate_up_form, transposed, expert_start, num_experts, global_experts,
                deterministic, recompute_gate_up):
        family = Family(activation, alpha, limit, ExpertLayout(gate_up_form, transposed))
        top_k = topk_ids.shape[1]
        tw = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        gate, up, w2v, b_gate_bias, b_up_bias = expert_views(w1, w2, w3, b1, family)
        groups = num_experts - expert_start if lora_scaling is not None else gate.shape[0]
        align = torch.ops.flash_moe.moe_align(topk_ids, num_experts, BLOCK_M, 1, expert_start, groups,
                                              CONSTANTS["CLUSTER_BLOCKS"])
        save = not recompute_gate_up and any(ctx.needs_input_grad[:len(GRAD_INPUTS)])
        lora_rows = None
        if lora_scaling is None:
            out, gate_up = torch.ops.flash_moe.moe_forward(x, gate, up, w2v, *align, tw, top_k, BLOCK_M, deterministic,
                                                           save, global_experts, activation, alpha, limit, b_gate_bias,
                                                           b_up_bias, b2)
        else:
            out, gate_up, lora_rows = torch.ops.flash_moe.moe_lora_forward(
                x, gate, up, w2v, *align, tw, top_k, BLOCK_M, deterministic, save, global_experts, lora_scaling,
                a_gate, b_gate, a_up, b_up, a_down, b_down, activation, alpha, limit, b_gate_bias, b_up_bias, b2)
        ctx.save_for_backward(x, w1, w2, w3, b1, b2, topk_ids, tw, *align, gate_up, topk_weights, lora_scaling, a_gate,
                              b_gate, a_up, b_up, a_down, b_down, lora_rows if save else None)
        ctx.family = family
        ctx.saved_gate_up = save
        ctx.deterministic = deterministic
        ctx.expert_start = expert_start
        ctx.global_experts = global_experts
        ctx.tw_dtype = topk_weights.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w2, w3, b1, b2, ids, tw, *align, gate_up, topk_weights, scaling = ctx.saved_tensors[:14]
        adapters, lora_rows = ctx.saved_tensors[14:20], ctx.saved_tensors[20]
        lora = None if scaling is None else LoraOperands(scaling, *adapters, lora_rows)
        needs = dict(zip(GRAD_INPUTS, ctx.needs_input_grad))
        with torch.no_grad():
            grads = _closed_form_backward(grad_out, x, w1, w2, w3, b1, b2, ids, tw, align, needs, ctx.family,
                                          ctx.expert_start, ctx.global_experts, ctx.tw_dtype, ctx.deterministic,
                                          gate_up if ctx.saved_gate_up else None, lora)
        anchors = (grad_out, x, w1, w2, w3, b1, b2, topk_weights, *adapters)
        return (*_first_order_only(grads, anchors), *[None] * 10)


def _closed_form_backward(grad_out, x, w1, w2, w3, b1, b2, ids, tw, align, needs, family, expert_start,
                          global_experts, tw_dtype, deterministic, gate_up=None, lora: LoraOperands | None = None):
    """The gradients of MoE.forward's tensor inputs (GRAD_INPUTS; None for topk_ids), each in its input's layout,
    for those ``needs`` names. ``global_experts``: the expert count the launch rules spread the routed slots over
    (the ops' num_experts).

    Per routed slot s (token t, expert e, weight p), on the ops' views of the weights (layouts.expert_views): the
    pre-activations g | u (biases included) recomputed by the fused gate/up kernel (``moe_gate_up``) unless the
    forward kept them (``gate_up``); ``moe_grad_gate_up`` (one GEMM kernel on CUDA) forms grad_h = grad_out_t W2[e]
    (unweighted, fp32, never stored) and from it the activation's dg, du, p h and dL/dp = grad_h . h; the weight
    gradients are per-expert GEMMs over the slots sorted by expert with x / grad_out gathered by token
    (``moe_grad_weight``, one kernel each with the gathers inside, where ``_fused_weight_grads`` says it is the faster
    path; else gathers + ``torch._grouped_mm``; fp32 accumulation in both), written in the weight's own layout where
    that is a GEMM's output order (transposed weights: the source-major product; gate and up interleaved: dg | du
    interleaved the same way first); ``moe_grad_x`` (one GEMM kernel on CUDA) gives dx = sum over a token's slots of dg W1[e]
    + du W3[e] in fp32: in k order when ``deterministic`` (bitwise reproducible), else with fp32 atomics on CUDA. When
    w2's gradient alone is needed (SwiGLU), the grad_h GEMM is skipped (``swiglu_backward`` on zeros gives p h).
    Biases: db1 = per-expert sums of dg | du (a grouped GEMM against ones: fp32 accumulation, deterministic);
    db2[e] = sum of p grad_out_t over e's slots, and each slot's dL/dp gains grad_out_t . b2[e], both from dense
    (tokens x experts) products.
    LoRA (``lora``; ``ids`` are then (expert, adapter) groups, lora.py): the moe_lora_* ops in place of moe_gate_up,
    moe_grad_gate_up and moe_grad_x (their adapter terms in grad_h and dx, and the rank-r rows of the adapters'
    gradients, which lora.adapter_grads forms per group); the rows sorted by group keep each expert's rows together,
    so the base weight gradients (when needed: frozen base weights cost no GEMM) run per expert as without adapters.
    """
    gate, up, w2v, b_gate, b_up = expert_views(w1, w2, w3, b1, family)
    layout = family.layout
    T = x.shape[0]
    top_k = ids.shape[1]
    E, hidden = gate.shape[0], gate.shape[1]
    S = T * top_k
    n = 1 if lora is None else lora.n  # groups per expert: its adapters
    # slots sorted by local group, stable (moe_align's order, which moe_gate_up's rows follow); unrouted slots last
    local = ids.reshape(-1).long() - expert_start
    valid = (ids.reshape(-1) >= 0) & (local >= 0) & (local < E * n)
    key = torch.where(valid, local, torch.full_like(local, E * n))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(E * n + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    group_ends = torch.cumsum(counts[:E * n], 0).to(torch.int32)
    offs = group_ends[n - 1::n].contiguous()  # each expert's end: its adapters' groups are adjacent
    ok = valid[order]
    tok = order // top_k
    row_token = torch.where(ok, tok, -1).to(torch.int32)  # moe_grad_weight's gather rows: each sorted slot's token

    grads = dict.fromkeys(GRAD_INPUTS)
    go = grad_out.to(x.dtype)
    if gate_up is None and lora is None:
        gate_up = torch.ops.flash_moe.moe_gate_up(x, gate, up, *align, top_k, BLOCK_M, global_experts, b_gate, b_up)
    elif gate_up is None:  # the forward kept g | u and [u_gate | u_up] together, or neither
        gate_up, lora.gate_up_rows = torch.ops.flash_moe.moe_lora_gate_up(
            x, gate, up, *align, top_k, BLOCK_M, lora.scaling, lora.a_gate, lora.b_gate, lora.a_up, lora.b_up,
            global_experts, b_gate, b_up)
    need_gate_up_rows = needs["x"] or needs["w1"] or needs["w3"] or needs["b1"] or needs["topk_weights"]
    grad_gate_up = grad_gate = grad_up = down_rows = None
    if lora is not None:
        grad_gate_up, weighted_h, grad_p, down_rows = torch.ops.flash_moe.moe_lora_grad_gate_up(
            go, w2v, gate_up, *align, tw, top_k, BLOCK_M, lora.scaling, lora.a_down, lora.b_down, global_experts,
            family.activation, family.alpha, family.limit)
    elif need_gate_up_rows or family.activation != "swiglu":
        grad_gate_up, weighted_h, grad_p = torch.ops.flash_moe.moe_grad_gate_up(
            go, w2v, gate_up, *align, tw, top_k, BLOCK_M, global_experts, family.activation, family.alpha,
            family.limit)
    if grad_gate_up is not None:
        if family.gated and layout.gate_up == "interleaved":
            # dg | du interleaved column by column as w1 interleaves gate and up: dx is then one GEMM over w1 whole
            # (moe_grad_x reads the pairs in place), and db1 and dW1 come out in w1's order (an S x 2 hidden copy
            # here instead of a permuting copy of dW1)
            grad_gate_up = join_pairs(*grad_gate_up.split(hidden, 1), 1, "interleaved")
            grad_gate, grad_up = split_pairs(grad_gate_up, 1, "interleaved")  # views
        else:
            grad_gate, grad_up = grad_gate_up.split(hidden, 1) if family.gated else (grad_gate_up, None)  # views
        if needs["topk_weights"]:
            if b2 is not None:  # y = h W2^T + b2: dL/dp gains grad_out_t . b2[e]
                expert = torch.div(local, n, rounding_mode="floor").clamp(0, E - 1)
                bias_dot = (go.float() @ b2.float().t()).gather(1, expert.view(T, top_k))
                grad_p = grad_p + torch.where(valid.view(T, top_k), bias_dot, 0)
            grads["topk_weights"] = grad_p.to(tw_dtype)
    else:  # w2's gradient alone takes only p h, which swiglu_backward computes without reading grad_h
        _, _, weighted_h, _ = torch.ops.flash_moe.swiglu_backward(gate_up, go.new_zeros(S, hidden),
                                                                  tw.reshape(-1)[order], ok)
    del gate_up
    x_rows = None
    if lora is None and needs["x"]:
        grads["x"] = torch.ops.flash_moe.moe_grad_x(grad_gate, grad_up, gate, up, *align, top_k, BLOCK_M,
                                                    deterministic, global_experts)
    elif lora is not None and (needs["x"] or needs["a_gate"] or needs["a_up"]):
        grads["x"], x_rows = torch.ops.flash_moe.moe_lora_grad_x(
            grad_gate, grad_up, gate, up, *align, top_k, BLOCK_M, deterministic, lora.scaling, lora.a_gate,
            lora.b_gate, lora.a_up, lora.b_up, global_experts)
    if lora is not None:
        own_row = torch.where(ok, torch.arange(S, device=x.device), -1).to(torch.int32)
        grads.update(adapter_grads(lora, needs, x, go, grad_gate, grad_up, weighted_h, down_rows, x_rows,
                                   lora.gate_up_rows, row_token, own_row, group_ends))
        del x_rows, down_rows
        if not needs["x"]:
            grads["x"] = None
    if needs["b1"]:
        grads["b1"] = _bias_grad(grad_gate_up, offs)
    if needs["b2"]:
        expert_key = torch.where(valid, torch.div(local, n, rounding_mode="floor"), E)
        routed = torch.zeros(T, E + 1, dtype=torch.float32, device=x.device).scatter_add_(
            1, expert_key.view(T, top_k), torch.where(valid, tw.reshape(-1), 0).view(T, top_k))
        grads["b2"] = (routed[:, :E].t() @ go.float()).to(b2.dtype)
    # the weight gradients: per expert, its rows of dg / du / p h against x / grad_out gathered by token; dW1 and dW3
    # of a w1 holding both in one GEMM over moe_grad_gate_up's [dg | du] (S x 2 hidden, as it comes: no concatenation)
    if not family.gated or layout.gate_up != "separate":
        rows_x = (grad_gate_up if needs["w1"] else None, None)
    else:
        rows_x = (grad_gate if needs["w1"] else None, grad_up if needs["w3"] else None)
    del grad_gate_up, grad_gate, grad_up  # held by rows_x alone where still needed
    # transposed weights (E, in, out): the product in source-major order, (E, K, N), is the weight's own layout
    w2_major, gate_up_major = not layout.transposed, layout.transposed
    if _fused_weight_grads(hidden):  # moe_grad_weight: the gathers inside, no S x dim copy of x or grad_out
        if needs["w2"]:
            grads["w2"] = torch.ops.flash_moe.moe_grad_weight(weighted_h, go, row_token, offs, w2_major)
        del weighted_h  # S x hidden: freed before the dW1 / dW3 outputs are allocated
        grad_w1, grad_w3 = (None if r is None else
                            torch.ops.flash_moe.moe_grad_weight(r, x, row_token, offs, gate_up_major) for r in rows_x)
    else:
        if needs["w2"]:
            grads["w2"] = _grouped_against((weighted_h,), go[tok], offs, w2_major)[0]
        del weighted_h  # S x hidden: freed before the x gather and the dW1 / dW3 outputs are allocated
        grad_w1 = grad_w3 = None
        if any(r is not None for r in rows_x):  # the S x dim gather lives only while they run
            grad_w1, grad_w3 = _grouped_against(rows_x, x[tok], offs, gate_up_major)
    del rows_x
    grads["w1"], grads["w3"] = grad_w1, grad_w3
    return tuple(grads[name] for name in GRAD_INPUTS)


def _bias_grad(grad_gate_up, offs):
    """db1: each expert's sum of its dg | du rows (the rows sorted by expert, ``offs`` their ends; their columns in
    b1's order), as a grouped GEMM against a column of ones (fp32 accumulation, deterministic; 8 columns: the GEMM's
    16-byte rows)."""
    ones = grad_gate_up.new_ones(grad_gate_up.shape[0], 8)
    return torch._grouped_mm(grad_gate_up.t(), ones, offs=offs)[:, :, 0]  # (E, width)


def _grouped_against(rows, gathered, offs, source_major=False):
    """Per expert, each of ``rows`` (slot rows sorted by expert, or None) against ``gathered`` (the same slots' source
    rows): grouped GEMMs, (E, N, K), or (E, K, N) when ``source_major``."""
    if source_major:
        return tuple(None if r is None else torch._grouped_mm(gathered.t(), r, offs=offs) for r in rows)
    return tuple(None if r is None else torch._grouped_mm(r.t(), gathered, offs=offs) for r in rows)


def _fused_weight_grads(hidden: int) -> bool:
    """Whether moe()'s backward takes moe_grad_weight for dW1 / dW2 / dW3 (kernel.toml: FUSED_DW_MAX_HIDDEN, where
    the measurements behind the rule are named)."""
    return hidden <= CONSTANTS["FUSED_DW_MAX_HIDDEN"]


class MoEMxfp8(torch.autograd.Function):
    """Forward: x quantized per call, fused mxfp8 kernels on the cached quantized weights. Backward: the bf16 closed
    form on the dequantized x and weights, gradients passed straight through the quantization to the bf16 leaves."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, topk_ids, topk_weights, wq, ws, w2q, w2s, expert_start, num_experts,
                global_experts, deterministic):
        top_k = topk_ids.shape[1]
        tw = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        xq, xs = quantize_mxfp8(x, exponent_block=MXFP8_ALIGN)
        align = torch.ops.flash_moe.moe_align(topk_ids, num_experts, BLOCK_M, 1, expert_start, wq.shape[0])
        out = torch.ops.flash_moe.moe_forward_mxfp8(xq, xs, wq, ws, w2q, w2s, *align, tw, top_k, BLOCK_M, deterministic)
        # the caller's x, weights and topk_weights too (no copies): the anchors of _first_order_only, since the
        # quantized operands and a float copy of bf16 topk_weights carry no grad history
        ctx.save_for_backward(xq, xs, wq, ws, w2q, w2s, topk_ids, tw, *align, x, w1, w2, w3, topk_weights)
        ctx.deterministic = deterministic
        ctx.expert_start = expert_start
        ctx.global_experts = global_experts
        ctx.tw_dtype = topk_weights.dtype
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xq, xs, wq, ws, w2q, w2s, ids, tw, *align, x_in, w1_in, w2_in, w3_in, tw_in = ctx.saved_tensors
        dt = ctx.x_dtype
        x = dequantize_mxfp8(xq, xs, dtype=dt)
        w = dequantize_mxfp8(wq, unpack_scales_blocked(ws), dtype=dt)  # wq is [gate; up]
        w1, w3 = gate_and_up(w, None) if w3_in is not None else (w, None)  # as the caller's: apart, or stacked
        w2 = dequantize_mxfp8(w2q, unpack_scales_blocked(w2s), dtype=dt)
        family = Family("swiglu", 0.0, 0.0, ExpertLayout("separate" if w3_in is not None else "stacked"))
        needs = dict.fromkeys(GRAD_INPUTS, False) | dict(zip(("x", "w1", "w2", "w3", "topk_ids", "topk_weights"),
                                                             ctx.needs_input_grad))
        with torch.no_grad():
            grads = _closed_form_backward(grad_out, x, w1, w2, w3, None, None, ids, tw, align, needs, family,
                                          ctx.expert_start, ctx.global_experts, ctx.tw_dtype, ctx.deterministic)
        grads = dict(zip(GRAD_INPUTS, grads))
        grads = tuple(grads[name] for name in ("x", "w1", "w2", "w3", "topk_ids", "topk_weights"))
        return (*_first_order_only(grads, (grad_out, x_in, w1_in, w2_in, w3_in, tw_in)), None, None, None, None, None,
                None, None, None)
