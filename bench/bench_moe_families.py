"""GPU benchmark of flash_moe's families (never a test): forward and forward+backward of ``ops.moe`` for gpt-oss's
experts (clamped sigmoid-GLU, biases, gate/up interleaved, transposed weights as transformers stores them) and
Nemotron-H's (relu2, not gated), against prime-rl's grouped-mm formulation of the same family
(``reference.moe_grouped_mm``) and ours with SwiGLU at the same shape (the activation and biases are epilogue work:
the goal is within 5 % of its TFLOP/s), all in the same run, in alternating turns; ``moe_sorted`` against ``moe`` on
the same routing (it skips only the gather).

    python bench/bench_moe_families.py [--json PATH] [--shapes NAME,NAME] [--quick]

FLOPs: gated forward 2 S dim 2 hidden + 2 S hidden dim, relu2 2 S dim hidden + 2 S hidden dim (S = T k routed
slots); forward+backward 3x the forward. Floors at the bf16 ceiling measured in the same run (common.matmul_ceiling).
Peak memory: allocated at the peak of one forward+backward above the inputs (gradients included).
"""
from __future__ import annotations

import argparse
import json

import torch

from common import LONG_TIMING, backward_ms, do_bench, free, interleaved, matmul_ceiling, peak_extra, run_record

# (name, T, E, top_k, dim, hidden, activation, layout args, biases): gpt-oss-120b / -20b experts from their configs
# (hidden_size 2880, intermediate_size 2880, 128 / 32 experts, 4 per token); Nemotron 3 Nano 30B-A3B's
# (hidden_size 2688, moe_intermediate_size 1856, 128 routed experts, 6 per token)
SHAPES = [
    ("gpt-oss-120b", 16384, 128, 4, 2880, 2880, "gpt_oss", ("interleaved", True), True),
    ("gpt-oss-20b", 16384, 32, 4, 2880, 2880, "gpt_oss", ("interleaved", True), True),
    ("nemotron-3-nano", 16384, 128, 6, 2688, 1856, "relu2", ("stacked", False), False),
]


def forward_flops(slots, dim, hidden, gated):
    return 2 * slots * dim * (2 if gated else 1) * hidden + 2 * slots * hidden * dim


