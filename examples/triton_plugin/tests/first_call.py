"""One process's first moe_router call on the GPU, timed, and what it started: run by test_moe_router_gpu.py (and by
hand) in a fresh process, so nothing is compiled, loaded or cached before it.

    python first_call.py shipped   # the wheel's shipped code: must compile nothing (compilers off PATH, empty cache)
    python first_call.py jit       # PRIME_KERNELS_AOT=0: Triton's JIT compiles on this first call (the cold JIT)

Prints one JSON line: mode, the first call's seconds (forward + backward, to a synchronised result; CUDA's context and
torch's allocator are set up before the clock starts), the second call's, the processes started during the first call
(an audit hook sees every subprocess, exec and spawn: ptxas, a C compiler building Triton's launcher), the files the
first call left in TRITON_CACHE_DIR, and the fallbacks jit_runtime recorded.
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

    cache = Path(os.environ["TRITON_CACHE_DIR"])
    ops = prime_kernels.load("moe_router")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16384, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    bias = (0.1 * torch.randn(256, generator=gen)).cuda()
    grad = torch.randn(16384, 8, device="cuda")
    torch.cuda.synchronize()

    def call():
        weights, _ = ops.moe_route(logits, bias, top_k=8, n_groups=8, topk_groups=4, score="sigmoid", scale=2.5)
        weights.backward(grad)
        torch.cuda.synchronize()

    before = sorted(p.name for p in cache.rglob("*")) if cache.exists() else []
    sys.addaudithook(_audit)
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    started = list(STARTS)
    cached = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) if cache.exists() else []
    start = time.perf_counter()
    call()
    second = time.perf_counter() - start
    print(json.dumps({"mode": MODE, "first_call_s": first, "second_call_s": second, "processes_started": started,
                      "cache_files_before": before, "cache_files_after_first_call": cached,
                      "fallbacks": jit_runtime.fallbacks(), "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
