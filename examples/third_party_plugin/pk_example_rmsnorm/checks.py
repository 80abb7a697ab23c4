"""residual_rmsnorm's argument checks in Python: the conditions and words of csrc/residual_rmsnorm.h.

The fake (meta) implementation runs them, so a traced call, and a call mixing a ``meta`` tensor with real ones (the
dispatcher sends it to the fake), fail as the C++ op does instead of returning uninitialised memory.
"""
from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    """The name TORCH_CHECK prints for a scalar type (c10's ScalarType names)."""
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.bool: "Bool"}.get(dtype, str(dtype).removeprefix("torch."))


def _require(condition, message: str) -> None:
    torch._check(condition, lambda: message)  # RuntimeError, as TORCH_CHECK


def require_tensors(**operands) -> None:
    """TypeError naming the first operand that is not a torch.Tensor (the public function's arguments)."""
    for name, value in operands.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"residual_rmsnorm: {name} must be a torch.Tensor, got {type(value).__name__}")


def check_residual_rmsnorm_args(x, residual, weight, eps) -> None:
    op = "residual_rmsnorm"
    _require(x.dim() >= 1, f"{op}: x must have at least 1 dimension [..., D], got a 0-d tensor")
    hidden = x.shape[-1]
    _require(hidden > 0, f"{op}: x's last dimension (the hidden size D) must be positive, got {hidden}")
    _require(x.dtype in _DTYPES, f"{op}: x must be float32, float64, float16 or bfloat16, got {_name(x.dtype)}")
    _require(residual.shape == x.shape, f"{op}: residual must have x's shape {list(x.shape)}, got "
                                        f"{list(residual.shape)}")
    _require(residual.dtype == x.dtype, f"{op}: residual must have x's dtype {_name(x.dtype)}, got {_name(residual.dtype)}")
    _require(weight.dim() == 1 and weight.shape[0] == hidden,
             f"{op}: weight must have shape [{hidden}] (x's last dimension), got {list(weight.shape)}")
    _require(weight.dtype == x.dtype, f"{op}: weight must have x's dtype {_name(x.dtype)}, got {_name(weight.dtype)}")
    _require(residual.device == x.device, f"{op}: residual must be on x's device {x.device}, got {residual.device}")
    _require(weight.device == x.device, f"{op}: weight must be on x's device {x.device}, got {weight.device}")
    _require(eps >= 0.0, f"{op}: eps must be non-negative, got {eps}")
