#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a venv with torch, the core, and every plugin built once as a wheel
# (python -m build --no-isolation, against the torch in the venv) and installed from that wheel.
# Prints the venv's python path last. A plugin is rebuilt only when its sources or the build kit change.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PRIME_KERNELS_VENV:-.venv}
wheelhouse=${PRIME_KERNELS_WHEELHOUSE:-dist}
log() { echo "[setup] $*" >&2; }
# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper outside the toolkit.
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda

[ -x "$venv/bin/python" ] || { log "creating $venv"; python3 -m venv "$venv"; }
py="$venv/bin/python"
# This machine's pip config names local find-links folders that may be absent; pip warns once per package for them.
pip_install() {
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v '^WARNING: Location .* is ignored' || true; } >&2
}
log "installing torch and build tools"
# The core is installed with --no-deps below, so its dependencies come here (tomli: manifests on Python 3.10).
pip_install torch==2.14.1 pluggy "tomli; python_version < '3.11'" pytest ninja build wheel "setuptools>=64" numpy
# Test dependency: flash_moe's transformers integration is tested against this release (its tests skip without it).
pip_install transformers==5.24.0
# --no-build-isolation everywhere: an isolated build would pull another torch and produce a wheel that fails at import.
pip_install --no-build-isolation --no-deps --force-reinstall .

kit_hash=$(cat prime_kernels_core/build.py prime_kernels_core/manifest.py prime_kernels_core/csrc/* prime_kernels_core/include/prime_kernels/* | sha1sum | cut -c1-12)
for plugin in plugins/*/ examples/*/; do
  [ -f "$plugin/pyproject.toml" ] || continue
  hash=$( (cd "$plugin" && find . -type f -not -path './build/*' -not -path '*/__pycache__/*' -not -name '*.so' \
           -not -name '_build_record.json' -not -path '*.egg-info*' | sort | xargs sha1sum; echo "$kit_hash") | sha1sum | cut -c1-12)
  out="$wheelhouse/$(basename "$plugin")-$hash"
  if ! ls "$out"/*.whl >/dev/null 2>&1; then
    log "building $plugin (wheel into $out)"
    start=$(date +%s)
    rm -rf "$plugin/build"
    "$py" -m build --wheel --no-isolation --outdir "$out" "$plugin" >&2
    log "built $plugin in $(( $(date +%s) - start )) s"
  fi
  pip_install --no-deps --force-reinstall "$out"/*.whl
done
echo "$py"
