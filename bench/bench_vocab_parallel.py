"""GPU benchmark of vocabulary-parallel linear_logp (never a test): the lm_head sharded over R GPUs (NCCL), against
the single-GPU op on the full vocabulary in the same run.

    python bench/bench_vocab_parallel.py [--json PATH] [--world R]     (default R: every visible GPU)

With R = 1 the group path runs on one GPU: its overhead and memory against the plain op.
Shape N = 8192, H = 4096, V = 151936 (V / R rows per rank), T = 0.7, entropy on, bf16. Rank 0 first times the
single-GPU op on the full weight while the others wait; then every rank times (a) the sharded op through the group
and (b) its local op alone on its shard with no group: (a) - (b) is what the collectives and the float64 combine cost.
A collective needs the same number of calls on every rank, so timing is a fixed loop (CUDA events, median of REPS
calls after WARMUP), not do_bench's adaptive one. Floor per rank: 2NH(V/R) (fwd) and 8NH(V/R) (fwd+bwd) at the bf16
matmul ceiling measured on that rank in this run. NVLink multicast off (NCCL_NVLS_ENABLE=0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

N, H, V, T = 8192, 4096, 151936, 0.7
WARMUP, REPS = 3, 15


def timed(fn, reps=REPS, warmup=WARMUP) -> float:
    """Median milliseconds of ``fn`` over a fixed number of calls (the same count on every rank)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(rank_rows: slice | None):
    """The same hidden / weight / labels on every rank (seeded on the device); weight rows ``rank_rows`` only."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    h = (torch.randn(N, H, device="cuda", generator=gen) / H**0.25).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) / H**0.25).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda", generator=gen)
    if rank_rows is not None:
        w = w[rank_rows].clone()
    return h.requires_grad_(), w.requires_grad_(), y


def fwd_and_fwd_bwd(h, w, y, group):
    from prime_kernels_fused_logp.linear_ops import linear_logp_entropy

    def fwd():
        with torch.no_grad():
            return linear_logp_entropy(h, w, y, T, process_group=group)

    def fwd_bwd():
        lp, ent = linear_logp_entropy(h, w, y, T, process_group=group)
        (lp.sum() + ent.sum()).backward()
        h.grad = w.grad = None

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fb = timed(fwd_bwd)
    peak = torch.cuda.max_memory_allocated() - base - 2 * (h.numel() + w.numel())  # beyond inputs and gradients
    return timed(fwd), fb, peak, fwd()


def worker(rank: int, world: int, store: str, results_path: str) -> None:
    import torch.distributed as dist

    from common import matmul_ceiling

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    ceiling = matmul_ceiling()
    rows = V // world
    shard = slice(rank * rows, V if rank == world - 1 else (rank + 1) * rows)
    row = {"rank": rank, "ceiling_flops": ceiling, "local_vocab": shard.stop - shard.start}
    if rank == 0:
        h, w, y = inputs(None)
        row["single_fwd_ms"], row["single_fwd_bwd_ms"], row["single_peak_extra"], (lp1, ent1) = \
            fwd_and_fwd_bwd(h, w, y, None)
        del h, w
        torch.cuda.empty_cache()
    dist.barrier()
    h, w, y = inputs(shard)
    row["sharded_fwd_ms"], row["sharded_fwd_bwd_ms"], row["sharded_peak_extra"], (lp, ent) = \
        fwd_and_fwd_bwd(h, w, y, dist.group.WORLD)
    row["local_fwd_ms"], row["local_fwd_bwd_ms"], _, _ = fwd_and_fwd_bwd(h, w, y, None)
    if rank == 0:  # informational: the sharded result against the single-GPU op on the same inputs
        row["max_abs_diff_logp"] = float((lp - lp1).abs().max())
        row["max_abs_diff_entropy"] = float((ent - ent1).abs().max())
    rows_all = [None] * world
    dist.all_gather_object(rows_all, row)
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(rows_all, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    args = ap.parse_args()
    if args.world < 1 or torch.cuda.device_count() < args.world:
        print(f"bench_vocab_parallel: needs {max(args.world, 1)} GPUs, this machine has {torch.cuda.device_count()}: "
              "skipped")
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import run_record

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        torch.multiprocessing.spawn(worker, args=(args.world, os.path.join(tmp, "store"), path), nprocs=args.world)
        with open(path) as f:
            rows = json.load(f)
    r0, R = rows[0], args.world
    flops = 2 * N * H * V
    ceiling = min(r["ceiling_flops"] for r in rows)
    summary = [f"{torch.cuda.get_device_name()} x{R}, NCCL, N={N} H={H} V={V} T={T}, entropy on, bf16; bf16 ceiling "
               f"{ceiling / 1e12:.0f} TFLOP/s (slowest rank)"]
    for what, mult in (("fwd", 1), ("fwd_bwd", 4)):
        single = r0[f"single_{what}_ms"]
        sharded = max(r[f"sharded_{what}_ms"] for r in rows)
        local = max(r[f"local_{what}_ms"] for r in rows)
        floor1, floor_r = mult * flops / ceiling * 1e3, mult * flops / R / ceiling * 1e3
        summary.append(f"{what:8s}: 1 GPU {single:7.2f} ms (floor {floor1:.2f}) | {R} GPUs {sharded:7.2f} ms (floor "
                       f"{floor_r:.2f}) = {single / sharded:.2f}x, {single / sharded / R:.0%} scaling efficiency | "
                       f"local op alone {local:.2f} ms: collectives + combine {sharded - local:+.2f} ms")
    summary.append(f"peak extra (beyond inputs and grads): 1 GPU {r0['single_peak_extra'] / 2**30:.2f} GiB, per rank "
                   f"{max(r['sharded_peak_extra'] for r in rows) / 2**30:.2f} GiB; sharded vs 1 GPU max |d logp| "
                   f"{r0['max_abs_diff_logp']:.2e}, |d entropy| {r0['max_abs_diff_entropy']:.2e}")
    print("\n".join(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_record(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "world": R, "N": N, "H": H, "V": V, "T": T, "ranks": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
