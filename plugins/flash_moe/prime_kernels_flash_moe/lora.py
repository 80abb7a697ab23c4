"""LoRA adapters on the experts: ``MoeLora`` (what ``moe(lora=...)`` takes), its contract, the routing over
(expert, adapter) groups, and the adapters' gradients from the LoRA ops' rank-r rows.

Definition (prime-rl's MultiLoRAGroupedExperts, several adapters per call): for a slot of token t routed to local
expert e, with a = the token's adapter and s_a its scaling, each adapted projection P (weight W[e], adapter A[a, e],
B[a, e]) computes P(z) = z W[e]^T + s_a (z A[a, e]^T) B[a, e]^T; gate and up are adapted before the activation (its
input is the sum), down before the expert bias b2 and the routing weight. A projection without an adapter is the
base one. The ops compute this on rows aligned by group v = e * n_adapters + a (one adapter's rows of one expert per
aligned block, an expert's adapters adjacent): the layout the planned fused kernels read (docs/notes/flash_moe.md).
"""
from __future__ import annotations

import dataclasses

import torch

from . import checks
from .contract import CONSTANTS, MAX_EXPERTS

PROJECTIONS = ("gate", "up", "down")
ADAPTER_INPUTS = ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: == on tensors is elementwise
class MoeLora:
    """LoRA adapters for moe() / moe_sorted(): n_adapters adapters over the local experts, any of gate, up, down.

    ``a_<proj>`` (n_adapters, E_local, r, in) and ``b_<proj>`` (n_adapters, E_local, out, r), bfloat16 (gate, up:
    in = dim, out = hidden; down: in = hidden, out = dim), on x's device; both None for a projection without an
    adapter (relu2 has no up projection). The rank r may differ between projections, never between a projection's A
    and B; each a multiple of LORA_RANK_ALIGN (kernel.toml). The adapters are (out, in) in every weight layout: for a
    stacked or interleaved w1 the gate adapter adapts the gate rows and the up adapter the up rows, as PEFT and
    vLLM's per-expert gate_proj / up_proj do.
    ``scaling``: each adapter's factor (PEFT's lora_alpha / r), a (n_adapters,) float tensor, or a float for one
    adapter. Not differentiated.
    ``adapter_ids``: each token's adapter, int (x's leading dimensions), values in [0, n_adapters); None: adapter 0
    for every token (prime-rl's one adapter per call).
    """
    scaling: torch.Tensor | float
    a_gate: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    a_up: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    a_down: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    adapter_ids: torch.Tensor | None = None

    def adapters(self) -> tuple:
        """(a_gate, b_gate, a_up, b_up, a_down, b_down): the order the ops take them in."""
        return tuple(getattr(self, name) for name in ADAPTER_INPUTS)

    def n_adapters(self) -> int:
        return self.scaling.shape[0] if isinstance(self.scaling, torch.Tensor) else 1


def scaling_tensor(lora: MoeLora, device: torch.device) -> torch.Tensor:
    """The per-adapter scaling as the ops take it: (n_adapters,) float32 on x's device."""
    s = lora.scaling
    if isinstance(s, bool) or not isinstance(s, (int, float, torch.Tensor)):
        raise TypeError(f"moe: lora.scaling must be a float or a (n_adapters,) float tensor, got {type(s).__name__}")
    if not isinstance(s, torch.Tensor):
        return torch.tensor([float(s)], dtype=torch.float32, device=device)
    if not s.is_floating_point() or s.dim() != 1 or s.shape[0] < 1:
        raise RuntimeError(f"moe: lora.scaling must be a 1-D float tensor of one factor per adapter, got {s.dtype} of "
                           f"shape {tuple(s.shape)}")
    if s.device != device:
        raise RuntimeError(f"moe: lora.scaling must be on x's device {device}, got {s.device}")
    return s.detach().to(torch.float32)


def check_moe_lora(lora, x, E: int, dim: int, hidden: int, gated: bool) -> torch.Tensor:
    """moe()'s contract for ``lora`` (the ops' checks, in moe()'s words, plus the adapter ids and the group count);
    returns the scaling tensor."""
    if not isinstance(lora, MoeLora):
        raise TypeError(f"moe: lora must be a MoeLora or None, got {type(lora).__name__}")
    checks.require_tensors("moe", **{f"lora.{name}?": t for name, t in zip(ADAPTER_INPUTS, lora.adapters())},
                           **{"lora.adapter_ids?": lora.adapter_ids})
    scaling = scaling_tensor(lora, x.device)
    n = scaling.shape[0]
    checks.check_lora("moe", x, scaling, E, dim, hidden, gated, *lora.adapters(), CONSTANTS)
    if E * n > MAX_EXPERTS:
        raise RuntimeError(f"moe: lora: E_local * n_adapters = {E} * {n} = {E * n} (expert, adapter) groups, at most "
                           f"MAX_EXPERTS={MAX_EXPERTS} (the alignment's limit): split the adapters over calls")
    ids = lora.adapter_ids
    if ids is None:
        return scaling
    if ids.dtype not in (torch.int32, torch.int64) or ids.shape != x.shape[:-1]:
        raise RuntimeError(f"moe: lora.adapter_ids must be int32 or int64 with x's leading dimensions "
                           f"{tuple(x.shape[:-1])} (one adapter per token), got {ids.dtype} of shape "
                           f"{tuple(ids.shape)}")
    if ids.device != x.device:
        raise RuntimeError(f"moe: lora.adapter_ids must be on x's device {x.device}, got {ids.device}")
    if not torch.compiler.is_compiling() and ids.numel():  # a value check reads the device (eager only)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= n:
            raise ValueError(f"moe: lora.adapter_ids must be in [0, n_adapters={n}), got values in [{low}, {high}]")
    return scaling


