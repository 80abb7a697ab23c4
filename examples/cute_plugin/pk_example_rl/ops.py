"""PPO / GRPO clipped surrogate loss per token, fused: ``ppo_clip_loss(logp, old_logp, advantages, eps_low=0.2,
eps_high=0.2, dual_clip=None) -> loss`` (fp32, logp's shape), differentiable in ``logp``.

    ratio = exp(logp - old_logp);  loss = -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
    dual_clip = c (> 1): where A < 0, loss = -max(that objective, c * A)

What a trainer writes as five elementwise ops and an autograd graph is one op here: ``pk_rl::ppo_loss`` returns the
loss and its slope d loss / d logp (the backward multiplies the incoming gradient by it). On CUDA the slope and loss
come from kernels.py's CuTe DSL function, run from the object the wheel ships for the device
(prime_kernels_core.cute_runtime), else compiled on first use; on the CPU from the PyTorch code below (the same
formulas). Reach it through ``prime_kernels.load("ppo_loss")`` to get a reason instead of an error when it cannot run
(this module imports the DSL, which the registry checks is installed; discovery never imports this module).
"""
from __future__ import annotations

import torch

from prime_kernels_core import cute_runtime

from . import kernels

KERNEL = "ppo_loss"
LOGP_DTYPES = (torch.float32, torch.bfloat16)
THREADS = 256  # threads a block: a constexpr of the shipped specializations (kernel.toml)


def unsupported_shape_reason(tokens: int) -> str | None:
    """None: any number of tokens (one thread each; the grid grows with them)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"ppo_loss: tokens must be an int, got {type(tokens).__name__}")
    return None if tokens >= 0 else f"ppo_loss needs a non-negative number of tokens, got {tokens}"


def _require(condition, message: str) -> None:
    torch._check(condition, lambda: message)  # RuntimeError, as a C++ TORCH_CHECK


def check_args(logp, old_logp, advantages, eps_low, eps_high, dual_clip) -> None:
    op = "ppo_loss"
    _require(logp.dtype in LOGP_DTYPES, f"{op}: logp must be float32 or bfloat16, got {logp.dtype}")
    _require(old_logp.dtype == logp.dtype, f"{op}: old_logp must have logp's dtype {logp.dtype}, got {old_logp.dtype}")
    _require(advantages.dtype == torch.float32, f"{op}: advantages must be float32, got {advantages.dtype}")
    for name, other in (("old_logp", old_logp), ("advantages", advantages)):
        _require(other.shape == logp.shape, f"{op}: {name} must have logp's shape {list(logp.shape)}, got "
                                            f"{list(other.shape)}")
        _require(other.device == logp.device,
                 f"{op}: {name} must be on logp's device {logp.device}, got {other.device}")
    _require(0 <= eps_low < 1, f"{op}: eps_low must be in [0, 1), got {eps_low}")
    _require(0 <= eps_high < float("inf"), f"{op}: eps_high must be finite and non-negative, got {eps_high}")
    _require(dual_clip is None or 1 < dual_clip < float("inf"), f"{op}: dual_clip must be None or a finite value "
                                                                 f"above 1, got {dual_clip}")


def ppo_loss_reference(logp, old_logp, advantages, eps_low, eps_high, dual_clip, dtype=torch.float32):
    """(loss, slope) in plain PyTorch, computed in ``dtype``: the CPU implementation (fp32) and the tests' reference
    (float64). The clip bounds are formed as the kernel gets them: 1 -/+ eps in Python, then rounded to ``dtype``."""
    ratio = torch.exp(logp.to(dtype) - old_logp.to(dtype))
    advantage = advantages.to(dtype)
    surrogate = ratio * advantage
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantage
    objective = torch.minimum(surrogate, clipped)
    gradient = torch.where(surrogate <= clipped, surrogate, 0)
    if dual_clip is not None:
        floor = dual_clip * advantage
        bounded = (advantage < 0) & (floor > objective)
        objective = torch.where(bounded, floor, objective)
        gradient = torch.where(bounded, 0, gradient)
    return -objective, -gradient


def _cuda_forward(logp, old_logp, advantages, eps_low, eps_high, dual_clip):
    loss = torch.empty(logp.shape, dtype=torch.float32, device=logp.device)
    slope = torch.empty_like(loss)
    if logp.numel():
        flat = lambda t: t.contiguous().view(-1)
        cute_runtime.call(KERNEL, kernels.ppo_loss_forward,
                          (flat(logp), flat(old_logp), flat(advantages), loss.view(-1), slope.view(-1),
                           1.0 - eps_low, 1.0 + eps_high, float(dual_clip or 0.0)),
                          dict(THREADS=THREADS, DUAL_CLIP=dual_clip is not None))
    return loss, slope


@torch.library.custom_op("pk_rl::ppo_loss", mutates_args=())
def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
             dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(logp, old_logp, advantages, eps_low, eps_high, dual_clip)
    if logp.device.type == "cpu":
        loss, slope = ppo_loss_reference(logp, old_logp, advantages, eps_low, eps_high, dual_clip)
        return loss.contiguous(), slope.contiguous()
    return _cuda_forward(logp, old_logp, advantages, eps_low, eps_high, dual_clip)


@ppo_loss.register_fake
def _(logp, old_logp, advantages, eps_low, eps_high, dual_clip):
    check_args(logp, old_logp, advantages, eps_low, eps_high, dual_clip)
    loss = logp.new_empty(logp.shape, dtype=torch.float32)
    return loss, torch.empty_like(loss)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.logp_dtype = inputs[0].dtype
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_loss, _grad_slope):
    """d loss / d logp = the slope the forward computed; old_logp and the advantages are constants of the step."""
    (slope,) = ctx.saved_tensors
    return (grad_loss * slope).to(ctx.logp_dtype), None, None, None, None, None


ppo_loss.register_autograd(_backward, setup_context=_setup_context)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2,
                  eps_high: float = 0.2, dual_clip: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate loss per token (fp32, logp's shape): ``logp`` the policy's log-probabilities of the
    sampled tokens (float32 or bfloat16, differentiable), ``old_logp`` the sampling policy's (same dtype),
    ``advantages`` float32 of the same shape; ``eps_low``/``eps_high`` the clip range (DAPO's asymmetric clip when they
    differ); ``dual_clip`` c > 1 bounds a negative advantage's loss (None: off). Reduce (mask, mean) as the trainer
    does."""
    for name, value in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"ppo_clip_loss: {name} must be a torch.Tensor, got {type(value).__name__}")
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"ppo_clip_loss: {name} must be a float, got {type(value).__name__}")
    if dual_clip is not None and (isinstance(dual_clip, bool) or not isinstance(dual_clip, (int, float))):
        raise TypeError(f"ppo_clip_loss: dual_clip must be a float or None, got {type(dual_clip).__name__}")
    loss, _ = ppo_loss(logp, old_logp, advantages, float(eps_low), float(eps_high),
                       None if dual_clip is None else float(dual_clip))
    return loss
