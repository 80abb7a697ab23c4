"""Running a CuTe DSL kernel's ``@cute.jit`` functions: the object its wheel ships where it serves the call, else
``cute.compile`` on the device.

``call(kernel, fn, args, constexprs)`` is what a kernel module calls instead of compiling and calling ``fn`` itself:
``args`` are ``fn``'s runtime parameters in order without the stream (torch tensors, Python scalars; the current torch
stream is passed where the manifest's signature says ``"stream"``), ``constexprs`` its constexpr parameters by name.

What serves a call is decided once per process for each function, specialization (every tensor's element type and
rank, the constexprs, whether the tensors keep the manifest's alignment) and device, and kept:

- the call's specialization is the manifest's for those types, or (not listed) the function's first one with the
  call's element types and constexprs, so a JIT fallback compiles what the build would have shipped for it;
- shipped code serves it when the build record has an object for that specialization whose arch runs on the device,
  compiled by the installed nvidia-cutlass-dsl release with the CUDA flavour of libraries this process runs (the
  objects link against those runtime libraries, whose ABI between releases and flavours is not promised), and
  ``cute.runtime.load_module`` loads it (once per object and process: the DSL links it in-process, no compiler);
- otherwise ``cute.compile`` on the device, saying why once (a warning, and ``jit_runtime.fallbacks()``, which status
  notes show).

Both give the DSL's own compiled-function object, called the same way (``from_dlpack`` views, scalars, the stream), so
steady state is the same host and device code either way. The loaded object does not check element types (a float16
tensor given to a bfloat16 object reaches the GPU): the specialization key does.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
from functools import lru_cache
from pathlib import Path

from . import cute_signature, jit_manifest, jit_runtime, manifest

LIBRARY = jit_manifest.LIBRARY_OF["cute-dsl"]
TERMINAL_COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # the DSL's error messages are coloured for a terminal


@lru_cache(maxsize=None)
def _table(package: str, kernel: str) -> dict:
    return manifest.load(manifest.package_dir(package))["kernels"][kernel]


@lru_cache(maxsize=None)
def _specializations(package: str, kernel: str, function: str) -> tuple:
    """The manifest's specializations of ``function``, expanded (one per dtype and constexpr value)."""
    table = _table(package, kernel)
    return tuple(s for spec in table.get("specializations", []) if spec["function"] == function
                 for s in jit_manifest.expanded(spec))


def _runtime_parameters(signature: dict) -> list[str]:
    """The parameters a caller passes, in order: every signature entry but the stream."""
    return [name for name, kind in signature.items() if kind != cute_signature.STREAM]


def describe(value) -> tuple | str:
    """What of an argument decides its specialization: (element type, rank) of a tensor, a scalar's Python type."""
    import torch

    if isinstance(value, torch.Tensor):
        return _element_types().get(value.dtype, str(value.dtype)), value.dim()
    return type(value).__name__


@lru_cache(maxsize=None)
def _element_types() -> dict:
    import torch

    return {getattr(torch, name): kind for name, kind in cute_signature.TORCH_TO_CUTE.items() if hasattr(torch, name)}


def specialization_for(package: str, kernel: str, function: str, described: tuple, constexprs: dict,
                       aligned: bool) -> dict:
    """The specialization of a call whose arguments are ``described`` (describe, in order): the manifest's when it
    lists one, else the function's first with the call's element types and constexprs (and no alignment assumed when
    the call's tensors break it)."""
    listed = _specializations(package, kernel, function)
    if not listed:
        raise ValueError(f"{kernel}: kernel.toml lists no specialization of {function}, so nothing says how to compile "
                         "it (its tensors' modes, scalars, stream)")
    template = listed[0]
    names = _runtime_parameters(template["signature"])
    if len(names) != len(described):
        raise ValueError(f"{function} takes {len(names)} arguments ({', '.join(names)}), got {len(described)}")
    signature = dict(template["signature"])
    for name, found in zip(names, described):
        parsed = cute_signature.parse(signature[name], {**template["constexprs"], **constexprs})
        if "tensor" not in parsed:
            if isinstance(found, tuple):
                raise ValueError(f"{function}: {name} must be a {signature[name]} scalar, got a tensor")
            continue
        if not isinstance(found, tuple) or found[1] != len(parsed["modes"]):
            raise ValueError(f"{function}: {name} must be a {len(parsed['modes'])}-D tensor ({signature[name]}), "
                             f"got {found}")
        if found[0] not in cute_signature.ELEMENT_BYTES:
            raise ValueError(f"{function}: {name}'s dtype {found[0]} has no CuTe DSL element type")
        signature[name] = signature[name].replace(parsed["tensor"], found[0], 1)
    call = {"function": function, "signature": signature, "constexprs": dict(constexprs)}
    if aligned and "align" in template:
        call["align"] = template["align"]
    return next((s for s in listed if s == call), call)


