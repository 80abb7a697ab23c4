"""Log-probabilities and entropy straight from hidden states and the lm_head weight (issue 5).

``linear_logp_entropy(hidden, weight, labels, temperature)`` computes, per token, with z = g(hidden @ weight.T + bias) / T
(g: the optional logit transform, softcap and logit_scale, as in ``ops.logp_entropy``),
``logp = z_y - logsumexp(z)`` and ``entropy = logsumexp(z) - sum softmax(z) z`` in fp32, without materialising the
[N, V] logits, differentiable in hidden, weight and bias. The ops are ``torch.ops.fused_logp.linear_logp_entropy``
and ``linear_logp_entropy_backward`` (CPU: C++, CUDA sm_90a: TMA + wgmma; see docs/notes/linear_logp.md).
"""
from __future__ import annotations

import torch

from prime_kernels_core.contracts import UnsupportedShapeError

from . import _C_stable  # noqa: F401  (registers the ops: STABLE_TORCH_LIBRARY_FRAGMENT in csrc/linear_logp.cpp)
from . import checks, reference
from . import ops  # noqa: F401  (registers fused_logp::logp_entropy's autograd, which the chunked fallback runs through)
from .inputs import check_linear_transform, flatten_linear
from .linear_contract import (  # noqa: F401  (the contract is part of this module's public surface)
    BLOCK_K, BLOCK_N, BLOCK_V, CONSTANTS, CUDA_DTYPES, DZ_CHUNK_ELEMS, HIDDEN_ALIGN, INVARIANT_DZ_CHUNK_TILES,
    INVARIANT_GEMM_ROWS, INVARIANT_TILES_PER_SPLIT, MAX_NUM_TOKENS, MAX_SPLITS, MAX_VOCAB_SIZE, PTR_ALIGN_BYTES, STAGES,
    unsupported_shape_reason, workspace_bytes)
from .vocab_parallel import linear_logp_entropy_vocab_parallel

_ops = torch.ops.fused_logp


@torch.library.register_fake("fused_logp::linear_logp_entropy")
def _linear_logp_entropy_fake(hidden, weight, labels, temperature, token_temperature, bias, ignore_index,
                              return_entropy, batch_invariant=False, softcap=None, logit_scale=1.0):
    checks.check_linear_logp_entropy_args(hidden, weight, labels, temperature, token_temperature, bias, CONSTANTS)
    check_linear_transform(temperature, softcap, logit_scale)
    n = hidden.shape[0]
    return (hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n if return_entropy else 0,), dtype=torch.float32),
            hidden.new_empty((n, 2), dtype=torch.float64))


@torch.library.register_fake("fused_logp::linear_logp_entropy_backward")
def _linear_logp_entropy_backward_fake(grad_logp, grad_entropy, hidden, weight, labels, temperature,
                                       token_temperature, bias, stats, ignore_index, output_mask, grad_weight_fp32,
                                       batch_invariant=False, softcap=None, logit_scale=1.0):
    checks.check_linear_logp_entropy_backward_args(grad_logp, grad_entropy, hidden, weight, labels, temperature,
                                                   token_temperature, bias, stats, CONSTANTS)
    check_linear_transform(temperature, softcap, logit_scale)
    gh = hidden.new_empty(hidden.shape) if output_mask[0] else hidden.new_empty((0,))
    gw = (hidden.new_empty(weight.shape, dtype=torch.float32 if grad_weight_fp32 else hidden.dtype)
          if output_mask[1] else hidden.new_empty((0,)))
    gb = bias.new_empty(bias.shape) if (output_mask[2] and bias is not None) else hidden.new_empty((0,))
    return gh, gw, gb


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, temperature, token_temperature, bias, ignore_index, return_entropy = inputs[:8]
    _, _, stats = output
    ctx.save_for_backward(hidden, weight, labels, token_temperature, bias, stats)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.return_entropy = return_entropy
    ctx.has_bias = bias is not None
    ctx.batch_invariant = bool(inputs[8]) if len(inputs) > 8 else False
    ctx.softcap = inputs[9] if len(inputs) > 9 else None
    ctx.logit_scale = inputs[10] if len(inputs) > 10 else 1.0


