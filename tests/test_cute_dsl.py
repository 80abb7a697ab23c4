"""CuTe DSL kernels: the manifest's compile-argument form, the specialization a call gets, which shipped object
serves it (or why none does), gating notes, and the ahead-of-time build of one function without a GPU (skipped, with
the reason, where nvidia-cutlass-dsl is not installed). The example plugin's tests cover the real wheel."""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from prime_kernels_core import (cute_compile, cute_runtime, cute_signature, jit_gating, jit_manifest, jit_runtime,
                                manifest, registry)

DSL = "nvidia-cutlass-dsl"
needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                               reason=f"{DSL} is not installed (scripts/setup.sh installs it)")

# ---------------------------------------------------------------- the manifest

GOOD = dict(description="d", namespace="ns", ops=["op"], module="m.ops", language="cute-dsl",
            requires=f"{DSL} >= 4.8, < 4.9", capability=">= 8.0", cpu=["pytorch"], archs=["8.0", "9.0a"],
            functions="m.kernels",
            specializations=[{"function": "f", "signature": {"x": "{dtype}[rows, N]", "y": "Float32[rows]",
                                                             "eps": "Float32", "stream": "stream"},
                              "dtypes": ["BFloat16", "Float32"], "align": 16,
                              "constexprs": {"N": 64, "FLAG": [False, True]}}])


@pytest.fixture
def load(tmp_path, write_manifest):
    """Returns load(**change): the manifest of GOOD with ``change``'s keys."""
    return lambda **change: manifest.load(write_manifest(tmp_path, {**GOOD, **change}))


def test_a_good_table_loads(load):
    assert load()["kernels"]["k"]["language"] == "cute-dsl"


def _spec(**change):
    return {**GOOD["specializations"][0], **change}


@pytest.mark.parametrize("change, words", [
    (dict(cpu=["interpreter"]), "cpu lists how the ops run on the CPU, each once, from ['pytorch']"),
    (dict(launch={"f": {"num_warps": 4}}), "launch holds Triton's launch options; a cute-dsl kernel's launch"),
    (dict(specializations=[_spec(signature={"x": "Float33[rows]"})]), "signature.x: expected a tensor such as"),
    (dict(specializations=[_spec(signature={"x": "Float32[rows, 2x]"})]), "a tensor's modes are names or integers"),
    (dict(specializations=[_spec(signature={"x": "Float32[rows, FLAG]"})]), "mode FLAG of 'Float32[rows, FLAG]' is "
                                                                             "the constexpr FLAG = False"),
    (dict(specializations=[_spec(dtypes=[])]), "signature.x uses {dtype}, and the specialization lists no dtypes"),
    (dict(specializations=[_spec(dtypes=["bf16"])]), "dtypes lists the element types {dtype} stands for"),
    (dict(specializations=[_spec(signature={"x": "Float32[rows]"})]), "no signature entry uses {dtype}"),
    (dict(specializations=[_spec(align=12)]), "align is the byte alignment every tensor is compiled for, a power of "
                                              "two"),
    (dict(specializations=[_spec(constexprs={"N": []})]), "constexprs maps each constexpr parameter to a number or "
                                                          "boolean, or to a list of them"),
    (dict(specializations=[_spec(num_warps=4)]), "needs a function name and only the keys"),
])
def test_manifest_errors_name_the_key(load, change, words):
    with pytest.raises(manifest.ManifestError, match=words.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)").replace("{", r"\{").replace("}", r"\}")):
        load(**change)


def test_archs_are_spelled_as_gpu_arch_takes_them(load):
    """Unlike Triton (which picks sm_90a itself), the DSL compiles what --gpu-arch names: 9.0 and 9.0a both load."""
    assert load(archs=["9.0", "9.0a", "12.0a"])["kernels"]["k"]["archs"] == ["9.0", "9.0a", "12.0a"]


def test_tensor_modes_are_dynamic_names_or_static_extents():
    assert cute_signature.parse("BFloat16[tokens, N, 8]", {"N": 256}) == {
        "tensor": "BFloat16", "modes": [["tokens", None], ["N", 256], ["8", 8]]}
    assert cute_signature.parse("Float32", {}) == {"scalar": "Float32"}
    assert cute_signature.parse("stream", {}) == {"stream": True}


