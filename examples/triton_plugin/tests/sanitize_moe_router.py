"""Small-shape CUDA run for compute-sanitizer (memcheck, racecheck, synccheck); scripts/gpu_check.sh runs it. A
shipped specialization (DeepSeek-V3 in bf16) and a JIT one (37 experts), forward and backward, against the CPU
implementation. Exits 1 on a mismatch."""
import sys

import torch

import prime_kernels

ops = prime_kernels.load("moe_router")
CASES = [(256, dict(top_k=8, n_groups=8, topk_groups=4, score="sigmoid")),
         (37, dict(top_k=5, n_groups=1, topk_groups=1, score="softmax"))]
for n_experts, options in CASES:
    for tokens in (1, 3, 130):
        gen = torch.Generator().manual_seed(tokens)
        logits = torch.randn(tokens, n_experts, generator=gen).to(torch.bfloat16)
        bias = 0.1 * torch.randn(n_experts, generator=gen)
        grad = torch.randn(tokens, options["top_k"], generator=gen)
        results = []
        for device in ("cuda", "cpu"):
            x = logits.to(device).requires_grad_()
            weights, experts = ops.moe_route(x, bias.to(device), **options)
            weights.backward(grad.to(device))
            results.append((weights.cpu(), experts.cpu(), x.grad.float().cpu()))
        (w, e, g), (w_cpu, e_cpu, g_cpu) = results
        if not torch.equal(e.sort(-1).values, e_cpu.sort(-1).values) or not torch.allclose(w, w_cpu, atol=1e-5) \
                or not torch.allclose(g, g_cpu, atol=2e-2, rtol=2e-2):
            sys.exit(f"mismatch for {n_experts} experts, {tokens} tokens")
torch.cuda.synchronize()
print("sanitize_moe_router: ok")
