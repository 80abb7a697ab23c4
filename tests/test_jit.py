"""JIT kernels (Triton, CuTe DSL): the manifest kind, every gating state, shipped-code selection and fallback, and the
ahead-of-time build of one function. Throwaway distributions as in conftest.py; the Triton example plugin's own tests
cover the real wheel."""
import importlib.metadata
import json
import sys
import textwrap
import warnings

import pytest
import torch

from prime_kernels_core import jit_build, jit_gating, jit_manifest, jit_runtime, manifest, registry
from prime_kernels_core.registry import Target

TABLE = """\
    version = "0.1.0"
    [router]
    description = "test JIT kernel"
    namespace = "{namespace}"
    ops = ["op_a"]
    module = "{package}.ops"
    language = "triton"
    requires = "{requires}"
    capability = "{capability}"
    cpu = {cpu}
    archs = {archs}
    functions = "{package}.functions"
    [router.launch.scale]
    num_warps = 4
"""
OPS = "import torch\n_library = torch.library.Library('{namespace}', 'DEF')\n_library.define('op_a(Tensor x) -> Tensor')\n"
MADE = iter(range(10**6))  # each plugin its own namespace: one registered by an earlier test stays in the dispatcher


@pytest.fixture
def jit_plugin(tmp_path, monkeypatch):
    """make(requires=..., capability=..., cpu=..., shipped_archs=...) writes one JIT plugin distribution."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(requires="triton >= 3.0", capability=">= 8.0", cpu=("pytorch",), shipped_archs=("8.0", "9.0a")):
        package = f"pk_jit_demo{next(MADE)}"
        pkg = tmp_path / package
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "kernel.toml").write_text(textwrap.dedent(TABLE).format(
            package=package, namespace=f"pk_test_{package}", requires=requires, capability=capability, cpu=json.dumps(list(cpu)), archs=json.dumps(list(shipped_archs))))
        record = {"jit": True, "kernels": {"router": {"language": "triton", "archs": list(shipped_archs),
                                                      "not_built": {}, "shipped": []}}}
        (pkg / "_build_record.json").write_text(json.dumps(record))
        (pkg / "ops.py").write_text(OPS.format(namespace=f"pk_test_{package}") + "def unsupported_shape_reason(n):\n    return None\n")
        (pkg / "plugin.py").write_text("from prime_kernels_core import hookimpl, manifest\n\n"
                                       "@hookimpl\ndef prime_kernels_declare():\n    return manifest.declare(__file__)\n")
        info = tmp_path / f"{package}-0.1.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[prime_kernels]\nrouter = {package}.plugin\n")
        monkeypatch.setenv(registry.ALLOW_ENV, package)
        registry.refresh()
        return registry.spec("router")

    registry.refresh()
    yield make
    registry.refresh()


@pytest.fixture
def triton_version(monkeypatch):
    """set(version or None): what importlib.metadata reports as the installed triton (None: not installed)."""
    real = importlib.metadata.version

    def set_version(found):
        def version(name):
            if name != "triton":
                return real(name)
            if found is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return found
        monkeypatch.setattr(jit_gating.importlib.metadata, "version", version)
    return set_version


def test_jit_kernel_is_declared_and_available_on_cpu(jit_plugin, triton_version):
    triton_version("3.8.0")
    spec = jit_plugin()
    assert spec.jit["language"] == "triton" and spec.extension is None
    assert registry.unavailable_reason("router", "cpu") is None
    assert registry.built_archs(spec) == ["8.0", "9.0a"]
    assert registry.torch_support(spec) == "triton >= 3.0"


def test_library_not_installed(jit_plugin, triton_version):
    triton_version(None)
    jit_plugin(requires="triton >= 3.4, < 3.9")
    assert registry.unavailable_reason("router", "cpu") == (
        "router is a triton kernel and needs triton >= 3.4, < 3.9, which is not installed; pip install 'triton>=3.4,<3.9'")


@pytest.mark.parametrize("installed, requires, usable", [
    ("3.8.0", "triton >= 3.4, < 3.9", True), ("3.9.0", "triton >= 3.4, < 3.9", False),
    ("3.3.1", "triton >= 3.4, < 3.9", False), ("3.8.1+gitabc", "triton == 3.8", True),
    ("3.7.0", "triton == 3.8", False), ("3.8.0", "triton != 3.8.0", False), ("3.4", "triton > 3.4.0", False),
])
def test_library_version_range(jit_plugin, triton_version, installed, requires, usable):
    triton_version(installed)
    spec = jit_plugin(requires=requires)
    reason = registry.unavailable_reason("router", "cpu")
    assert (reason is None) == usable, reason
    if not usable:
        assert reason == (f"router supports {requires} but triton {installed} is installed; install a triton in that "
                          f"range, or a build of {spec.distribution} that supports triton {installed}")


def test_capability_below_the_kernels_rule(jit_plugin, triton_version):
    triton_version("3.8.0")
    jit_plugin()
    assert registry.unavailable_reason("router", Target("cuda", 0, (7, 5))) == (
        "router runs on compute capability >= 8.0 (its kernel.toml), but the device is sm_75 (capability 7.5)")
    assert registry.unavailable_reason("router", Target("cuda", 0, (12, 0))) is None


def test_hopper_only_rule(jit_plugin, triton_version):
    triton_version("3.8.0")
    jit_plugin(capability=">= 9.0, < 10.0", shipped_archs=("9.0a",))
    assert registry.unavailable_reason("router", Target("cuda", 0, (9, 0))) is None
    assert "compute capability >= 9.0, < 10.0" in registry.unavailable_reason("router", Target("cuda", 0, (10, 0)))


def test_no_device_is_the_targets_reason(jit_plugin, triton_version, monkeypatch):
    triton_version("3.8.0")
    jit_plugin()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert registry.unavailable_reason("router") == (
        "no CUDA device is visible to this process (torch.cuda.is_available() is False)")


def test_cpu_only_torch(jit_plugin, triton_version, monkeypatch):
    triton_version("3.8.0")
    jit_plugin()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert registry.unavailable_reason("router", (9, 0)) == (
        "router runs on CUDA devices, but this process runs a CPU-only torch; use device 'cpu'")


def test_disabled(jit_plugin, triton_version, monkeypatch):
    triton_version("3.8.0")
    jit_plugin()
    monkeypatch.setenv(registry.DISABLE_ENV, "router")
    assert registry.unavailable_reason("router", "cpu") == f"disabled by {registry.DISABLE_ENV}"


def test_cpu_only_through_the_interpreter(jit_plugin, triton_version, monkeypatch):
    triton_version("3.8.0")
    jit_plugin(cpu=("interpreter",))
    monkeypatch.delenv(jit_gating.INTERPRET_ENV, raising=False)
    assert registry.unavailable_reason("router", "cpu") == (
        "router runs on the CPU only through Triton's interpreter, and TRITON_INTERPRET is not set; start Python with "
        "TRITON_INTERPRET=1 (that process then runs no Triton kernel on a GPU)")
    monkeypatch.setenv(jit_gating.INTERPRET_ENV, "1")
    assert registry.unavailable_reason("router", "cpu") is None
    assert registry.unavailable_reason("router", (9, 0)).startswith(
        "TRITON_INTERPRET=1 is set: Triton runs every kernel of this process through its interpreter on the CPU")


def test_no_cpu_path(jit_plugin, triton_version):
    triton_version("3.8.0")
    jit_plugin(cpu=())
    assert registry.unavailable_reason("router", "cpu") == (
        "router has no CPU implementation (its kernel.toml's cpu lists none)")


def test_note_when_nothing_shipped_serves_the_device(jit_plugin, triton_version, monkeypatch):
    triton_version("3.8.0")
    jit_plugin(shipped_archs=("8.0", "9.0a"))
    assert registry.note("router", Target("cuda", 0, (9, 0))) is None
    assert registry.note("router", Target("cuda", 0, (8, 6))) is None  # sm_80 code runs on 8.6
    assert registry.note("router", Target("cuda", 0, (10, 0))) == (
        "router compiles on its first call on sm_100 (triton JIT): it ships code for 8.0, 9.0a")
    assert registry.note("router", "cpu") is None
    monkeypatch.setenv(jit_runtime.SHIPPED_ENV, "0")
    assert registry.note("router", Target("cuda", 0, (9, 0))) == (
        "PRIME_KERNELS_AOT=0 turns shipped code off: router compiles on its first call")


def test_note_names_a_fallback_of_this_process(jit_plugin, triton_version, monkeypatch):
    triton_version("3.8.0")
    jit_plugin()
    monkeypatch.setattr(jit_runtime, "_fallbacks", {})
    with pytest.warns(RuntimeWarning, match="router: no shipped scale for this call's specialization"):
        jit_runtime._fell_back("router", "no shipped scale for this call's specialization (x *fp16)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a second fallback for the same reason warns no more
        jit_runtime._fell_back("router", "no shipped scale for this call's specialization (x *fp16)")
    assert registry.note("router", Target("cuda", 0, (9, 0))) == (
        "router compiled with triton at run time in this process: no shipped scale for this call's specialization "
        "(x *fp16)")


def test_discovery_imports_neither_the_kernel_module_nor_the_library(jit_plugin, triton_version):
    triton_version("3.8.0")
    spec = jit_plugin()
    package = spec.module.split(".")[0]
    assert f"{package}.ops" not in sys.modules
    assert jit_gating.library_reason(spec) is None
    assert f"{package}.ops" not in sys.modules and f"{package}.functions" not in sys.modules


# ---------------------------------------------------------------- the manifest

GOOD = dict(description="d", namespace="ns", ops=["op"], module="m.ops", language="triton",
            requires="triton >= 3.4, < 3.9", capability=">= 8.0", cpu=["pytorch"], archs=["8.0", "9.0a"],
            functions="m.kernels", launch={"f": {"num_warps": 4}},
            specializations=[{"function": "f", "signature": {"x": "*{dtype}", "n": "i32"}, "dtypes": ["bf16"],
                              "constexprs": {"BLOCK": 128}}])


@pytest.mark.parametrize("change, words", [
    (dict(language="cuda"), "language is one of ['triton', 'cute-dsl'], found 'cuda'"),
    (dict(requires="torch >= 2.0"), "requires names the library and the versions the kernel supports, \"triton >= X, < Y\""),
    (dict(requires="triton ~= 3.4"), "requires: '~= 3.4' is no version clause"),
    (dict(capability="sm_80"), "capability is the compute capabilities the kernel runs on"),
    (dict(cpu=["numpy"]), "cpu lists how the ops run on the CPU, each once, from ['interpreter', 'pytorch']"),
    (dict(archs=["9.0"]), "Triton compiles 9.0 for sm_90a, so archs spells it \"9.0a\", found '9.0'"),
    (dict(archs=["8.0a"]), "Triton compiles 8.0 for sm_80, so archs spells it \"8.0\", found '8.0a'"),
    (dict(archs=["7.5"]), "archs lists 7.5, outside the kernel's capability '>= 8.0'"),
    (dict(sources={"cpu": ["a.cpp"]}), r"a triton kernel has no C\+\+/CUDA sources"),
    (dict(launch={"f": {"num_warps": 0}}), "launch.f holds positive ints among ['num_stages', 'num_warps']"),
    (dict(launch={}), "function 'f' has no launch.f options"),
    (dict(specializations=[{"function": "f", "signature": {"x": "*float"}}]), "signature.x must be a Triton type"),
    (dict(specializations=[{"function": "f", "signature": {"x": "*{dtype}"}}]), "dtypes lists the Triton types"),
    (dict(specializations=[{"function": "f", "signature": {"x": "*fp32"}, "constexprs": {"B": "x"}}]),
     "constexprs maps each constexpr parameter to a number or boolean"),
    (dict(functions=""), "archs asks for ahead-of-time code, so functions must name the module"),
])
def test_manifest_errors_name_the_key(tmp_path, write_manifest, change, words):
    path = write_manifest(tmp_path, {**GOOD, **change})
    with pytest.raises(manifest.ManifestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        manifest.load(path)


def test_dtypes_expand_each_specialization():
    expanded = jit_manifest.expanded({"function": "f", "signature": {"x": "*{dtype}", "n": "i32"},
                                      "dtypes": ["bf16", "fp32"], "constexprs": {"B": 1}})
    assert [e["signature"]["x"] for e in expanded] == ["*bf16", "*fp32"]
    assert all(e["signature"]["n"] == "i32" and e["constexprs"] == {"B": 1} for e in expanded)


# ---------------------------------------------------------------- the runtime

def test_triton_types_as_the_jit_gives_them():
    assert jit_runtime.triton_type(torch.zeros(2, dtype=torch.bfloat16)) == "*bf16"
    assert jit_runtime.triton_type(torch.zeros(2, dtype=torch.int64)) == "*i64"
    assert [jit_runtime.triton_type(v) for v in (7, 2**31, True, 0.5)] == ["i32", "i64", "u1", "fp32"]


def test_triton_types_are_the_ones_tritons_jit_derives():
    """Every dtype and scalar range the runtime types, against Triton's own typing of a call's argument."""
    pytest.importorskip("triton")
    from triton.runtime.jit import mangle_type

    values = [torch.zeros(2, dtype=getattr(torch, name)) for name in jit_runtime.TORCH_TO_TRITON if hasattr(torch, name)]
    values += [7, -2**31, 2**31, -2**63, 2**63, True, 0.5]
    assert [jit_runtime.triton_type(v) for v in values] == [mangle_type(v) for v in values]
    assert jit_runtime.launcher_arg_types([["x", "*bf16"], ["n", "i32"], ["s", "fp32"]], 2) == "OifOO"


SHIPPED = [{"function": "scale", "arch": arch, "params": [["x", "*fp32"], ["n", "i32"]], "constexprs": {"B": 128},
            "file": f"_aot/router/scale-{arch}.cubin", "name": "scale", "num_warps": 4, "shared": 0, "scratch": 2,
            "arg_types": "OiOO", "path": f"/nonexistent/scale-{arch}.cubin", "aligned": ["x"], "aligned_at": [0]}
           for arch in ("8.0", "9.0a")]


@pytest.fixture
def shipped(monkeypatch):
    index = {jit_runtime._key("scale", SHIPPED[0]["params"], {"B": 128}): SHIPPED}
    monkeypatch.setattr(jit_runtime, "_shipped_index", lambda package, kernel: index)

    def miss(args, capability=(9, 0), constexprs=None):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        return jit_runtime._shipped_miss("pkg", "router", "scale", ["x", "n", "B"], args,
                                         constexprs or {"B": 128}, torch.device("cuda", 0))
    return miss


def test_the_shipped_entry_serving_a_call(shipped):
    x = torch.zeros(64)
    assert shipped((x, 64))[0]["arch"] == "9.0a"
    assert shipped((x, 64), capability=(8, 9))[0]["arch"] == "8.0"  # plain sm_80 code runs on later 8.x


def test_why_nothing_shipped_serves_a_call(shipped):
    x = torch.zeros(64)
    assert shipped((x.half(), 64))[1] == "no shipped scale for this call's specialization (x *fp16, n i32, B=128)"
    assert shipped((x, 2**40))[1] == "no shipped scale for this call's specialization (x *fp32, n i64, B=128)"
    assert shipped((x, 64), constexprs={"B": 64})[1].startswith("no shipped scale for this call's specialization")
    assert shipped((x, 64), capability=(12, 0))[1] == "no shipped scale runs on sm_120 (shipped for 8.0, 9.0a)"
    assert shipped((x[1:], 63))[1] == (
        "x is not 16-byte aligned, and the shipped scale is compiled for aligned pointers as Triton's JIT is for "
        "aligned tensors")


def test_a_pointer_compiled_without_alignment_takes_any_address(shipped, monkeypatch):
    """A function whose pointer is do_not_specialize_on_alignment was compiled without the assumption (the record's
    aligned list leaves it out): a misaligned tensor is served."""
    unaligned = [dict(e, aligned=[], aligned_at=[]) for e in SHIPPED]
    index = {jit_runtime._key("scale", SHIPPED[0]["params"], {"B": 128}): unaligned}
    monkeypatch.setattr(jit_runtime, "_shipped_index", lambda package, kernel: index)
    assert shipped((torch.zeros(64)[1:], 63)) == (unaligned[1], "")


def test_shipped_code_turned_off(shipped, monkeypatch):
    monkeypatch.setenv(jit_runtime.SHIPPED_ENV, "0")
    assert shipped((torch.zeros(64), 64)) == (None, "PRIME_KERNELS_AOT=0 turns shipped code off")


# ---------------------------------------------------------------- the ahead-of-time build

FUNCTIONS = '''
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["out"])
def scale(x, out, n, factor, BLOCK: tl.constexpr):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + lanes, tl.load(x + lanes, mask=lanes < n) * factor, mask=lanes < n)


@triton.jit
def scale_specialized(x, out, n, factor, BLOCK: tl.constexpr):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + lanes, tl.load(x + lanes, mask=lanes < n) * factor, mask=lanes < n)
'''


def test_one_function_compiled_for_a_named_target_without_a_gpu(tmp_path, monkeypatch):
    """Triton compiles for sm_80 with no device; the record holds what the launcher needs, the cubin is machine code."""
    (tmp_path / "aot_functions.py").write_text(FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    from aot_functions import scale

    specialization = {"function": "scale", "signature": {"x": "*fp32", "out": "*fp32", "n": "i32", "factor": "fp32"},
                      "constexprs": {"BLOCK": 256}}
    entry = jit_build.ship_function(tmp_path / "out", "k", scale, "8.0", specialization, {"num_warps": 4})
    assert entry["params"] == [["x", "*fp32"], ["out", "*fp32"], ["n", "i32"], ["factor", "fp32"]]
    assert entry["name"] == "scale" and entry["num_warps"] == 4 and entry["scratch"] == 2
    assert entry["aligned"] == ["x"]  # out is do_not_specialize_on_alignment: compiled for any address, as the JIT does
    assert (tmp_path / "out" / entry["file"]).read_bytes()[:4] == b"\x7fELF"
    with pytest.raises(jit_build.AotBuildError, match="do not cover them exactly"):
        jit_build.compile_function(scale, "8.0", {"signature": {"x": "*fp32"}, "constexprs": {}}, {})
    with pytest.raises(jit_build.AotBuildError, match="factor is a fp64: Triton's JIT types a Python scalar as"):
        jit_build.compile_function(scale, "8.0", dict(specialization, signature=dict(
            specialization["signature"], factor="fp64")), {})
    monkeypatch.setitem(jit_build.SCALAR_STAND_INS, "i32", 2**40)  # a Triton that typed this stand-in otherwise
    with pytest.raises(jit_build.AotBuildError, match="Triton's JIT types scale's parameters .*'n': 'i64'"):
        jit_build.compile_function(scale, "8.0", specialization, {})


def test_the_build_compiles_what_the_jit_compiles_for_a_call(tmp_path, monkeypatch):
    """The build's compile of a specialization and Triton's JIT given a call of it (CPU tensors at their addresses)
    for the same target, each from an empty cache: the same hash (compile inputs) and the same cubin bytes (one
    source path here); an integer the JIT specializes on its value is refused at build, naming it."""
    (tmp_path / "aot_functions2.py").write_text(FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from aot_functions2 import scale, scale_specialized

    from prime_kernels_core import jit_target

    specialization = {"function": "scale", "signature": {"x": "*fp32", "out": "*fp32", "n": "i32", "factor": "fp32"},
                      "constexprs": {"BLOCK": 256}}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "build-cache"))
    built = jit_build.compile_function(scale, "9.0a", specialization, {"num_warps": 4})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "jit-cache"))
    x = torch.randn(1000)
    called = jit_target.compiled_by_the_jit(scale, "9.0a", (x, torch.empty(1000)[1:], 999, 0.5),
                                            {"BLOCK": 256, "num_warps": 4})
    assert called.hash == built.hash and called.asm["cubin"] == built.asm["cubin"]
    with pytest.raises(jit_build.AotBuildError, match=r"integer parameters \['n'\] are specialized"):
        jit_build.compile_function(scale_specialized, "9.0a", specialization, {"num_warps": 4})


def test_a_plugin_is_compiled_or_jit_not_both():
    with pytest.raises(jit_build.AotBuildError, match=r"kernels \['c'\] are compiled \(C\+\+/CUDA\) and the others JIT"):
        jit_build._refuse_other_languages("pkg", {"c": {"sources": {}}, "j": {"language": "triton"}})
    jit_build._refuse_other_languages("pkg", {"j": {"language": "cute-dsl", "archs": ["9.0a"]},
                                              "t": {"language": "triton", "archs": ["9.0a"]}})  # both ship code


def test_a_jit_wheel_is_checked_from_its_own_files():
    """release's check of a JIT plugin's wheel: every listed arch shipped, one cubin per arch and specialization, each
    in the wheel and machine code, nothing else."""
    table = {"archs": ["8.0", "9.0a"], "specializations": [{"function": "f", "signature": {"x": "*{dtype}"},
                                                              "dtypes": ["bf16", "fp32"]}]}
    entry = lambda arch, i: {"arch": arch, "file": f"_aot/k/f-{arch}-{i}.cubin"}
    record = {"jit": True, "kernels": {"k": {"archs": ["8.0", "9.0a"], "not_built": {},
                                             "shipped": [entry(a, i) for a in ("8.0", "9.0a") for i in (0, 1)]}}}
    files = {f"pkg/{e['file']}": b"\x7fELF..." for e in record["kernels"]["k"]["shipped"]}
    files.update({"pkg/__init__.py": b"", "pkg/kernel.toml": b"", "pkg/_build_record.json": b""})
    check = lambda names, rec: jit_build.check_jit_wheel(list(names), files.__getitem__, "pkg", {"k": table}, rec)
    assert check(files, record) == []
    assert check([*files, "pkg/notes.txt"], record) == [
        "pkg/notes.txt is not part of a JIT plugin's surface (its .py files, kernel.toml, _build_record.json, the "
        "shipped code of its record)"]
    assert check([n for n in files if "9.0a-1" not in n], record) == [
        "pkg/_aot/k/f-9.0a-1.cubin is in the build record but not in the wheel"]
    files["pkg/_aot/k/f-8.0-0.cubin"] = b"PTX"
    assert check(files, record) == ["pkg/_aot/k/f-8.0-0.cubin is not machine code (no ELF header: a cubin, or a CuTe "
                                    "DSL object)"]
    files["pkg/_aot/k/f-8.0-0.cubin"] = b"\x7fELF"
    partial = {"jit": True, "kernels": {"k": {"archs": ["8.0"], "not_built": {"9.0a": "Triton failed"},
                                              "shipped": [entry("8.0", 0)]}}}
    assert check(files, partial)[:2] == ["k ships no code for 9.0a (9.0a: Triton failed)",
                                         "k ships 1 functions for 8.0, its manifest names 2"]


def test_a_cubin_the_driver_does_not_load_is_a_reason(shipped):
    """No driver here (or a cubin the driver rejects): the loader's error becomes the fallback's sentence."""
    function, why = jit_runtime._load_shipped(SHIPPED[1], torch.device("cuda", 0))
    assert function is None and why.startswith("the driver did not load the shipped scale-9.0a.cubin: ")