def problem(ops, T, E, k, dim, hidden, activation, layout, biases):
    """x, w1, w2, w3, ids, tw and the family keywords, in the family's layout (gpt-oss: transposed, interleaved)."""
    gated = activation != "relu2"
    out_rows = (2 if gated else 1) * hidden
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(E, out_rows, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    w2 = torch.randn(E, dim, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    if layout.transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    ids = torch.rand(T, E, device="cuda").topk(k, -1).indices.to(torch.int32)
    tw = torch.rand(T, k, device="cuda").softmax(-1)
    kw = dict(activation=activation, layout=layout,
              b1=torch.randn(E, out_rows, device="cuda", dtype=torch.bfloat16) if biases else None,
              b2=torch.randn(E, dim, device="cuda", dtype=torch.bfloat16) if biases else None)
    return [x, w1, w2, None, ids, tw], kw


def timed(fn, leaves, go, timing):
    """(forward ms, forward+backward ms, backward-alone ms, peak extra bytes of a forward+backward)."""
    def step():
        fn().backward(go)

    with torch.no_grad():
        fwd = do_bench(fn, **timing)
    both = do_bench(step, grad_to_none=leaves, **timing)
    bwd = backward_ms(fn, go, grad_to_none=leaves, **timing)
    peak = peak_extra(step)
    for t in leaves:
        t.grad = None
    return fwd, both, bwd, peak


def bench_shape(ops, reference, name, T, E, k, dim, hidden, activation, layout_args, biases, ceiling, timing):
    layout = ops.ExpertLayout(*layout_args)
    gated = activation != "relu2"
    args, kw = problem(ops, T, E, k, dim, hidden, activation, layout, biases)
    leaves = [t.requires_grad_() for t in (args[0], args[1], args[2], kw["b1"], kw["b2"], args[5]) if t is not None]
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    paths = {"ours": lambda: ops.moe(*args, **kw), "grouped_mm": lambda: reference.moe_grouped_mm(*args, **kw)}
    # moe_sorted on moe()'s routing with one slot per row: x's rows repeated k times and sorted by expert
    key = args[4].reshape(-1).long()
    order = torch.argsort(key, stable=True)
    x_sorted = args[0].detach()[order // k].clone().requires_grad_()
    counts = torch.bincount(key, minlength=E)
    paths["ours_sorted"] = lambda: ops.moe_sorted(x_sorted, args[1], args[2], None, counts, **kw)
    paths["ours_top1_same_rows"] = lambda: ops.moe(x_sorted, args[1], args[2], None,
                                                   key[order].to(torch.int32).unsqueeze(1),
                                                   torch.ones(T * k, 1, device="cuda"), **kw)
    results = {}
    for path, fn in paths.items():
        gof = go if not path.endswith(("sorted", "same_rows")) else torch.randn_like(x_sorted)
        own = leaves + ([x_sorted] if path.endswith(("sorted", "same_rows")) else [])
        results[path] = timed(fn, own, gof, timing)
        free()
    # the alternation that the ratio rests on: ours against grouped-mm, forward+backward, in turns
    def step(fn):
        return lambda: fn().backward(go)

    turns = interleaved({"ours": step(paths["ours"]), "grouped_mm": step(paths["grouped_mm"])},
                        grad_to_none=leaves, **LONG_TIMING)
    # SwiGLU at the same shape and layout, bias-free: the same GEMMs with the plain epilogues
    swiglu_args, swiglu_kw = problem(ops, T, E, k, dim, hidden, "swiglu", ops.ExpertLayout(
        layout.gate_up if gated else "stacked", layout.transposed), False)
    swiglu_leaves = [t.requires_grad_() for t in (swiglu_args[0], swiglu_args[1], swiglu_args[2], swiglu_args[5])]
    swiglu = timed(lambda: ops.moe(*swiglu_args, **swiglu_kw), swiglu_leaves, go, timing)
    del swiglu_args, swiglu_kw, swiglu_leaves
    free()
    # and in the stacked (E, 2 hidden, dim) layout, K-major B tiles: what reading this layout in place costs
    default_args, default_kw = problem(ops, T, E, k, dim, hidden, "swiglu", ops.ExpertLayout("stacked"), False)
    default_leaves = [t.requires_grad_() for t in (default_args[0], default_args[1], default_args[2], default_args[5])]
    swiglu_default = timed(lambda: ops.moe(*default_args, **default_kw), default_leaves, go, timing)
    del default_args, default_kw, default_leaves
    free()
    flops = forward_flops(T * k, dim, hidden, gated)
    swiglu_flops = forward_flops(T * k, dim, hidden, True)
    row = {"shape": name, "T": T, "E": E, "top_k": k, "dim": dim, "hidden": hidden, "activation": activation,
           "layout": f"{layout.gate_up}{' transposed' if layout.transposed else ''}", "biases": biases,
           "ceiling_tflops": ceiling / 1e12, "floor_fwd_bwd_ms": 3 * flops / ceiling * 1e3,
           "fwd_bwd_turns_ms": turns, "speedup_fwd_bwd": turns["grouped_mm"] / turns["ours"],
           "swiglu_same_shape": {"fwd_ms": swiglu[0], "fwd_bwd_ms": swiglu[1], "bwd_ms": swiglu[2],
                                 "peak_gib": swiglu[3] / 2**30,
                                 "fwd_bwd_tflops": 3 * swiglu_flops / swiglu[1] / 1e9},
           "swiglu_stacked_layout": {"fwd_ms": swiglu_default[0], "fwd_bwd_ms": swiglu_default[1],
                                     "bwd_ms": swiglu_default[2], "peak_gib": swiglu_default[3] / 2**30,
                                     "fwd_bwd_tflops": 3 * swiglu_flops / swiglu_default[1] / 1e9}}
    for path, (fwd, both, bwd, peak) in results.items():
        row[path] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "bwd_ms": bwd, "peak_gib": peak / 2**30,
                     "fwd_tflops": flops / fwd / 1e9, "fwd_bwd_tflops": 3 * flops / both / 1e9}
    row["tflops_vs_swiglu"] = row["ours"]["fwd_bwd_tflops"] / row["swiglu_same_shape"]["fwd_bwd_tflops"]
    print(f"{name:16s} {activation:7s} {row['layout']:22s} fwd+bwd ours {turns['ours']:7.3f} ms vs grouped-mm "
          f"{turns['grouped_mm']:7.3f} ms: x{row['speedup_fwd_bwd']:.2f} (floor {row['floor_fwd_bwd_ms']:.3f} ms; "
          f"{row['ours']['fwd_bwd_tflops']:.0f} TFLOP/s, SwiGLU same shape {row['swiglu_same_shape']['fwd_bwd_tflops']:.0f}: "
          f"x{row['tflops_vs_swiglu']:.3f}; stacked layout {row['swiglu_stacked_layout']['fwd_bwd_tflops']:.0f}) | fwd ours {row['ours']['fwd_ms']:.3f} grouped-mm "
          f"{row['grouped_mm']['fwd_ms']:.3f} | sorted {row['ours_sorted']['fwd_bwd_ms']:.3f} vs moe on the same rows "
          f"{row['ours_top1_same_rows']['fwd_bwd_ms']:.3f} ms | peak GiB ours {row['ours']['peak_gib']:.2f} "
          f"grouped-mm {row['grouped_mm']['peak_gib']:.2f}")
    return row


def main():
    import prime_kernels
    from prime_kernels_flash_moe import reference

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default=None, help="comma-separated names of SHAPES")
    parser.add_argument("--quick", action="store_true", help="shorter timing (a smoke run, not a measurement)")
    args = parser.parse_args()
    ops = prime_kernels.load("flash_moe")
    wanted = set(args.shapes.split(",")) if args.shapes else None
    timing = {"warmup": 5, "rep": 20} if args.quick else {}
    ceiling = matmul_ceiling()
    print(f"{torch.cuda.get_device_name()}: bf16 ceiling {ceiling / 1e12:.0f} TFLOP/s (torch {torch.__version__})")
    rows = [bench_shape(ops, reference, *shape, ceiling, timing) for shape in SHAPES
            if wanted is None or shape[0] in wanted]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_record(), "ceiling_tflops": ceiling / 1e12, "families": rows}, f, indent=2)


if __name__ == "__main__":
    main()
