"""What every benchmark here needs: median timing, the two ceilings measured in the same run, peak extra memory."""
import gc

import torch


def do_bench(fn, grad_to_none=None, warmup=25, rep=100) -> float:
    """Median milliseconds by CUDA events (triton.testing.do_bench; warmup and rep are milliseconds)."""
    from triton.testing import do_bench as triton_do_bench

    return triton_do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def backward_ms(forward, go, grad_to_none=(), warmup=25, rep=100) -> float:
    """Median milliseconds of the backward alone of ``forward().backward(go)``: each call's forward runs untimed and
    its backward between CUDA events. A backward over a retained graph is not what training runs: a build that frees
    what its forward kept once the first backward has used it recomputes it on every later one (session 37)."""
    import statistics

    def timed_backward():
        for t in grad_to_none:
            t.grad = None
        out = forward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.backward(go)
        end.record()
        return start, end

    def median_of(calls):
        events = [timed_backward() for _ in range(calls)]
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    estimate = median_of(3)
    median_of(max(1, int(warmup / estimate)))
    return median_of(max(5, int(rep / estimate)))


def interleaved(fns: dict, rounds: int = 2, timer=do_bench, **bench_args) -> dict:
    """Median ms of each of ``fns`` (name -> callable) timed in turns by ``timer``, the order reversed every round
    (A B, B A, ...): an H200 under sustained load draws up to its power cap and lowers its clocks within the run
    (session 18: 1980 -> 1560 MHz at DeepSeek-V3), which a fixed order would charge to whichever runs last."""
    import statistics

    names, times = list(fns), {name: [] for name in fns}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(timer(fns[name], **bench_args))
    return {name: statistics.median(v) for name, v in times.items()}


# ~1 s of calls per timing, 4 rounds, for rows decided within a few percent (peers against ours, the diagnostics):
# do_bench's default 100 ms is 3 calls at Mixtral, and an H200 saw ours 10 % slower there than in the main rows and
# in the same run's GPU timeline
LONG_TIMING = {"rounds": 4, "rep": 1000}


def run_record(bench: str | None = None) -> dict:
    """When, where and from which commit a benchmark ran: the ``run`` block of its JSON, which bench/summary.py reads.
    ``bench``: the script's name (default: the running script's). The commit is $COMMIT (gpu_check.sh's caller passes
    it: the device's copy of the tree has no .git), else git's HEAD here, else None (summary.py: "not recorded")."""
    import datetime
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parent)
            commit = done.stdout.strip() if done.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return {"bench": bench or Path(sys.argv[0]).stem, "date": today, "commit": commit or None,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


def stamp_run(path: str, bench: str) -> None:
    """Adds ``run_record(bench)`` to a benchmark's JSON that has no ``run`` block (gpu_check.sh, after each benchmark:
    on the machine and torch that ran it)."""
    import json

    with open(path) as f:
        data = json.load(f)
    if "run" not in data:
        data["run"] = run_record(bench)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def peak_extra(fn) -> int:
    """Bytes allocated at the peak of ``fn`` above what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a))
    del a, b
    return 2 * n / (ms * 1e-3)


CEILING_WARMUP_MS = 500


def matmul_ceiling() -> float:
    """bf16 FLOP/s of an 8192³ product on random data, after half a second of the same products (CEILING_WARMUP_MS):
    with 10 ms of warm-up, the first benchmark of a device call read 743 TFLOP/s and the next ones in that call 808-812."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=CEILING_WARMUP_MS, rep=200)
    return 2 * 8192**3 / (ms * 1e-3)


def gpu_timeline(fn, iters: int = 5, top: int = 6, grad_to_none=()) -> dict:
    """Where the GPU's time goes over ``iters`` calls of ``fn`` under torch.profiler (one trace), each call prepared as
    do_bench prepares one (the L2 flushed, the ``grad_to_none`` tensors' gradients cleared; cleared again at the end,
    so that no later backward adds into them): per call, the span
    from the first kernel's start to the last one's end, the time some kernel, memset or copy ran (busy) and the
    rest (idle); the host's time per call unprofiled; the kernels and the CUDA runtime calls with the most time (a
    blocking call shows here); the longest idle gaps, each with the kernel before and after it and
    how long after the gap opened the CPU finished launching the one after (``cpu_late_ms`` > 0: the GPU waited for the
    host)."""
    import json
    import tempfile
    import time

    from torch.profiler import ProfilerActivity, profile

    l2_flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def call():
        l2_flush.zero_()
        for t in grad_to_none:
            t.grad = None
        fn()

    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    host = (time.perf_counter() - start) / iters  # the host's time per call, unprofiled, the GPU not waited for
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    for t in grad_to_none:
        t.grad = None
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return {"host_ms": host * 1e3, **timeline_of(json.load(open(f.name))["traceEvents"], iters, top)}


def kernel_name(name: str) -> str:
    """A kernel's name without "void", namespaces and parameters, cut at 60 characters: "moe_gemm_kernel<4>",
    "vectorized_elementwise_kernel<4, at::native::FillFunctor<float>..." (PyTorch's CUTLASS GEMMs, mangled, all under
    one name: their sum)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").split("(", 1)[0].strip()
    head, angle, args = name.partition("<")
    return (head.rsplit("::", 1)[-1] + angle + args)[:60]


def timeline_of(events: list, iters: int, top: int) -> dict:
    """gpu_timeline's summary of a chrome trace's events (trace microseconds in, milliseconds per call out)."""
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                    key=lambda e: e["ts"])
    launch_end = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in events
                  if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    busy, gaps, by_name = 0.0, [], {}
    end, previous = device[0]["ts"], None
    for e in device:
        start, stop, name = e["ts"], e["ts"] + e["dur"], kernel_name(e["name"])
        if start > end:
            late = launch_end.get(e["args"].get("correlation"), start) - end
            gaps.append((start - end, previous, name, late))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, previous = stop, name
        by_name[name] = by_name.get(name, 0.0) + e["dur"]
    span = end - device[0]["ts"]
    runtime = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            runtime[e["name"]] = runtime.get(e["name"], 0.0) + e["dur"]
    ms = 1e-3 / iters  # trace microseconds over the whole trace -> milliseconds per call
    return {"span_ms": span * ms, "busy_ms": busy * ms, "idle_ms": (span - busy) * ms,
            "kernels_ms": {name: t * ms for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]},
            "runtime_ms": {name: t * ms for name, t in sorted(runtime.items(), key=lambda kv: -kv[1])[:top]},
            "gaps": [{"ms": g / 1e3, "after": a, "before": b, "cpu_late_ms": late / 1e3}
                     for g, a, b, late in sorted(gaps, reverse=True)[:top]]}


def sampled_clocks(fn) -> tuple:
    """``fn()``'s result and this GPU's median SM clock (MHz) and mean power (W), sampled by nvidia-smi every 50 ms
    while it ran (None, None without nvidia-smi): same-run ratios can only be trusted between equal clocks."""
    import shutil
    import statistics
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return fn(), None, None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    ours = f"{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=pci.bus_id,clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        result = fn()
    finally:
        sampler.terminate()
        lines = [line.split(",") for line in sampler.communicate()[0].splitlines() if line.count(",") == 2]
    samples = []
    for bus_id, clock, power in lines:
        try:
            if bus_id.strip().upper().endswith(ours):
                samples.append((float(clock), float(power)))
        except ValueError:  # "[N/A]" where the driver does not report it
            continue
    if not samples:
        return result, None, None
    return result, statistics.median(s[0] for s in samples), statistics.fmean(s[1] for s in samples)
