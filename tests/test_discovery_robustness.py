"""Discovery survives whatever one installed distribution gets wrong: each mistake is one row naming the distribution
and what it got wrong, and every other kernel stays available (issue 61, item 5)."""
import pytest

from prime_kernels_core import cli


def _dist_info(tmp_path, name, entry_points=None, metadata=True):
    info = tmp_path / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    if metadata:
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)
    return info


def _good_kernel_stays(api):
    assert api.unavailable_reason("demo", "cpu") is None
    assert api.load("demo", "cpu").unsupported_shape_reason(16) is None


def test_a_malformed_entry_point_value_is_a_row(plugin_dir, api, tmp_path, monkeypatch):
    plugin_dir("pk-beside-weird")
    _dist_info(tmp_path, "pk-weird-ep", "[prime_kernels]\nweird = this is not a module path!!\n")
    monkeypatch.setenv("PRIME_KERNELS_PLUGINS", "pk-beside-weird,pk-weird-ep")
    api.refresh()
    status = api.status("cpu")
    assert set(status) == {"demo", "weird"}, status
    assert status["weird"] == ("plugin pk-weird-ep 1.0 failed to load: its prime_kernels entry point 'weird' has the "
                               "value 'this is not a module path!!', which is no module path (package.module or "
                               "package.module:object)"), status
    _good_kernel_stays(api)


@pytest.mark.parametrize("index, returned, expected", [
    (0, "5", "its prime_kernels_declare hook returned 5, not a list of KernelSpecs"),
    (1, "None", "its prime_kernels_declare hook returned None, not a list of KernelSpecs"),
    (2, "[dataclasses.replace(s, name=5) for s in manifest.declare(__file__)]",
     "its prime_kernels_declare hook returned a KernelSpec whose name is 5, not a string"),
    (3, "[dataclasses.replace(s, archs=[9.0]) for s in manifest.declare(__file__)]",
     "its prime_kernels_declare hook returned a KernelSpec whose archs is [9.0], not a tuple of strings"),
])
def test_a_hook_returning_no_kernelspecs_is_a_row(plugin_dir, api, tmp_path, index, returned, expected):
    plugin_dir("pk-good-beside")
    plugin_dir(f"pk-odd-{index}", kernel="odd", plugin_source=(
        "import dataclasses\nfrom prime_kernels_core import hookimpl, manifest\n\n"
        f"@hookimpl\ndef prime_kernels_declare():\n    return {returned}\n"))
    status = api.status("cpu")
    assert set(status) == {"demo", "odd"}, status
    assert expected in status["odd"], status
    _good_kernel_stays(api)
    text = cli.format_report(cli.report("cpu"), 80)  # the table renders it, no TypeError
    assert "odd" in text and "demo" in text


def test_a_dist_info_without_metadata_is_a_row(plugin_dir, api, tmp_path):
    plugin_dir("pk-good-meta")
    package = plugin_dir("pk-no-metadata", kernel="nometa")
    (tmp_path / f"{package}-0.1.0.dist-info" / "METADATA").unlink()
    api.refresh()
    status = api.status("cpu")
    assert set(status) == {"demo", "nometa"}, status
    assert status["nometa"].startswith("plugin pk_no_metadata 0.1.0 failed to load: its dist-info folder "), status
    assert "has no METADATA" in status["nometa"], status
    _good_kernel_stays(api)
