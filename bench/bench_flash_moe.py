"""GPU benchmark of flash_moe (never a test): the fused MoE expert forward and forward+backward through
``prime_kernels_flash_moe.ops.moe``, against the grouped-mm expert path (argsort permute -> torch._grouped_mm gate/up
-> silu * up -> grouped_mm down -> weighted index_add) and the bf16 matmul ceiling, all measured in the same run.

    python bench/bench_flash_moe.py [--json PATH] [--quick] [--mxfp8-only] [--no-mxfp8] [--shapes NAME,NAME]
    python bench/bench_flash_moe.py --sonicmoe --no-mxfp8 [--shapes NAME,NAME]   (peer wheels: scripts/peer_wheels.sh)
    python bench/bench_flash_moe.py --liger [--no-lck] [--shapes NAME,NAME]   (peer wheels: scripts/peer_wheels.sh liger)
    python bench/bench_flash_moe.py --liger-warm [--shapes NAME,NAME]
    python bench/bench_flash_moe.py --parts --no-mxfp8 [--shapes NAME,NAME]
    python bench/bench_flash_moe.py --paths dw-grouped,dw-fused --no-mxfp8 [--rounds N] [--shapes NAME,NAME]
    python bench/bench_flash_moe.py --timeline --no-mxfp8 [--shapes NAME,NAME]
    python bench/bench_flash_moe.py --expert-parallel RANKS --no-mxfp8 [--shapes NAME,NAME]

Timing: triton.testing.do_bench median; ours and the grouped-mm path timed in turns, the order reversed each round
(``common.interleaved``: the H200 lowers its clocks at its power cap within a run). FLOPs = 2 T k dim 2 hidden + 2 T k
hidden dim (forward); forward+backward counts 3x that (``recompute_gate_up=True``'s recomputed gate/up not counted).
The backward alone (each call's backward between CUDA events after its untimed forward: common.backward_ms) is
reported in model FLOPs (2x the forward's: the recomputation not counted, so the TFLOP/s of both paths compare).
Peak memory: allocated at the peak of one forward+backward above the inputs (gradients included). Routing: uniform
random top-k ids, softmax weights.
``sonicmoe-7b``: SonicMoE's fine-grained 7B shape.

mxfp8 rows (DeepSeek-V3 and Qwen3-30B-A3B): ``moe(mxfp8=True)`` forward (x quantized per call, weights cached;
both with one exponent per 128 of K), the ``fused_moe_mxfp8`` op on pre-quantized operands with those shared
exponents (the kernels' fast path) and with per-32 exponents (their per-32 path), and ``quantize_mxfp8`` of x
alone, in TFLOP/s against the fp8 ceiling (``torch._scaled_mm`` e4m3 8192^3, per-tensor scales, bf16 out) and
against the bf16 flash_moe forward, all measured in the same run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
from common import (CEILING_WARMUP_MS, LONG_TIMING, backward_ms, do_bench, free, gpu_timeline, interleaved, matmul_ceiling,
                    peak_extra, sampled_clocks)

# (name, T, E, top_k, dim, hidden)
SHAPES = [
    ("qwen3-30b-a3b", 16384, 128, 8, 2048, 768),
    ("deepseek-v3", 8192, 256, 8, 7168, 2048),
    ("mixtral", 8192, 8, 2, 4096, 14336),
    ("qwen3-30b-a3b T=1024", 1024, 128, 8, 2048, 768),
    ("qwen3-30b-a3b T=65536", 65536, 128, 8, 2048, 768),
    ("sonicmoe-7b", 24576, 128, 8, 1536, 256),
]
TARGETS = {"qwen3-30b-a3b": 2.0, "deepseek-v3": 1.6, "mixtral": 1.3}
MXFP8_SHAPES = [
    ("deepseek-v3 mxfp8", 8192, 256, 8, 7168, 2048),
    ("qwen3-30b-a3b mxfp8", 16384, 128, 8, 2048, 768),
]


def fp8_ceiling() -> float:
    """e4m3 FLOP/s of an 8192^3 torch._scaled_mm (per-tensor scales, bf16 out) on random data."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    ms = do_bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), warmup=CEILING_WARMUP_MS, rep=200)
    del a, b
    free()
    return 2 * 8192**3 / (ms * 1e-3)


def bench_mxfp8(ops, fp8_peak, bf16_peak):
    rows = []
    for name, T, E, k, dim, hidden in MXFP8_SHAPES:
        flops = forward_flops(T * k, dim, hidden)
        with torch.no_grad():
            p = problem(T, E, k, dim, hidden)
            bf16 = do_bench(lambda: ops.moe(*p))
            mx = do_bench(lambda: ops.moe(*p, mxfp8=True))  # first call (warmup) fills the weight cache
            xq, xs = ops.quantize_mxfp8(p[0], exponent_block=ops.MXFP8_ALIGN)
            wq, ws, w2q, w2s = ops.cached_quantized_weights(p[1], p[2], p[3])
            s, e, n = ops.moe_align(p[4], E)
            out = torch.empty_like(p[0])
            fused = do_bench(lambda: ops.fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, s, e, n, p[5], out, k))
            quant = do_bench(lambda: ops.quantize_mxfp8(p[0], exponent_block=ops.MXFP8_ALIGN))
            del wq, ws, w2q, w2s
            ops.clear_mxfp8_weight_cache()
            xq, xs = ops.quantize_mxfp8(p[0])
            wq, ws = ops.quantize_mxfp8(torch.cat([p[1], p[3]], 1))
            w2q, w2s = ops.quantize_mxfp8(p[2])
            ws, w2s = ops.pack_scales_blocked(ws), ops.pack_scales_blocked(w2s)
            per32 = do_bench(lambda: ops.fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, s, e, n, p[5], out, k))
        row = {"shape": name, "T": T, "E": E, "top_k": k, "dim": dim, "hidden": hidden, "mxfp8_fwd_ms": mx,
               "mxfp8_fused_op_ms": fused, "mxfp8_fused_op_per32_ms": per32, "quantize_x_ms": quant,
               "bf16_fwd_ms": bf16, "mxfp8_fused_op_per32_tflops": flops / per32 / 1e9,
               "mxfp8_fwd_tflops": flops / mx / 1e9, "mxfp8_fused_op_tflops": flops / fused / 1e9,
               "fraction_of_fp8_ceiling": flops / fused / 1e9 / (fp8_peak / 1e12), "speedup_vs_bf16": bf16 / mx,
               "fp8_ceiling_tflops": fp8_peak / 1e12, "floor_fp8_ms": flops / fp8_peak * 1e3,
               "floor_bf16_ms": flops / bf16_peak * 1e3}
        rows.append(row)
        print(f"{name:24s} mxfp8 fwd {mx:7.3f} ms ({row['mxfp8_fwd_tflops']:5.0f} TFLOP/s), fused op {fused:7.3f} ms "
              f"({row['mxfp8_fused_op_tflops']:5.0f}, {100 * row['fraction_of_fp8_ceiling']:4.1f}% of fp8 ceiling; "
              f"floor {row['floor_fp8_ms']:.3f} ms), per-32 exponents {per32:7.3f} ms "
              f"({row['mxfp8_fused_op_per32_tflops']:5.0f}), quantize x {quant:6.3f} ms | "
              f"bf16 flash_moe fwd {bf16:7.3f} ms "
              f"(floor {row['floor_bf16_ms']:.3f} ms) | x{row['speedup_vs_bf16']:.2f}")
        del p, xq, xs, wq, ws, w2q, w2s, s, e, n, out
        ops.clear_mxfp8_weight_cache()
        free()
    return rows


