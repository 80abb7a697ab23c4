"""Kernels on the LibTorch stable ABI (kernel.toml's stable_abi): the manifest key, the build plan, and the gating rule
(any running torch from the floor on, same CUDA major), on throwaway plugins and on the example plugin as installed."""
import importlib.metadata
import itertools
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import prime_kernels
from prime_kernels_core import build
from prime_kernels_core.build import BuildError, Toolchain
from prime_kernels_core.manifest import ManifestError, load, source_paths
from prime_kernels_core.testing import assert_error_ratio

GOOD = Toolchain("2.14.1+cu130", "13.0", "/usr/local/cuda", "13.0")


def _touch_sources(root, package):
    """An empty file for each source the manifest names: the build kit checks that they exist."""
    try:
        kernels = load(root / package)["kernels"]
    except ManifestError:  # the test is about the manifest's own mistake
        return
    for table in kernels.values():
        for path in source_paths(table):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).touch()


def _write(root, kernels: str, package="pk_stable"):
    (root / package).mkdir()
    (root / package / "kernel.toml").write_text('version = "0.3.0"\n' + textwrap.dedent(kernels))
    load.cache_clear()
    _touch_sources(root, package)
    return root / package


def _kernel(name, floor=None, cpu="csrc/{name}.cpp", cuda="csrc/cuda/{name}.cu", archs='["9.0a"]'):
    stable = "" if floor is None else f"stable_abi = {floor}\n"
    return (f'[{name}]\nnamespace = "pk_stable"\nops = ["{name}"]\nmodule = "pk_stable.ops"\narchs = {archs}\n'
            f'sources.cpu = ["{cpu.format(name=name)}"]\nsources.cuda = ["{cuda.format(name=name)}"]\n{stable}')


# ---------------------------------------------------------------- manifest

@pytest.mark.parametrize("floor,words", [
    ("2.11", "stable_abi is the oldest torch release the kernel targets, a string MAJOR.MINOR such as \"2.10\" (its "
             "sources then use only the LibTorch stable ABI), found 2.11"),
    ('"2"', "a string MAJOR.MINOR such as \"2.10\" (its sources then use only the LibTorch stable ABI), found '2'"),
    ('"2.11.0"', "found '2.11.0'"),
    ('"latest"', "found 'latest'"),
    ('"2.9"', "stable_abi = \"2.9\" is older than torch 2.10, the first release whose stable ABI a build can target "
              "(TORCH_TARGET_VERSION); use \"2.10\" or newer"),
])
def test_a_bad_stable_abi_is_refused_with_a_sentence(tmp_path, floor, words):
    package = _write(tmp_path, _kernel("a", floor))
    with pytest.raises(ManifestError) as refused:
        load(package)
    assert "kernel 'a': stable_abi" in str(refused.value) and words in str(refused.value)


def test_stable_kernels_of_one_plugin_share_one_floor(tmp_path):
    package = _write(tmp_path, _kernel("a", '"2.11"') + _kernel("b", '"2.12"'))
    with pytest.raises(ManifestError, match=r"kernels disagree on stable_abi \(a = '2.11', b = '2.12'\); the stable "
                                            r"kernels of a plugin share one _C_stable built for one torch floor"):
        load(package)


# ---------------------------------------------------------------- build plan

def test_target_version_define_packs_major_and_minor_as_torch_does():
    assert build.target_version_define("2.11") == "-DTORCH_TARGET_VERSION=0x020b000000000000"
    assert build.target_version_define("2.10") == "-DTORCH_TARGET_VERSION=0x020a000000000000"


def test_abi_tag_names_the_floor_for_stable_builds():
    assert build.abi_tag(GOOD, True, "2.11") == "cu130torchabi2.11"
    assert build.abi_tag(GOOD, False, "2.11") == "cputorchabi2.11"
    assert build.abi_tag(GOOD, True) == "cu130torch2.14"


def test_abi3_tag_follows_cpp_extensions_limited_api():
    from torch.utils import cpp_extension

    assert build.limited_api_tag(cpp_extension) == "cp{}{}".format(*divmod(int(cpp_extension.min_supported_cpython, 16)
                                                                            >> 16, 256))


def _modules(plan):
    return {m["name"]: m for m in plan["modules"]}


