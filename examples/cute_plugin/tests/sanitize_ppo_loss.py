"""Small-shape CUDA run for compute-sanitizer (memcheck, racecheck, synccheck); scripts/gpu_check.sh runs it. The
shipped specializations (fp32 and bf16 logp, with and without dual-clip) and a JIT one (float16 is not shipped: the
op refuses it, so a 128-thread block through cute_runtime directly), token counts around the block size, against the
CPU implementation. Exits 1 on a mismatch."""
import sys

import torch

import prime_kernels
from prime_kernels_core import cute_runtime

ops = prime_kernels.load("ppo_loss")
for dtype in (torch.float32, torch.bfloat16):
    for dual_clip in (None, 3.0):
        for tokens in (1, 255, 257, 1000):
            gen = torch.Generator().manual_seed(tokens)
            old = -4 * torch.rand(tokens, generator=gen)
            logp = (old + 0.5 * torch.randn(tokens, generator=gen)).to(dtype)
            advantages, grad = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
            results = []
            for device in ("cuda", "cpu"):
                x = logp.to(device).requires_grad_()
                loss = ops.ppo_clip_loss(x, old.to(device, dtype), advantages.to(device), eps_high=0.28,
                                         dual_clip=dual_clip)
                loss.backward(grad.to(device))
                results.append((loss.cpu(), x.grad.float().cpu()))
            (loss, g), (loss_cpu, g_cpu) = results
            if not torch.allclose(loss, loss_cpu, rtol=1e-5, atol=1e-6) or not torch.allclose(g, g_cpu, rtol=1e-2,
                                                                                               atol=1e-5):
                sys.exit(f"mismatch for {dtype}, dual_clip {dual_clip}, {tokens} tokens")

from pk_example_rl import kernels  # noqa: E402  a JIT-compiled specialization (another block size) too

x = torch.randn(300, device="cuda")
loss, slope = torch.empty(300, device="cuda"), torch.empty(300, device="cuda")
cute_runtime.call("ppo_loss", kernels.ppo_loss_forward, (x, x - 0.1, torch.ones(300, device="cuda"), loss, slope, 0.8,
                                                         1.2, 0.0), dict(THREADS=128, DUAL_CLIP=False))
expected, _ = ops.ppo_loss_reference(x.cpu(), x.cpu() - 0.1, torch.ones(300), 0.2, 0.2, None)
if not torch.allclose(loss.cpu(), expected, rtol=1e-5, atol=1e-6):
    sys.exit("mismatch for the JIT-compiled 128-thread specialization")
torch.cuda.synchronize()
print("sanitize_ppo_loss: ok")
