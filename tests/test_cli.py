"""The status CLI through a real child process (python -m prime_kernels), over throwaway plugins."""
import json
import os
import subprocess
import sys

import pytest

from prime_kernels_core import cli, registry

ALLOW = "pk-cli-good,pk-cli-bad"
BAD_REASON = "libcuda.so.1: cannot open shared object file"


def _run(tmp_path, *args, allow=ALLOW, columns=80):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), PRIME_KERNELS_PLUGINS=allow,
               COLUMNS=str(columns))
    return subprocess.run([sys.executable, "-m", "prime_kernels", *args], capture_output=True, text=True, env=env)


def _two_plugins(plugin_dir):
    plugin_dir("pk-cli-good", kernel="good")
    plugin_dir("pk-cli-bad", kernel="bad", import_error=BAD_REASON)


def _kernels(done):
    assert done.returncode in (0, 1), done.stderr
    return {k["kernel"]: k for k in json.loads(done.stdout)["kernels"]}


def test_table_has_the_environment_and_both_devices(plugin_dir, tmp_path):
    _two_plugins(plugin_dir)
    done = _run(tmp_path, columns=200)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    import torch

    assert lines[0].startswith("prime-kernels") and f"torch {torch.__version__}" in lines[0]
    assert any(line.startswith(("driver", "nvcc", "GPU")) for line in lines[1:5])
    header = next(line for line in lines if line.startswith("kernel"))
    assert header.split()[:2] == ["kernel", "plugin"] and header.split()[-1] == "cpu" and "cuda" in header
    good = next(line for line in lines if line.startswith("good"))
    assert "pk-cli-good 0.1.0" in good and good.split()[-1] == "available"
    assert f"(torch {'.'.join(torch.__version__.split('.')[:2])})" in good  # the torch releases the build runs under
    assert any(BAD_REASON in line for line in lines)


@pytest.mark.parametrize("columns", [80, 120, 200])
def test_table_fits_the_terminal(plugin_dir, tmp_path, columns):
    long_reason = "a very long reason " * 20  # several lines' worth at any of these widths
    plugin_dir("pk-cli-good", kernel="good_kernel_with_a_long_name")
    plugin_dir("pk-cli-bad-with-a-long-distribution-name", kernel="bad", import_error=long_reason)
    done = _run(tmp_path, columns=columns, allow="pk-cli-good,pk-cli-bad-with-a-long-distribution-name")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    too_wide = [line for line in lines if len(line) > columns]
    assert not too_wide, too_wide
    assert " ".join(" ".join(lines).split()).count(" ".join(long_reason.split())) == 1  # wrapped, not cut


def test_a_reason_every_row_shares_is_printed_once(plugin_dir, tmp_path, monkeypatch):
    plugin_dir("pk-cli-good", kernel="good")
    plugin_dir("pk-cli-bad", kernel="bad")
    monkeypatch.setenv(registry.DISABLE_ENV, "good,bad")
    done = _run(tmp_path, "--device", "cpu", columns=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"disabled by {registry.DISABLE_ENV}") == 1, done.stdout
    assert done.stdout.splitlines()[-1] == f"every kernel is unavailable on cpu: disabled by {registry.DISABLE_ENV}"
    cells = [line.split() for line in done.stdout.splitlines() if line.startswith(("good", "bad"))]
    assert [c[-1] for c in cells] == ["unavailable"] * 2


def test_json_schema_version_1(plugin_dir, tmp_path):
    _two_plugins(plugin_dir)
    doc = json.loads(_run(tmp_path, "--json").stdout)
    assert doc["schema_version"] == 1 == cli.SCHEMA_VERSION
    assert set(doc) == {"schema_version", "environment", "cuda_target", "probed", "discovery_failure", "kernels"}
    assert set(doc["environment"]) == {
        "core_version", "python_version", "python_executable", "torch_version", "torch_cuda_version",
        "driver_version", "driver_reason", "nvcc_version", "nvcc_path", "cuda_home", "nvcc_reason", "gpus", "gpu_reason"}
    for gpu in doc["environment"]["gpus"]:
        assert set(gpu) == {"index", "name", "capability", "arch", "memory_gib"}
    assert (doc["environment"]["gpus"] == []) == (doc["environment"]["gpu_reason"] is not None)
    assert set(doc["cuda_target"]) == {"device", "arch", "what_if"} and doc["cuda_target"]["what_if"] is False
    assert doc["probed"] is False and doc["discovery_failure"] is None
    kernels = {k["kernel"]: k for k in doc["kernels"]}
    assert set(kernels) == {"good", "bad"}
    import torch

    good, bad = kernels["good"], kernels["bad"]
    assert set(good) == {
        "kernel", "distribution", "distribution_version", "namespace", "archs_listed", "archs_built",
        "built_torch_version", "built_torch_cuda_version", "torch_support", "language", "checked_in_child", "cuda",
        "cpu"}
    assert (good["distribution"], good["distribution_version"], good["namespace"]) == ("pk-cli-good", "0.1.0",
                                                                                       "pk_test_pk_cli_good")
    assert good["archs_listed"] == good["archs_built"] == ["9.0a"]
    assert (good["built_torch_version"], good["built_torch_cuda_version"]) == (torch.__version__, torch.version.cuda)
    assert good["torch_support"] == bad["torch_support"] == f"torch {'.'.join(torch.__version__.split('.')[:2])}"
    assert good["cpu"] == {"available": True, "reason": None, "note": None}
    assert set(good["cuda"]) == {"available", "reason", "note"} and good["language"] is None
    assert bad["cpu"]["available"] is False and bad["cpu"]["reason"].endswith(BAD_REASON)
    assert all(" " not in key for k in doc["kernels"] for key in k)


