"""Every gating rule, through real entry points of throwaway distributions. Each test fails if its rule is removed."""
import sys

import pytest
import torch

from prime_kernels_core.registry import Target, arch_runs_on

SM90 = Target("cuda", 0, (9, 0))
SM100 = Target("cuda", 0, (10, 0))


def test_available_on_cpu_and_matching_gpu(plugin_dir, api):
    plugin_dir("pk-good")
    assert api.unavailable_reason("demo", "cpu") is None
    assert api.unavailable_reason("demo", SM90) is None
    assert api.is_available("demo", "cpu")
    assert api.load("demo", "cpu").unsupported_shape_reason(16) is None


def test_entry_point_naming_manifest_hooks(plugin_dir, api, tmp_path):
    from prime_kernels_core import registry

    package = plugin_dir("pk-hooks-object", entry_point="plugin:hooks", plugin_source=(
        "from prime_kernels_core.manifest import ManifestHooks\n\n"
        "hooks = ManifestHooks(__file__, 'PACKAGE.samples')\n"))
    (tmp_path / package / "samples.py").write_text(
        "def op_samples(kernel, device):\n    return [('op_a', (kernel, device), {})]\n\n"
        "def surface_samples(kernel, device):\n    return []\n")
    assert api.unavailable_reason("demo", "cpu") is None
    entry = next(e for e in registry.entries() if e.name == "demo")
    assert entry.manager.hook.prime_kernels_sample_inputs(kernel="demo", device="cpu") == [[("op_a", ("demo", "cpu"), {})]]


def test_refresh_rereads_the_manifest(plugin_dir, api, tmp_path):
    package = plugin_dir("pk-renamed", kernel="before")
    assert set(api.status("cpu")) == {"before"}
    manifest = tmp_path / package / "kernel.toml"
    manifest.write_text(manifest.read_text().replace("[before]", "[after]"))
    api.refresh()
    assert set(api.status("cpu")) == {"after"}


def test_unknown_kernel_is_a_reason(plugin_dir, api):
    plugin_dir("pk-good2")
    assert api.unavailable_reason("nope", "cpu") == "no installed plugin declares a kernel named 'nope'"
    with pytest.raises(api.KernelUnavailableError, match="nope"):
        api.load("nope", "cpu")


def test_rule1_broken_import_beside_good_plugin(plugin_dir, api, tmp_path):
    plugin_dir("pk-fine", kernel="fine")
    broken = plugin_dir("pk-broken", kernel="broken")
    (tmp_path / broken / "plugin.py").write_text("raise RuntimeError('boom at import')\n")
    api.refresh()
    status = api.status("cpu")
    assert status["fine"] == "available"
    assert status["broken"] == "plugin pk-broken 0.1.0 failed to load: RuntimeError: boom at import"
    assert api.load("fine", "cpu") is not None


def test_rule1_broken_plugin_names_every_kernel_of_its_manifest(plugin_dir, api, tmp_path):
    package = plugin_dir("pk-multi", kernel="first")
    with open(tmp_path / package / "kernel.toml", "a") as manifest:
        manifest.write(f'[second]\nnamespace = "pk_test_{package}"\nops = ["op_b"]\nmodule = "{package}.ops"\n')
    (tmp_path / package / "plugin.py").write_text("raise ImportError('boom')\n")
    api.refresh()
    assert api.status("cpu") == dict.fromkeys(["first", "second"], "plugin pk-multi 0.1.0 failed to load: ImportError: boom")
    (tmp_path / package / "kernel.toml").unlink()
    api.refresh()
    assert api.status("cpu") == {"first": "plugin pk-multi 0.1.0 failed to load: ImportError: boom"}


def test_rule1_hook_raising(plugin_dir, api, tmp_path):
    plugin_dir("pk-hookok", kernel="hookok")
    package = plugin_dir("pk-hookraise", kernel="hookraise")
    (tmp_path / package / "plugin.py").write_text(
        "from prime_kernels_core import hookimpl\n\n"
        "@hookimpl\ndef prime_kernels_declare():\n    raise ValueError('manifest unreadable')\n"
    )
    api.refresh()
    assert api.unavailable_reason("hookraise", "cpu") == (
        "plugin pk-hookraise 0.1.0 failed to load: ValueError: manifest unreadable")
    assert api.unavailable_reason("hookok", "cpu") is None


