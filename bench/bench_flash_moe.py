"""GPU benchmark of flash_moe (never a test): the fused MoE expert forward and forward+backward through
``prime_kernels_flash_moe.ops.moe``, against the grouped-mm expert path (argsort permute -> torch._grouped_mm gate/up
-> silu * up -> grouped_mm down -> weighted index_add) and the bf16 matmul ceiling, all measured in the same run.

    python bench/bench_flash_moe.py [--json PATH] [--quick]

Timing: triton.testing.do_bench median. FLOPs = 2 T k dim 2 hidden + 2 T k hidden dim (forward); forward+backward
counts 3x that plus the recomputed gate/up (2 T k dim 2 hidden). Routing: uniform random top-k ids, softmax weights.
"""
from __future__ import annotations

import argparse
import json

import torch
from common import do_bench, free, matmul_ceiling

# (name, T, E, top_k, dim, hidden)
SHAPES = [
    ("qwen3-30b-a3b", 16384, 128, 8, 2048, 768),
    ("deepseek-v3", 8192, 256, 8, 7168, 2048),
    ("mixtral", 8192, 8, 2, 4096, 14336),
    ("qwen3-30b-a3b T=1024", 1024, 128, 8, 2048, 768),
    ("qwen3-30b-a3b T=65536", 65536, 128, 8, 2048, 768),
]
TARGETS = {"qwen3-30b-a3b": 2.0, "deepseek-v3": 1.6, "mixtral": 1.3}


def problem(T, E, k, dim, hidden, grad=False):
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(E, hidden, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    w3 = torch.randn(E, hidden, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    w2 = torch.randn(E, dim, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    ids = torch.rand(T, E, device="cuda").topk(k, -1).indices.to(torch.int32)
    tw = torch.rand(T, k, device="cuda").softmax(-1)
    if grad:
        for t in (x, w1, w2, w3, tw):
            t.requires_grad_(True)
    return x, w1, w2, w3, ids, tw


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="the three main shapes, forward only at T=65536")
    args = parser.parse_args()
    import prime_kernels
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    ops = prime_kernels.load("flash_moe")
    ceiling = matmul_ceiling()
    print(f"bf16 matmul ceiling 8192^3: {ceiling / 1e12:.0f} TFLOP/s")
    summary = []
    for name, T, E, k, dim, hidden in SHAPES[:3] if args.quick else SHAPES:
        flops = 2 * T * k * dim * 2 * hidden + 2 * T * k * hidden * dim
        row = {"shape": name, "T": T, "E": E, "top_k": k, "dim": dim, "hidden": hidden}
        with torch.no_grad():
            p = problem(T, E, k, dim, hidden)
            ours = do_bench(lambda: ops.moe(*p))
            det = do_bench(lambda: ops.moe(*p, deterministic=True))
            peer = do_bench(lambda: moe_grouped_mm(*p))
            s, e, n = ops.moe_align(p[4], E)
            out = torch.empty_like(p[0])
            w = torch.cat([p[1], p[3]], 1)
            fused = do_bench(lambda: ops.fused_moe_bf16(p[0], w, p[2], s, e, n, p[5], out, k))
            align = do_bench(lambda: ops.moe_align(p[4], E))
        row.update(fwd_ms=ours, fwd_det_ms=det, fused_op_ms=fused, align_ms=align, peer_fwd_ms=peer,
                   fwd_tflops=flops / ours / 1e9, peer_fwd_tflops=flops / peer / 1e9, fwd_speedup=peer / ours,
                   target=TARGETS.get(name))
        del p, w, out
        free()
        if not (args.quick and T > 16384):
            p = problem(T, E, k, dim, hidden, grad=True)
            go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
            leaves = [p[i] for i in (0, 1, 2, 3, 5)]
            fb = do_bench(lambda: ops.moe(*p).backward(go), grad_to_none=leaves)
            fb_peer = do_bench(lambda: moe_grouped_mm(*p).backward(go), grad_to_none=leaves)
            row.update(fwd_bwd_ms=fb, peer_fwd_bwd_ms=fb_peer, fwd_bwd_speedup=fb_peer / fb,
                       fwd_bwd_tflops=(3 * flops + 2 * T * k * dim * 2 * hidden) / fb / 1e9)
            del p, go, leaves
            free()
        row["ceiling_tflops"] = ceiling / 1e12
        summary.append(row)
        print(f"{name:24s} fwd {ours:7.3f} ms ({row['fwd_tflops']:5.0f} TFLOP/s, det {det:7.3f}, fused op {fused:7.3f},"
              f" align {align:6.3f}) | grouped-mm {peer:7.3f} ms ({row['peer_fwd_tflops']:5.0f}) | x{row['fwd_speedup']:.2f}"
              f" (target {row['target']})" + (f" | fwd+bwd {row['fwd_bwd_ms']:7.3f} vs {row['peer_fwd_bwd_ms']:7.3f} ms"
                                               f" x{row['fwd_bwd_speedup']:.2f}" if "fwd_bwd_ms" in row else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling_tflops": ceiling / 1e12, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