def test_json_with_device_cpu_has_no_cuda_column(plugin_dir, tmp_path):
    _two_plugins(plugin_dir)
    doc = json.loads(_run(tmp_path, "--json", "--device", "cpu").stdout)
    assert doc["cuda_target"] is None and all(k["cuda"] is None for k in doc["kernels"])


def test_what_if_arch_is_passed_to_the_registry(plugin_dir, monkeypatch):
    plugin_dir("pk-cli-what-if", kernel="good")  # in this process: a distribution name no other test imports
    asked = []
    monkeypatch.setattr(registry, "unavailable_reason", lambda name, device=None: asked.append(device))
    doc = cli.report(arch="sm_100")
    assert asked == ["sm_100", "cpu"]
    assert doc["cuda_target"] == {"device": None, "arch": "sm_100", "what_if": True}


def test_exit_codes(plugin_dir, tmp_path):
    _two_plugins(plugin_dir)
    assert _run(tmp_path, "--device", "cpu", "--require", "good").returncode == 0
    done = _run(tmp_path, "--device", "cpu", "--require", "good", "bad", "missing")
    assert done.returncode == 1
    assert "required kernel bad is unavailable on cpu: importing pk_cli_bad.ops failed" in done.stderr
    assert "required kernel missing is unavailable on cpu: no installed plugin declares a kernel named" in done.stderr
    version = _run(tmp_path, "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"prime-kernels {cli.__version__}")
    for bad_args in (["--device", "garbage"], ["--device", "cuda:x"], ["--arch", "hopper"], ["--arch", "90"],
                     ["--device", "0", "--arch", "sm_90"], ["--frobnicate"], ["nonsense"]):
        done = _run(tmp_path, *bad_args)
        assert done.returncode == 2, (bad_args, done.stdout, done.stderr)
        assert done.stdout == "" and len(done.stderr.splitlines()) == 1, (bad_args, done.stderr)
        assert done.stderr.startswith("prime-kernels: error:"), done.stderr
    assert "'garbage' is not a device" in _run(tmp_path, "--device", "garbage").stderr


def test_require_suggests_the_closest_name(plugin_dir, tmp_path):
    plugin_dir("pk-cli-good", kernel="fused_logp")
    done = _run(tmp_path, "--device", "cpu", "--require", "fused-logp", allow="pk-cli-good")
    assert done.returncode == 1
    assert "no installed plugin declares a kernel named 'fused-logp'; did you mean 'fused_logp'?" in done.stderr


def test_load_names_the_kernel_and_suggests_the_cpu(plugin_dir, api):
    # in this process: a distribution name no other test imports; an arch no GPU of this project's machines has
    plugin_dir("pk-cli-load", kernel="fused_logp", archs=("12.1a",))
    with pytest.raises(api.KernelUnavailableError) as raised:
        api.load("fused_logp")
    reason = api.unavailable_reason("fused_logp")
    assert str(raised.value) == (
        f"cannot load fused_logp on the current CUDA device: {reason}; its CPU implementation can run: "
        'prime_kernels.load("fused_logp", device="cpu")')
    assert api.load("fused_logp", device="cpu") is not None
    with pytest.raises(api.KernelUnavailableError, match="did you mean 'fused_logp'"):
        api.load("fused-logp", device="cpu")


def test_probe_turns_a_crash_into_a_row_and_says_so(plugin_dir, tmp_path):
    plugin_dir("pk-cli-good", kernel="good", ops_source="import os\nos.abort()\n")
    done = _run(tmp_path, "--device", "cpu", "--probe", "--json", allow="pk-cli-good")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    (row,) = doc["kernels"]
    assert doc["probed"] is True and row["checked_in_child"] is True
    assert row["cpu"]["available"] is False and "crashed the child process (exit code -6)" in row["cpu"]["reason"]
    text = _run(tmp_path, "--device", "cpu", "--probe", allow="pk-cli-good").stdout
    assert "checked in a child process of its own (--probe): good; the child crashed for good." in " ".join(
        text.split())
    assert "child process" not in _run(tmp_path, "--device", "cpu", allow="pk-cli-good").stdout


def test_broken_unrelated_distribution_beside_a_good_plugin(plugin_dir, tmp_path):
    plugin_dir("pk-cli-good", kernel="good")
    info = tmp_path / "other-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: other\nVersion: 1.0\nSummary: caf\xe9\n")
    done = _run(tmp_path, "--device", "cpu", "--json", "--require", "good", allow="pk-cli-good")
    assert done.returncode == 0, done.stderr
    assert [(k["kernel"], k["cpu"]["available"]) for k in json.loads(done.stdout)["kernels"]] == [("good", True)]


