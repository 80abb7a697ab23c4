"""Ahead-of-time code for JIT kernels, compiled while the wheel is built, without a GPU (CuTe DSL kernels: cute_build).

For each arch a Triton kernel lists and each specialization its manifest names, the build has Triton's JIT itself
compile a call of that specialization (16-byte aligned tensors of its dtypes, its scalars, constexprs and launch
options) for ``GPUTarget("cuda", capability, 32)`` (jit_target: the JIT's warmup with the device replaced), so the
shipped code is what the JIT compiles for such a call on such a device, by construction, and ships the cubin in the
package (``_aot/<kernel>/``). The build record lists every shipped cubin with what a launcher needs (kernel name,
runtime parameters and their types, the pointers compiled as 16-byte aligned, trailing scratch pointers, warps, shared
memory), Triton's hash of the compile (its inputs: source, specialization, options, target, ptxas) and, per arch, why
one was not shipped. jit_runtime.launch runs them with torch's static launcher: nothing is compiled at run time.

Why this mechanism (and not Triton's cache or Triton's CompiledKernel): Triton's launcher is a C file that Triton
compiles with the system C compiler the first time a process launches any kernel (triton/backends/nvidia/driver.py:
CudaUtils, compile_module_from_file), and its cache key runs ptxas --version; a pre-filled cache would still compile
the launcher on a fresh machine and breaks on any change of Triton, Python or path. torch's static launcher is C++ in
libtorch_python (Inductor launches its own Triton kernels with it), loads a cubin by path and launches it with the
current stream: no compiler, no cache, and no dependence on the installed Triton's version for shipped code.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import platform
import re
import sys
from pathlib import Path

from . import jit_manifest, jit_target
from .manifest import BUILD_RECORD_NAME, MANIFEST_NAME, capability_of, load
from .jit_runtime import LAUNCHER_CHARS, SHIPPED_DIR, TORCH_TO_TRITON

# Triton appends these pointer parameters to every CUDA kernel when its metadata has the size (torch's static
# launcher follows the same rule); shipped code passes null, so each size must be 0.
SCRATCH_SIZES = ("global_scratch_size", "profile_scratch_size")


class AotBuildError(RuntimeError):
    """A JIT plugin build that cannot go on (a manifest the kit cannot compile, or a target failing under REQUIRE)."""


def _unshippable(metadata, params: list, ptx: str) -> str | None:
    """Why a compiled kernel cannot be launched by the static launcher with null scratch, or None."""
    scalars = [f"{n} {kind}" for n, kind in params if not kind.startswith("*") and kind not in LAUNCHER_CHARS]
    if scalars:
        return f"the shipped launcher cannot pass its scalar parameters {', '.join(scalars)} (pass fp32 or an int)"
    used = [s for s in SCRATCH_SIZES if getattr(metadata, s, 0)]
    if used:
        return f"it needs {', '.join(used)} > 0, scratch memory the shipped launcher does not allocate"
    if getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False) \
            or getattr(metadata, "launch_pdl", False) or getattr(metadata, "tensordesc_meta", None):
        return "it uses clusters, a cooperative grid, programmatic dependent launch or TMA descriptors, which the " \
               "shipped launcher does not set up"
    declared = len(re.findall(r"\.param\s", ptx.split(".entry", 1)[-1].split("{", 1)[0]))
    expected = len(params) + sum(hasattr(metadata, s) for s in SCRATCH_SIZES)
    if declared != expected:
        return (f"its PTX entry takes {declared} parameters where {len(params)} arguments and the scratch pointers "
                f"make {expected}: this Triton's kernel ABI is not the one the shipped launcher follows")
    return None


# What stands for a runtime scalar of each Triton type in a call the build makes up: the JIT types a Python bool as
# u1, an int by its range, a float as fp32. Integers are do_not_specialize in a shipped function (_refuse_specialized),
# so their value changes nothing; these are neither 1 nor multiples of 16 all the same.
SCALAR_STAND_INS = {"u1": True, "i32": 3, "i64": 2**40 + 3, "u64": 2**63 + 3, "fp32": 1.5}


def _stand_in(name: str, kind: str):
    """What the build passes Triton's JIT for parameter ``name`` of Triton type ``kind``: a torch dtype for a pointer
    (Triton's warmup makes it a 16-byte aligned tensor), a Python scalar the JIT types as ``kind``."""
    import torch

    if kind.startswith("*"):
        dtype = {v: k for k, v in TORCH_TO_TRITON.items()}.get(kind[1:])
        if dtype is None:
            raise AotBuildError(f"{name} is a {kind}: no torch dtype gives Triton that element type")
        return getattr(torch, dtype)
    if kind not in SCALAR_STAND_INS:
        raise AotBuildError(f"{name} is a {kind}: Triton's JIT types a Python scalar as one of "
                            f"{sorted(SCALAR_STAND_INS)} only, so no call has this signature")
    return SCALAR_STAND_INS[kind]


def _refuse_specialized(fn, signature: dict) -> None:
    """A shipped function's integers must be do_not_specialize: the JIT compiles one variant per value class of a
    specialized integer (equal to 1, divisible by 16, other), where shipped code has one per call signature."""
    specialized = [p.name for p in fn.params if p.name in signature and signature[p.name][0] in "iu"
                   and signature[p.name] != "u1" and not p.do_not_specialize]
    if specialized:
        raise AotBuildError(f"{fn.__name__}'s integer parameters {specialized} are specialized by Triton's JIT on "
                            "their value (equal to 1, divisible by 16); shipped code is one compile per call "
                            "signature, so list them in @triton.jit(do_not_specialize=[...])")


def compile_function(fn, arch: str, specialization: dict, options: dict):
    """Triton's CompiledKernel of JIT function ``fn`` for ``arch`` ("9.0a"), compiled by Triton's JIT itself for a call
    of ``specialization`` (16-byte aligned tensors of its dtypes, its scalars and constexprs) with ``options``: what a
    launch of such a call on such a device compiles (jit_target)."""
    signature, constexprs = specialization["signature"], specialization["constexprs"]
    unknown = set(signature) ^ (set(fn.arg_names) - set(constexprs))
    if unknown:
        raise AotBuildError(f"{fn.__name__}'s parameters are {fn.arg_names}; the specialization gives types and "
                            f"constexprs that do not cover them exactly (off: {sorted(unknown)})")
    _refuse_specialized(fn, signature)
    args = [_stand_in(n, signature[n]) for n in fn.arg_names if n not in constexprs]
    compiled = jit_target.compiled_by_the_jit(fn, arch, tuple(args), {**constexprs, **options})
    typed = {n: compiled.src.signature[n] for n in signature}
    if typed != signature:
        raise AotBuildError(f"Triton's JIT types {fn.__name__}'s parameters {typed}, the specialization says "
                            f"{signature}")
    return compiled


def aligned_parameters(fn, compiled) -> list[str]:
    """The pointer parameters ``compiled`` assumes 16-byte aligned (Triton's ``tt.divisibility 16`` attribute)."""
    return [name for i, name in enumerate(fn.arg_names)
            if ["tt.divisibility", 16] in [list(a) for a in compiled.src.attrs.get((i,), [])]]


def _file_name(kernel: str, function: str, arch: str, specialization: dict) -> str:
    digest = hashlib.sha1(json.dumps(specialization, sort_keys=True).encode()).hexdigest()[:12]
    return f"{SHIPPED_DIR}/{kernel}/{function}-sm{arch.replace('.', '')}-{digest}.cubin"


def ship_function(package_out: Path, kernel: str, fn, arch: str, specialization: dict, options: dict) -> dict:
    """Compile one specialization for one arch, write its cubin under ``package_out``, return its record entry."""
    compiled = compile_function(fn, arch, specialization, options)
    params = [[n, specialization["signature"][n]] for n in fn.arg_names if n not in specialization["constexprs"]]
    why = _unshippable(compiled.metadata, params, compiled.asm["ptx"])
    if why:
        raise AotBuildError(f"{fn.__name__} cannot be shipped: {why}")
    file = _file_name(kernel, fn.__name__, arch, specialization)
    (package_out / file).parent.mkdir(parents=True, exist_ok=True)
    (package_out / file).write_bytes(compiled.asm["cubin"])
    return {
        "function": fn.__name__, "arch": arch, "params": params, "constexprs": specialization["constexprs"],
        "file": file, "name": compiled.metadata.name, "num_warps": compiled.metadata.num_warps,
        "shared": compiled.metadata.shared, "scratch": sum(hasattr(compiled.metadata, s) for s in SCRATCH_SIZES),
        "aligned": aligned_parameters(fn, compiled), "triton_hash": compiled.hash,
    }


def _ptxas_version(arch: str) -> str | None:
    """The ptxas release Triton compiles ``arch`` with (it bundles one for sm_100 and newer, one for the rest)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version

        found = re.search(r"release (\d+\.\d+)", get_ptxas_version(capability_of(arch)[0] * 10))
        return found[1] if found else None
    except Exception:
        return None


def ship_kernel(package_out: Path, name: str, table: dict) -> dict:
    """This kernel's build record entry: every specialization for every arch it lists, each arch shipped whole or
    not at all (with why)."""
    entry = {"language": table["language"], "requires": table["requires"], "archs": [], "not_built": {}, "ptxas": {},
             "shipped": []}
    if not table.get("archs"):
        return entry
    import triton

    entry["library_version"] = triton.__version__
    functions = importlib.import_module(table["functions"])
    specializations = [s for spec in table.get("specializations", []) for s in jit_manifest.expanded(spec)]
    for arch in table["archs"]:
        try:
            shipped = [ship_function(package_out, name, getattr(functions, s["function"]), arch, s,
                                     table["launch"][s["function"]]) for s in specializations]
        except Exception as exc:  # one arch Triton cannot target leaves the others shipped
            entry["not_built"][arch] = f"Triton {triton.__version__} did not compile it: {type(exc).__name__}: {exc}"
            continue
        entry["archs"].append(arch)
        entry["ptxas"][arch] = _ptxas_version(arch)
        entry["shipped"] += shipped
    return entry


def _refuse_other_languages(package: str, kernels: dict) -> None:
    compiled = [n for n, t in kernels.items() if not jit_manifest.is_jit(t)]
    if compiled:
        raise AotBuildError(f"{package}: kernels {compiled} are compiled (C++/CUDA) and the others JIT; the build kit "
                            "builds a plugin of one kind: put them in two plugins")


def _ship(root: Path, package_out: Path, name: str, table: dict) -> dict:
    if table["language"] == "cute-dsl":
        from . import cute_build

        return cute_build.ship_kernel(root, package_out, name, table)
    return ship_kernel(package_out, name, table)


def build_record(root: Path, package_out: Path, kernels: dict, required: bool) -> dict:
    """Compile every kernel's shipped code into ``package_out`` (its JIT functions imported from the source tree at
    ``root``); the record of what was shipped and what was not."""
    import torch

    record = {"torch": torch.__version__, "python": platform.python_version(), "jit": True,
              "kernels": {name: _ship(root, package_out, name, table) for name, table in kernels.items()}}
    for name, kernel in record["kernels"].items():
        shipped = ", ".join(kernel["archs"]) or "no arch"
        left = "; ".join(f"not {a}: {why}" for a, why in kernel["not_built"].items())
        print(f"prime-kernels: {name}: {len(kernel['shipped'])} compiled functions shipped for {shipped}"
              + (f" ({left})" if left else ""), file=sys.stderr)
        if left and required:
            raise AotBuildError(f"prime-kernels: {name}: {left} (PRIME_KERNELS_REQUIRE=1 makes this an error)")
    return record


def setup_jit_plugin(root: Path, package_dir: Path, required: bool, **setup_kwargs) -> None:
    """A JIT plugin's setup: a pure-Python wheel holding its manifest, its shipped code and the build record."""
    import setuptools
    from setuptools.command.build_py import build_py

    manifest = load(package_dir)
    _refuse_other_languages(package_dir.name, manifest["kernels"])

    class BuildWithShippedCode(build_py):
        def run(self):
            super().run()
            package_out = Path(self.build_lib) / package_dir.name
            sys.path.insert(0, str(root))  # the build imports the kernel's JIT functions from the source tree
            try:
                record = build_record(root, package_out, manifest["kernels"], required)
            finally:
                sys.path.remove(str(root))
            (package_out / BUILD_RECORD_NAME).write_text(json.dumps(record, indent=2))

    setuptools.setup(
        version=manifest["version"],
        packages=[package_dir.name],
        package_data={package_dir.name: [MANIFEST_NAME]},
        cmdclass={"build_py": BuildWithShippedCode},
        **setup_kwargs,
    )