def test_dtypes_and_constexpr_lists_expand_each_specialization():
    expanded = jit_manifest.expanded(GOOD["specializations"][0])
    assert [(e["signature"]["x"], e["constexprs"]["FLAG"]) for e in expanded] == [
        ("BFloat16[rows, N]", False), ("BFloat16[rows, N]", True), ("Float32[rows, N]", False),
        ("Float32[rows, N]", True)]
    assert all(e["align"] == 16 and e["constexprs"]["N"] == 64 and e["signature"]["y"] == "Float32[rows]"
               for e in expanded)


# ---------------------------------------------------------------- the runtime: which specialization, which object

@pytest.fixture
def installed(monkeypatch, tmp_path, write_manifest):
    """A package "pkcute" whose manifest is GOOD and whose record ships (function, arch, specialization) entries."""
    folder = tmp_path / "pkcute"
    folder.mkdir()
    write_manifest(folder, GOOD)
    shipped = [dict(s, arch=arch, file=f"_aot/k/f-{arch}-{i}.o", prefix="f")
               for arch in ("8.0", "9.0a") for i, s in enumerate(jit_manifest.expanded(GOOD["specializations"][0]))]
    record = {"jit": True, "kernels": {"k": {"language": "cute-dsl", "archs": ["8.0", "9.0a"], "not_built": {},
                                             "shipped": shipped, "library_version": "4.8.1",
                                             "library_flavor": "cu13"}}}
    (folder / "_build_record.json").write_text(json.dumps(record))
    monkeypatch.setattr(manifest, "package_dir", lambda package: folder)
    for cached in (cute_runtime._table, cute_runtime._specializations, cute_runtime._record,
                   cute_runtime._shipped_index, cute_runtime._template_align, manifest.load):
        cached.cache_clear()
    real = importlib.metadata.version
    monkeypatch.setattr(cute_runtime.importlib.metadata, "version",
                        lambda name: "4.8.1" if name == DSL else real(name))
    monkeypatch.setattr(cute_compile, "library_flavor", lambda: "cu13")
    yield folder
    for cached in (cute_runtime._table, cute_runtime._specializations, cute_runtime._record,
                   cute_runtime._shipped_index, cute_runtime._template_align, manifest.load):
        cached.cache_clear()


CALL = (("BFloat16", 2), ("Float32", 1), "float")


def _specialization(described=CALL, constexprs=None, aligned=True):
    return cute_runtime.specialization_for("pkcute", "k", "f", described, constexprs or {"N": 64, "FLAG": True},
                                           aligned)


def test_a_listed_call_gets_the_manifests_specialization(installed):
    assert _specialization() in jit_manifest.expanded(GOOD["specializations"][0])


def test_an_unlisted_call_gets_the_functions_layout_with_its_own_types(installed):
    """float16 is not listed: the first specialization's modes, scalars, stream and alignment with the call's element
    type and constexprs, so a fallback compiles what a listed float16 would have shipped."""
    found = _specialization((("Float16", 2), ("Float32", 1), "float"), {"N": 32, "FLAG": False})
    assert found == {"function": "f", "signature": {"x": "Float16[rows, N]", "y": "Float32[rows]", "eps": "Float32",
                                                    "stream": "stream"},
                     "constexprs": {"N": 32, "FLAG": False}, "align": 16}
    assert "align" not in _specialization(aligned=False)


def test_a_call_of_the_wrong_kind_is_refused_by_name(installed):
    with pytest.raises(ValueError, match=r"f: x must be a 2-D tensor \(BFloat16\[rows, N\]\), got \('BFloat16', 1\)"):
        _specialization((("BFloat16", 1), ("Float32", 1), "float"))
    with pytest.raises(ValueError, match="f: eps must be a Float32 scalar, got a tensor"):
        _specialization((("BFloat16", 2), ("Float32", 1), ("Float32", 0)))
    with pytest.raises(ValueError, match="f: x's dtype torch.complex64 has no CuTe DSL element type"):
        _specialization((("torch.complex64", 2), ("Float32", 1), "float"))


@pytest.mark.parametrize("capability, arch", [((9, 0), "9.0a"), ((8, 0), "8.0"), ((8, 9), "8.0")])
def test_the_shipped_object_serving_a_call(installed, monkeypatch, capability, arch):
    loaded = []
    monkeypatch.setattr(cute_runtime, "_module", lambda path: loaded.append(path) or type("M", (), {"f": path}))
    function, why = cute_runtime.shipped_function("pkcute", "k", _specialization(), capability)
    assert why == "" and function == loaded[0] and f"f-{arch}-" in function


