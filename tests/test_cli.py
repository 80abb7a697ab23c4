"""The status CLI through a real child process (python -m prime_kernels), over throwaway plugins."""
import json
import os
import subprocess
import sys

from prime_kernels_core.cli import format_table, rows


def _run(tmp_path, *args, allow="pk-cli-good,pk-cli-bad"):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), PRIME_KERNELS_PLUGINS=allow)
    return subprocess.run([sys.executable, "-m", "prime_kernels", *args], capture_output=True, text=True, env=env)


def _two_plugins(plugin_dir):
    plugin_dir("pk-cli-good", kernel="good")
    plugin_dir("pk-cli-bad", kernel="bad", import_error="libcuda.so.1: cannot open shared object file")


def test_table_and_json(plugin_dir, tmp_path):
    _two_plugins(plugin_dir)
    done = _run(tmp_path, "--device", "cpu")
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    assert header.split()[:3] == ["kernel", "distribution", "namespace"]
    good = next(line for line in lines if line.startswith("good"))
    assert "pk-cli-good 0.1.0" in good and "available" in good
    rows = {r["kernel"]: r for r in json.loads(_run(tmp_path, "--json", "--device", "cpu").stdout)}
    assert rows["good"]["state"] == "available" and rows["good"]["archs built"] == "9.0a"
    assert rows["bad"]["state"] == "unavailable"
    assert rows["bad"]["reason"].endswith("libcuda.so.1: cannot open shared object file")


def test_require_exit_codes(plugin_dir, tmp_path):
    _two_plugins(plugin_dir)
    assert _run(tmp_path, "--device", "cpu", "--require", "good").returncode == 0
    done = _run(tmp_path, "--device", "cpu", "--require", "good", "bad", "missing")
    assert done.returncode == 1
    assert "required kernel bad is unavailable: importing pk_cli_bad.ops failed" in done.stderr
    assert "required kernel missing is unavailable: not installed" in done.stderr


def test_probe_turns_a_crash_into_a_row(plugin_dir, tmp_path):
    plugin_dir("pk-cli-good", kernel="good", ops_source="import os\nos.abort()\n")
    done = _run(tmp_path, "--device", "cpu", "--probe", "--json", allow="pk-cli-good")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["state"] == "unavailable" and "crashed the child process (exit code -6)" in row["reason"]


def test_broken_unrelated_distribution_beside_a_good_plugin(plugin_dir, tmp_path):
    plugin_dir("pk-cli-good", kernel="good")
    info = tmp_path / "other-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: other\nVersion: 1.0\nSummary: caf\xe9\n")
    done = _run(tmp_path, "--device", "cpu", "--json", "--require", "good", allow="pk-cli-good")
    assert done.returncode == 0, done.stderr
    assert [(r["kernel"], r["state"]) for r in json.loads(done.stdout)] == [("good", "available")]


def test_failed_discovery_is_one_row(monkeypatch):
    from prime_kernels_core import registry

    def unreadable_site_packages():
        raise OSError("site-packages unreadable")

    monkeypatch.setattr(registry.importlib.metadata, "distributions", unreadable_site_packages)
    registry.refresh()
    try:
        expected = "plugin discovery failed: OSError: site-packages unreadable"
        assert registry.status("cpu") == {registry.DISCOVERY_KEY: expected}
        (row,) = rows("cpu")
        assert (row["kernel"], row["state"], row["reason"]) == (registry.DISCOVERY_KEY, "unavailable", expected)
    finally:
        monkeypatch.undo()
        registry.refresh()


def test_probe_parses_the_device_like_the_parent(plugin_dir, tmp_path):
    plugin_dir("pk-cli-good", kernel="good")
    for device in ([], ["--device", "0"], ["--device", "cpu"]):
        direct, probed = (json.loads(_run(tmp_path, "--json", *device, *probe, allow="pk-cli-good").stdout)
                          for probe in ([], ["--probe"]))
        assert probed == direct, device
    (row,) = probed
    assert row["state"] == "available"


def test_empty_table_has_a_hint():
    assert "No prime-kernels plugins are installed" in format_table([])
