"""kernel.toml, the one source of truth a plugin's build and runtime both read, and the KernelSpec declared from it.

A manifest sits inside the plugin's package and holds a top-level ``version`` and one table per kernel:
description, namespace, ops, trainable, module, archs, cxx_std, sources.cpu / sources.cuda / sources.cuda_variants,
include_dirs, extra_cxx_flags, extra_nvcc_flags, build_requires, stable_abi and a ``constants`` table (compile
definitions ``<KERNEL>_<NAME>`` and runtime values alike). ``archs`` are the CUDA archs the kernel has code for; each is
compiled from its ``sources.cuda_variants`` entry when it has one, else from ``sources.cuda``. ``stable_abi = "2.11"``
says the kernel's C++/CUDA uses only the LibTorch stable ABI and runs on any torch from that release on: it is compiled
into ``<package>._C_stable`` (the others into ``<package>._C``), and every stable kernel of a plugin names one floor.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
import sys
from functools import lru_cache
from pathlib import Path

from . import hookimpl as _hookimpl
from . import jit_manifest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MANIFEST_NAME = "kernel.toml"
BUILD_RECORD_NAME = "_build_record.json"
# The compiled module of a plugin's exact-ABI kernels, <package>._C; module_init.cpp takes its name from the build's define.
EXTENSION_MODULE = "_C"
# The compiled module of a plugin's stable-ABI kernels (stable_abi = "2.11"): one per plugin, built for one torch floor.
STABLE_EXTENSION_MODULE = "_C_stable"
# The first torch whose stable ABI a build can target (TORCH_TARGET_VERSION, STABLE_TORCH_LIBRARY, TORCH_BOX).
STABLE_ABI_FIRST = (2, 10)
# ASCII digits only ([0-9], not \d): "٢.١١" or "٩.٠a" would pass \d, and int() reads them, but no compiler does.
TORCH_RELEASE = re.compile(r"([0-9]+)\.([0-9]+)")
# A CUDA arch as manifests and PRIME_KERNELS_ARCH spell it: MAJOR.MINOR, then "a" (arch-specific) or "f" (family).
ARCH_PATTERN = re.compile(r"([0-9]+)\.([0-9]+)([af]?)")
CXX_STD_PATTERN = re.compile(r"c\+\+(17|20|23)")
DEFAULT_CXX_STD = "c++20"
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
STRING_LISTS = ("ops", "trainable", "archs", "include_dirs", "extra_cxx_flags", "extra_nvcc_flags", "build_requires")
KERNEL_KEYS = {"description", "namespace", "module", "cxx_std", "sources", "constants", "stable_abi", *STRING_LISTS}
SOURCE_KEYS = {"cpu", "cuda", "cuda_variants"}


class ManifestError(ValueError):
    """A kernel.toml that the build kit or the registry cannot use."""


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What a plugin declares about one kernel, without importing its compiled extension."""

    name: str
    description: str
    namespace: str
    ops: tuple[str, ...]
    module: str
    archs: tuple[str, ...]
    trainable: tuple[str, ...] = ()
    constants: dict = dataclasses.field(default_factory=dict)
    extension: str | None = None  # None for a JIT kernel: it has no compiled module
    build: dict | None = None  # the build record as read; registry._kernel_build checks its form
    distribution: str = ""
    version: str = ""
    jit: dict | None = None  # a JIT kernel's language, requires, capability, cpu paths (jit_manifest.declared)


def _is_string_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_sources(where: str, sources, archs: list[str]) -> None:
    if not isinstance(sources, dict):
        raise ManifestError(f"{where}: sources must be a table (sources.cpu = [...]), found {sources!r}")
    unknown = set(sources) - SOURCE_KEYS
    if unknown:
        raise ManifestError(f"{where}: sources has unknown keys {sorted(unknown)}; known: {sorted(SOURCE_KEYS)}")
    for key in ("cpu", "cuda"):
        if not _is_string_list(sources.get(key, [])):
            raise ManifestError(f"{where}: sources.{key} must be a list of paths, found {sources[key]!r}")
    variants = sources.get("cuda_variants", {})
    if not isinstance(variants, dict) or not all(_is_string_list(v) and v for v in variants.values()):
        raise ManifestError(f"{where}: sources.cuda_variants must map an arch to a list of paths, found {variants!r}")
    unlisted = sorted(set(variants) - set(archs))
    if unlisted:
        raise ManifestError(f"{where}: sources.cuda_variants names {unlisted}, which archs does not list ({archs})")


def _check_stable_abi(where: str, table: dict) -> None:
    floor = table.get("stable_abi")
    if floor is None:
        return
    first = "{}.{}".format(*STABLE_ABI_FIRST)
    if not isinstance(floor, str) or not TORCH_RELEASE.fullmatch(floor):
        raise ManifestError(
            f"{where}: stable_abi is the oldest torch release the kernel targets, a string MAJOR.MINOR such as "
            f"\"{first}\" (its sources then use only the LibTorch stable ABI), found {floor!r}"
        )
    if release_tuple(floor) < STABLE_ABI_FIRST:
        raise ManifestError(
            f"{where}: stable_abi = \"{floor}\" is older than torch {first}, the first release whose stable ABI a "
            f"build can target (TORCH_TARGET_VERSION); use \"{first}\" or newer"
        )


