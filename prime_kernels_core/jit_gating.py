"""Gating for JIT kernels (Triton, CuTe DSL): the library and its version, the interpreter, the device's capability,
and which shipped code serves a device. Reads installed metadata and the build record only: the library is never
imported here, so discovery and status never start a compiler or a driver."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from . import jit_manifest, jit_runtime
from .manifest import arch_runs_on

# Triton reads it once, at import: set before Python starts, every @triton.jit function is interpreted on the CPU.
INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """Whether this process runs Triton kernels through Triton's interpreter (how Triton itself reads the variable)."""
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def library_reason(spec) -> str | None:
    """Why the installed library cannot run ``spec`` (absent, or a version outside its range), from metadata only."""
    library, clauses = jit_manifest.requirement(spec.jit)
    wanted = f"{library} {clauses}".strip()
    try:
        version = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return (f"{spec.name} is a {spec.jit['language']} kernel and needs {wanted}, which is not installed; "
                f"pip install '{library}{clauses.replace(' ', '')}'")
    found = jit_manifest.release(version)
    if clauses and (found is None or not jit_manifest.satisfies(found, jit_manifest.parse_clauses(clauses))):
        return (f"{spec.name} supports {wanted} but {library} {version} is installed; install a {library} in that "
                f"range, or a build of {spec.distribution} that supports {library} {version}")
    return None


def _cpu_reason(spec) -> str | None:
    paths = spec.jit.get("cpu", [])
    if "interpreter" in paths and interpreting():
        if importlib.util.find_spec("numpy") is None:
            return f"{spec.name} runs on the CPU through Triton's interpreter, which needs numpy; pip install numpy"
        return None
    if "pytorch" in paths:
        return None
    if "interpreter" in paths:
        return (f"{spec.name} runs on the CPU only through Triton's interpreter, and {INTERPRET_ENV} is not set; start "
                f"Python with {INTERPRET_ENV}=1 (that process then runs no Triton kernel on a GPU)")
    return f"{spec.name} has no CPU implementation (its kernel.toml's cpu lists none)"


def _capability_reason(spec, target) -> str | None:
    if spec.jit["language"] == "triton" and interpreting():
        return (f"{INTERPRET_ENV}=1 is set: Triton runs every kernel of this process through its interpreter on the "
                f"CPU, never on a GPU; unset it to run {spec.name} on CUDA")
    rule = spec.jit["capability"]
    if not jit_manifest.satisfies(tuple(target.capability), jit_manifest.parse_clauses(rule)):
        device = "sm_{}{}".format(*target.capability)
        return (f"{spec.name} runs on compute capability {rule} (its kernel.toml), but the device is {device} "
                f"(capability {target.capability[0]}.{target.capability[1]})")
    return None


def reason(spec, target) -> str | None:
    """Rules 4-7 for a JIT kernel: its library (absent, out of range), where it would run (no device, the CPU without
    a CPU path, a capability outside its rule), each one sentence. ``target`` is a registry.Target or a sentence."""
    found = library_reason(spec)
    if found:
        return found
    if isinstance(target, str):
        return target
    if target.kind == "cpu":
        return _cpu_reason(spec)
    import torch

    if torch.version.cuda is None:
        return f"{spec.name} runs on CUDA devices, but this process runs a CPU-only torch; use device 'cpu'"
    return _capability_reason(spec, target)


def kernel_record(spec) -> dict | None:
    """This kernel's entry of its build record when it is a well-formed JIT entry, else None (no shipped code)."""
    record = spec.build
    kernel = record.get("kernels", {}).get(spec.name) if isinstance(record, dict) else None
    if not isinstance(kernel, dict) or not isinstance(kernel.get("shipped"), list):
        return None
    return kernel


def shipped_archs(spec) -> list[str]:
    """The archs this install ships ahead-of-time code for (none without a build record)."""
    kernel = kernel_record(spec)
    return list(kernel.get("archs", [])) if kernel else []


def _shipped_release_reason(spec) -> str | None:
    """For a CuTe DSL kernel: why its shipped objects do not serve the installed DSL (they serve the release and the
    libraries' CUDA flavour that compiled them, cute_runtime), from metadata and the build record only."""
    kernel = kernel_record(spec)
    if spec.jit["language"] != "cute-dsl" or not kernel or not kernel["shipped"]:
        return None
    library, _ = jit_manifest.requirement(spec.jit)
    try:
        installed = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None
    built = kernel.get("library_version")
    if installed != built:
        return f"its shipped code was compiled by {library} {built} and {library} {installed} is installed"
    flavor = kernel.get("library_flavor")
    try:
        importlib.metadata.version(f"{library}-libs-{flavor}")
    except importlib.metadata.PackageNotFoundError:
        return f"its shipped code was compiled with {library}'s {flavor} libraries, which are not installed"
    return None


def note(spec, target) -> str | None:
    """For a kernel that can run on ``target``: a sentence when its first call there will compile (no shipped code for
    the device, shipped code turned off, or a call that already fell back in this process), else None."""
    if isinstance(target, str) or target.kind != "cuda":
        return None
    fallbacks = jit_runtime.fallbacks().get(spec.name)
    if fallbacks:
        return f"{spec.name} compiled with {spec.jit['language']} at run time in this process: " + "; ".join(fallbacks)
    if not jit_runtime.shipped_code_enabled():
        return f"{jit_runtime.SHIPPED_ENV}=0 turns shipped code off: {spec.name} compiles on its first call"
    stale = _shipped_release_reason(spec)
    if stale:
        return f"{spec.name} compiles on its first call: {stale}"
    device = "sm_{}{}".format(*target.capability)
    archs = shipped_archs(spec)
    if not any(arch_runs_on(a, tuple(target.capability)) for a in archs):
        shipped = f"it ships code for {', '.join(archs)}" if archs else "this install ships no compiled code for it"
        return f"{spec.name} compiles on its first call on {device} ({spec.jit['language']} JIT): {shipped}"
    return None
