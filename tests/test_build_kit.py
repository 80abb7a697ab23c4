"""The build kit's decisions (pure functions, any toolchain) and its manifest handling."""
import importlib.util
import textwrap
from pathlib import Path

import pytest

import prime_kernels

from prime_kernels_core import build
from prime_kernels_core.build import Toolchain, cuda_skip_reason

GOOD = Toolchain("2.14.1+cu130", "13.0", "/usr/local/cuda", "13.0")


def test_suitable_toolchain_builds():
    assert cuda_skip_reason(GOOD, ["9.0a", "10.0a"]) is None


@pytest.mark.parametrize("toolchain,archs,expected", [
    (Toolchain("2.14.1+cpu", None, "/usr/local/cuda", "13.0"), ["9.0a"], "torch 2.14.1+cpu is a CPU-only build"),
    (Toolchain("2.14.1+cu130", "13.0", None, None), ["9.0a"],
     "no CUDA toolkit was found (CUDA_HOME=None has no bin/nvcc and include/cuda_runtime.h)"),
    (Toolchain("2.14.1+cu130", "13.0", "/usr/local/cuda", "12.8"), ["9.0a"],
     "nvcc is CUDA 12.8 but torch 2.14.1+cu130 was built with CUDA 13.0; the CUDA majors must match"),
    (Toolchain("2.7.0+cu126", "12.6", "/usr/local/cuda", "12.6"), ["10.0a"],
     "nvcc 12.6 cannot build 10.0a; it needs CUDA 12.8 or newer"),
    (Toolchain("2.7.0+cu128", "12.8", "/usr/local/cuda", "12.8"), ["10.0f"],
     "nvcc 12.8 cannot build 10.0f; it needs CUDA 12.9 or newer"),
    (Toolchain("2.7.0+cu129", "12.9", "/usr/local/cuda", "12.9"), ["11.0f"],
     "nvcc 12.9 cannot build 11.0f; it needs CUDA 13.0 or newer"),
    (GOOD, ["sm90"], "arch 'sm90' is not of the form MAJOR.MINOR[a|f] (e.g. 9.0a)"),
    (GOOD, [], "no CUDA arch was requested (the manifest lists none and PRIME_KERNELS_ARCH is unset)"),
])
def test_unsuitable_toolchains_skip_with_a_sentence(toolchain, archs, expected):
    assert cuda_skip_reason(toolchain, archs) == expected