def test_failed_discovery_is_one_line(monkeypatch):
    def unreadable_site_packages():
        raise OSError("site-packages unreadable")

    monkeypatch.setattr(registry.importlib.metadata, "distributions", unreadable_site_packages)
    registry.refresh()
    try:
        expected = "plugin discovery failed: OSError: site-packages unreadable"
        assert registry.status("cpu") == {registry.DISCOVERY_KEY: expected}
        doc = cli.report("cpu")
        assert (doc["discovery_failure"], doc["kernels"]) == (expected, [])
        assert cli.format_report(doc, 80).splitlines()[-1] == expected
    finally:
        monkeypatch.undo()
        registry.refresh()


def test_probe_gives_the_same_answers_as_the_parent(plugin_dir, tmp_path):
    plugin_dir("pk-cli-good", kernel="good")
    for device in ([], ["--device", "0"], ["--device", "cpu"], ["--arch", "sm_90"]):
        direct, probed = (json.loads(_run(tmp_path, "--json", *device, *probe, allow="pk-cli-good").stdout)["kernels"]
                          for probe in ([], ["--probe"]))
        strip = lambda rows: [{k: v for k, v in row.items() if k != "checked_in_child"} for row in rows]
        assert strip(probed) == strip(direct), device
    (row,) = probed
    assert row["cpu"]["available"] is True


def test_empty_table_has_a_hint(monkeypatch):
    monkeypatch.setenv(registry.ALLOW_ENV, "no-such-plugin-anywhere")
    registry.refresh()
    try:
        assert cli.NO_PLUGINS_HINT.split(".")[0] in cli.format_report(cli.report(), 80)
    finally:
        monkeypatch.undo()
        registry.refresh()


def test_arch_table_and_require_answer_for_a_gpu_that_is_not_here(plugin_dir, tmp_path):
    """A login node checking a wheel for the cluster's GPUs: --arch sm_100 / sm_120 against kernels built for 8.0 and
    12.0 (generic) and for 9.0a only."""
    plugin_dir("pk-cli-generic", kernel="generic", archs=("8.0", "12.0"))
    plugin_dir("pk-cli-hopper", kernel="hopper", archs=("9.0a",))
    allow = "pk-cli-generic,pk-cli-hopper"
    doc = json.loads(_run(tmp_path, "--json", "--arch", "sm_120", allow=allow).stdout)
    state = {k["kernel"]: k["cuda"] for k in doc["kernels"]}
    assert state["generic"] == {"available": True, "reason": None, "note": None}
    assert state["hopper"]["reason"] == ("hopper has no CUDA build for sm_120: it supports 9.0a only (this install has "
                                         "it for 9.0a)")
    assert _run(tmp_path, "--require", "generic", "--arch", "sm_121", allow=allow).returncode == 0
    assert _run(tmp_path, "--require", "hopper", "--arch", "sm_90", allow=allow).returncode == 0
    done = _run(tmp_path, "--require", "hopper", "--arch", "sm_100", allow=allow)
    assert done.returncode == 1 and "hopper has no CUDA build for sm_100" in done.stderr
    text = _run(tmp_path, "--arch", "sm_100", allow=allow, columns=120).stdout
    assert "sm_100" in text and all(len(line) <= 120 for line in text.splitlines())


def test_repeated_require_flags_add_up(plugin_dir, capsys):
    """A launch script that passes one --require per kernel requires every one of them (issue 61, item 1)."""
    plugin_dir("pk-cli-repeat", kernel="good")  # in this process: a distribution name no other test imports
    assert cli.main(["--device", "cpu", "--require", "nope_kernel", "--require", "good"]) == 1
    assert "required kernel nope_kernel is unavailable on cpu" in capsys.readouterr().err
    assert cli.main(["--device", "cpu", "--require", "good", "--require", "nope_kernel", "other"]) == 1
    assert capsys.readouterr().err.count("is unavailable on cpu") == 2
    assert cli.main(["--device", "cpu", "--require", "good", "--require", "good"]) == 0