def group_ids(topk_ids, adapter_ids, E: int, n: int, expert_start: int, num_experts: int) -> torch.Tensor:
    """The slots' (expert, adapter) groups e * n + a (int32, -1 where not routed to a local expert), the ids the
    alignment sorts by. An expert id outside [-1, num_experts) or an adapter id outside [0, n) gets the group E * n,
    which moe_align refuses on the CPU and skips on CUDA (as it treats out-of-range expert ids)."""
    ids = topk_ids.long()
    local = ids - expert_start
    routed = (ids >= 0) & (local >= 0) & (local < E)
    adapter = torch.zeros_like(ids) if adapter_ids is None else adapter_ids.reshape(-1, 1).long().expand_as(ids)
    bad = (ids < -1) | (ids >= num_experts) | (adapter < 0) | (adapter >= n)
    groups = torch.where(routed, local * n + adapter, -1)
    return torch.where(bad, E * n, groups).to(torch.int32)


def check_expert_ids(topk_ids, num_experts: int) -> None:
    """moe_align's rule for expert ids, before they become group ids (eager only: it reads the device)."""
    if torch.compiler.is_compiling() or not topk_ids.numel():
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < -1 or high >= num_experts:
        raise ValueError(f"moe: topk_ids must be in [-1, num_experts={num_experts}) (-1: not routed), got values in "
                         f"[{low}, {high}]")


@dataclasses.dataclass
class LoraOperands:
    """What moe()'s backward needs of the adapters: the scaling, the six adapter tensors (None where absent), the
    forward's [u_gate | u_up] rows (None: recomputed) and the adapter count."""
    scaling: torch.Tensor
    a_gate: torch.Tensor | None
    b_gate: torch.Tensor | None
    a_up: torch.Tensor | None
    b_up: torch.Tensor | None
    a_down: torch.Tensor | None
    b_down: torch.Tensor | None
    gate_up_rows: torch.Tensor | None

    @property
    def n(self) -> int:
        return self.scaling.shape[0]

    def rank(self, projection: str) -> int:
        a = getattr(self, f"a_{projection}")
        return 0 if a is None else a.shape[2]


def _per_adapter(grad, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-group gradient (E * n, ...) in fp32 -> (n, E, ...) in the adapter's dtype (groups are expert-major)."""
    out = grad.new_empty((n, grad.shape[0] // n, *grad.shape[1:]), dtype=dtype)
    return out.copy_(grad.unflatten(0, (-1, n)).transpose(0, 1))


def adapter_grads(lora: LoraOperands, needs, x, go, grad_gate, grad_up, weighted_h, down_rows, x_rows, gate_up_rows,
                  row_token, own_row, group_ends) -> dict:
    """The adapters' gradients needed (``needs``: GRAD_INPUTS' names), per (expert, adapter) group by moe_grad_weight
    (fp32 accumulation) over the rows sorted by group (``group_ends``: each group's end), then in each adapter's dtype.
    With z the projection's input and d the gradient of its output, per group (a, e): dB = d^T (s_a z A^T) and
    dA = (s_a d B)^T z; the ops give the rank-r rows: ``gate_up_rows`` [s x A_gate^T | s x A_up^T], ``x_rows``
    [s dg B_gate | s du B_up], ``down_rows`` [s grad_out B_down | p s h A_down^T] (p: the routing weight, which
    multiplies the down output). ``row_token``: each row's token (x, grad_out); ``own_row``: each row itself (the
    per-row sources), -1 past the routed rows."""
    grads = {}
    n = lora.n
    weight_grad = torch.ops.flash_moe.moe_grad_weight
    r_gate, r_up, r_down = (lora.rank(p) for p in PROJECTIONS)
    halves = {"gate": (grad_gate, slice(0, r_gate)), "up": (grad_up, slice(r_gate, r_gate + r_up))}
    for projection, (d, cols) in halves.items():
        a, b = getattr(lora, f"a_{projection}"), getattr(lora, f"b_{projection}")
        if a is None:
            continue
        if needs[f"a_{projection}"]:
            grads[f"a_{projection}"] = _per_adapter(weight_grad(x_rows[:, cols], x, row_token, group_ends, False,
                                                                True), n, a.dtype)
        if needs[f"b_{projection}"]:
            grads[f"b_{projection}"] = _per_adapter(weight_grad(d, gate_up_rows[:, cols], own_row, group_ends, False,
                                                                True), n, b.dtype)
    if lora.a_down is not None:
        v, weighted_u = down_rows[:, :r_down], down_rows[:, r_down:]
        if needs["a_down"]:
            grads["a_down"] = _per_adapter(weight_grad(v, weighted_h, own_row, group_ends, False, True), n,
                                           lora.a_down.dtype)
        if needs["b_down"]:
            grads["b_down"] = _per_adapter(weight_grad(weighted_u, go, row_token, group_ends, True, True), n,
                                           lora.b_down.dtype)
    return grads
