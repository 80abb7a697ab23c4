"""MoE router, group-limited top-k with bias correction (DeepSeek-V3's; with one group and softmax, Mixtral's and
Qwen3's): ``moe_route(logits, bias, top_k=..., ...) -> (weights, experts)``.

    s = sigmoid(logits) or softmax(logits)             (fp32)
    experts = the top_k of s + bias among the topk_groups best groups (a group scores the sum of its two best)
    weights = s[experts] (/ their sum when renormalize) * scale    (fp32)

The ops are ``torch.library.triton_op``s: eager calls run the Triton functions of kernels.py from the code the wheel
ships for the device (prime_kernels_core.jit_runtime), torch.compile sees the Triton functions themselves
(``wrap_triton``), and on the CPU they run through Triton's interpreter when the process has TRITON_INTERPRET=1, else
through the PyTorch implementation below (the same formulas, the path the kernel replaces). Reach it through
``prime_kernels.load("moe_router")`` to get a reason instead of an error when it cannot run.
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from prime_kernels_core import jit_gating, jit_runtime

from . import checks, kernels

KERNEL = "moe_router"
MAX_EXPERTS = checks.MAX_EXPERTS


def unsupported_shape_reason(n_experts: int) -> str | None:
    """None when the kernel routes ``n_experts`` experts, else why not (one token's scores stay in registers)."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int):
        raise TypeError(f"moe_router: n_experts must be an int, got {type(n_experts).__name__}")
    return checks.unsupported_experts_reason(n_experts)


def _scores(logits: torch.Tensor, sigmoid: bool, dtype: torch.dtype) -> torch.Tensor:
    x = logits.to(dtype)
    return x.sigmoid() if sigmoid else x.softmax(-1)


def route_reference(logits, bias, n_groups, topk_groups, top_k, sigmoid, renormalize, scale, dtype=torch.float32):
    """The router in plain PyTorch, computed in ``dtype``: the CPU implementation and the tests' baseline (fp32) and
    reference (float64). Returns (weights in fp32 or float64, experts int64)."""
    s = _scores(logits, sigmoid, dtype)
    b = s + bias.to(dtype)
    tokens, n_experts = b.shape
    per_group = n_experts // n_groups
    group_score = b.view(tokens, n_groups, per_group).topk(min(2, per_group), -1).values.sum(-1)
    kept = group_score.topk(topk_groups, -1).indices
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, kept, True)
    allowed = allowed.repeat_interleave(per_group, -1)
    experts = b.masked_fill(~allowed, float("-inf")).topk(top_k, -1).indices
    weights = s.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return (weights * scale).to(torch.float32 if dtype != torch.float64 else dtype), experts


def route_backward_reference(logits, experts, grad_weights, sigmoid, renormalize, scale, dtype=torch.float32):
    """d loss / d logits in plain PyTorch, computed in ``dtype`` and returned in logits' dtype."""
    s = _scores(logits, sigmoid, dtype)
    picked = s.gather(1, experts)
    grad = grad_weights.to(dtype) * scale
    if renormalize:
        total = picked.sum(-1, keepdim=True)
        grad = (grad - (grad * picked).sum(-1, keepdim=True) / total) / total
    grad_s = torch.zeros_like(s).scatter_add(1, experts, grad)
    grad_x = grad_s * s * (1 - s) if sigmoid else s * (grad_s - (grad_s * s).sum(-1, keepdim=True))
    return grad_x.to(logits.dtype)


def _pytorch_on_cpu(tensor: torch.Tensor) -> bool:
    """A CPU call runs the Triton function through the interpreter when this process has it, else PyTorch; a traced
    CPU call (fake tensors, torch.compile) always traces the PyTorch code (the interpreter reads real memory)."""
    return tensor.device.type == "cpu" and (not jit_gating.interpreting() or jit_runtime.traced((tensor,)))


@triton_op("pk_router::route", mutates_args=())
def route(logits: torch.Tensor, bias: torch.Tensor, n_groups: int, topk_groups: int, top_k: int, sigmoid: bool,
          renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_route_args(logits, bias, n_groups, topk_groups, top_k, scale)
    if _pytorch_on_cpu(logits):
        return route_reference(logits, bias, n_groups, topk_groups, top_k, sigmoid, renormalize, scale)
    tokens, n_experts = logits.shape
    weights = logits.new_empty((tokens, top_k), dtype=torch.float32)
    experts = logits.new_empty((tokens, top_k), dtype=torch.int64)
    if tokens:
        jit_runtime.launch(KERNEL, kernels.route_forward, (tokens,),
                           (logits, bias, weights, experts, logits.stride(0), float(scale)),
                           dict(N_EXPERTS=n_experts, N_GROUPS=n_groups, TOPK_GROUPS=topk_groups, TOP_K=top_k,
                                SIGMOID=sigmoid, RENORMALIZE=renormalize))
    return weights, experts


@triton_op("pk_router::route_backward", mutates_args=())
def route_backward(logits: torch.Tensor, experts: torch.Tensor, grad_weights: torch.Tensor, sigmoid: bool,
                   renormalize: bool, scale: float) -> torch.Tensor:
    checks.check_backward_args(logits, experts, grad_weights)
    if _pytorch_on_cpu(logits):
        return route_backward_reference(logits, experts, grad_weights, sigmoid, renormalize, scale)
    grad_logits = logits.new_empty(logits.shape)
    tokens, n_experts = logits.shape
    if tokens:
        jit_runtime.launch(KERNEL, kernels.route_backward, (tokens,),
                           (logits, experts, grad_weights.contiguous(), grad_logits, logits.stride(0), float(scale)),
                           dict(N_EXPERTS=n_experts, TOP_K=experts.shape[1], SIGMOID=sigmoid,
                                RENORMALIZE=renormalize))
    return grad_logits


def _setup_context(ctx, inputs, output):
    logits, _, _, _, _, sigmoid, renormalize, scale = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.sigmoid, ctx.renormalize, ctx.scale = sigmoid, renormalize, scale


def _backward(ctx, grad_weights, _grad_experts):
    """Only the logits get a gradient: the choice of experts is piecewise constant and the bias only moves it."""
    logits, experts = ctx.saved_tensors
    if grad_weights is None:
        return None, None, None, None, None, None, None, None
    grad = route_backward(logits, experts, grad_weights.float(), ctx.sigmoid, ctx.renormalize, ctx.scale)
    return grad, None, None, None, None, None, None, None


route.register_autograd(_backward, setup_context=_setup_context)


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None = None, *, top_k: int, n_groups: int = 1,
              topk_groups: int = 1, score: str = "sigmoid", renormalize: bool = True, scale: float = 1.0):
    """(weights fp32 [tokens, top_k], experts int64 [tokens, top_k]) for router ``logits`` [tokens, n_experts] and
    an fp32 selection ``bias`` [n_experts] (None: no bias); ``score`` is "sigmoid" or "softmax"."""
    checks.require_types(logits=(logits, torch.Tensor, "a torch.Tensor"), top_k=(top_k, int, "an int"),
                         n_groups=(n_groups, int, "an int"), topk_groups=(topk_groups, int, "an int"),
                         scale=(scale, (int, float), "a float"), renormalize=(renormalize, bool, "a bool"))
    if bias is not None:
        checks.require_types(bias=(bias, torch.Tensor, "a torch.Tensor or None"))
    if score not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_route: score must be 'sigmoid' or 'softmax', got {score!r}")
    if bias is None:
        bias = logits.new_zeros(logits.shape[-1:], dtype=torch.float32)
    return route(logits, bias, n_groups, topk_groups, top_k, score == "sigmoid", renormalize, float(scale))
