"""Plain-PyTorch MoE expert paths: the baselines of the tests and the peer of the benchmark.

- ``moe_per_expert``: a Python loop over experts (gather, gate/up, silu * up, down, weighted index_add), in the inputs'
  dtype: with bf16 inputs it is the trainers' grouped-mm path emulated with per-expert bf16 matmuls (the bf16 output
  of each expert is weighted in fp32, rounded to bf16 and index-added in bf16, as torchtitan-style code does); with
  float64 inputs it is the reference. Differentiable through autograd.
- ``moe_grouped_mm``: the grouped-mm expert path (argsort permute -> torch._grouped_mm gate/up -> silu * up ->
  grouped_mm down -> weighted index_add), differentiable through autograd; the benchmark's peer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _local(topk_ids, num_local, expert_start):
    ids = topk_ids.reshape(-1).long()
    local = ids - expert_start
    valid = (ids >= 0) & (local >= 0) & (local < num_local)
    return local, valid


def moe_per_expert(x, w1, w2, w3, topk_ids, topk_weights, expert_start=0):
    T, dim = x.shape
    top_k = topk_ids.shape[1]
    local, valid = _local(topk_ids, w1.shape[0], expert_start)
    p = topk_weights.reshape(-1)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        slots = torch.nonzero(valid & (local == e)).squeeze(1)
        if slots.numel() == 0:
            continue
        tok = slots // top_k
        xs = x[tok]
        h = F.silu(xs @ w1[e].t()) * (xs @ w3[e].t())
        y = h @ w2[e].t()
        pw = p[slots].unsqueeze(1)
        y = (y.to(pw.dtype) * pw).to(x.dtype) if x.dtype != torch.float64 else y * pw.to(y.dtype)
        out = out.index_add(0, tok, y)
    return out


def moe_grouped_mm(x, w1, w2, w3, topk_ids, topk_weights, expert_start=0):
    T, dim = x.shape
    top_k = topk_ids.shape[1]
    E = w1.shape[0]
    local, valid = _local(topk_ids, E, expert_start)
    key = torch.where(valid, local, torch.full_like(local, E))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts[:E], 0).to(torch.int32)
    tok = order // top_k
    xs = x[tok]
    g = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    pw = torch.where(valid[order], topk_weights.reshape(-1)[order].float(), 0.0).unsqueeze(1)
    y = torch.where(valid[order].unsqueeze(1), y.float() * pw, 0.0).to(x.dtype)
    return torch.zeros_like(x).index_add(0, tok, y)
