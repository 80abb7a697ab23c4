"""Per-kernel GPU time of one flash_moe forward (never a test): torch.profiler over a few calls of ``moe`` (bf16 or
mxfp8) or of ``fused_moe_mxfp8`` on pre-quantized operands, summed per kernel name and divided by the call count.

    python bench/diagnostics/profile_flash_moe.py [--shape deepseek-v3|qwen3-30b-a3b|mixtral] [--calls 5] [--backward]
        [--fused-dw] [--plain]

--backward: the bf16 ``moe`` forward + backward instead (gradients of x, the weights and topk_weights); with
--fused-dw its weight gradients by ``moe_grad_weight`` whatever kernel.toml's FUSED_DW_MAX_HIDDEN picks. --plain: the
calls without torch.profiler, for Nsight Compute (gpu_check.sh's profile and hbm phases), which must own the GPU's
counters (CUPTI takes one subscriber).

Prints, for each path, the kernels that take >= 1% of its time; where a path's time goes is what decides the next
kernel change (docs/notes/flash_moe.md).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shapes and timing helpers
from bench_flash_moe import SHAPES, problem, use_path
from torch.profiler import ProfilerActivity, profile


def per_kernel_ms(fn, calls):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / 1e3 / calls
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[s[0] for s in SHAPES[:3]])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--backward", action="store_true", help="bf16 moe forward + backward only")
    parser.add_argument("--fused-dw", action="store_true",
                        help="--backward's weight gradients by moe_grad_weight at every shape")
    parser.add_argument("--plain", action="store_true", help="the calls only, no torch.profiler (for Nsight Compute)")
    args = parser.parse_args()
    from prime_kernels_flash_moe import ops

    _, T, E, k, dim, hidden = next(s for s in SHAPES if s[0] == args.shape)
    if args.fused_dw:
        use_path(ops, "dw-fused")
    if args.backward:
        p = problem(T, E, k, dim, hidden, grad=True)
        grad_out = torch.randn_like(p[0])

        def forward_backward():
            ops.moe(*p).backward(grad_out)
            for leaf in p:
                leaf.grad = None

        paths = {"bf16 moe forward+backward": forward_backward}
    else:
        with torch.no_grad():
            p = problem(T, E, k, dim, hidden)
            xq, xs = ops.quantize_mxfp8(p[0], exponent_block=ops.MXFP8_ALIGN)
            wq, ws, w2q, w2s = ops.cached_quantized_weights(p[1], p[2], p[3])
            s, e, n = ops.moe_align(p[4], E)
        out = torch.empty_like(p[0])
        paths = {"bf16 moe": lambda: ops.moe(*p), "mxfp8 moe": lambda: ops.moe(*p, mxfp8=True),
                 "fused_moe_mxfp8 (shared exponents)":
                     lambda: ops.fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, s, e, n, p[5], out, k)}
    for label, fn in paths.items():
        with torch.set_grad_enabled(args.backward):
            if args.plain:
                for _ in range(args.calls):
                    fn()
                torch.cuda.synchronize()
                print(f"{args.shape} {label}: {args.calls} calls")
                continue
            totals = per_kernel_ms(fn, args.calls)
        whole = sum(totals.values())
        print(f"{args.shape} {label}: {whole:.3f} ms of kernels per call")
        for name, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
            if ms >= 0.01 * whole:
                print(f"  {ms:8.3f} ms  {100 * ms / whole:5.1f}%  {name[:110]}")


if __name__ == "__main__":
    main()