@pytest.mark.parametrize("capability, described, constexprs, aligned, words", [
    ((9, 0), (("Float16", 2), ("Float32", 1), "float"), None, True,
     "no shipped f for this call's specialization (x Float16[rows, N], y Float32[rows], eps Float32, FLAG=True, N=64, "
     "aligned to 16 bytes)"),
    ((9, 0), CALL, {"N": 32, "FLAG": True}, True, "no shipped f for this call's specialization"),
    ((9, 0), CALL, None, False, "no shipped f for this call's specialization (x BFloat16[rows, N], y Float32[rows], "
                                "eps Float32, FLAG=True, N=64)"),
    ((10, 0), CALL, None, True, "no shipped f runs on sm_100 (shipped for 8.0, 9.0a)"),
])
def test_why_nothing_shipped_serves_a_call(installed, capability, described, constexprs, aligned, words):
    specialization = _specialization(described, constexprs, aligned)
    function, why = cute_runtime.shipped_function("pkcute", "k", specialization, capability)
    assert function is None and why.startswith(words), why


def test_objects_of_another_dsl_release_are_not_loaded(installed, monkeypatch):
    monkeypatch.setattr(cute_runtime.importlib.metadata, "version", lambda name: "4.8.2")
    function, why = cute_runtime.shipped_function("pkcute", "k", _specialization(), (9, 0))
    assert function is None and why == (f"the shipped code was compiled by {DSL} 4.8.1 and {DSL} 4.8.2 is installed "
                                        "(an object links against its own release's runtime libraries)")


def test_objects_built_with_libraries_of_another_cuda_flavour_are_not_loaded(installed, monkeypatch):
    """The DSL loads the newest libraries the driver supports: the same release may run its cu12 libraries where the
    objects were linked against cu13's."""
    monkeypatch.setattr(cute_compile, "library_flavor", lambda: "cu12")
    function, why = cute_runtime.shipped_function("pkcute", "k", _specialization(), (9, 0))
    assert function is None and why == (f"the shipped code was compiled by {DSL} 4.8.1 with its cu13 libraries and "
                                        "this process runs its cu12 libraries")


def test_shipped_code_turned_off(installed, monkeypatch):
    monkeypatch.setenv(jit_runtime.SHIPPED_ENV, "0")
    assert cute_runtime.shipped_function("pkcute", "k", _specialization(), (9, 0)) == (
        None, f"{jit_runtime.SHIPPED_ENV}=0 turns shipped code off")


@needs_dsl
def test_an_object_the_dsl_does_not_load_is_a_reason(installed):
    (installed / "_aot" / "k").mkdir(parents=True)
    (installed / "_aot" / "k" / "f-9.0a-1.o").write_bytes(b"\x7fELF not an object")  # FLAG=True's
    function, why = cute_runtime.shipped_function("pkcute", "k", _specialization(), (9, 0))
    assert function is None and why.startswith(f"{DSL} did not load the shipped f-9.0a-1.o: RuntimeError: "), why
    assert "\x1b" not in why  # the DSL colours its messages for a terminal


# ---------------------------------------------------------------- gating

class _Spec:
    name = "k"
    jit = {"language": "cute-dsl", "requires": f"{DSL} >= 4.8, < 4.9", "capability": ">= 8.0", "cpu": ["pytorch"]}
    build = {"kernels": {"k": {"archs": ["9.0a"], "shipped": [{"arch": "9.0a"}], "library_version": "4.8.1",
                               "library_flavor": "cu13"}}}