def _key(specialization: dict) -> str:
    return json.dumps(specialization, sort_keys=True)


@lru_cache(maxsize=None)
def _record(package: str, kernel: str) -> dict:
    record = manifest.read_build_record(manifest.package_dir(package))
    entry = record.get("kernels", {}).get(kernel, {}) if isinstance(record, dict) else {}
    return entry if isinstance(entry, dict) else {}


@lru_cache(maxsize=None)
def _shipped_index(package: str, kernel: str) -> dict:
    """{specialization key: [shipped entries, one per arch]} of ``kernel`` in the installed ``package``'s record."""
    folder = manifest.package_dir(package)
    index: dict = {}
    for entry in _record(package, kernel).get("shipped", []):
        specialization = {k: entry[k] for k in ("function", "signature", "constexprs", "align") if k in entry}
        index.setdefault(_key(specialization), []).append(dict(entry, path=str(folder / entry["file"])))
    return index


def _library_reason(package: str, kernel: str) -> str:
    """Why this process's DSL cannot run this kernel's shipped objects ("" when it can): another release, or the same
    release running its libraries of another CUDA flavour (an object links against the libraries it was built with)."""
    from . import cute_compile

    record = _record(package, kernel)
    built = record.get("library_version")
    try:
        installed = importlib.metadata.version(LIBRARY)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if built != installed:
        return (f"the shipped code was compiled by {LIBRARY} {built} and {LIBRARY} {installed} is installed "
                "(an object links against its own release's runtime libraries)")
    flavor = cute_compile.library_flavor()
    if record.get("library_flavor") != flavor:
        return (f"the shipped code was compiled by {LIBRARY} {built} with its {record.get('library_flavor')} "
                f"libraries and this process runs its {flavor} libraries")
    return ""


def _best_for(entries: list[dict], capability: tuple[int, int]) -> dict | None:
    """The shipped entry whose arch runs best on ``capability``: arch-specific first, then the highest plain arch."""
    runs = [e for e in entries if manifest.arch_runs_on(e["arch"], capability)]
    return max(runs, key=lambda e: (e["arch"].endswith("a"), manifest.capability_of(e["arch"])), default=None)


@lru_cache(maxsize=None)
def _module(path: str):
    """The DSL's module of one shipped object, loaded once per process."""
    import cutlass.cute as cute

    return cute.runtime.load_module(path)


def _describe_specialization(specialization: dict) -> str:
    return ", ".join([f"{n} {k}" for n, k in specialization["signature"].items() if k != cute_signature.STREAM]
                     + [f"{k}={v}" for k, v in sorted(specialization["constexprs"].items())]
                     + ([f"aligned to {specialization['align']} bytes"] if "align" in specialization else []))


def shipped_function(package: str, kernel: str, specialization: dict, capability: tuple[int, int]):
    """(the loaded compiled function serving ``specialization`` on a device of ``capability``, "") or (None, why
    none does)."""
    if not jit_runtime.shipped_code_enabled():
        return None, f"{jit_runtime.SHIPPED_ENV}=0 turns shipped code off"
    function = specialization["function"]
    candidates = _shipped_index(package, kernel).get(_key(specialization))
    if not candidates:
        described = _describe_specialization(specialization)
        return None, f"no shipped {function} for this call's specialization ({described})"
    entry = _best_for(candidates, capability)
    if entry is None:
        archs = ", ".join(sorted(e["arch"] for e in candidates))
        return None, f"no shipped {function} runs on sm_{capability[0]}{capability[1]} (shipped for {archs})"
    why = _library_reason(package, kernel)
    if why:
        return None, why
    try:
        return getattr(_module(entry["path"]), entry["prefix"]), ""
    except Exception as exc:  # an object this DSL cannot load falls back to the JIT, with the DSL's words
        words = " ".join(TERMINAL_COLOURS.sub("", str(exc)).split())[:300]
        return None, f"{LIBRARY} did not load the shipped {Path(entry['path']).name}: {type(exc).__name__}: {words}"


