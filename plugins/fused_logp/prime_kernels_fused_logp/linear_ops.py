"""Log-probabilities and entropy straight from hidden states and the lm_head weight (issue 5).

``linear_logp_entropy(hidden, weight, labels, temperature)`` computes, per token, with z = g(hidden @ weight.T + bias) / T
(g: the optional logit transform, softcap and logit_scale, as in ``ops.logp_entropy``),
``logp = z_y - logsumexp(z)`` and ``entropy = logsumexp(z) - sum softmax(z) z`` in fp32, without materialising the
[N, V] logits, differentiable in hidden, weight and bias. The ops are ``torch.ops.fused_logp.linear_logp_entropy``
and ``linear_logp_entropy_backward`` (CPU: C++, CUDA sm_90a: TMA + wgmma; see docs/notes/linear_logp.md).
"""
from __future__ import annotations

import torch

from prime_kernels_core import manifest
from prime_kernels_core.contracts import UnsupportedShapeError

from . import _C  # noqa: F401  (registers the ops)
from . import checks, reference
from .ops import require_device  # the module also registers fused_logp::logp_entropy's autograd (the fallback's)

_CONSTANTS = manifest.constants("prime_kernels_fused_logp", "linear_logp")
BLOCK_N: int = _CONSTANTS["BLOCK_N"]
BLOCK_V: int = _CONSTANTS["BLOCK_V"]
BLOCK_K: int = _CONSTANTS["BLOCK_K"]
STAGES: int = _CONSTANTS["STAGES"]
MAX_SPLITS: int = _CONSTANTS["MAX_SPLITS"]
DZ_CHUNK_ELEMS: int = _CONSTANTS["DZ_CHUNK_ELEMS"]
INVARIANT_TILES_PER_SPLIT: int = _CONSTANTS["INVARIANT_TILES_PER_SPLIT"]
INVARIANT_DZ_CHUNK_TILES: int = _CONSTANTS["INVARIANT_DZ_CHUNK_TILES"]
INVARIANT_GEMM_ROWS: int = _CONSTANTS["INVARIANT_GEMM_ROWS"]
HIDDEN_ALIGN: int = _CONSTANTS["HIDDEN_ALIGN"]
PTR_ALIGN_BYTES: int = _CONSTANTS["PTR_ALIGN_BYTES"]
MAX_VOCAB_SIZE: int = _CONSTANTS["MAX_VOCAB_SIZE"]
MAX_NUM_TOKENS: int = _CONSTANTS["MAX_NUM_TOKENS"]
CUDA_DTYPES = (torch.bfloat16, torch.float16)

_ops = torch.ops.fused_logp


