"""Small-shape CUDA run for compute-sanitizer (memcheck, racecheck); scripts/gpu_check.sh runs it. Exits 1 on a
mismatch with the CPU implementation."""
import sys

import torch

import prime_kernels

ops = prime_kernels.load("residual_rmsnorm")
for dtype in (torch.float32, torch.bfloat16):
    for shape in [(1, 1), (3, 31), (2, 5, 300), (4, 1024), (0, 8)]:
        x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
        weight = torch.randn(shape[-1], dtype=dtype)
        got = ops.residual_rmsnorm(x.cuda(), residual.cuda(), weight.cuda(), 1e-6)
        want = ops.residual_rmsnorm(x, residual, weight, 1e-6)
        for g, w in zip(got, want):
            if not torch.allclose(g.cpu().float(), w.float(), rtol=2e-2, atol=2e-2):
                sys.exit(f"mismatch for {dtype} {shape}")
torch.cuda.synchronize()
print("sanitize_residual_rmsnorm: ok")
