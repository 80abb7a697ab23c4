"""moe_router's argument checks: one place for the conditions and words every path raises (eager, fake, compiled)."""
from __future__ import annotations

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One program holds a token's scores in registers; beyond this many experts it would spill (and no model routes more).
MAX_EXPERTS = 1024


def _require(condition, message: str) -> None:
    torch._check(condition, lambda: message)  # RuntimeError, as a C++ TORCH_CHECK


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_types(**arguments) -> None:
    """TypeError naming the first argument of the wrong Python type (the public function's arguments)."""
    for name, (value, kinds, words) in arguments.items():
        if not isinstance(value, kinds) or (kinds == int and isinstance(value, bool)):
            raise TypeError(f"moe_route: {name} must be {words}, got {type(value).__name__}")


def unsupported_experts_reason(n_experts: int) -> str | None:
    if n_experts < 1:
        return f"moe_router needs at least one expert (logits' last dimension), got {n_experts}"
    if n_experts > MAX_EXPERTS:
        return f"moe_router routes at most {MAX_EXPERTS} experts (one token's scores stay in registers), got {n_experts}"
    return None


def check_route_args(logits, bias, n_groups, topk_groups, top_k, scale) -> None:
    op = "moe_router"
    _require(logits.dim() == 2, f"{op}: logits must be 2-D [tokens, experts], got {logits.dim()}-D {list(logits.shape)}")
    _require(logits.dtype in LOGIT_DTYPES, f"{op}: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    n_experts = logits.shape[1]
    too_many = unsupported_experts_reason(n_experts)
    _require(too_many is None, f"{op}: {too_many}")
    _require(bias.dim() == 1 and bias.shape[0] == n_experts,
             f"{op}: bias must have shape [{n_experts}] (logits' last dimension), got {list(bias.shape)}")
    _require(bias.dtype == torch.float32, f"{op}: bias must be float32, got {bias.dtype}")
    _require(bias.device == logits.device, f"{op}: bias must be on logits' device {logits.device}, got {bias.device}")
    _require(n_groups >= 1 and n_experts % n_groups == 0,
             f"{op}: n_groups must be positive and divide the {n_experts} experts, got {n_groups}")
    _require(1 <= topk_groups <= n_groups, f"{op}: topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    allowed = topk_groups * (n_experts // n_groups)
    _require(1 <= top_k <= allowed,
             f"{op}: top_k must be in [1, {allowed}] (the experts of topk_groups groups), got {top_k}")
    _require(scale == scale and abs(scale) != float("inf"), f"{op}: scale must be finite, got {scale}")


def check_backward_args(logits, experts, grad_weights) -> None:
    op = "moe_router backward"
    _require(logits.dim() == 2 and logits.dtype in LOGIT_DTYPES,
             f"{op}: logits must be 2-D float32, bfloat16 or float16, got {logits.dim()}-D {logits.dtype}")
    _require(experts.dim() == 2 and experts.shape[0] == logits.shape[0] and experts.dtype == torch.int64,
             f"{op}: experts must be int64 [{logits.shape[0]}, top_k], got {experts.dtype} {list(experts.shape)}")
    _require(grad_weights.shape == experts.shape and grad_weights.dtype == torch.float32,
             f"{op}: grad_weights must be float32 of experts' shape {list(experts.shape)}, got {grad_weights.dtype} "
             f"{list(grad_weights.shape)}")
    _require(experts.device == logits.device and grad_weights.device == logits.device,
             f"{op}: experts and grad_weights must be on logits' device {logits.device}")
