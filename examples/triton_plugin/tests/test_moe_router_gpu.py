"""The shipped code on a GPU: the first call compiles nothing and returns within a second, beside a cold JIT's first
call; the shipped cubin is the one Triton's JIT compiles for the same call; steady state matches the JIT-compiled
kernel. Run on the GPU machine: ``python -m pytest examples/triton_plugin/tests -m gpu -q -s``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

KERNEL = "moe_router"
pytestmark = [pytest.mark.gpu, pytest.mark.kernel(KERNEL)]
FIRST_CALL = Path(__file__).with_name("first_call.py")
# What a compile would run: a C compiler (Triton builds its launcher with one), ptxas, nvcc.
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "nvcc", "ptxas")
FIRST_CALL_LIMIT_S = 1.0


def _path_without_compilers() -> str:
    """PATH without any folder holding a compiler (python itself may share a folder with none of them)."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not any(Path(d, c).exists() for c in COMPILERS))


def _first_call(mode: str, tmp_path: Path) -> dict:
    cache = tmp_path / f"triton-cache-{mode}"
    cache.mkdir()
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PATH=_path_without_compilers(), CC="/nonexistent/cc",
               TRITON_PTXAS_PATH="/nonexistent/ptxas", TRITON_PTXAS_BLACKWELL_PATH="/nonexistent/ptxas")
    if mode == "jit":  # the cold JIT needs its compilers back
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PRIME_KERNELS_AOT="0")
    done = subprocess.run([sys.executable, str(FIRST_CALL), mode], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{mode} first call failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    return result


def test_first_call_with_shipped_code_compiles_nothing(tmp_path):
    shipped = _first_call("shipped", tmp_path)
    cold = _first_call("jit", tmp_path)
    print(f"first call (forward + backward, 16384 x 256 bf16) on {shipped['device']}: shipped code "
          f"{shipped['first_call_s'] * 1e3:.1f} ms, cold JIT {cold['first_call_s'] * 1e3:.1f} ms; second call "
          f"{shipped['second_call_s'] * 1e3:.2f} / {cold['second_call_s'] * 1e3:.2f} ms")
    assert shipped["processes_started"] == [], shipped["processes_started"]
    assert shipped["cache_files_after_first_call"] == [], "the first call wrote Triton's cache: it compiled"
    assert shipped["fallbacks"] == {}, shipped["fallbacks"]
    assert shipped["first_call_s"] < FIRST_CALL_LIMIT_S
    # The same checks see the cold JIT compile: they can fail.
    assert cold["fallbacks"] and cold["cache_files_after_first_call"] and cold["processes_started"]


def _same_triton_as_the_build():
    """Skip unless this process's Triton compiled the shipped code (build the wheel here to compare the two)."""
    import triton

    from prime_kernels_core import manifest

    record = manifest.read_build_record(manifest.package_dir("pk_example_router"))
    built = record["kernels"][KERNEL].get("library_version")
    if built != triton.__version__:
        pytest.skip(f"the shipped code was compiled by Triton {built} and this process runs Triton {triton.__version__}: "
                    "the JIT's code and the shipped code differ by compiler; build the wheel with this Triton")


def test_shipped_cubin_is_what_the_jit_compiles(tmp_path, monkeypatch):
    """Triton's JIT, launching the shipped specialization on this device, compiles with the hash the build recorded
    (the same source, specialization, options, target and ptxas) and to the shipped cubin's machine code: steady state
    runs the same SASS either way. The bytes also differ in the debug line table, which names kernels.py's path: the
    build's source tree in the shipped cubin, the installed package in the JIT's (printed, not asserted)."""
    _same_triton_as_the_build()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    from prime_kernels_core import jit_runtime, jit_target, manifest

    from pk_example_router import kernels

    logits = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(256, device="cuda")
    weights = torch.empty(64, 8, device="cuda")
    experts = torch.empty(64, 8, device="cuda", dtype=torch.int64)
    constexprs = dict(N_EXPERTS=256, N_GROUPS=8, TOPK_GROUPS=4, TOP_K=8, SIGMOID=True, RENORMALIZE=True)
    args = (logits, bias, weights, experts, logits.stride(0), 2.5)
    entry, why = jit_runtime._shipped_miss("pk_example_router", KERNEL, "route_forward", kernels.route_forward.arg_names,
                                           args, constexprs, logits.device)
    assert entry is not None, why
    compiled = kernels.route_forward[(64,)](*args, **constexprs, num_warps=4, num_stages=1)
    shipped = (manifest.package_dir("pk_example_router") / entry["file"]).read_bytes()
    print(f"shipped {entry['file']}: bytes equal to the JIT's: {compiled.asm['cubin'] == shipped}")
    assert compiled.hash == entry["triton_hash"], "the JIT compiled other inputs than the build"
    assert jit_target.machine_code(compiled.asm["cubin"]) == jit_target.machine_code(shipped), (
        f"the JIT's SASS differs from the shipped {entry['file']}")


# A value for each scalar type of the shipped functions' runtime parameters (every integer is do_not_specialize, so
# the value does not change what the JIT compiles).
SCALARS = {"i32": 7, "fp32": 0.5}


def test_every_shipped_specialization_for_this_device_is_the_jits(tmp_path, monkeypatch):
    """For each specialization shipped for this device's arch: Triton's JIT on this device (its own driver and
    target), given CUDA tensors of the recorded dtypes and the recorded constexprs, compiles with the build's hash and
    to the shipped SASS."""
    _same_triton_as_the_build()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    from prime_kernels_core import jit_runtime, jit_target, manifest

    from pk_example_router import kernels

    folder = manifest.package_dir("pk_example_router")
    record = manifest.read_build_record(folder)["kernels"][KERNEL]
    capability = torch.cuda.get_device_capability()
    here = [e for e in record["shipped"] if manifest.arch_runs_on(e["arch"], capability)]
    assert here, f"nothing shipped runs on sm_{capability[0]}{capability[1]}"
    table = manifest.load(folder)["kernels"][KERNEL]
    for entry in here:
        fn = getattr(kernels, entry["function"])
        args = [torch.empty(64, dtype=getattr(torch, {v: k for k, v in jit_runtime.TORCH_TO_TRITON.items()}[kind[1:]]),
                            device="cuda") if kind.startswith("*") else SCALARS[kind] for _, kind in entry["params"]]
        compiled = fn.warmup(*args, grid=(1,), **entry["constexprs"], **table["launch"][entry["function"]])
        shipped = (folder / entry["file"]).read_bytes()
        assert compiled.hash == entry["triton_hash"], f"{entry['file']}: the JIT compiled other inputs than the build"
        assert jit_target.machine_code(compiled.asm["cubin"]) == jit_target.machine_code(shipped), (
            f"the JIT's SASS differs from the shipped {entry['file']}")
    print(f"{len(here)} shipped specializations for {here[0]['arch']}: the JIT's hash and SASS")


def test_steady_state_matches_the_jit_compiled_kernel():
    """CUDA-event time of many back-to-back launches, shipped code against Triton's JIT launch of the same function:
    within 2 % (bench_moe_router.py prints the table)."""
    _same_triton_as_the_build()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_moe_router import compare

    rows = [row for row in compare(rounds=5) if "jit_ms" in row]  # the op-against-PyTorch rows have no JIT figure
    for row in rows:
        print(row)
    slower = [row for row in rows if row["shipped_ms"] > row["jit_ms"] * 1.02]
    assert not slower, f"shipped code more than 2 % slower than the JIT's launch (host ms per call beside): {slower}"


def test_inductor_compiles_the_triton_functions():
    """torch.compile with Inductor (not only the conformance kit's aot_eager) sees the Triton functions through
    wrap_triton and matches eager, forward and backward."""
    import prime_kernels

    ops = prime_kernels.load(KERNEL)
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(512, 256, generator=gen).to("cuda", torch.bfloat16)
    bias = (0.1 * torch.randn(256, generator=gen)).cuda()
    grad = torch.randn(512, 8, device="cuda")
    options = dict(top_k=8, n_groups=8, topk_groups=4, score="sigmoid", scale=2.5)
    results = []
    for fn in (ops.moe_route, torch.compile(ops.moe_route, fullgraph=True)):
        x = logits.clone().requires_grad_()
        weights, experts = fn(x, bias, **options)
        weights.backward(grad)
        results.append((weights, experts, x.grad))
    torch.testing.assert_close(results[1], results[0])
