"""Plain-PyTorch MoE expert paths for every family (layouts.py): the baselines of the tests and the benchmark's peer.

- ``moe_per_expert``: a Python loop over experts (gather, gate/up, activation, down, weighted index_add), in the
  inputs' dtype: with bf16 inputs it is the trainers' grouped-mm path emulated with per-expert bf16 matmuls (each
  expert's bf16 output weighted in fp32, rounded to bf16 and index-added in bf16, as torchtitan-style code does); with
  float64 inputs (weights and biases too) it is the reference. Differentiable through autograd.
- ``experts_grouped_mm``: prime-rl's expert formulation of each family on tokens already grouped by expert
  (``num_tokens_per_expert``): one ``torch._grouped_mm`` per projection in bf16 (gate and up in one where w1 holds
  both), biases added in bf16 after the GEMM, the activation in bf16; rows past the counted ones come back zero.
- ``moe_grouped_mm``: the same behind routing (argsort permute, ``experts_grouped_mm``, weighted index_add),
  differentiable through autograd; the benchmark's peer.

LoRA adapters (``lora``: a MoeLora, lora.py's definition): ``moe_per_expert`` adds each adapted projection's
s_a (z A[a, e]^T) B[a, e]^T per adapter (the float64 reference); ``moe_lora_grouped_mm`` is prime-rl's unfused
formulation (MultiLoRAGroupedExperts: one adapter per call): per adapter, its tokens through ``moe_grouped_mm`` with
each projection's base grouped GEMM plus the adapter's two grouped GEMMs (z A^T, then (.) B^T, bf16 outputs),
scaled and added in bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layouts import GPT_OSS_ALPHA, GPT_OSS_LIMIT, ExpertLayout, Family, expert_views, resolve_layout, split_pairs
from .lora import MoeLora


def activate(g, u, family: Family):
    """h from the pre-activations (u None when not gated), in their dtype: csrc/flash_moe.h's definitions."""
    if family.activation == "swiglu":
        return F.silu(g) * u
    if family.activation == "gpt_oss":
        gc = g.clamp(max=family.limit)
        return (u.clamp(-family.limit, family.limit) + 1) * gc * torch.sigmoid(gc * family.alpha)
    return F.relu(g).square()


def _family(activation, alpha, limit, layout, w3):
    return Family(activation, alpha, limit, resolve_layout(layout, w3, activation != "relu2"))


def _local(topk_ids, num_local, expert_start):
    ids = topk_ids.reshape(-1).long()
    local = ids - expert_start
    valid = (ids >= 0) & (local >= 0) & (local < num_local)
    return local, valid


def _lora_term(z, lora: MoeLora | None, projection: str, e: int, adapter):
    """sum over adapters a of [row's adapter == a] s_a (z A[a, e]^T) B[a, e]^T (0 without an adapter), in z's dtype."""
    if lora is None or getattr(lora, f"a_{projection}") is None:
        return 0
    a_all, b_all = getattr(lora, f"a_{projection}"), getattr(lora, f"b_{projection}")
    scaling = torch.as_tensor(lora.scaling, dtype=z.dtype, device=z.device).reshape(-1)
    term = 0
    for a in range(a_all.shape[0]):
        mine = (adapter == a).unsqueeze(1).to(z.dtype)
        term = term + mine * scaling[a] * ((z @ a_all[a, e].t()) @ b_all[a, e].t())
    return term


def moe_per_expert(x, w1, w2, w3, topk_ids, topk_weights, expert_start=0, *, activation="swiglu",
                   alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT, b1=None, b2=None, layout: ExpertLayout | None = None,
                   lora: MoeLora | None = None):
    family = _family(activation, alpha, limit, layout, w3)
    gate, up, w2v, b_gate, b_up = expert_views(w1, w2, w3, b1, family)
    top_k = topk_ids.shape[1]
    local, valid = _local(topk_ids, gate.shape[0], expert_start)
    p = topk_weights.reshape(-1)
    token_adapter = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    if lora is not None and lora.adapter_ids is not None:
        token_adapter = lora.adapter_ids.reshape(-1).long()
    out = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        slots = torch.nonzero(valid & (local == e)).squeeze(1)
        if slots.numel() == 0:
            continue
        tok = slots // top_k
        xs = x[tok]
        adapter = token_adapter[tok]
        g = xs @ gate[e].t() + (b_gate[e] if b_gate is not None else 0) + _lora_term(xs, lora, "gate", e, adapter)
        u = (xs @ up[e].t() + (b_up[e] if b_up is not None else 0) + _lora_term(xs, lora, "up", e, adapter)
             if up is not None else None)
        h = activate(g, u, family)
        y = h @ w2v[e].t() + (b2[e] if b2 is not None else 0) + _lora_term(h, lora, "down", e, adapter)
        pw = p[slots].unsqueeze(1)
        y = (y.to(pw.dtype) * pw).to(x.dtype) if x.dtype != torch.float64 else y * pw.to(y.dtype)
        out = out.index_add(0, tok, y)
    return out