def check_jit_wheel(names: list[str], read, package: str, kernels: dict, record: dict) -> list[str]:
    """Every way a JIT plugin's wheel differs from a release wheel of its manifest (``names`` its members, ``read(name)``
    their bytes): each kernel shipped for every arch it lists, one file (a cubin, or a CuTe DSL object) per arch and
    specialization, each in the wheel and machine code, nothing else beside the Python surface, the manifest and the
    record."""
    problems = []
    shipped_files = set()
    for name, table in kernels.items():
        kernel = record.get("kernels", {}).get(name, {})
        missing = [a for a in table.get("archs", []) if a not in kernel.get("archs", [])]
        if missing:
            why = "; ".join(f"{a}: {kernel.get('not_built', {}).get(a, 'not in the record')}" for a in missing)
            problems.append(f"{name} ships no code for {', '.join(missing)} ({why})")
        per_arch = len([s for spec in table.get("specializations", []) for s in jit_manifest.expanded(spec)])
        for arch in kernel.get("archs", []):
            count = sum(e["arch"] == arch for e in kernel.get("shipped", []))
            if count != per_arch:
                problems.append(f"{name} ships {count} functions for {arch}, its manifest names {per_arch}")
        for entry in kernel.get("shipped", []):
            file = f"{package}/{entry['file']}"
            shipped_files.add(file)
            if file not in names:
                problems.append(f"{file} is in the build record but not in the wheel")
            elif read(file)[:4] != b"\x7fELF":
                problems.append(f"{file} is not machine code (no ELF header: a cubin, or a CuTe DSL object)")
    surface = {f"{package}/{MANIFEST_NAME}", f"{package}/{BUILD_RECORD_NAME}"}
    problems += [f"{n} is not part of a JIT plugin's surface (its .py files, {MANIFEST_NAME}, {BUILD_RECORD_NAME}, "
                 "the shipped code of its record)" for n in names
                 if not (".dist-info/" in n or n.endswith(".py") or n in surface or n in shipped_files)]
    return problems
