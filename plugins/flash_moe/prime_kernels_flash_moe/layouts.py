"""Expert families: the activation and how the weights are stored, and the views the ops read them through.

A family is an activation (``"swiglu"``, ``"gpt_oss"``, ``"relu2"``: csrc/flash_moe.h says what each computes) and an
``ExpertLayout``. The ops see every layout as views of the caller's tensors, never copies: gate and up as
(E, hidden, dim), w2 as (E, dim, hidden), whatever their strides; the gradients come back in the caller's layout.

| layout | w1 | w3 | w2 | b1 |
|---|---|---|---|---|
| ``separate`` | gate (E, I, dim) | up (E, I, dim) | (E, dim, I) | (E, 2I): [gate \\| up] |
| ``stacked`` | [gate; up] (E, 2I, dim) | None | (E, dim, I) | (E, 2I): [gate \\| up] |
| ``interleaved`` | gate row 2i, up row 2i + 1 (E, 2I, dim) | None | (E, dim, I) | (E, 2I), interleaved |
| not gated (relu2) | (E, I, dim) | None | (E, dim, I) | (E, I) |

``transposed=True`` stores each weight as (E, in, out) instead (transformers' ``is_transposed``: gpt-oss keeps
``gate_up_proj`` (E, dim, 2I) interleaved and ``down_proj`` (E, I, dim)); b2 is (E, dim) in every layout.
"""
from __future__ import annotations

import dataclasses

import torch

from . import checks

GATE_UP_FORMS = ("separate", "stacked", "interleaved")
# gpt-oss's activation constants (its config's swiglu_limit and the sigmoid's alpha): moe()'s defaults
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How the expert weights are stored: ``gate_up`` one of GATE_UP_FORMS (ignored when the activation is not gated),
    ``transposed`` whether each weight is (E, in, out)."""
    gate_up: str = "stacked"
    transposed: bool = False

    def __post_init__(self):
        if self.gate_up not in GATE_UP_FORMS:
            raise ValueError(f"ExpertLayout: gate_up must be one of {GATE_UP_FORMS}, got {self.gate_up!r}")
        if not isinstance(self.transposed, bool):
            raise TypeError(f"ExpertLayout: transposed must be a bool, got {type(self.transposed).__name__}")


GPT_OSS_LAYOUT = ExpertLayout("interleaved", transposed=True)


@dataclasses.dataclass(frozen=True)
class Family:
    """What moe() computes: the activation, its constants (gpt_oss only) and the weights' layout."""
    activation: str
    alpha: float
    limit: float
    layout: ExpertLayout

    @property
    def gated(self) -> bool:
        return self.activation != "relu2"


def resolve_layout(layout: ExpertLayout | None, w3, gated: bool) -> ExpertLayout:
    """The layout moe() reads: the caller's, or separate when w3 is given and stacked otherwise."""
    if layout is None:
        return ExpertLayout("separate" if w3 is not None else "stacked")
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"moe: layout must be an ExpertLayout or None, got {type(layout).__name__}")
    if gated and (layout.gate_up == "separate") != (w3 is not None):
        raise RuntimeError(f"moe: layout gate_up={layout.gate_up!r} needs "
                           + ("w3 (the up weights apart from w1)" if layout.gate_up == "separate" else
                              "w3 None (gate and up both in w1)") + f", got w3 {'None' if w3 is None else 'a tensor'}")
    return layout


def _as_out_in(w: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """A weight as (E, out, in): transposed layouts store (E, in, out)."""
    return w.transpose(1, 2) if layout.transposed else w


def split_pairs(t: torch.Tensor, dim: int, form: str):
    """The gate and up halves of ``t`` along ``dim`` (views): stacked halves or interleaved columns."""
    n = t.shape[dim] // 2
    if form == "interleaved":
        pairs = t.unflatten(dim, (n, 2))
        return pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
    return t.narrow(dim, 0, n), t.narrow(dim, n, n)


def join_pairs(gate: torch.Tensor, up: torch.Tensor, dim: int, form: str) -> torch.Tensor:
    """split_pairs' inverse (a new tensor)."""
    if form == "interleaved":
        return torch.stack([gate, up], dim + 1).flatten(dim, dim + 1)
    return torch.cat([gate, up], dim)


def expert_views(w1, w2, w3, b1, family: Family):
    """(gate, up, w2, b_gate, b_up): the op-level views (E, hidden, dim) / (E, dim, hidden) / (E, hidden) of the
    caller's tensors; up and b_up None when not gated, b_gate and b_up None without b1."""
    layout = family.layout
    w1_oi = _as_out_in(w1, layout)
    w2_oi = _as_out_in(w2, layout)
    if not family.gated:
        return w1_oi, None, w2_oi, b1, None
    if layout.gate_up == "separate":
        gate, up = w1_oi, _as_out_in(w3, layout)
        b_gate, b_up = split_pairs(b1, 1, "stacked") if b1 is not None else (None, None)
    else:
        gate, up = split_pairs(w1_oi, 1, layout.gate_up)
        b_gate, b_up = split_pairs(b1, 1, layout.gate_up) if b1 is not None else (None, None)
    return gate, up, w2_oi, b_gate, b_up


def make_family(activation, alpha, limit, layout, w3) -> Family:
    """The Family of a moe() call from its arguments, checked (names the argument and what was expected)."""
    if not isinstance(activation, str):
        raise TypeError(f"moe: activation must be a str, got {type(activation).__name__}")
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"moe: {name} must be a float, got {type(value).__name__}")
    gated = checks.parse_activation("moe", activation, float(alpha), float(limit))
    return Family(activation, float(alpha), float(limit), resolve_layout(layout, w3, gated))
