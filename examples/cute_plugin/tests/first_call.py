"""One process's first ppo_loss call on the GPU, timed, and what it started: run by test_ppo_loss_gpu.py (and by hand)
in a fresh process, so nothing is compiled, loaded or cached before it.

    python first_call.py shipped   # the wheel's shipped object: must compile nothing (compilers off PATH, empty cache)
    python first_call.py jit       # PRIME_KERNELS_AOT=0: cute.compile on this first call (the cold JIT)

Prints one JSON line: mode, prime_kernels.load's seconds (before the clock: it imports the ops module and with it the
DSL; importing a library is not compiling), the first call's seconds (forward + backward, bf16 [64, 4096] with dual-clip, to a synchronised result; CUDA's context and
torch's allocator are set up before the clock starts), the second call's, the processes started during the first call
(an audit hook sees every subprocess, exec and spawn), the files the first call left in CUTE_DSL_CACHE_DIR, and the
fallbacks recorded.
"""
import json
import os
import sys
import time
from pathlib import Path

MODE = sys.argv[1]
STARTS = []


def _audit(event, args):
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"):
        STARTS.append(f"{event} {str(args)[:200]}")


def main():
    import torch

    import prime_kernels
    from prime_kernels_core import jit_runtime

    cache = Path(os.environ["CUTE_DSL_CACHE_DIR"])
    start = time.perf_counter()
    ops = prime_kernels.load("ppo_loss")
    loaded = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    old = -4 * torch.rand(64, 4096, generator=gen)
    logp = (old + 0.5 * torch.randn(64, 4096, generator=gen)).to("cuda", torch.bfloat16).requires_grad_()
    old, advantages = old.to("cuda", torch.bfloat16), torch.randn(64, 4096, generator=gen).cuda()
    grad = torch.randn(64, 4096, device="cuda")
    torch.cuda.synchronize()

    def call():
        ops.ppo_clip_loss(logp, old, advantages, eps_low=0.2, eps_high=0.28, dual_clip=3.0).backward(grad)
        torch.cuda.synchronize()

    before = sorted(str(p) for p in cache.rglob("*")) if cache.exists() else []
    sys.addaudithook(_audit)
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    started = list(STARTS)
    cached = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) if cache.exists() else []
    start = time.perf_counter()
    call()
    second = time.perf_counter() - start
    print(json.dumps({"mode": MODE, "load_s": loaded, "first_call_s": first, "second_call_s": second,
                      "processes_started": started, "cache_files_before": before,
                      "cache_files_after_first_call": cached, "fallbacks": jit_runtime.fallbacks(),
                      "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
