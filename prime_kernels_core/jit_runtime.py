"""Running a JIT kernel's functions: the code its wheel ships where it serves the call, else the library's JIT.

``launch(kernel, fn, grid, args, constexprs)`` is what a kernel module calls instead of ``fn[grid](*args, **constexprs)``:

- under tracing (FakeTensorMode, torch.compile's functionalization: tensor subclasses), it goes through
  ``torch.library.wrap_triton`` so that the op's fake runs and Inductor sees the kernel;
- on CUDA tensors, it looks up the shipped cubin compiled at wheel build time for this function, specialization
  (every argument's Triton type, the constexprs) and device, and launches it with torch's static launcher
  (``torch._C._StaticCudaLauncher``, the C++ launcher Inductor uses for its own Triton kernels): loading and launching
  a cubin, nothing compiled, no Triton launcher built. Where nothing shipped serves the call, it calls the library's
  JIT (``fn[grid]``), and says why once (a warning, and ``fallbacks()``, which status notes show);
- on CPU tensors, ``fn[grid]`` too: Triton's interpreter, when the process runs with TRITON_INTERPRET=1.

Launch options (``num_warps``, ``num_stages``) come from the manifest's ``launch.<function>`` table, the same the
build compiled with, so shipped code and a JIT fallback run the same configuration.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache
from pathlib import Path

from . import manifest

# "0" turns shipped code off: every JIT kernel compiles on its first call (for measuring a cold JIT, or a bad build).
SHIPPED_ENV = "PRIME_KERNELS_AOT"
# Where the build puts shipped code inside the package (one file per function, specialization and arch).
SHIPPED_DIR = "_aot"
# Triton's JIT specializes a pointer on 16-byte alignment (tt.divisibility 16): shipped code compiled so (the record's
# "aligned" parameters) serves only calls whose tensors are.
POINTER_ALIGNMENT = 16
# The element type Triton's JIT gives a tensor of each torch dtype (by the dtype's name in torch).
TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int8": "i8",
                   "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "u1",
                   "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
# The argument type characters of torch's static launcher (torch/csrc/inductor/static_launcher/cuda.cpp) for each
# scalar Triton type it passes bit-exactly; every pointer is "O" (a tensor, or None for a null pointer). It writes a
# 16-bit float scalar as a float, so a function taking one is not shipped (jit_build refuses it).
LAUNCHER_CHARS = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
                  "u32": "I", "u64": "K", "fp32": "f", "fp64": "d"}

_fallbacks: dict[str, list[str]] = {}


def shipped_code_enabled() -> bool:
    return os.environ.get(SHIPPED_ENV, "1").strip() != "0"


def fallbacks() -> dict[str, list[str]]:
    """{kernel: why a call compiled at run time instead of using shipped code}, each sentence once, in this process."""
    return {kernel: list(sentences) for kernel, sentences in _fallbacks.items()}


def _fell_back(kernel: str, sentence: str) -> None:
    """Say once per process and sentence that a call compiles with the JIT instead of running shipped code."""
    said = _fallbacks.setdefault(kernel, [])
    if sentence not in said:
        said.append(sentence)
        warnings.warn(f"prime-kernels: {kernel}: {sentence}; compiling it now (seconds, once per process and "
                      "specialization)", RuntimeWarning, stacklevel=4)


def launcher_arg_types(params: list[list[str]], scratch: int) -> str:
    """The static launcher's type string for a shipped function: one character per runtime parameter, in order, then
    one "O" per trailing scratch pointer Triton appends to every kernel (passed as null)."""
    return "".join("O" if kind.startswith("*") else LAUNCHER_CHARS[kind] for _, kind in params) + "O" * scratch


def triton_type(value) -> str | None:
    """The Triton type Triton's JIT gives an argument (``*bf16`` for a bfloat16 tensor, ``i32`` for a small int), or
    None for a value it has no scalar type for."""
    import torch

    if isinstance(value, torch.Tensor):
        name = _element_types().get(value.dtype)
        return f"*{name}" if name else None
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else ("i64" if -2**63 <= value < 2**63 else "u64")
    if isinstance(value, float):
        return "fp32"
    return None


@lru_cache(maxsize=None)
def _element_types() -> dict:
    import torch

    return {getattr(torch, name): kind for name, kind in TORCH_TO_TRITON.items() if hasattr(torch, name)}


def _key(function: str, params: list, constexprs: dict) -> tuple:
    return function, tuple(tuple(p) for p in params), tuple(sorted(constexprs.items()))


@lru_cache(maxsize=None)
def _shipped_index(package: str, kernel: str) -> dict:
    """{specialization key: [shipped entries, one per arch]} of ``kernel`` in the installed ``package``'s record."""
    folder = manifest.package_dir(package)
    record = manifest.read_build_record(folder)
    entry = record.get("kernels", {}).get(kernel, {}) if isinstance(record, dict) else {}
    index: dict = {}
    for shipped in entry.get("shipped", []) if isinstance(entry, dict) else []:
        names = [name for name, _ in shipped["params"]]
        shipped = dict(shipped, arg_types=launcher_arg_types(shipped["params"], shipped["scratch"]),
                       path=str(folder / shipped["file"]), aligned_at=[names.index(n) for n in shipped["aligned"]])
        index.setdefault(_key(shipped["function"], shipped["params"], shipped["constexprs"]), []).append(shipped)
    return index