def _backward(ctx, grad_logp, grad_entropy, grad_stats):
    hidden, weight, labels, token_temperature, bias, stats = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[5]]
    if not any(mask):
        return (None,) * 11
    if grad_logp is None:
        grad_logp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    if not ctx.return_entropy:
        grad_entropy = None
    gh, gw, gb = _ops.linear_logp_entropy_backward(grad_logp, grad_entropy, hidden, weight, labels, ctx.temperature,
                                                   token_temperature, bias, stats, ctx.ignore_index, mask, False,
                                                   ctx.batch_invariant, ctx.softcap, ctx.logit_scale)
    return (gh if mask[0] else None, gw if mask[1] else None, None, None, None, gb if mask[2] else None, None, None,
            None, None, None)


torch.library.register_autograd("fused_logp::linear_logp_entropy", _backward, setup_context=_setup_context)
checks.refuse_double_backward("linear_logp_entropy_backward", "linear_logp_entropy")


def linear_logp_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        temperature: float | torch.Tensor = 1.0, *, bias: torch.Tensor | None = None,
                        ignore_index: int = -100, return_entropy: bool = True, fallback: str | None = None,
                        chunk_size: int = 8192, batch_invariant: bool = False, process_group=None,
                        vocab_start: int | None = None, softcap: float | None = None, logit_scale: float = 1.0):
    """(logp, entropy) of shape labels.shape, fp32; entropy is None when return_entropy is False.

    hidden [..., H] and weight [V, H] in bfloat16/float16 (float32 on CPU), labels [...] integer, temperature a float
    or a floating-point tensor used as float32 (0-d or labels' shape; bf16/fp16 convert exactly, float64 rounds; not
    differentiated). Ignored tokens give 0 and no gradient.
    softcap, logit_scale: the logit transform applied to x = hidden @ weight.T + bias, in this order: logit_scale * x
    (Cohere's ``logit_scale``; Granite: ``1 / logits_scaling``), then softcap * tanh(x / softcap) (Gemma 2/3's
    ``final_logit_softcapping``), then the temperature; both finite and > 0, logit_scale / softcap at most 1e15, and
    temperature / softcap (or temperature / logit_scale without a softcap) a normal float32. On CUDA a logit_scale
    alone costs nothing (it is folded into the temperature); a softcap adds a tanh per logit in the epilogues (docs/integrations.md).
    Every other token needs a label in [0, V) and a temperature that is finite and > 0: on CPU either raises, naming
    the first offending position; on CUDA (no sync) the token gets NaN logp and entropy (a bad temperature also NaN
    gradients). Gradients come in the inputs' dtypes (autograd casts each to its input's); for an fp32 grad_weight
    (fp32 master gradients) call ``linear_logp_entropy_backward`` with ``grad_weight_fp32=True`` instead.
    On CUDA, shapes outside the kernel's contract (``unsupported_shape_reason``) raise UnsupportedShapeError unless
    ``fallback="chunked"``: vocab chunks of ``chunk_size`` logits through the logits op ``fused_logp::logp_entropy``,
    merged by logsumexp, each chunk recomputed in the backward.
    process_group: a torch.distributed group over which the lm_head is sharded by vocabulary (tensor parallelism):
    weight (and bias) are this rank's [V_local, H] rows, labels are global vocab ids, and the result is the global
    logp and entropy; grad_hidden is summed over the group (module ``vocab_parallel``, docs/notes/vocab_parallel.md).
    vocab_start: this rank's first global vocab id (None: derived from the local vocab sizes in group-rank order).
    batch_invariant: each token's logp, entropy and grad_hidden row are then bitwise identical whatever the other
    tokens (their number, labels, temperatures, ignored ones), its position and the leading shape; grad_weight and
    grad_bias are bitwise reproducible run to run in either mode. CPU always is; on CUDA the forward's vocab split
    count and the backward's chunks and cuBLAS GEMM shapes then depend on V and H only. The chunked fallback is not
    batch-invariant (its logits GEMM is cuBLAS at M = N): with batch_invariant it raises UnsupportedShapeError.
    Not guaranteed: equal bits between CPU and CUDA, across GPUs, builds or cuBLAS versions, or between the two
    modes. With a process_group: bitwise identical for a given world size and shard layout (partials gathered and
    summed in rank order). docs/notes/batch_invariance.md.
    """
    checks.require_ignore_index("linear_logp_entropy", ignore_index)
    checks.require_flags("linear_logp_entropy", return_entropy=return_entropy, batch_invariant=batch_invariant)
    checks.require_process_group("linear_logp_entropy", process_group)
    checks.require_logit_transform("linear_logp_entropy", softcap, logit_scale)
    softcap = None if softcap is None else float(softcap)
    logit_scale = float(logit_scale)
    if process_group is not None:
        return linear_logp_entropy_vocab_parallel(hidden, weight, labels, temperature, bias=bias,
                                                  ignore_index=ignore_index, return_entropy=return_entropy,
                                                  fallback=fallback, process_group=process_group,
                                                  vocab_start=vocab_start, batch_invariant=batch_invariant,
                                                  softcap=softcap, logit_scale=logit_scale)
    if vocab_start is not None:
        raise ValueError("linear_logp_entropy: vocab_start needs a process_group (it is the first vocab id of this "
                         "rank's shard)")
    h2, l1, temp, token_temperature = flatten_linear(hidden, weight, labels, temperature, bias)
    if fallback not in (None, "chunked"):
        raise ValueError(f'fallback must be None or "chunked", got {fallback!r}')
    checks.require_ints("linear_logp_entropy", chunk_size=chunk_size)
    if chunk_size < 1:
        raise ValueError(f"linear_logp_entropy: chunk_size must be >= 1, got {chunk_size}")
    reason = unsupported_shape_reason(h2.shape[1], weight.shape[0], h2.shape[0], h2.dtype, device=h2.device,
                                      hidden=h2 if h2.is_cuda else None, weight=weight if weight.is_cuda else None)
    if reason is not None:
        if fallback != "chunked":
            raise UnsupportedShapeError(f"linear_logp_entropy: {reason} (pass fallback=\"chunked\" to use the logits op)")
        if batch_invariant:
            raise UnsupportedShapeError(f"linear_logp_entropy: {reason}, and batch_invariant=True needs the fused "
                                        f"kernel (the chunked fallback's cuBLAS logits GEMM is not batch-invariant)")
        logp, entropy = _chunked(h2, weight, l1, temp, token_temperature, bias, ignore_index, chunk_size, softcap,
                                 logit_scale)
    else:
        logp, entropy, _ = _ops.linear_logp_entropy(h2, weight, l1, temp, token_temperature, bias, ignore_index,
                                                    return_entropy, bool(batch_invariant), softcap, logit_scale)
    shape = labels.shape
    return logp.reshape(shape), (entropy.reshape(shape) if return_entropy else None)


