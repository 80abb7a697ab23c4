"""``cute.compile`` of a CuTe DSL function for one manifest specialization: the same fake arguments for the build
(without a GPU, for a named arch) and for a JIT fallback at run time (for the device), so a fallback compiles what the
build would have shipped for that call. Imports the DSL: called by the build's per-arch child and by cute_runtime only.
"""
from __future__ import annotations

import inspect
import re
import sys

from . import cute_signature


def gpu_arch(arch: str) -> str:
    """``"9.0a"`` -> ``"sm_90a"``, as ``--gpu-arch`` and ``CUTE_DSL_ARCH`` spell it."""
    return "sm_" + arch.replace(".", "")


def library_flavor() -> str | None:
    """The CUDA toolkit flavour of the DSL's libraries this process runs ("cu12", "cu13"): the DSL installs one per
    libs wheel and loads the newest the driver supports (without a driver, the newest installed), so the same release
    may compile with, and link objects against, either. Read from the module it loaded; None when it cannot tell."""
    import cutlass  # noqa: F401  loads the flavour

    loaded = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    found = re.search(r"\.(cu\d+)\.", getattr(loaded, "__file__", "") or "")
    return found[1] if found else None


def parameters(fn) -> list[str]:
    """The parameter names of a ``@cute.jit`` function (the DSL keeps the Python function)."""
    return list(inspect.signature(fn).parameters)


def check_covers(fn, specialization: dict) -> None:
    """The specialization gives every parameter of ``fn`` exactly once: a signature entry or a constexpr."""
    given = set(specialization["signature"]) | set(specialization["constexprs"])
    off = sorted(given ^ set(parameters(fn)))
    if off or set(specialization["signature"]) & set(specialization["constexprs"]):
        raise ValueError(f"{fn.__name__}'s parameters are {parameters(fn)}; the specialization's signature and "
                         f"constexprs do not cover them exactly once (off: {off})")


def _fake(parsed: dict, symbols: dict, align: int | None):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if "stream" in parsed:
        return make_fake_stream()
    if "scalar" in parsed:
        return getattr(cutlass, parsed["scalar"])(0)
    shape = tuple(static if static is not None else symbols.setdefault(name, cute.sym_int())
                  for name, static in parsed["modes"])
    rank = len(shape)
    return make_fake_compact_tensor(getattr(cutlass, parsed["tensor"]), shape,
                                    stride_order=tuple(rank - 1 - i for i in range(rank)),  # row-major, as torch's
                                    assumed_align=align)


def fake_arguments(fn, specialization: dict) -> list:
    """The positional compile arguments of ``fn`` (every non-constexpr parameter, in order) for ``specialization``
    ({"signature", "constexprs", "align"}, one dtype chosen): fake tensors with shared symbolic extents, typed scalars,
    a fake stream."""
    check_covers(fn, specialization)
    symbols: dict = {}
    signature, constexprs = specialization["signature"], specialization["constexprs"]
    return [_fake(cute_signature.parse(signature[name], constexprs), symbols, specialization.get("align"))
            for name in parameters(fn) if name in signature]


def compile_specialization(fn, specialization: dict, arch: str | None = None):
    """``cute.compile`` of ``fn`` for ``specialization``: for ``arch`` ("9.0a") when given (the build: the process must
    have ``CUTE_DSL_ARCH`` set to it, see cute_build), else for the current device (a JIT fallback)."""
    import cutlass.cute as cute

    options = {"options": f"--gpu-arch {gpu_arch(arch)}"} if arch else {}
    return cute.compile(fn, *fake_arguments(fn, specialization), **specialization["constexprs"], **options)