def test_status_notes_objects_of_another_dsl_release(monkeypatch):
    monkeypatch.setattr(jit_gating.importlib.metadata, "version", lambda name: "4.8.2")
    target = registry.Target("cuda", 0, (9, 0))
    assert jit_gating.note(_Spec(), target) == (f"k compiles on its first call: its shipped code was compiled by {DSL} "
                                                f"4.8.1 and {DSL} 4.8.2 is installed")
    monkeypatch.setattr(jit_gating.importlib.metadata, "version", lambda name: "4.8.1")
    assert jit_gating.note(_Spec(), target) is None

    def without_cu13(name):
        if name.endswith("-libs-cu13"):
            raise importlib.metadata.PackageNotFoundError(name)
        return "4.8.1"

    monkeypatch.setattr(jit_gating.importlib.metadata, "version", without_cu13)
    assert jit_gating.note(_Spec(), target) == (f"k compiles on its first call: its shipped code was compiled with "
                                                f"{DSL}'s cu13 libraries, which are not installed")
    monkeypatch.setattr(jit_gating.importlib.metadata, "version", lambda name: "4.8.1")
    assert jit_gating.note(_Spec(), registry.Target("cuda", 0, (8, 9))).startswith("k compiles on its first call on "
                                                                                    "sm_89")


def test_tritons_interpreter_does_not_gate_a_cute_kernel(monkeypatch):
    monkeypatch.setenv(jit_gating.INTERPRET_ENV, "1")
    assert jit_gating._capability_reason(_Spec(), registry.Target("cuda", 0, (9, 0))) is None


# ---------------------------------------------------------------- the build, without a GPU

KERNELS = '''
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute


@cute.kernel
def scale_kernel(x: cute.Tensor, y: cute.Tensor, factor: cutlass.Float32, THREADS: cutlass.Constexpr[int]):
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    i = block * THREADS + thread
    if i < x.shape[0]:
        y[i] = x[i].to(cutlass.Float32) * factor


@cute.jit
def scale(x: cute.Tensor, y: cute.Tensor, factor: cutlass.Float32, stream: cuda.CUstream,
          THREADS: cutlass.Constexpr[int]):
    scale_kernel(x, y, factor, THREADS).launch(grid=((x.shape[0] + THREADS - 1) // THREADS, 1, 1),
                                               block=(THREADS, 1, 1), stream=stream)
'''


@needs_dsl
def test_one_function_is_shipped_for_a_named_arch_and_loads_in_a_fresh_process(tmp_path):
    """cute_build's child compiles and exports one specialization for 9.0a without a GPU; a fresh process with no
    compiler on PATH loads the object and finds the function by its prefix (calling it needs a GPU)."""
    from prime_kernels_core import cute_build

    (tmp_path / "pkscale").mkdir()
    (tmp_path / "pkscale" / "__init__.py").write_text("")
    (tmp_path / "pkscale" / "kernels.py").write_text(textwrap.dedent(KERNELS))
    table = {"language": "cute-dsl", "requires": f"{DSL} >= 4.8", "archs": ["9.0a"], "functions": "pkscale.kernels",
             "specializations": [{"function": "scale", "signature": {"x": "{dtype}[n]", "y": "Float32[n]",
                                                                       "factor": "Float32", "stream": "stream"},
                                  "dtypes": ["BFloat16"], "align": 16, "constexprs": {"THREADS": 128}}]}
    out = tmp_path / "out"
    entry = cute_build.ship_kernel(tmp_path, out, "scale", table)
    assert entry["archs"] == ["9.0a"] and not entry["not_built"], entry["not_built"]
    assert entry["library_version"] == importlib.metadata.version(DSL) and entry["object_file_version"]
    assert entry["library_flavor"] == cute_compile.library_flavor()  # this process's DSL, as the child's
    (shipped,) = entry["shipped"]
    assert shipped["signature"]["x"] == "BFloat16[n]" and shipped["arch"] == "9.0a"
    assert sorted(p.name for p in (out / "_aot" / "scale").iterdir()) == [shipped["file"].split("/")[-1]]
    code = ("import sys, cutlass.cute as cute; f = getattr(cute.runtime.load_module(sys.argv[1]), sys.argv[2]); "
            "print(type(f).__name__)")
    done = subprocess.run([sys.executable, "-c", code, str(out / shipped["file"]), shipped["prefix"]],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PATH="/nonexistent"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "JitCompiledFunction" in done.stdout


def test_a_build_without_the_dsl_says_so_per_arch(tmp_path, monkeypatch):
    from prime_kernels_core import cute_build

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cute_build.importlib.metadata, "version", absent)
    entry = cute_build.ship_kernel(tmp_path, tmp_path, "k", dict(GOOD))
    assert entry["archs"] == [] and entry["not_built"] == {
        a: f"{DSL} is not installed in the build's Python" for a in ("8.0", "9.0a")}
