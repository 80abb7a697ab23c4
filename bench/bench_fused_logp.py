"""GPU benchmark of fused_logp (never a test): forward with entropy, forward+backward, peak extra memory, against the
memory floor from the copy bandwidth measured in the same run, and peers where importable.

    python bench/bench_fused_logp.py [--json PATH] [--quick] [--no-compile]
    python bench/bench_fused_logp.py --invariant-ab [--json PATH]
    python bench/bench_fused_logp.py --softcap-ab [--json PATH]

--invariant-ab: default vs batch_invariant=True at the issue-25 shapes (N = 16384 and 1024, V = 151936 and 32000; and N
= 16384, V = 32001, whose rows are not 16-byte aligned; N = 5: latency, data in L2, the floor meaningless), alternating
rounds in one run, medians, ratios invariant / default and the floors; plus whether 5 probe tokens keep their bits
between a batch of 5 and the benchmark batch in each mode (informational; the tests assert it). ``--shapes NxV,...``
and ``--rounds R`` narrow it for a short device call. A kernel change against another build, same call: ``bench/ab.py
--variant main=SITE -- bench/bench_fused_logp.py --invariant-ab`` (rows are labelled by shape, timings
``default_fwd_ms`` etc.).

--softcap-ab: the logit transforms' cost at N = 16384, V = 151936, bf16 and fp32: none, softcap=30.0, softcap=10.0,
softcap=3.0, logit_scale=0.0625 (folded into the temperature: expected free), alternating rounds, medians, ratios to
none and the floors.

Timing: triton.testing.do_bench median; data larger than L2; fresh randn*3 bf16 logits per shape.
Floor: fwd reads logits once; fwd+bwd reads them twice and writes the gradient once (bytes / copy bandwidth).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from common import copy_bandwidth, do_bench, free, peak_extra, run_record

SHAPES = [(16384, 151936), (1024, 151936), (65536, 151936), (16384, 32000)]


def make_peers(no_compile: bool):
    """name -> (fwd(x, y), fwd_bwd(x, y) or None, note); entries missing become 'not installed'."""
    from prime_kernels_fused_logp.reference import logp_entropy_reference

    peers: dict = {}

    def naive_fwd(x, y):
        return logp_entropy_reference(x, y)

    def naive_fb(x, y):
        lp, ent = logp_entropy_reference(x, y)
        (lp.sum() + ent.sum()).backward()

    peers["naive fp32"] = (naive_fwd, naive_fb, "log_softmax(x.float()) gather + entropy")
    if no_compile:
        peers["compiled fp32"] = None
    else:
        cf = torch.compile(naive_fwd, dynamic=False)

        def comp_fb(x, y):
            lp, ent = cf(x, y)
            (lp.sum() + ent.sum()).backward()

        peers["compiled fp32"] = (cf, comp_fb, "torch.compile of the naive path")
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        ce = LigerCrossEntropyLoss(reduction="none")

        def liger_fwd(x, y):
            return -ce(x, y)

        def liger_fb(x, y):
            (-ce(x, y)).sum().backward()

        peers["liger CE"] = (liger_fwd, liger_fb, "LigerCrossEntropyLoss(reduction='none'), logp only")
    except Exception as e:  # noqa: BLE001
        peers["liger CE"] = f"not installed ({type(e).__name__})"
    try:
        from quack import cross_entropy as quack_ce  # type: ignore

        def quack_fwd(x, y):
            return -quack_ce(x, y)

        def quack_fb(x, y):
            (-quack_ce(x, y)).sum().backward()

        peers["quack CE"] = (quack_fwd, quack_fb, "quack.cross_entropy, logp only")
    except Exception as e:  # noqa: BLE001
        peers["quack CE"] = f"not installed ({type(e).__name__})"
    try:
        import cut_cross_entropy  # noqa: F401

        peers["cut-cross-entropy"] = "not applicable (fuses the classifier matmul; takes hidden states, not logits)"
    except Exception as e:  # noqa: BLE001
        peers["cut-cross-entropy"] = f"not installed ({type(e).__name__})"
    return peers


def bench_shape(n, v, bw, peers, results):
    from prime_kernels_fused_logp.ops import logp_entropy

    elem = 2  # bf16
    floor_fwd = n * v * elem / bw * 1e3
    floor_fb = 3 * n * v * elem / bw * 1e3
    x = (torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 3)
    y = torch.randint(0, v, (n,), device="cuda")
    row = {"N": n, "V": v, "floor_fwd_ms": floor_fwd, "floor_fwd_bwd_ms": floor_fb}

    def ours_fwd():
        return logp_entropy(x, y, check_labels=False)

    def ours_fwd_checked():
        return logp_entropy(x, y)

    xg = x.detach().requires_grad_()

    def ours_fb():
        lp, ent = logp_entropy(xg, y, check_labels=False)
        (lp.sum() + ent.sum()).backward()

    row["ours_fwd_ms"] = do_bench(ours_fwd)
    row["ours_fwd_checked_ms"] = do_bench(ours_fwd_checked)
    row["ours_fwd_mem_bytes"] = peak_extra(ours_fwd)
    row["ours_fwd_bwd_ms"] = do_bench(ours_fb, grad_to_none=[xg])
    xg.grad = None
    row["ours_fwd_bwd_mem_bytes"] = peak_extra(ours_fb)
    xg.grad = None
    free()
    print(f"N={n} V={v}: fwd {row['ours_fwd_ms']:.3f} ms (floor {floor_fwd:.3f}, x{row['ours_fwd_ms'] / floor_fwd:.3f}; "
          f"checked {row['ours_fwd_checked_ms']:.3f}), fwd+bwd {row['ours_fwd_bwd_ms']:.3f} ms (floor {floor_fb:.3f}, "
          f"x{row['ours_fwd_bwd_ms'] / floor_fb:.3f}), extra mem fwd {row['ours_fwd_mem_bytes'] / 2**20:.1f} MiB, "
          f"fwd+bwd {row['ours_fwd_bwd_mem_bytes'] / 2**30:.2f} GiB", flush=True)
    row["peers"] = {}
    big = n * v >= 65536 * 151936
    for name, peer in peers.items():
        if not isinstance(peer, tuple):
            row["peers"][name] = peer or "skipped (--no-compile)"
            continue
        fwd, fb, note = peer
        entry = {"note": note}
        if big and name in ("naive fp32", "compiled fp32"):
            row["peers"][name] = "skipped: fp32 copies of 65536x151936 logits exceed GPU memory"
            continue
        for key, fn, g in (("fwd_ms", lambda: fwd(x, y), None), ("fwd_bwd_ms", lambda: fb(xg, y), [xg])):
            try:
                entry[key] = do_bench(fn, grad_to_none=g)
                base = row["ours_fwd_ms"] if key == "fwd_ms" else row["ours_fwd_bwd_ms"]
                entry[key.replace("_ms", "_ratio")] = entry[key] / base
                if key == "fwd_bwd_ms":
                    xg.grad = None
                    entry["fwd_bwd_mem_bytes"] = peak_extra(fn)
            except torch.cuda.OutOfMemoryError:
                entry[key] = "OOM"
            except Exception as e:  # noqa: BLE001
                entry[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            xg.grad = None
            free()
        row["peers"][name] = entry
        print(f"  {name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()
                                        if k != "note"), flush=True)
    results.append(row)
    del x, xg, y
    free()


INVARIANT_AB_SHAPES = [(16384, 151936), (1024, 151936), (16384, 32000), (1024, 32000), (16384, 32001), (5, 151936)]
AB_ROUNDS = 3


def _probe_bits_kept(x, y, t, invariant):
    """Whether the first 5 tokens' logp, entropy and gradient rows have the same bits alone as inside (x, y, t)."""
    from prime_kernels_fused_logp.ops import logp_entropy

    def run(xs, ys, ts):
        xg = xs.detach().clone().requires_grad_()
        lp, ent = logp_entropy(xg, ys, ts, check_labels=False, batch_invariant=invariant)
        (lp.sum() + ent.sum()).backward()
        return lp[:5], ent[:5], xg.grad[:5]

    return all(torch.equal(a, b) for a, b in zip(run(x[:5], y[:5], t[:5]), run(x, y, t)))


