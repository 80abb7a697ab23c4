"""DIAGNOSTIC (branch diag-dw; run against its build only): where moe_grad_weight's time goes at the benchmark shapes.
Times dW1 (dg^T x, transposed store) and dW2 (grad_out^T p h) with parts of the kernel left out through
FLASH_MOE_DIAG_DW (bit 0: no TMA stores of the output; 1: no epilogue; 2: no wgmmas; 3: no gather of the
source rows (A); 4: no slot-row (B) loads), beside the gathers + grouped GEMM
path moe() takes in place of it, the same-run matmul ceiling and copy bandwidth. Results of modes != 0 are wrong by
design: only the times mean anything.
    PYTHONPATH=/tmp/variants/diag-dw python3 .variants/diag-dw/bench/diag_grad_weight.py [--shapes a,b]"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), "bench"]  # common.py: beside it, or the tree's (run from its root)
from common import copy_bandwidth, do_bench, free, matmul_ceiling  # noqa: E402

SHAPES = {  # name: (T, E, top_k, dim, hidden)
    "qwen3-30b-a3b": (16384, 128, 8, 2048, 768),
    "deepseek-v3": (8192, 256, 8, 7168, 2048),
    "mixtral": (8192, 8, 2, 4096, 14336),
    "sonicmoe-7b": (24576, 128, 8, 1536, 256),
}
MODES = {0: "whole kernel", 1: "no output stores", 2: "no epilogue", 4: "no wgmmas", 6: "loads only",
         8: "no A gather", 16: "no B loads", 24: "no loads", 26: "wgmmas only"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b,mixtral")
    args = parser.parse_args()
    import prime_kernels_flash_moe.ops  # noqa: F401  (registers the ops)

    ceiling, bandwidth = matmul_ceiling(), copy_bandwidth()
    print(f"ceiling {ceiling / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s (read + write)")
    for name in args.shapes.split(","):
        T, E, k, dim, hidden = SHAPES[name]
        S = T * k
        ids = torch.rand(T, E, device="cuda").topk(k, -1).indices.to(torch.int32)  # as bench_flash_moe.problem
        order = torch.sort(ids.reshape(-1).long(), stable=True).indices
        offs = torch.cumsum(torch.bincount(ids.reshape(-1).long(), minlength=E), 0).to(torch.int32)
        tok = order // k
        row_token = tok.to(torch.int32)
        x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
        go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
        dg = torch.randn(S, hidden, device="cuda", dtype=torch.bfloat16)
        ph = torch.randn(S, hidden, device="cuda", dtype=torch.bfloat16)
        flop = 2 * S * dim * hidden
        written = E * dim * hidden * 2
        runs = {
            "dW1 gather+gmm": lambda: torch._grouped_mm(dg.t(), x[tok], offs=offs),
            "dW2 gather+gmm": lambda: torch._grouped_mm(go[tok].t(), ph, offs=offs),
        }
        for mode, what in MODES.items():
            runs[f"dW1 {what}"] = (mode, lambda: torch.ops.flash_moe.moe_grad_weight(dg, x, row_token, offs, False))
            runs[f"dW2 {what}"] = (mode, lambda: torch.ops.flash_moe.moe_grad_weight(ph, go, row_token, offs, True))
        for label, run in runs.items():
            mode, fn = run if isinstance(run, tuple) else (0, run)
            os.environ["FLASH_MOE_DIAG_DW"] = str(mode)
            ms = do_bench(fn)
            print(f"{name:14s} {label:22s} {ms:7.3f} ms {flop / ms / 1e9:5.0f} TFLOP/s "
                  f"{written / ms / 1e6:6.0f} GB/s written (floors: {flop / ceiling * 1e3:.3f} ms matmul, "
                  f"{2 * written / bandwidth * 1e3:.3f} ms write)")
        os.environ["FLASH_MOE_DIAG_DW"] = "0"
        del x, go, dg, ph
        free()


if __name__ == "__main__":
    main()
