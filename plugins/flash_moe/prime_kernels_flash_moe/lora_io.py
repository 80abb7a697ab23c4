"""Adapters in the per-expert naming of prime-rl, PEFT and vLLM, to and from MoeLora's stacked tensors.

One expert's adapter on one projection is two 2-D weights, ``{prefix}.{e}.{proj}.lora_A.weight`` (r, in) and
``{prefix}.{e}.{proj}.lora_B.weight`` (out, r), proj in gate_proj / up_proj / down_proj and e the global expert index:
prime-rl's ``state_dict_for_adapter`` writes them with an empty prefix (relative to the experts module); a PEFT
checkpoint, which vLLM loads, prefixes the experts module's path (``base_model.model.model.layers.{L}.mlp.experts``).
Models naming their projections otherwise (Mixtral's w1 / w3 / w2) pass ``names``.
"""
from __future__ import annotations

import re

import torch

from .lora import PROJECTIONS, MoeLora

PEFT_NAMES = ("gate_proj", "up_proj", "down_proj")  # gate, up, down


def _key(prefix: str, expert: int, proj: str, matrix: str) -> str:
    return f"{prefix}.{expert}.{proj}.lora_{matrix}.weight" if prefix else f"{expert}.{proj}.lora_{matrix}.weight"


def export_adapter(lora: MoeLora, adapter: int = 0, prefix: str = "", *, expert_start: int = 0,
                   names: tuple[str, str, str] = PEFT_NAMES) -> dict[str, torch.Tensor]:
    """Adapter ``adapter`` of ``lora`` as per-expert tensors (detached contiguous copies: no view keeps the stacked
    tensor alive), keyed by the global expert index expert_start + e. Projections without an adapter have no keys."""
    if not isinstance(lora, MoeLora):
        raise TypeError(f"export_adapter: lora must be a MoeLora, got {type(lora).__name__}")
    if not 0 <= adapter < lora.n_adapters():
        raise ValueError(f"export_adapter: adapter must be in [0, n_adapters={lora.n_adapters()}), got {adapter}")
    out = {}
    for projection, proj_name in zip(PROJECTIONS, names):
        a, b = getattr(lora, f"a_{projection}"), getattr(lora, f"b_{projection}")
        if a is None:
            continue
        for e in range(a.shape[1]):
            out[_key(prefix, expert_start + e, proj_name, "A")] = a[adapter, e].detach().clone()
            out[_key(prefix, expert_start + e, proj_name, "B")] = b[adapter, e].detach().clone()
    return out


def load_adapter(state_dict: dict[str, torch.Tensor], num_local_experts: int, scaling: float, prefix: str = "", *,
                 expert_start: int = 0, names: tuple[str, str, str] = PEFT_NAMES, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> MoeLora:
    """One adapter (n_adapters = 1) from per-expert tensors: the local experts [expert_start, expert_start +
    num_local_experts) of the keys under ``prefix`` (other keys, other experts' included, are ignored); a projection
    with no key is not adapted; one with some keys must have both matrices of every local expert, of one shape.
    ``scaling``: PEFT's lora_alpha / r (adapter_config.json), which the weights do not carry."""
    pattern = re.compile(rf"^{re.escape(prefix + '.') if prefix else ''}(\d+)\.([^.]+)\.lora_([AB])\.weight$")
    found: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        m = pattern.match(key)
        if m and m.group(2) in names:
            found.setdefault((m.group(2), m.group(3)), {})[int(m.group(1))] = tensor
    pairs = {}
    for projection, proj_name in zip(PROJECTIONS, names):
        if (proj_name, "A") not in found and (proj_name, "B") not in found:
            continue
        pairs[f"a_{projection}"], pairs[f"b_{projection}"] = (
            _stack_experts(found.get((proj_name, matrix), {}), prefix, proj_name, matrix, num_local_experts,
                           expert_start, dtype, device) for matrix in "AB")
    if not pairs:
        raise ValueError(f"load_adapter: no key {_key(prefix, expert_start, '<proj>', 'A')} with <proj> in {names}")
    return MoeLora(float(scaling), **pairs)


def _stack_experts(per_expert, prefix, proj_name, matrix, num_local_experts, expert_start, dtype, device):
    """(1, E_local, ...) from one matrix's per-expert tensors, every local expert present, one shape."""
    experts = range(expert_start, expert_start + num_local_experts)
    missing = [e for e in experts if e not in per_expert]
    if missing:
        key = _key(prefix, missing[0], proj_name, matrix)
        raise ValueError(f"load_adapter: {proj_name} has an adapter but no {key} ({len(missing)} of its "
                         f"{num_local_experts} local experts missing)")
    shapes = {tuple(per_expert[e].shape) for e in experts}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"load_adapter: {proj_name}'s lora_{matrix} weights must be 2-D of one shape across experts, "
                         f"got shapes {sorted(shapes)}")
    return torch.stack([per_expert[e] for e in experts]).to(dtype=dtype, device=device).unsqueeze(0)


def stack_adapters(loras: list[MoeLora], adapter_ids: torch.Tensor | None = None) -> MoeLora:
    """Several one-or-more-adapter MoeLoras as one (their adapters in order, scalings concatenated); a smaller rank is
    zero-padded to the largest (zero rows of A, zero columns of B: the same products). Every adapter must adapt the
    same projections."""
    if not loras or not all(isinstance(lora, MoeLora) for lora in loras):
        raise TypeError("stack_adapters: loras must be a non-empty list of MoeLora")
    scalings = [torch.as_tensor(lora.scaling, dtype=torch.float32).reshape(-1) for lora in loras]
    device = next((t.device for t in loras[0].adapters() if t is not None), None)
    stacked = {}
    for projection in PROJECTIONS:
        a_list = [getattr(lora, f"a_{projection}") for lora in loras]
        b_list = [getattr(lora, f"b_{projection}") for lora in loras]
        if all(a is None for a in a_list):
            continue
        if any(a is None for a in a_list):
            raise ValueError(f"stack_adapters: every adapter must adapt {projection} or none, got some without it")
        rank = max(a.shape[2] for a in a_list)
        stacked[f"a_{projection}"] = torch.cat([_pad(a, 2, rank) for a in a_list])
        stacked[f"b_{projection}"] = torch.cat([_pad(b, 3, rank) for b in b_list])
    return MoeLora(torch.cat(scalings).to(device), **stacked, adapter_ids=adapter_ids)


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]]
    return torch.nn.functional.pad(t, pad)
