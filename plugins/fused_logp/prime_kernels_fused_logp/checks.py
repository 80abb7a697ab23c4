"""The ops' argument checks in Python (the conditions and words of csrc/fused_logp.cpp and csrc/linear_logp.cpp), and
the public functions' checks of what the ops never see.

The fake (meta) implementations run the op checks, so a traced call, and a call mixing a ``meta`` tensor with real
ones (the dispatcher sends it to the fake), fail as the C++ ops do instead of returning uninitialised memory. The
public functions name their own arguments: a list, an array, None or a string where a tensor belongs is a TypeError
naming it, not an AttributeError from deep inside.
"""
from __future__ import annotations

import math
import numbers

import torch

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT32_MIN, _FLOAT32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _require(condition, message: str) -> None:
    torch._check(condition, lambda: message)  # RuntimeError, as TORCH_CHECK


def _dtype_name(dtype: torch.dtype) -> str:
    """The name TORCH_CHECK prints for a scalar type (c10's ScalarType names)."""
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
            torch.bool: "Bool"}.get(dtype, str(dtype).removeprefix("torch."))


# ---- fused_logp::logp_entropy / logp_entropy_backward (check_forward_args / check_backward_args) --------------------
def _check_token_temperature_form(p: str, tt, N: int) -> None:
    _require(tt.dtype == torch.float32, f"{p}: token_temperature dtype must be float32, got {_dtype_name(tt.dtype)}")
    _require(tt.dim() == 1 and tt.shape[0] == N,
             f"{p}: token_temperature must have shape [{N}] (one per token), got {list(tt.shape)}")


def check_logp_entropy_args(logits, labels, temperature, token_temperature, constants) -> None:
    p = "fused_logp"
    _require(logits.dim() == 2, f"{p}: logits must be 2-D [N, V], got {logits.dim()}-D with shape {list(logits.shape)}")
    _require(logits.dtype in (torch.float32, torch.bfloat16, torch.float16),
             f"{p}: logits dtype must be float32, bfloat16 or float16, got {_dtype_name(logits.dtype)}")
    N, V = logits.shape
    _require(V >= 1, f"{p}: logits vocab size (last dim) must be >= 1, got {V}")
    _require(V <= constants["MAX_VOCAB_SIZE"], f"{p}: logits vocab size must be <= {constants['MAX_VOCAB_SIZE']}, got {V}")
    _require(N <= constants["MAX_NUM_TOKENS"], f"{p}: number of tokens must be <= {constants['MAX_NUM_TOKENS']}, got {N}")
    _require(V == 1 or logits.stride(1) == 1, f"{p}: logits last dim must have stride 1, got stride {logits.stride(1)}")
    _require(labels.dim() == 1, f"{p}: labels must be 1-D [N], got {labels.dim()}-D with shape {list(labels.shape)}")
    _require(labels.dtype in (torch.int64, torch.int32),
             f"{p}: labels dtype must be int64 or int32, got {_dtype_name(labels.dtype)}")
    _require(labels.shape[0] == N, f"{p}: labels must have N = {N} entries (logits rows), got {labels.shape[0]}")
    _require(labels.device == logits.device, f"{p}: labels must be on logits' device {logits.device}, got {labels.device}")
    _require(math.isfinite(temperature) and temperature > 0.0,
             f"{p}: temperature must be finite and > 0, got {temperature}")
    if token_temperature is not None:
        tt = token_temperature
        _check_token_temperature_form(p, tt, N)
        _require(tt.device == logits.device,
                 f"{p}: token_temperature must be on logits' device {logits.device}, got {tt.device}")


