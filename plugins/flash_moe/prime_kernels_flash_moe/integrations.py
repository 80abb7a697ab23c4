"""flash_moe inside other libraries' models.

transformers (5.x: its experts-implementation registry, ``ALL_EXPERTS_FUNCTIONS``)::

    from prime_kernels_flash_moe.integrations import register_transformers
    register_transformers()
    model.set_experts_implementation("flash_moe")  # or from_pretrained(..., experts_implementation="flash_moe")

Routing stays the model's own (its router's top-k ids and weights, in the dtype it gives them: Qwen3-MoE rounds them
to the model dtype, Mixtral keeps them fp32). The experts' fused weights are read in place: ``gate_up_proj`` (E, 2I, H)
goes to ``moe`` whole as its stacked w1 (gate = its first I rows, up = the next I; its gradient comes back as one
tensor), ``down_proj`` (E, H, I) is w2. Slots that transformers marks with
expert id == num_experts (unrouted, or another rank's expert under its expert parallelism) are skipped by ``moe``.
Where flash_moe cannot run a call (an experts layout it does not compute, the device, the dtype, the shape contract),
the call goes to transformers' default implementation (``grouped_mm``) and the reason is logged once; with
``strict=True`` it raises instead.
"""
from __future__ import annotations

import inspect
import logging

import torch

import prime_kernels

logger = logging.getLogger(__name__)

KERNEL = "flash_moe"
DEFAULT_NAME = "flash_moe"
# transformers' default experts implementation (PreTrainedModel.get_correct_experts_implementation)
FALLBACK = "grouped_mm"
# @use_experts_implementation's layout flags and their defaults there. A release whose decorator does not take a flag
# (transformers 5.17 has no has_post_expert_norm) cannot give any model that layout: its modules have the default.
LAYOUT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                "has_post_expert_norm": False}

_reported: set[str] = set()
_kernels: dict[torch.device, tuple] = {}
_moe_module = None


def _transformers_moe():
    """transformers.integrations.moe, or a RuntimeError saying what is missing."""
    global _moe_module
    if _moe_module is not None:
        return _moe_module
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError(f"register_transformers needs transformers 5.x installed (pip install transformers); "
                           f"importing it failed: {exc}") from exc
    try:
        from transformers.integrations import moe
    except ImportError as exc:
        raise RuntimeError(f"register_transformers needs transformers 5.x (its experts-implementation registry, "
                           f"transformers.integrations.moe); transformers {transformers.__version__} has none: "
                           f"{exc}") from exc
    missing = [n for n in ("ALL_EXPERTS_FUNCTIONS", "use_experts_implementation") if not hasattr(moe, n)]
    if missing:
        raise RuntimeError(f"register_transformers needs transformers 5.x's experts-implementation registry; "
                           f"transformers {transformers.__version__} lacks {', '.join(missing)} in "
                           f"transformers.integrations.moe")
    _moe_module = moe
    return moe


def _is_silu(act_fn) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act_fn, (SiLUActivation, torch.nn.SiLU)) or act_fn is torch.nn.functional.silu


