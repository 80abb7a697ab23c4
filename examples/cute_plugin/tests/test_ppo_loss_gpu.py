"""The shipped CuTe DSL objects on a GPU: the first call compiles nothing and returns within a second, beside a cold
cute.compile's first call; every object shipped for this device computes what cute.compile's code computes for the
same specialization, bit for bit; steady state matches the JIT-compiled kernel within 2 %. Run on the GPU machine:
``python -m pytest examples/cute_plugin/tests -m gpu -q -s``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

KERNEL = "ppo_loss"
PACKAGE = "pk_example_rl"
pytestmark = [pytest.mark.gpu, pytest.mark.kernel(KERNEL)]
HERE = Path(__file__).parent
# What a compile could run: a C compiler, ptxas, nvcc (the DSL compiles in-process; these prove nothing else ran).
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "nvcc", "ptxas")
FIRST_CALL_LIMIT_S = 1.0


def _path_without_compilers() -> str:
    """PATH without any folder holding a compiler (python itself may share a folder with none of them)."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not any(Path(d, c).exists() for c in COMPILERS))


def _first_call(mode: str, tmp_path: Path) -> dict:
    cache = tmp_path / f"cute-cache-{mode}"
    cache.mkdir()
    env = dict(os.environ, CUTE_DSL_CACHE_DIR=str(cache), PATH=_path_without_compilers(), CC="/nonexistent/cc",
               CXX="/nonexistent/c++")
    if mode == "jit":  # the cold JIT, with its toolchain back
        env = dict(os.environ, CUTE_DSL_CACHE_DIR=str(cache), PRIME_KERNELS_AOT="0")
    done = subprocess.run([sys.executable, str(HERE / "first_call.py"), mode], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{mode} first call failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    return result


def test_first_call_with_shipped_code_compiles_nothing(tmp_path):
    shipped = _first_call("shipped", tmp_path)
    cold = _first_call("jit", tmp_path)
    print(f"first call (forward + backward, 64 x 4096 bf16, dual-clip) on {shipped['device']}: shipped code "
          f"{shipped['first_call_s'] * 1e3:.1f} ms, cold cute.compile {cold['first_call_s'] * 1e3:.1f} ms; second "
          f"call {shipped['second_call_s'] * 1e3:.2f} / {cold['second_call_s'] * 1e3:.2f} ms; prime_kernels.load, "
          f"the DSL's import with it (before the clock) {shipped['load_s']:.2f} / {cold['load_s']:.2f} s")
    assert shipped["processes_started"] == [], shipped["processes_started"]
    assert shipped["cache_files_after_first_call"] == [], "the first call wrote the DSL's cache: it compiled"
    assert shipped["fallbacks"] == {}, shipped["fallbacks"]
    assert shipped["first_call_s"] < FIRST_CALL_LIMIT_S
    # The same record sees the cold JIT compile: the check can fail.
    assert cold["fallbacks"] == {KERNEL: ["PRIME_KERNELS_AOT=0 turns shipped code off"]}
    assert cold["first_call_s"] > shipped["first_call_s"]


def _shipped_here() -> list[dict]:
    from prime_kernels_core import manifest

    record = manifest.read_build_record(manifest.package_dir(PACKAGE))["kernels"][KERNEL]
    capability = torch.cuda.get_device_capability()
    here = [e for e in record["shipped"] if manifest.arch_runs_on(e["arch"], capability)]
    assert here, f"nothing shipped runs on sm_{capability[0]}{capability[1]}"
    return here


def test_every_shipped_object_for_this_device_computes_what_cute_compile_does():
    """For each specialization shipped for this device: its loaded object and cute.compile's function for the same
    specialization (cute_compile, on this device), given the same tensors, write the same bits."""
    from prime_kernels_core import cute_compile, cute_runtime, cute_signature, manifest

    from pk_example_rl import kernels

    folder = manifest.package_dir(PACKAGE)
    gen = torch.Generator().manual_seed(0)
    tokens = 100_003  # not a multiple of the block: the last block's bound check runs
    for entry in _shipped_here():
        specialization = {k: entry[k] for k in ("function", "signature", "constexprs", "align")}
        element = cute_signature.parse(entry["signature"]["logp"], {})["tensor"]
        dtype = getattr(torch, {v: k for k, v in cute_signature.TORCH_TO_CUTE.items()}[element])
        old = -4 * torch.rand(tokens, generator=gen)
        args = ((old + 0.5 * torch.randn(tokens, generator=gen)).to("cuda", dtype), old.to("cuda", dtype),
                torch.randn(tokens, generator=gen).cuda())
        outputs = []
        for compiled in (cute_runtime._module(str(folder / entry["file"])).ppo_loss_forward,
                         cute_compile.compile_specialization(getattr(kernels, entry["function"]), specialization)):
            loss, slope = (torch.full((tokens,), float("nan"), device="cuda") for _ in range(2))
            plan = cute_runtime.Plan(compiled, specialization, shipped=True)
            plan.run((*args, loss, slope, 0.8, 1.28, 3.0), loss.device)
            outputs.append((loss, slope))
        torch.cuda.synchronize()
        assert not outputs[0][0].isnan().any(), f"{entry['file']} left tokens unwritten"
        for ours, theirs in zip(*outputs):
            assert torch.equal(ours, theirs), f"{entry['file']} differs from cute.compile's code"
    print(f"{len(_shipped_here())} shipped objects for {_shipped_here()[0]['arch']}: the same bits as cute.compile's")


def test_steady_state_matches_the_jit_compiled_kernel():
    """CUDA-event time of many back-to-back calls, the op on its shipped object against the op on cute.compile's
    code: within 2 % (bench_ppo_loss.py prints the table, with the PyTorch path beside)."""
    sys.path.insert(0, str(HERE))
    from bench_ppo_loss import compare

    rows = compare(rounds=5)
    for row in rows:
        print(row)
    slower = [row for row in rows if row["shipped_ms"] > row["jit_ms"] * 1.02]
    assert not slower, f"shipped code more than 2 % slower than cute.compile's: {slower}"
