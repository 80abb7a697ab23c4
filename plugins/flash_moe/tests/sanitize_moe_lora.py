"""Small-shape CUDA run of moe(lora=...)'s fused kernels for compute-sanitizer (memcheck, racecheck, synccheck,
initcheck): the forward's shrinks over x and over h, the gate/up GEMM with its K extension in every weight form
(halves, relu2's whole tiles, gpt-oss's pairs), the down GEMM with its extension (atomics and per slot), the
recomputation; the backward's shrinks over grad_out, h and dg | du and its dH and dX GEMMs with their extensions.
Exits 1 where a result differs from the CPU implementation (the definition of the numerics).

    compute-sanitizer --tool memcheck python plugins/flash_moe/tests/sanitize_moe_lora.py
"""
import sys

import torch

import prime_kernels
from prime_kernels_flash_moe.layouts import join_pairs

ops = prime_kernels.load("flash_moe")
g = torch.Generator().manual_seed(0)
# (activation, layout, biases): each extension path and base weight form
FAMILIES = [("swiglu", ops.ExpertLayout("separate"), False), ("swiglu", ops.ExpertLayout("stacked", True), True),
            ("gpt_oss", ops.GPT_OSS_LAYOUT, True), ("relu2", ops.ExpertLayout("stacked"), True)]
# (n_adapters, rank, projections): 1 / 2 / 4 adapters, ranks 8 / 16 / 64 (r_gate + r_up = 128: two extension K tiles),
# an absent gate or down adapter
ADAPTERS = [(1, 8, ("gate", "up", "down")), (2, 16, ("up", "down")), (4, 64, ("gate", "up")), (2, 16, ("gate",))]


def make_weights(E, dim, hidden, activation, layout, biases):
    gated = activation != "relu2"
    gate, up = ((torch.randn(E, hidden, dim, generator=g) / dim**0.5).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, dim, hidden, generator=g) / hidden**0.5).bfloat16()
    if not gated:
        w1, w3 = gate, None
    elif layout.gate_up == "separate":
        w1, w3 = gate, up
    else:
        w1, w3 = join_pairs(gate, up, 1, layout.gate_up), None
    if layout.transposed:
        w1, w2, w3 = (None if w is None else w.transpose(1, 2).contiguous() for w in (w1, w2, w3))
    b1 = (0.5 * torch.randn(E, (2 if gated else 1) * hidden, generator=g)).bfloat16() if biases else None
    b2 = (0.5 * torch.randn(E, dim, generator=g)).bfloat16() if biases else None
    return w1, w2, w3, b1, b2


def make_lora(n, E, dim, hidden, rank, projections, gated, adapter_ids):
    tensors = {}
    for proj, n_in, n_out in (("gate", dim, hidden), ("up", dim, hidden), ("down", hidden, dim)):
        if proj in projections and (gated or proj != "up"):
            tensors[f"a_{proj}"] = (torch.randn(n, E, rank, n_in, generator=g) / n_in**0.5).bfloat16()
            tensors[f"b_{proj}"] = (torch.randn(n, E, n_out, rank, generator=g) / rank**0.5).bfloat16()
    return ops.MoeLora(torch.linspace(0.5, 2.0, n), **tensors, adapter_ids=adapter_ids)


def to_cuda(lora):
    return ops.MoeLora(lora.scaling.cuda(), *[None if a is None else a.cuda() for a in lora.adapters()],
                       adapter_ids=lora.adapter_ids.cuda())


def run(x, w1, w2, w3, b1, b2, ids, tw, lora, activation, layout, **kwargs):
    """moe()'s output and the gradients of x, topk_weights and every adapter tensor. gpt_oss's clamps out of reach: an
    element whose bf16 pre-activation rounds across the limit on one device and not the other flips its gradient (a
    discontinuity), which no tolerance covers; the clamp code still runs."""
    if activation == "gpt_oss":
        kwargs = {"limit": 1e4, **kwargs}
    leaves = [x.clone().requires_grad_(), tw.clone().requires_grad_()]
    adapters = [None if a is None else a.clone().requires_grad_() for a in lora.adapters()]
    lr = ops.MoeLora(lora.scaling, *adapters, adapter_ids=lora.adapter_ids)
    out = ops.moe(leaves[0], w1, w2, w3, ids, leaves[1], activation=activation, b1=b1, b2=b2, layout=layout, lora=lr,
                  **kwargs)
    wrt = leaves + [a for a in adapters if a is not None]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16().to(out.device)
    return [out, *torch.autograd.grad(out, wrt, grad_out)]


for T, dim, hidden, E, k in [(37, 320, 192, 5, 2), (130, 256, 128, 4, 3)]:
    for activation, layout, biases in FAMILIES:
        for n, rank, projections in ADAPTERS:
            x = torch.randn(T, dim, generator=g).bfloat16()
            weights = make_weights(E, dim, hidden, activation, layout, biases)
            ids = torch.stack([torch.randperm(E + 1, generator=g)[:k] - 1 for _ in range(T)]).to(torch.int32)
            tw = torch.rand(T, k, generator=g)
            adapter_ids = torch.randint(0, n, (T,), generator=g)
            lora = make_lora(n, E, dim, hidden, rank, projections, activation != "relu2", adapter_ids)
            want = run(x, *weights, ids, tw, lora, activation, layout)
            cu = [None if t is None else t.cuda() for t in (x, *weights, ids, tw)]
            for kwargs in ({}, {"deterministic": True, "recompute_gate_up": True}):
                got = run(*cu, to_cuda(lora), activation, layout, **kwargs)
                for i, (a, b) in enumerate(zip(got, want)):
                    if not torch.allclose(a.cpu().float(), b.float(), rtol=3e-2, atol=3e-2):
                        sys.exit(f"moe(lora=...) result {i} mismatch for {(T, dim, hidden, E, k)}, {activation}, "
                                 f"{layout}, {(n, rank, projections)}, {kwargs}")
# expert parallelism: local experts [2, 4) of 4, unrouted slots, one adapter without tokens
x = torch.randn(96, 256, generator=g).bfloat16()
weights = make_weights(2, 256, 128, "swiglu", ops.ExpertLayout("separate"), True)
ids = torch.randint(-1, 4, (96, 2), generator=g, dtype=torch.int32)
tw = torch.rand(96, 2, generator=g)
lora = make_lora(3, 2, 256, 128, 16, ("gate", "up", "down"), True, torch.randint(0, 2, (96,), generator=g))
want = run(x, *weights, ids, tw, lora, "swiglu", None, expert_start=2, num_experts=4)
got = run(*[None if t is None else t.cuda() for t in (x, *weights, ids, tw)], to_cuda(lora), "swiglu", None,
          expert_start=2, num_experts=4)
for i, (a, b) in enumerate(zip(got, want)):
    if not torch.allclose(a.cpu().float(), b.float(), rtol=3e-2, atol=3e-2):
        sys.exit(f"moe(lora=..., expert_start=2) result {i} mismatch")
print("sanitize_moe_lora: ok")
