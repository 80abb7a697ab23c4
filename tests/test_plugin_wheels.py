"""The installed plugins as CI builds them: wheel contents, a real CPU-only build, and a clash between two copies."""
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import zipfile
from pathlib import Path

import pytest

import prime_kernels
from prime_kernels_core.build import ARCH_ENV

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "third_party_plugin"
WHEELHOUSE = os.environ.get("PRIME_KERNELS_WHEELHOUSE")


def _installed_wheels(wheelhouse: Path) -> list[Path]:
    """The wheels from ``wheelhouse`` that are installed now, as pip recorded them (direct_url.json): scripts/setup.sh
    leaves the builds of earlier sources in the wheelhouse, and those are not what runs."""
    wheels = []
    for dist in importlib.metadata.distributions():
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        if url.startswith("file:") and path.suffix == ".whl" and path.parent.parent == wheelhouse.resolve():
            wheels.append(path)
    return sorted(wheels)


WHEELS = _installed_wheels(Path(ROOT, WHEELHOUSE)) if WHEELHOUSE else []


@pytest.mark.skipif(not WHEELHOUSE, reason="PRIME_KERNELS_WHEELHOUSE is unset (scripts/test.sh sets it)")
def test_every_plugin_has_a_wheel():
    built = {w.parent.name.rsplit("-", 1)[0] for w in WHEELS}
    expected = {p.parent.name for p in [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]}
    assert built >= expected, f"no wheel from {WHEELHOUSE} is installed for {sorted(expected - built)}"


@pytest.mark.parametrize("wheel", WHEELS, ids=lambda w: w.name)
def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    package = next(n.split("/")[0] for n in names if n.endswith("/kernel.toml"))
    for required in ("__init__.py", "plugin.py", "ops.py", "kernel.toml", "_build_record.json"):
        assert f"{package}/{required}" in names, f"{wheel.name} lacks {package}/{required}"
    if json.loads(zipfile.ZipFile(wheel).read(f"{package}/_build_record.json")).get("jit"):
        from prime_kernels_core.release import check_plugin_wheel

        assert check_plugin_wheel(wheel) == [], f"{wheel.name}: the shipped code of a JIT plugin"
        return
    assert any(n.startswith(f"{package}/_C") and n.endswith(".so") for n in names), f"{wheel.name} lacks _C"
    assert not any("csrc/" in n for n in names), f"{wheel.name} ships its csrc/ build input"
    record = json.loads(zipfile.ZipFile(wheel).read(f"{package}/_build_record.json"))
    tag = "cu" + record["torch_cuda"].replace(".", "") if not record["cuda_skipped"] else "cpu"
    assert f"+{tag}torch" in wheel.name, f"{wheel.name} does not carry its ABI ({tag})"


def _build_example(tmp_path, *command, **env):
    """Runs ``command`` (default: build a wheel into tmp_path/out) in a fresh copy of the example; returns the run."""
    source = tmp_path / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.so", "_build_record.json", "tests"))
    # An arch override (scripts/test.sh is often run with PRIME_KERNELS_ARCH=native) would skip CUDA for its own reason.
    inherited = {k: v for k, v in os.environ.items() if k != ARCH_ENV}
    command = command or ("-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "out"), ".")
    return subprocess.run(
        [sys.executable, *command], cwd=source, capture_output=True, text=True, env=dict(inherited, **env),
    )


SKIP = "prime-kernels: skipping CUDA for pk_example_rmsnorm: no CUDA toolkit was found: /nonexistent (CUDA_HOME) has no bin/nvcc and no include/cuda_runtime.h; set CUDA_HOME to the toolkit's folder (e.g. /usr/local/cuda)"


def test_missing_nvcc_fails_the_build_under_require(tmp_path):
    done = _build_example(tmp_path, CUDA_HOME="/nonexistent", PRIME_KERNELS_REQUIRE="1")
    assert done.returncode != 0
    assert f"{SKIP} (PRIME_KERNELS_REQUIRE=1 makes this an error)" in done.stdout + done.stderr


def test_missing_nvcc_skips_cuda_and_status_says_why(tmp_path):
    done = _build_example(tmp_path, CUDA_HOME="/nonexistent")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert SKIP in done.stdout + done.stderr
    assert "prime-kernels: pk_example_rmsnorm: residual_rmsnorm runs on no GPU (no CUDA code: its CPU implementation " \
           "only)" in done.stdout + done.stderr
    (wheel,) = (tmp_path / "out").glob("*.whl")
    assert "+cputorch" in wheel.name
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]), PRIME_KERNELS_PLUGINS="pk-example-rmsnorm")
    (row,) = json.loads(subprocess.run([sys.executable, "-m", "prime_kernels", "--json", "--device", "cuda:0"],
                                       capture_output=True, text=True, env=env, check=True).stdout)["kernels"]
    assert row["cpu"] == {"available": True, "reason": None, "note": None}
    assert row["cuda"]["reason"] == "residual_rmsnorm was built without CUDA: no CUDA toolkit was found: /nonexistent (CUDA_HOME) has no bin/nvcc and no include/cuda_runtime.h; set CUDA_HOME to the toolkit's folder (e.g. /usr/local/cuda)"


def test_in_place_build_records_beside_the_in_place_extension(tmp_path):
    """An editable install (pip install -e) builds in place and imports the package from the source tree."""
    done = _build_example(tmp_path, "setup.py", "build_ext", "--inplace", CUDA_HOME="/nonexistent")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    package = tmp_path / "src" / "pk_example_rmsnorm"
    assert list(package.glob("_C*.so")), "the in-place build wrote no _C"
    record = json.loads((package / "_build_record.json").read_text())
    assert SKIP.endswith(record["cuda_skipped"])


