"""Release wheels: ``python -m prime_kernels_core.release --wheelhouse DIR [--python PY]... [--cpu] PROJECT...`` builds
each project's wheel (a plugin: fat, every arch each kernel lists, PRIME_KERNELS_REQUIRE=1) with each interpreter
given (one per platform: an aarch64 one under emulation builds the linux_aarch64 wheels; a pure-Python project is built
once), with ``--cpu`` also each plugin's CPU-only wheel, checks every plugin wheel from its own files, and prints the
lines a consumer pastes to pin exactly these wheels, with ``platform_machine`` markers where platforms differ.

A plugin wheel passes when it holds only its Python surface, kernel.toml, the build record and its compiled modules
(``_C``, and ``_C_stable`` for stable-ABI kernels); the record says every kernel was compiled for every arch its
manifest lists; each module links libstdc++ dynamically (a static one crashes on the first C++ exception that crosses
into torch); and the machine code inside each module has, for each arch, one cubin
per CUDA source compiled for it (read with cuobjdump), so no kernel's code went to another kernel's archs; each
module's ELF machine is the wheel's platform's. A CPU-only wheel (``+cpu...``) holds no device code and needs no CUDA
library.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .build import ARCH_ENV, CPU_ONLY_ARCH, KERNELS_ENV, REQUIRE_ENV
from .manifest import BUILD_RECORD_NAME, MANIFEST_NAME, cuda_source_sets, extension_module, load

WHEEL_NAME = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)-.+-(?P<platform>[^-]+)\.whl")
# readelf -h's "Machine:" for each wheel platform's machine.
ELF_MACHINE = {"x86_64": "Advanced Micro Devices X86-64", "aarch64": "AArch64"}
# Libraries only a CUDA build links: a CPU-only wheel that needs one fails to import under a CPU-only torch.
CUDA_LIBRARIES = re.compile(r"lib(cudart|torch_cuda|c10_cuda)\b")


def build_wheel(project: Path, wheelhouse: Path, log_dir: Path, python: str = sys.executable, cpu_only: bool = False) -> Path:
    """The project's wheel, built by ``python`` against its torch: fat, or with no device code when ``cpu_only``; the
    build's output goes to a log file."""
    env = {k: v for k, v in os.environ.items() if k not in (ARCH_ENV, KERNELS_ENV)}
    env[REQUIRE_ENV] = "1"
    if cpu_only:
        env[ARCH_ENV] = CPU_ONLY_ARCH
    out = Path(tempfile.mkdtemp(prefix="wheel-", dir=wheelhouse))
    log = log_dir / f"{project.resolve().name}-{machine_of(python)}{'-cpu' if cpu_only else ''}.log"
    with open(log, "w") as f:
        done = subprocess.run([python, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(project)],
                              stdout=f, stderr=subprocess.STDOUT, env=env)
    wheels = list(out.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"building {project} failed (exit {done.returncode}); the last lines of {log}:\n{tail}")
    wheel = wheelhouse / wheels[0].name
    shutil.move(wheels[0], wheel)
    out.rmdir()
    return wheel


@functools.lru_cache(maxsize=None)
def machine_of(python: str) -> str:
    """The machine ``python`` runs as (``platform.machine()``: x86_64, aarch64), asked of it once."""
    if python == sys.executable:
        return platform.machine()
    return subprocess.run([python, "-c", "import platform; print(platform.machine())"], capture_output=True,
                          text=True, check=True).stdout.strip()


def wheel_machine(wheel: Path) -> str | None:
    """The machine a wheel's platform tag names (``linux_aarch64`` -> aarch64), None for a pure wheel (``any``)."""
    platform_tag = WHEEL_NAME.match(wheel.name)["platform"]
    return None if platform_tag == "any" else next((m for m in ELF_MACHINE if platform_tag.endswith(m)), platform_tag)