def check_logp_entropy_backward_args(grad_logp, grad_entropy, logits, labels, temperature, token_temperature, stats,
                                     constants) -> None:
    p = "fused_logp"
    check_logp_entropy_args(logits, labels, temperature, token_temperature, constants)
    N = logits.shape[0]
    _require(grad_logp.dim() == 1 and grad_logp.shape[0] == N,
             f"{p}: grad_logp must have shape [{N}], got {list(grad_logp.shape)}")
    _require(grad_logp.is_floating_point(),
             f"{p}: grad_logp must be floating point, got {_dtype_name(grad_logp.dtype)}")
    _require(grad_logp.device == logits.device,
             f"{p}: grad_logp must be on logits' device {logits.device}, got {grad_logp.device}")
    if grad_entropy is not None:
        ge = grad_entropy
        _require(ge.dim() == 1 and ge.shape[0] == N, f"{p}: grad_entropy must have shape [{N}], got {list(ge.shape)}")
        _require(ge.is_floating_point(), f"{p}: grad_entropy must be floating point, got {_dtype_name(ge.dtype)}")
        _require(ge.device == logits.device,
                 f"{p}: grad_entropy must be on logits' device {logits.device}, got {ge.device}")
    _require(stats.dtype == torch.float64,
             f"{p}: stats must be float64 (from logp_entropy), got {_dtype_name(stats.dtype)}")
    _require(stats.dim() == 2 and stats.shape[0] == N and stats.shape[1] == 2,
             f"{p}: stats must have shape [{N}, 2], got {list(stats.shape)}")
    _require(stats.device == logits.device, f"{p}: stats must be on logits' device {logits.device}, got {stats.device}")


# ---- the logit transforms (cpu_common.h: check_logit_transform, check_effective_temperature) ------------------------
_MAX_SOFTCAP_SLOPE = 1e15  # cpu_common.h's kMaxSlope: the CUDA kernels' x * logit_scale / softcap as a float pair


def _slope_in_range(softcap, logit_scale) -> bool:
    return _FLOAT32_MIN <= logit_scale / softcap <= _MAX_SOFTCAP_SLOPE


def check_logit_transform(p: str, softcap, logit_scale) -> None:
    lo, hi = f"{_FLOAT32_MIN:g}", f"{_FLOAT32_MAX:g}"  # numbers as TORCH_CHECK prints doubles
    _require(_FLOAT32_MIN <= logit_scale <= _FLOAT32_MAX,
             f"{p}: logit_scale must be finite and > 0 (a normal float32, in [{lo}, {hi}]), got {logit_scale:g}")
    if softcap is not None:
        _require(_FLOAT32_MIN <= softcap <= _FLOAT32_MAX,
                 f"{p}: softcap must be None or finite and > 0 (a normal float32, in [{lo}, {hi}]), got {softcap:g}")
        _require(_slope_in_range(softcap, logit_scale),
                 f"{p}: logit_scale / softcap must be in [{lo}, {_MAX_SOFTCAP_SLOPE:g}], got {logit_scale:g} / "
                 f"{softcap:g} = {logit_scale / softcap:g}")


def check_effective_temperature(p: str, temperature, softcap, logit_scale) -> None:
    t = temperature / (softcap if softcap is not None else logit_scale)
    _require(_FLOAT32_MIN <= t <= _FLOAT32_MAX,
             f"{p}: temperature / {'softcap' if softcap is not None else 'logit_scale'} = {t:g} must be a normal "
             f"float32, in [{_FLOAT32_MIN:g}, {_FLOAT32_MAX:g}] (the kernels' effective temperature; temperature = "
             f"{temperature:g})")


# ---- fused_logp::linear_logp_entropy / linear_logp_entropy_backward ------------------------------------------------
def _same_device(t, hidden, name) -> None:
    _require(t.device == hidden.device, f"linear_logp: {name} must be on hidden's device {hidden.device}, got {t.device}")