def invariant_ab(bw, results, shapes=INVARIANT_AB_SHAPES, rounds=AB_ROUNDS):
    from prime_kernels_fused_logp.ops import logp_entropy

    print("| N | V | mode | fwd ms | fwd/floor | fwd+bwd ms | fwd+bwd/floor | probe bits kept (N=5 vs N) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, v in shapes:
        floor_fwd, floor_fb = n * v * 2 / bw * 1e3, 3 * n * v * 2 / bw * 1e3
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 3
        y = torch.randint(0, v, (n,), device="cuda")
        t = torch.rand(n, device="cuda") + 0.5
        xg = x.detach().requires_grad_()
        times = {m: {"fwd": [], "fb": []} for m in (False, True)}
        for _ in range(rounds):
            for inv in (False, True):
                def fwd():
                    return logp_entropy(x, y, t, check_labels=False, batch_invariant=inv)

                def fb():
                    lp, ent = logp_entropy(xg, y, t, check_labels=False, batch_invariant=inv)
                    (lp.sum() + ent.sum()).backward()

                times[inv]["fwd"].append(do_bench(fwd))
                times[inv]["fb"].append(do_bench(fb, grad_to_none=[xg]))
                xg.grad = None
        # flat fields, one row per shape: bench/ab.py labels timings by "shape" and field name
        row = {"shape": f"{n} x {v}", "N": n, "V": v, "floor_fwd_ms": floor_fwd, "floor_fwd_bwd_ms": floor_fb}
        for inv in (False, True):
            key = "invariant" if inv else "default"
            f = sorted(times[inv]["fwd"])[rounds // 2]
            b = sorted(times[inv]["fb"])[rounds // 2]
            kept = _probe_bits_kept(x, y, t, inv)
            row.update({f"{key}_fwd_ms": f, f"{key}_fwd_bwd_ms": b, f"{key}_fwd_rounds": times[inv]["fwd"],
                        f"{key}_fwd_bwd_rounds": times[inv]["fb"], f"{key}_probe_bits_kept": kept})
            print(f"| {n} | {v} | {key} | {f:.3f} | {f / floor_fwd:.3f} | {b:.3f} | {b / floor_fb:.3f} | {kept} |",
                  flush=True)
        row["ratio_fwd"] = row["invariant_fwd_ms"] / row["default_fwd_ms"]
        row["ratio_fwd_bwd"] = row["invariant_fwd_bwd_ms"] / row["default_fwd_bwd_ms"]
        print(f"| {n} | {v} | invariant / default | x{row['ratio_fwd']:.3f} | | x{row['ratio_fwd_bwd']:.3f} | | |",
              flush=True)
        results.append(row)
        del x, xg, y, t
        free()


# The logits are randn x 3. The logits kernel's tanh runs its series below |x / softcap| = 0.625 and the exp form
# beyond, for every element of a warp's vectors once one of its 256 bf16 (128 fp32) logits needs it: softcap 30 leaves
# the series only at the rare 6.25-sigma logit, softcap 10 in 3.7 % of the logits (every warp), softcap 3 in 53 %.
TRANSFORM_VARIANTS = {"none": {}, "softcap=30": {"softcap": 30.0}, "softcap=10": {"softcap": 10.0},
                      "softcap=3": {"softcap": 3.0}, "logit_scale=0.0625": {"logit_scale": 0.0625}}


def softcap_ab(bw, results, n=16384, v=151936, rounds=AB_ROUNDS):
    from prime_kernels_fused_logp.ops import logp_entropy

    for dtype in (torch.bfloat16, torch.float32):
        size = torch.finfo(dtype).bits // 8
        floor_fwd, floor_fb = n * v * size / bw * 1e3, 3 * n * v * size / bw * 1e3
        x = (torch.randn(n, v, device="cuda") * 3).to(dtype)
        y = torch.randint(0, v, (n,), device="cuda")
        xg = x.detach().requires_grad_()
        times = {name: {"fwd": [], "fb": []} for name in TRANSFORM_VARIANTS}
        for _ in range(rounds):
            for name, tf in TRANSFORM_VARIANTS.items():
                def fwd():
                    return logp_entropy(x, y, 0.7, check_labels=False, **tf)

                def fb():
                    lp, ent = logp_entropy(xg, y, 0.7, check_labels=False, **tf)
                    (lp.sum() + ent.sum()).backward()

                times[name]["fwd"].append(do_bench(fwd))
                times[name]["fb"].append(do_bench(fb, grad_to_none=[xg]))
                xg.grad = None
        tag = str(dtype).removeprefix("torch.")
        print(f"N={n} V={v} {tag} T=0.7; floors fwd {floor_fwd:.3f} ms, fwd+bwd {floor_fb:.3f} ms (medians of "
              f"{rounds} alternating rounds)")
        print("| transform | fwd ms | fwd / none | fwd / floor | fwd+bwd ms | fwd+bwd / none | fwd+bwd / floor |")
        print("|---|---|---|---|---|---|---|")
        med = {name: (sorted(t["fwd"])[rounds // 2], sorted(t["fb"])[rounds // 2]) for name, t in times.items()}
        for name, (f, b) in med.items():
            rf, rb = f / med["none"][0], b / med["none"][1]
            print(f"| {name} | {f:.3f} | x{rf:.3f} | {f / floor_fwd:.3f} | {b:.3f} | x{rb:.3f} | {b / floor_fb:.3f} |",
                  flush=True)
            results.append({"transform": name, "dtype": tag, "N": n, "V": v, "fwd_ms": f, "fwd_bwd_ms": b,
                            "ratio_fwd": rf, "ratio_fwd_bwd": rb, "floor_fwd_ms": floor_fwd,
                            "floor_fwd_bwd_ms": floor_fb,
                            "fwd_rounds": times[name]["fwd"], "fwd_bwd_rounds": times[name]["fb"]})
        del x, xg, y
        free()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--quick", action="store_true", help="main shape only")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--invariant-ab", action="store_true", help="default vs batch_invariant=True (issue 25), only")
    ap.add_argument("--softcap-ab", action="store_true", help="cost of the logit transforms (issue 24), only")
    ap.add_argument("--shapes", help="--invariant-ab's shapes as NxV,NxV,... (default: all of INVARIANT_AB_SHAPES)")
    ap.add_argument("--rounds", type=int, default=AB_ROUNDS,
                    help="--invariant-ab's (per shape) and --softcap-ab's alternating rounds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fused_logp: needs a CUDA device")
    torch.manual_seed(torch.seed() % 2**31)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write, 2 GiB)", flush=True)
    shapes = ([tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else INVARIANT_AB_SHAPES)
    ab_runs = ((args.invariant_ab, "invariant_ab", lambda bw, results: invariant_ab(bw, results, shapes, args.rounds)),
               (args.softcap_ab, "softcap_ab", lambda bw, results: softcap_ab(bw, results, rounds=args.rounds)))
    for flag, key, run in ab_runs:
        if not flag:
            continue
        results = []
        run(bw, results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"run": run_record(), "device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw,
                           "torch": torch.__version__, key: results}, f, indent=1)
        return
    peers = make_peers(args.no_compile)
    results = []
    for n, v in SHAPES[:1] if args.quick else SHAPES:
        bench_shape(n, v, bw, peers, results)

    print("\n| N | V | fwd ms | fwd/floor | fwd+bwd ms | fwd+bwd/floor | " + " | ".join(
        f"{p} fwd / fwd+bwd (x ours)" for p in peers) + " |")
    print("|" + "---|" * (6 + len(peers)))
    for r in results:
        cells = [str(r["N"]), str(r["V"]), f"{r['ours_fwd_ms']:.3f}", f"{r['ours_fwd_ms'] / r['floor_fwd_ms']:.3f}",
                 f"{r['ours_fwd_bwd_ms']:.3f}", f"{r['ours_fwd_bwd_ms'] / r['floor_fwd_bwd_ms']:.3f}"]
        for p in peers:
            e = r["peers"][p]
            if isinstance(e, dict):
                f = e.get("fwd_ratio")
                b = e.get("fwd_bwd_ratio")
                cells.append(f"{f:.2f}x / {b:.2f}x" if isinstance(f, float) and isinstance(b, float)
                             else f"{e.get('fwd_ms')} / {e.get('fwd_bwd_ms')}")
            else:
                cells.append(e.split(" (")[0].split(":")[0])
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_record(), "device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw,
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