def bench_backward_parts(ops, name, T, E, k, dim, hidden, ceiling):
    """Each piece of moe()'s backward alone (same inputs; "recompute gate_up" only with recompute_gate_up=True),
    beside what it replaced: grad_h by torch._grouped_mm + swiglu_backward, dx by two grouped GEMMs + the slot sum,
    the weight gradients by gathers + grouped GEMMs; and its forward's op, keeping g | u (training) and not.
    TFLOP/s in each piece's own FLOPs."""
    def _gmm(a, b, offs):
        return torch._grouped_mm(a, b, offs=offs)

    x, w1, w2, w3, ids, tw = problem(T, E, k, dim, hidden)
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    align = ops.moe_align(ids, E, block_align=ops.CONSTANTS["CLUSTER_BLOCKS"])
    S = T * k
    order = torch.sort(ids.reshape(-1).long(), stable=True).indices
    offs = torch.cumsum(torch.bincount(ids.reshape(-1).long(), minlength=E), 0).to(torch.int32)
    tok = order // k
    row_token = tok.to(torch.int32)
    with torch.no_grad():
        gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, k, ops.BLOCK_M)
        dgu, ph, _ = torch.ops.flash_moe.moe_grad_gate_up(go, w2, gate_up, *align, tw, k, ops.BLOCK_M)
        dg, du = dgu.split(w1.shape[1], 1)  # as moe() passes them: read in place
        ok = torch.ones(S, dtype=torch.bool, device="cuda")
        slot_combine = k >= ops.CONSTANTS["SLOT_COMBINE_MIN_TOP_K"]  # moe()'s combine rule

        def forward(save_gate_up):  # the forward's two GEMMs as moe() runs them
            return torch.ops.flash_moe.moe_forward(x, w1, w3, w2, *align, tw, k, ops.BLOCK_M, slot_combine,
                                                   save_gate_up, -1)
        parts = {
            "forward keeping g|u": (functools.partial(forward, True), 3),  # training: g | u kept for the backward
            "forward (inference)": (functools.partial(forward, False), 3),
            "recompute gate_up": (lambda: torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, k, ops.BLOCK_M), 2),
            "dH+swiglu (fused)": (lambda: torch.ops.flash_moe.moe_grad_gate_up(go, w2, gate_up, *align, tw, k,
                                                                            ops.BLOCK_M), 1),
            "dH+swiglu (gmm+pass)": (lambda: torch.ops.flash_moe.swiglu_backward(
                gate_up, _gmm(go[tok], w2, offs), tw.reshape(-1)[order], ok), 1),
            "dX atomic (fused)": (lambda: torch.ops.flash_moe.moe_grad_x(dg, du, w1, w3, *align, k, ops.BLOCK_M,
                                                                       False), 2),
            "dX k-order (fused)": (lambda: torch.ops.flash_moe.moe_grad_x(dg, du, w1, w3, *align, k, ops.BLOCK_M,
                                                                        True), 2),
            "dX (2 gmm + sum)": (lambda: dg.new_empty(S, dim).index_copy_(
                0, order, _gmm(dg, w1, offs) + _gmm(du, w3, offs)).view(T, k, dim).sum(1, dtype=torch.float32), 2),
            "dW1+dW3 (gather+2 gmm)": (lambda: [_gmm(g.t(), xs, offs) for xs in [x[tok]] for g in (dg, du)], 2),
            "dW1|dW3 (gather+gmm over dg | du)": (lambda: _gmm(dgu.t(), x[tok], offs), 2),
            "dW2 (gather+gmm)": (lambda: _gmm(go[tok].t(), ph, offs), 1),
            # the grouped-mm path's own orientation (its autograd's: the gathered rows as A, the result transposed),
            # with the copy into the weights' layout that AccumulateGrad makes of a transposed gradient
            "dW1+dW3 (gather+2 gmm, x^T as A)": (lambda: [_gmm(xs.t(), g, offs).transpose(1, 2).contiguous()
                                                          for xs in [x[tok]] for g in (dg, du)], 2),
            "dW2 (gather+gmm, h^T as A)": (lambda: _gmm(ph.t(), go[tok], offs).transpose(1, 2).contiguous(), 1),
            "dW1+dW3 (fused)": (lambda: (torch.ops.flash_moe.moe_grad_weight(dg, x, row_token, offs, False),
                                         torch.ops.flash_moe.moe_grad_weight(du, x, row_token, offs, False)), 2),
            "dW1|dW3 (fused over dg | du)": (lambda: torch.ops.flash_moe.moe_grad_weight(dgu, x, row_token, offs,
                                                                                          False), 2),
            "dW2 (fused)": (lambda: torch.ops.flash_moe.moe_grad_weight(ph, go, row_token, offs, True), 1),
        }
        times = {}
        for part, (fn, units) in parts.items():
            ms = times[part] = do_bench(fn)
            tflops = 2 * S * dim * hidden * units / ms / 1e9
            print(f"  {name:22s} {part:24s} {ms:7.3f} ms {tflops:5.0f} TFLOP/s (ceiling {ceiling / 1e12:.0f})")
    del x, w1, w2, w3, gate_up, dgu, dg, du, ph
    free()
    return {"shape": name, "parts_ms": times}


