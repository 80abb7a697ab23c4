"""Fused residual-add + RMSNorm: ``residual_rmsnorm(x, residual, weight, eps) -> (y, new_residual)``.

    new_residual = x + residual                                    (in x's dtype)
    y = new_residual / sqrt(mean(new_residual², -1) + eps) * weight  (computed in fp32, returned in x's dtype)

Importing this module loads the compiled extension, which registers ``torch.ops.pk_example.residual_rmsnorm`` (CPU
always, CUDA when the build had a toolkit); it is built on the LibTorch stable ABI (kernel.toml's stable_abi), so one
build runs under every torch from that release on. Reach it through ``prime_kernels.load("residual_rmsnorm")`` to get a
reason instead of an ImportError when it cannot run.
"""
from __future__ import annotations

import torch

from prime_kernels_core import manifest

from . import _C_stable  # noqa: F401  (loads the shared library; its static STABLE_TORCH_LIBRARY blocks register the op)
from . import checks

# The shape contract. Constants come from the installed kernel.toml, the same table the build compiled in.
CONSTANTS = manifest.constants("pk_example_rmsnorm", "residual_rmsnorm")
BLOCK_THREADS: int = CONSTANTS["BLOCK_THREADS"]  # threads per row (one CUDA block per row)


def unsupported_shape_reason(hidden_size: int) -> str | None:
    """None when the kernel handles rows of ``hidden_size`` elements, else why not.

    One block of BLOCK_THREADS threads strides over a row, so any positive hidden size works.
    """
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int):
        raise TypeError(f"residual_rmsnorm: hidden_size must be an int, got {type(hidden_size).__name__}")
    if hidden_size < 1:
        return f"residual_rmsnorm needs a positive hidden size (x's last dimension), got {hidden_size}"
    return None


@torch.library.register_fake("pk_example::residual_rmsnorm")
def _(x, residual, weight, eps):
    checks.check_residual_rmsnorm_args(x, residual, weight, eps)
    return x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, as the real kernels return


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps = inputs
    _, new_residual = output
    ctx.save_for_backward(new_residual, weight)
    ctx.eps = eps
    ctx.residual_dtype = residual.dtype


def _backward(ctx, grad_y, grad_new_residual):
    """Closed-form RMSNorm backward in the forward's math precision (fp32, float64 for float64: as the kernels); the
    add passes its gradient to x and residual unchanged."""
    new_residual, weight = ctx.saved_tensors
    math_dtype = torch.promote_types(new_residual.dtype, torch.float32)
    h = new_residual.to(math_dtype)
    rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + ctx.eps)
    h_hat = h * rstd
    grad_h = grad_weight = None
    if grad_y is not None:
        g = grad_y.to(math_dtype)
        g_hat = g * weight.to(math_dtype)
        grad_h = rstd * (g_hat - h_hat * (g_hat * h_hat).mean(-1, keepdim=True))
        if ctx.needs_input_grad[2]:
            grad_weight = (g * h_hat).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    if grad_new_residual is not None:
        grad_h = grad_new_residual.to(math_dtype) if grad_h is None else grad_h + grad_new_residual.to(math_dtype)
    if grad_h is None:
        return None, None, grad_weight, None
    return grad_h.to(new_residual.dtype), grad_h.to(ctx.residual_dtype), grad_weight, None


torch.library.register_autograd("pk_example::residual_rmsnorm", _backward, setup_context=_setup_context)


def residual_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """(y, new_residual) for x, residual [..., D] and weight [D], all of one dtype and device."""
    checks.require_tensors(x=x, residual=residual, weight=weight)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"residual_rmsnorm: eps must be a float, got {type(eps).__name__}")
    return torch.ops.pk_example.residual_rmsnorm(x, residual, weight, eps)


def residual_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """The same computation as plain PyTorch ops: the baseline for tests (and the float64 reference, given float64)."""
    new_residual = x + residual
    h = new_residual.float() if new_residual.dtype != torch.float64 else new_residual
    y = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight.to(h.dtype)
    return y.to(x.dtype), new_residual