def _check_stable_floors(path: Path, kernels: dict) -> None:
    """The stable kernels of one plugin share one compiled module, built for one torch floor."""
    floors = {name: t["stable_abi"] for name, t in kernels.items() if t.get("stable_abi") is not None}
    if len(set(floors.values())) > 1:
        raise ManifestError(
            f"{path}: kernels disagree on stable_abi ({', '.join(f'{n} = {f!r}' for n, f in floors.items())}); the "
            f"stable kernels of a plugin share one {STABLE_EXTENSION_MODULE} built for one torch floor, so give them one"
        )


def _check_kernel(where: str, table: dict) -> None:
    """Every key of one kernel table, each with a sentence naming the key, what was expected and what was found."""
    known = KERNEL_KEYS | (jit_manifest.JIT_KEYS if jit_manifest.is_jit(table) else set())
    unknown = set(table) - known
    if unknown:
        raise ManifestError(f"{where} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    for key in ("namespace", "module"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise ManifestError(f"{where} needs a {key} string, found {table.get(key)!r}")
    if not IDENTIFIER.fullmatch(table["namespace"]):
        raise ManifestError(f"{where}: namespace must be a C++ identifier (it names a TORCH_LIBRARY), found {table['namespace']!r}")
    if not isinstance(table.get("description", ""), str):
        raise ManifestError(f"{where}: description must be a string, found {table['description']!r}")
    for key in STRING_LISTS:
        if not _is_string_list(table.get(key, [])):
            raise ManifestError(f"{where}: {key} must be a list of strings, found {table[key]!r}")
    if not table.get("ops"):
        raise ManifestError(f"{where} declares no ops")
    bad_ops = [op for op in table["ops"] + table.get("trainable", []) if not IDENTIFIER.fullmatch(op)]
    if bad_ops:
        raise ManifestError(f"{where}: op names are bare identifiers (no namespace), found {bad_ops}")
    untrained = sorted(set(table.get("trainable", [])) - set(table["ops"]))
    if untrained:
        raise ManifestError(f"{where}: trainable names {untrained}, which ops does not list")
    bad_archs = [a for a in table.get("archs", []) if not ARCH_PATTERN.fullmatch(a)]
    if bad_archs:
        raise ManifestError(f"{where}: archs are spelled MAJOR.MINOR[a|f] (e.g. \"8.0\", \"9.0a\", \"10.0f\"), found {bad_archs}")
    cxx_std = table.get("cxx_std", DEFAULT_CXX_STD)
    if not isinstance(cxx_std, str) or not CXX_STD_PATTERN.fullmatch(cxx_std):
        raise ManifestError(f"{where}: cxx_std is a string c++17, c++20 or c++23 (default {DEFAULT_CXX_STD}), found {cxx_std!r}")
    _check_sources(where, table.get("sources", {}), table.get("archs", []))
    _check_stable_abi(where, table)
    constants = table.get("constants", {})
    if not isinstance(constants, dict):
        raise ManifestError(f"{where}: constants must be a table, found {constants!r}")
    for key, value in constants.items():
        if not IDENTIFIER.fullmatch(key) or not isinstance(value, (bool, int, float)):
            raise ManifestError(
                f"{where}: constant {key!r} must be an identifier with a number or boolean value (it is compiled in "
                f"as a define), found {value!r}"
            )
    if jit_manifest.is_jit(table):
        try:
            jit_manifest.check(where, table)
        except jit_manifest.JitManifestError as exc:
            raise ManifestError(str(exc)) from None


@lru_cache(maxsize=None)
def load(path: str | Path) -> dict:
    """The parsed manifest at ``path`` (a kernel.toml, or the package directory holding it), validated."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: is not valid TOML: {exc}") from None
    if not isinstance(data.get("version"), str):
        raise ManifestError(f"{path}: needs a top-level version string, found {data.get('version')!r}")
    stray = sorted(k for k, v in data.items() if k != "version" and not isinstance(v, dict))
    if stray:
        raise ManifestError(f"{path}: top-level keys other than version must be kernel tables, found {stray}")
    kernels = {k: v for k, v in data.items() if isinstance(v, dict)}
    if not kernels:
        raise ManifestError(f"{path}: declares no kernel table")
    for name, table in kernels.items():
        _check_kernel(f"{path}: kernel {name!r}", table)
    _check_stable_floors(path, kernels)
    return {"version": data["version"], "kernels": kernels}


def cuda_source_sets(table: dict) -> dict[str, tuple[str, ...]]:
    """{arch: the CUDA sources compiled for it} for one kernel table: its variant for that arch, else sources.cuda."""
    sources = table.get("sources", {})
    variants = sources.get("cuda_variants", {})
    return {arch: tuple(variants.get(arch, sources.get("cuda", []))) for arch in table.get("archs", [])}


def source_paths(table: dict) -> list[str]:
    """Every path one kernel table's sources name (cpu, cuda, each cuda_variants entry), relative to the project."""
    sources = table.get("sources", {})
    variants = [p for paths in sources.get("cuda_variants", {}).values() for p in paths]
    return list(dict.fromkeys([*sources.get("cpu", []), *sources.get("cuda", []), *variants]))


def capability_of(arch: str) -> tuple[int, int] | None:
    """``"9.0a"`` -> ``(9, 0)``: the compute capability an arch is spelled after, or None when it is malformed."""
    match = ARCH_PATTERN.fullmatch(arch) if isinstance(arch, str) else None
    return (int(match[1]), int(match[2])) if match else None


# The GPU generations a wheel is described for at the end of its build: every shipping capability from Turing on
# (docs/archs.md's columns, which tests/test_archs.py checks against this).
GPU_CAPABILITIES = ((7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1))


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether machine code built for ``arch`` runs on a device of ``capability`` (no PTX is ever shipped).

    ``X.Ya`` runs only on X.Y; family ``X.Yf`` and plain ``X.Y`` code on X.Y' with Y' >= Y of the same major (nvcc's
    families: 10.0f on 10.0 and 10.3, 12.0f on 12.0 and 12.1).
    """
    built_for = capability_of(arch)
    if built_for is None:
        return False
    capability = tuple(capability)
    if arch.endswith("a"):
        return built_for == capability
    return built_for[0] == capability[0] and capability[1] >= built_for[1]


def extension_module(table: dict) -> str:
    """The compiled module a kernel's C++ lives in: ``_C_stable`` for a stable-ABI kernel, else ``_C``."""
    return STABLE_EXTENSION_MODULE if table.get("stable_abi") is not None else EXTENSION_MODULE


def release_tuple(version: str | None) -> tuple[int, int] | None:
    """``"2.11"`` or ``"2.11.0+cu130"`` -> ``(2, 11)``; None when it does not begin with MAJOR.MINOR."""
    found = TORCH_RELEASE.match(version) if isinstance(version, str) else None
    return (int(found[1]), int(found[2])) if found else None


def major_minor(version: str | None) -> str | None:
    """``2.14.1+cu130`` -> ``2.14``: the part of a torch version whose C++ ABI an extension is bound to."""
    return ".".join(version.split("+")[0].split(".")[:2]) if version else None


def read_build_record(package_dir: str | Path):
    """The build record the build kit wrote into the package (the registry checks its form), None when the package
    was never built by it, or a sentence when it is not JSON."""
    try:
        text = (Path(package_dir) / BUILD_RECORD_NAME).read_text()
    except OSError:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        return f"{BUILD_RECORD_NAME} is not valid JSON ({exc})"


def declare(hook_module_file: str) -> list[KernelSpec]:
    """KernelSpecs for the package containing ``hook_module_file`` (call it with ``__file__`` from the plugin's hooks)."""
    package_dir = Path(hook_module_file).resolve().parent
    manifest = load(package_dir)
    record = read_build_record(package_dir)
    return [
        KernelSpec(
            name=name,
            description=table.get("description", ""),
            namespace=table["namespace"],
            ops=tuple(table["ops"]),
            module=table["module"],
            archs=tuple(table.get("archs", ())),
            trainable=tuple(table.get("trainable", ())),
            constants=dict(table.get("constants", {})),
            extension=None if jit_manifest.is_jit(table) else f"{package_dir.name}.{extension_module(table)}",
            build=record,
            jit=jit_manifest.declared(table) if jit_manifest.is_jit(table) else None,
        )
        for name, table in manifest["kernels"].items()
    ]


def package_dir(package: str) -> Path:
    """The folder of the installed top-level ``package``, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ManifestError(f"package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def constants(package: str, kernel: str) -> dict:
    """The ``constants`` table of ``kernel`` in the installed ``package``'s manifest (what the build compiled in)."""
    table = load(package_dir(package))["kernels"].get(kernel)
    if table is None:
        raise ManifestError(f"package {package!r} declares no kernel {kernel!r}")
    return dict(table.get("constants", {}))


class ManifestHooks:
    """A plugin's hooks when it needs nothing beyond its manifest and a samples module: an entry point may name an
    instance, ``flash_moe = "prime_kernels_flash_moe.plugin:hooks"`` with, in plugin.py,
    ``hooks = ManifestHooks(__file__, "prime_kernels_flash_moe.samples")``. The kernels come from the kernel.toml beside
    ``hook_module_file``; ``op_samples(kernel, device)`` and ``surface_samples(kernel, device)`` of ``samples_module``
    are imported only when the conformance kit asks, so discovery never loads compiled code."""

    def __init__(self, hook_module_file: str, samples_module: str):
        self._file = hook_module_file
        self._samples = samples_module

    @_hookimpl
    def prime_kernels_declare(self):
        return declare(self._file)

    @_hookimpl
    def prime_kernels_sample_inputs(self, kernel, device):
        return importlib.import_module(self._samples).op_samples(kernel, device)

    @_hookimpl
    def prime_kernels_surface_samples(self, kernel, device):
        return importlib.import_module(self._samples).surface_samples(kernel, device)