def check_linear_logp_entropy_args(hidden, weight, labels, temperature, token_temperature, bias, constants) -> None:
    p = "linear_logp"
    _require(hidden.dim() == 2, f"{p}: hidden must be 2-D [N, H], got {hidden.dim()}-D with shape {list(hidden.shape)}")
    _require(weight.dim() == 2, f"{p}: weight must be 2-D [V, H], got {weight.dim()}-D with shape {list(weight.shape)}")
    st = hidden.dtype
    _require(st in (torch.bfloat16, torch.float16, torch.float32),
             f"{p}: hidden dtype must be bfloat16 or float16 (float32 on CPU), got {_dtype_name(st)}")
    _require(weight.dtype == st,
             f"{p}: weight dtype must equal hidden's ({_dtype_name(st)}), got {_dtype_name(weight.dtype)}")
    N, H = hidden.shape
    V = weight.shape[0]
    _require(weight.shape[1] == H, f"{p}: weight must have H = {H} columns (hidden's last dim), got shape "
                                   f"{list(weight.shape)}")
    _require(H >= 1, f"{p}: hidden size (last dim of hidden) must be >= 1, got {H}")
    _require(V >= 1, f"{p}: weight vocab size (rows) must be >= 1, got {V}")
    _require(V <= constants["MAX_VOCAB_SIZE"], f"{p}: weight vocab size must be <= {constants['MAX_VOCAB_SIZE']}, got {V}")
    _require(N <= constants["MAX_NUM_TOKENS"], f"{p}: number of tokens must be <= {constants['MAX_NUM_TOKENS']}, got {N}")
    _same_device(weight, hidden, "weight")
    _require(labels.dim() == 1, f"{p}: labels must be 1-D [N], got {labels.dim()}-D with shape {list(labels.shape)}")
    _require(labels.dtype in (torch.int64, torch.int32),
             f"{p}: labels dtype must be int64 or int32, got {_dtype_name(labels.dtype)}")
    _require(labels.shape[0] == N, f"{p}: labels must have N = {N} entries (hidden rows), got {labels.shape[0]}")
    _same_device(labels, hidden, "labels")
    _require(math.isfinite(temperature) and temperature > 0.0,
             f"{p}: temperature must be finite and > 0, got {temperature}")
    _require(_FLOAT32_MIN <= temperature <= _FLOAT32_MAX,
             f"{p}: temperature must be a normal float32, in [{_FLOAT32_MIN}, {_FLOAT32_MAX}], got {temperature}")
    if token_temperature is not None:
        tt = token_temperature
        _check_token_temperature_form(p, tt, N)
        _same_device(tt, hidden, "token_temperature")
    if bias is not None:
        _require(bias.is_floating_point(), f"{p}: bias must be floating point, got {_dtype_name(bias.dtype)}")
        _require(bias.dim() == 1 and bias.shape[0] == V,
                 f"{p}: bias must have shape [{V}] (weight rows), got {list(bias.shape)}")
        _same_device(bias, hidden, "bias")


def check_linear_logp_entropy_backward_args(grad_logp, grad_entropy, hidden, weight, labels, temperature,
                                            token_temperature, bias, stats, constants) -> None:
    p = "linear_logp"
    check_linear_logp_entropy_args(hidden, weight, labels, temperature, token_temperature, bias, constants)
    N = hidden.shape[0]
    _require(grad_logp.dim() == 1 and grad_logp.shape[0] == N,
             f"{p}: grad_logp must have shape [{N}], got {list(grad_logp.shape)}")
    _require(grad_logp.is_floating_point(),
             f"{p}: grad_logp must be floating point, got {_dtype_name(grad_logp.dtype)}")
    _same_device(grad_logp, hidden, "grad_logp")
    if grad_entropy is not None:
        ge = grad_entropy
        _require(ge.dim() == 1 and ge.shape[0] == N, f"{p}: grad_entropy must have shape [{N}], got {list(ge.shape)}")
        _require(ge.is_floating_point(), f"{p}: grad_entropy must be floating point, got {_dtype_name(ge.dtype)}")
        _same_device(ge, hidden, "grad_entropy")
    _require(stats.dtype == torch.float64,
             f"{p}: stats must be float64 (from linear_logp_entropy), got {_dtype_name(stats.dtype)}")
    _require(stats.dim() == 2 and stats.shape[0] == N and stats.shape[1] == 2,
             f"{p}: stats must have shape [{N}, 2], got {list(stats.shape)}")
    _same_device(stats, hidden, "stats")


