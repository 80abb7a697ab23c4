"""The build kit: a plugin's setup.py is ``setup_plugin()``; everything else comes from its kernel.toml.

Builds ``<package>._C`` with torch.utils.cpp_extension (ninja), and ``<package>._C_stable`` for the kernels whose
manifest says ``stable_abi = "X.Y"`` (compiled with TORCH_TARGET_VERSION at that torch, so that any API outside the
LibTorch stable ABI is a compile error, and with the Python limited API, so that one wheel serves every CPython 3 from
3.10 on): the CPU sources always, so the op schemas exist on every install, and each kernel's CUDA sources only for that kernel's own archs (``-gencode=arch=compute_XX,code=sm_XX``,
machine code only, no PTX): every arch it lists by default (a fat build), or the best of them for each device arch
PRIME_KERNELS_ARCH names. A requested arch a kernel does not support leaves that kernel without code for it, never a
failed build. CUDA is skipped with a message when the toolkit does not suit the installed torch, unless
PRIME_KERNELS_REQUIRE=1. The build record it writes into the package is what the registry gates on without importing
``_C``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import threading
from pathlib import Path

from . import jit_manifest
from .manifest import (
    ARCH_PATTERN, BUILD_RECORD_NAME, DEFAULT_CXX_STD, EXTENSION_MODULE, GPU_CAPABILITIES, MANIFEST_NAME, arch_runs_on,
    capability_of,
    cuda_source_sets, extension_module, load, major_minor, release_tuple, source_paths,
)

ARCH_ENV = "PRIME_KERNELS_ARCH"
REQUIRE_ENV = "PRIME_KERNELS_REQUIRE"
KERNELS_ENV = "PRIME_KERNELS"
# PRIME_KERNELS_ARCH=cpu: no device code at all, a wheel for CPU-only torch (``+cpu...``), whatever toolkit is present.
CPU_ONLY_ARCH = "cpu"
MODULE_INIT = Path(__file__).parent / "csrc" / "module_init.cpp"
# Device-code building blocks every plugin may include (<prime_kernels/sm90.cuh>).
CORE_INCLUDE = Path(__file__).parent / "include"
# The first CUDA release whose nvcc can target each arch-specific major (a fact about nvcc, not a project choice).
NVCC_MIN_FOR_MAJOR = {9: (12, 0), 10: (12, 8), 11: (13, 0), 12: (12, 8)}
# The first CUDA release whose nvcc knows family-specific targets ("10.0f"), whatever the major.
NVCC_MIN_FOR_FAMILY = (12, 9)
# CUDA 13.0 dropped every target below sm_75 (Maxwell, Pascal, Volta).
NVCC_DROPPED_BELOW = {(13, 0): (7, 5)}
# Arch-specific targets ("9.0a") begin with Hopper; older GPUs have plain ones only ("8.0").
FIRST_ARCH_SPECIFIC_MAJOR = 9


class BuildError(RuntimeError):
    """A build that cannot go on: a bad manifest, or a CUDA skip under PRIME_KERNELS_REQUIRE=1."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    torch_version: str
    torch_cuda: str | None
    cuda_home: str | None
    nvcc_version: str | None
    cxx_version: str | None = None


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def detect_toolchain() -> Toolchain:
    import torch
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    nvcc_version = None
    # torch guesses CUDA_HOME from the nvcc on PATH; a wrapper script there yields a directory with no toolkit in it.
    if cuda_home and all(Path(cuda_home, f).exists() for f in TOOLKIT_FILES):
        text = subprocess.run([str(Path(cuda_home, "bin", "nvcc")), "--version"], capture_output=True, text=True).stdout
        found = re.search(r"release (\d+\.\d+)", text)
        nvcc_version = found[1] if found else None
    return Toolchain(
        torch.__version__, torch.version.cuda, cuda_home, nvcc_version, _first_line([os.environ.get("CXX", "c++"), "--version"])
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:2])


@dataclasses.dataclass(frozen=True)
class ArchRequest:
    """The device archs a build is asked for (None: every arch each kernel lists) and how it was asked."""

    archs: tuple[str, ...] | None
    described: str