def _chunked(h2, weight, l1, temperature, token_temperature, bias, ignore_index, chunk_size, softcap=None,
             logit_scale=1.0):
    """The fallback: per vocab chunk, logits -> fused_logp::logp_entropy, merged by logsumexp (checkpointed chunks).
    A label outside [0, V) that is not ignore_index gives NaN logp and entropy, as the CUDA kernel (no sync)."""
    from torch.utils.checkpoint import checkpoint

    if weight.dtype != h2.dtype or weight.device != h2.device:
        raise TypeError(f"linear_logp_entropy(fallback=\"chunked\"): weight must have hidden's dtype and device "
                        f"({h2.dtype} on {h2.device}), got {weight.dtype} on {weight.device}")

    n, V = h2.shape[0], weight.shape[0]
    labels = l1.to(torch.int64)
    ignored = labels == ignore_index
    out_of_range = ~ignored & ((labels < 0) | (labels >= V))
    tvec = temperature * (token_temperature if token_temperature is not None
                          else torch.ones(n, dtype=torch.float32, device=h2.device))

    def chunk(h, w, b, local):
        logits = h @ w.t() if b is None else torch.addmm(b.to(h.dtype), h, w.t())
        # A token whose logits in this chunk are all -inf (e.g. a -inf bias on padded vocab rows) has no softmax here:
        # the op would give NaN (and NaN gradients). It runs as ignored instead (0, zero gradient), so its lse is
        # zsel = -inf and the merge gives the chunk weight 0; its sum p z must then be finite, not -inf (0 * -inf).
        # (A softcap maps -inf to -softcap: such a chunk is an ordinary one.)
        dead = (logits.amax(1) == float("-inf")) & (softcap is None)
        lp, ent, _ = _ops.logp_entropy(logits, torch.where(dead, -1, local), temperature, token_temperature, -1, True,
                                       False, False, softcap, logit_scale)
        zsel = reference.transform(logits.gather(1, local[:, None]).squeeze(1).float(), softcap, logit_scale) / tvec
        lse = zsel - lp
        return lse, torch.where(dead, 0.0, lse - ent), zsel  # logsumexp, sum p z, the selected logit

    lses, spzs, zy = [], [], torch.zeros(n, dtype=torch.float32, device=h2.device)
    for v0 in range(0, V, chunk_size):
        v1 = min(V, v0 + chunk_size)
        inside = (labels >= v0) & (labels < v1)
        local = torch.where(inside, labels - v0, torch.zeros_like(labels))
        b = None if bias is None else bias[v0:v1]
        lse, spz, zsel = checkpoint(chunk, h2, weight[v0:v1], b, local, use_reentrant=False)
        lses.append(lse)
        spzs.append(spz)
        zy = torch.where(inside, zsel, zy)
    # Ignored tokens' outputs are masked below; a stand-in lse of 0 keeps their (zero) gradients finite even where all
    # their logits are -inf.
    lse_c, spz_c = torch.where(ignored, 0.0, torch.stack(lses)), torch.stack(spzs)
    lse = torch.logsumexp(lse_c, dim=0)
    spz = (torch.exp(lse_c - lse) * spz_c).sum(0)
    zero = torch.zeros_like(lse)
    logp, entropy = torch.where(ignored, zero, zy - lse), torch.where(ignored, zero, lse - spz)
    return torch.where(out_of_range, float("nan"), logp), torch.where(out_of_range, float("nan"), entropy)


