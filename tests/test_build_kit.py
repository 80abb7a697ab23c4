"""The build kit's decisions (pure functions, any toolchain) and its manifest handling."""
import importlib.util
import textwrap
from pathlib import Path

import pytest

import prime_kernels

from prime_kernels_core import build
from prime_kernels_core.manifest import ManifestError, load, source_paths
from prime_kernels_core.build import Toolchain, nvcc_arch_reason, toolchain_skip_reason

GOOD = Toolchain("2.14.1+cu130", "13.0", "/usr/local/cuda", "13.0")


def test_suitable_toolchain_builds():
    assert toolchain_skip_reason(GOOD) is None
    assert nvcc_arch_reason("13.0", "9.0a") is None and nvcc_arch_reason("13.0", "12.0") is None


@pytest.mark.parametrize("toolchain,expected", [
    (Toolchain("2.14.1+cpu", None, "/usr/local/cuda", "13.0"), "torch 2.14.1+cpu is a CPU-only build"),
    (Toolchain("2.14.1+cu130", "13.0", None, None),
     "no CUDA toolkit was found (CUDA_HOME is unset and no nvcc is on PATH)"),
    (Toolchain("2.14.1+cu130", "13.0", "/usr/local/cuda", "12.8"),
     "nvcc is CUDA 12.8 but torch 2.14.1+cu130 was built with CUDA 13.0; the CUDA majors must match"),
])
def test_unsuitable_toolchains_skip_with_a_sentence(toolchain, expected):
    assert toolchain_skip_reason(toolchain) == expected


def test_a_guessed_cuda_home_with_nvcc_but_no_headers_says_so(tmp_path, monkeypatch):
    """A wrapper nvcc on PATH outside the toolkit: torch guesses a folder with bin/nvcc but no headers, and the skip
    said it had neither (issue 61, item 11)."""
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\n")
    assert toolchain_skip_reason(Toolchain("2.14.1+cu130", "13.0", str(tmp_path), None)) == (
        f"no CUDA toolkit was found: {tmp_path} (CUDA_HOME is unset, so torch guessed it from the nvcc on PATH) has "
        "no include/cuda_runtime.h; set CUDA_HOME to the toolkit's folder (e.g. /usr/local/cuda)")


@pytest.mark.parametrize("nvcc,arch,expected", [
    ("12.6", "10.0a", "nvcc 12.6 cannot build 10.0a; it needs CUDA 12.8 or newer"),
    ("12.8", "10.0f", "nvcc 12.8 cannot build 10.0f; it needs CUDA 12.9 or newer"),
    ("12.9", "11.0f", "nvcc 12.9 cannot build 11.0f; it needs CUDA 13.0 or newer"),
    ("13.0", "7.0", "nvcc 13.0 cannot build 7.0; CUDA 13.0 dropped every arch below 7.5"),
    ("13.0", "8.0a", "8.0a is no nvcc target: arch-specific targets begin with 9.0a"),
])
def test_archs_this_nvcc_cannot_build(nvcc, arch, expected):
    assert nvcc_arch_reason(nvcc, arch) == expected


FUSED_LOGP_ARCHS = ["8.0", "8.6", "8.9", "9.0", "10.0", "11.0", "12.0"]


@pytest.mark.parametrize("device,generic,hopper_only", [
    ("8.0", "8.0", None), ("8.6", "8.6", None), ("8.7", "8.6", None), ("8.9", "8.9", None), ("9.0a", "9.0", "9.0a"),
    ("9.0", "9.0", "9.0a"), ("10.0a", "10.0", None), ("10.3a", "10.0", None), ("11.0a", "11.0", None),
    ("12.0a", "12.0", None), ("12.1a", "12.0", None), ("7.5", None, None),
])
def test_each_requested_device_gets_the_kernels_best_arch(device, generic, hopper_only):
    assert build.best_arch(FUSED_LOGP_ARCHS, device) == generic
    assert build.best_arch(["9.0a"], device) == hopper_only