def _per_row(bias, counts, rows):
    """A per-expert bias (E, n) repeated over each expert's counted rows, ``rows`` in all: (rows, n)."""
    return torch.repeat_interleave(bias, counts, dim=0, output_size=rows)


def experts_grouped_mm(x_sorted, w1, w2, w3, num_tokens_per_expert, *, activation="swiglu", alpha=GPT_OSS_ALPHA,
                       limit=GPT_OSS_LIMIT, b1=None, b2=None, layout: ExpertLayout | None = None,
                       adapter: tuple | None = None):
    """``adapter``: one adapter's (scaling, a_gate, b_gate, a_up, b_up, a_down, b_down), each pair (E, r, in) /
    (E, out, r) or None: prime-rl's LoRA terms, s ((z A^T) B^T) by two grouped GEMMs with bf16 outputs, added to the
    projection's bf16 output."""
    family = _family(activation, alpha, limit, layout, w3)
    counts = num_tokens_per_expert.to(torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    # the counted rows alone (a host sync, as torchtitan's splits are host values): grouped_mm leaves the rows past
    # the last offset undefined, forward and backward
    rows = int(offs[-1])
    x_counted = x_sorted[:rows]

    def project(a, w, bias):
        y = torch._grouped_mm(a, w if family.layout.transposed else w.transpose(-2, -1), offs=offs)
        return y if bias is None else y + _per_row(bias, counts, rows)

    def plus_lora(y, z, pair):
        if adapter is None or pair[0] is None:
            return y
        low = torch._grouped_mm(z, pair[0].transpose(-2, -1), offs=offs)
        return y + adapter[0] * torch._grouped_mm(low, pair[1].transpose(-2, -1), offs=offs)

    gate_pair, up_pair, down_pair = ((None, None),) * 3 if adapter is None else \
        (adapter[1:3], adapter[3:5], adapter[5:7])
    if family.gated and family.layout.gate_up == "separate":
        b_gate, b_up = split_pairs(b1, 1, "stacked") if b1 is not None else (None, None)
        g, u = project(x_counted, w1, b_gate), project(x_counted, w3, b_up)
    elif family.gated:
        g, u = split_pairs(project(x_counted, w1, b1), 1, family.layout.gate_up)
    else:
        g, u = project(x_counted, w1, b1), None
    g = plus_lora(g, x_counted, gate_pair)
    u = None if u is None else plus_lora(u, x_counted, up_pair)
    h = activate(g, u, family)
    out = plus_lora(project(h, w2, b2), h, down_pair)
    return F.pad(out, (0, 0, 0, x_sorted.shape[0] - rows))


def moe_grouped_mm(x, w1, w2, w3, topk_ids, topk_weights, expert_start=0, *, activation="swiglu",
                   alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT, b1=None, b2=None, layout: ExpertLayout | None = None,
                   adapter: tuple | None = None):
    top_k = topk_ids.shape[1]
    E = w1.shape[0]
    local, valid = _local(topk_ids, E, expert_start)
    key = torch.where(valid, local, torch.full_like(local, E))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    tok = order // top_k
    y = experts_grouped_mm(x[tok], w1, w2, w3, counts[:E], activation=activation, alpha=alpha, limit=limit, b1=b1,
                           b2=b2, layout=layout, adapter=adapter)
    pw = torch.where(valid[order], topk_weights.reshape(-1)[order].float(), 0.0).unsqueeze(1)
    y = torch.where(valid[order].unsqueeze(1), y.float() * pw, 0.0).to(x.dtype)
    return torch.zeros_like(x).index_add(0, tok, y)


def moe_lora_grouped_mm(x, w1, w2, w3, topk_ids, topk_weights, expert_start=0, *, lora: MoeLora, **family):
    """prime-rl's unfused LoRA formulation, one adapter per call: each adapter's tokens through ``moe_grouped_mm``
    with that adapter's grouped GEMMs (its scaling a bf16 Python float, as prime-rl multiplies), the outputs put back
    in token order."""
    n = lora.n_adapters()
    token_adapter = torch.zeros(x.shape[0], dtype=torch.long, device=x.device) if lora.adapter_ids is None else \
        lora.adapter_ids.reshape(-1).long()
    scaling = torch.as_tensor(lora.scaling, dtype=torch.float32).reshape(-1).tolist()
    out = torch.zeros_like(x)
    for a in range(n):
        tokens = torch.nonzero(token_adapter == a).squeeze(1)
        if tokens.numel() == 0:
            continue
        pairs = tuple(None if t is None else t[a] for t in lora.adapters())
        y = moe_grouped_mm(x[tokens], w1, w2, w3, topk_ids[tokens], topk_weights[tokens], expert_start,
                           adapter=(scaling[a], *pairs), **family)
        out = out.index_copy(0, tokens, y)
    return out
