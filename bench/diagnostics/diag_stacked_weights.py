"""Whether moe()'s forward+backward costs more with the gate and up weights stacked as one [W1; W3] tensor (the form
the SonicMoE comparison and transformers' fused experts pass) than with w1 and w3 apart (the main rows' form): both
beside the grouped-mm path, in turns, each timing ~1 s of calls (the main rows' 100 ms is 3 calls at Mixtral), then
each form's GPU timeline span. If the two forms tie here, the SonicMoE bench's lower ratio for ours is its timing.

    python3 bench/diagnostics/diag_stacked_weights.py [--shapes mixtral,qwen3-30b-a3b]
"""
import argparse
import sys
from pathlib import Path

import torch

import prime_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shapes and timing helpers
from bench_flash_moe import SHAPES, forward_flops, problem
from common import LONG_TIMING, free, gpu_timeline, interleaved, matmul_ceiling
from prime_kernels_flash_moe.reference import moe_grouped_mm

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
args = parser.parse_args()
ops = prime_kernels.load("flash_moe")
ceiling = matmul_ceiling()
print(f"bf16 ceiling {ceiling / 1e12:.0f} TFLOP/s")
for name, T, E, k, dim, hidden in SHAPES:
    if name not in args.shapes.split(","):
        continue
    x, w1, w2, w3, ids, tw = problem(T, E, k, dim, hidden, grad=True)
    w13 = torch.cat([w1, w3], 1).detach().requires_grad_()
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    leaves = [x, w1, w2, w3, tw, w13]
    forms = {"w1, w3 apart": lambda: ops.moe(x, w1, w2, w3, ids, tw).backward(go),
             "[W1; W3] stacked": lambda: ops.moe(x, w13, w2, None, ids, tw).backward(go),
             "grouped-mm": lambda: moe_grouped_mm(x, w1, w2, w3, ids, tw).backward(go)}
    times = interleaved(forms, grad_to_none=leaves, **LONG_TIMING)
    flops = 3 * forward_flops(T * k, dim, hidden)
    print(f"{name}: fwd+bwd floor {flops / ceiling * 1e3:.3f} ms at the ceiling")
    for form, ms in times.items():
        span = gpu_timeline(forms[form], grad_to_none=leaves)["span_ms"]
        print(f"  {form:18s} {ms:7.3f} ms ({flops / ms / 1e9:4.0f} TFLOP/s), x{times['grouped-mm'] / ms:.3f} the "
              f"grouped-mm path; timeline span {span:.3f} ms")
    del forms, x, w1, w2, w3, w13, leaves
    free()
