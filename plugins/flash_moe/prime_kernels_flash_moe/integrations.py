"""flash_moe inside other libraries' models.

transformers (5.x: its experts-implementation registry, ``ALL_EXPERTS_FUNCTIONS``)::

    from prime_kernels_flash_moe.integrations import register_transformers
    register_transformers()
    model.set_experts_implementation("flash_moe")  # or from_pretrained(..., experts_implementation="flash_moe")

Routing stays the model's own (its router's top-k ids and weights, in the dtype it gives them: Qwen3-MoE rounds them
to the model dtype, Mixtral keeps them fp32). Each experts module is mapped to one of moe()'s families
(``experts_family``): transformers' layout flags become moe()'s layout and biases (``gate_up_proj`` or, without a
gate, ``up_proj`` is w1, read in place whole: stacked when ``is_concatenated``, else interleaved, transposed when
``is_transposed``; ``down_proj`` is w2; with ``has_bias`` the ``*_bias`` tensors are b1 and b2), and the module's gate
the activation: transformers' default gate with SiLU is swiglu, gpt-oss's gate (and the classes reusing it,
KNOWN_GATES) gpt_oss with the module's own alpha and limit, relu2 without a gate. Slots that transformers marks with
expert id == num_experts (unrouted, or another rank's expert under its expert parallelism) are skipped by ``moe``.
Where flash_moe cannot run a call (an experts layout or gate it does not compute, the device, the dtype, the shape
contract), the call goes to transformers' default implementation (``grouped_mm``) and the reason is logged once; with
``strict=True`` it raises instead.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging

import torch

import prime_kernels

from .layouts import GPT_OSS_ALPHA, GPT_OSS_LIMIT, ExpertLayout

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


def _activation_name(act_fn) -> str:
    return type(act_fn).__name__ if isinstance(act_fn, torch.nn.Module) else getattr(act_fn, "__name__", repr(act_fn))


def _is_silu(act_fn) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act_fn, (SiLUActivation, torch.nn.SiLU)) or act_fn is torch.nn.functional.silu


def _is_relu2(act_fn) -> bool:
    from transformers.activations import ReLUSquaredActivation

    return isinstance(act_fn, ReLUSquaredActivation)


@dataclasses.dataclass(frozen=True)
class ExpertsFamily:
    """What ``moe`` computes for a transformers experts module: the activation (and gpt_oss's alpha and limit), the
    layout, and the names of the module's tensors that are w1, w2, b1, b2 (b1 and b2 None without biases)."""
    activation: str
    layout: ExpertLayout
    w1: str
    b1: str | None
    b2: str | None
    alpha: float = GPT_OSS_ALPHA
    limit: float = GPT_OSS_LIMIT

    def tensors(self, experts):
        """(w1, w2, b1, b2) of ``experts`` (b1, b2 None without biases)."""
        return (getattr(experts, self.w1), experts.down_proj, getattr(experts, self.b1) if self.b1 else None,
                getattr(experts, self.b2) if self.b2 else None)


# Gated experts whose own _apply_gate flash_moe computes, keyed by (module, class) of the function: the activation,
# how the gate reads gate and up from the projection ("stacked": gate_up.chunk(2), "interleaved": [..., ::2] and
# [..., 1::2]) and the module attributes holding gpt_oss's alpha and limit (its config's swiglu_alpha and
# swiglu_limit: read from the module, never restated here). Each was read in transformers 5.24's modeling files.
KNOWN_GATES = {
    ("transformers.integrations.moe", "_default_apply_gate"): ("swiglu", "stacked", None),
    # clamp(gate, max=limit), clamp(up, +-limit), (up + 1) * gate * sigmoid(alpha * gate)
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts"): ("gpt_oss", "interleaved", ("alpha", "limit")),
    ("transformers.models.openai_privacy_filter.modeling_openai_privacy_filter", "OpenAIPrivacyFilterExperts"):
        ("gpt_oss", "stacked", ("alpha", "limit")),
    ("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLExperts"):
        ("gpt_oss", "stacked", ("swiglu_alpha", "swiglu_limit")),
}


def _gate_key(experts) -> tuple[str, str] | None:
    """(module, owner) of the experts class's _apply_gate: its class for a method, its name for a function."""
    return _class_gate_key(type(experts))


# a constant of the class under torch.compile (dynamo does not trace str methods of a function's __qualname__)
@torch.compiler.assume_constant_result
def _class_gate_key(cls) -> tuple[str, str] | None:
    gate = getattr(cls, "_apply_gate", None)
    if gate is None:
        return None
    return getattr(gate, "__module__", ""), getattr(gate, "__qualname__", "").split(".")[0]


def _layout_flags(experts) -> tuple[dict | None, str | None]:
    """({flag: value} of transformers' @use_experts_implementation layout flags, None), or (None, why not)."""
    name = type(experts).__name__
    taken = inspect.signature(_transformers_moe().use_experts_implementation).parameters
    missing = [f for f in LAYOUT_FLAGS if f in taken and not hasattr(experts, f)]
    if missing:
        return None, (f"{name} has no {', '.join(missing)} (the layout flags of transformers' "
                      f"@use_experts_implementation), so its layout is unknown")
    for flag, default in LAYOUT_FLAGS.items():
        if flag not in taken and getattr(experts, flag, default) != default:
            return None, (f"{name} sets {flag}={getattr(experts, flag)!r}, a layout this transformers release does "
                          f"not define")
    return {f: getattr(experts, f, default) for f, default in LAYOUT_FLAGS.items()}, None


def _gated_activation(experts, flags) -> tuple[tuple | None, str | None]:
    """((activation, gate_up form, alpha, limit), None) for gated experts flash_moe computes, else (None, why not)."""
    name = type(experts).__name__
    known = KNOWN_GATES.get(_gate_key(experts))
    if known is None:
        return None, (f"{name} has its own gating (_apply_gate), not transformers' act(gate) * up nor gpt-oss's "
                      f"clamped sigmoid-GLU")
    activation, form, constants = known
    declared = "stacked" if flags["is_concatenated"] else "interleaved"
    if form != declared:
        return None, (f"{name} declares is_concatenated={flags['is_concatenated']} (gate and up {declared}) but its "
                      f"_apply_gate reads them {form}")
    if activation == "swiglu" and not _is_silu(getattr(experts, "act_fn", None)):
        return None, f"{name}'s activation is {_activation_name(getattr(experts, 'act_fn', None))}, not SiLU"
    alpha, limit = (GPT_OSS_ALPHA, GPT_OSS_LIMIT)
    if constants is not None:
        alpha, limit = (getattr(experts, attr, None) for attr in constants)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)):
            return None, (f"{name}.{constants[0]} and .{constants[1]} (gpt-oss's alpha and limit) must be numbers, "
                          f"got {alpha!r} and {limit!r}")
    return (activation, form, float(alpha), float(limit)), None


