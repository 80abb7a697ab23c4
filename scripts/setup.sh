#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a venv with torch, the core, and every plugin built once as a wheel
# (python -m build --no-isolation, against the torch in the venv) and installed from that wheel.
# Prints the venv's python path last (stdout); progress goes to stderr, compiler output to a log per plugin
# (<plugin>/build/setup.log). A plugin is rebuilt only when its sources or the build kit change.
# Environment: PRIME_KERNELS_VENV (default .venv), PRIME_KERNELS_WHEELHOUSE (default dist), MAX_JOBS (compile jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PRIME_KERNELS_VENV:-.venv}
wheelhouse=${PRIME_KERNELS_WHEELHOUSE:-dist}
torch_pin=2.14.1
log() { echo "[setup] $*" >&2; }
# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper outside the toolkit.
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda

[ -x "$venv/bin/python" ] || { log "creating $venv"; python3 -m venv "$venv"; }
py="$venv/bin/python"
# This machine's pip config names local find-links folders that may be absent; pip warns once per package for them.
pip_install() {
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v '^WARNING: Location .* is ignored' || true; } >&2
}
if "$py" -c "import sys, torch; sys.exit(not torch.__version__.startswith('$torch_pin'))" 2>/dev/null; then
  log "torch $torch_pin is installed; checking the build tools"
else
  log "installing torch $torch_pin and build tools (a download of a few GB the first time)"
fi
# The core is installed with --no-deps below, so its dependencies come here (tomli: manifests on Python 3.10).
pip_install torch==$torch_pin pluggy "tomli; python_version < '3.11'" pytest ninja build wheel "setuptools>=64" numpy
# Test dependency: flash_moe's transformers integration is tested against this release (its tests skip without it).
pip_install transformers==5.24.0
# shellcheck source=lib/wheels.sh
. scripts/lib/wheels.sh
# Build and test dependency: the CuTe DSL example compiles its shipped objects with it (lib/wheels.sh: the GPU image's
# release and cu13 libraries; the meta package brings cu12's too, and the DSL loads the newest) and its tests load
# them; ~190 MB download, ~490 MB installed, ~10 s.
pip_install "$CUTE_DSL_REQUIREMENT"
# --no-build-isolation everywhere: an isolated build would pull another torch and produce a wheel that fails at import.
pip_install --no-build-isolation --no-deps --force-reinstall .

kit=$(kit_hash)
wheel_dir() { echo "$wheelhouse/$(basename "$1")-$(plugin_hash "$1" "$kit")"; }  # named by the plugin's content hash
plugins=() to_build=()
for plugin in plugins/*/ examples/*/; do
  [ -f "$plugin/pyproject.toml" ] || continue
  plugins+=("${plugin%/}")
  ls "$(wheel_dir "$plugin")"/*.whl >/dev/null 2>&1 || to_build+=("$(basename "$plugin")")
done
if [ ${#to_build[@]} -gt 0 ]; then
  log "compiling ${#to_build[@]} plugin(s) from source (${to_build[*]}) with ${MAX_JOBS:-all} parallel jobs: roughly 1-3" \
      "minutes per CUDA plugin on 2 cores; later runs reuse the wheels in $wheelhouse"
else
  log "reusing built wheels from $wheelhouse (no plugin source changed)"
fi

for plugin in "${plugins[@]}"; do
  out=$(wheel_dir "$plugin")
  start=$(date +%s)
  if ls "$out"/*.whl >/dev/null 2>&1; then
    what="reused wheel $out"
  else
    rm -rf "$plugin/build" && mkdir -p "$plugin/build"  # compiler output goes to the log; on failure, its last errors
    build_wheel "$py" "$plugin" "$out" "$PWD/$plugin/build/setup.log" || exit 1
    what="built in $(( $(date +%s) - start )) s (log: $plugin/build/setup.log)"
  fi
  installed=$(date +%s)
  pip_install --no-deps --force-reinstall "$out"/*.whl
  log "$(printf '%-22s' "$(basename "$plugin")") $what, installed in $(( $(date +%s) - installed )) s"
done
echo "$py"
