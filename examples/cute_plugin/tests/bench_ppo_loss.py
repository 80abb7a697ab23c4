"""Steady state of ppo_loss on the GPU: the op with its shipped object against the same op compiled by cute.compile
in this process (PRIME_KERNELS_AOT=0: the same specialization, the same host path), and against the PyTorch path it
replaces (the unfused loss and autograd), forward + backward. CUDA-event time of back-to-back calls, the best of
interleaved rounds. Run on the GPU machine: ``python examples/cute_plugin/tests/bench_ppo_loss.py``; the GPU test
asserts the shipped-against-JIT rows within 2 %.
"""
import json
import os

import torch

SHAPES = {"rl-batch 64 x 4096": (64, 4096), "rl-batch 256 x 16384": (256, 16384)}
CALLS = 200


def _inputs(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    old = -4 * torch.rand(shape, generator=gen)
    logp = (old + 0.5 * torch.randn(shape, generator=gen)).to("cuda", dtype).requires_grad_()
    return logp, old.to("cuda", dtype), torch.randn(shape, generator=gen).cuda(), torch.randn(shape, device="cuda")


def pytorch_path(logp, old_logp, advantages, eps_low, eps_high, dual_clip):
    ratio = torch.exp(logp.float() - old_logp.float())
    objective = torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.max(objective, dual_clip * advantages), objective)
    return -objective


def _ms_per_call(fn, args, backward: bool) -> float:
    logp, old, advantages, grad = args

    def step():
        if backward:
            fn(logp, old, advantages, 0.2, 0.28, 3.0).backward(grad)
        else:
            with torch.no_grad():
                fn(logp, old, advantages, 0.2, 0.28, 3.0)

    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(CALLS):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def _with_shipped_code(enabled: bool):
    os.environ["PRIME_KERNELS_AOT"] = "1" if enabled else "0"  # a plan per setting (cute_runtime keys on it)


def compare(rounds: int = 5) -> list[dict]:
    import prime_kernels

    ops = prime_kernels.load("ppo_loss")
    op = lambda *a: ops.ppo_clip_loss(*a)
    rows = []
    for label, shape in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            args = _inputs(shape, dtype)
            for backward in (False, True):
                best = {"shipped": float("inf"), "jit": float("inf"), "pytorch": float("inf")}
                for _ in range(rounds):  # interleaved, so clock and thermal drift reach every path alike
                    for path in ("shipped", "jit"):
                        _with_shipped_code(path == "shipped")
                        best[path] = min(best[path], _ms_per_call(op, args, backward))
                    best["pytorch"] = min(best["pytorch"], _ms_per_call(pytorch_path, args, backward))
                _with_shipped_code(True)
                rows.append({"shape": label, "dtype": str(dtype), "pass": "forward+backward" if backward else "forward",
                             "shipped_ms": best["shipped"], "jit_ms": best["jit"], "pytorch_ms": best["pytorch"]})
    return rows


if __name__ == "__main__":
    for row in compare():
        print(json.dumps(row))
