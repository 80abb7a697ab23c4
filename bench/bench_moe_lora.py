"""GPU benchmark of flash_moe with LoRA adapters (issue 58; never a test): forward+backward with frozen base weights
(gradients for x, the routing weights and the adapters) of prime-rl's unfused formulation
(``reference.moe_lora_grouped_mm``: base grouped GEMMs plus two grouped GEMMs per adapted projection, one adapter per
call), flash_moe without adapters (the frozen-base time the fused adapters must stay within 1.15x of), and
``moe(lora=...)`` with one and with four adapters in one call; peak memory of each; and the forward alone (no grad)
of each, where ``moe(lora=...)`` runs the fused kernels.

    python bench/bench_moe_lora.py [--json PATH] [--shapes NAME,NAME] [--ranks 16,64] [--quick]

``moe(lora=...)`` runs fused kernels (the rank-r shrink, then the base GEMMs with their K extended by it), forward
and backward.
"""
from __future__ import annotations

import argparse
import json

import torch

from common import LONG_TIMING, do_bench, free, interleaved, peak_extra, run_record

# (name, T, E, top_k, dim, hidden, activation, layout args, biases): Qwen3-30B-A3B's and gpt-oss-20b's experts
SHAPES = [
    ("qwen3-30b-a3b", 16384, 128, 8, 2048, 768, "swiglu", ("separate", False), False),
    ("gpt-oss-20b", 16384, 32, 4, 2880, 2880, "gpt_oss", ("interleaved", True), True),
]


