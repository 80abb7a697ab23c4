"""The build kit: a plugin's setup.py is ``setup_plugin()``; everything else comes from its kernel.toml.

Builds ``<package>._C`` with torch.utils.cpp_extension (ninja): the CPU sources always, so the op schemas exist on
every install, and the CUDA sources once per manifest arch (``-gencode=arch=compute_XX,code=sm_XX``, no PTX) when the
toolkit suits the installed torch. Otherwise CUDA is skipped with a message, unless PRIME_KERNELS_REQUIRE=1.
The build record it writes into the package is what the registry gates on without importing ``_C``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from .manifest import ARCH_PATTERN, BUILD_RECORD_NAME, EXTENSION_MODULE, MANIFEST_NAME, load, major_minor

ARCH_ENV = "PRIME_KERNELS_ARCH"
REQUIRE_ENV = "PRIME_KERNELS_REQUIRE"
MODULE_INIT = Path(__file__).parent / "csrc" / "module_init.cpp"
# Device-code building blocks every plugin may include (<prime_kernels/sm90.cuh>).
CORE_INCLUDE = Path(__file__).parent / "include"
# The first CUDA release whose nvcc can target each arch-specific major (a fact about nvcc, not a project choice).
NVCC_MIN_FOR_MAJOR = {9: (12, 0), 10: (12, 8), 11: (13, 0), 12: (12, 8)}
# The first CUDA release whose nvcc knows family-specific targets ("10.0f"), whatever the major.
NVCC_MIN_FOR_FAMILY = (12, 9)
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
    if cuda_home and Path(cuda_home, "bin", "nvcc").exists() and Path(cuda_home, "include", "cuda_runtime.h").exists():
        text = subprocess.run([str(Path(cuda_home, "bin", "nvcc")), "--version"], capture_output=True, text=True).stdout
        found = re.search(r"release (\d+\.\d+)", text)
        nvcc_version = found[1] if found else None
    return Toolchain(
        torch.__version__, torch.version.cuda, cuda_home, nvcc_version, _first_line([os.environ.get("CXX", "c++"), "--version"])
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:2])


def requested_archs(manifest_archs: list[str]) -> list[str] | str:
    """The archs to build: PRIME_KERNELS_ARCH (a ;-list, or ``native``) or the manifest's; a string is a skip reason."""
    override = os.environ.get(ARCH_ENV, "").strip()
    if not override:
        return list(manifest_archs)
    if override == "native":
        import torch

        if not torch.cuda.is_available():
            return f"{ARCH_ENV}=native but no CUDA device is visible to the build"
        major, minor = torch.cuda.get_device_capability()
        return [f"{major}.{minor}{'a' if major >= FIRST_ARCH_SPECIFIC_MAJOR else ''}"]
    return [a.strip() for a in re.split(r"[;,\s]+", override) if a.strip()]


def cuda_skip_reason(toolchain: Toolchain, archs: list[str]) -> str | None:
    """Why CUDA cannot be built with this toolchain for these archs, or None."""
    if toolchain.torch_cuda is None:
        return f"torch {toolchain.torch_version} is a CPU-only build"
    if not toolchain.nvcc_version:
        return f"no CUDA toolkit was found (CUDA_HOME={toolchain.cuda_home} has no bin/nvcc and include/cuda_runtime.h)"
    if _version_tuple(toolchain.nvcc_version)[0] != _version_tuple(toolchain.torch_cuda)[0]:
        return (
            f"nvcc is CUDA {toolchain.nvcc_version} but torch {toolchain.torch_version} was built with CUDA "
            f"{toolchain.torch_cuda}; the CUDA majors must match"
        )
    if not archs:
        return f"no CUDA arch was requested (the manifest lists none and {ARCH_ENV} is unset)"
    for arch in archs:
        found = ARCH_PATTERN.fullmatch(arch)
        if not found:
            return f"arch {arch!r} is not of the form MAJOR.MINOR[a|f] (e.g. 9.0a)"
        needed = max(NVCC_MIN_FOR_MAJOR.get(int(found[1]), (0, 0)), NVCC_MIN_FOR_FAMILY if found[3] == "f" else (0, 0))
        if _version_tuple(toolchain.nvcc_version) < needed:
            return f"nvcc {toolchain.nvcc_version} cannot build {arch}; it needs CUDA {needed[0]}.{needed[1]} or newer"
    return None


def gencode_flags(archs: list[str]) -> list[str]:
    """One -gencode per arch, machine code only: ``9.0a`` -> ``-gencode=arch=compute_90a,code=sm_90a``."""
    flags = []
    for arch in archs:
        digits = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{digits},code=sm_{digits}")
    return flags


def abi_tag(toolchain: Toolchain, with_cuda: bool) -> str:
    """The wheel's local version: the torch (and CUDA) ABI it imports under, e.g. ``cu130torch2.14``."""
    cuda = "cu" + toolchain.torch_cuda.replace(".", "") if with_cuda else "cpu"
    return f"{cuda}torch{major_minor(toolchain.torch_version)}"


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


