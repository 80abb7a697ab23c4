"""Release wheels: ``python -m prime_kernels_core.release --wheelhouse DIR PROJECT...`` builds each project's wheel
(a plugin: fat, every arch each kernel lists, PRIME_KERNELS_REQUIRE=1), checks every plugin wheel from its own files,
and prints the lines a consumer pastes to pin exactly these wheels.

A plugin wheel passes when it holds only its Python surface, kernel.toml, the build record and its compiled modules
(``_C``, and ``_C_stable`` for stable-ABI kernels); the record says every kernel was compiled for every arch its
manifest lists; each module links libstdc++ dynamically (a static one crashes on the first C++ exception that crosses
into torch); and the machine code inside each module has, for each arch, one cubin
per CUDA source compiled for it (read with cuobjdump), so no kernel's code went to another kernel's archs.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .build import ARCH_ENV, KERNELS_ENV, REQUIRE_ENV
from .manifest import BUILD_RECORD_NAME, MANIFEST_NAME, cuda_source_sets, extension_module, load

WHEEL_NAME = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)-.+\.whl")


def build_wheel(project: Path, wheelhouse: Path, log_dir: Path) -> Path:
    """The project's wheel, built fat against the installed torch; the build's output goes to a log file."""
    env = {k: v for k, v in os.environ.items() if k not in (ARCH_ENV, KERNELS_ENV)}
    env[REQUIRE_ENV] = "1"
    out = Path(tempfile.mkdtemp(prefix="wheel-", dir=wheelhouse))
    log = log_dir / f"{project.resolve().name}.log"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(project)],
                              stdout=f, stderr=subprocess.STDOUT, env=env)
    wheels = list(out.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"building {project} failed (exit {done.returncode}); the last lines of {log}:\n{tail}")
    wheel = wheelhouse / wheels[0].name
    shutil.move(wheels[0], wheel)
    out.rmdir()
    return wheel


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


def _check_module(archive, scratch: str, package: str, module: str, kernels: dict, record: dict) -> list[str]:
    """One compiled module of the wheel (``_C`` or ``_C_stable``) against its kernels: archs, cubins, libstdc++."""
    found_names = [n for n in archive.namelist() if re.fullmatch(rf"{package}/{module}\.[^/]*\.so", n)]
    if len(found_names) != 1:
        return [f"the wheel holds {len(found_names)} {package}/{module}*.so for kernels {sorted(kernels)}, not one"]
    extension = found_names[0]
    shared_object = Path(archive.extract(extension, scratch))
    problems, expected = [], collections.Counter()
    for kernel, table in kernels.items():
        built = record.get("kernels", {}).get(kernel, {})
        if built.get("archs") != table.get("archs", []):
            problems.append(f"{kernel} was compiled for {built.get('archs')}, its manifest lists {table.get('archs', [])}")
        for arch, sources in cuda_source_sets(table).items():
            expected["sm_" + arch.replace(".", "")] += len(sources)
    found = cubins_per_arch(shared_object)
    if found != expected:
        problems.append(f"{extension} holds cubins {dict(sorted(found.items()))}, its kernels' source sets need "
                        f"{dict(sorted(expected.items()))}")
    needed = _needed_libraries(shared_object)
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
        for module in modules:
            members = {k: t for k, t in kernels.items() if extension_module(t) == module}
            problems += _check_module(archive, scratch, package, module, members, record)
    return problems


def pin_lines(wheels: list[Path], wheelhouse: Path) -> str:
    """What a consumer pastes: a pip line with exact versions, and uv sources naming these files."""
    found = [WHEEL_NAME.match(w.name) for w in wheels]
    requirements = [f"{m['name'].replace('_', '-')}=={m['version']}" for m in found]
    uv = [f'{m["name"].replace("_", "-")} = {{ path = "{wheelhouse / w.name}" }}' for m, w in zip(found, wheels)]
    return "\n".join([
        f"pip install --find-links {wheelhouse} " + " ".join(f"'{r}'" for r in requirements),
        "", "# pyproject.toml", "[project]", "dependencies = [" + ", ".join(f'"{r}"' for r in requirements) + "]",
        "[tool.uv.sources]", *uv,
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_kernels_core.release", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("projects", nargs="+", type=Path, help="project folders (a plugin, or the core itself)")
    parser.add_argument("--wheelhouse", type=Path, default=Path("wheelhouse"))
    args = parser.parse_args(argv)
    wheelhouse = args.wheelhouse.resolve()
    log_dir = wheelhouse / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    wheels, failed = [], False
    for project in args.projects:
        start = time.monotonic()
        wheel = build_wheel(project, wheelhouse, log_dir)
        is_plugin = any(n.endswith(f"/{MANIFEST_NAME}") for n in zipfile.ZipFile(wheel).namelist())
        problems = check_plugin_wheel(wheel) if is_plugin else []
        size = wheel.stat().st_size / 2**20
        print(f"[release] {wheel.name}: {size:.1f} MiB, built in {time.monotonic() - start:.0f} s, "
              + ("checks passed" if not problems else "FAILED: " + "; ".join(problems)), file=sys.stderr)
        failed |= bool(problems)
        wheels.append(wheel)
    print(pin_lines(wheels, wheelhouse))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
