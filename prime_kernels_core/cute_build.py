"""Ahead-of-time code for CuTe DSL kernels, compiled while the wheel is built, without a GPU.

For each arch a CuTe DSL kernel lists, one child process (``CUTE_DSL_ARCH`` names the arch, no device visible) compiles
every specialization its manifest names with ``cute.compile(fn, *fakes, **constexprs, options="--gpu-arch sm_XX")``
(cute_compile: the fake arguments a JIT fallback would compile with) and exports it with ``export_to_c``: one object
file per arch and specialization, holding the host launch code and the cubin, under ``_aot/<kernel>/`` in the package.
At run time cute_runtime loads it with ``cute.runtime.load_module``: no compiler. The build record lists each object
with its function, arch, signature, constexprs and alignment, and the kernel's nvidia-cutlass-dsl release and object
file format version and the CUDA flavour of its libraries (cu12 or cu13, cute_compile.library_flavor).

Why one child per arch: the DSL reads ``CUTE_DSL_ARCH`` once, and without a GPU defaults to sm_100; ``--gpu-arch``
alone compiles for another arch but ``export_to_c`` then fails to link the host code (measured with 4.8.1: sm_80,
sm_90 and sm_120a failed, sm_100a passed). A child also keeps the DSL out of the build process.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from . import cute_compile, jit_manifest
from .jit_runtime import SHIPPED_DIR

LIBRARY = jit_manifest.LIBRARY_OF["cute-dsl"]


def object_file(kernel: str, function: str, arch: str, specialization: dict) -> str:
    """The object's path inside the package, named by its function, arch and specialization."""
    digest = hashlib.sha1(json.dumps(specialization, sort_keys=True).encode()).hexdigest()[:12]
    return f"{SHIPPED_DIR}/{kernel}/{function}-sm{arch.replace('.', '')}-{digest}.o"


def _export(package_out: Path, kernel: str, module, arch: str, specialization: dict) -> dict:
    """Compile and export one specialization for ``arch`` (in the child); its build record entry."""
    function = specialization["function"]
    compiled = cute_compile.compile_specialization(getattr(module, function), specialization, arch)
    file = object_file(kernel, function, arch, specialization)
    folder, stem = (package_out / file).parent, Path(file).stem
    folder.mkdir(parents=True, exist_ok=True)
    compiled.export_to_c(str(folder), stem, function)
    (folder / f"{stem}.h").unlink()  # the C header serves C callers; the runtime loads the object from Python
    return {**specialization, "arch": arch, "file": file, "prefix": function}


def _child(request: dict) -> dict:
    """The child's work: every specialization for one arch, or why the arch failed."""
    sys.path.insert(0, request["root"])
    from cutlass.cute.export import _object_file_version

    module = importlib.import_module(request["functions"])
    shipped = [_export(Path(request["out"]), request["kernel"], module, request["arch"], s)
               for s in request["specializations"]]
    return {"shipped": shipped, "object_file_version": _object_file_version,
            "library_flavor": cute_compile.library_flavor()}


def _compile_arch(root: Path, package_out: Path, name: str, table: dict, arch: str) -> dict:
    request = {"root": str(root), "out": str(package_out), "kernel": name, "functions": table["functions"],
               "arch": arch, "specializations": [s for spec in table.get("specializations", [])
                                                 for s in jit_manifest.expanded(spec)]}
    env = dict(os.environ, CUTE_DSL_ARCH=cute_compile.gpu_arch(arch), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request), capture_output=True,
                          text=True, env=env, timeout=1800)
    if done.returncode != 0:
        last = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
        raise RuntimeError(" / ".join(last) or f"the compile child exited {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ship_kernel(root: Path, package_out: Path, name: str, table: dict) -> dict:
    """This kernel's build record entry: every specialization for every arch it lists, each arch shipped whole or not
    at all (with why)."""
    entry = {"language": table["language"], "requires": table["requires"], "archs": [], "not_built": {},
             "shipped": []}
    if not table.get("archs"):
        return entry
    try:
        entry["library_version"] = importlib.metadata.version(LIBRARY)
    except importlib.metadata.PackageNotFoundError:
        entry["not_built"] = {a: f"{LIBRARY} is not installed in the build's Python" for a in table["archs"]}
        return entry
    for arch in table["archs"]:
        try:
            compiled = _compile_arch(root, package_out, name, table, arch)
        except Exception as exc:  # one arch the DSL cannot target leaves the others shipped
            entry["not_built"][arch] = f"{LIBRARY} {entry['library_version']} did not compile it: {exc}"
            continue
        entry["archs"].append(arch)
        entry["object_file_version"] = compiled["object_file_version"]
        entry["library_flavor"] = compiled["library_flavor"]
        entry["shipped"] += compiled["shipped"]
    return entry


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.stdin.read()))))
