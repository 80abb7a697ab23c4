"""Triton's own JIT, aimed at a named target on a machine without a GPU.

``compiled_by_the_jit(fn, arch, args, kwargs)`` runs ``fn.warmup(*args, **kwargs)``: Triton's JIT derives the
specialization from the arguments exactly as for a launch (each argument's type, ``tt.divisibility 16`` for a
16-byte aligned tensor unless the function says ``do_not_specialize_on_alignment``, an integer's value class unless it
says ``do_not_specialize``, the constexprs, the options: ``num_warps``, ``num_stages``, ``debug``, instrumentation) and
compiles it, without launching. Only the device is replaced: a driver that reports ``GPUTarget("cuda", capability, 32)``
(what Triton's CUDA driver reports for such a device) and a new device identity for every call, so the function's
in-memory kernel cache (kept per device) never answers: each call compiles, or reads Triton's on-disk cache, as a new
process's first launch does, and two calls compared in one process are two compiles. The build ships what this
returns, and the tests compare it with a call's.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager

from .manifest import capability_of


def target_capability(arch: str) -> int:
    """``"9.0a"`` -> 90: the capability Triton's GPUTarget names (Triton picks sm_90a for 90 itself)."""
    major, minor = capability_of(arch)
    return major * 10 + minor


_calls = itertools.count()


@contextmanager
def _driver_for(arch: str):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    device = f"prime-kernels-target-{arch}-{next(_calls)}"

    class NamedTargetDriver(CudaDriver):
        """Triton's CUDA driver as seen from a device of ``arch``: no libcuda, no launcher build (never launches)."""

        def __init__(self):  # CudaDriver's own loads libcuda and compiles its launcher utilities
            pass

        def get_current_target(self):
            return GPUTarget("cuda", target_capability(arch), 32)

        def get_current_device(self):
            return device

        def get_current_stream(self, device=None):
            return 0

    previous = driver._active  # None until a process first asks for its driver: restored as it was
    driver.set_active(NamedTargetDriver())
    try:
        yield
    finally:
        driver.set_active(previous)


def compiled_by_the_jit(fn, arch: str, args: tuple, kwargs: dict):
    """Triton's CompiledKernel of JIT function ``fn`` for a call ``fn[grid](*args, **kwargs)`` on a device of ``arch``
    ("9.0a"): tensors may be CPU tensors (only their dtype and address count) or torch dtypes (an aligned tensor)."""
    with _driver_for(arch):
        return fn.warmup(*args, grid=(1,), **kwargs)


def machine_code(cubin: bytes) -> str:
    """The SASS of a cubin, by the cuobjdump Triton bundles: what the GPU runs, without the debug sections (their line
    table names the source file's path, which differs between a build's source tree and an installed package)."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", file.name], check=True, capture_output=True,
                              text=True).stdout