# moe()'s paths at every shape, by kernel.toml's launch rules switched in this process: the weight gradients by
# gathers + grouped GEMMs or by moe_grad_weight (FUSED_DW_MAX_HIDDEN)
PATHS = {
    "dw-grouped": {"FUSED_DW_MAX_HIDDEN": 0},
    "dw-fused": {"FUSED_DW_MAX_HIDDEN": 2**40},
}
PEER_PATH = "grouped-mm"  # --paths' name for the grouped-mm expert path, timed in the same rounds


def use_path(ops, path):
    """PATHS[path]'s rules into ops.CONSTANTS (the caller restores them if it needs to)."""
    ops.CONSTANTS.update(PATHS[path])


def bench_paths(ops, name, T, E, k, dim, hidden, paths, rounds=3):
    """moe() forward+backward through each of ``paths`` (PATHS' names, or PEER_PATH), alternating over rounds with
    the SM clock and power sampled, then per path a GPU timeline of a few calls (busy vs idle, the kernels, the longest
    gaps and whether the host was late) and one backward's device time by the operator that launched it: the
    end-to-end check of what --parts times alone."""
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    p = problem(T, E, k, dim, hidden, grad=True)
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    leaves = [p[i] for i in (0, 1, 2, 3, 5)]
    saved = {key: ops.CONSTANTS[key] for path in paths for key in PATHS.get(path, ())}
    times, clocks, timelines, by_operator = {path: [] for path in paths}, {path: [] for path in paths}, {}, {}

    def use(path):
        """the forward of ``path``, its rules in place"""
        ops.CONSTANTS.update(saved)
        if path == PEER_PATH:
            return lambda: moe_grouped_mm(*p)
        use_path(ops, path)
        return lambda: ops.moe(*p)

    try:
        for _ in range(rounds):
            for path in times:
                forward = use(path)
                ms, mhz, watts = sampled_clocks(lambda: do_bench(lambda: forward().backward(go), grad_to_none=leaves))
                times[path].append(ms)
                clocks[path].append((mhz, watts))
        for path in times:
            forward = use(path)
            timelines[path] = gpu_timeline(lambda: forward().backward(go), grad_to_none=leaves)
            out = forward()
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                out.backward(go)
                torch.cuda.synchronize()
            for t in leaves:
                t.grad = None
            # by the operator that launched each kernel (its self device time): which op a copy or a gather serves
            events = [(getattr(e, "self_device_time_total", 0) / 1e3, e.key) for e in prof.key_averages()
                      if e.key.startswith(("aten::", "flash_moe::"))]
            by_operator[path] = sorted(events, reverse=True)[:10]
    finally:
        ops.CONSTANTS.update(saved)
    print(f"  {name:22s} forward+backward by path (ms [SM MHz, W], {rounds} alternating rounds): "
          + "; ".join(f"{path} " + " / ".join(f"{ms:.3f} [{mhz}, {watts and round(watts)}]"
                                              for ms, (mhz, watts) in zip(v, clocks[path]))
                      for path, v in times.items())
          + "; medians " + ", ".join(f"{path} {statistics.median(v):.3f}" for path, v in times.items()))
    for path, line in timelines.items():
        print_timeline(f"{path} (L2 flush included)", line)
    for path, top in by_operator.items():
        print(f"    {path} backward, device time by operator (ms): " + "; ".join(f"{key} {ms:.3f}" for ms, key in top))
    del p, go, leaves
    free()
    return {"shape": name, **{f"{path}_fwd_bwd_ms": v for path, v in times.items()},
            **{f"{path}_clocks_mhz_w": v for path, v in clocks.items()},
            **{f"{path}_timeline": v for path, v in timelines.items()}}


def print_timeline(label, line):
    print(f"    {label} timeline per call: span {line['span_ms']:.3f} ms, busy {line['busy_ms']:.3f}, idle "
          f"{line['idle_ms']:.3f}, host {line['host_ms']:.3f} unprofiled; kernels (ms) "
          + "; ".join(f"{key} {ms:.3f}" for key, ms in line["kernels_ms"].items()))
    print("      runtime calls (ms): " + "; ".join(f"{key} {ms:.3f}" for key, ms in line["runtime_ms"].items()))
    print("      longest gaps: " + "; ".join(
        f"{g['ms']:.3f} ms after {g['after']} before {g['before']} (host late {g['cpu_late_ms']:.3f})"
        for g in line["gaps"]))


def bench_timelines(ops, name, T, E, k, dim, hidden):
    """GPU timelines of forward+backward through moe() (default mode; also on one stacked [W1; W3] tensor,
    transformers' gate_up_proj layout, and with deterministic=True: its fixed-order combines, which the default takes
    from top_k = SLOT_COMBINE_MIN_TOP_K on) and through the grouped-mm path: where each one's time goes in place
    (kernels, idle, host), the in-situ companion of --parts."""
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    p = problem(T, E, k, dim, hidden, grad=True)
    x, w1, w2, w3, ids, tw = p
    stacked = torch.cat([w1, w3], 1).detach().requires_grad_()
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    leaves = [x, w1, w2, w3, tw, stacked]
    row = {"shape": name}
    print(f"  {name}")
    for label, run in (("moe", lambda: ops.moe(*p)), ("moe [W1; W3]", lambda: ops.moe(x, stacked, w2, None, ids, tw)),
                       ("moe deterministic", lambda: ops.moe(*p, deterministic=True)),
                       ("grouped-mm", lambda: moe_grouped_mm(*p))):
        row[label] = gpu_timeline(lambda run=run: run().backward(go), top=12, grad_to_none=leaves)
        print_timeline(label, row[label])
    del p, x, w1, w2, w3, ids, tw, stacked, go, leaves
    free()
    return row