# ---- the public functions' own arguments -----------------------------------------------------------------------------
def require_tensor(fn: str, name: str, value, *, optional: bool = False) -> None:
    """TypeError unless ``value`` is a torch.Tensor (or None where ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, torch.Tensor):
        what = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{fn}: {name} must be {what}, got {type(value).__name__}")


def is_real(value) -> bool:
    """A real number: Python's int and float, and NumPy's scalars (np.float32 is no Python float); not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require_flags(fn: str, **flags) -> None:
    """TypeError naming the first flag that is not a bool: a string or a tensor there would be read as its truth."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{fn}: {name} must be True or False, got {type(value).__name__} {value!r}")


def require_temperature(fn: str, temperature) -> None:
    """A real number, or a floating-point tensor (its dtype and shape are checked where it is flattened)."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f"{fn}: a temperature tensor must be floating point (it is used as float32), got "
                            f"{temperature.dtype}")
        return
    if not is_real(temperature):
        raise TypeError(f"{fn}: temperature must be a real number or a floating-point tensor, got "
                        f"{type(temperature).__name__}")


def require_logit_transform(fn: str, softcap, logit_scale) -> None:
    """The public functions' softcap (None or a real number) and logit_scale (a real number), both finite and > 0 and
    within float32's normal range (the kernels take them as float32): a TypeError or ValueError naming the argument."""
    for name, value, optional in (("softcap", softcap, True), ("logit_scale", logit_scale, False)):
        if optional and value is None:
            continue
        if not is_real(value):
            what = "None or a real number" if optional else "a real number"
            raise TypeError(f"{fn}: {name} must be {what}, got {type(value).__name__}")
        if not _FLOAT32_MIN <= float(value) <= _FLOAT32_MAX:  # float(): a NumPy float16 compared with 3e38 warns
            raise ValueError(f"{fn}: {name} must be finite and > 0 (a normal float32, in [{_FLOAT32_MIN}, "
                             f"{_FLOAT32_MAX}]), got {value}")
    softcap, logit_scale = None if softcap is None else float(softcap), float(logit_scale)
    if softcap is not None and not _slope_in_range(softcap, logit_scale):
        raise ValueError(f"{fn}: logit_scale / softcap must be in [{_FLOAT32_MIN}, {_MAX_SOFTCAP_SLOPE:g}], got "
                         f"{logit_scale} / {softcap} = {logit_scale / softcap}")


def temperature_as_float32(fn: str, temperature: torch.Tensor) -> torch.Tensor:
    """The one temperature rule of both ops: any floating-point tensor is used as float32, detached (bf16 and fp16
    convert exactly, float64 rounds to the nearest float32)."""
    if not temperature.is_floating_point():
        raise TypeError(f"{fn}: a temperature tensor must be floating point (it is used as float32), got "
                        f"{temperature.dtype}")
    return temperature.detach().to(torch.float32)


def require_ignore_index(fn: str, ignore_index) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(f"{fn}: ignore_index must fit in int64, got {ignore_index}")


def require_process_group(fn: str, process_group) -> None:
    """None or a torch.distributed ProcessGroup (checked before any collective touches it)."""
    if process_group is None:
        return
    import torch.distributed as dist

    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{fn}: process_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(process_group).__name__}")


def refuse_double_backward(op: str, differentiable: str) -> None:
    """Registers an autograd formula for the backward op ``fused_logp::{op}`` that raises: without one, a second
    derivative through ``differentiable`` would silently come out as zero (after torch's generic warning)."""
    def backward(ctx, *grads):
        raise RuntimeError(f"{differentiable}: double backward is not supported (fused_logp::{op} has no derivative; "
                           f"the gradient is first-order only)")

    torch.library.register_autograd(f"fused_logp::{op}", backward)


def require_ints(fn: str, **values) -> None:
    """TypeError naming the first value that is not an int (bool excluded)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}")


def require_needs(fn: str, needs) -> None:
    """``needs``: three flags (grad_hidden, grad_weight, grad_bias)."""
    if not isinstance(needs, (tuple, list)) or len(needs) != 3:
        raise TypeError(f"{fn}: needs must be three flags (grad_hidden, grad_weight, grad_bias), got {needs!r}")