def unsupported_layout_reason(experts: torch.nn.Module) -> str | None:
    """None when flash_moe computes ``experts`` (a transformers experts module) as it is stored, else why not."""
    name = type(experts).__name__
    taken = inspect.signature(_transformers_moe().use_experts_implementation).parameters
    missing = [f for f in LAYOUT_FLAGS if f in taken and not hasattr(experts, f)]
    if missing:
        return (f"{name} has no {', '.join(missing)} (the layout flags of transformers' @use_experts_implementation), "
                f"so its layout is unknown")
    for flag, default in LAYOUT_FLAGS.items():
        if flag not in taken and getattr(experts, flag, default) != default:
            return f"{name} sets {flag}={getattr(experts, flag)!r}, a layout this transformers release does not define"
    flags = {f: getattr(experts, f, default) for f, default in LAYOUT_FLAGS.items()}
    if not flags["has_gate"]:
        return f"{name} has no gate (has_gate=False: up_proj only); flash_moe computes gated SwiGLU experts"
    if flags["has_bias"]:
        return f"{name} has expert biases (has_bias=True); flash_moe's experts have none"
    if flags["is_transposed"]:
        return (f"{name} stores its experts transposed (is_transposed=True: gate_up_proj (E, H, 2I)); flash_moe reads "
                f"(E, 2I, H) in place and would copy the weights on every call")
    if not flags["is_concatenated"]:
        return (f"{name} interleaves gate and up rows (is_concatenated=False); flash_moe reads gate rows then up rows "
                f"in place")
    if flags["has_post_expert_norm"]:
        return f"{name} normalizes each expert's output (has_post_expert_norm=True); flash_moe combines them directly"
    default_gate = getattr(_transformers_moe(), "_default_apply_gate", None)
    if getattr(type(experts), "_apply_gate", None) is not default_gate:
        return f"{name} has its own gating (_apply_gate), not transformers' act(gate) * up"
    if not _is_silu(getattr(experts, "act_fn", None)):
        return f"{name}'s activation is {type(getattr(experts, 'act_fn', None)).__name__}, not SiLU"
    w, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(w, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return f"{name} has no gate_up_proj and down_proj tensors"
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (w, w2)):
        return (f"{name}'s expert weights are {type(w).__name__} / {type(w2).__name__} (sharded or quantized), not "
                f"plain tensors")
    if w.dim() != 3 or w.shape[1] % 2 or w2.shape != (w.shape[0], w.shape[2], w.shape[1] // 2):
        return (f"{name}'s weights are not gate_up_proj (E, 2I, H) and down_proj (E, H, I): got "
                f"{tuple(w.shape)} and {tuple(w2.shape)}")
    if getattr(experts, "num_experts", w.shape[0]) != w.shape[0]:
        return f"{name}.num_experts is {experts.num_experts} but gate_up_proj holds {w.shape[0]} experts"
    return None


def _kernel(device: torch.device):
    """(flash_moe's ops module, None) where it runs on ``device``, else (None, why not); asked once per device."""
    if device not in _kernels:
        reason = prime_kernels.unavailable_reason(KERNEL, device)
        _kernels[device] = (None, reason) if reason else (prime_kernels.load(KERNEL, device), None)
    return _kernels[device]


def unsupported_call_reason(experts, hidden_states, top_k_index, top_k_weights) -> str | None:
    """None when flash_moe runs this experts call, else why not (layout, device, dtypes, shape contract)."""
    reason = unsupported_layout_reason(experts)
    if reason:
        return reason
    w, w2 = experts.gate_up_proj, experts.down_proj
    if w.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return f"flash_moe needs bfloat16 expert weights, got gate_up_proj {w.dtype} and down_proj {w2.dtype}"
    if not hidden_states.is_floating_point() or hidden_states.dim() != 2 or hidden_states.shape[1] != w.shape[2]:
        return (f"flash_moe needs hidden_states (tokens, {w.shape[2]}) of a float dtype, got "
                f"{hidden_states.dtype} of shape {tuple(hidden_states.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64) or not top_k_weights.is_floating_point():
        return (f"flash_moe needs int32/int64 top_k_index and float top_k_weights, got {top_k_index.dtype} and "
                f"{top_k_weights.dtype}")
    devices = {t.device for t in (hidden_states, top_k_index, top_k_weights, w, w2)}
    if len(devices) != 1:
        return f"flash_moe needs every tensor on one device, got {sorted(map(str, devices))}"
    ops, reason = _kernel(w.device)
    return reason or ops.unsupported_shape_reason(w.shape[2], w.shape[1] // 2)


def _fallback(experts, reason, *args):
    key = f"{type(experts).__name__}: {reason}"
    if key not in _reported and not torch.compiler.is_compiling():
        _reported.add(key)
        logger.warning("flash_moe experts: running transformers' %s for %s: %s", FALLBACK, type(experts).__name__,
                       reason)
    return _transformers_moe().ALL_EXPERTS_FUNCTIONS[FALLBACK](experts, *args)


def _experts_forward(experts, hidden_states, top_k_index, top_k_weights, *, strict: bool):
    reason = unsupported_call_reason(experts, hidden_states, top_k_index, top_k_weights)
    if reason:
        if strict:
            raise RuntimeError(f"flash_moe experts (strict): {reason}")
        return _fallback(experts, reason, hidden_states, top_k_index, top_k_weights)
    ops, _ = _kernel(hidden_states.device)
    # gate_up_proj passed whole (w3 None): its gradient comes back as one tensor, not through two slices
    w = experts.gate_up_proj
    out = ops.moe(hidden_states.to(torch.bfloat16), w, experts.down_proj, None, top_k_index, top_k_weights,
                  num_experts=w.shape[0])
    return out.to(hidden_states.dtype)


def _lenient(experts, hidden_states, top_k_index, top_k_weights):
    return _experts_forward(experts, hidden_states, top_k_index, top_k_weights, strict=False)


def _strict(experts, hidden_states, top_k_index, top_k_weights):
    return _experts_forward(experts, hidden_states, top_k_index, top_k_weights, strict=True)


def register_transformers(name: str = DEFAULT_NAME, *, strict: bool = False) -> str:
    """Register flash_moe as transformers experts implementation ``name`` (idempotent) and return ``name``.

    Then ``model.set_experts_implementation(name)`` (or ``from_pretrained(..., experts_implementation=name)``) routes
    every experts module of the model through ``ops.moe``. A call flash_moe cannot run goes to transformers'
    ``grouped_mm`` with the reason logged once (``strict=False``) or raises a RuntimeError with it (``strict=True``).
    Raises a RuntimeError saying so when transformers is missing or has no experts-implementation registry.
    """
    _transformers_moe().ALL_EXPERTS_FUNCTIONS.register(name, _strict if strict else _lenient)
    return name