@pytest.mark.parametrize("same", ["namespace", "kernel"])
def test_rule2_two_distributions_one_claim(plugin_dir, api, same):
    if same == "namespace":
        plugin_dir("pk-first", kernel="first", namespace="pk_shared_ns", version="1.0.0")
        plugin_dir("pk-second", kernel="second", namespace="pk_shared_ns", version="2.0.0")
        names, expected = ("first", "second"), "namespace 'pk_shared_ns'"
    else:
        plugin_dir("pk-kfirst", kernel="same", version="1.0.0")
        plugin_dir("pk-ksecond", kernel="same", version="2.0.0")
        names, expected = ("same",), "kernel name 'same'"
    for name in names:
        reason = api.unavailable_reason(name, "cpu")
        assert expected in reason and "1.0.0" in reason and "2.0.0" in reason, reason
    import sys

    assert not any(m.endswith(".ops") and m.startswith("pk_") and ("first" in m or "second" in m) for m in sys.modules)


def test_rule3_namespace_preregistered_in_process(plugin_dir, api):
    lib = torch.library.Library("pk_test_prereg", "DEF")
    lib.define("squat(Tensor x) -> Tensor")
    plugin_dir("pk-prereg", namespace="pk_test_prereg")
    reason = api.unavailable_reason("demo", "cpu")
    assert reason.startswith("torch.ops namespace 'pk_test_prereg' is already registered"), reason
    assert "pk_test_prereg::squat" in reason


def test_rule4_not_compiled(plugin_dir, api):
    plugin_dir("pk-unbuilt", record=None)
    assert "is not compiled" in api.unavailable_reason("demo", "cpu")


def test_rule4_cuda_skipped_at_build(plugin_dir, api, record):
    plugin_dir("pk-cpuonly", record=record({"demo": []}, cuda_skipped="no nvcc was found (CUDA_HOME=None)"))
    assert api.unavailable_reason("demo", SM90) == "demo was built without CUDA: no nvcc was found (CUDA_HOME=None)"
    assert api.unavailable_reason("demo", "cpu") is None


def test_rule5_abi_mismatch_checked_before_import(plugin_dir, api, record):
    plugin_dir("pk-oldtorch", record=record({"demo": ["9.0a"]}, torch="1.13.0+cu117", torch_cuda="11.7"),
               import_error="undefined symbol: _ZN3c10 would crash")
    reason = api.unavailable_reason("demo", SM90)
    assert reason.startswith("demo was built against torch 1.13 but this process runs torch"), reason


def test_rule5_cuda_mismatch(plugin_dir, api, record):
    plugin_dir("pk-oldcuda", record=record({"demo": ["9.0a"]}, torch_cuda="11.8"))
    assert "was built against CUDA 11.8" in api.unavailable_reason("demo", SM90)


def test_rule5_cpu_only_torch(plugin_dir, api, monkeypatch, record):
    import torch

    plugin_dir("pk-cputorch", record=record({"demo": ["9.0a"]}, torch="2.14.1+cu130", torch_cuda="13.0"))
    monkeypatch.setattr(torch.version, "cuda", None)
    expected = ("demo was built with CUDA 13.0, and its compiled module loads only under a torch built with CUDA, but "
                f"this process runs a CPU-only torch ({torch.__version__}); install a torch built with CUDA 13.0, or the "
                "CPU-only build of pk-cputorch (+cputorch2.14)")
    assert api.unavailable_reason("demo", SM90) == expected
    assert api.unavailable_reason("demo", "cpu") == expected  # its module links libtorch_cuda: it cannot load


