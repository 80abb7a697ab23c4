"""Why PyTorch's grouped GEMM for dW1 / dW3 runs ~7 % slower inside moe()'s backward than in the grouped-mm path's
own (Mixtral, session 33's H200 timeline): the same torch._grouped_mm, per expert rows^T @ gathered x, with the rows
(dg or du) as they come from moe_grad_gate_up (a half of one [dg | du] tensor: row stride 2 hidden) and as a
contiguous tensor of their own (the grouped-mm path's autograd gradient), and dW2's product for scale; in turns, with
the bf16 ceiling of the same run. If the half-view form is the slower, moe_grad_gate_up writing dg and du apart for
separate w1 / w3 is the lever; if not, the gap is the clocks under our heavier kernels before it.

    python3 bench/diagnostics/diag_dw_layout.py [--shapes mixtral,deepseek-v3]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shapes and timing helpers
from bench_flash_moe import SHAPES
from common import interleaved, matmul_ceiling

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="mixtral")
args = parser.parse_args()
ceiling = matmul_ceiling()
print(f"bf16 ceiling {ceiling / 1e12:.0f} TFLOP/s")
for name, T, E, k, dim, hidden in SHAPES:
    if name not in args.shapes.split(","):
        continue
    S = T * k
    ids = torch.rand(T, E, device="cuda").topk(k, -1).indices.reshape(-1)
    order = ids.sort(stable=True).indices
    offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
    gathered = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)[order // k]
    both = torch.randn(S, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    half, own = both[:, :hidden], both[:, :hidden].contiguous()
    weighted_h = torch.randn(S, hidden, device="cuda", dtype=torch.bfloat16)
    forms = {"dW1 from the [dg | du] half": lambda: torch._grouped_mm(half.t(), gathered, offs=offs),
             "dW1 from its own tensor": lambda: torch._grouped_mm(own.t(), gathered, offs=offs),
             "dW2 (grad_out rows against p h)": lambda: torch._grouped_mm(gathered.t(), weighted_h, offs=offs)}
    assert torch.equal(forms["dW1 from the [dg | du] half"](), forms["dW1 from its own tensor"]())
    times = interleaved(forms, rounds=4)
    flops = 2 * S * dim * hidden  # each of the three products
    for form, ms in times.items():
        print(f"  {name} {form}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s (floor {flops / ceiling * 1e3:.3f} ms)")
    del forms, gathered, both, half, own, weighted_h  # the lambdas hold the tensors too
