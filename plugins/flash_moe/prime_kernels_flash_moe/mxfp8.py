"""mxfp8 (OCP MX: e4m3 elements, one e8m0 power-of-two scale per 32 elements along K): quantisation, the weight-scale
layout the kernels read, the fused mxfp8 op, and moe(mxfp8=True)'s cache of quantized weights."""
from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from . import _C  # noqa: F401
from . import checks
from .contract import BLOCK_M, MXFP8_ALIGN, MXFP8_SCALE_BLOCK


def quantize_mxfp8(t: torch.Tensor, block: int = MXFP8_SCALE_BLOCK, *, exponent_block: int | None = None):
    """(data float8_e4m3fn, scales float8_e8m0fnu): t (..., K) (float32 / bfloat16 / float16; K a multiple of
    ``block``) in OCP MX blocks of ``block`` consecutive elements along the last dimension; scales (..., K / block).

    Scale of a block: the smallest power of two 2^e with amax / 2^e <= 448, i.e. e = ceil(log2(amax / 448)) in exact
    arithmetic (torchao's RCEIL rule; computed from amax's bits, so amax / 448 is never rounded), clamped below to
    2^-127 (e8m0 byte 0). amax = 0 (or below 448 * 2^-127) gives that smallest scale 2^-127 and the elements round
    from t * 2^127. Elements: round-to-nearest-even of t * 2^-e (exact in fp32) to e4m3, saturated to +-448. A block
    holding Inf or NaN gets the NaN scale (byte 0xFF) and NaN elements (0x7F). Deterministic: the same input gives
    the same bytes on CPU and CUDA.

    ``exponent_block`` (a multiple of ``block``): blocks of that many elements get the rule above, their scale
    repeated for each ``block`` inside: still mxfp8 (one scale per ``block``), with equal scales in each group. With
    ``exponent_block=MXFP8_ALIGN`` (128) the Hopper kernels apply the scales once per 128 of K instead of once per 32
    (their shared-exponent path, ~4x less promotion work); the encoding differs from per-32 scales only for elements
    below e4m3's normal range at the group's scale (|t| < 2^-6 * 2^e), which keep fewer bits.
    """
    checks.require_tensors("quantize_mxfp8", t=t)
    checks.require_int("quantize_mxfp8", block=block)
    if exponent_block is not None:
        checks.require_int("quantize_mxfp8", exponent_block=exponent_block)
    if exponent_block is None or exponent_block == block:
        return torch.ops.flash_moe.quantize_mxfp8(t, block)
    if block < 1 or exponent_block < block or exponent_block % block:
        raise RuntimeError(f"quantize_mxfp8: exponent_block must be a multiple of block={block}, got {exponent_block}")
    if t.dim() >= 1 and t.shape[-1] % exponent_block:  # the op below would name its own argument, block
        raise RuntimeError(f"quantize_mxfp8: the last dimension of t must be a multiple of exponent_block="
                           f"{exponent_block}, got {t.shape[-1]}")
    data, scales = torch.ops.flash_moe.quantize_mxfp8(t, exponent_block)
    repeated = scales.view(torch.uint8).repeat_interleave(exponent_block // block, -1)
    return data, repeated.view(torch.float8_e8m0fnu)


def share_exponents_mxfp8(data: torch.Tensor, scales: torch.Tensor):
    """Any mxfp8 tensor (data (..., K) float8_e4m3fn, scales (..., K / 32) float8_e8m0fnu, or their uint8 bytes; K a
    multiple of MXFP8_ALIGN = 128) -> the same with each 128 elements' four scales replaced by their largest (NaN if
    any is NaN: the group's elements NaN), the elements of the smaller-scaled blocks re-rounded (RNE) onto it: the form
    quantize_mxfp8(..., exponent_block=MXFP8_ALIGN) gives directly and the CUDA kernels' fast path needs (e.g. for
    weights quantized elsewhere). Only elements below e4m3's normal range at the shared scale change, by at most half
    its subnormal step 2^-9 * 2^e. New tensors (float8); CPU and CUDA give the same bytes."""
    checks.require_tensors("share_exponents_mxfp8", data=data, scales=scales)
    return torch.ops.flash_moe.share_exponents_mxfp8(data, scales)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, block: int = MXFP8_SCALE_BLOCK,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_mxfp8's inverse: data * 2^e per block (exact in float32; ``dtype`` casts the result)."""
    checks.require_tensors("dequantize_mxfp8", data=data, scales=scales)
    checks.require_int("dequantize_mxfp8", block=block)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dequantize_mxfp8: dtype must be a floating-point torch.dtype, got {dtype!r}")
    if scales.device != data.device:
        raise RuntimeError(f"dequantize_mxfp8: scales must be on data's device {data.device}, got {scales.device}")
    if data.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
        raise RuntimeError(f"dequantize_mxfp8: data must be float8_e4m3fn and scales float8_e8m0fnu, got data "
                           f"{data.dtype} and scales {scales.dtype}")
    if block < 1 or data.dim() < 1 or data.shape[-1] % block:
        raise RuntimeError(f"dequantize_mxfp8: block must be positive and divide data's last dimension, got "
                           f"block={block} for data of shape {tuple(data.shape)}")
    if scales.shape != (*data.shape[:-1], data.shape[-1] // block):
        raise RuntimeError(f"dequantize_mxfp8: scales must have shape (..., K / block) = "
                           f"{(*data.shape[:-1], data.shape[-1] // block)} for data of shape {tuple(data.shape)}, "
                           f"got {tuple(scales.shape)}")
    return (data.float() * scales.float().repeat_interleave(block, -1)).to(dtype)


def pack_scales_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Weight scales (E, N, K / 32) row-major -> the layout the mxfp8 kernels read, (E, K / 128, N, 4): for each
    expert and each 128-wide K step, the 4 scale bytes of every row n in turn (one coalesced 4-byte copy per row and
    pipeline stage). K must be a multiple of MXFP8_ALIGN = 128."""
    checks.require_tensors("pack_scales_blocked", scales=scales)
    g = MXFP8_ALIGN // MXFP8_SCALE_BLOCK
    if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise RuntimeError(f"pack_scales_blocked: scales must be float8_e8m0fnu (or its uint8 bytes), got "
                           f"{scales.dtype}")
    if scales.dim() != 3 or scales.shape[-1] % g:
        raise RuntimeError(f"pack_scales_blocked: scales must be (E, N, K / {MXFP8_SCALE_BLOCK}) with K a multiple "
                           f"of {MXFP8_ALIGN}, got shape {tuple(scales.shape)}")
    E, N, KB = scales.shape
    b = scales.view(torch.uint8).reshape(E, N, KB // g, g).permute(0, 2, 1, 3).contiguous()
    return b.view(torch.float8_e8m0fnu)


def unpack_scales_blocked(packed: torch.Tensor) -> torch.Tensor:
    """pack_scales_blocked's inverse: (E, K / 128, N, 4) -> (E, N, K / 32)."""
    checks.require_tensors("unpack_scales_blocked", packed=packed)
    g = MXFP8_ALIGN // MXFP8_SCALE_BLOCK
    if packed.dtype not in (torch.float8_e8m0fnu, torch.uint8) or packed.dim() != 4 or packed.shape[-1] != g:
        raise RuntimeError(f"unpack_scales_blocked: packed must be pack_scales_blocked's layout (E, K / {MXFP8_ALIGN}, "
                           f"N, {g}) of float8_e8m0fnu (or its uint8 bytes), got {packed.dtype} of shape "
                           f"{tuple(packed.shape)}")
    E, KT, N, _ = packed.shape
    return packed.view(torch.uint8).permute(0, 2, 1, 3).reshape(E, N, KT * g).view(torch.float8_e8m0fnu)


def _bytes_of(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t's uint8 bytes when it has ``dtype`` (the op reads those as ``dtype``); any other tensor unchanged, for the
    op's check to name."""
    return t.view(torch.uint8) if t.dtype == dtype else t


def fused_moe_mxfp8(x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids, num_tokens_post_padded,
                    topk_weights, out, top_k, block_m=BLOCK_M, block_n=64, warp_n=4, stages=4, bpc=1, split=True):
    """fused_moe_bf16 on mxfp8 operands; returns ``out`` (bf16, overwritten entirely).

    x (M, dim) float8_e4m3fn with x_scales (M, dim / 32) row-major (fp8 operands may also be given as their uint8
    bytes); w (E, 2 hidden, dim) e4m3 (gate rows then up rows)
    with w_scales = pack_scales_blocked(scales of w along dim); w2 (E, dim, hidden) e4m3 with w2_scales =
    pack_scales_blocked(scales of w2 along hidden). SwiGLU in fp32 on the fp32 accumulators, h re-quantized to mxfp8
    (quantize_mxfp8's rule, per 32 hidden elements), then each 128 hidden elements' scales shared (the largest; the
    elements of smaller-scaled blocks re-rounded: see quantize_mxfp8's ``exponent_block``) before the down
    projection; combine and index values as fused_moe_bf16. Speed: wherever a pipeline stage's 128 K of x and w (h
    and w2) carry one scale per row, the CUDA kernels apply the scales once per stage instead of once per 32 of K:
    quantize with ``exponent_block=MXFP8_ALIGN`` (as ``moe(mxfp8=True)`` does), or pass operands quantized elsewhere
    through ``share_exponents_mxfp8`` once (weights: once per version), for the fast path.
    ``block_m`` must equal BLOCK_M; the other tuning keywords are accepted and ignored.
    The float8 operands reach the op as their uint8 bytes (a free view): under torch.compile with inductor, the
    in-place op on float8 tensors fails ("auto_functionalized_v2 was not removed", torch 2.14); on bytes it compiles.
    """
    checks.require_tensors("fused_moe_mxfp8", x=x, x_scales=x_scales, w=w, w_scales=w_scales, w2=w2,
                           w2_scales=w2_scales, sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
                           num_tokens_post_padded=num_tokens_post_padded, topk_weights=topk_weights, out=out)
    checks.require_int("fused_moe_mxfp8", top_k=top_k, block_m=block_m)
    x, w, w2 = (_bytes_of(t, torch.float8_e4m3fn) for t in (x, w, w2))
    x_scales, w_scales, w2_scales = (_bytes_of(t, torch.float8_e8m0fnu) for t in (x_scales, w_scales, w2_scales))
    torch.ops.flash_moe.fused_moe_mxfp8(x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
                                        num_tokens_post_padded, topk_weights, out, top_k, block_m, block_n, warp_n,
                                        stages, bpc, split)
    return out


def quantize_weights(w1, w2, w3):
    """(w e4m3 (E, 2 hidden, dim), its packed scales, w2 e4m3, its packed scales) from bf16 master weights."""
    with torch.no_grad():
        wq, ws = quantize_mxfp8(torch.cat([w1.detach(), w3.detach()], 1), exponent_block=MXFP8_ALIGN)
        w2q, w2s = quantize_mxfp8(w2.detach(), exponent_block=MXFP8_ALIGN)
    return wq, pack_scales_blocked(ws), w2q, pack_scales_blocked(w2s)


# moe(mxfp8=True)'s quantized weights, keyed weakly by the tensors owning the weights' storage (a view's _base, so
# fresh views of one parameter hit): owner of w1 -> owner of w2 -> owner of w3 -> {the views' geometry: (each weight's
# (_version, data_ptr) when quantized, the quantized weights)}. An entry is freed with any of its three weights; a
# stale one is replaced in place.
_WEIGHT_CACHE = WeakTensorKeyDictionary()


def clear_mxfp8_weight_cache() -> None:
    """Drop every weight quantization moe(mxfp8=True) holds. Needed after writes that keep a weight's _version:
    through ``w.data`` or under ``torch.autograd._unsafe_preserve_version_counter`` (see ``moe``)."""
    _WEIGHT_CACHE.clear()


def _storage_owner(w: torch.Tensor) -> torch.Tensor:
    return w if w._base is None else w._base


def cached_quantized_weights(w1, w2, w3):
    if torch.compiler.is_compiling() or any(w.is_inference() for w in (w1, w2, w3)):
        return quantize_weights(w1, w2, w3)
    by_w2 = _WEIGHT_CACHE.setdefault(_storage_owner(w1), WeakTensorKeyDictionary())
    by_w3 = by_w2.setdefault(_storage_owner(w2), WeakTensorKeyDictionary())
    entries = by_w3.setdefault(_storage_owner(w3), {})
    geometry = tuple((w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype) for w in (w1, w2, w3))
    state = tuple((w._version, w.data_ptr()) for w in (w1, w2, w3))
    hit = entries.get(geometry)
    if hit is not None and hit[0] == state:
        return hit[1]
    quantized = quantize_weights(w1, w2, w3)
    entries[geometry] = (state, quantized)
    return quantized