def test_rule5_cpu_only_build_under_cpu_only_torch(plugin_dir, api, monkeypatch, record):
    import torch

    plugin_dir("pk-cpubuild", record=record({"demo": []}, torch_cuda="13.0", nvcc=None))
    monkeypatch.setattr(torch.version, "cuda", None)
    assert api.unavailable_reason("demo", "cpu") is None


def test_rule6_no_such_cuda_device(plugin_dir, api):
    plugin_dir("pk-nodev")
    reason = api.unavailable_reason("demo", "cuda:64")
    assert reason.startswith("no CUDA device cuda:64 is visible to this process"), reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_rule6_default_device_without_gpu(plugin_dir, api):
    plugin_dir("pk-nogpu")
    assert api.unavailable_reason("demo") == "no CUDA device is visible to this process (torch.cuda.is_available() is False)"
    assert api.status() == {"demo": api.unavailable_reason("demo")}


def test_rule7_arch_mismatch(plugin_dir, api):
    plugin_dir("pk-hopper", archs=("9.0a",))
    assert api.unavailable_reason("demo", SM100) == (
        "demo has no CUDA build for sm_100: it supports 9.0a only (this install has it for 9.0a)")
    assert api.unavailable_reason("demo", SM90) is None


def test_rule7_archs_are_per_kernel(plugin_dir, api, tmp_path, record):
    package = plugin_dir("pk-two-archs", kernel="generic", archs=("8.0", "12.0"),
                         record=record({"generic": ["8.0", "12.0"], "hopper_only": ["9.0a"]}))
    with open(tmp_path / package / "kernel.toml", "a") as manifest:
        manifest.write(f'[hopper_only]\nnamespace = "pk_test_{package}"\nops = ["op_a"]\nmodule = "{package}.ops"\n'
                       'archs = ["9.0a"]\n')
    api.refresh()
    assert api.unavailable_reason("generic", Target("cuda", 0, (12, 1))) is None
    assert api.unavailable_reason("hopper_only", SM90) is None
    assert api.unavailable_reason("hopper_only", Target("cuda", 0, (12, 0))) == (
        "hopper_only has no CUDA build for sm_120: it supports 9.0a only (this install has it for 9.0a); "
        "this install has generic's for sm_120")
    assert api.unavailable_reason("generic", SM90) == (
        "generic has no CUDA build for sm_90: it supports 8.0, 12.0 only (this install has it for 8.0, 12.0); "
        "this install has hopper_only's for sm_90")


def test_rule7_listed_arch_not_compiled(plugin_dir, api, record):
    why = "PRIME_KERNELS_ARCH=9.0a did not ask for a device it runs on"
    plugin_dir("pk-partial-build", archs=("9.0a", "10.0a"), record=record({"demo": (["9.0a"], {"10.0a": why})}))
    assert api.unavailable_reason("demo", SM100) == (
        f"demo supports sm_100 (10.0a) but this build of pk-partial-build did not compile it (10.0a: {why}; this "
        "install has it for 9.0a); rebuild it without PRIME_KERNELS_ARCH (every arch) or with PRIME_KERNELS_ARCH=10.0a")
    assert api.unavailable_reason("demo", SM90) is None


@pytest.mark.parametrize("device,capability", [("sm_120", (12, 0)), ("sm_90", (9, 0)), ((12, 0), (12, 0)),
                                               ("sm_86", (8, 6)), ("12.1", (12, 1)), ("sm_100a", (10, 0))])
def test_what_if_gating_takes_a_capability_and_skips_device_presence(plugin_dir, api, device, capability):
    plugin_dir("pk-whatif", archs=("8.0", "9.0a", "12.0"))
    assert api.unavailable_reason("demo", device) == api.unavailable_reason("demo", Target("cuda", 0, capability))
    assert api.is_available("demo", "sm_90") and api.is_available("demo", "sm_121") and api.is_available("demo", (8, 9))
    assert api.unavailable_reason("demo", "sm_100") == (
        "demo has no CUDA build for sm_100: it supports 8.0, 9.0a, 12.0 only (this install has it for 8.0, 9.0a, 12.0)")


