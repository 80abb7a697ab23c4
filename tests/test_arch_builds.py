"""Real builds of tests/arch_variants_plugin (one kernel: a generic CUDA source set and a 9.0a variant): the release
script's fat wheel, a build for requested devices, and what each install would run on, read from the wheels."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from prime_kernels_core import build, release
from prime_kernels_core.build import ARCH_ENV, KERNELS_ENV, REQUIRE_ENV

PLUGIN = Path(__file__).resolve().parent / "arch_variants_plugin"
ENV = {k: v for k, v in os.environ.items() if k not in (ARCH_ENV, KERNELS_ENV, REQUIRE_ENV)}
TOOLCHAIN_SKIP = build.toolchain_skip_reason(build.detect_toolchain())
pytestmark = pytest.mark.skipif(TOOLCHAIN_SKIP is not None, reason=f"these builds need CUDA: {TOOLCHAIN_SKIP}")


def _copy(tmp_path) -> Path:
    source = tmp_path / "src"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.so", "_build_record.json", "*.egg-info"))
    return source


def _functions_per_arch(wheel: Path, tmp_path: Path) -> dict[str, set[str]]:
    with zipfile.ZipFile(wheel) as archive:
        (extension,) = [n for n in archive.namelist() if n.endswith(".so")]
        shared_object = archive.extract(extension, tmp_path / "unpacked")
    tool = release._cuobjdump()
    out = {}
    for arch in release.cubins_per_arch(Path(shared_object)):
        sass = subprocess.run([tool, "-sass", "-arch", arch, shared_object], capture_output=True, text=True).stdout
        out[arch] = {line.split(":")[1].strip() for line in sass.splitlines() if "Function :" in line}
    return out


def _gating(wheel: Path, tmp_path: Path, *devices) -> dict:
    """unavailable_reason of arch_variants for each device, in a child process with only this wheel installed."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], check=True)
    script = (
        "import json, sys, torch, prime_kernels; "
        "devices = [tuple(d) if isinstance(d, list) else d for d in json.loads(sys.argv[1])]; "
        "out = {str(d): prime_kernels.unavailable_reason('arch_variants', d) for d in devices}; "
        "ops = prime_kernels.load('arch_variants', 'cpu'); x = torch.randn(1000); "
        "out['cpu_op_ok'] = bool(torch.equal(ops.scale(x, 3.0), x * 3.0)); print(json.dumps(out))"
    )
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(site), *sys.path]), PRIME_KERNELS_PLUGINS="pk-arch-variants")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(devices)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("release")
    wheelhouse = tmp_path / "wheelhouse"
    done = subprocess.run([sys.executable, "-m", "prime_kernels_core.release", "--wheelhouse", str(wheelhouse),
                           str(_copy(tmp_path))], capture_output=True, text=True, env=ENV)
    return done, wheelhouse, tmp_path


def test_release_builds_checks_and_prints_pins(released):
    done, wheelhouse, _ = released
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (wheel,) = wheelhouse.glob("*.whl")
    assert "checks passed" in done.stderr
    version = wheel.name.split("-")[1]
    assert f'pip install --find-links {wheelhouse} "pk-arch-variants=={version}"' in done.stdout
    assert f'pk-arch-variants = {{ path = "{wheel}" }}' in done.stdout
    record = json.loads(zipfile.ZipFile(wheel).read("pk_arch_variants/_build_record.json"))
    assert record["kernels"]["arch_variants"] == {"archs": ["8.0", "9.0a", "12.0"], "not_built": {}}


def test_each_source_set_is_compiled_for_its_own_archs_only(released):
    _, wheelhouse, tmp_path = released
    (wheel,) = wheelhouse.glob("*.whl")
    generic, hopper = {"_Z20scale_generic_kernelPfPKffl"}, {"_Z18scale_sm90a_kernelPfPKffl"}
    assert _functions_per_arch(wheel, tmp_path) == {"sm_80": generic, "sm_90a": hopper, "sm_120": generic}


def test_what_if_gating_of_the_fat_wheel(released):
    _, wheelhouse, tmp_path = released
    (wheel,) = wheelhouse.glob("*.whl")
    found = _gating(wheel, tmp_path, "sm_80", "sm_86", "sm_89", "sm_90", "sm_120", [12, 1], "sm_100", "sm_75", "cpu")
    assert found.pop("cpu_op_ok") is True
    runs = {d for d, reason in found.items() if reason is None}
    assert runs == {"sm_80", "sm_86", "sm_89", "sm_90", "sm_120", "(12, 1)", "cpu"}
    assert found["sm_100"] == ("arch_variants has no CUDA build for sm_100: it supports 8.0, 9.0a, 12.0 only "
                               "(this install has it for 8.0, 9.0a, 12.0)")


def test_the_release_check_catches_a_wheel_that_lacks_an_arch(released, tmp_path):
    _, wheelhouse, _ = released
    (wheel,) = wheelhouse.glob("*.whl")
    forged = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(forged, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("kernel.toml"):
                data = data.replace(b'archs = ["8.0", "9.0a", "12.0"]', b'archs = ["8.0", "9.0a", "10.0", "12.0"]')
            dst.writestr(item, data)
    problems = release.check_plugin_wheel(forged)
    assert any("arch_variants was compiled for ['8.0', '9.0a', '12.0'], its manifest lists" in p for p in problems)
    assert any("'sm_100': 1" in p and "holds cubins" in p for p in problems)


def test_requested_devices_give_each_source_set_its_best_arch_or_nothing(tmp_path):
    """PRIME_KERNELS_ARCH names devices: 8.6 gets the generic set's 8.0 code, 12.0a its 12.0 code, and the 9.0a
    variant, which serves neither, is not compiled (without failing the build, even under PRIME_KERNELS_REQUIRE=1)."""
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "out"),
                           str(_copy(tmp_path))], capture_output=True, text=True,
                          env=dict(ENV, **{ARCH_ENV: "8.6;12.0a", REQUIRE_ENV: "1"}))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (wheel,) = (tmp_path / "out").glob("*.whl")
    record = json.loads(zipfile.ZipFile(wheel).read("pk_arch_variants/_build_record.json"))
    assert record["kernels"]["arch_variants"] == {"archs": ["8.0", "12.0"], "not_built": {
        "9.0a": "PRIME_KERNELS_ARCH=8.6;12.0a did not ask for a device it runs on"}}
    assert _functions_per_arch(wheel, tmp_path) == {
        "sm_80": {"_Z20scale_generic_kernelPfPKffl"}, "sm_120": {"_Z20scale_generic_kernelPfPKffl"}}
    found = _gating(wheel, tmp_path, "sm_86", "sm_90")
    assert found["sm_86"] is None
    assert found["sm_90"] == (
        "arch_variants supports sm_90 (9.0a) but this build of pk-arch-variants did not compile it (9.0a: "
        "PRIME_KERNELS_ARCH=8.6;12.0a did not ask for a device it runs on; this install has it for 8.0, 12.0); "
        "rebuild it without PRIME_KERNELS_ARCH (every arch) or with PRIME_KERNELS_ARCH=9.0a")
