"""What routing imbalance costs flash_moe's bf16 forward (never a test): ``moe`` forward and the grouped-mm expert path
on the benchmark's uniform random top-k routing against a balanced one (token t takes experts (t k + j) mod E, so
every expert gets exactly T k / E slots: whole BLOCK_M blocks at these shapes, no partly filled last block), with the
per-kernel split of our forward and the padded-block count of each routing.

    python bench/diagnostics/routing_balance.py [--shape deepseek-v3|qwen3-30b-a3b|mixtral ...] [--json PATH]

A large gap between the two routings says the partly filled last block of each expert (which streams the expert's
whole weight tile through L2 for a few rows) is where the time goes; docs/notes/flash_moe.md reads these figures.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shapes and timing helpers
from bench_flash_moe import SHAPES, forward_flops, problem
from common import do_bench, free, matmul_ceiling
from profile_flash_moe import per_kernel_ms


def balanced_ids(T, E, k):
    t = torch.arange(T, device="cuda").unsqueeze(1)
    return ((t * k + torch.arange(k, device="cuda")) % E).to(torch.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["deepseek-v3", "qwen3-30b-a3b", "mixtral"],
                        choices=[s[0] for s in SHAPES[:3]])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import prime_kernels
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    ops = prime_kernels.load("flash_moe")
    ceiling = matmul_ceiling()
    print(f"bf16 matmul ceiling 8192^3: {ceiling / 1e12:.0f} TFLOP/s")
    rows = []
    for name in args.shape:
        _, T, E, k, dim, hidden = next(s for s in SHAPES if s[0] == name)
        flops = forward_flops(T * k, dim, hidden)
        with torch.no_grad():
            p = list(problem(T, E, k, dim, hidden))
            for routing, ids in (("random", p[4]), ("balanced", balanced_ids(T, E, k))):
                p[4] = ids
                blocks = int(ops.moe_align(ids, E)[2].item()) // ops.BLOCK_M
                ours = do_bench(lambda: ops.moe(*p))
                peer = do_bench(lambda: moe_grouped_mm(*p))
                kernels = per_kernel_ms(lambda: ops.moe(*p), 5)
                gemm = {mode: sum(ms for n, ms in kernels.items() if f"moe_gemm_kernel<{mode}>" in n) for mode in (0, 1)}
                rows.append({"shape": f"{name} {routing}", "blocks": blocks, "moe_fwd_ms": ours,
                             "grouped_mm_fwd_ms": peer, "gate_up_kernel_ms": gemm[0], "down_kernel_ms": gemm[1],
                             "floor_milliseconds": flops / ceiling * 1e3})
                split = ", ".join(f"{ms:.3f} {n[:28]}" for n, ms in sorted(kernels.items(), key=lambda kv: -kv[1])
                                  if ms >= 0.01 * sum(kernels.values()))
                print(f"{name:14s} {routing:8s} blocks {blocks:5d} ({T * k / ops.BLOCK_M:7.0f} if full) | ours "
                      f"{ours:7.3f} ms ({flops / ours / 1e9:4.0f} TFLOP/s; floor {flops / ceiling * 1e3:.3f}) | "
                      f"grouped-mm {peer:7.3f} ms | x{peer / ours:.2f} | {split}")
        del p
        free()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "bf16_ceiling_tflops": ceiling / 1e12}, f, indent=1)


if __name__ == "__main__":
    main()
