"""fused_logp: per-token log-probability of the label and entropy of softmax(logits / T), without materialising
log_softmax. ``logp_entropy`` is the public function; ``torch.ops.fused_logp.logp_entropy`` /
``logp_entropy_backward`` are the registered ops (schemas documented in csrc/fused_logp.cpp).

Shape contract: the constants below come from kernel.toml (what the build compiled in), and
``unsupported_shape_reason`` is the one place the kernel's limits live.
"""
from __future__ import annotations

import torch
from prime_kernels_core.manifest import constants

from . import _C_stable  # noqa: F401  (loads the stable-ABI library; its STABLE_TORCH_LIBRARY blocks register the ops)
from . import checks
from .inputs import flatten_logits
from .vocab_parallel import logp_entropy_vocab_parallel


CONSTANTS = constants("prime_kernels_fused_logp", "fused_logp")
BLOCK_THREADS: int = CONSTANTS["BLOCK_THREADS"]
VEC_UNROLL: int = CONSTANTS["VEC_UNROLL"]
SPLIT_MIN_ELEMS: int = CONSTANTS["SPLIT_MIN_ELEMS"]
MAX_SPLITS: int = CONSTANTS["MAX_SPLITS"]
MAX_VOCAB_SIZE: int = CONSTANTS["MAX_VOCAB_SIZE"]
MAX_NUM_TOKENS: int = CONSTANTS["MAX_NUM_TOKENS"]

_op = torch.ops.fused_logp.logp_entropy
_op_backward = torch.ops.fused_logp.logp_entropy_backward


def unsupported_shape_reason(vocab_size: int, num_tokens: int = 1) -> str | None:
    """None when ``logp_entropy`` handles logits of ``num_tokens`` rows of ``vocab_size``; else one sentence why not."""
    checks.require_ints("unsupported_shape_reason", vocab_size=vocab_size, num_tokens=num_tokens)
    if vocab_size < 1:
        return f"vocab_size is {vocab_size}; fused_logp needs vocab_size >= 1"
    if vocab_size > MAX_VOCAB_SIZE:
        return f"vocab_size is {vocab_size}; fused_logp indexes a row with 32-bit integers and needs vocab_size <= {MAX_VOCAB_SIZE}"
    if num_tokens < 0:
        return f"num_tokens is {num_tokens}; fused_logp needs num_tokens >= 0"
    if num_tokens > MAX_NUM_TOKENS:
        return f"num_tokens is {num_tokens}; fused_logp launches one grid row per token and needs num_tokens <= {MAX_NUM_TOKENS}"
    return None


# ---- fake (meta) implementations, for torch.compile / FakeTensor --------------------------------------------------
@torch.library.register_fake("fused_logp::logp_entropy")
def _logp_entropy_fake(logits, labels, temperature, token_temperature, ignore_index, return_entropy, check_labels,
                       batch_invariant=False, softcap=None, logit_scale=1.0):
    checks.check_logp_entropy_args(logits, labels, temperature, token_temperature, CONSTANTS)
    checks.check_logit_transform("fused_logp", softcap, logit_scale)
    checks.check_effective_temperature("fused_logp", temperature, softcap, logit_scale)
    n = logits.shape[0]
    logp = logits.new_empty((n,), dtype=torch.float32)
    entropy = logits.new_empty((n if return_entropy else 0,), dtype=torch.float32)
    stats = logits.new_empty((n, 2), dtype=torch.float64)
    return logp, entropy, stats


@torch.library.register_fake("fused_logp::logp_entropy_backward")
def _logp_entropy_backward_fake(
    grad_logp, grad_entropy, logits, labels, temperature, token_temperature, stats, ignore_index, batch_invariant=False,
    softcap=None, logit_scale=1.0
):
    checks.check_logp_entropy_backward_args(grad_logp, grad_entropy, logits, labels, temperature, token_temperature,
                                            stats, CONSTANTS)
    checks.check_logit_transform("fused_logp", softcap, logit_scale)
    checks.check_effective_temperature("fused_logp", temperature, softcap, logit_scale)
    return logits.new_empty(logits.shape)


# ---- autograd -------------------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    logits, labels, temperature, token_temperature, ignore_index, return_entropy = inputs[:6]
    ctx.save_for_backward(logits, labels, token_temperature, output[2])
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.return_entropy = return_entropy
    ctx.batch_invariant = bool(inputs[7]) if len(inputs) > 7 else False
    ctx.softcap = inputs[8] if len(inputs) > 8 else None
    ctx.logit_scale = inputs[9] if len(inputs) > 9 else 1.0


def _backward(ctx, grad_logp, grad_entropy, _grad_stats):
    logits, labels, token_temperature, stats = ctx.saved_tensors
    grad_logits = None
    if ctx.needs_input_grad[0]:
        grad_logits = _op_backward(
            grad_logp,
            grad_entropy if ctx.return_entropy else None,
            logits,
            labels,
            ctx.temperature,
            token_temperature,
            stats,
            ctx.ignore_index,
            ctx.batch_invariant,
            ctx.softcap,
            ctx.logit_scale,
        )
    # No gradient for labels, temperatures (the per-token temperature is treated as a constant), the transforms or the
    # flags.
    return grad_logits, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("fused_logp::logp_entropy", _backward, setup_context=_setup_context)