def workspace_bytes(num_tokens: int, vocab_size: int, hidden_size: int, backward: bool = False,
                    batch_invariant: bool = False) -> int:
    """Device memory the CUDA ops allocate beyond their inputs and outputs (upper bound, excluding cuBLAS's own)."""
    if not backward:
        return (3 * MAX_SPLITS + 1) * 4 * num_tokens + 12 * num_tokens  # partials + label logit, stats
    if batch_invariant:  # vocab chunks of INVARIANT_DZ_CHUNK_TILES tiles, rows padded to whole GEMM blocks
        vc = INVARIANT_DZ_CHUNK_TILES * BLOCK_V
        block_rows = max(INVARIANT_GEMM_ROWS, DZ_CHUNK_ELEMS // vc // INVARIANT_GEMM_ROWS * INVARIANT_GEMM_ROWS)
        pad = -(-min(num_tokens, block_rows) // INVARIANT_GEMM_ROWS) * INVARIANT_GEMM_ROWS
        padded_tokens = -(-num_tokens // INVARIANT_GEMM_ROWS) * INVARIANT_GEMM_ROWS
        gw = 4 * vc * hidden_size if num_tokens > block_rows else 0  # fp32 grad_weight across token chunks
        return pad * vc * 2 + 4 * padded_tokens * hidden_size + 4 * vocab_size + gw
    rows = min(num_tokens, max(BLOCK_N, DZ_CHUNK_ELEMS // BLOCK_V // BLOCK_N * BLOCK_N))
    dz = min(DZ_CHUNK_ELEMS, rows * ((vocab_size + BLOCK_V - 1) // BLOCK_V) * BLOCK_V) * 2
    return dz + 4 * num_tokens * hidden_size + 4 * vocab_size  # + fp32 grad_hidden accumulator, fp32 grad_bias


def unsupported_shape_reason(hidden_size: int, vocab_size: int, num_tokens: int | None = None,
                             dtype: torch.dtype = torch.bfloat16, *, device: str | torch.device = "cuda",
                             hidden: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> str | None:
    """None when the kernel on ``device`` handles these shapes, else one sentence saying what was found and what is needed.

    Pass the 2-D ``hidden`` [N, H] and ``weight`` [V, H] to also check their strides and data-pointer alignment.
    """
    checks.require_ints("unsupported_shape_reason", hidden_size=hidden_size, vocab_size=vocab_size)
    if num_tokens is not None:
        checks.require_ints("unsupported_shape_reason", num_tokens=num_tokens)
    if hidden_size < 1:
        return f"hidden_size must be >= 1, got {hidden_size}"
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        return f"vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {vocab_size}"
    if num_tokens is not None and num_tokens > MAX_NUM_TOKENS:
        return f"num_tokens must be <= {MAX_NUM_TOKENS}, got {num_tokens}"
    if torch.device(device).type != "cuda":
        if dtype not in CUDA_DTYPES + (torch.float32,):
            return f"dtype must be bfloat16, float16 or float32 on CPU, got {dtype}"
        return None
    if dtype not in CUDA_DTYPES:
        return f"dtype must be bfloat16 or float16 on CUDA, got {dtype}"
    if hidden_size % HIDDEN_ALIGN:
        return (f"hidden_size must be a multiple of {HIDDEN_ALIGN} on CUDA (16-byte rows for TMA), "
                f"got {hidden_size}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t is None:
            continue
        if t.stride(-1) != 1:
            return f"{name} last dim must have stride 1 on CUDA, got stride {t.stride(-1)}"
        if t.shape[0] > 1 and t.stride(0) % HIDDEN_ALIGN:
            return f"{name} row stride must be a multiple of {HIDDEN_ALIGN} elements on CUDA, got {t.stride(0)}"
        # Traced tensors have no address; the op's own check covers alignment when the compiled graph runs.
        if not torch.compiler.is_compiling() and t.data_ptr() % PTR_ALIGN_BYTES:
            return f"{name} data pointer must be {PTR_ALIGN_BYTES}-byte aligned on CUDA"
    return None


@torch.library.register_fake("fused_logp::linear_logp_entropy")
def _linear_logp_entropy_fake(hidden, weight, labels, temperature, token_temperature, bias, ignore_index,
                              return_entropy, batch_invariant=False, softcap=None, logit_scale=1.0):
    checks.check_linear_logp_entropy_args(hidden, weight, labels, temperature, token_temperature, bias, _CONSTANTS)
    _check_transform(temperature, softcap, logit_scale)
    n = hidden.shape[0]
    return (hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n if return_entropy else 0,), dtype=torch.float32),
            hidden.new_empty((n, 2), dtype=torch.float64))


def _check_transform(temperature, softcap, logit_scale):
    checks.check_logit_transform("linear_logp", softcap, logit_scale)
    checks.check_effective_temperature("linear_logp", temperature, softcap, logit_scale)


@torch.library.register_fake("fused_logp::linear_logp_entropy_backward")
def _linear_logp_entropy_backward_fake(grad_logp, grad_entropy, hidden, weight, labels, temperature,
                                       token_temperature, bias, stats, ignore_index, output_mask, grad_weight_fp32,
                                       batch_invariant=False, softcap=None, logit_scale=1.0):
    checks.check_linear_logp_entropy_backward_args(grad_logp, grad_entropy, hidden, weight, labels, temperature,
                                                   token_temperature, bias, stats, _CONSTANTS)
    _check_transform(temperature, softcap, logit_scale)
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


def _flatten(hidden, weight, labels, temperature, bias):
    fn = "linear_logp_entropy"
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        checks.require_tensor(fn, name, value)
    checks.require_tensor(fn, "bias", bias, optional=True)
    checks.require_temperature(fn, temperature)
    if hidden.dtype not in CUDA_DTYPES + (torch.float32,):
        raise TypeError(f"{fn}: hidden must be bfloat16 or float16 (float32 also on CPU and through "
                        f"fallback=\"chunked\"), got {hidden.dtype}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError(f"hidden must be a tensor [..., H], got {type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [V, H], got {getattr(weight, 'shape', type(weight).__name__)}")
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(getattr(labels, 'shape', ()))}")
    if hidden.shape[-1] < 1:
        raise ValueError(f"hidden size (last dim of hidden) must be >= 1, got {hidden.shape[-1]}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight vocab size (rows) must be >= 1, got {weight.shape[0]}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}] (hidden size of hidden), got {tuple(weight.shape)}")
    require_device(hidden, "hidden's", {"weight": weight, "labels": labels, "temperature": temperature, "bias": bias})
    h2 = hidden.reshape(-1, hidden.shape[-1])
    l1 = labels.reshape(-1)
    token_temperature = None
    if isinstance(temperature, torch.Tensor):
        temperature = checks.temperature_as_float32(fn, temperature)
        if temperature.dim() == 0:
            token_temperature = temperature.expand(l1.shape[0]).contiguous()
        elif tuple(temperature.shape) == tuple(labels.shape):
            token_temperature = temperature.reshape(-1)
        else:
            raise ValueError(f"temperature must be a float, a 0-d tensor or a tensor of labels' shape "
                             f"{tuple(labels.shape)}, got shape {tuple(temperature.shape)}")
        temperature = 1.0
    elif not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a float or a tensor, got {type(temperature).__name__}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be a tensor of shape [{weight.shape[0]}], got {getattr(bias, 'shape', bias)}")
    return h2, l1, float(temperature), token_temperature


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
    checks.require_process_group("linear_logp_entropy", process_group)
    checks.require_logit_transform("linear_logp_entropy", softcap, logit_scale)
    softcap = None if softcap is None else float(softcap)
    logit_scale = float(logit_scale)
    if process_group is not None:
        from .vocab_parallel import linear_logp_entropy_vocab_parallel

        return linear_logp_entropy_vocab_parallel(hidden, weight, labels, temperature, bias=bias,
                                                  ignore_index=ignore_index, return_entropy=return_entropy,
                                                  fallback=fallback, process_group=process_group,
                                                  vocab_start=vocab_start, batch_invariant=batch_invariant,
                                                  softcap=softcap, logit_scale=logit_scale)
    if vocab_start is not None:
        raise ValueError("linear_logp_entropy: vocab_start needs a process_group (it is the first vocab id of this "
                         "rank's shard)")
    h2, l1, temp, token_temperature = _flatten(hidden, weight, labels, temperature, bias)
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
    checks.require_logit_transform("linear_logp_entropy_backward", softcap, logit_scale)
    h2, l1, temp, token_temperature = _flatten(hidden, weight, labels, temperature, bias)
    ge = None if grad_entropy is None else grad_entropy.reshape(-1)
    mask = [bool(needs[0]), bool(needs[1]), bool(needs[2]) and bias is not None]
    gh, gw, gb = _ops.linear_logp_entropy_backward(grad_logp.reshape(-1), ge, h2, weight, l1, temp, token_temperature,
                                                   bias, stats, ignore_index, mask, grad_weight_fp32,
                                                   bool(batch_invariant), None if softcap is None else float(softcap),
                                                   float(logit_scale))
    return (gh.reshape(hidden.shape) if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None)
