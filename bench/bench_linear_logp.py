"""GPU benchmark of linear_logp (never a test): logp + entropy straight from hidden states and the lm_head weight,
forward and forward+backward, peak memory above the inputs, against the bf16 matmul ceiling measured in the same run.

    python bench/bench_linear_logp.py [--json PATH] [--quick]
    python bench/bench_linear_logp.py --invariant-ab [--json PATH]
    python bench/bench_linear_logp.py --softcap-ab [--json PATH]

--invariant-ab: default vs batch_invariant=True at the issue-25 shapes (N = 8192 and 1024, H = 4096, V = 151936; N = 5),
forward and forward+backward, alternating rounds in one run, medians, ratios invariant / default and the floors; plus
whether 5 probe tokens keep their bits (logp, entropy, grad_hidden rows) between a batch of 5 and the benchmark batch
in each mode (informational; the tests assert the invariant mode).

--softcap-ab: the logit transforms' cost (issue 24: a softcap <= 5 %) at N = 8192, H = 4096, V = 151936 bf16, T = 0.7:
no transform, softcap=30.0 (Gemma 2/3), logit_scale=0.0625 alone (Cohere; folded into the temperature, expected free)
and both, forward and forward+backward, alternating rounds in one run, medians, ratios to no transform and the floors.

Timing: triton.testing.do_bench median. Ceiling: an 8192^3 bf16 torch.mm. Floors: 2NHV / ceiling (forward),
8NHV / ceiling (forward + backward: recompute + two gradient GEMMs). Peers where importable (try/except):
naive (h @ W.T + fp32 log_softmax), chunked PyTorch (8192-wide vocab chunks, online lse + entropy, checkpointed),
Liger LigerFusedLinearCrossEntropyLoss(reduction="none"), Liger's SM90 CuTe-DSL fused scaled cross-entropy (the
issue's peer: per-token NLL + bf16 entropy, scalar temperature; needs nvidia-cutlass-dsl), cut-cross-entropy
linear_cross_entropy(reduction="none").
"""
from __future__ import annotations

import argparse
import json

import torch
from common import do_bench, free, matmul_ceiling, peak_extra

MAIN = (8192, 4096, 151936)
SHAPES = [MAIN, (8192, 2048, 151936), (8192, 5120, 151936), (8192, 4096, 32000), (2048, 4096, 151936),
          (32768, 4096, 151936)]
T = 0.7


def naive(h, w, y):
    ls = torch.log_softmax((h @ w.t()).float() / T, dim=-1)
    return ls.gather(1, y[:, None]).squeeze(1), -(ls.exp() * ls).sum(-1)


def chunked(h, w, y, chunk=8192):
    from torch.utils.checkpoint import checkpoint

    def part(h, wc, local, inside):
        z = (h @ wc.t()).float() / T
        lse = torch.logsumexp(z, -1)
        p = torch.exp(z - lse[:, None])
        zy = torch.where(inside, z.gather(1, local[:, None]).squeeze(1), torch.zeros_like(lse))
        return lse, (p * z).sum(-1), zy

    lses, spzs, zy = [], [], 0
    for v0 in range(0, w.shape[0], chunk):
        v1 = min(w.shape[0], v0 + chunk)
        inside = (y >= v0) & (y < v1)
        local = torch.where(inside, y - v0, torch.zeros_like(y))
        lse, spz, z = checkpoint(part, h, w[v0:v1], local, inside, use_reentrant=False)
        lses.append(lse)
        spzs.append(spz)
        zy = zy + z
    lse_c = torch.stack(lses)
    lse = torch.logsumexp(lse_c, 0)
    spz = (torch.exp(lse_c - lse) * torch.stack(spzs)).sum(0)
    return zy - lse, lse - spz


def make_peers():
    peers = {"naive": lambda h, w, y: naive(h, w, y), "chunked PyTorch": lambda h, w, y: chunked(h, w, y)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="none")
        peers["Liger FLCE (no entropy, T=1)"] = lambda h, w, y: (liger(w, h, y),)
    except Exception as e:  # noqa: BLE001
        print(f"Liger not available: {type(e).__name__}")
    try:
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import \
            LigerFusedScaledCrossEntropySM90Function as LigerSM90

        peers["Liger SM90 CuTe-DSL (bf16 entropy)"] = lambda h, w, y: LigerSM90.apply(h, w, y, T, -100, 1, True)
    except Exception as e:  # noqa: BLE001
        print(f"Liger SM90 CuTe-DSL not available: {type(e).__name__}: {e}")
    try:
        from cut_cross_entropy import linear_cross_entropy

        peers["CCE (no entropy, T=1)"] = lambda h, w, y: (linear_cross_entropy(h, w, y, reduction="none"),)
    except Exception as e:  # noqa: BLE001
        print(f"cut-cross-entropy not available: {type(e).__name__}")
    return peers