def arch_request() -> ArchRequest | str:
    """PRIME_KERNELS_ARCH as an ArchRequest (unset: the fat default; ``native``: the visible device; ``cpu``: none),
    or why CUDA cannot be built for it."""
    override = os.environ.get(ARCH_ENV, "").strip()
    if not override:
        return ArchRequest(None, f"every arch each kernel lists ({ARCH_ENV} unset)")
    if override == CPU_ONLY_ARCH:
        return ArchRequest((), f"{ARCH_ENV}={CPU_ONLY_ARCH} (a CPU-only build)")
    if override == "native":
        import torch

        if not torch.cuda.is_available():
            return f"{ARCH_ENV}=native but no CUDA device is visible to the build"
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}.{minor}{'a' if major >= FIRST_ARCH_SPECIFIC_MAJOR else ''}"
        return ArchRequest((arch,), f"{ARCH_ENV}=native ({arch})")
    archs = tuple(a.strip() for a in re.split(r"[;,\s]+", override) if a.strip())
    malformed = [a for a in archs if not ARCH_PATTERN.fullmatch(a)]
    if malformed:
        return f"{ARCH_ENV} names {malformed}, not of the form MAJOR.MINOR[a|f] (e.g. 9.0a)"
    return ArchRequest(archs, f"{ARCH_ENV}={override}")


# What a folder needs to be the CUDA toolkit a build compiles with (detect_toolchain checks the same).
TOOLKIT_FILES = ("bin/nvcc", "include/cuda_runtime.h")


def no_toolkit_reason(cuda_home: str | None) -> str:
    """Why ``cuda_home`` (torch's CUDA_HOME) is no usable toolkit, naming what it lacks and where it came from: torch
    guesses it from the nvcc on PATH when CUDA_HOME is unset, and a wrapper script there yields a folder with a
    bin/nvcc but no headers."""
    if not cuda_home:
        return "no CUDA toolkit was found (CUDA_HOME is unset and no nvcc is on PATH)"
    origin = ("CUDA_HOME" if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
              else "CUDA_HOME is unset, so torch guessed it from the nvcc on PATH")
    missing = [f for f in TOOLKIT_FILES if not Path(cuda_home, f).exists()]
    if missing:
        return (f"no CUDA toolkit was found: {cuda_home} ({origin}) has no {' and no '.join(missing)}; set CUDA_HOME "
                "to the toolkit's folder (e.g. /usr/local/cuda)")
    return f"no CUDA toolkit was found: {Path(cuda_home, 'bin', 'nvcc')} --version names no release ({origin})"


def toolchain_skip_reason(toolchain: Toolchain) -> str | None:
    """Why this toolchain cannot build CUDA extensions for the installed torch at all, or None."""
    if toolchain.torch_cuda is None:
        return f"torch {toolchain.torch_version} is a CPU-only build"
    if not toolchain.nvcc_version:
        return no_toolkit_reason(toolchain.cuda_home)
    if _version_tuple(toolchain.nvcc_version)[0] != _version_tuple(toolchain.torch_cuda)[0]:
        return (
            f"nvcc is CUDA {toolchain.nvcc_version} but torch {toolchain.torch_version} was built with CUDA "
            f"{toolchain.torch_cuda}; the CUDA majors must match"
        )
    return None


def nvcc_arch_reason(nvcc_version: str, arch: str) -> str | None:
    """Why this nvcc cannot target ``arch``, or None."""
    found = ARCH_PATTERN.fullmatch(arch)
    if found[3] == "a" and int(found[1]) < FIRST_ARCH_SPECIFIC_MAJOR:
        return f"{arch} is no nvcc target: arch-specific targets begin with {FIRST_ARCH_SPECIFIC_MAJOR}.0a"
    needed = (0, 0)
    if found[3]:
        needed = max(NVCC_MIN_FOR_MAJOR.get(int(found[1]), (0, 0)), NVCC_MIN_FOR_FAMILY if found[3] == "f" else (0, 0))
    if _version_tuple(nvcc_version) < needed:
        return f"nvcc {nvcc_version} cannot build {arch}; it needs CUDA {needed[0]}.{needed[1]} or newer"
    for release, lowest in NVCC_DROPPED_BELOW.items():
        if _version_tuple(nvcc_version) >= release and capability_of(arch) < lowest:
            return f"nvcc {nvcc_version} cannot build {arch}; CUDA {release[0]}.{release[1]} dropped every arch below {lowest[0]}.{lowest[1]}"
    return None


