"""Pure-PyTorch paths for fused_logp (no compiled code): the fp32 log_softmax path trainers use today (the fallback and
the baseline the kernel's accuracy is judged against) and the float64 ground truth, forward and gradient. Each takes
the ops' logit transform (``softcap``, ``logit_scale``), applied in the paths' own dtype as a model would."""
from __future__ import annotations

import torch


def transform(x: torch.Tensor, softcap: float | None = None, logit_scale: float = 1.0) -> torch.Tensor:
    """g(x): logit_scale * x, then softcap * tanh(. / softcap) when softcap is given (in x's dtype)."""
    if logit_scale != 1.0:
        x = x * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x


def transform_slope(x: torch.Tensor, softcap: float | None = None, logit_scale: float = 1.0) -> torch.Tensor:
    """g'(x) of ``transform`` (in x's dtype)."""
    if softcap is None:
        return torch.full_like(x, logit_scale)
    return logit_scale / torch.cosh(x * (logit_scale / softcap)) ** 2


def _scaled(logits: torch.Tensor, temperature, dtype: torch.dtype, softcap=None, logit_scale=1.0) -> torch.Tensor:
    z = transform(logits.to(dtype), softcap, logit_scale)
    if isinstance(temperature, torch.Tensor):
        return z / temperature.to(dtype).unsqueeze(-1)
    return z / temperature


def _logp_entropy(logits, labels, temperature, ignore_index, return_entropy, dtype, softcap=None, logit_scale=1.0):
    z = _scaled(logits, temperature, dtype, softcap, logit_scale)
    logsm = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    index = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(-1)
    zero = logsm.new_zeros(())
    logp = torch.where(valid, logsm.gather(-1, index).squeeze(-1), zero)
    if not return_entropy:
        return logp, None
    p = logsm.exp()
    # -sum p log p, with 0 log 0 = 0 (a -inf logit) without a NaN in value or gradient; NaN rows stay NaN.
    safe_logsm = torch.where(p == 0, zero, logsm)
    entropy = torch.where(valid, -(p * safe_logsm).sum(-1), zero)
    return logp, entropy


def logp_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    ignore_index: int = -100,
    return_entropy: bool = True,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same semantics as ``ops.logp_entropy`` through ``log_softmax(g(logits.float()) / T)`` in fp32 (differentiable)."""
    return _logp_entropy(logits, labels, temperature, ignore_index, return_entropy, torch.float32, softcap, logit_scale)


def logp_entropy_float64(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    ignore_index: int = -100,
    return_entropy: bool = True,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 ground truth of ``logp_entropy`` (outputs float64)."""
    return _logp_entropy(logits, labels, temperature, ignore_index, return_entropy, torch.float64, softcap, logit_scale)


def logp_entropy_grad_float64(
    logits: torch.Tensor,
    labels: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Float64 gradient w.r.t. logits: (g_logp (onehot(y) - p) - g_ent p (z - sum p z)) g'(logits) / T, 0 for ignored
    tokens."""
    z = _scaled(logits, temperature, torch.float64, softcap, logit_scale)
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else float(temperature)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    zero = z.new_zeros(())
    valid = labels != ignore_index
    index = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(-1)
    onehot = torch.zeros_like(z).scatter_(-1, index, 1.0)
    grad = grad_logp.double().unsqueeze(-1) * (onehot - p)
    if grad_entropy is not None:
        centred = torch.where(p == 0, zero, z - torch.where(p == 0, zero, p * z).sum(-1, keepdim=True))
        grad = grad - grad_entropy.double().unsqueeze(-1) * p * centred
    grad = grad / t * transform_slope(logits.double(), softcap, logit_scale)
    return torch.where(valid.unsqueeze(-1), grad, zero)


__all__ = ["logp_entropy_reference", "logp_entropy_float64", "logp_entropy_grad_float64", "transform",
           "transform_slope"]
