"""Steady state of moe_router on the GPU: the shipped code (torch's static launcher) against Triton's JIT launch of the
same function, per function and shipped specialization, and the op against the PyTorch path it replaces. CUDA-event
time of ITERATIONS back-to-back calls (host launch cost included, as a training step pays it), median of rounds, and
beside it the host's own time per call (perf_counter over the same calls, before the synchronize): where that is the
larger, the GPU waits on the launch path and the CUDA-event time measures Python, not the kernel.

    python examples/triton_plugin/tests/bench_moe_router.py [--rounds 5] [--json OUT]
"""
import argparse
import json
import statistics
import time

import torch

import prime_kernels
from prime_kernels_core import jit_runtime

ITERATIONS = 200
TOKENS = 16384
CONFIGS = {
    "deepseek-v3": dict(n_experts=256, n_groups=8, topk_groups=4, top_k=8, sigmoid=True, renormalize=True),
    "qwen3-moe": dict(n_experts=128, n_groups=1, topk_groups=1, top_k=8, sigmoid=False, renormalize=True),
}


def _time_ms(fn, rounds):
    """(GPU ms per call, host ms per call): medians over rounds of ITERATIONS back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        for _ in range(ITERATIONS):
            fn()
        host.append((time.perf_counter() - began) * 1e3 / ITERATIONS)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / ITERATIONS)
    return statistics.median(times), statistics.median(host)


def _launches(config, dtype):
    """{function: (shipped launch, Triton JIT launch)} of the forward and backward at one shipped specialization."""
    from pk_example_router import kernels

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, config["n_experts"], generator=gen).to("cuda", dtype)
    bias = (0.1 * torch.randn(config["n_experts"], generator=gen)).cuda()
    weights = torch.empty(TOKENS, config["top_k"], device="cuda")
    experts = torch.empty(TOKENS, config["top_k"], device="cuda", dtype=torch.int64)
    grad_weights = torch.randn(TOKENS, config["top_k"], device="cuda")
    grad_logits = torch.empty_like(logits)
    flags = dict(N_EXPERTS=config["n_experts"], TOP_K=config["top_k"], SIGMOID=config["sigmoid"],
                 RENORMALIZE=config["renormalize"])
    forward = ((logits, bias, weights, experts, logits.stride(0), 2.5),
               dict(flags, N_GROUPS=config["n_groups"], TOPK_GROUPS=config["topk_groups"]))
    backward = ((logits, experts, grad_weights, grad_logits, logits.stride(0), 2.5), flags)
    grid = (TOKENS,)
    result = {}
    for fn, (args, constexprs) in ((kernels.route_forward, forward), (kernels.route_backward, backward)):
        result[fn.fn.__name__] = (
            lambda fn=fn, args=args, c=constexprs: jit_runtime.launch("moe_router", fn, grid, args, c),
            lambda fn=fn, args=args, c=constexprs: fn[grid](*args, **c, num_warps=4, num_stages=1))
    return result, logits, bias


def compare(rounds=5):
    """Rows of shipped vs JIT (and the op vs PyTorch) milliseconds per call."""
    ops = prime_kernels.load("moe_router")
    rows = []
    for name, config in CONFIGS.items():
        for dtype in (torch.bfloat16, torch.float32):
            launches, logits, bias = _launches(config, dtype)
            for function, (shipped, jit) in launches.items():
                before = jit_runtime.fallbacks()
                (shipped_ms, shipped_host_ms), (jit_ms, jit_host_ms) = _time_ms(shipped, rounds), _time_ms(jit, rounds)
                rows.append({"config": name, "dtype": str(dtype), "tokens": TOKENS, "function": function,
                             "shipped_ms": shipped_ms, "jit_ms": jit_ms, "shipped_host_ms": shipped_host_ms,
                             "jit_host_ms": jit_host_ms})
                assert jit_runtime.fallbacks() == before, f"{function} fell back: {jit_runtime.fallbacks()}"
            options = dict(top_k=config["top_k"], n_groups=config["n_groups"], topk_groups=config["topk_groups"],
                           score="sigmoid" if config["sigmoid"] else "softmax", scale=2.5)
            flags = (config["n_groups"], config["topk_groups"], config["top_k"], config["sigmoid"], True, 2.5)
            rows.append({"config": name, "dtype": str(dtype), "tokens": TOKENS, "function": "op forward",
                         "shipped_ms": _time_ms(lambda: ops.moe_route(logits, bias, **options), rounds)[0],
                         "pytorch_ms": _time_ms(lambda: ops.route_reference(logits, bias, *flags), rounds)[0]})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = compare(args.rounds)
    print(f"moe_router on {torch.cuda.get_device_name()}, {TOKENS} tokens, ms per call (median of {args.rounds} rounds "
          f"of {ITERATIONS}):")
    for row in rows:
        other = f"jit {row['jit_ms']:.4f} ({row['shipped_ms'] / row['jit_ms']:.3f}x); host per call shipped " \
            f"{row['shipped_host_ms']:.4f} jit {row['jit_host_ms']:.4f}" if "jit_ms" in row else \
            f"pytorch {row['pytorch_ms']:.4f} ({row['pytorch_ms'] / row['shipped_ms']:.2f}x slower)"
        print(f"  {row['config']:12} {row['dtype']:15} {row['function']:15} shipped {row['shipped_ms']:.4f}  {other}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
