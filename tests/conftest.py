"""Throwaway plugin distributions: a real ``*.dist-info`` with ``entry_points.txt`` on a temporary sys.path entry."""
import json
import textwrap

import pytest

import prime_kernels
from prime_kernels_core import manifest, registry

DEFAULT_RECORD = object()
# A kernel module that registers its declared ops, as a real _C would, and a shape contract.
_DEFAULT_OPS = (
    "import torch\n_library = torch.library.Library('{namespace}', 'DEF')\n{defines}"
    "def unsupported_shape_reason(n):\n    return None if n % 8 == 0 else f'n={{n}}, needs a multiple of 8'\n"
)


def running_record(kernels: dict | None = None, **overrides) -> dict:
    """A build record as the build kit writes it, built by the running torch: ``kernels`` maps each kernel to the
    archs its CUDA code was compiled for, or to (archs, its not_built table)."""
    import torch

    record = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "nvcc": torch.version.cuda,
              "arch_request": "every arch each kernel lists (PRIME_KERNELS_ARCH unset)", "cuda_skipped": None,
              "kernels": {}}
    for name, built in (kernels or {}).items():
        archs, not_built = built if isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], dict) else (built, {})
        record["kernels"][name] = {"archs": list(archs), "not_built": dict(not_built)}
    record.update(overrides)
    return record


def _toml_value(value) -> str:
    """A TOML value, tables inline."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


@pytest.fixture
def write_manifest():
    """Returns write(folder, table): folder/kernel.toml holding the one kernel "k" with ``table``'s keys, the
    manifest cache cleared; the file's path."""
    def write(folder, table: dict):
        path = folder / "kernel.toml"
        path.write_text('version = "0.1.0"\n[k]\n' + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items()))
        manifest.load.cache_clear()
        return path
    return write


@pytest.fixture
def record():
    return running_record


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """Returns make(dist, kernel=..., ...) which writes one plugin distribution; only these are discovered."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(dist, kernel="demo", namespace=None, version="0.1.0", archs=("9.0a",), record=DEFAULT_RECORD,
             hooks="", ops_source="", import_error=None, ops=("op_a",), trainable=(), plugin_source=None,
             entry_point="plugin"):
        package = dist.replace("-", "_")
        pkg = tmp_path / package
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        namespace = namespace or f"pk_test_{package}"
        ops_source = ops_source.replace("NAMESPACE", namespace)
        (pkg / "kernel.toml").write_text(textwrap.dedent(f"""\
            version = "{version}"
            [{kernel}]
            description = "test kernel"
            namespace = "{namespace}"
            ops = {json.dumps(list(ops))}
            trainable = {json.dumps(list(trainable))}
            module = "{package}.ops"
            archs = {json.dumps(list(archs))}
        """))
        if record is DEFAULT_RECORD:
            record = running_record({kernel: list(archs)})
        if isinstance(record, dict):  # as the build kit records them, unless the test says otherwise
            record = {"registered_ops": [f"{namespace}::{op}" for op in ops], **record}
        if record is not None:
            (pkg / "_build_record.json").write_text(json.dumps(record))
        (pkg / "ops.py").write_text(
            f"raise ImportError({import_error!r})\n" if import_error else
            ops_source or _DEFAULT_OPS.format(namespace=namespace, defines="".join(
                f"_library.define('{op}(Tensor x) -> Tensor')\n" for op in ops))
        )
        (pkg / "plugin.py").write_text(
            plugin_source.replace("PACKAGE", package) if plugin_source else
            "from prime_kernels_core import hookimpl, manifest\n\n"
            "@hookimpl\ndef prime_kernels_declare():\n    return manifest.declare(__file__)\n" + textwrap.dedent(hooks)
        )
        info = tmp_path / f"{package}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[prime_kernels]\n{kernel} = {package}.{entry_point}\n")
        made.append(dist)
        monkeypatch.setenv(registry.ALLOW_ENV, ",".join(made))
        registry.refresh()
        return package

    registry.refresh()
    yield make
    registry.refresh()


@pytest.fixture
def api():
    return prime_kernels
