"""GPU benchmark of linear_logp (never a test): logp + entropy straight from hidden states and the lm_head weight,
forward and forward+backward, peak memory above the inputs, against the bf16 matmul ceiling measured in the same run.

    python bench/bench_linear_logp.py [--json PATH] [--quick]
    python bench/bench_linear_logp.py --invariant-ab [--json PATH]
    python bench/bench_linear_logp.py --softcap-ab [--json PATH]
    python bench/bench_linear_logp.py --liger [--json PATH]   (peer wheels: scripts/peer_wheels.sh liger)

--invariant-ab: default vs batch_invariant=True at the issue-25 shapes (N = 8192 and 1024, H = 4096, V = 151936; N = 5),
forward and forward+backward, alternating rounds in one run, medians, ratios invariant / default and the floors; plus
whether 5 probe tokens keep their bits (logp, entropy, grad_hidden rows) between a batch of 5 and the benchmark batch
in each mode (informational; the tests assert the invariant mode).

--liger: issue 62's rows, Liger's SM90 lm-head kernels against ours (liger_peers; bench/peer_logp.py says what each
computes): at the benchmark's shape, that shape with V rounded up to 152064 (FLCE SM90 takes V in multiples of 256) and
Liger's published M 4096, H 4096, V 128256.

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
import peer_logp
from common import do_bench, free, gpu_timeline, interleaved, matmul_ceiling, peak_extra

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


def liger_shapes():
    """The benchmark's shape, the same with V rounded up to FLCE's multiple of 256 (FLCE SM90 rejects 151936), and
    Liger's published one."""
    n, hs, v = MAIN
    rounded = -(-v // peer_logp.FLCE_TILE_V) * peer_logp.FLCE_TILE_V
    return [MAIN, (n, hs, rounded), peer_logp.LIGER_PUBLISHED]


def liger_peers(ceiling, results):
    """Issue 62: Liger's SM90 lm-head kernels (bench/peer_logp.py) against ours at liger_shapes(), in two groups timed
    in turns (common.interleaved, do_bench 100 + 500 ms, 2 rounds): without entropy (ours with return_entropy=False at
    T = 1 against FLCE's reduction="sum" and the scaled kernel's per-token NLL at T = 1) and with it (ours at T against
    the scaled kernel's NLL + bf16 entropy at T). Per implementation: its first forward+backward in seconds (the CuTe
    DSL compiles there; not in the timings), forward and forward+backward ms, TFLOP/s at 6NHV (Liger's count: logits,
    dX, dW; ours recomputes the logits, 8NHV), peak memory above the inputs and gradients, agreement with ours
    (largest |difference| per token; FLCE's sum: relative) and a forward+backward GPU timeline (its kernels). A peer that
    cannot run a shape gets its error as its row."""
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

    forms = peer_logp.liger_forms(T)
    ours = {"no entropy": ("ours (return_entropy=False, T=1)",
                           lambda h, w, y: linear_logp_entropy(h, w, y, 1.0, return_entropy=False)[:1]),
            "entropy": (f"ours (entropy, T={T})", lambda h, w, y: linear_logp_entropy(h, w, y, T))}
    for label, form in forms.items():
        if isinstance(form, str):
            print(f"{label}: {form}")
    print("| N | H | V | implementation | first fwd+bwd s | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s (6NHV) | ours / it "
          "(fwd+bwd) | peak extra GiB | agreement with ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, hs, v in liger_shapes():
        free()
        h = (torch.randn(n, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
        w = (torch.randn(v, hs, device="cuda") / hs**0.25).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        for group, (ours_label, ours_fn) in ours.items():
            impls = {ours_label: ours_fn, **{label: form[0] for label, form in forms.items()
                                             if not isinstance(form, str) and form[1] == group}}
            rows = {label: {"impl": label, "group": group, "N": n, "H": hs, "V": v} for label in impls}
            outs = {}
            for label, fn in list(impls.items()):
                try:
                    rows[label]["first_fwd_bwd_s"], outs[label] = _first_call(fn, h, w, y)
                except Exception as exc:  # noqa: BLE001: its exact error is the row's result
                    rows[label]["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    del impls[label]
                    free()
            if ours_label in impls:
                _liger_timings(impls, rows, outs, ours_label, h, w, y)
            for label, row in rows.items():
                results.append(row)
                _print_liger_row(row, rows.get(ours_label, {}), n, hs, v)
            _print_liger_timelines(rows.values())
        del h, w, y


def _first_call(fn, h, w, y):
    """Seconds of fn's first forward+backward, and its forward's outputs (float, detached)."""
    import time

    start = time.perf_counter()
    out = fn(h, w, y)
    sum(o.float().sum() for o in out).backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    h.grad = w.grad = None
    return seconds, [o.detach().float() for o in out]


def _liger_timings(impls, rows, outs, ours_label, h, w, y):
    def forward(fn):
        return lambda: fn(h.detach(), w.detach(), y)

    def forward_backward(fn):
        return lambda: sum(o.float().sum() for o in fn(h, w, y)).backward()

    with torch.no_grad():
        fwd = interleaved({label: forward(fn) for label, fn in impls.items()}, warmup=100, rep=500)
    fb = interleaved({label: forward_backward(fn) for label, fn in impls.items()}, grad_to_none=[h, w], warmup=100,
                     rep=500)
    flops = 6 * h.shape[0] * h.shape[1] * w.shape[0]
    for label, fn in impls.items():
        row = rows[label]
        row.update(fwd_ms=fwd[label], fwd_bwd_ms=fb[label], fwd_bwd_tflops_6nhv=flops / fb[label] / 1e9)
        h.grad = w.grad = None
        row["fwd_bwd_peak_extra_gib"] = (peak_extra(forward_backward(fn)) - 2 * (h.numel() + w.numel())) / 2**30
        h.grad = w.grad = None
        row["agreement"] = {} if label == ours_label else _agreement(outs[label], outs[ours_label])
        # where its forward+backward's time goes, kernel by kernel (for the notes, where a peer is ahead)
        row["timeline"] = gpu_timeline(forward_backward(fn), top=8, grad_to_none=[h, w])


def _agreement(theirs, ours):
    """Largest |difference| from ours per token: NLL against -logp, entropy against entropy; a scalar (FLCE's sum)
    against -sum(logp), relative."""
    if theirs[0].ndim == 0:
        return {"sum_rel": (abs(theirs[0] + ours[0].sum()) / ours[0].sum().abs()).item()}
    found = {"logp_max_abs": (theirs[0] + ours[0]).abs().max().item()}
    if len(theirs) > 1 and len(ours) > 1:
        found["entropy_max_abs"] = (theirs[1] - ours[1]).abs().max().item()
    return found


def _print_liger_timelines(rows):
    for row in rows:
        line = row.get("timeline")
        if line:
            print(f"  {row['impl']} N={row['N']} V={row['V']}: span {line['span_ms']:.3f} ms, busy {line['busy_ms']:.3f}; "
                  + "; ".join(f"{key} {ms:.3f}" for key, ms in line["kernels_ms"].items()), flush=True)


def _print_liger_row(row, ours_row, n, hs, v):
    if "error" in row:
        print(f"| {n} | {hs} | {v} | {row['impl']} | {row['error']} |||||||", flush=True)
        return
    if "fwd_ms" not in row:
        print(f"| {n} | {hs} | {v} | {row['impl']} | {row['first_fwd_bwd_s']:.1f} | not timed: ours failed here "
              "|||||||", flush=True)
        return
    ratio = ours_row["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    agreement = ", ".join(f"{key} {value:.1e}" for key, value in row["agreement"].items())
    print(f"| {n} | {hs} | {v} | {row['impl']} | {row['first_fwd_bwd_s']:.1f} | {row['fwd_ms']:.3f} | "
          f"{row['fwd_bwd_ms']:.3f} | {row['fwd_bwd_tflops_6nhv']:.0f} | x{ratio:.3f} | "
          f"{row['fwd_bwd_peak_extra_gib']:.2f} | {agreement} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--quick", action="store_true", help="main shape only, no peers")
    ap.add_argument("--invariant-ab", action="store_true", help="default vs batch_invariant=True (issue 25), only")
    ap.add_argument("--softcap-ab", action="store_true", help="cost of the logit transforms (issue 24), only")
    ap.add_argument("--liger", action="store_true",
                    help="Liger's SM90 kernels (FLCE 'sum', scaled CE with and without entropy) against ours, only")
    args = ap.parse_args()
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

    ceiling = matmul_ceiling()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s (8192^3)")
    for flag, key, run in ((args.invariant_ab, "invariant_ab", invariant_ab), (args.softcap_ab, "softcap_ab", softcap_ab),
                           (args.liger, "liger", liger_peers)):
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