checks.refuse_double_backward("logp_entropy_backward", "logp_entropy")


# ---- public surface -------------------------------------------------------------------------------------------------
def logp_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    ignore_index: int = -100,
    return_entropy: bool = True,
    check_labels: bool = True,
    batch_invariant: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each label and entropy of each token's distribution, at a sampling temperature.

    With z = g(logits) / temperature (g: the logit transform, identity by default; see softcap, logit_scale):
    ``logp = z[label] - logsumexp(z)`` and ``entropy = logsumexp(z) - sum softmax(z) z``, both float32 with logits'
    leading shape (entropy is None when ``return_entropy`` is false). Differentiable w.r.t. logits (the gradient has
    logits' dtype); the backward re-reads logits instead of saving probabilities.

    logits: [..., V] float32/bfloat16/float16 (a last dim that is not stride-1 is made contiguous).
    labels: int64/int32 with logits' leading shape. Tokens whose label is ``ignore_index`` get logp 0, entropy 0 and a
        zero gradient. Any other label outside [0, V) raises, naming the first offending flat position; on CUDA this
        check reads one device word back (a stream sync). ``check_labels=False`` skips that read (no sync, CUDA-graph
        capturable); such tokens then get NaN instead of an error. On CPU labels are always checked.
    temperature: a positive float, or a floating-point tensor used as float32 (bf16/fp16 convert exactly, float64
        rounds to float32; no gradient flows to it): 0-d (one temperature for every token, broadcast on its device
        without a host read) or with logits' leading shape (one per token). A token's
        temperature must be finite and > 0 unless the token is ignored: on CPU any other raises, naming the first
        offending position; on CUDA that token gets NaN and, with ``check_labels``, the same read-back raises naming
        it.
    batch_invariant: every token's logp, entropy and gradient row are then bitwise identical whatever the other
        tokens (their number, labels, temperatures, ignored ones), the token's position and the leading shape. CPU is
        always batch-invariant; CUDA then runs one block per row (the default splits rows over blocks when few rows
        fill the GPU) and reads rows that are not 16-byte aligned element-wise into the same vector layout, in the
        forward and the backward. In the default mode only rows that are not 16-byte aligned (odd V, strided views)
        can change their gradient bits with their position. Not guaranteed: equal bits between CPU and CUDA, between GPU
        architectures or builds (e.g. the 9.0a build and a generic-arch one), or between the two modes
        (docs/notes/batch_invariance.md). With a process_group: bitwise identical for a given world size and shard
        layout (the ranks' partials are gathered and summed in rank order).
    process_group: a torch.distributed group over which the vocabulary is sharded (tensor-parallel lm_head): logits
        is then this rank's [..., V_local] slice, labels are global vocab ids, and the result is the global logp and
        entropy (module ``vocab_parallel``, docs/notes/vocab_parallel.md). None (default): single rank, unchanged.
    vocab_start: with a process_group, this rank's first global vocab id; None derives it from the ranks' local vocab
        sizes in group-rank order.
    softcap, logit_scale: the logit transform g, in this order: x -> logit_scale * x (Cohere's ``logit_scale``;
        Granite's ``logits_scaling`` is ``logit_scale = 1 / logits_scaling``), then x -> softcap * tanh(x / softcap)
        (Gemma 2/3's ``final_logit_softcapping``), then the temperature. Both finite and > 0 (normal float32 values),
        logit_scale / softcap at most 1e15, and temperature / softcap (or temperature / logit_scale without a
        softcap) a normal float32, as for linear_logp_entropy; None / 1.0 (default): g(x) = x, the kernels without
        any transform work. Differentiated through (the gradient carries g'(x) = logit_scale / cosh^2(logit_scale * x
        / softcap)); docs/integrations.md lists the model fields.
    """
    checks.require_ignore_index("logp_entropy", ignore_index)
    checks.require_flags("logp_entropy", return_entropy=return_entropy, check_labels=check_labels,
                         batch_invariant=batch_invariant)
    checks.require_logit_transform("logp_entropy", softcap, logit_scale)
    checks.require_process_group("logp_entropy", process_group)
    if process_group is not None:
        return logp_entropy_vocab_parallel(logits, labels, temperature, ignore_index=ignore_index,
                                           return_entropy=return_entropy, process_group=process_group,
                                           vocab_start=vocab_start, batch_invariant=batch_invariant,
                                           softcap=softcap, logit_scale=logit_scale)
    if vocab_start is not None:
        raise ValueError("fused_logp: vocab_start needs a process_group (the first vocab id of this rank's shard)")
    x, labels1, scalar_t, token_temperature, lead = flatten_logits(logits, labels, temperature)
    logp, entropy, _stats = _op(
        x, labels1, scalar_t, token_temperature, int(ignore_index), bool(return_entropy), bool(check_labels),
        bool(batch_invariant), None if softcap is None else float(softcap), float(logit_scale)
    )
    logp = logp.reshape(lead)
    return logp, (entropy.reshape(lead) if return_entropy else None)


__all__ = [
    "logp_entropy",
    "unsupported_shape_reason",
    "BLOCK_THREADS",
    "VEC_UNROLL",
    "SPLIT_MIN_ELEMS",
    "MAX_SPLITS",
    "MAX_VOCAB_SIZE",
    "MAX_NUM_TOKENS",
]
