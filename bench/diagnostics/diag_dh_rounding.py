"""Whether a build's dH kernel (moe_grad_gate_up on CUDA) differs from the CPU op by rounding grad_h to bf16 or by
more: its outputs against the CPU op's (grad_h in fp32) and against the CPU swiglu_backward of grad_h rounded to bf16
(what a kernel staging grad_h as bf16 computes), at small shapes like the sanitizer script's. A kernel with a
protocol slip is far from both; one that stages grad_h as bf16 matches the second to fp32 summation order.

    PYTHONPATH=/tmp/variants/NAME python3 bench/diagnostics/diag_dh_rounding.py
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
    want_fp32 = torch.ops.flash_moe.moe_grad_gate_up(grad_out, w2, gate_up, *align, tw, k, ops.BLOCK_M)
    # the CPU op's swiglu_backward from grad_h rounded to bf16: grad_h per compact row (the routed entries of
    # sorted_token_ids, in order)
    sorted_ids, expert_ids, padded = align[:3]
    entries = sorted_ids[:int(padded.reshape(-1)[0])].long()
    routed = (entries >= 0) & (entries < T * k)
    slots = entries[routed]
    experts = expert_ids.long().repeat_interleave(ops.BLOCK_M)[:entries.numel()][routed]
    grad_h = torch.einsum("sd,sdh->sh", grad_out[slots // k].float(), w2[experts].float()).bfloat16()
    rows = slots.numel()
    dg, du, ph, dp = torch.ops.flash_moe.swiglu_backward(gate_up[:rows], grad_h, tw.reshape(-1)[slots],
                                                        torch.ones(rows, dtype=torch.bool))
    want_bf16 = (torch.cat([dg, du], 1), ph, torch.zeros(T * k).index_put_((slots,), dp))
    for name, want in (("grad_h fp32", want_fp32), ("grad_h bf16", want_bf16)):
        want = [t.float() for t in want]
        print(f"{(T, dim, hidden, E, k)} vs {name}: max |difference| "
              f"dg|du {(got[0][:rows] - want[0][:rows]).abs().max():.4f}, "
              f"p h {(got[1][:rows] - want[1][:rows]).abs().max():.4f}, "
              f"d topk_weights {(got[2].reshape(-1) - want[2].reshape(-1)).abs().max():.4f}")