@pytest.mark.parametrize("flag, first, second", [("--device", "cpu", "0"), ("--arch", "sm_90", "sm_100")])
def test_a_single_valued_flag_given_twice_is_a_usage_error(flag, first, second, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.parser().parse_args([flag, first, flag, second])
    assert exited.value.code == 2
    assert f"{flag} was given twice ({first} and {second}); give it once" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--arch", "sm_9"], ["--arch", "sm_٩٠"], ["--device", "cuda:٩"], ["--device", "٠"]])
def test_an_arch_or_device_torch_cannot_parse_is_a_usage_error(args, capsys):
    """Not "Invalid device string" in every row (issue 61, items 7 and 8): one digit, or non-ASCII digits."""
    with pytest.raises(SystemExit) as exited:
        cli.parser().parse_args(args)
    assert exited.value.code == 2
    assert f"{args[1]!r} is not a{'n arch' if args[0] == '--arch' else ' device'}" in capsys.readouterr().err


def test_json_is_the_only_thing_on_stdout_when_a_plugin_prints(plugin_dir, tmp_path):
    """A plugin that prints at import, from Python and straight to file descriptor 1 (as C code would), does not break
    --json (issue 61, item 6): its output goes to stderr."""
    plugin_dir("pk-cli-chatty", kernel="chatty", ops_source=(
        "import os\nprint('hello from python')\nos.write(1, b'hello from fd 1\\n')\n"
        "def unsupported_shape_reason(n):\n    return None\n"))
    done = _run(tmp_path, "--json", "--device", "cpu", allow="pk-cli-chatty")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["kernels"]
    assert row["kernel"] == "chatty"
    assert "hello from python" in done.stderr and "hello from fd 1" in done.stderr


def test_a_non_ascii_reason_under_an_ascii_stdout_is_escaped(plugin_dir, tmp_path):
    """PYTHONIOENCODING=ascii and a reason naming a non-ASCII path: the report, not a UnicodeEncodeError (issue 61,
    item 7)."""
    plugin_dir("pk-cli-ascii", kernel="good", import_error="/home/josé/libcuda.so.1: cannot open shared object file")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), PRIME_KERNELS_PLUGINS="pk-cli-ascii",
               PYTHONIOENCODING="ascii")
    done = subprocess.run([sys.executable, "-m", "prime_kernels", "--device", "cpu"], capture_output=True, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"/home/jos\\xe9/libcuda.so.1" in done.stdout and b"Traceback" not in done.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_on_a_full_device_is_one_line_and_exit_3(plugin_dir, tmp_path):
    plugin_dir("pk-cli-full", kernel="good")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), PRIME_KERNELS_PLUGINS="pk-cli-full")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "prime_kernels", "--device", "cpu"], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=env)
    assert done.returncode == cli.UNWRITTEN_EXIT == 3, done.stderr
    assert done.stderr == "prime-kernels: error: the report could not be written to stdout: No space left on device\n"


@pytest.mark.parametrize("where", ["a file", "unwritable"])
def test_release_with_a_wheelhouse_it_cannot_use_is_one_line(tmp_path, where):
    wheelhouse = tmp_path / "wheelhouse"
    if where == "a file":
        wheelhouse.write_text("")
    else:
        (wheelhouse / "logs").mkdir(parents=True)
        (wheelhouse / "logs").chmod(0o500)
        if os.access(wheelhouse / "logs", os.W_OK):
            pytest.skip("this user writes to read-only folders (root)")
    done = subprocess.run([sys.executable, "-m", "prime_kernels_core.release", "--wheelhouse", str(wheelhouse),
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"python -m prime_kernels_core.release: error: --wheelhouse {wheelhouse} cannot hold "
                                  "the wheels and their logs: "), done.stderr


def test_the_nvcc_line_is_the_build_kits_toolkit(tmp_path, monkeypatch):
    """A wrapper nvcc on PATH outside the toolkit: the CLI reported it as what builds would use while the build kit
    skipped CUDA (issue 61, item 11); both now give the build kit's answer, naming the CUDA_HOME."""
    from prime_kernels_core import build

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    (tmp_path / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setattr(build, "detect_toolchain", lambda: build.Toolchain("2.14.1", "13.0", str(tmp_path), None))
    env = cli.environment()
    assert env["nvcc_version"] is None and env["cuda_home"] == str(tmp_path)
    assert env["nvcc_reason"] == build.no_toolkit_reason(str(tmp_path)) and "include/cuda_runtime.h" in env["nvcc_reason"]
    monkeypatch.setattr(build, "detect_toolchain", lambda: build.Toolchain("2.14.1", "13.0", "/usr/local/cuda", "13.0"))
    lines = cli._environment_lines(cli.environment(), 120)
    assert any(line.startswith("nvcc") and "13.0 (CUDA_HOME /usr/local/cuda, as plugin builds use it)" in line
               for line in lines), lines
