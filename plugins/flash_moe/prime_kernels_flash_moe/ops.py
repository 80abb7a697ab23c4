"""flash_moe: fused MoE experts in bf16 and mxfp8 (Hopper sm_90a kernels, a CPU implementation everywhere).

Surface (compatible with the original Blackwell flash_moe, namespace ``prime_moe`` there):

- ``BLOCK_M``, ``MXFP8_SCALE_BLOCK``: from kernel.toml's ``[flash_moe.constants]`` (what the build compiled in).
- ``unsupported_shape_reason(dim, hidden_dim, *, mxfp8=False, split=True)``: the one place the alignment rules live.
- ``moe_align(topk_ids, num_experts, block_m=BLOCK_M, bpc=1, *, expert_start=0, num_local_experts=None,
  block_align=1)``.
- ``fused_moe_bf16(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out, top_k, ...)``:
  writes ``out`` in place and returns it. **The op overwrites every row of ``out``** (rows of tokens with no local
  slot become zero), in every mode, so callers need not zero it.
- ``moe(x, w1, w2, w3, topk_ids, topk_weights, *, expert_start=0, deterministic=False, mxfp8=False)``:
  differentiable; w3 None takes gate and up stacked in w1 (E, 2 hidden, dim), as transformers' gate_up_proj.
- mxfp8 (OCP MX: e4m3 elements, one e8m0 power-of-two scale per 32 elements along K): ``quantize_mxfp8``,
  ``dequantize_mxfp8``, ``share_exponents_mxfp8`` (one scale per 128 of K: the CUDA kernels' fast path),
  ``pack_scales_blocked`` / ``unpack_scales_blocked`` (the weight-scale layout the kernels read), ``fused_moe_mxfp8``
  (same semantics as fused_moe_bf16; the SwiGLU output is re-quantized to mxfp8, its exponents shared per 128 hidden
  elements, before the down projection; out bf16, overwritten entirely) and ``moe(..., mxfp8=True)`` (x and weights
  quantized with one exponent per 128 of K; its weight cache: see ``moe``; ``clear_mxfp8_weight_cache()`` empties
  it).

The ``torch.ops.flash_moe`` ops are forward-only: a backward through ``moe_forward``, ``moe_forward_mxfp8``,
``moe_gate_up``, ``moe_grad_gate_up``, ``moe_grad_x``, ``swiglu_backward`` or ``quantize_mxfp8`` raises; ``moe`` is the
differentiable entry point.

Tuning keywords of the original: ``block_m`` must equal BLOCK_M (the compiled tile; checked); ``bpc`` is honoured by
``moe_align`` (experts padded to block_m * bpc) and ignored by the GEMM (blocks are independent); ``block_n``,
``warp_n``, ``stages``, ``cpc`` and ``split`` are accepted and ignored (the sm_90a kernels have one compiled
configuration from kernel.toml and always run split: gate/up + SwiGLU kernel, then down + combine kernel).

Numerics: bf16 inputs, fp32 accumulation, SwiGLU in fp32 on the accumulators, the intermediate stored as bf16, the
down projection in fp32. Combine: on CUDA, ``fused_moe_bf16`` and ``moe(deterministic=False)`` add the weighted fp32
expert outputs into an fp32 buffer with atomics (order varies run to run: not bitwise deterministic), then round once
to bf16; ``moe(deterministic=True)``, and bf16 ``moe()`` from top_k = SLOT_COMBINE_MIN_TOP_K (kernel.toml) on, where
it measured faster, stores each slot's expert output as bf16 and sums the top_k slots of a token in k order in fp32
(bitwise reproducible; its backward also reduces dx in a fixed order). The CPU path is always fixed-order.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from prime_kernels_core import manifest

from . import _C  # noqa: F401  (loads the shared library; its static TORCH_LIBRARY blocks register the ops)
from . import checks

CONSTANTS = manifest.constants("prime_kernels_flash_moe", "flash_moe")
BLOCK_M: int = CONSTANTS["BLOCK_M"]
MXFP8_SCALE_BLOCK: int = CONSTANTS["MXFP8_SCALE_BLOCK"]
DIM_ALIGN: int = CONSTANTS["DIM_ALIGN"]
HIDDEN_ALIGN: int = CONSTANTS["HIDDEN_ALIGN"]
MAX_EXPERTS: int = CONSTANTS["MAX_EXPERTS"]
MXFP8_ALIGN: int = CONSTANTS["MXFP8_ALIGN"]
_INT32_MAX = 2**31 - 1


def unsupported_shape_reason(dim: int, hidden_dim: int, *, mxfp8: bool = False, split: bool = True) -> str | None:
    """None when the kernels handle model dim ``dim`` and expert hidden size ``hidden_dim``, else why not.

    bf16: the GEMMs run over whole BLOCK_K tiles along K: dim (gate/up) and hidden_dim (down) must be multiples of
    DIM_ALIGN / HIDDEN_ALIGN (64). mxfp8: both must be multiples of MXFP8_ALIGN = 128 (4 scale blocks of 32: one
    128-byte e4m3 pipeline stage, and the group of pack_scales_blocked's layout). ``split`` is accepted for
    compatibility (this plugin always runs the split pair of kernels). The ops' own checks use the same words.
    """
    del split
    checks.require_int("unsupported_shape_reason", dim=dim, hidden_dim=hidden_dim)
    return checks.contract_reason(dim, hidden_dim, CONSTANTS, mxfp8)


def max_padded(num_slots, num_local_experts: int, block_m: int = BLOCK_M, bpc: int = 1, block_align: int = 1):
    """Length of ``sorted_token_ids``: ceil((slots + E * (pad - 1)) / pad) * pad with pad = block_m * bpc, plus the
    empty blocks (fewer than block_align after each expert) that align every expert's start."""
    pad = block_m * bpc
    return ((num_slots + num_local_experts * (pad - 1) + pad - 1) // pad * pad
            + num_local_experts * (block_align - 1) * block_m)


# ---------------------------------------------------------------------------------------------------------------
# fake (meta) implementations: static output shapes, so torch.compile needs no data-dependent sizes
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
      deterministic, save_gate_up=False, num_experts=-1):
    checks.check_moe_args("moe_forward", x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                          topk_weights, top_k, block_m, "w1/w3", CONSTANTS)
    checks.check_global_experts("moe_forward", num_experts, w1.shape[0])
    rows = x.shape[0] * top_k if save_gate_up else 0
    return x.new_empty(x.shape), x.new_empty(rows, 2 * w1.shape[1])


