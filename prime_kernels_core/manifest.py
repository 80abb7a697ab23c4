"""kernel.toml, the one source of truth a plugin's build and runtime both read, and the KernelSpec declared from it.

A manifest sits inside the plugin's package and holds a top-level ``version`` and one table per kernel:
description, namespace, ops, trainable, module, archs, cxx_std, sources.cpu / sources.cuda, include_dirs,
extra_cxx_flags, extra_nvcc_flags, build_requires and a ``constants`` table (compile definitions
``<KERNEL>_<NAME>`` and runtime values alike).
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

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MANIFEST_NAME = "kernel.toml"
BUILD_RECORD_NAME = "_build_record.json"
# The compiled module of every plugin package, <package>._C; module_init.cpp takes its name from the build's define.
EXTENSION_MODULE = "_C"
# A CUDA arch as manifests and PRIME_KERNELS_ARCH spell it: MAJOR.MINOR, then "a" (arch-specific) or "f" (family).
ARCH_PATTERN = re.compile(r"(\d+)\.(\d+)([af]?)")
KERNEL_KEYS = {
    "description", "namespace", "ops", "trainable", "module", "archs", "cxx_std", "sources", "include_dirs",
    "extra_cxx_flags", "extra_nvcc_flags", "build_requires", "constants",
}


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
    extension: str | None = None
    build: dict | None = None
    distribution: str = ""
    version: str = ""


@lru_cache(maxsize=None)
def load(path: str | Path) -> dict:
    """The parsed manifest at ``path`` (a kernel.toml, or the package directory holding it), validated."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    with open(path, "rb") as f:
        data = tomllib.load(f)
    if not isinstance(data.get("version"), str):
        raise ManifestError(f"{path}: needs a top-level version string, found {data.get('version')!r}")
    kernels = {k: v for k, v in data.items() if isinstance(v, dict)}
    if not kernels:
        raise ManifestError(f"{path}: declares no kernel table")
    for name, table in kernels.items():
        unknown = set(table) - KERNEL_KEYS
        if unknown:
            raise ManifestError(f"{path}: kernel {name!r} has unknown keys {sorted(unknown)}; known: {sorted(KERNEL_KEYS)}")
        for key in ("namespace", "module"):
            if not isinstance(table.get(key), str):
                raise ManifestError(f"{path}: kernel {name!r} needs a {key} string, found {table.get(key)!r}")
        if not table.get("ops"):
            raise ManifestError(f"{path}: kernel {name!r} declares no ops")
    return {"version": data["version"], "kernels": kernels}


def major_minor(version: str | None) -> str | None:
    """``2.14.1+cu130`` -> ``2.14``: the part of a torch version whose C++ ABI an extension is bound to."""
    return ".".join(version.split("+")[0].split(".")[:2]) if version else None


def read_build_record(package_dir: str | Path) -> dict | None:
    """The build record the build kit wrote into the package, or None when the package was never built by it."""
    try:
        record = json.loads((Path(package_dir) / BUILD_RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


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
            extension=f"{package_dir.name}.{EXTENSION_MODULE}",
            build=record,
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