@pytest.mark.parametrize("record_value,expected", [
    ({"kernels": {"demo": {"archs": [90]}}}, "lists archs [90] for demo, not a list of arch strings"),
    ({"archs": ["9.0a"], "kernels": None}, "has no per-kernel 'kernels' table"),
    ({"kernels": {}}, "has no entry for demo"),
    ([1, 2], "is not a JSON object (found list)"),
])
def test_malformed_build_records_are_sentences(plugin_dir, api, record, record_value, expected):
    value = dict(record(), **record_value) if isinstance(record_value, dict) else record_value
    plugin_dir(f"pk-badrecord-{abs(hash(expected))}", record=value)  # a package per case: sys.modules keeps each
    assert expected in api.unavailable_reason("demo", "cpu")
    assert expected in api.status("sm_90")["demo"]


@pytest.mark.parametrize("target", [Target("x"), Target("cuda", 0, None), Target("cuda", 0, (9,))])
def test_a_malformed_target_is_a_reason(plugin_dir, api, target):
    plugin_dir("pk-badtarget")
    assert api.unavailable_reason("demo", target).startswith(f"Target {target!r} is neither")


@pytest.mark.parametrize("arch,capability,runs", [
    ("9.0a", (9, 0), True), ("9.0a", (10, 0), False), ("10.0a", (10, 3), False), ("10.0f", (10, 3), True),
    ("8.0", (8, 6), True), ("8.0", (9, 0), False), ("12.0a", (12, 0), True), ("junk", (9, 0), False),
])
def test_arch_matching(arch, capability, runs):
    assert arch_runs_on(arch, capability) is runs


def test_rule8_import_failure_translated(plugin_dir, api):
    plugin_dir("pk-badso", import_error="/x/_C.so: undefined symbol: _ZN3c1017RegisterOperators")
    reason = api.unavailable_reason("demo", "cpu")
    assert "undefined symbol (_ZN3c1017RegisterOperators)" in reason and "rebuild it against this torch" in reason


def test_rule8_other_import_failure(plugin_dir, api):
    plugin_dir("pk-badimport", import_error="libfoo.so: cannot open shared object file")
    assert api.unavailable_reason("demo", "cpu") == (
        "importing pk_badimport.ops failed: ImportError: libfoo.so: cannot open shared object file")


def test_rule9_extra_check(plugin_dir, api):
    plugin_dir("pk-extra", hooks="""
        @hookimpl
        def prime_kernels_extra_check(kernel, device):
            return f"{kernel} needs 2 GPUs, found 1" if device.kind == "cuda" else None
    """)
    assert api.unavailable_reason("demo", SM90) == "demo needs 2 GPUs, found 1"
    assert api.unavailable_reason("demo", "cpu") is None


EXTRA_CHECK_ANSWERS = {"empty": "''", "blank": "'   '", "false": "False", "zero": "0", "true": "True", "list": "['2 GPUs']"}


@pytest.mark.parametrize("case", sorted(EXTRA_CHECK_ANSWERS))
def test_rule9_extra_check_answers_are_normalised(plugin_dir, api, case):
    answer, refused = EXTRA_CHECK_ANSWERS[case], case in ("true", "list")
    dist = f"pk-extra-{case}"  # a package per case: a hook module is imported once per process
    plugin_dir(dist, hooks=f"""
        @hookimpl
        def prime_kernels_extra_check(kernel, device):
            return {answer}
    """)
    expected = f"{dist}'s extra check refused demo without saying why (it returned {answer}, not a sentence)"
    assert api.unavailable_reason("demo", "cpu") == (expected if refused else None)
    assert api.status("cpu") == {"demo": expected if refused else "available"}