def _cuobjdump() -> str | None:
    """cuobjdump with nvdisasm beside it (its -sass needs it): triton's copy (a dependency of torch's CUDA wheels), the
    toolkit's, the nvidia-cuda-cuobjdump wheel's, or the PATH's."""
    import importlib.util

    candidates = []
    for package, sub in (("triton", "backends/nvidia/bin"), ("nvidia", "cu13/bin")):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(Path(root, sub, "cuobjdump"))
    candidates.insert(1, Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"))
    found = [c for c in candidates if c.is_file() and os.access(c, os.X_OK)]
    with_disassembler = [c for c in found if (c.parent / "nvdisasm").exists()]
    return str((with_disassembler or found)[0]) if found else shutil.which("cuobjdump")


def cubins_per_arch(shared_object: Path) -> collections.Counter:
    """{"sm_90a": how many cubins of that arch ``shared_object`` holds}, read with cuobjdump --list-elf."""
    tool = _cuobjdump()
    if tool is None:
        raise SystemExit("no cuobjdump found: pip install nvidia-cuda-cuobjdump (or put a CUDA toolkit on CUDA_HOME)")
    listing = subprocess.run([tool, "--list-elf", str(shared_object)], capture_output=True, text=True).stdout
    return collections.Counter(re.findall(r"\.(sm_\d+[af]?)\.cubin", listing))


def _needed_libraries(shared_object: Path) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", str(shared_object)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)


def _elf_machine(shared_object: Path) -> str:
    header = subprocess.run(["readelf", "-h", str(shared_object)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"Machine:\s+(.+)", header)
    return found[1].strip() if found else "unknown"


def _check_module(archive, scratch: str, package: str, module: str, kernels: dict, record: dict, machine: str,
                  cpu_only: bool) -> list[str]:
    """One compiled module of the wheel (``_C`` or ``_C_stable``) against its kernels: ELF machine, archs, cubins,
    libstdc++, and no CUDA library in a CPU-only wheel."""
    found_names = [n for n in archive.namelist() if re.fullmatch(rf"{package}/{module}\.[^/]*\.so", n)]
    if len(found_names) != 1:
        return [f"the wheel holds {len(found_names)} {package}/{module}*.so for kernels {sorted(kernels)}, not one"]
    extension = found_names[0]
    shared_object = Path(archive.extract(extension, scratch))
    problems, expected = [], collections.Counter()
    elf = _elf_machine(shared_object)
    if elf != ELF_MACHINE.get(machine):
        problems.append(f"{extension} is ELF machine {elf!r}, the wheel's platform {machine} needs "
                        f"{ELF_MACHINE.get(machine, 'one this check knows')!r}")
    for kernel, table in kernels.items():
        built = record.get("kernels", {}).get(kernel, {})
        wanted = [] if cpu_only else table.get("archs", [])
        if built.get("archs") != wanted:
            problems.append(f"{kernel} was compiled for {built.get('archs')}, "
                            + ("a CPU-only wheel holds no device code" if cpu_only else f"its manifest lists {wanted}"))
        for arch, sources in ({} if cpu_only else cuda_source_sets(table)).items():
            expected["sm_" + arch.replace(".", "")] += len(sources)
    found = cubins_per_arch(shared_object)
    if found != expected:
        problems.append(f"{extension} holds cubins {dict(sorted(found.items()))}, its kernels' source sets need "
                        f"{dict(sorted(expected.items()))}")
    needed = _needed_libraries(shared_object)
    if cpu_only and any(CUDA_LIBRARIES.match(lib) for lib in needed):
        problems.append(f"{extension} of a CPU-only wheel links CUDA libraries (NEEDED: {needed})")
    if not any(lib.startswith("libstdc++.so") for lib in needed):
        problems.append(f"{extension} does not link libstdc++ dynamically (NEEDED: {needed}); build with the "
                        "system g++ (CXX=/usr/bin/g++), not one that links it statically")
    return problems


def check_plugin_wheel(wheel: Path) -> list[str]:
    """Every way ``wheel`` differs from a release wheel of its manifest, as sentences (none: it passes)."""
    import json

    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as scratch:
        names = archive.namelist()
        package = next(n.split("/")[0] for n in names if n.endswith(f"/{MANIFEST_NAME}"))
        kernels = load(archive.extract(f"{package}/{MANIFEST_NAME}", scratch))["kernels"]
        record = json.loads(archive.read(f"{package}/{BUILD_RECORD_NAME}"))
        if record.get("jit"):  # Triton kernels: shipped cubins, no compiled module
            from .jit_build import check_jit_wheel

            return check_jit_wheel(names, archive.read, package, kernels, record)
        modules = sorted({extension_module(t) for t in kernels.values()})
        problems = [
            f"{name} is not part of a plugin's surface (its .py files, {MANIFEST_NAME}, {BUILD_RECORD_NAME}, "
            f"{', '.join(modules)})"
            for name in names
            if not (".dist-info/" in name or name.endswith(".py") or name in (f"{package}/{MANIFEST_NAME}", f"{package}/{BUILD_RECORD_NAME}")
                    or any(re.fullmatch(rf"{package}/{module}\.[^/]*\.so", name) for module in modules))
        ]
        if record.get("cuda_skipped"):
            problems.append(f"its build skipped CUDA: {record['cuda_skipped']}")
        cpu_only = WHEEL_NAME.match(wheel.name)["version"].split("+")[-1].startswith("cpu")
        for module in modules:
            members = {k: t for k, t in kernels.items() if extension_module(t) == module}
            problems += _check_module(archive, scratch, package, module, members, record, wheel_machine(wheel), cpu_only)
    return problems


def _requirements(wheels: list[Path]) -> dict[str, list[tuple[str, str | None, Path]]]:
    """{distribution: [(version, machine or None for a pure wheel, file)]}, in the order built."""
    found: dict[str, list] = {}
    for wheel in wheels:
        m = WHEEL_NAME.match(wheel.name)
        found.setdefault(m["name"].replace("_", "-"), []).append((m["version"], wheel_machine(wheel), wheel))
    return found


def _marker(machine: str | None) -> str:
    return f"platform_machine == '{machine}'" if machine else ""


def pin_lines(wheels: list[Path], wheelhouse: Path) -> str:
    """What a consumer pastes: a pip line with exact versions, and uv sources naming these files (one per platform,
    each with its ``platform_machine`` marker, where a distribution has wheels for several)."""
    requirements, uv = [], []
    for name, built in _requirements(wheels).items():
        versions = {version for version, _, _ in built}
        if len(versions) == 1:
            requirements.append(f"{name}=={built[0][0]}")
        else:  # one requirement per platform, each pinning its own wheel's version
            requirements += [f"{name}=={version}; {_marker(machine)}" for version, machine, _ in built]
        if len(built) == 1:
            uv.append(f'{name} = {{ path = "{built[0][2]}" }}')
        else:
            uv += [f"{name} = ["] + [f'  {{ path = "{path}", marker = "{_marker(machine)}" }},'
                                     for _, machine, path in built] + ["]"]
    return "\n".join([
        f"pip install --find-links {wheelhouse} " + " ".join(f'"{r}"' for r in requirements),
        "", "# pyproject.toml", "[project]", "dependencies = [" + ", ".join(f'"{r}"' for r in requirements) + "]",
        "[tool.uv.sources]", *uv,
    ])


def _release(project: Path, wheelhouse: Path, log_dir: Path, python: str, cpu_only: bool) -> tuple[Path, bool]:
    """Build one wheel and check it; one line on stderr says what came out. (wheel, passed)."""
    start = time.monotonic()
    wheel = build_wheel(project, wheelhouse, log_dir, python, cpu_only)
    is_plugin = any(n.endswith(f"/{MANIFEST_NAME}") for n in zipfile.ZipFile(wheel).namelist())
    problems = check_plugin_wheel(wheel) if is_plugin else []
    size = wheel.stat().st_size / 2**20
    print(f"[release] {wheel.name}: {size:.1f} MiB, built in {time.monotonic() - start:.0f} s, "
          + ("checks passed" if not problems else "FAILED: " + "; ".join(problems)), file=sys.stderr)
    return wheel, not problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_kernels_core.release", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("projects", nargs="+", type=Path, help="project folders (a plugin, or the core itself)")
    parser.add_argument("--wheelhouse", type=Path, default=Path("wheelhouse"))
    parser.add_argument("--python", action="append", dest="pythons", metavar="PYTHON",
                        help="an interpreter that builds the plugins (repeatable, one per platform; default: this one)")
    parser.add_argument("--cpu", action="store_true", help="also build each plugin's CPU-only wheel (+cpu...)")
    args = parser.parse_args(argv)
    wheelhouse = args.wheelhouse.resolve()
    log_dir = wheelhouse / "logs"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(log_dir, os.W_OK):
            raise PermissionError(f"{log_dir} is not writable")
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: --wheelhouse {args.wheelhouse} cannot hold the wheels and their logs: "
                       f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}\n")
    pythons = args.pythons or [sys.executable]
    plugins = [p for p in args.projects if list(p.glob(f"*/{MANIFEST_NAME}"))]
    jobs = [(p, pythons[0], False) for p in args.projects if p not in plugins]  # pure Python: one wheel for all
    jobs += [(p, python, False) for python in pythons for p in plugins]
    cpu_jobs = [(p, python, True) for python in pythons for p in plugins] if args.cpu else []
    results = {cpu: [_release(p, wheelhouse, log_dir, python, cpu) for p, python, cpu in group]
               for cpu, group in ((False, jobs), (True, cpu_jobs))}
    print(pin_lines([w for w, _ in results[False]], wheelhouse))
    if cpu_jobs:
        core = [w for w, _ in results[False] if wheel_machine(w) is None]
        print("\n# CPU-only torch\n" + pin_lines(core + [w for w, _ in results[True]], wheelhouse))
    return 0 if all(ok for group in results.values() for _, ok in group) else 1


if __name__ == "__main__":
    sys.exit(main())