@torch.library.register_fake("flash_moe::moe_gate_up")
def _(x, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m, num_experts=-1):
    checks.check_moe_args("moe_gate_up", x, w1, w3, None, sorted_token_ids, expert_ids, num_tokens_post_padded, None,
                          top_k, block_m, "w1/w3", CONSTANTS)
    checks.check_global_experts("moe_gate_up", num_experts, w1.shape[0])
    return x.new_empty((x.shape[0] * top_k, 2 * w1.shape[1]))


@torch.library.register_fake("flash_moe::swiglu_backward")
def _(gate_up, grad_h, row_weights, valid):
    checks.check_swiglu_backward_args(gate_up, grad_h, row_weights, valid)
    return (grad_h.new_empty(grad_h.shape), grad_h.new_empty(grad_h.shape), grad_h.new_empty(grad_h.shape),
            row_weights.new_empty(row_weights.shape))


@torch.library.register_fake("flash_moe::moe_grad_gate_up")
def _(grad_out, w2, gate_up, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, block_m,
      num_experts=-1, halves_apart=False):
    M, _, hidden, E = checks.check_grad_gate_up_args("moe_grad_gate_up", grad_out, w2, gate_up, sorted_token_ids,
                                                     expert_ids, num_tokens_post_padded, topk_weights, top_k,
                                                     block_m, CONSTANTS)
    checks.check_global_experts("moe_grad_gate_up", num_experts, E)
    grad_gate_up = (2, M * top_k, hidden) if halves_apart else (M * top_k, 2 * hidden)
    return (grad_out.new_empty(grad_gate_up), grad_out.new_empty((M * top_k, hidden)),
            topk_weights.new_empty((M, top_k)))