def test_second_copy_of_a_namespace_is_a_clash_not_an_abort(tmp_path, monkeypatch):
    import pk_example_rmsnorm

    installed = Path(pk_example_rmsnorm.__file__).parent
    shutil.copytree(installed, tmp_path / "pk_example_fork", ignore=shutil.ignore_patterns("__pycache__"))
    info = tmp_path / "pk_example_fork-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pk-example-fork\nVersion: 9.9.9\n")
    (info / "entry_points.txt").write_text("[prime_kernels]\nresidual_rmsnorm = pk_example_fork.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PRIME_KERNELS_PLUGINS", "pk-example-rmsnorm,pk-example-fork")
    prime_kernels.refresh()
    try:
        reason = prime_kernels.status("cpu")["residual_rmsnorm"]
        assert "namespace 'pk_example' is claimed by both pk-example-fork 9.9.9 and pk-example-rmsnorm" in reason or \
            "kernel name 'residual_rmsnorm' is claimed by both pk-example-fork 9.9.9 and pk-example-rmsnorm" in reason
        assert not {"pk_example_fork._C", "pk_example_fork._C_stable"} & set(sys.modules)
    finally:
        prime_kernels.refresh()


GENERIC_DEVICES = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121")


def _default_build(name):
    """The installed kernel's spec, skipping unless it comes from a default (fat) build."""
    reason = prime_kernels.unavailable_reason(name, "cpu")
    if reason is not None and "no installed plugin" in reason:
        pytest.skip(f"{name} is not installed")
    spec = prime_kernels.spec(name)
    if (spec.build or {}).get("arch_request", "").startswith(ARCH_ENV):
        pytest.skip(f"{name} was built for {spec.build['arch_request']}, not the default every-arch build")
    return spec


def test_default_install_runs_fused_logp_on_every_generation_from_sm80():
    _default_build("fused_logp")
    for device in GENERIC_DEVICES:
        assert prime_kernels.unavailable_reason("fused_logp", device) is None, device
    assert prime_kernels.unavailable_reason("fused_logp", "sm_75") == (
        "fused_logp has no CUDA build for sm_75: it supports 8.0, 8.6, 8.9, 9.0, 10.0, 11.0, 12.0 only (this install "
        "has it for 8.0, 8.6, 8.9, 9.0, 10.0, 11.0, 12.0)")


@pytest.mark.parametrize("name", ["linear_logp", "flash_moe"])
def test_default_install_runs_the_hopper_kernels_on_sm90_only(name):
    spec = _default_build(name)
    assert prime_kernels.unavailable_reason(name, "sm_90") is None
    for device in set(GENERIC_DEVICES) - {"sm_90"}:
        reason = prime_kernels.unavailable_reason(name, device)
        assert reason.startswith(f"{name} has no CUDA build for {device}: it supports 9.0a only (this install has it "
                                 "for 9.0a)"), reason
        if spec.distribution == prime_kernels.spec("fused_logp").distribution:
            assert reason.endswith(f"; this install has fused_logp's for {device}"), reason


def test_a_build_whose_c_plus_plus_registers_another_namespace_is_refused(tmp_path):
    """The abort case of issue 22: kernel.toml says acme_squat, the C++ registers pk_example. The build kit loads the
    built _C in a child process, compares, and refuses, naming both; an honest build records what _C registers."""
    source = tmp_path / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.so", "_build_record.json", "tests"))
    manifest = source / "pk_example_rmsnorm" / "kernel.toml"
    manifest.write_text(manifest.read_text().replace('namespace = "pk_example"', 'namespace = "acme_squat"'))
    inherited = {k: v for k, v in os.environ.items() if k != ARCH_ENV}
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=source, capture_output=True,
                          text=True, env=dict(inherited, CUDA_HOME="/nonexistent"))
    assert done.returncode != 0
    assert ("pk_example_rmsnorm._C_stable does not register what kernel.toml declares: its C++ registers namespaces "
            "['pk_example'] and kernel.toml declares ['acme_squat']; declared but not registered: "
            "['acme_squat::residual_rmsnorm']; registered but not declared: ['pk_example::residual_rmsnorm']"
            ) in done.stdout + done.stderr
    assert not (source / "pk_example_rmsnorm" / "_build_record.json").exists()


def test_a_failed_compile_ends_with_the_compilers_first_errors(tmp_path):
    """Issue 61, item 13: a C++ error in a stable-ABI kernel's source ends the build's output with the compiler's
    first error lines, the kernel and source, and the porting table for the unstable header it includes."""
    source = tmp_path / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.so", "_build_record.json", "tests"))
    cpp = source / "csrc" / "residual_rmsnorm.cpp"
    cpp.write_text("#include <ATen/ATen.h>\n" + cpp.read_text() + "\nthis is not C++;\n")
    inherited = {k: v for k, v in os.environ.items() if k != ARCH_ENV}
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=source, capture_output=True,
                          text=True, env=dict(inherited, CUDA_HOME="/nonexistent"))
    assert done.returncode != 0
    tail = "\n".join(done.stderr.strip().splitlines()[-12:])
    assert "prime-kernels: compiling failed in kernel residual_rmsnorm's csrc/residual_rmsnorm.cpp; the compiler's " \
           "first errors:" in tail, tail
    assert "residual_rmsnorm.cpp:" in tail and "error" in tail
    assert tail.endswith("includes ATen/ATen.h, outside the stable API: docs/writing-a-plugin.md section 9 has the "
                         "porting table"), tail


def test_the_build_record_lists_what_c_registers():
    spec = prime_kernels.spec("residual_rmsnorm")
    assert spec.build["registered_ops"] == ["pk_example::residual_rmsnorm"]
