"""Every module of every plugin package imports alone (no hidden dependence on import order), and no package's modules
import one another in a circle (imports inside functions included: a lazy import hides a circle, it does not remove
it)."""
import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_PACKAGES = sorted(p.parent for pattern in ("plugins/*/*/kernel.toml", "examples/*/*/kernel.toml")
                         for p in ROOT.glob(pattern))
PACKAGES = [ROOT / "prime_kernels_core", ROOT / "prime_kernels", *PLUGIN_PACKAGES]


def _imported_siblings(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    """The modules of ``package`` (by bare name, among ``modules``) that a parsed module imports, at any depth."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                raise AssertionError(f"{package}: an import from a parent package ({'.' * node.level}{node.module})")
            base = node.module or ""
            if node.level == 0:
                if base != package and not base.startswith(package + "."):
                    continue
                base = base[len(package) + 1:]
            # ``from . import a`` names modules; ``from .a import f`` names module a.
            targets = [base] if base else [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if node.__class__ is ast.Import:
                if not target.startswith(package + "."):
                    continue
                target = target[len(package) + 1:]
            name = target.split(".")[0]
            if name in modules:
                found.add(name)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from the source files' syntax trees."""
    files = {f.stem: f for f in package_dir.glob("*.py")}
    modules = set(files)
    return {name: _imported_siblings(ast.parse(f.read_text(), str(f)), package_dir.name, modules) - {name}
            for name, f in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports as [a, b, ..., a], or None."""
    state = {}  # module -> "open" while on the current path, "done" once fully explored

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_a_circle_and_only_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"ops": {"inputs", "vp"}, "vp": {"inputs"}, "inputs": set()}) is None


def test_import_graph_reads_every_import_form(tmp_path):
    pkg = tmp_path / "pk_demo"
    pkg.mkdir()
    (pkg / "a.py").write_text("from . import b\nimport pk_demo.c\n\ndef f():\n    from .d import g\n")
    (pkg / "b.py").write_text("from pk_demo import c\nimport torch\n")
    (pkg / "c.py").write_text("from pk_demo.d import x\n")
    (pkg / "d.py").write_text("")
    assert import_graph(pkg) == {"a": {"b", "c", "d"}, "b": {"c"}, "c": {"d"}, "d": set()}


@pytest.mark.parametrize("package_dir", PACKAGES, ids=lambda p: p.name)
def test_no_import_circle(package_dir):
    cycle = find_cycle(import_graph(package_dir))
    assert cycle is None, f"{package_dir.name}: its modules import one another in a circle: {' -> '.join(cycle)}"


# One interpreter imports torch and the core once, then forks a child per module: each child imports that one module
# into a process where no module of its package has been imported yet.
_IMPORT_EACH_ALONE = r"""
import importlib, json, os, sys, traceback
import torch, prime_kernels_core.manifest
package, modules = sys.argv[1], sys.argv[2:]
loaded = [m for m in sys.modules if m == package or m.startswith(package + ".")]
assert not loaded, f"{package} was imported before the children forked: {loaded}"
failures = {}
for module in modules:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(f"{package}.{module}")
            code, message = 0, b""
        except BaseException:
            code, message = 1, traceback.format_exc().encode()
        os.write(write, message)
        os._exit(code)
    os.close(write)
    message = b"".join(iter(lambda: os.read(read, 65536), b""))
    os.close(read)
    if os.waitpid(pid, 0)[1] != 0:
        failures[module] = message.decode() or "the child died without a traceback"
print(json.dumps(failures))
"""


@pytest.mark.parametrize("package_dir", PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_each_module_imports_alone(package_dir):
    spec = importlib.util.find_spec(package_dir.name)
    if spec is None:
        pytest.skip(f"{package_dir.name} is not installed (scripts/setup.sh installs every plugin)")
    installed = Path(spec.origin).parent
    modules = sorted(f.stem for f in installed.glob("*.py"))
    assert modules, f"no modules found in {installed}"
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE, package_dir.name, *modules],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"{package_dir.name}.{m} fails to import alone:\n{tb}" for m, tb in failures.items())
