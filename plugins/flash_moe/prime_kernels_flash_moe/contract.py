"""flash_moe's shape contract: the compiled constants (kernel.toml's [flash_moe.constants]), the alignment rules
of ``unsupported_shape_reason``, the routing buffer length ``max_padded``, and ``check_moe_operands`` (moe()'s
operand contract, checked before any path runs)."""
from __future__ import annotations

import torch

from prime_kernels_core import manifest

from . import checks
from .layouts import Family

CONSTANTS = manifest.constants("prime_kernels_flash_moe", "flash_moe")
BLOCK_M: int = CONSTANTS["BLOCK_M"]
MXFP8_SCALE_BLOCK: int = CONSTANTS["MXFP8_SCALE_BLOCK"]
DIM_ALIGN: int = CONSTANTS["DIM_ALIGN"]
HIDDEN_ALIGN: int = CONSTANTS["HIDDEN_ALIGN"]
MAX_EXPERTS: int = CONSTANTS["MAX_EXPERTS"]
MXFP8_ALIGN: int = CONSTANTS["MXFP8_ALIGN"]


def unsupported_shape_reason(dim: int, hidden_dim: int, *, mxfp8: bool = False, split: bool = True,
                             lora_rank: int | None = None, n_adapters: int = 1,
                             num_local_experts: int = 1) -> str | None:
    """None when the kernels handle model dim ``dim`` and expert hidden size ``hidden_dim``, else why not.

    bf16: the GEMMs run over whole BLOCK_K tiles along K: dim (gate/up) and hidden_dim (down) must be multiples of
    DIM_ALIGN / HIDDEN_ALIGN (64). mxfp8: both must be multiples of MXFP8_ALIGN = 128 (4 scale blocks of 32: one
    128-byte e4m3 pipeline stage, and the group of pack_scales_blocked's layout). ``split`` is accepted for
    compatibility (this plugin always runs the split pair of kernels). The ops' own checks use the same words.
    LoRA adapters (``lora_rank`` given: moe(lora=...)): bf16 only, the rank a positive multiple of LORA_RANK_ALIGN
    (8), and num_local_experts * n_adapters (expert, adapter) groups at most MAX_EXPERTS (the alignment's limit).
    On CUDA the adapters run fused (moe()'s docstring).
    """
    del split
    checks.require_int("unsupported_shape_reason", dim=dim, hidden_dim=hidden_dim)
    reason = checks.contract_reason(dim, hidden_dim, CONSTANTS, mxfp8)
    if reason is not None or lora_rank is None:
        return reason
    checks.require_int("unsupported_shape_reason", lora_rank=lora_rank, n_adapters=n_adapters,
                       num_local_experts=num_local_experts)
    return _lora_reason(lora_rank, n_adapters, num_local_experts, mxfp8)


def _lora_reason(rank: int, n_adapters: int, num_local_experts: int, mxfp8: bool) -> str | None:
    align = CONSTANTS["LORA_RANK_ALIGN"]
    if mxfp8:
        return "flash_moe runs LoRA adapters on the bf16 path only, got mxfp8=True"
    if rank < 1 or rank % align:
        return f"flash_moe needs the LoRA rank to be a positive multiple of {align}, got {rank}"
    if n_adapters < 1 or num_local_experts < 1:
        return (f"flash_moe needs at least one adapter and one local expert, got n_adapters={n_adapters}, "
                f"num_local_experts={num_local_experts}")
    if n_adapters * num_local_experts > MAX_EXPERTS:
        return (f"flash_moe needs num_local_experts * n_adapters (the (expert, adapter) groups) to be at most "
                f"{MAX_EXPERTS}, got {num_local_experts} * {n_adapters} = {num_local_experts * n_adapters}")
    return None


def max_padded(num_slots, num_local_experts: int, block_m: int = BLOCK_M, bpc: int = 1, block_align: int = 1):
    """Length of ``sorted_token_ids``: ceil((slots + E * (pad - 1)) / pad) * pad with pad = block_m * bpc, plus the
    empty blocks (fewer than block_align after each expert) that align every expert's start."""
    pad = block_m * bpc
    return ((num_slots + num_local_experts * (pad - 1) + pad - 1) // pad * pad
            + num_local_experts * (block_align - 1) * block_m)


def _w1_form(family: Family) -> str:
    """w1's shape in words, for the family's layout."""
    layout = family.layout
    if not family.gated:
        body, note = "hidden", " (relu2: w1 alone)"
    elif layout.gate_up == "separate":
        body, note = "hidden", ""
    else:
        body, note = "2 hidden", f" (gate and up {layout.gate_up}: w3 is None)"
    return (f"(E, dim, {body})" if layout.transposed else f"(E, {body}, dim)") + note