@pytest.mark.parametrize("where", ["plugin.py", "ops.py", "extra check"])
def test_sys_exit_in_plugin_code_is_a_reason(plugin_dir, api, tmp_path, where):
    dist = "pk-exits-in-" + where.replace(".", "-").replace(" ", "-")
    package = plugin_dir(dist, hooks="""
        @hookimpl
        def prime_kernels_extra_check(kernel, device):
            raise SystemExit("extra check exits")
    """ if where == "extra check" else "")
    if where != "extra check":
        (tmp_path / package / where).write_text("import sys\nsys.exit('module exits')\n")
    api.refresh()
    expected = {
        "plugin.py": f"plugin {dist} 0.1.0 failed to load: SystemExit: module exits",
        "ops.py": f"importing {package}.ops failed: SystemExit: module exits",
        "extra check": f"{dist}'s extra check raised SystemExit: extra check exits",
    }[where]
    assert api.status("cpu") == {"demo": expected}


def test_disabled_by_env(plugin_dir, api, monkeypatch):
    plugin_dir("pk-disabled")
    monkeypatch.setenv("PRIME_KERNELS_DISABLE", "other,demo")
    assert api.unavailable_reason("demo", "cpu") == "disabled by PRIME_KERNELS_DISABLE"
    with pytest.raises(api.KernelUnavailableError, match="disabled by PRIME_KERNELS_DISABLE"):
        api.load("demo", "cpu")


def test_allow_list_limits_discovery(plugin_dir, api, monkeypatch):
    plugin_dir("pk-a", kernel="ka")
    plugin_dir("pk-b", kernel="kb")
    monkeypatch.setenv("PRIME_KERNELS_PLUGINS", "pk-b")
    api.refresh()
    assert set(api.status("cpu")) == {"kb"}


@pytest.mark.parametrize("spelling", ["PK_B", " pk.b ", "Pk-B"])
def test_allow_list_is_compared_by_normalised_name(plugin_dir, api, monkeypatch, spelling):
    plugin_dir("pk-a", kernel="ka")
    plugin_dir("pk-b", kernel="kb")
    monkeypatch.setenv("PRIME_KERNELS_PLUGINS", spelling)
    api.refresh()
    assert set(api.status("cpu")) == {"kb"}


def test_empty_allow_list_is_unset(plugin_dir, api, monkeypatch):
    plugin_dir("pk-a", kernel="ka")
    plugin_dir("pk-b", kernel="kb")
    monkeypatch.setenv("PRIME_KERNELS_PLUGINS", " ")
    api.refresh()
    assert {"ka", "kb"} <= set(api.status("cpu"))


UNDECODABLE_METADATA = b"Metadata-Version: 2.1\nName: other\nVersion: 1.0\nSummary: caf\xe9\n"


@pytest.mark.parametrize("broken", ["METADATA", "entry_points.txt"])
def test_broken_unrelated_distribution_hides_no_plugin(plugin_dir, api, tmp_path, broken):
    plugin_dir("pk-good")
    info = tmp_path / "other-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(UNDECODABLE_METADATA if broken == "METADATA" else b"Name: other\nVersion: 1.0\n")
    if broken == "entry_points.txt":
        (info / "entry_points.txt").write_text("[console_scripts]\nno equals sign here\n")
    api.refresh()
    assert api.status("cpu") == {"demo": "available"}
    assert api.load("demo", "cpu").unsupported_shape_reason(16) is None


def test_plugin_with_unreadable_metadata_is_a_row(plugin_dir, api, tmp_path):
    package = plugin_dir("pk-latin")
    (tmp_path / f"{package}-0.1.0.dist-info" / "METADATA").write_bytes(UNDECODABLE_METADATA)
    api.refresh()
    reason = api.unavailable_reason("demo", "cpu")
    assert reason.startswith("plugin pk_latin 0.1.0 failed to load: its METADATA cannot be read: UnicodeDecodeError"), reason


def test_unresolvable_device_is_a_reason(plugin_dir, api):
    plugin_dir("pk-weird")
    device = object()
    assert api.status(device) == {"demo": api.unavailable_reason("demo", device)}
    assert "could not resolve device" in api.unavailable_reason("demo", device)
    assert api.unavailable_reason("demo", "meta") == "device type 'meta' is not supported; use a CUDA device or 'cpu'"