@lru_cache(maxsize=None)
def _options(package: str, kernel: str, function: str) -> dict:
    table = manifest.load(manifest.package_dir(package))["kernels"][kernel]
    return dict(table.get("launch", {}).get(function, {}))


def _best_for(entries: list[dict], capability: tuple[int, int]) -> dict | None:
    """The shipped entry whose arch runs best on ``capability``: arch-specific first, then the highest plain arch."""
    runs = [e for e in entries if manifest.arch_runs_on(e["arch"], capability)]
    return max(runs, key=lambda e: (e["arch"].endswith("a"), manifest.capability_of(e["arch"])), default=None)


@lru_cache(maxsize=None)
def _loaded(path: str, name: str, shared: int, device: int) -> tuple[int | None, str]:
    """(the CUfunction of a shipped cubin on ``device``, "") or (None, why the driver did not load it): tried once per
    process and device, and never unloaded."""
    import torch

    try:
        loaded = torch._C._StaticCudaLauncher._load_kernel(path, name, shared, device)
    except Exception as exc:  # a cubin this driver cannot load falls back to the JIT, with the driver's words
        return None, f"the driver did not load the shipped {Path(path).name}: {type(exc).__name__}: {exc}"
    return loaded[-3], ""  # (module, function, n_regs, n_spills) since torch 2.8; (function, n_regs, n_spills) before


def traced(args: tuple) -> bool:
    """Whether the call is being traced (fake or functional tensors, torch.compile): then only wrap_triton will do."""
    import torch

    plain = (torch.Tensor, torch.nn.Parameter)
    return torch.compiler.is_compiling() or any(isinstance(a, torch.Tensor) and type(a) not in plain for a in args)


def _shipped_entry(package: str, kernel: str, function: str, arg_names: list, args: tuple, constexprs: dict,
                   device) -> tuple[dict | None, str]:
    """(the shipped entry compiled for this call's specialization and device, "") or (None, why none is): what the
    arguments' types, the constexprs and the device decide, the same for every call that shares them."""
    import torch

    if not hasattr(torch._C, "_StaticCudaLauncher"):
        return None, f"torch {torch.__version__} has no static CUDA launcher (torch._C._StaticCudaLauncher) to load shipped code"
    names = [n for n in arg_names if n not in constexprs]
    params = [[n, triton_type(a)] for n, a in zip(names, args)]
    candidates = _shipped_index(package, kernel).get(_key(function, params, constexprs))
    if not candidates:
        described = ", ".join(f"{n} {t}" for n, t in params) + "".join(f", {k}={v}" for k, v in sorted(constexprs.items()))
        return None, f"no shipped {function} for this call's specialization ({described})"
    capability = torch.cuda.get_device_capability(device)
    entry = _best_for(candidates, capability)
    if entry is None:
        archs = ", ".join(sorted(e["arch"] for e in candidates))
        return None, f"no shipped {function} runs on sm_{capability[0]}{capability[1]} (shipped for {archs})"
    return entry, ""