def linear_logp_entropy_backward(grad_logp, grad_entropy, hidden, weight, labels, temperature=1.0, *, bias=None,
                                 stats, ignore_index=-100, needs=(True, True, True), grad_weight_fp32=False,
                                 batch_invariant=False, softcap=None, logit_scale=1.0):
    """The backward op directly, for what autograd cannot return: ``grad_weight_fp32=True`` gives grad_weight in fp32
    (accumulated in fp32 and never rounded to weight's dtype), e.g. for fp32 master gradients; autograd casts every
    gradient to its input's dtype. ``stats``: the third output of ``torch.ops.fused_logp.linear_logp_entropy`` on the
    same inputs (2-D hidden). Returns (grad_hidden, grad_weight, grad_bias), None where not requested. Example:
    docs/notes/linear_logp.md, "fp32 grad_weight". ``batch_invariant``: as in ``linear_logp_entropy`` (pair it with
    stats from a batch-invariant forward). ``softcap``, ``logit_scale``: those of the forward."""
    checks.require_tensor("linear_logp_entropy_backward", "grad_logp", grad_logp)
    checks.require_tensor("linear_logp_entropy_backward", "grad_entropy", grad_entropy, optional=True)
    checks.require_tensor("linear_logp_entropy_backward", "stats", stats)
    checks.require_ignore_index("linear_logp_entropy_backward", ignore_index)
    checks.require_needs("linear_logp_entropy_backward", needs)
    checks.require_flags("linear_logp_entropy_backward", grad_weight_fp32=grad_weight_fp32,
                         batch_invariant=batch_invariant)
    checks.require_logit_transform("linear_logp_entropy_backward", softcap, logit_scale)
    h2, l1, temp, token_temperature = flatten_linear(hidden, weight, labels, temperature, bias)
    ge = None if grad_entropy is None else grad_entropy.reshape(-1)
    mask = [bool(needs[0]), bool(needs[1]), bool(needs[2]) and bias is not None]
    gh, gw, gb = _ops.linear_logp_entropy_backward(grad_logp.reshape(-1), ge, h2, weight, l1, temp, token_temperature,
                                                   bias, stats, ignore_index, mask, grad_weight_fp32,
                                                   bool(batch_invariant), None if softcap is None else float(softcap),
                                                   float(logit_scale))
    return (gh.reshape(hidden.shape) if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None)