def extension_plan(root: Path, toolchain: Toolchain) -> dict:
    """Everything the build decides from the manifest and toolchain, without compiling (tested on its own)."""
    package_dir = _plugin_package(root)
    manifest = load(package_dir)
    kernels = manifest["kernels"]
    archs = requested_archs(sorted({a for t in kernels.values() for a in t.get("archs", [])}))
    has_cuda_sources = any(t.get("sources", {}).get("cuda") for t in kernels.values())
    # A plugin without CUDA sources is CPU-only by design: nothing is skipped, so PRIME_KERNELS_REQUIRE has no say.
    skip = (archs if isinstance(archs, str) else cuda_skip_reason(toolchain, archs)) if has_cuda_sources else None
    with_cuda = has_cuda_sources and skip is None
    cxx_std = {t.get("cxx_std", "c++20") for t in kernels.values()}
    if len(cxx_std) != 1:
        raise BuildError(f"{package_dir.name}: kernels disagree on cxx_std ({sorted(cxx_std)}); they share one _C")
    defines = [
        f"-D{kernel.upper()}_{key}={_define_value(kernel, key, value)}"
        for kernel, table in kernels.items()
        for key, value in table.get("constants", {}).items()
    ]
    gather = lambda key: [x for t in kernels.values() for x in t.get(key, [])]
    includes = [str(root / d) for d in gather("include_dirs")] + [str(CORE_INCLUDE)]
    if with_cuda:
        includes += cuda_library_includes(toolchain.cuda_home)
    for requirement in gather("build_requires"):
        includes += _build_requirement_includes(requirement)
    std = f"-std={cxx_std.pop()}"
    return {
        "package": package_dir.name,
        "version": f"{manifest['version']}+{abi_tag(toolchain, with_cuda)}",
        "cpu_sources": [s for t in kernels.values() for s in t.get("sources", {}).get("cpu", [])],
        "cuda_sources": [s for t in kernels.values() for s in t.get("sources", {}).get("cuda", [])] if with_cuda else [],
        "include_dirs": includes,
        "cxx_flags": _unique([std, *gather("extra_cxx_flags"), *defines]),
        "nvcc_flags": _unique([std, *gencode_flags(archs), *gather("extra_nvcc_flags"), *defines]) if with_cuda else [],
        "archs": archs if with_cuda else [],
        "cuda_skipped": skip,
    }


def announce_skip(plan: dict) -> None:
    """Say why CUDA is skipped; under PRIME_KERNELS_REQUIRE=1 a skip fails the build instead."""
    if not plan["cuda_skipped"]:
        return
    message = f"prime-kernels: skipping CUDA for {plan['package']}: {plan['cuda_skipped']}"
    if os.environ.get(REQUIRE_ENV) == "1":
        raise BuildError(f"{message} ({REQUIRE_ENV}=1 makes this an error)")
    print(message, file=sys.stderr)


def build_record(plan: dict, toolchain: Toolchain) -> dict:
    return {
        "torch": toolchain.torch_version,
        "torch_cuda": toolchain.torch_cuda,
        "nvcc": toolchain.nvcc_version if plan["cuda_sources"] else None,
        "cxx": toolchain.cxx_version,
        "archs": plan["archs"],
        "cuda_skipped": plan["cuda_skipped"],
        "python": platform.python_version(),
    }


def setup_plugin(root: str | Path | None = None, **setup_kwargs) -> None:
    """The whole of a plugin's setup.py. ``root`` defaults to the working directory, where setup.py runs."""
    import setuptools
    from torch.utils import cpp_extension

    # pip and python -m build run setup.py from its own directory; setuptools wants sources relative to it.
    root = Path(root) if root else Path.cwd()
    toolchain = detect_toolchain()
    plan = extension_plan(root, toolchain)
    announce_skip(plan)
    record = build_record(plan, toolchain)

    extension_type = cpp_extension.CUDAExtension if plan["cuda_sources"] else cpp_extension.CppExtension
    compile_args = {"cxx": plan["cxx_flags"]}
    if plan["cuda_sources"]:
        compile_args["nvcc"] = plan["nvcc_flags"]
    # A copy under build/: setuptools wants relative sources, and objects must land inside build_temp.
    module_init = Path("build", MODULE_INIT.name)
    module_init.parent.mkdir(exist_ok=True)
    module_init.write_text(MODULE_INIT.read_text())
    extension = extension_type(
        name=f"{plan['package']}.{EXTENSION_MODULE}",
        sources=[*plan["cpu_sources"], str(module_init), *plan["cuda_sources"]],
        include_dirs=plan["include_dirs"],
        extra_compile_args=compile_args,
    )

    class BuildWithRecord(cpp_extension.BuildExtension):
        def run(self):
            super().run()
            # Beside the built _C, and beside the in-place copy an editable install (pip install -e) imports.
            in_place = Path(self.get_ext_fullpath(extension.name)).parent
            for package_dir in {Path(self.build_lib) / plan["package"], in_place}:
                package_dir.mkdir(parents=True, exist_ok=True)
                (package_dir / BUILD_RECORD_NAME).write_text(json.dumps(record, indent=2))

    setuptools.setup(
        version=plan["version"],
        packages=[plan["package"]],
        package_data={plan["package"]: [MANIFEST_NAME]},
        ext_modules=[extension],
        cmdclass={"build_ext": BuildWithRecord.with_options(use_ninja=True)},
        **setup_kwargs,
    )