def problem(T, E, k, dim, hidden, activation, layout, biases):
    """x, w1, w2, w3, ids, tw (frozen weights) and the family keywords."""
    gated = activation != "relu2"
    out_rows = (2 if gated else 1) * hidden
    separate = layout.gate_up == "separate"
    w1 = torch.randn(E, hidden if separate else out_rows, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    w3 = torch.randn(E, hidden, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5 if separate else None
    w2 = torch.randn(E, dim, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    if layout.transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        w3 = None if w3 is None else w3.transpose(1, 2).contiguous()
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ids = torch.rand(T, E, device="cuda").topk(k, -1).indices.to(torch.int32)
    tw = torch.rand(T, k, device="cuda").softmax(-1).requires_grad_()
    kw = dict(activation=activation, layout=layout,
              b1=torch.randn(E, out_rows, device="cuda", dtype=torch.bfloat16) if biases else None,
              b2=torch.randn(E, dim, device="cuda", dtype=torch.bfloat16) if biases else None)
    return [x, w1, w2, w3, ids, tw], kw


def adapters(ops, n, E, dim, hidden, rank, gated, T):
    """n adapters on gate, up, down (PEFT's init: A random, B small random so the products are not zero), tokens
    spread evenly over them."""
    pairs = {}
    for proj, n_in, n_out in (("gate", dim, hidden), ("up", dim, hidden), ("down", hidden, dim)):
        if proj == "up" and not gated:
            continue
        pairs[f"a_{proj}"] = (torch.randn(n, E, rank, n_in, device="cuda") / n_in**0.5).bfloat16().requires_grad_()
        pairs[f"b_{proj}"] = (torch.randn(n, E, n_out, rank, device="cuda") * 0.01).bfloat16().requires_grad_()
    return ops.MoeLora(torch.full((n,), 2.0, device="cuda"), **pairs,
                       adapter_ids=torch.arange(T, device="cuda") % n)


def timed(fn, leaves, go, timing):
    """(forward+backward ms, peak extra bytes of one forward+backward)."""
    def step():
        fn().backward(go)

    ms = do_bench(step, grad_to_none=leaves, **timing)
    peak = peak_extra(step)
    for t in leaves:
        t.grad = None
    return ms, peak


def bench_shape(ops, reference, name, T, E, k, dim, hidden, activation, layout_args, biases, rank, timing):
    layout = ops.ExpertLayout(*layout_args)
    gated = activation != "relu2"
    args, kw = problem(T, E, k, dim, hidden, activation, layout, biases)
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    one, four = (adapters(ops, n, E, dim, hidden, rank, gated, T) for n in (1, 4))
    base_leaves = [args[0], args[5]]
    leaves_of = lambda lora: base_leaves + [t for t in lora.adapters() if t is not None]  # noqa: E731
    paths = {
        "prime_rl_1": (lambda: reference.moe_lora_grouped_mm(*args, lora=one, **kw), leaves_of(one), timing),
        "prime_rl_4": (lambda: reference.moe_lora_grouped_mm(*args, lora=four, **kw), leaves_of(four), timing),
        "ours_no_adapters": (lambda: ops.moe(*args, **kw), base_leaves, timing),
        "ours_1": (lambda: ops.moe(*args, lora=one, **kw), leaves_of(one), timing),
        "ours_4": (lambda: ops.moe(*args, lora=four, **kw), leaves_of(four), timing),
    }
    results, forward = {}, {}
    for path, (fn, leaves, path_timing) in paths.items():
        results[path] = timed(fn, leaves, go, path_timing)
        free()
        with torch.no_grad():
            forward[path] = do_bench(fn, **timing)
        free()
    turns = interleaved({"prime_rl_1": lambda: paths["prime_rl_1"][0]().backward(go),
                         "ours_no_adapters": lambda: paths["ours_no_adapters"][0]().backward(go)},
                        grad_to_none=leaves_of(one), **LONG_TIMING)
    row = {"shape": name, "T": T, "E": E, "top_k": k, "dim": dim, "hidden": hidden, "activation": activation,
           "layout": f"{layout.gate_up}{' transposed' if layout.transposed else ''}", "rank": rank,
           "fwd_bwd_turns_ms": turns,
           **{p: {"fwd_bwd_ms": ms, "fwd_no_grad_ms": forward[p], "peak_gib": peak / 2**30}
              for p, (ms, peak) in results.items()}}
    print(f"{name:14s} r{rank:<3d} fwd+bwd (frozen base) prime-rl 1 adapter {turns['prime_rl_1']:8.3f} ms, 4 "
          f"{results['prime_rl_4'][0]:8.3f} | flash_moe no adapters {turns['ours_no_adapters']:7.3f} ms | "
          f"moe(lora) 1 {results['ours_1'][0]:8.3f} ms, 4 {results['ours_4'][0]:8.3f} | "
          f"peak GiB prime-rl {results['prime_rl_1'][1] / 2**30:.2f}, no adapters "
          f"{results['ours_no_adapters'][1] / 2**30:.2f}, moe(lora) {results['ours_1'][1] / 2**30:.2f}")
    print(f"{'':14s} r{rank:<3d} forward (no grad) prime-rl 1 {forward['prime_rl_1']:8.3f} ms, 4 "
          f"{forward['prime_rl_4']:8.3f} | flash_moe no adapters {forward['ours_no_adapters']:7.3f} | moe(lora) fused 1 "
          f"{forward['ours_1']:7.3f}, 4 {forward['ours_4']:7.3f}")
    return row


def main():
    import prime_kernels
    from prime_kernels_flash_moe import reference

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default=None, help="comma-separated names of SHAPES")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--quick", action="store_true", help="shorter timing (a smoke run, not a measurement)")
    args = parser.parse_args()
    ops = prime_kernels.load("flash_moe")
    wanted = set(args.shapes.split(",")) if args.shapes else None
    timing = {"warmup": 5, "rep": 20} if args.quick else {}
    print(f"{torch.cuda.get_device_name()} (torch {torch.__version__})")
    rows = [bench_shape(ops, reference, *shape, int(rank), timing) for shape in SHAPES
            for rank in args.ranks.split(",") if wanted is None or shape[0] in wanted]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_record(), "lora": rows}, f, indent=2)


if __name__ == "__main__":
    main()