class Plan:
    """How calls of one specialization on one device run: the compiled function and where its arguments go. Each plan
    has a compiled-function object of its own (``getattr`` on a loaded module makes a new one; a fallback compiles
    one): the DSL binds it to the device current at its first call, which call() makes the tensors' device."""

    def __init__(self, compiled, specialization: dict, shipped: bool):
        import cuda.bindings.driver as cuda
        from cutlass.cute.runtime import from_dlpack

        self.compiled, self.specialization, self.shipped = compiled, specialization, shipped
        self.from_dlpack, self.stream_type = from_dlpack, cuda.CUstream  # looked up once, not per call
        signature = specialization["signature"]
        self.stream_at = next((i for i, k in enumerate(signature.values()) if k == cute_signature.STREAM), None)
        self.align = specialization.get("align")
        self.names = _runtime_parameters(signature)
        self.static = [(i, mode, extent) for i, name in enumerate(self.names)
                       for mode, (_, extent) in enumerate(cute_signature.parse(signature[name],
                                                                               specialization["constexprs"]).get(
                                                                                   "modes", []))
                       if extent is not None]

    def run(self, args: tuple, device) -> None:
        import torch

        views = []
        for name, value in zip(self.names, args):
            if isinstance(value, torch.Tensor):
                if not value.is_contiguous():
                    raise ValueError(f"{self.specialization['function']}: {name} must be contiguous (the compiled "
                                     f"code assumes a compact row-major layout), got strides {value.stride()}")
                value = self.from_dlpack(value, assumed_align=self.align)
            views.append(value)
        for i, mode, extent in self.static:
            if args[i].shape[mode] != extent:
                raise ValueError(f"{self.specialization['function']}: {self.names[i]}'s mode {mode} is compiled for "
                                 f"{extent}, got {args[i].shape[mode]}")
        if self.stream_at is not None:
            views.insert(self.stream_at, self.stream_type(torch.cuda.current_stream(device).cuda_stream))
        self.compiled(*views)  # the constexprs are compiled in


_plans: dict[tuple, Plan] = {}


def _aligned(args: tuple, align: int | None) -> bool:
    import torch

    return align is None or all(a.data_ptr() % align == 0 for a in args if isinstance(a, torch.Tensor))


@lru_cache(maxsize=None)
def _template_align(package: str, kernel: str, function: str) -> int | None:
    listed = _specializations(package, kernel, function)
    return listed[0].get("align") if listed else None


def plan(kernel: str, fn, args: tuple, constexprs: dict, device) -> Plan:
    """The plan of this call's specialization on ``device``: decided on its first call, kept afterwards."""
    import torch

    package, function = fn.__module__.split(".")[0], fn.__name__
    index = device.index if device.index is not None else torch.cuda.current_device()
    aligned = _aligned(args, _template_align(package, kernel, function))
    described = tuple(describe(a) for a in args)
    key = (package, kernel, function, index, jit_runtime.shipped_code_enabled(), aligned, described,
           tuple(constexprs.items()))
    found = _plans.get(key)
    if found is None:
        found = _plans[key] = _new_plan(package, kernel, fn, described, constexprs, aligned, index)
    return found


def _new_plan(package: str, kernel: str, fn, described: tuple, constexprs: dict, aligned: bool, index: int) -> Plan:
    import torch

    specialization = specialization_for(package, kernel, fn.__name__, described, constexprs, aligned)
    compiled, why = shipped_function(package, kernel, specialization, torch.cuda.get_device_capability(index))
    if compiled is not None:
        return Plan(compiled, specialization, shipped=True)
    if not aligned and not why.startswith(jit_runtime.SHIPPED_ENV):
        why = (f"{why}: a tensor of this call is not {_template_align(package, kernel, fn.__name__)}-byte aligned, "
               "and the shipped code is compiled for aligned tensors")
    jit_runtime._fell_back(kernel, why)
    from . import cute_compile

    with torch.cuda.device(index):
        return Plan(cute_compile.compile_specialization(fn, specialization), specialization, shipped=False)


def call(kernel: str, fn, args: tuple, constexprs: dict) -> None:
    """Run ``@cute.jit`` function ``fn`` of ``kernel`` on CUDA tensors ``args`` (its runtime parameters in order,
    without the stream) and ``constexprs``: shipped code where it serves the call, else ``cute.compile`` (see the
    module's docstring)."""
    import torch

    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    found = plan(kernel, fn, args, constexprs, device)
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device.index):  # the DSL launches on the current device, the tensors' must be it
            found.run(args, device)
        return
    found.run(args, device)