def test_best_arch_prefers_the_same_spelling_then_arch_specific_code():
    assert build.best_arch(["9.0", "9.0a"], "9.0") == "9.0"
    assert build.best_arch(["9.0", "9.0a"], "9.0a") == "9.0a"
    assert build.best_arch(["10.0", "10.0f", "10.0a"], "10.0a") == "10.0a"
    assert build.best_arch(["10.0", "10.0f"], "10.3a") == "10.0f"


def test_gencode_is_one_per_arch_and_no_ptx():
    assert build.gencode_flags(["9.0a", "10.0a"]) == [
        "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]


def test_arch_request(monkeypatch):
    monkeypatch.setenv(build.ARCH_ENV, "9.0a;10.0a")
    assert build.arch_request() == build.ArchRequest(("9.0a", "10.0a"), "PRIME_KERNELS_ARCH=9.0a;10.0a")
    monkeypatch.setenv(build.ARCH_ENV, "sm90")
    assert build.arch_request() == "PRIME_KERNELS_ARCH names ['sm90'], not of the form MAJOR.MINOR[a|f] (e.g. 9.0a)"
    monkeypatch.delenv(build.ARCH_ENV)
    assert build.arch_request() == build.ArchRequest(None, "every arch each kernel lists (PRIME_KERNELS_ARCH unset)")


@pytest.mark.parametrize("capability,arch", [((8, 0), "8.0"), ((8, 6), "8.6"), ((9, 0), "9.0a"), ((10, 0), "10.0a")])
def test_native_arch_is_arch_specific_only_from_hopper_on(monkeypatch, capability, arch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    monkeypatch.setenv(build.ARCH_ENV, "native")
    assert build.arch_request().archs == (arch,)


def test_native_arch_without_a_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(build.ARCH_ENV, "native")
    assert build.arch_request() == "PRIME_KERNELS_ARCH=native but no CUDA device is visible to the build"


def test_abi_tag():
    assert build.abi_tag(GOOD, True) == "cu130torch2.14"
    assert build.abi_tag(GOOD, False) == "cputorch2.14"


def _module(plan, name="_C"):
    """The plan of one compiled module of the plugin (its exact-ABI _C unless named)."""
    return next(m for m in plan["modules"] if m["name"] == name)


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


def _write_plugin(root, constants="BLOCK_M = 128\nUSE_TMA = true", cuda='["csrc/k.cu"]', extra=""):
    (root / "pk_plan").mkdir()
    (root / "pk_plan" / "kernel.toml").write_text(textwrap.dedent(f"""\
        version = "0.2.0"
        [moe]
        namespace = "pk_plan"
        ops = ["run"]
        module = "pk_plan.ops"
        archs = {'["9.0a", "10.0a"]' if cuda != "[]" else "[]"}
        sources.cpu = ["csrc/k.cpp"]
        sources.cuda = {cuda}
        extra_nvcc_flags = ["-DNDEBUG"]
        {extra}
        [moe.constants]
    """) + constants + "\n")
    load.cache_clear()
    _touch_sources(root, "pk_plan")


def _write_two_kernels(root):
    """A generic kernel beside a Hopper-only one with a Blackwell variant, as fused_logp beside linear_logp."""
    (root / "pk_two").mkdir()
    (root / "pk_two" / "kernel.toml").write_text(textwrap.dedent("""\
        version = "0.1.0"
        [generic]
        namespace = "pk_two"
        ops = ["a"]
        module = "pk_two.ops"
        archs = ["8.0", "9.0", "12.0"]
        sources.cpu = ["csrc/a.cpp"]
        sources.cuda = ["csrc/cuda/a.cu"]
        [hopper]
        namespace = "pk_two"
        ops = ["b"]
        module = "pk_two.ops"
        archs = ["9.0a", "10.0a"]
        sources.cpu = ["csrc/b.cpp"]
        sources.cuda_variants."9.0a" = ["csrc/cuda/b_sm90.cu", "csrc/cuda/b_common.cu"]
        sources.cuda_variants."10.0a" = ["csrc/cuda/b_sm100.cu"]
    """))
    load.cache_clear()
    _touch_sources(root, "pk_two")


def test_plan_compiles_manifest_constants_and_archs(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write_plugin(tmp_path)
    plan = build.extension_plan(tmp_path, GOOD)
    assert plan["version"] == "0.2.0+cu130torch2.14"
    assert _module(plan)["cpu_sources"] == ["csrc/k.cpp"]
    assert _module(plan)["cuda_groups"] == [{"sources": ["csrc/k.cu"], "archs": ["10.0a", "9.0a"], "nvcc_flags": [
        "-gencode=arch=compute_100a,code=sm_100a", "-gencode=arch=compute_90a,code=sm_90a", "--threads=0"]}]
    assert "-DMOE_BLOCK_M=128" in _module(plan)["cxx_flags"] and "-DMOE_USE_TMA=1" in _module(plan)["nvcc_flags"]
    assert not any("gencode" in f for f in _module(plan)["nvcc_flags"])  # each source set carries its own
    assert plan["cuda_skipped"] is None and plan["kernels"] == {"moe": {"archs": ["9.0a", "10.0a"], "not_built": {}}}


def test_fat_build_compiles_each_kernel_for_its_own_archs(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write_two_kernels(tmp_path)
    plan = build.extension_plan(tmp_path, GOOD)
    assert _module(plan)["cuda_groups"] == [
        {"sources": ["csrc/cuda/a.cu"], "archs": ["12.0", "8.0", "9.0"], "nvcc_flags": [*build.gencode_flags(["12.0", "8.0", "9.0"]), "--threads=0"]},
        {"sources": ["csrc/cuda/b_sm90.cu", "csrc/cuda/b_common.cu"], "archs": ["9.0a"], "nvcc_flags": build.gencode_flags(["9.0a"])},
        {"sources": ["csrc/cuda/b_sm100.cu"], "archs": ["10.0a"], "nvcc_flags": build.gencode_flags(["10.0a"])},
    ]
    assert plan["kernels"]["generic"] == {"archs": ["8.0", "9.0", "12.0"], "not_built": {}}


def test_a_requested_arch_a_kernel_lacks_leaves_it_without_code_not_a_failed_build(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ARCH_ENV, "9.0a;12.0a")
    monkeypatch.setenv(build.REQUIRE_ENV, "1")
    _write_two_kernels(tmp_path)
    plan = build.extension_plan(tmp_path, GOOD)
    build.announce(plan)  # no error under PRIME_KERNELS_REQUIRE=1
    asked = "PRIME_KERNELS_ARCH=9.0a;12.0a did not ask for a device it runs on"
    assert plan["kernels"] == {
        "generic": {"archs": ["9.0", "12.0"], "not_built": {"8.0": asked}},
        "hopper": {"archs": ["9.0a"], "not_built": {"10.0a": asked}},
    }
    assert [g["archs"] for g in _module(plan)["cuda_groups"]] == [["12.0", "9.0"], ["9.0a"]]
    monkeypatch.setenv(build.ARCH_ENV, "12.0a")
    plan = build.extension_plan(tmp_path, GOOD)
    assert plan["kernels"]["hopper"]["archs"] == [] and plan["cuda_skipped"] is None
    assert [g["sources"] for g in _module(plan)["cuda_groups"]] == [["csrc/cuda/a.cu"]]


@pytest.mark.parametrize("toolchain", [GOOD, Toolchain("2.14.1+cpu", None, None, None),
                                       Toolchain("2.14.1+cu130", "13.0", None, None)], ids=["cuda", "cpu-torch", "no-nvcc"])
def test_a_cpu_only_build_compiles_no_device_code_whatever_the_toolkit(tmp_path, monkeypatch, toolchain):
    monkeypatch.setenv(build.ARCH_ENV, "cpu")
    monkeypatch.setenv(build.REQUIRE_ENV, "1")
    _write_plugin(tmp_path)
    plan = build.extension_plan(tmp_path, toolchain)
    build.announce(plan)  # asked for no CUDA, so nothing is skipped: no error under PRIME_KERNELS_REQUIRE=1
    assert plan["version"] == "0.2.0+cputorch2.14" and plan["cuda_skipped"] is None
    assert _module(plan)["cuda_groups"] == [] and _module(plan)["cpu_sources"] == ["csrc/k.cpp"]
    assert plan["kernels"]["moe"] == {"archs": [], "not_built": dict.fromkeys(
        ["9.0a", "10.0a"], "PRIME_KERNELS_ARCH=cpu (a CPU-only build) did not ask for a device it runs on")}


def test_prime_kernels_names_the_kernels_built_with_cuda(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    monkeypatch.setenv(build.KERNELS_ENV, "hopper")
    _write_two_kernels(tmp_path)
    plan = build.extension_plan(tmp_path, GOOD)
    assert plan["kernels"]["generic"] == {"archs": [], "not_built": dict.fromkeys(
        ["8.0", "9.0", "12.0"], "PRIME_KERNELS=hopper does not name generic")}
    assert plan["kernels"]["hopper"]["archs"] == ["9.0a", "10.0a"]
    assert _module(plan)["cpu_sources"] == ["csrc/a.cpp", "csrc/b.cpp"]  # every kernel keeps its CPU implementation


def test_an_arch_this_nvcc_cannot_build_is_left_out_and_an_error_under_require(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    monkeypatch.delenv(build.REQUIRE_ENV, raising=False)
    _write_two_kernels(tmp_path)
    plan = build.extension_plan(tmp_path, Toolchain("2.7.0+cu126", "12.6", "/usr/local/cuda", "12.6"))
    assert plan["kernels"]["hopper"] == {"archs": ["9.0a"], "not_built": {
        "10.0a": "nvcc 12.6 cannot build 10.0a; it needs CUDA 12.8 or newer"}}
    build.announce(plan)
    assert "hopper: CUDA for 9.0a (not 10.0a: nvcc 12.6 cannot build 10.0a" in capsys.readouterr().err
    monkeypatch.setenv(build.REQUIRE_ENV, "1")
    with pytest.raises(build.BuildError, match="hopper: nvcc 12.6 cannot build 10.0a.*PRIME_KERNELS_REQUIRE=1"):
        build.announce(plan)


def test_a_source_in_two_sets_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write_plugin(tmp_path, extra='sources.cuda_variants."10.0a" = ["csrc/k.cu", "csrc/k100.cu"]')
    with pytest.raises(build.BuildError, match="csrc/k.cu is in two CUDA source sets"):
        build.extension_plan(tmp_path, GOOD)


def test_plan_skips_cuda_but_keeps_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write_plugin(tmp_path)
    plan = build.extension_plan(tmp_path, Toolchain("2.14.1+cu130", "13.0", None, None))
    assert _module(plan)["cuda_groups"] == [] and _module(plan)["nvcc_flags"] == [] and plan["kernels"]["moe"]["archs"] == []
    assert _module(plan)["cpu_sources"] == ["csrc/k.cpp"]
    assert plan["version"] == "0.2.0+cputorch2.14"
    assert plan["cuda_skipped"].startswith("no CUDA toolkit was found")


def test_plugin_without_cuda_sources_is_no_skip(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(build.REQUIRE_ENV, "1")
    _write_plugin(tmp_path, cuda="[]")
    plan = build.extension_plan(tmp_path, GOOD)
    build.announce(plan)
    assert "skipping CUDA" not in capsys.readouterr().err
    assert plan["cuda_skipped"] is None and _module(plan)["cuda_groups"] == [] and _module(plan)["nvcc_flags"] == []
    assert plan["version"] == "0.2.0+cputorch2.14"


@pytest.mark.parametrize("toolchain", [GOOD, Toolchain("2.14.1+cu130", "13.0", None, None)], ids=["cuda", "no toolkit"])
@pytest.mark.parametrize("missing", ["csrc/k.cpp", "csrc/k.cu", "csrc/k100.cu"])
def test_a_missing_source_fails_the_build_with_or_without_cuda(tmp_path, monkeypatch, toolchain, missing):
    """A missing .cu built a CPU-only wheel without a word where no toolkit was found (issue 61, item 12)."""
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    _write_plugin(tmp_path, extra='sources.cuda_variants."10.0a" = ["csrc/k100.cu"]')
    (tmp_path / missing).unlink()
    with pytest.raises(build.BuildError, match=rf"kernel 'moe' names sources \['{missing}'\] that are not files under "):
        build.extension_plan(tmp_path, toolchain)


def test_string_constants_are_refused(tmp_path):
    _write_plugin(tmp_path, constants='NAME = "x"')
    with pytest.raises(ManifestError, match="constant 'NAME' must be an identifier with a number or boolean value"):
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
    build.announce(plan)
    assert f"prime-kernels: skipping CUDA for pk_plan: {plan['cuda_skipped']}" in capsys.readouterr().err
    record = dict(build.build_record(plan, toolchain), torch=__import__("torch").__version__,
                  torch_cuda=__import__("torch").version.cuda)  # as if built by this torch, so rule 4 is what fires
    plugin_dir("pk-skipped-" + case.replace(" ", "-"), kernel="moe", record=record)
    from prime_kernels_core.registry import Target

    assert prime_kernels.unavailable_reason("moe", Target("cuda", 0, (9, 0))) == (
        f"moe was built without CUDA: {plan['cuda_skipped']}")


@pytest.mark.parametrize("case", sorted(UNSUITABLE))
def test_require_turns_each_skip_into_an_error(case, tmp_path, monkeypatch):
    monkeypatch.delenv(build.ARCH_ENV, raising=False)
    monkeypatch.setenv(build.REQUIRE_ENV, "1")
    _write_plugin(tmp_path)
    plan = build.extension_plan(tmp_path, UNSUITABLE[case])
    with pytest.raises(build.BuildError, match="PRIME_KERNELS_REQUIRE=1 makes this an error"):
        build.announce(plan)


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


@pytest.mark.parametrize("extra, words", [
    ('archs = ["٩.٠a"]', r"archs are spelled MAJOR.MINOR\[a\|f\]"),
    ('stable_abi = "٢.١١"', r"stable_abi is the oldest torch release the kernel targets, a string MAJOR.MINOR"),
])
def test_non_ascii_digits_are_no_arch_and_no_release(tmp_path, extra, words):
    """Arabic-Indic digits passed every spelling check (\\d) and reached nvcc (issue 61, item 8)."""
    (tmp_path / "pk_digits").mkdir()
    (tmp_path / "pk_digits" / "kernel.toml").write_text(
        f'version = "0.1.0"\n[k]\nnamespace = "pk_digits"\nops = ["a"]\nmodule = "pk_digits.ops"\n{extra}\n',
        encoding="utf-8")
    load.cache_clear()
    with pytest.raises(ManifestError, match=words):
        load(tmp_path / "pk_digits")


def test_non_ascii_digits_are_no_capability_and_no_arch_request(monkeypatch):
    from prime_kernels_core import registry

    assert registry.parse_capability("sm_٩٠") is None and registry.parse_capability("٩.٠") is None
    assert registry.parse_capability("sm_90") == (9, 0)
    monkeypatch.setenv(build.ARCH_ENV, "٩.٠a")
    assert "not of the form MAJOR.MINOR[a|f]" in build.arch_request()


@pytest.mark.parametrize("archs, line", [
    (["8.0", "9.0", "10.3"], "k runs on sm_80 sm_86 sm_87 sm_89 sm_90 sm_103; not on sm_100: 10.3 runs on sm_103 only"),
    (["9.0a", "12.1a"], "k runs on sm_90 sm_121; not on sm_120: 12.1a runs on sm_121 only"),
    (["8.0", "8.6", "8.9", "9.0", "10.0", "11.0", "12.0"],
     "k runs on sm_80 sm_86 sm_87 sm_89 sm_90 sm_100 sm_103 sm_110 sm_120 sm_121"),
    ([], "k runs on no GPU (no CUDA code: its CPU implementation only)"),
])
def test_the_build_ends_saying_which_gpus_each_kernel_runs_on(archs, line):
    """A valid but wrong arch ("10.3" for "10.0") is visible at the end of the build (issue 61, item 15)."""
    assert build.runs_on_line("pk", "k", archs) == f"prime-kernels: pk: {line}"


COMPILE_KERNELS = {
    "fused_rope": {"sources": {"cpu": ["csrc/rope.cpp"], "cuda": ["csrc/cuda/rope.cu"]}},
    "fused_norm": {"sources": {"cpu": ["csrc/norm.cpp"]}, "stable_abi": "2.11"},
}


@pytest.mark.parametrize("output, where, first", [
    ("[1/2] c++ -c /ROOT/csrc/rope.cpp\n/ROOT/csrc/rope.cpp:12:5: error: 'foo' was not declared in this scope\n"
     "   12 |     foo();\nninja: build stopped: subcommand failed.\nRuntimeError: Error compiling objects for extension",
     "in kernel fused_rope's csrc/rope.cpp", "/ROOT/csrc/rope.cpp:12:5: error: 'foo' was not declared in this scope"),
    ("/ROOT/csrc/cuda/rope.cu(40): error: identifier \"kAct\" is undefined\n1 error detected in the compilation of "
     "\"/ROOT/csrc/cuda/rope.cu\".", "in kernel fused_rope's csrc/cuda/rope.cu",
     "/ROOT/csrc/cuda/rope.cu(40): error: identifier \"kAct\" is undefined"),
    ("nvcc fatal   : Unsupported gpu architecture 'compute_200'", "", "nvcc fatal   : Unsupported gpu architecture"),
])
def test_a_failed_compile_ends_with_the_first_errors_and_their_kernel(tmp_path, output, where, first):
    """Issue 61, item 13: the compiler's first error lines and the kernel and source they belong to (or none where
    the line names no source), not setuptools' 'Error compiling objects' a hundred lines below."""
    message = build.compile_failure(output.replace("/ROOT", str(tmp_path)), tmp_path, COMPILE_KERNELS)
    assert message.startswith(f"prime-kernels: compiling failed{' ' + where if where else ''}; the compiler's first "
                              "errors:\n  "), message
    assert first.replace("/ROOT", str(tmp_path)) in message
    assert "Error compiling objects" not in message and "porting table" not in message


def test_a_stable_abi_kernel_including_an_unstable_header_is_pointed_at_the_porting_table(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "norm.cpp").write_text("#include <torch/csrc/stable/library.h>\n#include <ATen/ATen.h>\n"
                                                "#include <torch/extension.h>\n")
    output = f"{tmp_path}/csrc/norm.cpp:2:10: error: static assertion failed: TORCH_TARGET_VERSION\n"
    message = build.compile_failure(output, tmp_path, COMPILE_KERNELS)
    assert "in kernel fused_norm's csrc/norm.cpp" in message
    assert message.endswith('fused_norm is built on the LibTorch stable ABI (stable_abi = "2.11") and csrc/norm.cpp '
                            "includes ATen/ATen.h, torch/extension.h, outside the stable API: "
                            "docs/writing-a-plugin.md section 9 has the porting table"), message