def experts_family(experts: torch.nn.Module) -> tuple[ExpertsFamily | None, str | None]:
    """(the family moe() computes ``experts`` as, None), or (None, why flash_moe does not compute it as stored)."""
    name = type(experts).__name__
    flags, reason = _layout_flags(experts)
    if reason:
        return None, reason
    if flags["has_post_expert_norm"]:
        return None, f"{name} normalizes each expert's output (has_post_expert_norm=True); flash_moe combines them directly"
    if flags["has_gate"]:
        gated, reason = _gated_activation(experts, flags)
        if reason:
            return None, reason
        activation, form, alpha, limit = gated
        w1, b1 = "gate_up_proj", "gate_up_proj_bias"
    else:
        if not _is_relu2(getattr(experts, "act_fn", None)):
            return None, (f"{name} has no gate (has_gate=False: up_proj only) and activation "
                          f"{_activation_name(getattr(experts, 'act_fn', None))}; flash_moe computes relu2 there")
        activation, form, alpha, limit = "relu2", "stacked", GPT_OSS_ALPHA, GPT_OSS_LIMIT
        w1, b1 = "up_proj", "up_proj_bias"
    family = ExpertsFamily(activation, ExpertLayout(form, transposed=bool(flags["is_transposed"])), w1,
                           b1 if flags["has_bias"] else None, "down_proj_bias" if flags["has_bias"] else None, alpha,
                           limit)
    reason = _tensors_reason(experts, family)
    return (None, reason) if reason else (family, None)