def test_spec_and_log_status(plugin_dir, api, caplog):
    import logging

    plugin_dir("pk-spec", version="0.3.0")
    spec = api.spec("demo")
    assert (spec.distribution, spec.version, spec.ops, spec.archs) == ("pk-spec", "0.3.0", ("op_a",), ("9.0a",))
    assert spec.build["kernels"]["demo"]["archs"] == ["9.0a"]
    with caplog.at_level(logging.INFO):
        api.log_status(logging.getLogger("trainer"), device="cpu")
    assert "prime-kernels: demo: available" in caplog.text


def test_declared_ops_the_import_did_not_register_are_a_reason(plugin_dir, api, tmp_path):
    package = plugin_dir("pk-undeclared", ops=("op_a", "op_b"))
    ops = tmp_path / package / "ops.py"
    ops.write_text(ops.read_text().replace("_library.define('op_b(Tensor x) -> Tensor')\n", ""))
    assert api.unavailable_reason("demo", "cpu") == (
        f"demo declares ops pk_test_{package}::op_b that importing {package}.ops did not register; its kernel.toml and "
        "its C++ disagree (rebuild, or fix the manifest)")


def test_a_namespace_the_build_record_says_is_registered_clashes_before_any_import(plugin_dir, api, record):
    """A squatter declares acme_squat but its _C registers fused_logp's namespace: neither is imported."""
    plugin_dir("pk-owner", kernel="owner", namespace="pk_test_owned")
    plugin_dir("pk-squatter", kernel="squatter", namespace="acme_squat",
               record=record({"squatter": ["9.0a"]}, registered_ops=["pk_test_owned::op_a"]))
    expected = ("namespace 'pk_test_owned' is claimed by both pk-owner 0.1.0 and pk-squatter 0.1.0; uninstall one of "
                "them (neither was imported)")
    assert api.unavailable_reason("squatter", "cpu") == expected
    assert api.unavailable_reason("owner", "cpu") == expected
    assert "pk_squatter.ops" not in sys.modules and "pk_owner.ops" not in sys.modules


def test_a_record_without_registered_ops_is_a_reason(plugin_dir, api, record):
    plugin_dir("pk-noregistered", record=record({"demo": ["9.0a"]}, registered_ops=None))
    assert "does not list the ops its _C registers" in api.unavailable_reason("demo", "cpu")


def test_hooks_without_the_hookimpl_marker_are_still_called(plugin_dir, api):
    plugin_dir("pk-unmarked", plugin_source=(
        "from prime_kernels_core import manifest\n\n"
        "def prime_kernels_declare():\n    return manifest.declare(__file__)\n"))
    assert api.unavailable_reason("demo", "cpu") is None


@pytest.mark.parametrize("source,expected", [
    ("class Odd(BaseException):\n    pass\n\nraise Odd('at import')\n", "failed to load: Odd: at import"),
    ("from prime_kernels_core import hookimpl\n\n@hookimpl\ndef prime_kernels_declare():\n    return ['fused_logp']\n",
     "returned 'fused_logp', not a KernelSpec"),
    ("import PACKAGE._C\n", "discovery imports only the entry point's module"),
])
def test_a_plugin_misbehaving_at_discovery_is_a_row_with_a_sentence(plugin_dir, api, tmp_path, source, expected):
    package = plugin_dir(f"pk-misbehaving-{abs(hash(expected))}", plugin_source=source)
    if "_C" in source:
        (tmp_path / package / "_C.cpython-311-x86_64-linux-gnu.so").write_text("not an ELF file")
    status = api.status("cpu")
    assert expected in status["demo"], status
    with pytest.raises(api.KernelUnavailableError, match="failed to load"):
        api.load("demo", "cpu")


def test_a_source_tree_ahead_of_the_installed_wheel_is_named(plugin_dir, api, tmp_path):
    package = plugin_dir("pk-sourcetree", record=None)
    (tmp_path / "setup.py").write_text("")
    reason = api.unavailable_reason("demo", "cpu")
    assert reason.endswith("is a source tree with no build, found ahead of any installed copy on sys.path (pytest run "
                           "from the plugin's own folder puts it first): run from another folder, or pip install -e it")
    assert str(tmp_path / package) in reason