def test_gencode_is_one_per_arch_and_no_ptx():
    assert build.gencode_flags(["9.0a", "10.0a"]) == [
        "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]


def test_arch_override(monkeypatch):
    monkeypatch.setenv(build.ARCH_ENV, "9.0a;10.0a")
    assert build.requested_archs(["9.0a"]) == ["9.0a", "10.0a"]
    monkeypatch.delenv(build.ARCH_ENV)
    assert build.requested_archs(["9.0a"]) == ["9.0a"]


@pytest.mark.parametrize("capability,arch", [((8, 0), "8.0"), ((8, 6), "8.6"), ((9, 0), "9.0a"), ((10, 0), "10.0a")])
def test_native_arch_is_arch_specific_only_from_hopper_on(monkeypatch, capability, arch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    monkeypatch.setenv(build.ARCH_ENV, "native")
    assert build.requested_archs(["9.0a"]) == [arch]


def test_native_arch_without_a_device(monkeypatch):
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        monkeypatch.setenv(build.ARCH_ENV, "native")
        assert build.requested_archs([]) == [f"{major}.{minor}a"]
    else:
        monkeypatch.setenv(build.ARCH_ENV, "native")
        assert build.requested_archs(["9.0a"]) == "PRIME_KERNELS_ARCH=native but no CUDA device is visible to the build"


def test_abi_tag():
    assert build.abi_tag(GOOD, True) == "cu130torch2.14"
    assert build.abi_tag(GOOD, False) == "cputorch2.14"


def _write_plugin(root, constants="BLOCK_M = 128\nUSE_TMA = true", cuda='["csrc/k.cu"]'):
    (root / "pk_plan").mkdir()
    (root / "pk_plan" / "kernel.toml").write_text(textwrap.dedent(f"""\
        version = "0.2.0"
        [moe]
        namespace = "pk_plan"
        ops = ["run"]
        module = "pk_plan.ops"
        archs = ["9.0a", "10.0a"]
        sources.cpu = ["csrc/k.cpp"]
        sources.cuda = {cuda}
        extra_nvcc_flags = ["-DNDEBUG"]
        [moe.constants]
    """) + constants + "\n")


def test_plan_compiles_manifest_constants_and_archs(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write_plugin(tmp_path)
    plan = build.extension_plan(tmp_path, GOOD)
    assert plan["version"] == "0.2.0+cu130torch2.14"
    assert plan["cpu_sources"] == ["csrc/k.cpp"] and plan["cuda_sources"] == ["csrc/k.cu"]
    assert "-DMOE_BLOCK_M=128" in plan["cxx_flags"] and "-DMOE_USE_TMA=1" in plan["nvcc_flags"]
    assert plan["nvcc_flags"][:3] == ["-std=c++20", "-gencode=arch=compute_100a,code=sm_100a",
                                      "-gencode=arch=compute_90a,code=sm_90a"]
    assert plan["cuda_skipped"] is None and plan["archs"] == ["10.0a", "9.0a"]


def test_plan_skips_cuda_but_keeps_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write_plugin(tmp_path)
    plan = build.extension_plan(tmp_path, Toolchain("2.14.1+cu130", "13.0", None, None))
    assert plan["cuda_sources"] == [] and plan["nvcc_flags"] == [] and plan["archs"] == []
    assert plan["cpu_sources"] == ["csrc/k.cpp"]
    assert plan["version"] == "0.2.0+cputorch2.14"
    assert plan["cuda_skipped"].startswith("no CUDA toolkit was found")


def test_plugin_without_cuda_sources_is_no_skip(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(build.REQUIRE_ENV, "1")
    _write_plugin(tmp_path, cuda="[]")
    plan = build.extension_plan(tmp_path, GOOD)
    build.announce_skip(plan)
    assert "skipping CUDA" not in capsys.readouterr().err
    assert plan["cuda_skipped"] is None and plan["cuda_sources"] == [] and plan["nvcc_flags"] == [] and plan["archs"] == []
    assert plan["version"] == "0.2.0+cputorch2.14"


def test_string_constants_are_refused(tmp_path):
    _write_plugin(tmp_path, constants='NAME = "x"')
    with pytest.raises(build.BuildError, match="constant moe.NAME must be a number or boolean"):
        build.extension_plan(tmp_path, GOOD)


UNSUITABLE = {
    "cpu-only torch": Toolchain("2.14.1+cpu", None, "/usr/local/cuda", "13.0"),
    "missing nvcc": Toolchain("2.14.1+cu130", "13.0", "/nonexistent", None),
    "CUDA major mismatch": Toolchain("2.14.1+cu130", "13.0", "/usr/local/cuda-12.8", "12.8"),
}


@pytest.mark.parametrize("case", sorted(UNSUITABLE))
def test_skip_message_and_matching_status_reason(case, tmp_path, monkeypatch, capsys, plugin_dir):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    monkeypatch.delenv(build.REQUIRE_ENV, raising=False)
    source = tmp_path / "src"
    source.mkdir()
    _write_plugin(source)
    toolchain = UNSUITABLE[case]
    plan = build.extension_plan(source, toolchain)
    build.announce_skip(plan)
    assert f"prime-kernels: skipping CUDA for pk_plan: {plan['cuda_skipped']}" in capsys.readouterr().err
    record = dict(build.build_record(plan, toolchain), torch=__import__("torch").__version__,
                  torch_cuda=__import__("torch").version.cuda)  # as if built by this torch, so rule 4 is what fires
    plugin_dir("pk-skipped-" + case.replace(" ", "-"), record=record)
    from prime_kernels_core.registry import Target

    assert prime_kernels.unavailable_reason("demo", Target("cuda", 0, (9, 0))) == (
        f"demo was built without CUDA: {plan['cuda_skipped']}")


@pytest.mark.parametrize("case", sorted(UNSUITABLE))
def test_require_turns_each_skip_into_an_error(case, tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    monkeypatch.setenv(build.REQUIRE_ENV, "1")
    _write_plugin(tmp_path)
    plan = build.extension_plan(tmp_path, UNSUITABLE[case])
    with pytest.raises(build.BuildError, match="PRIME_KERNELS_REQUIRE=1 makes this an error"):
        build.announce_skip(plan)


def test_cuda_library_headers_only_when_the_toolkit_lacks_them(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cusparse.h").write_text("")
    assert build.cuda_library_includes(str(tmp_path)) == []
    includes = build.cuda_library_includes(str(tmp_path / "nvcc-and-cudart-only"))
    if importlib.util.find_spec("nvidia") is None:
        pytest.skip("no CUDA library wheels (the nvidia namespace) are installed beside torch")
    assert includes, "the nvidia wheels beside torch have no include folder with cusparse.h"
    for include in includes:
        assert (Path(include) / "cusparse.h").exists()