def _tensors_reason(experts, family: ExpertsFamily) -> str | None:
    """None when the module's tensors have the family's shapes (layouts.py's table), else why not."""
    name = type(experts).__name__
    names = [n for n in (family.w1, "down_proj", family.b1, family.b2) if n]
    tensors = [getattr(experts, n, None) for n in names]
    missing = [n for n, t in zip(names, tensors) if not isinstance(t, torch.Tensor)]
    if missing:
        return f"{name} has no {', '.join(missing)} tensor (its layout flags name {', '.join(names)})"
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return (f"{name}'s expert tensors are {' / '.join(type(t).__name__ for t in tensors)} (sharded or quantized), "
                f"not plain tensors")
    w1, w2, b1, b2 = family.tensors(experts)
    gated = family.activation != "relu2"
    E = w1.shape[0] if w1.dim() == 3 else -1
    dim, out = (w1.shape[1], w1.shape[2]) if family.layout.transposed else (w1.shape[2], w1.shape[1])
    hidden = out // 2 if gated else out
    w1_form = f"(E, {'2I' if gated else 'I'}, H)"
    w2_form, w2_shape = "(E, H, I)", (E, dim, hidden)
    if family.layout.transposed:
        w1_form, w2_form, w2_shape = f"(E, H, {'2I' if gated else 'I'})", "(E, I, H)", (E, hidden, dim)
    if w1.dim() != 3 or (gated and out % 2) or w2.shape != w2_shape:
        return (f"{name}'s weights are not {family.w1} {w1_form} and down_proj {w2_form}: got {tuple(w1.shape)} and "
                f"{tuple(w2.shape)}")
    if b1 is not None and (b1.shape != (E, out) or b2.shape != (E, dim)):
        return (f"{name}'s biases are not {family.b1} (E, {'2I' if gated else 'I'}) and {family.b2} (E, H): got "
                f"{tuple(b1.shape)} and {tuple(b2.shape)}")
    if getattr(experts, "num_experts", E) != E:
        return f"{name}.num_experts is {experts.num_experts} but {family.w1} holds {E} experts"
    return None


def unsupported_layout_reason(experts: torch.nn.Module) -> str | None:
    """None when flash_moe computes ``experts`` (a transformers experts module) as it is stored, else why not."""
    return experts_family(experts)[1]


def _kernel(device: torch.device):
    """(flash_moe's ops module, None) where it runs on ``device``, else (None, why not); asked once per device."""
    if device not in _kernels:
        reason = prime_kernels.unavailable_reason(KERNEL, device)
        _kernels[device] = (None, reason) if reason else (prime_kernels.load(KERNEL, device), None)
    return _kernels[device]


def unsupported_call_reason(experts, hidden_states, top_k_index, top_k_weights) -> str | None:
    """None when flash_moe runs this experts call, else why not (layout, device, dtypes, shape contract)."""
    family, reason = experts_family(experts)
    if reason:
        return reason
    w1, w2, b1, b2 = family.tensors(experts)
    named = [(n, t) for n, t in zip((family.w1, "down_proj", family.b1, family.b2), (w1, w2, b1, b2)) if n]
    if any(t.dtype != torch.bfloat16 for _, t in named):
        return (f"flash_moe needs bfloat16 expert weights, got "
                + " and ".join(f"{n} {t.dtype}" for n, t in named))
    dim, out = (w1.shape[1], w1.shape[2]) if family.layout.transposed else (w1.shape[2], w1.shape[1])
    if not hidden_states.is_floating_point() or hidden_states.dim() != 2 or hidden_states.shape[1] != dim:
        return (f"flash_moe needs hidden_states (tokens, {dim}) of a float dtype, got "
                f"{hidden_states.dtype} of shape {tuple(hidden_states.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64) or not top_k_weights.is_floating_point():
        return (f"flash_moe needs int32/int64 top_k_index and float top_k_weights, got {top_k_index.dtype} and "
                f"{top_k_weights.dtype}")
    devices = {t.device for t in (hidden_states, top_k_index, top_k_weights, *(t for _, t in named))}
    if len(devices) != 1:
        return f"flash_moe needs every tensor on one device, got {sorted(map(str, devices))}"
    ops, reason = _kernel(w1.device)
    return reason or ops.unsupported_shape_reason(dim, out // 2 if family.activation != "relu2" else out)


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
    family, _ = experts_family(experts)
    w1, w2, b1, b2 = family.tensors(experts)
    # the fused gate_up_proj passed whole (w3 None): its gradient comes back as one tensor, not through two slices
    out = ops.moe(hidden_states.to(torch.bfloat16), w1, w2, None, top_k_index, top_k_weights,
                  activation=family.activation, alpha=family.alpha, limit=family.limit, b1=b1, b2=b2,
                  layout=family.layout, num_experts=w1.shape[0])
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
    Raises a RuntimeError saying so when transformers is missing or has no experts-implementation registry, and a
    ValueError for a name transformers' own implementation (or any other not flash_moe's) is registered under: replacing
    ``grouped_mm`` would make every fallback call flash_moe again, without end.
    """
    functions = _transformers_moe().ALL_EXPERTS_FUNCTIONS
    taken = functions.get(name)
    if name == FALLBACK or taken not in (None, _lenient, _strict):
        raise ValueError(
            f"register_transformers: name {name!r} is taken by {getattr(taken, '__module__', '?')}."
            f"{getattr(taken, '__qualname__', taken)!s}" + (f" (transformers' {FALLBACK}, which flash_moe falls back "
                                                             "to)" if name == FALLBACK else "")
            + f"; give flash_moe a name of its own, e.g. {DEFAULT_NAME!r}")
    functions.register(name, _strict if strict else _lenient)
    return name