def _misaligned(entry: dict, args: tuple) -> str:
    """Why this call's tensors break the alignment ``entry`` was compiled for ("" when they keep it): the address is
    the one thing of the specialization that changes from call to call."""
    off = [entry["params"][i][0] for i in entry["aligned_at"] if args[i].data_ptr() % POINTER_ALIGNMENT]
    if not off:
        return ""
    return (f"{', '.join(off)} is not {POINTER_ALIGNMENT}-byte aligned, and the shipped {entry['function']} is "
            "compiled for aligned pointers as Triton's JIT is for aligned tensors")


def _shipped_miss(package: str, kernel: str, function: str, arg_names: list, args: tuple, constexprs: dict,
                  device) -> tuple[dict | None, str]:
    """(the shipped entry serving this call, "") or (None, why none does)."""
    if not shipped_code_enabled():
        return None, f"{SHIPPED_ENV}=0 turns shipped code off"
    entry, why = _shipped_entry(package, kernel, function, arg_names, args, constexprs, device)
    why = why or _misaligned(entry, args)
    return (None, why) if why else (entry, "")


def _device_index(device) -> int:
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def _load_shipped(entry: dict, device) -> tuple[int | None, str]:
    """(the CUfunction, "") or (None, why the driver would not load the shipped cubin)."""
    return _loaded(entry["path"], entry["name"], entry["shared"], _device_index(device))


# {(package, kernel, function, device index, argument types, constexprs): (entry, CUfunction, "") or (None, None, why)}:
# what serves a call is decided once per specialization and device, so a launch costs a dict lookup, the alignment
# check and the launch itself (a training step launches the same specialization thousands of times).
_plans: dict[tuple, tuple] = {}


def _plan(package: str, kernel: str, fn, args: tuple, constexprs: dict, device) -> tuple:
    key = (package, kernel, fn.fn.__name__, _device_index(device), tuple(map(triton_type, args)),
           tuple(constexprs.items()))
    plan = _plans.get(key)
    if plan is None:
        entry, why = _shipped_entry(package, kernel, fn.fn.__name__, fn.arg_names, args, constexprs, device)
        function = None
        if entry is not None:
            function, why = _load_shipped(entry, device)
        plan = _plans[key] = (entry if function is not None else None, function, why)
    return plan


def _run_shipped(entry: dict, function: int, grid: tuple, args: tuple, device) -> None:
    import torch

    index = _device_index(device)
    if index != torch.cuda.current_device():  # the function lives in its device's context, the launch uses the current
        with torch.cuda.device(index):
            _run_shipped(entry, function, grid, args, device)
        return
    grid = (*grid, 1, 1)[:3]
    torch._C._StaticCudaLauncher._launch_kernel(
        function, grid[0], grid[1], grid[2], entry["num_warps"], entry["shared"],
        entry["arg_types"], (*args, *[None] * entry["scratch"]),
        torch._C._cuda_getCurrentRawStream(index))  # the current stream's handle, as Inductor's launches take it


def launch(kernel: str, fn, grid: tuple, args: tuple, constexprs: dict) -> None:
    """Run JIT function ``fn`` of ``kernel`` over ``grid`` with runtime ``args`` (in parameter order) and ``constexprs``
    (by name): shipped code where it serves the call, else the library's JIT (see the module's docstring)."""
    package, name = fn.fn.__module__.split(".")[0], fn.fn.__name__  # JITFunction and InterpretedFunction keep .fn
    options = _options(package, kernel, name)
    if traced(args):
        import torch

        torch.library.wrap_triton(fn)[grid](*args, **constexprs, **options)
        return
    device = next((a.device for a in args if hasattr(a, "device")), None)
    if device is not None and device.type == "cuda":
        if shipped_code_enabled():
            entry, function, why = _plan(package, kernel, fn, args, constexprs, device)
            why = why or _misaligned(entry, args)
            if not why:
                _run_shipped(entry, function, grid, args, device)
                return
        else:
            why = f"{SHIPPED_ENV}=0 turns shipped code off"
        _fell_back(kernel, why)
    fn[grid](*args, **constexprs, **options)
