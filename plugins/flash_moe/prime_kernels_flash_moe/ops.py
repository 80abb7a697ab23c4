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

- LoRA adapters on the experts: ``moe(..., lora=MoeLora(...))`` (several adapters per call; the forward fused on
  CUDA: see ``moe``), ``load_adapter`` / ``export_adapter`` / ``stack_adapters``
  (prime-rl's, PEFT's and vLLM's per-expert naming).

The ``torch.ops.flash_moe`` ops are forward-only: a backward through ``moe_forward``, ``moe_forward_mxfp8``,
``moe_gate_up``, ``moe_grad_gate_up``, ``moe_grad_x``, ``swiglu_backward``, ``quantize_mxfp8`` or the ``moe_lora_*``
ops raises; ``moe`` is the differentiable entry point.

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

from . import _C  # noqa: F401  (loads the shared library; its static TORCH_LIBRARY blocks register the ops)
from . import checks, fakes  # noqa: F401  (fakes: registers the ops' fake and autograd implementations)
from .autograd import MoE, MoEMxfp8, gate_and_up
from .checks import INT32_MAX
from .contract import (BLOCK_M, CONSTANTS, DIM_ALIGN, HIDDEN_ALIGN, MAX_EXPERTS, MXFP8_ALIGN,
                       MXFP8_SCALE_BLOCK, check_moe_operands, max_padded, unsupported_shape_reason)
from .layouts import GPT_OSS_ALPHA, GPT_OSS_LAYOUT, GPT_OSS_LIMIT, ExpertLayout, expert_views, make_family
from .lora import MoeLora, check_expert_ids, check_moe_lora, group_ids
from .lora_io import export_adapter, load_adapter, stack_adapters
from .mxfp8 import (cached_quantized_weights, clear_mxfp8_weight_cache, dequantize_mxfp8,
                    fused_moe_mxfp8, pack_scales_blocked, quantize_mxfp8, share_exponents_mxfp8,
                    unpack_scales_blocked)

__all__ = ["BLOCK_M", "CONSTANTS", "DIM_ALIGN", "HIDDEN_ALIGN", "MAX_EXPERTS", "MXFP8_ALIGN", "MXFP8_SCALE_BLOCK",
           "clear_mxfp8_weight_cache", "dequantize_mxfp8", "fused_moe_bf16", "fused_moe_mxfp8",
           "max_padded", "moe", "moe_align", "moe_sorted", "ExpertLayout", "GPT_OSS_LAYOUT", "MoeLora",
           "export_adapter", "load_adapter", "stack_adapters",
           "GPT_OSS_ALPHA", "GPT_OSS_LIMIT", "pack_scales_blocked", "quantize_mxfp8", "share_exponents_mxfp8",
           "unpack_scales_blocked", "unsupported_shape_reason"]


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


def moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None, topk_ids: torch.Tensor,
        topk_weights: torch.Tensor, *, activation: str = "swiglu", alpha: float = GPT_OSS_ALPHA,
        limit: float = GPT_OSS_LIMIT, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
        layout: ExpertLayout | None = None, expert_start: int = 0, deterministic: bool = False,
        num_experts: int | None = None, mxfp8: bool = False, recompute_gate_up: bool = False,
        lora: MoeLora | None = None) -> torch.Tensor:
    """MoE experts: sum_k topk_weights[t, k] * (act(x W1[e]^T + b1[e], x W3[e]^T) W2[e]^T + b2[e]), differentiable.

    Families (layouts.py has the table of shapes): ``activation`` "swiglu" (silu(g) u), "gpt_oss" (gpt-oss's clamped
    sigmoid-GLU with ``alpha`` and ``limit``, gpt-oss's values by default, and (u + 1)) or "relu2" (relu(g)^2, not
    gated: w3 None and w1 alone); expert biases ``b1`` (E_local, 2 hidden) in w1's gate/up order ((E_local, hidden)
    for relu2) and ``b2`` (E_local, dim), the routing weight multiplying the down output with its bias (gpt-oss);
    ``layout`` (an ExpertLayout: gate and up ``separate`` (w1, w3), ``stacked`` [W1; W3] in w1 or ``interleaved`` row
    by row in w1 (gpt-oss), each weight (E, out, in) or ``transposed`` (E, in, out) as transformers stores gpt-oss;
    default: separate when w3 is given, else stacked). Every layout is read in place through views.
    x (..., dim) bf16; w1 (gate), w3 (up): (E_local, hidden, dim) bf16, or w3 None and w1 (E_local, 2 hidden, dim)
    holding both (transformers' gate_up_proj: its gradient then comes back whole, from one weight-gradient GEMM over
    [dg | du], where two slices of it would each cost a zero-filled tensor of its size and their sum in the autograd
    graph's backward); w2 (E_local, dim, hidden) bf16; topk_ids
    (..., top_k) int32 or int64 (global ids; -1 or ``num_experts`` = not routed, the latter transformers' marking of
    unrouted slots and of other ranks' experts; other ids out of range as ``moe_align`` treats them);
    topk_weights (..., top_k) float. Expert parallelism: experts [expert_start, expert_start + E_local) are local,
    other ids contribute nothing (``num_experts``: the global count, for the id range check and for the CUDA kernels'
    launch rules, which estimate the routed slots per local expert as M * top_k / num_experts: pass it under expert
    parallelism; default E_local when expert_start is 0, unchecked above otherwise). Tokens already grouped by
    expert (torchtitan's expert parallelism): ``moe_sorted``.
    Forward: ``moe_align`` (experts aligned to CLUSTER_BLOCKS blocks) + ``moe_forward`` (the fused kernels; the
    weights are read in place, never concatenated).
    On CUDA every family runs the fused sm_90a kernels: the activation is a compile-time choice of the gate/up and
    dH epilogues, the biases are added in the epilogues. Every layout is read in place (transposed weights: the
    kernels' B tiles flip majorness; gate and up interleaved: one tile of column pairs).
    Backward: closed form: the gate/up projections g | u saved by the forward (or recomputed: below), the
    grad_h = grad_out W2 with the activation's derivative and d topk_weights in its epilogue (``moe_grad_gate_up``),
    dx in one GEMM summed over each token's slots (``moe_grad_x``), the weight gradients per expert with the gathers
    inside (``moe_grad_weight``) where that measured faster (kernel.toml's FUSED_DW_MAX_HIDDEN), else gathers +
    grouped GEMMs, bias gradients as per-expert sums; gradients only for the inputs that need them.
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

    ``mxfp8=True`` (bias-free SwiGLU, separate or stacked (E, out, in) weights): x is quantized to mxfp8 on every
    call, the weights once per weight version, both with one exponent per MXFP8_ALIGN = 128 of K
    (``quantize_mxfp8(..., exponent_block=MXFP8_ALIGN)``: the kernels' fast path), and the forward runs the fused
    mxfp8 kernels (dim and hidden multiples of MXFP8_ALIGN). The backward is the bf16 closed form on the
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

    ``lora`` (a ``MoeLora``, lora.py): LoRA adapters on gate, up and down, several adapters in one call (each token's
    adapter from ``lora.adapter_ids``), every family and layout, bf16 path only: each adapted projection is
    z W^T + s_a (z A^T) B^T, gate / up before the activation, down before b2 and the routing weight (prime-rl's
    definition). Gradients for every adapter tensor that requires grad (fp32 accumulation, written in the adapter's
    dtype), x, topk_weights and the biases; the base weights' gradient GEMMs run only for base weights that require
    grad. The slots are aligned per (expert, adapter) group (E_local * n_adapters at most MAX_EXPERTS) and run the
    moe_lora_* ops. On the CPU they are the unfused definition (per aligned block: the base GEMMs plus two rank-r
    GEMMs per adapted projection, in fp32, the rank-r rows u = s_a z A^T rounded to bf16). On CUDA they are fused (sm_90a):
    the rank-r rows from a shrink kernel, appended to the base GEMM's K ([z | u] [W | B]^T). docs/notes/flash_moe.md, "LoRA adapters". Adapters in prime-rl's / vLLM's per-expert naming:
    ``load_adapter`` / ``export_adapter``.
    """
    family = make_family(activation, alpha, limit, layout, w3)
    check_moe_operands(x, w1, w2, w3, b1, b2, topk_ids, topk_weights, family)
    checks.require_int("moe", expert_start=expert_start)
    for flag, value in (("deterministic", deterministic), ("mxfp8", mxfp8), ("recompute_gate_up", recompute_gate_up)):
        checks.require_bool("moe", **{flag: value})
    if num_experts is not None:
        checks.require_int("moe", num_experts=num_experts)
        if not 1 <= num_experts <= INT32_MAX:
            raise ValueError(f"moe: num_experts must be in [1, {INT32_MAX}] (expert ids are int32 in the kernels), "
                             f"got {num_experts}")
    lead = x.shape[:-1]
    if lora is not None and mxfp8:
        raise RuntimeError("moe(mxfp8=True): LoRA adapters run on the bf16 path only (lora= with mxfp8=False)")
    top_k = topk_ids.shape[-1]
    E = w1.shape[0]
    _check_local_experts(E, expert_start, num_experts)
    global_experts = E if num_experts is None else num_experts  # the kernels' launch rules
    if num_experts is None:
        num_experts = E if expert_start == 0 else INT32_MAX
    # transformers marks a slot with no expert by id == num_experts; moe_align (CPU and CUDA) skips -1
    topk_ids = topk_ids.masked_fill(topk_ids == num_experts, -1)
    x2, ids, tw = x.reshape(-1, x.shape[-1]), topk_ids.reshape(-1, top_k), topk_weights.reshape(-1, top_k)
    if mxfp8:
        if family.activation != "swiglu" or b1 is not None or b2 is not None or family.layout.transposed \
                or family.layout.gate_up == "interleaved":
            raise RuntimeError(f"moe(mxfp8=True): the mxfp8 kernels compute bias-free SwiGLU experts with separate or "
                               f"stacked (E, out, in) weights, got activation {family.activation!r}, layout "
                               f"{family.layout}{', biases' if b1 is not None or b2 is not None else ''}")
        gate, up = gate_and_up(w1, w3)
        reason = unsupported_shape_reason(x.shape[-1], gate.shape[1], mxfp8=True)
        if reason is not None:
            raise RuntimeError(f"moe(mxfp8=True): {reason}")
        wq, ws, w2q, w2s = cached_quantized_weights(gate, w2, up)
        out = MoEMxfp8.apply(x2, w1, w2, w3, ids, tw, wq, ws, w2q, w2s, expert_start, num_experts, global_experts,
                             deterministic)
    else:
        lora_inputs = (None,) * 7
        if lora is not None:
            gate = expert_views(w1, w2, w3, b1, family)[0]
            scaling = check_moe_lora(lora, x, E, x.shape[-1], gate.shape[1], family.gated)
            check_expert_ids(ids, num_experts)
            adapter_ids = None if lora.adapter_ids is None else lora.adapter_ids.reshape(-1)
            n = scaling.shape[0]
            ids = group_ids(ids, adapter_ids, E, n, expert_start, num_experts)
            expert_start, num_experts = 0, E * n  # the alignment's (expert, adapter) groups
            lora_inputs = (scaling, *lora.adapters())
        # grad mode read here: inside Function.forward it is always off, and needs_input_grad stays True under
        # no_grad / inference_mode, where a stored g | u would never be used
        out = MoE.apply(x2, w1, w2, w3, b1, b2, ids, tw, *lora_inputs, family.activation, family.alpha, family.limit,
                        family.layout.gate_up, family.layout.transposed, expert_start, num_experts, global_experts,
                        deterministic or top_k >= CONSTANTS["SLOT_COMBINE_MIN_TOP_K"],
                        recompute_gate_up or not torch.is_grad_enabled())
    return out.view(*lead, x.shape[-1])