def test_a_mixed_plugin_compiles_its_stable_kernels_into_their_own_module(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write(tmp_path, _kernel("exact") + _kernel("stable", '"2.11"'))
    plan = build.extension_plan(tmp_path, GOOD)
    modules = _modules(plan)
    assert set(modules) == {"_C", "_C_stable"} and plan["py_limited_api"] is True
    assert modules["_C"]["kernels"] == ["exact"] and modules["_C_stable"]["kernels"] == ["stable"]
    assert modules["_C"]["cpu_sources"] == ["csrc/exact.cpp"] and modules["_C_stable"]["cpu_sources"] == ["csrc/stable.cpp"]
    assert [g["sources"] for g in modules["_C_stable"]["cuda_groups"]] == [["csrc/cuda/stable.cu"]]
    target = "-DTORCH_TARGET_VERSION=0x020b000000000000"
    assert target in modules["_C_stable"]["cxx_flags"] and target in modules["_C_stable"]["nvcc_flags"]
    assert "-DUSE_CUDA" in modules["_C_stable"]["nvcc_flags"]  # the C shim declares its CUDA stream calls under it
    assert not any("TORCH_TARGET_VERSION" in f for f in modules["_C"]["cxx_flags"] + modules["_C"]["nvcc_flags"])
    # The wheel holds an exact-ABI _C, so it names the one torch every kernel in it runs under.
    assert plan["version"] == "0.3.0+cu130torch2.14"
    assert build.build_record(plan, GOOD)["kernels"]["stable"]["stable_abi"] == "2.11"
    assert "stable_abi" not in build.build_record(plan, GOOD)["kernels"]["exact"]


def test_an_all_stable_plugin_is_stamped_with_its_floor(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write(tmp_path, _kernel("stable", '"2.11"'))
    plan = build.extension_plan(tmp_path, GOOD)
    assert set(_modules(plan)) == {"_C_stable"} and plan["version"] == "0.3.0+cu130torchabi2.11"


def test_an_exact_plugin_is_built_as_before(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write(tmp_path, _kernel("exact"))
    plan = build.extension_plan(tmp_path, GOOD)
    assert set(_modules(plan)) == {"_C"} and plan["py_limited_api"] is False


def test_a_floor_newer_than_the_building_torch_is_refused(tmp_path):
    _write(tmp_path, _kernel("stable", '"2.15"'))
    with pytest.raises(BuildError, match=r"pk_stable: stable_abi = \"2.15\" is newer than torch 2.14.1\+cu130, which "
                                         r"builds it; build with torch 2.15 or newer"):
        build.extension_plan(tmp_path, GOOD)


def test_a_source_shared_by_a_stable_and_an_exact_kernel_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write(tmp_path, _kernel("exact", cpu="csrc/common.cpp") + _kernel("stable", '"2.11"', cpu="csrc/common.cpp"))
    with pytest.raises(BuildError, match="csrc/common.cpp is compiled into both _C and _C_stable; a source file belongs "
                                         "to the stable-ABI kernels or to the others, not to both"):
        build.extension_plan(tmp_path, GOOD)


# ---------------------------------------------------------------- gating (throwaway plugins, no compile)

_DISTS = itertools.count()


def _stable_plugin(plugin_dir, record, floor="2.11"):
    """A plugin whose record says its kernel demo is on the stable ABI from ``floor``; a distribution name of its own
    each time (a hook module once imported stays imported)."""
    built = record({"demo": ["9.0a"]}, torch="2.14.1+cu130", torch_cuda="13.0", nvcc="13.0")
    built["kernels"]["demo"]["stable_abi"] = floor
    dist = f"pk-stable-gate{next(_DISTS)}"
    plugin_dir(dist, record=built)
    return dist


def _running(monkeypatch, version, cuda="13.0"):
    import torch

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)


OLDER = ("demo is built on the LibTorch stable ABI for torch >= 2.11, but this process runs torch 2.10; upgrade torch "
         "to 2.11 or newer, or install a build of {dist} for torch 2.10")


@pytest.mark.parametrize("running,expected", [
    ("2.10.0+cu130", OLDER), ("2.10.2", OLDER), ("2.9.1+cu128", OLDER.replace("2.10", "2.9")),
    ("2.11.0+cu130", None), ("2.11.0a0+gitabcdef", None), ("2.12.1+cu130", None), ("2.14.1+cu130", None),
    ("2.20.0", None), ("3.0.0", None),
])
def test_a_stable_build_runs_on_every_torch_from_its_floor(plugin_dir, record, monkeypatch, running, expected):
    dist = _stable_plugin(plugin_dir, record)
    _running(monkeypatch, running)
    expected = expected and expected.format(dist=dist)
    assert prime_kernels.unavailable_reason("demo", "cpu") == expected
    assert prime_kernels.unavailable_reason("demo", "sm_90") == expected


@pytest.mark.parametrize("cuda,expected", [
    ("13.0", None), ("13.2", None),
    ("12.8", "demo was built against CUDA 13.0 and runs under any torch >= 2.11 built with CUDA 13.x, but this process "
             "runs torch with CUDA 12.8; install a build of {dist} for CUDA 12"),
])
def test_a_stable_build_needs_the_same_cuda_major(plugin_dir, record, monkeypatch, cuda, expected):
    dist = _stable_plugin(plugin_dir, record)
    _running(monkeypatch, "2.12.0", cuda)
    assert prime_kernels.unavailable_reason("demo", "sm_90") == (expected and expected.format(dist=dist))
    assert prime_kernels.unavailable_reason("demo", "cpu") is None  # the CPU code needs no CUDA


def test_a_cuda_build_is_refused_everywhere_under_a_cpu_only_torch(plugin_dir, record, monkeypatch):
    """Its module links libtorch_cuda and libcudart, which a CPU-only torch lacks: even its CPU code cannot load."""
    dist = _stable_plugin(plugin_dir, record)
    _running(monkeypatch, "2.12.0", None)
    expected = ("demo was built with CUDA 13.0, and its compiled module loads only under a torch built with CUDA, but "
                f"this process runs a CPU-only torch (2.12.0); install a torch built with CUDA 13.x, or the CPU-only "
                f"build of {dist} (+cputorchabi2.11)")
    assert prime_kernels.unavailable_reason("demo", "sm_90") == expected
    assert prime_kernels.unavailable_reason("demo", "cpu") == expected


def test_an_exact_build_keeps_its_one_torch(plugin_dir, record, monkeypatch):
    dist = f"pk-exact-gate{next(_DISTS)}"
    plugin_dir(dist, record=record({"demo": ["9.0a"]}, torch="2.14.1+cu130", torch_cuda="13.0"))
    _running(monkeypatch, "2.15.0", "13.0")
    assert prime_kernels.unavailable_reason("demo", "cpu") == (
        f"demo was built against torch 2.14 but this process runs torch 2.15; rebuild {dist} against the running torch")
    _running(monkeypatch, "2.14.0", "13.2")
    assert prime_kernels.unavailable_reason("demo", "sm_90").startswith("demo was built against CUDA 13.0 but this "
                                                                        "process runs torch with CUDA 13.2")


@pytest.mark.parametrize("floor", [2.11, "2", "2.11.x", ["2.11"]])
def test_a_malformed_floor_in_the_record_is_a_reason(plugin_dir, record, floor):
    dist = _stable_plugin(plugin_dir, record, floor=floor)
    assert prime_kernels.unavailable_reason("demo", "cpu") == (
        f"{dist}'s build record gives demo the stable ABI floor {floor!r}, not a torch release such as \"2.11\"; "
        f"rebuild {dist}")


def test_an_unreadable_running_version_is_a_reason(plugin_dir, record, monkeypatch):
    _stable_plugin(plugin_dir, record)
    _running(monkeypatch, "unknown")
    assert prime_kernels.unavailable_reason("demo", "cpu") == (
        "demo is built on the LibTorch stable ABI for torch >= 2.11, but the running torch's version 'unknown' names no "
        "release MAJOR.MINOR to compare with it")
    assert prime_kernels.status("cpu")["demo"].startswith("demo is built on the LibTorch stable ABI")


def test_the_torch_range_of_each_build(plugin_dir, record):
    from prime_kernels_core import registry

    _stable_plugin(plugin_dir, record)
    assert registry.torch_support(prime_kernels.spec("demo")) == "torch >= 2.11"
    plugin_dir("pk-exact-range", kernel="exact", record=record({"exact": ["9.0a"]}, torch="2.14.1+cu130"))
    assert registry.torch_support(prime_kernels.spec("exact")) == "torch 2.14"
    plugin_dir("pk-unbuilt-range", kernel="unbuilt", record=None)
    assert registry.torch_support(prime_kernels.spec("unbuilt")) is None


# ---------------------------------------------------------------- the example plugin, as CI installs it

def _installed_example():
    try:
        dist = importlib.metadata.distribution("pk-example-rmsnorm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pk-example-rmsnorm is not installed (scripts/test.sh installs it)")
    return dist, prime_kernels.spec("residual_rmsnorm")


def test_the_example_wheel_is_one_abi3_wheel_for_every_torch_from_its_floor():
    from packaging.tags import Tag, cpython_tags
    from packaging.version import Version

    dist, spec = _installed_example()
    # "cpu" when no CUDA code was compiled (a skipped toolkit, PRIME_KERNELS_ARCH=cpu, or PRIME_KERNELS naming others)
    cuda = f"cu{spec.build['torch_cuda'].replace('.', '')}" if spec.build["nvcc"] else "cpu"
    assert Version(dist.version).local == f"{cuda}torchabi2.11", dist.version  # PEP 440, as pip and uv parse it
    (tag,) = [Tag(*line.split(": ")[1].split("-")) for line in dist.read_text("WHEEL").splitlines()
              if line.startswith("Tag: ")]
    assert tag.abi == "abi3"
    for python in [(3, 10), (3, 11), (3, 12), (3, 13)]:  # the H200 runs 3.12; this wheel is built under 3.11
        assert any(t.interpreter == tag.interpreter and t.abi == tag.abi for t in cpython_tags(python)), python
    assert spec.build["kernels"]["residual_rmsnorm"]["stable_abi"] == "2.11"


def test_the_example_module_imports_only_the_stable_c_shim_from_torch():
    dist, _ = _installed_example()
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not on PATH")
    (shared,) = Path(dist.locate_file("pk_example_rmsnorm")).glob("_C_stable*.so")
    assert b"libtorch_python" not in shared.read_bytes()  # not linked against torch's Python bindings
    imported = subprocess.run(["nm", "-D", "--undefined-only", str(shared)], capture_output=True, text=True,
                              check=True).stdout.split()
    bound = [s for s in imported if s.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch", "_ZNK3c10", "_ZNK2at"))]
    assert not bound, f"{shared.name} imports C++ symbols of one torch: {bound[:5]}"
    assert any(s.startswith(("aoti_torch_", "torch_")) for s in imported)  # it reaches torch through the C shim


@pytest.mark.parametrize("running", ["2.10.0+cu130", "2.11.0+cu130", "2.12.0+cu130", "2.14.1+cu130", "2.30.0+cu130"])
def test_the_installed_example_gates_on_its_floor(monkeypatch, running):
    _, spec = _installed_example()
    _running(monkeypatch, running, spec.build["torch_cuda"])
    reason = prime_kernels.unavailable_reason("residual_rmsnorm", "cpu")
    if running.startswith("2.10"):
        assert reason == ("residual_rmsnorm is built on the LibTorch stable ABI for torch >= 2.11, but this process runs "
                          "torch 2.10; upgrade torch to 2.11 or newer, or install a build of pk-example-rmsnorm for "
                          "torch 2.10")
    else:
        assert reason is None
    if spec.build["nvcc"]:  # a build with CUDA: another CUDA major is a sentence, whatever the torch
        _running(monkeypatch, running, "12.8")
        assert "install a build of pk-example-rmsnorm for CUDA 12" in prime_kernels.unavailable_reason(
            "residual_rmsnorm", "sm_90") or running.startswith("2.10")


def test_the_installed_example_runs_under_this_torch():
    import torch

    _, spec = _installed_example()
    assert prime_kernels.unavailable_reason("residual_rmsnorm", "cpu") is None
    ops = prime_kernels.load("residual_rmsnorm", "cpu")
    # the example's own rule (tests/test_residual_rmsnorm.py): enough elements for the ratio to settle, 2% room for a
    # summation order that flips an odd rounding (120 unseeded elements once measured 1.105x in CI)
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(64, 1000, generator=g), torch.randn(64, 1000, generator=g)
    weight = torch.rand(1000, generator=g) + 0.5
    y, new_residual = ops.residual_rmsnorm(x, residual, weight, 1e-6)
    reference, _ = ops.residual_rmsnorm_reference(x.double(), residual.double(), weight.double(), 1e-6)
    baseline, _ = ops.residual_rmsnorm_reference(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, x + residual)
    assert_error_ratio("stable-ABI y", y, baseline, reference, max_ratio=1.02)
    x, residual = x[:3, :40], residual[:3, :40]
    with pytest.raises(RuntimeError, match=r"^residual_rmsnorm: residual must have x's shape \[3, 40\], got \[3, 4\]$"):
        ops.residual_rmsnorm(x, residual[:, :4], weight, 1e-6)  # the exact-ABI build's words, nothing prefixed


# ---------------------------------------------------------------- one namespace from two kernels (fused_logp)

@pytest.mark.parametrize("first,then", [("linear_ops", "fused_logp"), ("ops", "linear_logp")])
def test_a_plugins_other_kernel_is_not_a_foreign_namespace(first, then):
    """fused_logp's two kernels register the namespace fused_logp from two sources of its _C_stable
    (STABLE_TORCH_LIBRARY in fused_logp.cpp, STABLE_TORCH_LIBRARY_FRAGMENT in linear_logp.cpp): whichever kernel's module
    was imported first, the other kernel stays available (rule 3 counts only what another distribution registered)."""
    try:
        spec = prime_kernels.spec("fused_logp")
    except prime_kernels.KernelUnavailableError:
        pytest.skip("prime-kernels-fused-logp is not installed")
    if spec.extension != "prime_kernels_fused_logp._C_stable":
        pytest.skip(f"this fused_logp build is not the stable-ABI one ({spec.extension})")
    assert prime_kernels.spec("linear_logp").extension == spec.extension  # one module, one floor
    code = (f"import prime_kernels, prime_kernels_fused_logp.{first}\n"
            f"print(repr(prime_kernels.unavailable_reason({then!r}, 'cpu')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "None"