@torch.library.register_fake("flash_moe::moe_grad_x")
def _(grad_gate, grad_up, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m,
      deterministic, num_experts=-1):
    M, dim, _, E = checks.check_grad_x_args("moe_grad_x", grad_gate, grad_up, w1, w3, sorted_token_ids, expert_ids,
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
for _op_name in ("moe_gate_up", "swiglu_backward", "moe_grad_gate_up", "moe_grad_x"):
    _forward_only(_op_name, "it is a piece of prime_kernels_flash_moe.ops.moe's closed-form backward, which is "
                            "first-order only (no double backward)")
_forward_only("quantize_mxfp8", "rounding to mxfp8 has none; prime_kernels_flash_moe.ops.moe(mxfp8=True) passes "
                                "gradients straight through to the bf16 weights")


# ---------------------------------------------------------------------------------------------------------------
def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, bpc: int = 1, *,
              expert_start: int = 0, num_local_experts: int | None = None, block_align: int = 1):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) for routing ``topk_ids`` (M, top_k).

    ``sorted_token_ids`` (int32, length ``max_padded``): flat slots t * top_k + k grouped by local expert, stable within
    an expert, each expert padded to block_m * bpc with -1; ``expert_ids`` (int32, one per block of block_m): the
    local expert of each block, -1 past ``num_tokens_post_padded`` (int32 [1]). Experts with no slot get no block.
    Expert parallelism: ids in [expert_start, expert_start + num_local_experts) are local (id - expert_start); -1 and
    other ranks' ids are skipped. ``num_experts`` is the global count: ids must lie in [-1, num_experts). ``topk_ids``
    is int32 or int64 (read as given, never narrowed); an id outside [-1, num_experts) raises on the CPU and is
    skipped on CUDA (no host sync), an int64 id outside int32 included.
    ``block_align``: every expert's first block index is a multiple of it; the blocks between experts are empty (-1
    entries, expert id -1, counted in num_tokens_post_padded). ``moe`` passes CLUSTER_BLOCKS, so the CTA pairs of the
    bf16 kernels (which share weight tiles when both run one expert) fall on one expert's blocks.
    """
    checks.require_tensors("moe_align", topk_ids=topk_ids)
    checks.require_int("moe_align", num_experts=num_experts, block_m=block_m, bpc=bpc, expert_start=expert_start,
                       block_align=block_align)
    if num_local_experts is not None:
        checks.require_int("moe_align", num_local_experts=num_local_experts)
    return torch.ops.flash_moe.moe_align(topk_ids, num_experts, block_m, bpc, expert_start,
                                         -1 if num_local_experts is None else num_local_experts, block_align)


def fused_moe_bf16(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out, top_k,
                   block_m=BLOCK_M, block_n=CONSTANTS["BLOCK_N_GATE_UP"], warp_n=64, stages=CONSTANTS["STAGES"], bpc=1,
                   cpc=1, split=True):
    """out[t] = sum_k topk_weights[t, k] * (silu(x_t Wg^T) * (x_t Wu^T)) W2^T over the aligned slots; returns ``out``.

    x (M, dim) bf16; w (E, 2 hidden, dim) bf16, gate rows [0, hidden), up rows [hidden, 2 hidden); w2 (E, dim, hidden)
    bf16; topk_weights (M, top_k) fp32; out (M, dim) bf16, overwritten entirely. See the module docstring for the
    tuning keywords (accepted; only block_m is checked) and the combine's numerics.
    Index values: the CPU op raises on a ``sorted_token_ids`` entry outside [-1, M * top_k) or an ``expert_ids`` entry
    outside [-1, E); the CUDA kernels check them on the device instead (no host sync): such a sorted_token_ids entry
    is skipped like padding, such an expert id skips its block (as other ranks' experts are skipped in expert
    parallelism, and as ``moe_align`` on CUDA skips out-of-range ``topk_ids``).
    """
    checks.require_tensors("fused_moe_bf16", x=x, w=w, w2=w2, sorted_token_ids=sorted_token_ids,
                           expert_ids=expert_ids, num_tokens_post_padded=num_tokens_post_padded,
                           topk_weights=topk_weights, out=out)
    checks.require_int("fused_moe_bf16", top_k=top_k, block_m=block_m)
    torch.ops.flash_moe.fused_moe_bf16(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
                                       out, top_k, block_m, block_n, warp_n, stages, bpc, cpc, split)
    return out


# ---------------------------------------------------------------------------------------------------------------
# mxfp8
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


def _quantize_weights(w1, w2, w3):
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


def _cached_quantized_weights(w1, w2, w3):
    if torch.compiler.is_compiling() or any(w.is_inference() for w in (w1, w2, w3)):
        return _quantize_weights(w1, w2, w3)
    by_w2 = _WEIGHT_CACHE.setdefault(_storage_owner(w1), WeakTensorKeyDictionary())
    by_w3 = by_w2.setdefault(_storage_owner(w2), WeakTensorKeyDictionary())
    entries = by_w3.setdefault(_storage_owner(w3), {})
    geometry = tuple((w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype) for w in (w1, w2, w3))
    state = tuple((w._version, w.data_ptr()) for w in (w1, w2, w3))
    hit = entries.get(geometry)
    if hit is not None and hit[0] == state:
        return hit[1]
    quantized = _quantize_weights(w1, w2, w3)
    entries[geometry] = (state, quantized)
    return quantized


# ---------------------------------------------------------------------------------------------------------------
# moe(): forward through the fused kernels, backward in closed form through the backward's kernels
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


def _gate_and_up(w1, w3):
    """The gate and up weights (E, hidden, dim): w1 and w3, or the two halves of a stacked w1 (E, 2 hidden, dim) when
    w3 is None (views: the kernels read them in place)."""
    if w3 is not None:
        return w1, w3
    hidden = w1.shape[1] // 2
    return w1[:, :hidden], w1[:, hidden:]


def _needed_grads(ctx, w3):
    """ctx.needs_input_grad of (x, w1, w2, w3, topk_ids, topk_weights), a stacked w1 (w3 None) needing both halves'
    gradients when it needs one; and whether it is stacked."""
    needs = list(ctx.needs_input_grad[:6])
    if w3 is None:
        needs[3] = needs[1]
    return needs, w3 is None


class _MoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, w3, topk_ids, topk_weights, expert_start, num_experts, global_experts, deterministic,
                recompute_gate_up):
        top_k = topk_ids.shape[1]
        tw = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        align = torch.ops.flash_moe.moe_align(topk_ids, num_experts, BLOCK_M, 1, expert_start, w1.shape[0],
                                              CONSTANTS["CLUSTER_BLOCKS"])
        save = not recompute_gate_up and any(ctx.needs_input_grad[:6])
        gate, up = _gate_and_up(w1, w3)
        out, gate_up = torch.ops.flash_moe.moe_forward(x, gate, up, w2, *align, tw, top_k, BLOCK_M, deterministic,
                                                       save, global_experts)
        ctx.save_for_backward(x, w1, w2, w3, topk_ids, tw, *align, gate_up, topk_weights)
        ctx.saved_gate_up = save
        ctx.deterministic = deterministic
        ctx.expert_start = expert_start
        ctx.global_experts = global_experts
        ctx.tw_dtype = topk_weights.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w2, w3, ids, tw, *align, gate_up, topk_weights = ctx.saved_tensors
        needs, stacked = _needed_grads(ctx, w3)
        gate, up = _gate_and_up(w1, w3)
        with torch.no_grad():
            grads = _closed_form_backward(grad_out, x, gate, w2, up, ids, tw, align, needs, ctx.expert_start,
                                          ctx.global_experts, ctx.tw_dtype, ctx.deterministic,
                                          gate_up if ctx.saved_gate_up else None, stacked)
        return (*_first_order_only(grads, (grad_out, x, w1, w2, w3, topk_weights)), None, None, None, None, None)


def _closed_form_backward(grad_out, x, w1, w2, w3, ids, tw, align, needs, expert_start, global_experts, tw_dtype,
                          deterministic, gate_up=None, stacked=False):
    """(grad_x, grad_w1, grad_w2, grad_w3, None, grad_tw): the gradients of (x, w1, w2, w3, topk_ids, topk_weights).
    ``stacked``: w1 and w3 are the halves of one (E, 2 hidden, dim) tensor, whose gradient comes back whole as grad_w1
    (from one weight-gradient GEMM over [dg | du]; needs[1] and needs[3] equal) and grad_w3 is None.
    ``global_experts``: the expert count the launch rules spread the routed slots over (the ops' num_experts).

    Per routed slot s (token t, expert e, weight p): g | u = x_t [W1; W3]^T recomputed by the fused gate/up kernel
    (``moe_gate_up``) unless the forward kept it (``gate_up``); ``moe_grad_gate_up`` (one GEMM kernel on CUDA) forms
    grad_h = grad_out_t W2[e] (unweighted, fp32, never stored) and from it dg, du, p h and dL/dp = grad_h . h; the
    weight gradients are per-expert GEMMs over the slots sorted by expert with x / grad_out gathered by token
    (``moe_grad_weight``, one kernel each with the gathers inside, where ``_fused_weight_grads`` says it is the faster
    path; else gathers + ``torch._grouped_mm``; fp32 accumulation in both); ``moe_grad_x`` (one GEMM kernel on CUDA)
    gives dx = sum over a token's slots of dg W1[e] + du W3[e] in fp32: in k order when ``deterministic`` (bitwise
    reproducible), else with fp32 atomics on CUDA. When w2's gradient alone is needed, the grad_h GEMM is skipped
    (``swiglu_backward`` on zeros gives p h).
    """
    need_x, need_w1, need_w2, need_w3, _, need_tw = needs
    T = x.shape[0]
    top_k = ids.shape[1]
    E = w1.shape[0]
    S = T * top_k
    # slots sorted by local expert, stable (moe_align's order, which moe_gate_up's rows follow); unrouted slots last
    local = ids.reshape(-1).long() - expert_start
    valid = (ids.reshape(-1) >= 0) & (local >= 0) & (local < E)
    key = torch.where(valid, local, torch.full_like(local, E))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts[:E], 0).to(torch.int32)
    ok = valid[order]
    tok = order // top_k

    if gate_up is None:
        gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, top_k, BLOCK_M, global_experts)
    grad_tw = grad_x = grad_w1 = grad_w2 = grad_w3 = grad_gate_up = grad_gate = grad_up = None
    go = grad_out.to(x.dtype)
    if need_x or need_w1 or need_w3 or need_tw:
        # dg | du side by side for a stacked [W1; W3] (its one weight-gradient GEMM), else one contiguous tensor
        # each (the grouped GEMMs read a half of the side-by-side tensor 7-11 % slower: BENCHMARKS.md session 36)
        grad_gate_up, weighted_h, grad_p = torch.ops.flash_moe.moe_grad_gate_up(go, w2, gate_up, *align, tw, top_k,
                                                                                BLOCK_M, global_experts, not stacked)
        grad_gate, grad_up = grad_gate_up.split(w1.shape[1], 1) if stacked else grad_gate_up.unbind(0)
        if need_tw:
            grad_tw = grad_p.to(tw_dtype)
    else:  # w2's gradient alone takes only p h, which swiglu_backward computes without reading grad_h
        _, _, weighted_h, _ = torch.ops.flash_moe.swiglu_backward(gate_up, go.new_zeros(S, w2.shape[2]),
                                                                  tw.reshape(-1)[order], ok)
    if need_x:
        grad_x = torch.ops.flash_moe.moe_grad_x(grad_gate, grad_up, w1, w3, *align, top_k, BLOCK_M, deterministic,
                                                global_experts)
    # the weight gradients: per expert, its rows of dg / du / p h against x / grad_out gathered by token; dW1 and dW3
    # of a stacked w1 in one GEMM over moe_grad_gate_up's [dg | du] (S x 2 hidden, as it comes: no concatenation),
    # straight into its (E, 2 hidden, dim) gradient
    if stacked:
        rows_x = (grad_gate_up if need_w1 else None, None)
    else:
        rows_x = (grad_gate if need_w1 else None, grad_up if need_w3 else None)
    del grad_gate_up, grad_gate, grad_up  # held by rows_x alone where still needed
    # moe_grad_weight: the gathers inside the kernel, no S x dim copy of x or grad_out
    if _fused_weight_grads(w1.shape[1]):
        row_token = torch.where(ok, tok, -1).to(torch.int32)
        if need_w2:
            grad_w2 = torch.ops.flash_moe.moe_grad_weight(weighted_h, go, row_token, offs, True)
        del weighted_h  # S x hidden: freed before the dW1 / dW3 outputs are allocated
        grad_w1, grad_w3 = (None if r is None else torch.ops.flash_moe.moe_grad_weight(r, x, row_token, offs, False)
                            for r in rows_x)
    else:
        if need_w2:
            grad_w2 = torch._grouped_mm(go[tok].t(), weighted_h, offs=offs)
        del weighted_h  # S x hidden: freed before the x gather and the dW1 / dW3 outputs are allocated
        if any(r is not None for r in rows_x):  # the S x dim gather lives only while they run
            grad_w1, grad_w3 = _grouped_against(rows_x, x[tok], offs)
    del rows_x
    return grad_x, grad_w1, grad_w2, grad_w3, None, grad_tw


def _grouped_against(rows, gathered, offs):
    """Per expert, each of ``rows`` (slot rows sorted by expert, or None) against ``gathered`` (the same slots' source
    rows): grouped GEMMs."""
    return tuple(None if r is None else torch._grouped_mm(r.t(), gathered, offs=offs) for r in rows)


def _fused_weight_grads(hidden: int) -> bool:
    """Whether moe()'s backward takes moe_grad_weight for dW1 / dW2 / dW3 (kernel.toml: FUSED_DW_MAX_HIDDEN, where
    the measurements behind the rule are named)."""
    return hidden <= CONSTANTS["FUSED_DW_MAX_HIDDEN"]


class _MoEMxfp8(torch.autograd.Function):
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
        w1, w3 = _gate_and_up(dequantize_mxfp8(wq, unpack_scales_blocked(ws), dtype=dt), None)  # wq is [gate; up]
        w2 = dequantize_mxfp8(w2q, unpack_scales_blocked(w2s), dtype=dt)
        needs, stacked = _needed_grads(ctx, w3_in)
        with torch.no_grad():
            grads = _closed_form_backward(grad_out, x, w1, w2, w3, ids, tw, align, needs, ctx.expert_start,
                                          ctx.global_experts, ctx.tw_dtype, ctx.deterministic, stacked=stacked)
        return (*_first_order_only(grads, (grad_out, x_in, w1_in, w2_in, w3_in, tw_in)), None, None, None, None, None,
                None, None, None)


def _check_moe_args(x, w1, w2, w3, topk_ids, topk_weights):
    """moe()'s operand contract, checked before either path runs: the mxfp8 path quantizes before any op checks, its
    bf16 backward would be the first to see a wrong dtype, and the ops see flattened tokens only (routing for fewer
    tokens than x has would leave the others' rows zero)."""
    checks.require_tensors("moe", x=x, w1=w1, w2=w2, **{"w3?": w3}, topk_ids=topk_ids, topk_weights=topk_weights)
    weights = (("w1", w1), ("w2", w2)) + ((("w3", w3),) if w3 is not None else ())
    for name, t in (*weights, ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise RuntimeError(f"moe: {name} must be on x's device {x.device}, got {t.device}")
    for name, t in (("x", x), *weights):
        if t.dtype != torch.bfloat16:
            raise RuntimeError(f"moe: {name} must be bfloat16, got {t.dtype}")
    if x.dim() < 1:
        raise RuntimeError("moe: x must have shape (..., dim), got a 0-dim tensor")
    dim = x.shape[-1]
    layout = "(E, hidden, dim)" if w3 is not None else "(E, 2 hidden, dim) (gate and up stacked: w3 is None)"
    if w1.dim() != 3 or w1.shape[2] != dim:
        raise RuntimeError(f"moe: w1 must be 3-D {layout} with dim = x's last dimension, got w1 of shape "
                           f"{tuple(w1.shape)} for x of shape {tuple(x.shape)}")
    E, hidden = w1.shape[:2]
    if w3 is None:
        if hidden % 2:
            raise RuntimeError(f"moe: with w3 None, w1 must be {layout} with an even second dimension, got w1 of "
                               f"shape {tuple(w1.shape)}")
        hidden //= 2
    elif w3.shape != w1.shape:
        raise RuntimeError(f"moe: w3 must have w1's shape (E, hidden, dim) = {tuple(w1.shape)}, got {tuple(w3.shape)}")
    if w2.shape != (E, dim, hidden):
        raise RuntimeError(f"moe: w2 must have shape (E, dim, hidden) = {(E, dim, hidden)}, got {tuple(w2.shape)}")
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


def moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None, topk_ids: torch.Tensor,
        topk_weights: torch.Tensor, *, expert_start: int = 0, deterministic: bool = False,
        num_experts: int | None = None, mxfp8: bool = False, recompute_gate_up: bool = False) -> torch.Tensor:
    """SwiGLU MoE experts: sum_k topk_weights[t, k] * (silu(x W1[e]^T) * (x W3[e]^T)) W2[e]^T, differentiable.

    x (..., dim) bf16; w1 (gate), w3 (up): (E_local, hidden, dim) bf16, or w3 None and w1 (E_local, 2 hidden, dim)
    holding both stacked, [W1; W3] (transformers' gate_up_proj: its gradient then comes back whole, from one
    weight-gradient GEMM over [dg | du], where two slices of it would each cost a zero-filled tensor of its size and
    their sum in the autograd graph's backward); w2 (E_local, dim, hidden) bf16; topk_ids
    (..., top_k) int32 or int64 (global ids; -1 or ``num_experts`` = not routed, the latter transformers' marking of
    unrouted slots and of other ranks' experts; other ids out of range as ``moe_align`` treats them);
    topk_weights (..., top_k) float. Expert parallelism: experts [expert_start, expert_start + E_local) are local,
    other ids contribute nothing (``num_experts``: the global count, for the id range check and for the CUDA kernels'
    launch rules, which estimate the routed slots per local expert as M * top_k / num_experts: pass it under expert
    parallelism; default E_local when expert_start is 0, unchecked above otherwise).
    Forward: ``moe_align`` (experts aligned to CLUSTER_BLOCKS blocks) + ``moe_forward`` (the fused kernels; w1 and w3
    are read in place, never concatenated).
    Backward: closed form: the gate/up projections g | u saved by the forward (or recomputed: below), the
    grad_h = grad_out W2 with the SwiGLU derivative and d topk_weights in its epilogue (``moe_grad_gate_up``), dx in one
    GEMM summed over each token's slots (``moe_grad_x``), the weight gradients per expert with the gathers inside
    (``moe_grad_weight``) where that measured faster (kernel.toml's FUSED_DW_MAX_HIDDEN), else gathers + grouped GEMMs;
    gradients only for the inputs that need them.
    ``deterministic=True``: fixed-order combines (forward output, dx: a token's slots in k order): bitwise
    reproducible end to end; False: on CUDA the forward combine and dx's sum use fp32 atomics (not bitwise
    reproducible; the other gradients are), except in bf16 from top_k = SLOT_COMBINE_MIN_TOP_K (kernel.toml) on, where
    the fixed-order combines measured faster.
    Saved for the backward (bf16 path, when a gradient is needed): x, the routing and the pre-activations g | u
    (top_k * tokens x 2 hidden bf16, the forward's gate/up kernel stores them: e.g. 384 MiB per layer for Qwen3-30B-A3B
    at 16384 tokens; SonicMoE saves the same). ``recompute_gate_up=True`` saves only x and the routing and recomputes
    g | u in the backward (``moe_gate_up``: the gate/up GEMM, two thirds of the forward's FLOPs, for that memory;
    forward+backward 9-19 % slower on the H200 at the benchmark's shapes: BENCHMARKS.md). Same gradients, bitwise.
    Nothing is stored under ``torch.no_grad()`` / ``inference_mode`` or without an input that requires grad. (The
    mxfp8 path always recomputes.)

    ``mxfp8=True``: x is quantized to mxfp8 on every call, the weights once per weight version, both with one
    exponent per MXFP8_ALIGN = 128 of K (``quantize_mxfp8(..., exponent_block=MXFP8_ALIGN)``: the kernels' fast
    path), and the forward runs the fused mxfp8 kernels (dim and hidden multiples of MXFP8_ALIGN). The backward is the bf16 closed form on the
    dequantized x and weights (straight-through: gradients land on the bf16 leaves).
    Weight caching rule: the quantized weights are cached per (w1, w2, w3), keyed weakly by the tensors themselves (a
    view by its base tensor and its geometry, so fresh views of one parameter hit) and freed with them; no size cap.
    A cached copy is reused while every weight keeps its ``_version`` and data_ptr. Detected: in-place updates that
    bump ``_version`` (an optimizer step, ``copy_``, ``load_state_dict``, a ``no_grad`` ``add_``, also through a view)
    and new storage (``w.data = t``): the next call re-quantizes. Not detected: writes that keep ``_version``, through
    ``w.data`` (``w.data.mul_(2)``: ``.data`` has its own version counter) or under
    ``torch.autograd._unsafe_preserve_version_counter``: call ``clear_mxfp8_weight_cache()`` after such writes.
    Inference tensors (no version counter) and traced calls (torch.compile: quantized inside the graph) quantize the
    weights on every call.
    """
    _check_moe_args(x, w1, w2, w3, topk_ids, topk_weights)
    checks.require_int("moe", expert_start=expert_start)
    if num_experts is not None:
        checks.require_int("moe", num_experts=num_experts)
        if not 1 <= num_experts <= _INT32_MAX:
            raise ValueError(f"moe: num_experts must be in [1, {_INT32_MAX}] (expert ids are int32 in the kernels), "
                             f"got {num_experts}")
    lead = x.shape[:-1]
    top_k = topk_ids.shape[-1]
    global_experts = w1.shape[0] if num_experts is None else num_experts  # the kernels' launch rules
    if num_experts is None:
        num_experts = w1.shape[0] if expert_start == 0 else _INT32_MAX
    # transformers marks a slot with no expert by id == num_experts; moe_align (CPU and CUDA) skips -1
    topk_ids = topk_ids.masked_fill(topk_ids == num_experts, -1)
    if mxfp8:
        gate, up = _gate_and_up(w1, w3)
        reason = unsupported_shape_reason(x.shape[-1], gate.shape[1], mxfp8=True)
        if reason is not None:
            raise RuntimeError(f"moe(mxfp8=True): {reason}")
        wq, ws, w2q, w2s = _cached_quantized_weights(gate, w2, up)
        out = _MoEMxfp8.apply(x.reshape(-1, x.shape[-1]), w1, w2, w3, topk_ids.reshape(-1, top_k),
                              topk_weights.reshape(-1, top_k), wq, ws, w2q, w2s, expert_start, num_experts,
                              global_experts, deterministic)
    else:
        # grad mode read here: inside Function.forward it is always off, and needs_input_grad stays True under
        # no_grad / inference_mode, where a stored g | u would never be used
        out = _MoE.apply(x.reshape(-1, x.shape[-1]), w1, w2, w3, topk_ids.reshape(-1, top_k),
                         topk_weights.reshape(-1, top_k), expert_start, num_experts, global_experts,
                         deterministic or top_k >= CONSTANTS["SLOT_COMBINE_MIN_TOP_K"],
                         recompute_gate_up or not torch.is_grad_enabled())
    return out.view(*lead, x.shape[-1])