def bench_host(ops, name, T, E, k, dim, hidden, iters=20):
    """The host's side of moe()'s forward+backward: time per call (unprofiled, the GPU not waited for) and, under
    torch.profiler (CPU only), the operators with the most self CPU time per call: where a small T's launch-bound
    step spends its host time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    p = problem(T, E, k, dim, hidden, grad=True)
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    leaves = [p[i] for i in (0, 1, 2, 3, 5)]

    def call():
        for t in leaves:
            t.grad = None
        ops.moe(*p).backward(go)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    host_ms = (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            call()
    torch.cuda.synchronize()
    top = sorted(((e.self_cpu_time_total / 1e3 / iters, e.count // iters, e.key) for e in prof.key_averages()),
                 reverse=True)[:20]
    print(f"  {name:22s} host {host_ms:.3f} ms per forward+backward (unprofiled); self CPU ms per call [calls]: "
          + "; ".join(f"{key} {ms:.3f} [{n}]" for ms, n, key in top))
    del p, go, leaves
    free()
    return {"shape": name, "host_ms": host_ms, "top": [{"op": key, "ms": ms, "calls": n} for ms, n, key in top]}


def bench_expert_parallel(ops, name, T, E, k, dim, hidden, ranks, ceiling):
    """One rank of expert parallelism over ``ranks`` (experts [start, start + E / ranks) local; all T tokens routed
    over all E experts, as moe(expert_start=) takes them): forward+backward with the kernels' launch rules given the
    global expert count (moe's num_experts) against the local count (num_experts not passed: the rules' estimate
    of routed slots per local expert ``ranks`` times too high) and the grouped-mm path, in turns."""
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    if E % ranks:
        raise SystemExit(f"--expert-parallel {ranks}: {name}'s {E} experts do not split evenly over {ranks} ranks")
    local = E // ranks
    start = local * (ranks // 2)
    x, w1, w2, w3, _, tw = problem(T, local, k, dim, hidden, grad=True)
    ids = torch.rand(T, E, device="cuda").topk(k, -1).indices.to(torch.int32)
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    leaves = [x, w1, w2, w3, tw]
    times = interleaved({
        "global count": lambda: ops.moe(x, w1, w2, w3, ids, tw, expert_start=start, num_experts=E).backward(go),
        "local count": lambda: ops.moe(x, w1, w2, w3, ids, tw, expert_start=start).backward(go),
        "grouped-mm": lambda: moe_grouped_mm(x, w1, w2, w3, ids, tw, start).backward(go)}, grad_to_none=leaves)
    routed = ((ids >= start) & (ids < start + local)).sum().item()
    flops = 3 * forward_flops(routed, dim, hidden)
    print(f"  {name} EP{ranks} (experts [{start}, {start + local}), {routed} routed slots) fwd+bwd: global count "
          f"{times['global count']:.3f} ms ({flops / times['global count'] / 1e9:.0f} TFLOP/s), local count "
          f"{times['local count']:.3f} (x{times['local count'] / times['global count']:.3f}), grouped-mm "
          f"{times['grouped-mm']:.3f} (x{times['grouped-mm'] / times['global count']:.3f}); floor "
          f"{flops / ceiling * 1e3:.3f} ms", flush=True)
    del x, w1, w2, w3, tw, ids, go, leaves
    free()
    return {"shape": name, "ranks": ranks, "expert_start": start, "routed_slots": routed,
            **{f"{key.replace(' ', '_').replace('-', '_')}_fwd_bwd_ms": ms for key, ms in times.items()},
            "floor_ms": flops / ceiling * 1e3}


def forward_flops(slots, dim, hidden):
    """Model FLOPs of one forward over ``slots`` routed (token, expert) pairs: gate/up (2 hidden columns) and down."""
    return 2 * slots * dim * 2 * hidden + 2 * slots * hidden * dim


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


def bench_sonicmoe(ops, shapes, ceiling, warm_only=False):
    """SonicMoE (sonic-moe 0.1.2.post1 on the CuTe DSL: scripts/peer_wheels.sh) on each shape: the same x, weights and
    routing (its layout built once, outside the timing: w1|w3 as (2I, H, E) and w2 as (H, I, E) views of E-major
    memory, [gate; up] concatenated), forward, forward+backward and the backward alone against ours, same run, with
    its output's error against the grouped-mm path as a layout check, and both forward+backward timelines (its
    kernels beside ours); or the exact error that stopped it. Ours runs on
    the same tensors (leaves sharing their storage), each timing in turns with SonicMoE's (common.interleaved: under
    sustained load the clocks drop, which a fixed order charges to the later one). warm_only: only its first
    forward+backward per shape (which compiles its kernels into the persistent caches), timed as a whole."""
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    try:
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType
    except Exception as exc:  # noqa: BLE001: any import failure is the row's result
        print(f"sonicmoe: unavailable: {type(exc).__name__}: {exc}")
        return [{"peer": "sonicmoe", "error": f"{type(exc).__name__}: {exc}"}]
    rows = []
    for name, T, E, k, dim, hidden in shapes:
        flops = forward_flops(T * k, dim, hidden)
        x, w1, w2, w3, ids, tw = problem(T, E, k, dim, hidden)
        # [W1; W3] once, for both: SonicMoE's (2I, H, E) view and ours' stacked (E, 2I, H) form (at DeepSeek-V3 a
        # second copy of the gate/up weights overflows an 80 GiB card)
        w13_stacked = torch.cat([w1, w3], 1).detach()
        del w1, w3
        w13 = w13_stacked.permute(1, 2, 0).detach().requires_grad_()
        w2s = w2.permute(1, 2, 0).detach().requires_grad_()
        tokens = torch.arange(T, device="cuda", dtype=torch.int32).repeat_interleave(k)
        experts, scores = ids.reshape(-1).contiguous(), tw.reshape(-1).float().requires_grad_()
        xg = x.detach().requires_grad_()
        # ours on the same inputs: leaves sharing their storage (at DeepSeek-V3 the weights are 21 GiB and each
        # implementation's weight gradients as much again: a second problem, or both gradient sets kept, overflows
        # an 80 GiB card)
        mine = [t.detach().requires_grad_() for t in (x, w13_stacked, w2, tw)]
        ours_args = (*mine[:3], None, ids, mine[3])
        leaves = [xg, w13, w2s, scores]

        def sonic():
            return moe_general_routing_inputs(xg, scores, tokens, experts, w13, None, w2s, None, E,
                                              torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU, False,
                                              True)[0]

        def ours():
            return ops.moe(*ours_args)

        def fwd_bwd(run, others):
            def step():
                for t in others:  # the other one's gradients, freed before this one's are allocated
                    t.grad = None
                run().backward(go)
            return step

        def drop_grads():
            for t in (*leaves, *mine):
                t.grad = None
        row = {"peer": "sonicmoe", "shape": name}
        try:
            start = time.perf_counter()
            out = sonic()  # the first call compiles its kernels (minutes)
            if warm_only:
                out.backward(torch.randn_like(out))
                torch.cuda.synchronize()
                row["first_fwd_bwd_s"] = time.perf_counter() - start
                print(f"sonicmoe {name}: first forward+backward {row['first_fwd_bwd_s']:.0f} s", flush=True)
                del out
            else:
                with torch.no_grad():
                    ref = moe_grouped_mm(x, w13_stacked[:, :hidden].contiguous(), w2,
                                         w13_stacked[:, hidden:].contiguous(), ids, tw).float()
                row["rel_err_vs_grouped_mm"] = ((out.float() - ref).norm() / ref.norm()).item()
                del out, ref
                go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
                with torch.no_grad():
                    fwd = interleaved({"sonic": sonic, "ours": ours}, **LONG_TIMING)
                fwd_bwd_ms = interleaved({"sonic": fwd_bwd(sonic, mine), "ours": fwd_bwd(ours, leaves)},
                                         grad_to_none=leaves + mine, **LONG_TIMING)
                drop_grads()
                row.update(fwd_ms=fwd["sonic"], ours_fwd_ms=fwd["ours"], fwd_bwd_ms=fwd_bwd_ms["sonic"],
                           ours_fwd_bwd_ms=fwd_bwd_ms["ours"])
                # the backward alone, after an untimed forward each call, as the main rows time ours
                try:
                    bwd = interleaved({"sonic": sonic, "ours": ours}, **LONG_TIMING,
                                      timer=functools.partial(backward_ms, go=go, grad_to_none=leaves + mine))
                    row.update(bwd_ms=bwd["sonic"], ours_bwd_ms=bwd["ours"])
                except Exception as exc:  # noqa: BLE001: the other timings of the row stand
                    row["bwd_error"] = f"{type(exc).__name__}: {exc}"
                drop_grads()
                row["peak_gib"] = peak_extra(lambda: sonic().backward(go)) / 2**30
                drop_grads()
                row["ours_peak_gib"] = peak_extra(lambda: ours().backward(go)) / 2**30
                row.update(fwd_tflops=flops / row["fwd_ms"] / 1e9, fwd_ratio=row["fwd_ms"] / row["ours_fwd_ms"],
                           fwd_bwd_ratio=row["fwd_bwd_ms"] / row["ours_fwd_bwd_ms"], ceiling_tflops=ceiling / 1e12)
                print(f"sonicmoe {name:24s} fwd {row['fwd_ms']:7.3f} ms ({row['fwd_tflops']:5.0f} TFLOP/s) vs ours "
                      f"{row['ours_fwd_ms']:7.3f} (sonic / ours x{row['fwd_ratio']:.2f}) | fwd+bwd "
                      f"{row['fwd_bwd_ms']:7.3f} vs {row['ours_fwd_bwd_ms']:7.3f} ms (x{row['fwd_bwd_ratio']:.2f})"
                      " | bwd "
                      + (row["bwd_error"] if "bwd_error" in row else
                         f"{row['bwd_ms']:7.3f} vs {row['ours_bwd_ms']:7.3f} ms")
                      + f" | peak {row['peak_gib']:.2f} vs {row['ours_peak_gib']:.2f} GiB"
                      f" | output vs grouped-mm rel err {row['rel_err_vs_grouped_mm']:.2e}", flush=True)
                # where each one's time goes, kernel by kernel (the same tensors, one after the other)
                for label, run, others in (("sonicmoe", sonic, mine), ("moe", ours, leaves)):
                    row[f"{label}_timeline"] = gpu_timeline(fwd_bwd(run, others), top=16, grad_to_none=leaves + mine)
                    print_timeline(label, row[f"{label}_timeline"])
        except Exception as exc:  # noqa: BLE001: its exact error is the row's result
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"sonicmoe {name}: {row['error']}", flush=True)
        rows.append(row)
        del x, w13_stacked, w2, ids, tw, w13, w2s, tokens, experts, scores, xg, mine, ours_args, leaves
        free()
    return rows


def bench_liger(ops, shapes, ceiling, warm_only=False, with_lck=True, lck_probed=False):
    """Liger's MoE peers (bench/peer_moe.py: its Triton fused MoE and, where it loads, the liger-cute-kernels MoE)
    against ours and the grouped-mm path at each shape, on the same x, weights and routing (leaves sharing storage: ours
    and Liger's Triton on one stacked [W1; W3], the grouped-mm path and lck on w1 and w3 apart): each one's
    first forward and first backward in seconds (Liger's Triton autotunes there, per (dim, hidden) and per (dim,
    top_k); reported apart, not in the timings), then forward, forward+backward and the backward alone in turns
    (common.interleaved; forward+backward over LONG_TIMING's rounds), peak memory of one forward+backward, the output's
    and dx's relative error against the grouped-mm path's, and the forward+backward timelines of Liger's and ours.
    Any peer's failure is its row's result (one line), never the benchmark's. warm_only: only Liger's Triton first
    forward+backward at a small problem with the shape's dim, hidden and top_k, which compiles every autotuning
    config into Triton's cache (gpu_check.sh liger-warm: in parallel background processes, one per shape).
    lck_probed: the lck probe already passed on this machine (gpu_check.sh's liger phase), so it is not run again."""
    import peer_moe
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    try:
        liger = peer_moe.liger_triton()
    except Exception as exc:  # noqa: BLE001: any import failure is the row's result
        print(f"{peer_moe.LIGER_TRITON}: skipped: {type(exc).__name__}: {exc}")
        return [{"peer": peer_moe.LIGER_TRITON, "error": f"{type(exc).__name__}: {exc}"}]
    autotune = os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1").lower() not in ("0", "false", "no")
    if warm_only:
        return [liger_warm(liger, *shape) for shape in shapes]
    lck, lck_reason = None, "--no-lck"
    if with_lck:
        lck_reason = None if lck_probed else peer_moe.probe_lck()
        if lck_reason is None:
            try:
                lck = peer_moe.LckSession()
            except Exception as exc:  # noqa: BLE001: the probe passed in a child; this process may still fail
                lck_reason = f"{type(exc).__name__}: {exc}"
    if lck is None:
        print(f"{peer_moe.LIGER_CUTE}: skipped: {lck_reason}", flush=True)
    rows = []
    for name, T, E, k, dim, hidden in shapes:
        row = {"shape": name, "T": T, "E": E, "top_k": k, "dim": dim, "hidden": hidden, "liger_autotune": autotune,
               "lck": "timed" if lck else f"skipped: {lck_reason}", "ceiling_tflops": ceiling / 1e12}
        try:
            liger_shape(ops, liger, lck, moe_grouped_mm, row)
        except Exception as exc:  # noqa: BLE001: its exact error is the row's result
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"liger {name}: {row['error']}", flush=True)
        rows.append(row)
        free()
    return rows


def liger_warm(liger, name, T, E, k, dim, hidden):
    """Liger's Triton first forward+backward at T 2048, min(E, 16) experts with the shape's dim, hidden and top_k:
    its autotuning keys are (dim, hidden) and (dim, top_k), so this compiles what the shape's first call will load."""
    import peer_moe

    x, w1, w2, w3, ids, tw = problem(2048, min(E, 16), k, dim, hidden)
    w13 = peer_moe.stack_gate_up(w1, w3).requires_grad_()
    start = time.perf_counter()
    try:
        out = liger(*peer_moe.liger_triton_args(x.requires_grad_(), w13, w2.requires_grad_(), ids, tw))
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001: the warm-up's result
        print(f"liger-warm {name}: {type(exc).__name__}: {exc}", flush=True)
        return {"shape": name, "error": f"{type(exc).__name__}: {exc}"}
    seconds = time.perf_counter() - start
    print(f"liger-warm {name}: first forward+backward (compiling and autotuning) {seconds:.0f} s", flush=True)
    del x, w1, w2, w3, w13, ids, tw, out
    free()
    return {"shape": name, "first_fwd_bwd_s": seconds}


def liger_shape(ops, liger, lck, moe_grouped_mm, row):
    """bench_liger's measurements at one shape, into ``row``."""
    import peer_moe

    T, E, k, dim, hidden = (row[key] for key in ("T", "E", "top_k", "dim", "hidden"))
    flops = forward_flops(T * k, dim, hidden)
    x, w1, w2, w3, ids, tw = problem(T, E, k, dim, hidden)
    w13 = peer_moe.stack_gate_up(w1, w3)
    go = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)

    def leaves(*tensors):
        return [t.detach().requires_grad_() for t in tensors]
    mine, theirs, gmm = leaves(x, w13, w2, tw), leaves(x, w13, w2, tw), leaves(x, w1, w2, w3, tw)
    impls = {"ours": lambda: ops.moe(mine[0], mine[1], mine[2], None, ids, mine[3]),
             peer_moe.LIGER_TRITON: lambda: liger(*peer_moe.liger_triton_args(theirs[0], theirs[1], theirs[2], ids,
                                                                              theirs[3])),
             "grouped-mm": lambda: moe_grouped_mm(gmm[0], gmm[1], gmm[2], gmm[3], ids, gmm[4])}
    every_leaf, x_leaf = mine + theirs + gmm, {"ours": mine[0], peer_moe.LIGER_TRITON: theirs[0], "grouped-mm": gmm[0]}
    if lck is not None:
        lck.configure_for(T, E, k, dim)
        cute = leaves(x, w1, w2, w3, tw.bfloat16())
        impls[peer_moe.LIGER_CUTE] = lambda: lck(*peer_moe.lck_args(*cute[:4], ids, cute[4]))
        every_leaf, x_leaf[peer_moe.LIGER_CUTE] = every_leaf + cute, cute[0]

    def drop_grads():
        for t in every_leaf:
            t.grad = None

    def fwd_bwd(run):
        return lambda: run().backward(go)

    # first calls, untimed by do_bench: Liger's Triton autotunes here (forward kernels, then backward ones)
    dx = {}
    for label, run in impls.items():
        drop_grads()
        start = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        row[f"{label}_first_fwd_s"] = time.perf_counter() - start
        start = time.perf_counter()
        out.backward(go)
        torch.cuda.synchronize()
        row[f"{label}_first_bwd_s"] = time.perf_counter() - start
        dx[label] = x_leaf[label].grad.float()
        del out
    drop_grads()
    with torch.no_grad():
        outs = {label: run().float() for label, run in impls.items()}
    for label in impls:
        row[f"{label}_rel_err_vs_grouped_mm"] = ((outs[label] - outs["grouped-mm"]).norm()
                                                 / outs["grouped-mm"].norm()).item()
        row[f"{label}_dx_rel_err_vs_grouped_mm"] = ((dx[label] - dx["grouped-mm"]).norm()
                                                    / dx["grouped-mm"].norm()).item()
    del outs, dx
    with torch.no_grad():
        fwd = interleaved(impls)
    fb = interleaved({label: fwd_bwd(run) for label, run in impls.items()}, grad_to_none=every_leaf, **LONG_TIMING)
    drop_grads()
    bwd = interleaved(impls, timer=functools.partial(backward_ms, go=go, grad_to_none=every_leaf))
    drop_grads()
    for label, run in impls.items():
        row[f"{label}_fwd_ms"], row[f"{label}_fwd_bwd_ms"], row[f"{label}_bwd_ms"] = fwd[label], fb[label], bwd[label]
        row[f"{label}_fwd_bwd_tflops"] = 3 * flops / fb[label] / 1e9
        row[f"{label}_peak_gib"] = peak_extra(fwd_bwd(run)) / 2**30
        drop_grads()
    print(f"liger {row['shape']:22s} (ms; forward+backward TFLOP/s; peak GiB; output / dx rel. err. vs grouped-mm; "
          "first forward / backward s)", flush=True)
    for label in impls:
        print(f"  {label:12s} fwd {row[label + '_fwd_ms']:8.3f} | fwd+bwd {row[label + '_fwd_bwd_ms']:8.3f} "
              f"({row[label + '_fwd_bwd_tflops']:4.0f}) | bwd {row[label + '_bwd_ms']:8.3f} | peak "
              f"{row[label + '_peak_gib']:6.2f} | err {row[label + '_rel_err_vs_grouped_mm']:.1e} / "
              f"{row[label + '_dx_rel_err_vs_grouped_mm']:.1e} | first {row[label + '_first_fwd_s']:.1f} / "
              f"{row[label + '_first_bwd_s']:.1f}", flush=True)
    for label in impls:
        if label != "ours":
            print(f"  {label} / ours: fwd x{row[label + '_fwd_ms'] / row['ours_fwd_ms']:.2f}, fwd+bwd "
                  f"x{row[label + '_fwd_bwd_ms'] / row['ours_fwd_bwd_ms']:.2f}, bwd "
                  f"x{row[label + '_bwd_ms'] / row['ours_bwd_ms']:.2f} (above 1: ours faster)", flush=True)
    # where each one's time goes, kernel by kernel (the same tensors, one after the other)
    for label in [name for name in impls if name != "grouped-mm"]:
        row[f"{label}_timeline"] = gpu_timeline(fwd_bwd(impls[label]), top=16, grad_to_none=every_leaf)
        print_timeline(label, row[f"{label}_timeline"])
    drop_grads()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="the three main shapes, forward only at T=65536")
    parser.add_argument("--mxfp8-only", action="store_true", help="only the mxfp8 rows (and both ceilings)")
    parser.add_argument("--no-mxfp8", action="store_true", help="skip the mxfp8 rows")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    parser.add_argument("--parts", action="store_true",
                        help="only each piece of the backward alone, beside what it replaced")
    parser.add_argument("--paths", default=None, metavar="NAME,NAME",
                        help=f"only forward+backward through each of these paths ({', '.join([*PATHS, PEER_PATH])}), "
                             "and their kernels")
    parser.add_argument("--rounds", type=int, default=3, help="--paths' alternating rounds (default 3)")
    parser.add_argument("--timeline", action="store_true",
                        help="only GPU timelines of forward+backward, ours and the grouped-mm path's")
    parser.add_argument("--host", action="store_true",
                        help="only the host's time per forward+backward and the operators that spend it")
    parser.add_argument("--sonicmoe", action="store_true",
                        help="only SonicMoE against ours on the shapes (its first call compiles for minutes)")
    parser.add_argument("--expert-parallel", type=int, default=None, metavar="RANKS",
                        help="only one rank of expert parallelism over RANKS: the launch rules with the global "
                             "expert count against the local one, and the grouped-mm path")
    parser.add_argument("--sonicmoe-warm", action="store_true",
                        help="only SonicMoE's first forward+backward per shape (fills its compile caches)")
    parser.add_argument("--liger", action="store_true",
                        help="only Liger's MoE peers (Triton; liger-cute-kernels where it loads) against ours and the "
                             "grouped-mm path (Liger's Triton autotunes on its first call per shape)")
    parser.add_argument("--liger-warm", action="store_true",
                        help="only Liger's Triton first call per shape at a small problem (fills Triton's cache)")
    parser.add_argument("--no-lck", action="store_true", help="--liger without the liger-cute-kernels MoE")
    parser.add_argument("--lck-probed", action="store_true",
                        help="--liger: the lck probe (bench/peer_moe.py --probe-lck) passed on this machine: not again")
    args = parser.parse_args()
    unknown = set(args.paths.split(",") if args.paths else ()) - {*PATHS, PEER_PATH}
    if unknown:
        parser.error(f"--paths: unknown {', '.join(sorted(unknown))}; known: {', '.join([*PATHS, PEER_PATH])}")
    import prime_kernels
    from prime_kernels_flash_moe.reference import moe_grouped_mm

    ops = prime_kernels.load("flash_moe")
    ceiling = matmul_ceiling()
    print(f"bf16 matmul ceiling 8192^3: {ceiling / 1e12:.0f} TFLOP/s")
    only_peers = args.sonicmoe or args.sonicmoe_warm or args.liger or args.liger_warm
    fp8_peak = None if args.no_mxfp8 or only_peers or args.expert_parallel else fp8_ceiling()
    if fp8_peak is not None:
        print(f"fp8 (e4m3 torch._scaled_mm) ceiling 8192^3: {fp8_peak / 1e12:.0f} TFLOP/s")
    summary = []
    shapes = [] if args.mxfp8_only else SHAPES[:3] if args.quick else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    if args.sonicmoe or args.sonicmoe_warm:
        rows = bench_sonicmoe(ops, shapes, ceiling, warm_only=args.sonicmoe_warm)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ceiling_tflops": ceiling / 1e12, "sonicmoe": rows}, f, indent=2)
        return
    if args.liger or args.liger_warm:
        rows = bench_liger(ops, shapes, ceiling, warm_only=args.liger_warm, with_lck=not args.no_lck,
                           lck_probed=args.lck_probed)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ceiling_tflops": ceiling / 1e12, "liger": rows}, f, indent=2)
        return
    ep = functools.partial(bench_expert_parallel, ranks=args.expert_parallel, ceiling=ceiling)
    parts = functools.partial(bench_backward_parts, ceiling=ceiling)
    paths = args.paths and functools.partial(bench_paths, paths=args.paths.split(","), rounds=args.rounds)
    for flag, bench in (("parts", parts), ("paths", paths), ("timeline", bench_timelines),
                        ("host", bench_host), ("expert_parallel", ep)):
        if getattr(args, flag):
            rows = [bench(ops, *shape) for shape in shapes]
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"ceiling_tflops": ceiling / 1e12, flag: rows}, f, indent=2)
            return
    mxfp8_rows = [] if args.no_mxfp8 else bench_mxfp8(ops, fp8_peak, ceiling)
    for name, T, E, k, dim, hidden in shapes:
        flops = forward_flops(T * k, dim, hidden)
        row = {"shape": name, "T": T, "E": E, "top_k": k, "dim": dim, "hidden": hidden}
        with torch.no_grad():
            p = problem(T, E, k, dim, hidden)
            s, e, n = ops.moe_align(p[4], E)
            out = torch.empty_like(p[0])
            w = torch.cat([p[1], p[3]], 1)
            # all four in turns: timed one after the other, the later ones ran at lower clocks (session 24, Mixtral:
            # the fused op, the same GEMMs as moe() without its routing, 6.6 % slower than moe() itself)
            fwd = interleaved({"ours": lambda: ops.moe(*p), "peer": lambda: moe_grouped_mm(*p),
                               "det": lambda: ops.moe(*p, deterministic=True),
                               "fused": lambda: ops.fused_moe_bf16(p[0], w, p[2], s, e, n, p[5], out, k)})
            ours, peer, det, fused = fwd["ours"], fwd["peer"], fwd["det"], fwd["fused"]
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
            fb_all = interleaved({"ours": lambda: ops.moe(*p).backward(go),
                                  "recompute": lambda: ops.moe(*p, recompute_gate_up=True).backward(go),
                                  "det": lambda: ops.moe(*p, deterministic=True).backward(go),
                                  "peer": lambda: moe_grouped_mm(*p).backward(go)}, grad_to_none=leaves)
            fb, fb_recompute, fb_det, fb_peer = fb_all["ours"], fb_all["recompute"], fb_all["det"], fb_all["peer"]
            bwd_all = interleaved({"ours": lambda: ops.moe(*p), "peer": lambda: moe_grouped_mm(*p)},
                                  timer=functools.partial(backward_ms, go=go, grad_to_none=leaves))
            bwd, bwd_peer = bwd_all["ours"], bwd_all["peer"]
            # peak memory of one forward+backward above the inputs (activations saved for backward, temporaries and
            # the gradients, which start as None each time)
            mem = {}
            for label, fn in (("ours", ops.moe), ("recompute", lambda *a: ops.moe(*a, recompute_gate_up=True)),
                              ("peer", moe_grouped_mm)):
                for t in leaves:
                    t.grad = None
                mem[label] = peak_extra(lambda: fn(*p).backward(go)) / 2**30
            for t in leaves:
                t.grad = None
            row.update(peak_gib=mem["ours"], peak_recompute_gib=mem["recompute"], peer_peak_gib=mem["peer"])
            row.update(fwd_bwd_ms=fb, fwd_bwd_recompute_ms=fb_recompute, fwd_bwd_det_ms=fb_det, peer_fwd_bwd_ms=fb_peer,
                       fwd_bwd_speedup=fb_peer / fb, fwd_bwd_recompute_speedup=fb_peer / fb_recompute,
                       fwd_bwd_tflops=3 * flops / fb / 1e9,
                       bwd_ms=bwd, peer_bwd_ms=bwd_peer, bwd_speedup=bwd_peer / bwd, bwd_tflops=2 * flops / bwd / 1e9,
                       peer_bwd_tflops=2 * flops / bwd_peer / 1e9, floor_bwd_ms=2 * flops / ceiling * 1e3)
            del p, go, leaves
            free()
        row["ceiling_tflops"] = ceiling / 1e12
        summary.append(row)
        print(f"{name:24s} fwd {ours:7.3f} ms ({row['fwd_tflops']:5.0f} TFLOP/s, det {det:7.3f}, fused op {fused:7.3f},"
              f" align {align:6.3f}) | grouped-mm {peer:7.3f} ms ({row['peer_fwd_tflops']:5.0f}) | x{row['fwd_speedup']:.2f}"
              f" (target {row['target']})" + (f" | fwd+bwd {row['fwd_bwd_ms']:7.3f} vs {row['peer_fwd_bwd_ms']:7.3f} ms"
                                               f" x{row['fwd_bwd_speedup']:.2f}; recompute g|u "
                                               f"{row['fwd_bwd_recompute_ms']:7.3f}"
                                               f" x{row['fwd_bwd_recompute_speedup']:.2f}; deterministic "
                                               f"{row['fwd_bwd_det_ms']:7.3f} | bwd {row['bwd_ms']:7.3f} "
                                               f"({row['bwd_tflops']:5.0f} TFLOP/s) vs {row['peer_bwd_ms']:7.3f} ms "
                                               f"({row['peer_bwd_tflops']:5.0f}) x{row['bwd_speedup']:.2f}, floor "
                                               f"{row['floor_bwd_ms']:.3f} ms at the {ceiling / 1e12:.0f} TFLOP/s "
                                               f"ceiling | peak fwd+bwd memory {row['peak_gib']:.2f} GiB (recompute g|u "
                                               f"{row['peak_recompute_gib']:.2f}) vs {row['peer_peak_gib']:.2f}"
                                               if "fwd_bwd_ms" in row else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling_tflops": ceiling / 1e12, "fp8_ceiling_tflops": fp8_peak and fp8_peak / 1e12,
                       "summary": summary,
                       "mxfp8": mxfp8_rows}, f, indent=2)


if __name__ == "__main__":
    main()
