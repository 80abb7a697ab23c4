"""Fuzz-style sweep (issue 22): every public function and raw op of fused_logp, each argument in turn replaced by a
bad or edge value (non-tensors, other dtypes, shapes one off, empty, non-contiguous, meta, NaN; ints at and past int32
and int64, negative, of other types), the logit transforms (softcap, logit_scale) and batch_invariant included. Each
case must give a clean result, judged against the float64 reference where the target has one (references()), or a
TypeError / ValueError / RuntimeError whose message names the argument replaced; a crash, any other exception, or a
result for a tensor on another device than the others' (meta, or CPU among CUDA tensors) fails;
prime_kernels_core.fuzz runs the sweep."""
from __future__ import annotations

import pytest
import torch

from prime_kernels_core import fuzz

KERNEL = "fused_logp"
SEED = 0  # conftest.py seeds each test from it; the cases draw their inputs from their own generator
N, V, H = 6, 40, 16


def cpu_targets() -> dict:
    """name -> (callable, valid keyword arguments): small CPU problems, the same in every process."""
    import torch

    from prime_kernels_fused_logp import linear_ops, ops

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(N, V, generator=g), torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    tt = torch.rand(N, generator=g) + 0.5
    # 16-bit: the dtypes of the CUDA kernel too (the same cases run on CUDA)
    hidden, weight = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((N, H), (V, H)))
    bias = torch.randn(V, generator=g)
    _, _, stats = torch.ops.fused_logp.logp_entropy(logits, labels, 1.0, tt, -100, True, True)
    _, _, lstats = torch.ops.fused_logp.linear_logp_entropy(hidden, weight, labels, 1.0, tt, bias, -100, True)
    grad = torch.randn(N, generator=g)
    f = torch.ops.fused_logp
    return {
        "logp_entropy": (ops.logp_entropy, dict(logits=logits, labels=labels, temperature=0.7, ignore_index=-100,
                                                return_entropy=True, check_labels=True, process_group=None,
                                                vocab_start=None)),
        "logp_entropy(T per token)": (ops.logp_entropy, dict(logits=logits, labels=labels, temperature=tt)),
        # softcap 2 bends N(0, 1) logits visibly (tanh(x / 2)); logit_scale 1.5 scales them first
        "logp_entropy(softcap, logit_scale)": (ops.logp_entropy, dict(logits=logits, labels=labels, temperature=0.7,
                                                                      softcap=2.0, logit_scale=1.5)),
        "logp_entropy(batch_invariant)": (ops.logp_entropy, dict(logits=logits, labels=labels, temperature=tt,
                                                                 batch_invariant=True)),
        "linear_logp_entropy": (linear_ops.linear_logp_entropy,
                                dict(hidden=hidden, weight=weight, labels=labels, temperature=0.7, bias=bias,
                                     ignore_index=-100, return_entropy=True, fallback=None, chunk_size=16,
                                     process_group=None, vocab_start=None)),
        "linear_logp_entropy(chunked)": (linear_ops.linear_logp_entropy,
                                         dict(hidden=hidden, weight=weight, labels=labels, temperature=tt,
                                              fallback="chunked", chunk_size=16)),
        "linear_logp_entropy_backward": (linear_ops.linear_logp_entropy_backward,
                                         dict(grad_logp=grad, grad_entropy=grad, hidden=hidden, weight=weight,
                                              labels=labels, temperature=tt, bias=bias, stats=lstats,
                                              ignore_index=-100, needs=(True, True, True), grad_weight_fp32=False)),
        "unsupported_shape_reason": (ops.unsupported_shape_reason, dict(vocab_size=V, num_tokens=N)),
        "linear unsupported_shape_reason": (linear_ops.unsupported_shape_reason,
                                            dict(hidden_size=H, vocab_size=V, num_tokens=N, dtype=torch.bfloat16,
                                                 device="cpu")),
        "fused_logp::logp_entropy": (f.logp_entropy, dict(logits=logits, labels=labels, temperature=1.0,
                                                          token_temperature=tt, ignore_index=-100,
                                                          return_entropy=True, check_labels=True)),
        "fused_logp::logp_entropy_backward": (f.logp_entropy_backward,
                                              dict(grad_logp=grad, grad_entropy=grad, logits=logits, labels=labels,
                                                   temperature=1.0, token_temperature=tt, stats=stats,
                                                   ignore_index=-100)),
        "fused_logp::linear_logp_entropy": (f.linear_logp_entropy,
                                            dict(hidden=hidden, weight=weight, labels=labels, temperature=1.0,
                                                 token_temperature=tt, bias=bias, ignore_index=-100,
                                                 return_entropy=True)),
        "fused_logp::linear_logp_entropy_backward": (f.linear_logp_entropy_backward,
                                                     dict(grad_logp=grad, grad_entropy=grad, hidden=hidden,
                                                          weight=weight, labels=labels, temperature=1.0,
                                                          token_temperature=tt, bias=bias, stats=lstats,
                                                          ignore_index=-100, output_mask=[True, True, True],
                                                          grad_weight_fp32=False)),
    }


def _logp_entropy_reference(logits, labels, temperature=1.0, ignore_index=-100, return_entropy=True, softcap=None,
                            logit_scale=1.0, **_modes):
    """ops.logp_entropy's value: the fp32 PyTorch path, or the float64 ground truth for float64 logits (the sweep
    gives it those); the modes (batch_invariant, check_labels, ...) change no value."""
    from prime_kernels_fused_logp import reference

    path = reference.logp_entropy_float64 if logits.dtype == torch.float64 else reference.logp_entropy_reference
    return path(logits, labels, temperature, ignore_index=ignore_index, return_entropy=return_entropy,
                softcap=softcap, logit_scale=logit_scale)


def references() -> dict:
    """name -> (the reference each clean result is judged against, max_ratio): the ratio test_fused_logp.py holds the
    same outputs to."""
    return {name: (_logp_entropy_reference, 1.0) for name in
            ("logp_entropy", "logp_entropy(T per token)", "logp_entropy(softcap, logit_scale)",
             "logp_entropy(batch_invariant)")}


# The sweep covers both kernels' functions: it skips where either cannot run.
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=[pytest.mark.kernel(KERNEL, device="cpu"), pytest.mark.kernel("linear_logp", device="cpu")]),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.kernel(KERNEL), pytest.mark.kernel("linear_logp")])])
def test_every_bad_input_gets_a_clean_result_or_an_error_naming_the_argument(device):
    failures = fuzz.sweep(__file__, device)
    assert not failures, "\n".join(failures)