def best_arch(kernel_archs: list[str], device_arch: str) -> str | None:
    """The kernel arch whose code serves a device of ``device_arch``'s capability best: the same spelling, else
    arch-specific, then family, then plain code of the highest minor; None when none of them runs there."""
    capability = capability_of(device_arch)
    runs = [a for a in kernel_archs if arch_runs_on(a, capability)]
    if device_arch in runs:
        return device_arch
    return max(runs, key=lambda a: (a.endswith("a"), a.endswith("f"), capability_of(a)), default=None)


def kernel_arch_plan(name: str, table: dict, request: ArchRequest, nvcc_version: str, selected: set[str] | None) -> dict:
    """{"archs": what this kernel's CUDA sources are compiled for, "not_built": {listed arch: why not}}."""
    listed = table.get("archs", [])
    if selected is not None and name not in selected:
        why = f"{KERNELS_ENV}={os.environ.get(KERNELS_ENV)} does not name {name}"
        return {"archs": [], "not_built": dict.fromkeys(listed, why)}
    wanted = listed if request.archs is None else {best_arch(listed, d) for d in request.archs} - {None}
    not_built = {a: f"{request.described} did not ask for a device it runs on" for a in listed if a not in wanted}
    archs = []
    for arch in listed:
        if arch in wanted:
            reason = nvcc_arch_reason(nvcc_version, arch)
            if reason:
                not_built[arch] = reason
            else:
                archs.append(arch)
    return {"archs": archs, "not_built": not_built}


def compile_groups(kernels: dict, arch_plans: dict) -> list[dict]:
    """The CUDA compile jobs: each distinct source set with every arch it is compiled for (one nvcc flag set each)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, table in kernels.items():
        sources = cuda_source_sets(table)
        for arch in arch_plans[name]["archs"]:
            groups.setdefault(sources[arch], []).append(arch)
    owners: dict[str, tuple[str, ...]] = {}
    for sources in groups:
        for source in sources:
            if owners.setdefault(source, sources) != sources:
                raise BuildError(f"{source} is in two CUDA source sets ({list(owners[source])} and {list(sources)}); "
                                 "a source file belongs to one set, compiled for all of that set's archs")
    return [{"sources": list(s), "archs": sorted(set(a))} for s, a in groups.items()]


def gencode_flags(archs: list[str]) -> list[str]:
    """One -gencode per arch, machine code only: ``9.0a`` -> ``-gencode=arch=compute_90a,code=sm_90a``."""
    flags = []
    for arch in archs:
        digits = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{digits},code=sm_{digits}")
    return flags


def abi_tag(toolchain: Toolchain, with_cuda: bool, stable_floor: str | None = None) -> str:
    """The wheel's local version: the torch (and CUDA) ABI it imports under: ``cu130torch2.14`` for one exact torch,
    ``cu130torchabi2.11`` when every kernel is on the stable ABI from torch 2.11 on (any later torch, same CUDA major).
    A PEP 440 local label (letters, digits, dots) that pip and uv accept and order like torch's own ``+cu130``."""
    cuda = "cu" + toolchain.torch_cuda.replace(".", "") if with_cuda else "cpu"
    if stable_floor:
        return f"{cuda}torchabi{stable_floor}"
    return f"{cuda}torch{major_minor(toolchain.torch_version)}"


def target_version_define(floor: str) -> str:
    """``-DTORCH_TARGET_VERSION=0x020b000000000000`` for floor ``2.11``: torch's headers then expose only the stable
    API of that release (torch/csrc/stable/version.h packs major and minor into the top two bytes)."""
    major, minor = release_tuple(floor)
    return f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000"


def stable_floor_reason(floor: str, toolchain: Toolchain) -> str | None:
    """Why the installed torch cannot build for the stable ABI floor ``floor``, or None: its headers must know it."""
    building = release_tuple(toolchain.torch_version)
    if building is None or building < release_tuple(floor):
        return (f"stable_abi = \"{floor}\" is newer than torch {toolchain.torch_version}, which builds it; build with "
                f"torch {floor} or newer (its headers define the stable API of every release up to their own)")
    return None


def _build_requirement_includes(requirement: str) -> list[str]:
    if requirement == "cutlass":
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec is None:
            raise BuildError("this plugin needs CUTLASS headers: pip install nvidia-cutlass")
        root = Path(spec.origin).parent / "source"
        return [str(root / "include"), str(root / "tools" / "util" / "include")]
    raise BuildError(f"unknown build requirement {requirement!r}; known: cutlass")