def check_moe_operands(x, w1, w2, w3, b1, b2, topk_ids, topk_weights, family: Family):
    """moe()'s operand contract for the family, checked before any path runs: the mxfp8 path quantizes before any op
    checks, its bf16 backward would be the first to see a wrong dtype, the ops see flattened tokens and views of the
    weights only (routing for fewer tokens than x has would leave the others' rows zero)."""
    checks.require_tensors("moe", x=x, w1=w1, w2=w2, **{"w3?": w3, "b1?": b1, "b2?": b2}, topk_ids=topk_ids,
                           topk_weights=topk_weights)
    operands = [(n, t) for n, t in (("w1", w1), ("w2", w2), ("w3", w3), ("b1", b1), ("b2", b2)) if t is not None]
    for name, t in (*operands, ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise RuntimeError(f"moe: {name} must be on x's device {x.device}, got {t.device}")
    for name, t in (("x", x), *operands):
        if t.dtype != torch.bfloat16:
            raise RuntimeError(f"moe: {name} must be bfloat16, got {t.dtype}")
    if x.dim() < 1:
        raise RuntimeError("moe: x must have shape (..., dim), got a 0-dim tensor")
    dim = x.shape[-1]
    layout, form = family.layout, _w1_form(family)
    in_axis, out_axis = (1, 2) if layout.transposed else (2, 1)
    if w1.dim() != 3 or w1.shape[in_axis] != dim:
        raise RuntimeError(f"moe: w1 must be 3-D {form} with dim = x's last dimension, got w1 of shape "
                           f"{tuple(w1.shape)} for x of shape {tuple(x.shape)}")
    E, hidden = w1.shape[0], w1.shape[out_axis]
    if not family.gated and w3 is not None:
        raise RuntimeError("moe: w3 must be None for activation 'relu2' (not gated: w1 alone), got a tensor")
    if family.gated and layout.gate_up != "separate":
        if hidden % 2:
            raise RuntimeError(f"moe: with w3 None, w1 must be {form} with an even "
                               f"{'third' if layout.transposed else 'second'} dimension, got w1 of shape "
                               f"{tuple(w1.shape)}")
        hidden //= 2
    elif w3 is not None and w3.shape != w1.shape:
        raise RuntimeError(f"moe: w3 must have w1's shape {form} = {tuple(w1.shape)}, got {tuple(w3.shape)}")
    w2_form, w2_shape = ("(E, hidden, dim)", (E, hidden, dim)) if layout.transposed else \
        ("(E, dim, hidden)", (E, dim, hidden))
    if w2.shape != w2_shape:
        stacked = family.gated and layout.gate_up != "separate"
        whence = f"half of w1's {'third' if layout.transposed else 'second'} dimension: w3 is None, so w1 holds " \
                 "gate and up" if stacked else f"w1's {'third' if layout.transposed else 'second'} dimension"
        raise RuntimeError(f"moe: w2 must have shape {w2_form} = {w2_shape} (hidden = {whence}), got "
                           f"{tuple(w2.shape)}")
    b1_shape = (E, 2 * hidden if family.gated else hidden)
    if b1 is not None and b1.shape != b1_shape:
        raise RuntimeError(f"moe: b1 must have shape (E, {'2 hidden' if family.gated else 'hidden'}) = {b1_shape}, "
                           f"got {tuple(b1.shape)}")
    if b2 is not None and b2.shape != (E, dim):
        raise RuntimeError(f"moe: b2 must have shape (E, dim) = {(E, dim)}, got {tuple(b2.shape)}")
    if topk_ids.dim() != x.dim() or topk_ids.shape[:-1] != x.shape[:-1]:
        raise RuntimeError(f"moe: topk_ids must have shape (..., top_k) with x's leading dimensions, got topk_ids of "
                           f"shape {tuple(topk_ids.shape)} for x of shape {tuple(x.shape)}")
    if topk_ids.shape[-1] < 1:
        raise RuntimeError(f"moe: topk_ids must have shape (..., top_k) with top_k >= 1, got topk_ids of shape "
                           f"{tuple(topk_ids.shape)}")
    if not topk_weights.is_floating_point():
        raise RuntimeError(f"moe: topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise RuntimeError(f"moe: topk_weights must have topk_ids' shape (..., top_k), got topk_weights of shape "
                           f"{tuple(topk_weights.shape)} for topk_ids of shape {tuple(topk_ids.shape)}")
