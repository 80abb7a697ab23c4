#!/usr/bin/env bash
# The plugins' CPU suites under the oldest torch the stable-ABI kernels run on (the manifests' stable_abi floor), with
# the wheels setup.sh built under its pinned torch, as a user of an older torch installs them: the stable-ABI kernels
# must pass, every test of a kernel the registry refuses under this torch must skip with the registry's sentence.
#   bash scripts/test_torch_floor.sh [PYTEST_ARGS]
# torch is PyPI's CUDA build of the floor release (what a GPU user of the +cuXYZtorchabi<floor> wheels runs: a CPU-only
# torch would refuse every CUDA-built kernel and test nothing); its venv is kept (PRIME_KERNELS_FLOOR_VENV, default
# .venv_floor) so that later runs download nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
wheelhouse=${PRIME_KERNELS_WHEELHOUSE:-dist}
venv=${PRIME_KERNELS_FLOOR_VENV:-.venv_floor}
log() { echo "[test_torch_floor] $*" >&2; }
floor=$("$py" - <<'PY'
from pathlib import Path
from prime_kernels_core.manifest import load, release_tuple
floors = {t["stable_abi"] for m in Path(".").glob("*/*/*/kernel.toml") for t in load(m.parent)["kernels"].values()
          if t.get("stable_abi")}
print(min(floors, key=release_tuple))
PY
)
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
fpy=$venv/bin/python
start=$(date +%s)
if ! "$fpy" -c "import sys, torch; sys.exit(not torch.__version__.startswith('$floor.'))" 2>/dev/null; then
  log "installing torch $floor (PyPI's CUDA build, a download of a few GB the first time)"
  # This machine's pip config points at local folders holding other torch releases (a CPU-only 2.13 among them).
  # No cache: the venv is kept instead, and a cached copy would hold a second few GB on the disk.
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$fpy" -m pip install -q --disable-pip-version-check --no-cache-dir \
    "torch~=$floor.0" >&2
fi
# The test and build tools (wheel: the core is installed from source without isolation).
"$fpy" -m pip install -q --disable-pip-version-check pluggy pytest numpy "setuptools>=64" wheel 2>&1 \
  | { grep -v '^WARNING: Location .* is ignored' || true; } >&2
# shellcheck source=lib/wheels.sh
. scripts/lib/wheels.sh
kit=$(kit_hash)
wheels=()
for plugin in plugins/*/ examples/*/; do
  wheels+=("$(ls "$wheelhouse/$(basename "$plugin")-$(plugin_hash "$plugin" "$kit")"/*.whl)")
done
"$fpy" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall . "${wheels[@]}" >&2
log "torch $("$fpy" -c 'import torch; print(torch.__version__)') ready in $(( $(date +%s) - start )) s; wheels built under" \
    "$("$py" -c 'import torch; print(torch.__version__)'): ${wheels[*]##*/}"
"$fpy" -m prime_kernels --device cpu  # what the registry says of each kernel under this torch
"$fpy" -m pytest plugins/*/tests examples/*/tests -q -p no:cacheprovider "$@"