def _check_local_experts(local: int, expert_start: int, num_experts: int | None) -> None:
    """moe()'s own words for its expert range (moe_align's name its num_local_experts, which moe() does not have)."""
    if expert_start < 0:
        raise ValueError(f"moe: expert_start must be >= 0 (the global id of w1's first expert), got {expert_start}")
    if num_experts is not None and expert_start + local > num_experts:
        raise ValueError(
            f"moe: the local experts [expert_start, expert_start + {local}) = [{expert_start}, {expert_start + local}) "
            f"({local}: w1's expert count) must lie within the num_experts = {num_experts} global experts; lower "
            f"expert_start to at most {num_experts - local} or raise num_experts")


def moe_sorted(x_sorted: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None,
               num_tokens_per_expert: torch.Tensor, *, row_weights: torch.Tensor | None = None, **family_and_flags):
    """moe() for rows already grouped by local expert (torchtitan's expert parallelism, prime-rl's GroupedExperts):
    row r of ``x_sorted`` (M, dim) belongs to expert e where r lies in e's run of ``num_tokens_per_expert``
    (E_local,) (int or float counts, on x's device; padding rows inside a run are computed like any other); rows past
    the runs' total are padding and come back zero. Returns (M, dim): each row's expert output, in the input's order,
    times ``row_weights`` (M,) float when given (the routing scores, fused into the combine). No host sync: the rows'
    experts come from a device-side search. Keywords as moe()'s (activation, alpha, limit, b1, b2, layout,
    deterministic, recompute_gate_up, mxfp8, lora: its adapter_ids then (M,), one per row); forward and backward run
    the same kernels as moe() (the gather reads rows in order)."""
    checks.require_tensors("moe_sorted", x_sorted=x_sorted, w1=w1, num_tokens_per_expert=num_tokens_per_expert,
                           **{"row_weights?": row_weights})
    for key in ("expert_start", "num_experts"):
        if key in family_and_flags:
            raise TypeError(f"moe_sorted: {key} does not apply (num_tokens_per_expert counts the local experts' rows)")
    if x_sorted.dim() != 2:
        raise RuntimeError(f"moe_sorted: x_sorted must be 2-D (M, dim), got shape {tuple(x_sorted.shape)}")
    E = w1.shape[0] if w1.dim() == 3 else -1
    if num_tokens_per_expert.shape != (E,) or num_tokens_per_expert.is_complex() or num_tokens_per_expert.dtype == torch.bool:
        raise RuntimeError(f"moe_sorted: num_tokens_per_expert must be a 1-D real tensor of one count per local expert "
                           f"(w1's first dimension {E}), got {num_tokens_per_expert.dtype} of shape "
                           f"{tuple(num_tokens_per_expert.shape)}")
    if num_tokens_per_expert.device != x_sorted.device:
        raise RuntimeError(f"moe_sorted: num_tokens_per_expert must be on x_sorted's device {x_sorted.device}, got "
                           f"{num_tokens_per_expert.device}")
    M = x_sorted.shape[0]
    if row_weights is not None and (row_weights.shape != (M,) or not row_weights.is_floating_point()):
        raise RuntimeError(f"moe_sorted: row_weights must be a floating-point tensor of shape (M,) = ({M},), got "
                           f"{row_weights.dtype} of shape {tuple(row_weights.shape)}")
    ends = torch.cumsum(num_tokens_per_expert.to(torch.int64), 0)
    expert = torch.searchsorted(ends, torch.arange(M, device=x_sorted.device), right=True)
    ids = torch.where(expert < E, expert, -1).to(torch.int32).unsqueeze(1)
    weights = (torch.ones(M, device=x_sorted.device) if row_weights is None else row_weights).unsqueeze(1)
    return moe(x_sorted, w1, w2, w3, ids, weights, num_experts=E, **family_and_flags)
