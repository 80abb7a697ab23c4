"""Input checks and flattening shared by the public surfaces (``ops.logp_entropy``, ``linear_ops.linear_logp_entropy``)
and their vocab-parallel forms (``vocab_parallel``): below all three, so that imports run one way (surfaces ->
vocab_parallel -> inputs, linear_contract, checks). Free of compiled code."""
from __future__ import annotations

import torch

from . import checks
from .linear_contract import CUDA_DTYPES


def require_device(reference: torch.Tensor, whose: str, operands: dict, prefix: str = "") -> None:
    """Every tensor among ``operands`` (name -> tensor or anything else) on ``reference``'s device (``whose``: the
    reference's name in the possessive, for the message). Checked by the Python surfaces, not only in the ops: with
    one tensor on meta the dispatcher would run the fake implementation and return uninitialised memory."""
    for name, t in operands.items():
        if isinstance(t, torch.Tensor) and t.device != reference.device:
            raise ValueError(f"{prefix}{name} must be on {whose} device {reference.device}, got {t.device}")


def flatten_logits(logits, labels, temperature):
    """Checks of the public surface; (logits [N, V] stride-1 rows, labels [N], scalar T, token temperatures or None,
    leading shape)."""
    checks.require_tensor("logp_entropy", "logits", logits)
    checks.require_tensor("logp_entropy", "labels", labels)
    checks.require_temperature("logp_entropy", temperature)
    if logits.dim() < 1:
        raise ValueError(f"fused_logp: logits must have at least 1 dim [..., V], got a {logits.dim()}-D tensor")
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    if vocab < 1:
        raise ValueError(f"fused_logp: logits vocab size (last dim) must be >= 1, got {vocab}")
    if labels.shape != lead:
        raise ValueError(
            f"fused_logp: labels shape {tuple(labels.shape)} must equal logits' leading shape {tuple(lead)}"
        )
    require_device(logits, "logits'", {"labels": labels, "temperature": temperature}, prefix="fused_logp: ")
    x = logits.reshape(-1, vocab)
    if vocab > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    if isinstance(temperature, torch.Tensor):
        temperature = checks.temperature_as_float32("logp_entropy", temperature)
        if temperature.dim() == 0:
            token_temperature = temperature.expand(x.shape[0]).contiguous()
        elif temperature.shape != lead:
            raise ValueError(
                f"fused_logp: per-token temperature shape {tuple(temperature.shape)} must equal logits' leading shape "
                f"{tuple(lead)} (or be 0-d)"
            )
        else:
            token_temperature = temperature.reshape(-1)
        scalar_t = 1.0
    else:
        token_temperature = None
        scalar_t = float(temperature)
    return x, labels.reshape(-1), scalar_t, token_temperature, lead


def check_linear_transform(temperature, softcap, logit_scale):
    """The logit transform and the temperature it leaves, as the linear_logp ops check them."""
    checks.check_logit_transform("linear_logp", softcap, logit_scale)
    checks.check_effective_temperature("linear_logp", temperature, softcap, logit_scale)


def flatten_linear(hidden, weight, labels, temperature, bias):
    """Checks of the linear surface; (hidden [N, H], labels [N], scalar T, token temperatures or None)."""
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
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be a tensor of shape [{weight.shape[0]}] (weight's vocab rows), got "
                         f"{getattr(bias, 'shape', bias)}")
    return h2, l1, float(temperature), token_temperature
