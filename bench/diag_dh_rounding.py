"""Whether a build's dH kernel (moe_grad_gate_up on CUDA) differs from the CPU op by rounding grad_h to bf16 or by
more: its outputs against the SwiGLU backward computed here from grad_h in fp32 (the CPU op's) and from grad_h rounded
to bf16 (what a kernel staging grad_h as bf16 computes), at the small shapes of the sanitizer script. A kernel with a
protocol slip is far from both; one that stages grad_h as bf16 matches the second to fp32 summation order.

    PYTHONPATH=/tmp/variants/NAME python3 bench/diag_dh_rounding.py
"""
import torch

import prime_kernels

ops = prime_kernels.load("flash_moe")
gen = torch.Generator().manual_seed(0)
for T, dim, hidden, E, k in [(37, 320, 192, 5, 2), (130, 256, 128, 8, 3), (600, 1024, 640, 2, 1),
                             (3072, 2048, 256, 4, 2)]:
    x = torch.randn(T, dim, generator=gen).to(torch.bfloat16)
    w1, w3 = ((torch.randn(E, hidden, dim, generator=gen) / dim**0.5).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, dim, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
    ids = torch.randint(-1, E, (T, k), generator=gen, dtype=torch.int32)
    tw = torch.rand(T, k, generator=gen)
    align = ops.moe_align(ids, E)
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, k, ops.BLOCK_M)
    grad_out = torch.randn(T, dim, generator=gen).to(torch.bfloat16)
    got = [t.cpu().float() for t in torch.ops.flash_moe.moe_grad_gate_up(
        grad_out.cuda(), w2.cuda(), gate_up.cuda(), *ops.moe_align(ids.cuda(), E), tw.cuda(), k, ops.BLOCK_M)]
    # compact row r of gate_up is the r-th routed entry of sorted_token_ids
    sorted_ids, expert_ids, padded = align[:3]
    slots, experts = [], []
    for i in range(int(padded.reshape(-1)[0])):
        if 0 <= int(sorted_ids[i]) < T * k:
            slots.append(int(sorted_ids[i]))
            experts.append(int(expert_ids[i // ops.BLOCK_M]))
    rows = len(slots)
    slots = torch.tensor(slots)
    grad_h = torch.einsum("sd,sdh->sh", grad_out[slots // k].float(), w2[torch.tensor(experts)].float())
    g, u = gate_up[:rows].float().split(hidden, 1)
    sig = torch.sigmoid(g)
    p = tw.reshape(-1)[slots][:, None]
    for name, gh in (("grad_h fp32", grad_h), ("grad_h bf16", grad_h.bfloat16().float())):
        dgu = torch.cat([gh * p * u * sig * (1 + g * (1 - sig)), gh * p * g * sig], 1)
        dp = (gh * g * sig * u).sum(1)
        print(f"{(T, dim, hidden, E, k)} vs {name}: max |difference| dg|du {(got[0][:rows] - dgu).abs().max():.4f}, "
              f"p h {(got[1][:rows] - p * g * sig * u).abs().max():.4f}, "
              f"d topk_weights {(got[2].reshape(-1)[slots] - dp).abs().max():.4f}")
