"""Whether CuTe DSL code compiled ahead of time, without a device, runs on this GPU with a first call that compiles
nothing (issue 57: "Triton, and by the same mechanism CuTe DSL"). A diagnostic for the GPU machine, needing
nvidia-cutlass-dsl importable (gpu_check.sh's peers: the wheels in .peers1); not a test of the framework.

    python bench/diagnostics/cute_dsl_aot.py [--json OUT]

Three fresh processes, one JSON line each, then a summary:
  compile  CUDA_VISIBLE_DEVICES="" and CUTE_DSL_ARCH set to this GPU's arch: cute.compile(..., options="--gpu-arch
           sm_XXa") of a 1-D add kernel for fake tensors, then export_to_c (a header and an object file holding the
           host launch entry and the cubin);
  shipped  compilers off PATH, an empty CuTe cache: cute.runtime.load_module(<object>) and the first call, timed to a
           synchronised result and checked against torch's a + b, with every process it starts (an audit hook);
  jit      an empty CuTe cache: cute.compile on the device and its first call, the cold JIT beside it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 128
ELEMENTS = BLOCK * 8192
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "nvcc", "ptxas")
STARTS = []


def _audit(event, args):
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"):
        STARTS.append(f"{event} {str(args)[:200]}")


def _add():
    """The 1-D add kernel and its host function (one element per thread, ELEMENTS a multiple of BLOCK)."""
    import cutlass.cute as cute

    @cute.kernel
    def add_kernel(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        thread, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        i = block * BLOCK + thread
        c[i] = a[i] + b[i]

    @cute.jit
    def add(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        add_kernel(a, b, c).launch(grid=(a.shape[0] // BLOCK, 1, 1), block=(BLOCK, 1, 1))

    return add


def compile_without_device(out: Path, arch: str) -> dict:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    start = time.perf_counter()
    n = cute.sym_int()
    fakes = [make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) for _ in range(3)]
    compiled = cute.compile(_add(), *fakes, options=f"--gpu-arch {arch}")
    out.mkdir(parents=True, exist_ok=True)
    compiled.export_to_c(str(out), "add")
    return {"phase": "compile", "arch": arch, "seconds": time.perf_counter() - start,
            "files": sorted(p.name for p in out.iterdir())}


def _inputs():
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(ELEMENTS, generator=gen).cuda() for _ in range(2))
    return a, b, torch.empty_like(a)


def _timed_first_call(prepare) -> dict:
    """The first call (prepare() returns the callable; its time counts), checked, and a second call, both synchronised."""
    import torch
    from cutlass.cute.runtime import from_dlpack

    a, b, c = _inputs()
    torch.cuda.synchronize()
    sys.addaudithook(_audit)
    start = time.perf_counter()
    fn = prepare()
    views = [from_dlpack(t, assumed_align=16) for t in (a, b, c)]
    fn(*views)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    started = list(STARTS)
    start = time.perf_counter()
    fn(*views)
    torch.cuda.synchronize()
    return {"first_call_s": first, "second_call_s": time.perf_counter() - start, "processes_started": started,
            "exact": bool(torch.equal(c, a + b)), "device": torch.cuda.get_device_name()}


def run_shipped(out: Path) -> dict:
    import cutlass.cute as cute

    return {"phase": "shipped", **_timed_first_call(lambda: cute.runtime.load_module(str(out / "add.o")).add)}


def run_jit(arch: str) -> dict:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    def prepare():
        n = cute.sym_int()
        fakes = [make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) for _ in range(3)]
        return cute.compile(_add(), *fakes, options=f"--gpu-arch {arch}")

    return {"phase": "jit", **_timed_first_call(prepare)}


def _path_without_compilers() -> str:
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not any(Path(d, c).exists() for c in COMPILERS))


def _child(phase: str, work: Path, arch: str, **env) -> dict:
    done = subprocess.run([sys.executable, __file__, "--phase", phase, "--work", str(work), "--arch", arch],
                          env=dict(os.environ, CUTE_DSL_CACHE_DIR=str(work / f"cache-{phase}"), **env),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"phase": phase, "failed": done.returncode, "stderr": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--phase", choices=["compile", "shipped", "jit"])
    parser.add_argument("--work")
    parser.add_argument("--arch")
    args = parser.parse_args()
    if args.phase:  # a child: one phase, one JSON line
        out = Path(args.work) / "export"
        result = {"compile": lambda: compile_without_device(out, args.arch), "shipped": lambda: run_shipped(out),
                  "jit": lambda: run_jit(args.arch)}[args.phase]()
        print(json.dumps(result))
        return
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        rows = [_child("compile", work, arch, CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH=arch)]
        rows.append(_child("shipped", work, arch, PATH=_path_without_compilers()))
        rows.append(_child("jit", work, arch))
    for row in rows:
        print(json.dumps(row))
    shipped = rows[1]
    verdict = ("shipped code ran exactly, starting no process" if shipped.get("exact")
               and not shipped.get("processes_started") else "shipped code did not run as hoped: see the rows")
    print(f"cute_dsl_aot on {shipped.get('device', '?')} ({arch}): {verdict}; first call shipped "
          f"{shipped.get('first_call_s', float('nan')):.3f} s, cold JIT {rows[2].get('first_call_s', float('nan')):.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