def measure(fn, h, w, y, backward: bool):
    def run():
        out = fn(h, w, y)
        if backward:
            loss = sum(o.float().sum() for o in out if o is not None)
            loss.backward()
            h.grad = w.grad = None
        return out

    try:
        ms = do_bench(run, warmup=100, rep=500)  # tens of ms per call: about ten timed repeats
        mem = peak_extra(run)
        return ms, mem
    except torch.OutOfMemoryError:
        free()
        return None, None


INVARIANT_AB_SHAPES = [(8192, 4096, 151936), (1024, 4096, 151936), (5, 4096, 151936)]
AB_ROUNDS = 2


def _probe_bits_kept(h, w, y, invariant):
    """Whether the first 5 tokens' logp, entropy and grad_hidden rows have the same bits alone as inside the batch."""
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

    def run(hs, ys):
        hg = hs.detach().clone().requires_grad_()
        lp, ent = linear_logp_entropy(hg, w.detach(), ys, T, batch_invariant=invariant)
        (lp.sum() + ent.sum()).backward()
        return lp[:5], ent[:5], hg.grad[:5]

    return all(torch.equal(a, b) for a, b in zip(run(h[:5], y[:5]), run(h, y)))


def invariant_ab(ceiling, results):
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

    print("| N | H | V | mode | fwd ms | fwd/floor | fwd+bwd ms | fwd+bwd/floor | probe bits kept (N=5 vs N) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, hs, v in INVARIANT_AB_SHAPES:
        free()
        h = (torch.randn(n, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
        w = (torch.randn(v, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        flops = 2 * n * hs * v
        floor_f, floor_fb = flops / ceiling * 1e3, 4 * flops / ceiling * 1e3
        times = {m: {"fwd": [], "fb": []} for m in (False, True)}
        for _ in range(AB_ROUNDS):
            for inv in (False, True):
                fn = lambda h_, w_, y_, inv=inv: linear_logp_entropy(h_, w_, y_, T, batch_invariant=inv)  # noqa: E731
                with torch.no_grad():
                    f_ms, _ = measure(fn, h.detach(), w.detach(), y, False)
                fb_ms, _ = measure(fn, h, w, y, True)
                times[inv]["fwd"].append(f_ms)
                times[inv]["fb"].append(fb_ms)
        row = {"N": n, "H": hs, "V": v, "floor_fwd_ms": floor_f, "floor_fwd_bwd_ms": floor_fb}
        for inv in (False, True):
            key = "invariant" if inv else "default"
            f, b = min(times[inv]["fwd"]), min(times[inv]["fb"])  # of the rounds' medians: the least disturbed
            kept = _probe_bits_kept(h, w, y, inv)
            row[key] = {"fwd_ms": f, "fwd_bwd_ms": b, "fwd_rounds": times[inv]["fwd"],
                        "fwd_bwd_rounds": times[inv]["fb"], "probe_bits_kept": kept}
            print(f"| {n} | {hs} | {v} | {key} | {f:.3f} | {f / floor_f:.3f} | {b:.3f} | {b / floor_fb:.3f} | {kept} |",
                  flush=True)
        row["ratio_fwd"] = row["invariant"]["fwd_ms"] / row["default"]["fwd_ms"]
        row["ratio_fwd_bwd"] = row["invariant"]["fwd_bwd_ms"] / row["default"]["fwd_bwd_ms"]
        print(f"| {n} | {hs} | {v} | invariant / default | x{row['ratio_fwd']:.3f} | | "
              f"x{row['ratio_fwd_bwd']:.3f} | | |", flush=True)
        results.append(row)
        del h, w, y


TRANSFORM_AB_SHAPE = MAIN
TRANSFORM_VARIANTS = {"none": {}, "softcap=30": {"softcap": 30.0}, "logit_scale=0.0625": {"logit_scale": 0.0625},
                      "softcap=30 + logit_scale=0.0625": {"softcap": 30.0, "logit_scale": 0.0625}}
TRANSFORM_AB_ROUNDS = 3


def softcap_ab(ceiling, results):
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

    n, hs, v = TRANSFORM_AB_SHAPE
    h = (torch.randn(n, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
    w = (torch.randn(v, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    flops = 2 * n * hs * v
    floor_f, floor_fb = flops / ceiling * 1e3, 4 * flops / ceiling * 1e3
    times = {name: {"fwd": [], "fb": []} for name in TRANSFORM_VARIANTS}
    for _ in range(TRANSFORM_AB_ROUNDS):
        for name, tf in TRANSFORM_VARIANTS.items():
            fn = lambda h_, w_, y_, tf=tf: linear_logp_entropy(h_, w_, y_, T, **tf)  # noqa: E731
            with torch.no_grad():
                f_ms, _ = measure(fn, h.detach(), w.detach(), y, False)
            fb_ms, _ = measure(fn, h, w, y, True)
            times[name]["fwd"].append(f_ms)
            times[name]["fb"].append(fb_ms)
    print(f"N={n} H={hs} V={v} bf16 T={T}; floors fwd {floor_f:.3f} ms, fwd+bwd {floor_fb:.3f} ms "
          f"({TRANSFORM_AB_ROUNDS} alternating rounds, min of the rounds' medians)")
    print("| transform | fwd ms | fwd / none | fwd / floor | fwd+bwd ms | fwd+bwd / none | fwd+bwd / floor |")
    print("|---|---|---|---|---|---|---|")
    base_f, base_fb = min(times["none"]["fwd"]), min(times["none"]["fb"])
    for name in TRANSFORM_VARIANTS:
        f, b = min(times[name]["fwd"]), min(times[name]["fb"])
        print(f"| {name} | {f:.3f} | x{f / base_f:.4f} | {f / floor_f:.3f} | {b:.3f} | x{b / base_fb:.4f} | "
              f"{b / floor_fb:.3f} |", flush=True)
        results.append({"transform": name, "N": n, "H": hs, "V": v, "fwd_ms": f, "fwd_bwd_ms": b,
                        "ratio_fwd": f / base_f, "ratio_fwd_bwd": b / base_fb, "fwd_rounds": times[name]["fwd"],
                        "fwd_bwd_rounds": times[name]["fb"], "floor_fwd_ms": floor_f, "floor_fwd_bwd_ms": floor_fb})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--quick", action="store_true", help="main shape only, no peers")
    ap.add_argument("--invariant-ab", action="store_true", help="default vs batch_invariant=True (issue 25), only")
    ap.add_argument("--softcap-ab", action="store_true", help="cost of the logit transforms (issue 24), only")
    args = ap.parse_args()
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

    ceiling = matmul_ceiling()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s (8192^3)")
    for flag, key, run in ((args.invariant_ab, "invariant_ab", invariant_ab), (args.softcap_ab, "softcap_ab", softcap_ab)):
        if not flag:
            continue
        results = []
        run(ceiling, results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceiling_flops": ceiling,
                           key: results}, f, indent=2)
        return
    results, summary = [], [f"ceiling {ceiling / 1e12:.0f} TFLOP/s"]
    ours = lambda h, w, y: linear_logp_entropy(h, w, y, T)  # noqa: E731
    peers = {} if args.quick else make_peers()
    for shape in [MAIN] if args.quick else SHAPES:
        n, hs, v = shape
        free()
        h = (torch.randn(n, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
        w = (torch.randn(v, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        flops = 2 * n * hs * v
        floor_f, floor_fb = flops / ceiling * 1e3, 4 * flops / ceiling * 1e3
        entries = {"ours": ours, **(peers if shape == MAIN else {})}
        for name, fn in entries.items():
            with torch.no_grad():
                hf, wf = h.detach(), w.detach()
                f_ms, f_mem = measure(fn, hf, wf, y, False)
            fb_ms, fb_mem = measure(fn, h, w, y, True)
            if fb_mem is not None:  # beyond inputs and gradients: the grads themselves are outputs
                fb_mem -= 2 * (h.numel() + w.numel())
            row = {"impl": name, "N": n, "H": hs, "V": v, "fwd_ms": f_ms, "fwd_bwd_ms": fb_ms, "fwd_peak_extra": f_mem,
                   "fwd_bwd_peak_extra": fb_mem, "floor_fwd_ms": floor_f, "floor_fwd_bwd_ms": floor_fb}
            results.append(row)
            fmt = lambda ms, fl: "OOM" if ms is None else f"{ms:7.2f} ms ({fl / ms * 1e-9:5.0f} TFLOP/s)"  # noqa: E731
            line = (f"{name:28s} N={n:5d} H={hs} V={v}: fwd {fmt(f_ms, flops)} floor {floor_f:.2f}; fwd+bwd "
                    f"{fmt(fb_ms, 4 * flops)} floor {floor_fb:.2f}; peak extra fwd "
                    f"{(f_mem or 0) / 2**30:.2f} GiB, fwd+bwd {(fb_mem or 0) / 2**30:.2f} GiB")
            print(line)
            if name == "ours" or shape == MAIN:
                summary.append(line)
        del h, w, y
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceiling_flops": ceiling,
                       "results": results, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