def cuda_library_includes(cuda_home: str | None) -> list[str]:
    """Header dirs of the CUDA libraries torch ships as wheels, when the toolkit lacks them (a toolkit of nvcc and cudart
    only): ATen/cuda/CUDAContext.h includes cuBLAS and cuSPARSE headers."""
    if cuda_home and Path(cuda_home, "include", "cusparse.h").exists():
        return []
    import importlib.util

    nvidia = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (nvidia.submodule_search_locations or [])] if nvidia else []
    return sorted(str(d) for root in roots for d in root.glob("*/include") if (d / "cusparse.h").exists())


def _define_value(kernel: str, key: str, value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    raise BuildError(f"constant {kernel}.{key} must be a number or boolean to be compiled in, found {value!r}")


def _unique(flags: list[str]) -> list[str]:
    """Flags in order, each once (kernels of one plugin often repeat -O3 / -DNDEBUG)."""
    return list(dict.fromkeys(flags))


def _plugin_package(root: Path) -> Path:
    manifests = sorted(root.glob(f"*/{MANIFEST_NAME}"))
    if len(manifests) != 1:
        raise BuildError(f"{root}: expected exactly one <package>/{MANIFEST_NAME}, found {len(manifests)}")
    return manifests[0].parent


def _check_cuda_sources(name: str, table: dict) -> None:
    """Every arch a kernel lists has CUDA sources to compile, and CUDA sources have an arch to be compiled for."""
    sources = table.get("sources", {})
    if (sources.get("cuda") or sources.get("cuda_variants")) and not table.get("archs"):
        raise BuildError(f"kernel {name!r} has CUDA sources but lists no archs to compile them for (archs = [\"9.0a\"])")
    bare = [arch for arch, files in cuda_source_sets(table).items() if not files]
    if bare:
        raise BuildError(f"kernel {name!r} lists archs {bare} with no CUDA sources (sources.cuda or sources.cuda_variants)")


def _check_source_files(root: Path, name: str, table: dict) -> None:
    """Every source a kernel names is a file, whether or not this build compiles CUDA: a missing .cu would otherwise
    go unnoticed wherever no toolkit is found (the wheel comes out CPU-only either way)."""
    missing = [p for p in source_paths(table) if not (root / p).is_file()]
    if missing:
        raise BuildError(f"kernel {name!r} names sources {missing} that are not files under {root} (kernel.toml's "
                         "sources are relative to the project folder, where setup.py is)")


def _selected_kernels() -> set[str] | None:
    """The kernels PRIME_KERNELS names (the only ones built with CUDA), or None when it is unset."""
    named = {n.strip() for n in os.environ.get(KERNELS_ENV, "").split(",") if n.strip()}
    return named or None


def _module_plan(name: str, kernels: dict, groups: list[dict], floor: str | None, std: str) -> dict:
    """One compiled module: its kernels' CPU sources, their CUDA source sets and the flags they compile with."""
    defines = [
        f"-D{kernel.upper()}_{key}={_define_value(kernel, key, value)}"
        for kernel, table in kernels.items()
        for key, value in table.get("constants", {}).items()
    ]
    gather = lambda key: [x for t in kernels.values() for x in t.get(key, [])]
    # The stable module sees only the stable API of its floor; USE_CUDA declares the shim's CUDA stream calls.
    stable = [target_version_define(floor)] if floor else []
    return {
        "name": name,
        "kernels": list(kernels),
        "stable_abi": floor,
        "cpu_sources": [s for t in kernels.values() for s in t.get("sources", {}).get("cpu", [])],
        "cuda_groups": groups,
        "cxx_flags": _unique([std, *gather("extra_cxx_flags"), *defines, *stable]),
        "nvcc_flags": _unique([std, *gather("extra_nvcc_flags"), *defines, *stable, *(["-DUSE_CUDA"] if floor else [])])
        if groups else [],
    }


def _check_one_module_per_source(modules: list[dict]) -> None:
    """A source file is compiled into one module: a stable kernel and an exact-ABI one cannot share it."""
    owners = {}
    for module in modules:
        for source in module["cpu_sources"] + [s for g in module["cuda_groups"] for s in g["sources"]]:
            if owners.setdefault(source, module["name"]) != module["name"]:
                raise BuildError(f"{source} is compiled into both {owners[source]} and {module['name']}; a source file "
                                 "belongs to the stable-ABI kernels or to the others, not to both")


def extension_plan(root: Path, toolchain: Toolchain) -> dict:
    """Everything the build decides from the manifest and toolchain, without compiling (tested on its own)."""
    package_dir = _plugin_package(root)
    manifest = load(package_dir)
    kernels = manifest["kernels"]
    for name, table in kernels.items():
        _check_cuda_sources(name, table)
        _check_source_files(root, name, table)
    floors = {t["stable_abi"] for t in kernels.values() if t.get("stable_abi")}
    floor = floors.pop() if floors else None  # the manifest allows one floor per plugin
    if floor and stable_floor_reason(floor, toolchain):
        raise BuildError(f"{package_dir.name}: {stable_floor_reason(floor, toolchain)}")
    has_cuda_sources = any(cuda_source_sets(t) for t in kernels.values())
    request = arch_request()
    # A plugin without CUDA sources is CPU-only by design, and a CPU-only request asks for no CUDA: nothing is skipped,
    # so PRIME_KERNELS_REQUIRE has no say.
    cpu_only = not isinstance(request, str) and request.archs == ()
    skip = (request if isinstance(request, str) else toolchain_skip_reason(toolchain)) \
        if has_cuda_sources and not cpu_only else None
    arch_plans = {
        name: kernel_arch_plan(name, table, request, toolchain.nvcc_version, _selected_kernels())
        if has_cuda_sources and skip is None else {"archs": [], "not_built": {}}
        for name, table in kernels.items()
    }
    cxx_std = {t.get("cxx_std", DEFAULT_CXX_STD) for t in kernels.values()}
    if len(cxx_std) != 1:
        raise BuildError(f"{package_dir.name}: kernels disagree on cxx_std ({sorted(cxx_std)}); they share one _C")
    std = f"-std={cxx_std.pop()}"
    by_module = {}
    for name, table in kernels.items():
        by_module.setdefault(extension_module(table), {})[name] = table
    compile_groups(kernels, arch_plans)  # raises when a source is in two sets, across modules too
    modules = []
    for module, members in sorted(by_module.items()):
        groups = compile_groups(members, arch_plans)
        for group in groups:
            # One nvcc compiles the host side once and the device side once per arch: --threads runs those at once.
            group["nvcc_flags"] = gencode_flags(group["archs"]) + (["--threads=0"] if len(group["archs"]) > 1 else [])
        modules.append(_module_plan(module, members, groups, floor if module != EXTENSION_MODULE else None, std))
    _check_one_module_per_source(modules)
    with_cuda = any(m["cuda_groups"] for m in modules)
    gather = lambda key: [x for t in kernels.values() for x in t.get(key, [])]
    includes = [str(root / d) for d in gather("include_dirs")] + [str(CORE_INCLUDE)]
    if with_cuda:
        includes += cuda_library_includes(toolchain.cuda_home)
    for requirement in gather("build_requires"):
        includes += _build_requirement_includes(requirement)
    all_stable = EXTENSION_MODULE not in by_module
    return {
        "package": package_dir.name,
        "version": f"{manifest['version']}+{abi_tag(toolchain, with_cuda, floor if all_stable else None)}",
        "modules": modules,
        # A plugin with a stable module ships one wheel for every CPython (abi3): its _C, if any, needs no more than
        # the limited API either (module_init.cpp; ops reach Python through the dispatcher, not pybind).
        "py_limited_api": floor is not None,
        "include_dirs": includes,
        "kernels": arch_plans,
        "arch_request": None if isinstance(request, str) else request.described,
        "cuda_skipped": skip,
    }


def announce(plan: dict) -> None:
    """One line per kernel saying what it gets; a CUDA skip, or an arch this nvcc cannot build, fails the build under
    PRIME_KERNELS_REQUIRE=1 instead."""
    required = os.environ.get(REQUIRE_ENV) == "1"
    if plan["cuda_skipped"]:
        message = f"prime-kernels: skipping CUDA for {plan['package']}: {plan['cuda_skipped']}"
        if required:
            raise BuildError(f"{message} ({REQUIRE_ENV}=1 makes this an error)")
        print(message, file=sys.stderr)
        return
    for name, kernel in plan["kernels"].items():
        unbuildable = {a: why for a, why in kernel["not_built"].items() if why.startswith("nvcc ")}
        if unbuildable and required:
            raise BuildError(f"prime-kernels: {name}: {'; '.join(unbuildable.values())} ({REQUIRE_ENV}=1 makes this an error)")
        built = ", ".join(kernel["archs"]) or "no CUDA arch"
        left = "; ".join(f"not {a}: {why}" for a, why in kernel["not_built"].items())
        print(f"prime-kernels: {plan['package']}: {name}: CUDA for {built}" + (f" ({left})" if left else ""), file=sys.stderr)


def _sm(capability: tuple[int, int]) -> str:
    return "sm_{}{}".format(*capability)


def _gpus_of(arch: str) -> list[tuple[int, int]]:
    return [c for c in GPU_CAPABILITIES if arch_runs_on(arch, c)]


def runs_on_line(package: str, name: str, archs: list[str]) -> str:
    """Which GPU generations (GPU_CAPABILITIES) a kernel built for ``archs`` runs on and, for each GPU of a major it
    has code for that none of that code runs on, why not: a valid but wrong arch ("10.3" for "10.0") shows here."""
    runs = [c for c in GPU_CAPABILITIES if any(arch_runs_on(a, c) for a in archs)]
    if not runs:
        return f"prime-kernels: {package}: {name} runs on no GPU (no CUDA code: its CPU implementation only)"
    gaps = []
    for capability in (c for c in GPU_CAPABILITIES if c not in runs):
        same_major = [a for a in archs if capability_of(a)[0] == capability[0]]
        if same_major:
            why = ", ".join(f"{a} runs on {' '.join(map(_sm, _gpus_of(a))) or 'none of them'} only" for a in same_major)
            gaps.append(f"; not on {_sm(capability)}: {why}")
    return f"prime-kernels: {package}: {name} runs on {' '.join(map(_sm, runs))}" + "".join(gaps)


# Run in a child process against the built _C: the ops its static TORCH_LIBRARY blocks register (overloads folded).
REGISTRATION_PROBE = (
    "import json, sys, torch; before = set(torch._C._dispatch_get_all_op_names()); "
    "torch.ops.load_library(sys.argv[1]); "
    "print(json.dumps(sorted({op.split('.')[0] for op in set(torch._C._dispatch_get_all_op_names()) - before})))"
)


def registered_ops(shared_object: str | Path) -> list[str]:
    """The ``namespace::op`` names the compiled extension registers, from a child process that loads it."""
    done = subprocess.run([sys.executable, "-c", REGISTRATION_PROBE, str(shared_object)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"the built {Path(shared_object).name} fails to load in a fresh process (exit {done.returncode}): {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def registration_mismatch(extension: str, kernels: dict, ops: list[str]) -> str | None:
    """Why what ``extension`` registers differs from what the manifest declares for its kernels (namespaces and ops),
    or None."""
    declared = {f"{t['namespace']}::{op}" for t in kernels.values() for op in t["ops"]}
    if set(ops) == declared:
        return None
    namespaces = lambda names: sorted({n.split("::")[0] for n in names})
    parts = [f"its C++ registers namespaces {namespaces(ops)} and kernel.toml declares {namespaces(declared)}"]
    if declared - set(ops):
        parts.append(f"declared but not registered: {sorted(declared - set(ops))}")
    if set(ops) - declared:
        parts.append(f"registered but not declared: {sorted(set(ops) - declared)}")
    return f"{extension} does not register what kernel.toml declares: " + "; ".join(parts)


def build_record(plan: dict, toolchain: Toolchain) -> dict:
    """What the registry gates on: the toolchain, and per kernel its archs and, for a stable-ABI kernel, its floor."""
    floors = {k: m["stable_abi"] for m in plan["modules"] for k in m["kernels"]}
    return {
        "torch": toolchain.torch_version,
        "torch_cuda": toolchain.torch_cuda,
        "nvcc": toolchain.nvcc_version if any(m["cuda_groups"] for m in plan["modules"]) else None,
        "cxx": toolchain.cxx_version,
        "python": platform.python_version(),
        "arch_request": plan["arch_request"],
        "cuda_skipped": plan["cuda_skipped"],
        # An exact-ABI kernel's entry is as before the stable ABI existed: registries of every version read it alike.
        "kernels": {name: {**kernel, **({"stable_abi": floors[name]} if floors[name] else {})}
                    for name, kernel in plan["kernels"].items()},
    }


def limited_api_tag(cpp_extension) -> str:
    """The abi3 wheel's tag, ``cp310``: cpp_extension compiles py_limited_api modules with Py_LIMITED_API set to its
    minimum CPython (0x030A0000), and the wheel must claim no older one."""
    version = int(cpp_extension.min_supported_cpython, 16)
    return f"cp{version >> 24}{(version >> 16) & 0xFF}"


def _extension(plan: dict, module: dict, cpp_extension):
    """The setuptools Extension of one module: its CPU sources and module_init.cpp (CUDA sets are compiled apart)."""
    compile_args = {"cxx": module["cxx_flags"]}
    if module["cuda_groups"]:
        compile_args["nvcc"] = module["nvcc_flags"]
    # A copy under build/: setuptools wants relative sources, and objects must land inside build_temp. One copy per
    # module, each compiled with its own flags (Py_LIMITED_API for an abi3 wheel).
    module_init = Path("build", module["name"], MODULE_INIT.name)
    module_init.parent.mkdir(parents=True, exist_ok=True)
    module_init.write_text(MODULE_INIT.read_text())
    extension_type = cpp_extension.CUDAExtension if module["cuda_groups"] else cpp_extension.CppExtension
    return extension_type(
        name=f"{plan['package']}.{module['name']}",
        sources=[*module["cpu_sources"], str(module_init)],
        include_dirs=plan["include_dirs"],
        extra_compile_args=compile_args,
        py_limited_api=plan["py_limited_api"],
    )


# A compiler's error line: gcc / clang "file:line:col: error:", nvcc's front end "file(line): error:", or one that
# names no file ("nvcc fatal   :", "ld: error").
_ERROR_LINE = re.compile(r"(?P<file>[^\s:()]+\.\w+)(?:\(\d+\)|:\d+(?::\d+)?): (?:fatal )?error|\berror\b|\bfatal\b",
                         re.IGNORECASE)
# Headers outside the LibTorch stable API (section 9 of docs/writing-a-plugin.md has the porting table).
_UNSTABLE_INCLUDE = re.compile(r'#\s*include\s*[<"]((?:ATen|c10|torch/(?!csrc/stable|headeronly))[^>"]*)[>"]')
FIRST_ERRORS = 5


@contextlib.contextmanager
def _captured_output():
    """Whatever the compilers and ninja write to this process's stdout and stderr (their file descriptors, which
    subprocesses inherit), still shown as it comes and also kept: yields the list the text accumulates in."""
    sys.stdout.flush()
    sys.stderr.flush()
    kept, pumps, restore = [], [], []
    for fd in (1, 2):
        read_end, write_end = os.pipe()
        shown = os.dup(fd)
        restore.append((fd, shown))

        def pump(read_end=read_end, shown=shown):
            while chunk := os.read(read_end, 65536):
                kept.append(chunk)
                os.write(shown, chunk)
            os.close(read_end)

        pumps.append(threading.Thread(target=pump, daemon=True))
        pumps[-1].start()
        os.dup2(write_end, fd)
        os.close(write_end)
    try:
        yield kept
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, shown in restore:
            os.dup2(shown, fd)  # the pipe's last write end closes: its pump sees the end
        for thread in pumps:
            thread.join()
        for _, shown in restore:
            os.close(shown)


def compile_failure(output: str, root: Path, kernels: dict) -> str:
    """The sentence a failed compile ends with: the compiler's first error lines, the kernel and source file they
    belong to and, where that kernel is on the stable ABI and its source includes a header outside the stable API,
    where the porting table is."""
    errors = [line.strip() for line in output.splitlines() if _ERROR_LINE.search(line)]
    errors = [e for e in errors if not e.startswith(("RuntimeError", "subprocess.CalledProcessError", "error: command"))]
    sources = {str((root / path).resolve()): (name, path, table)
               for name, table in kernels.items() for path in source_paths(table)}

    def source_of(line: str):
        match = _ERROR_LINE.search(line)
        if not match or not match["file"]:
            return None
        return sources.get(str((root / match["file"]).resolve())) or next(
            (v for k, v in sources.items() if k.endswith("/" + match["file"].lstrip("./"))), None)

    failing = next(filter(None, map(source_of, errors)), None)
    where = f" in kernel {failing[0]}'s {failing[1]}" if failing else ""
    first = "\n  ".join(errors[:FIRST_ERRORS]) or "(the compiler printed no error line: see the output above)"
    message = f"prime-kernels: compiling failed{where}; the compiler's first errors:\n  {first}"
    if failing and failing[2].get("stable_abi"):
        text = (root / failing[1]).read_text(errors="replace")
        unstable = sorted(set(_UNSTABLE_INCLUDE.findall(text)))
        if unstable:
            message += (f"\n{failing[0]} is built on the LibTorch stable ABI (stable_abi = "
                        f"\"{failing[2]['stable_abi']}\") and {failing[1]} includes {', '.join(unstable)}, outside "
                        f"the stable API: docs/writing-a-plugin.md section 9 has the porting table")
    return message


def setup_plugin(root: str | Path | None = None, **setup_kwargs) -> None:
    """The whole of a plugin's setup.py. ``root`` defaults to the working directory, where setup.py runs."""
    import setuptools
    from torch.utils import cpp_extension

    # pip and python -m build run setup.py from its own directory; setuptools wants sources relative to it.
    root = Path(root) if root else Path.cwd()
    package = _plugin_package(root)
    if any(jit_manifest.is_jit(t) for t in load(package)["kernels"].values()):  # Triton / CuTe DSL: no _C
        from .jit_build import setup_jit_plugin

        return setup_jit_plugin(root, package, os.environ.get(REQUIRE_ENV) == "1", **setup_kwargs)
    toolchain = detect_toolchain()
    plan = extension_plan(root, toolchain)
    announce(plan)
    record = build_record(plan, toolchain)
    extensions = [_extension(plan, module, cpp_extension) for module in plan["modules"]]
    modules = {f"{plan['package']}.{m['name']}": m for m in plan["modules"]}

    class BuildWithRecord(cpp_extension.BuildExtension):
        def build_extension(self, ext):
            # A failed compile ends with the compiler's first errors and their kernel, not with setuptools' "Error
            # compiling objects for extension" a hundred lines below them.
            failure = None
            with _captured_output() as output:
                try:
                    self._compile_and_link(ext)
                except Exception as error:  # the compilers', ninja's and the linker's failures alike
                    failure = error
            if failure is not None:
                text = b"".join(output).decode(errors="replace")
                raise BuildError(compile_failure(text, root, load(_plugin_package(root))["kernels"])) from failure

        def _compile_and_link(self, ext):
            # cpp_extension gives one extension one set of nvcc flags, so each CUDA source set is compiled on its own
            # (its archs' -gencode only, into its own folder) and linked in as objects.
            for i, group in enumerate(modules[ext.name]["cuda_groups"]):
                flags = dict(ext.extra_compile_args, nvcc=[*ext.extra_compile_args["nvcc"], *group["nvcc_flags"]])
                ext.extra_objects += self.compiler.compile(
                    group["sources"], output_dir=os.path.join(self.build_temp, ext.name, f"cuda_set_{i}"),
                    include_dirs=ext.include_dirs, extra_postargs=flags, depends=ext.depends,
                )
            super().build_extension(ext)

        def run(self):
            super().run()
            # The registry trusts the record before anything is imported, so the record must say what each module
            # really registers: a module that registers another namespace than declared would abort the process.
            kernels = load(_plugin_package(root))["kernels"]
            record["registered_ops"] = []
            for name, module in modules.items():
                ops = registered_ops(self.get_ext_fullpath(name))
                mismatch = registration_mismatch(name, {k: kernels[k] for k in module["kernels"]}, ops)
                if mismatch:
                    raise BuildError(mismatch)
                record["registered_ops"] = sorted({*record["registered_ops"], *ops})
            # Beside the built modules, and beside the in-place copy an editable install (pip install -e) imports.
            in_place = Path(self.get_ext_fullpath(extensions[0].name)).parent
            for package_dir in {Path(self.build_lib) / plan["package"], in_place}:
                package_dir.mkdir(parents=True, exist_ok=True)
                (package_dir / BUILD_RECORD_NAME).write_text(json.dumps(record, indent=2))
            for name, kernel in plan["kernels"].items():  # last, where the build's output ends
                print(runs_on_line(plan["package"], name, kernel["archs"]), file=sys.stderr)

    options = {"bdist_wheel": {"py_limited_api": limited_api_tag(cpp_extension)}} if plan["py_limited_api"] else {}
    setuptools.setup(
        version=plan["version"],
        packages=[plan["package"]],
        package_data={plan["package"]: [MANIFEST_NAME]},
        ext_modules=extensions,
        cmdclass={"build_ext": BuildWithRecord.with_options(use_ninja=True)},
        options=options,
        **setup_kwargs,
    )
