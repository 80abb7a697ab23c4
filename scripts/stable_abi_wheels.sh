#!/usr/bin/env bash
# The stable-ABI wheels of the ported plugins, built once on this machine for the GPU harness's stable phase
# (scripts/gpu_check.sh OUT stable: installs them under the device's own torch, whatever its release >= the floor):
#   bash scripts/stable_abi_wheels.sh [DIR]       (default .stable_wheels, ignored by git: carry it to the device)
# The example plugin and fused_logp (both its kernels, fused_logp and linear_logp). CUDA for PRIME_KERNELS_ARCH (default
# the H200's: lib/wheels.sh's DEVICE_ARCH).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/wheels.sh
out=${1:-.stable_wheels}
py=${PYTHON:-.venv/bin/python}
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
export PRIME_KERNELS_ARCH=${PRIME_KERNELS_ARCH:-$DEVICE_ARCH} PRIME_KERNELS_REQUIRE=1
rm -rf "$out" && mkdir -p "$out"
build() {  # PLUGIN_DIR [VAR=VALUE ...]: one wheel into $out, compiler output in PLUGIN_DIR/build/stable_abi.log
  local plugin=$1 start log; shift
  rm -rf "$plugin/build" && mkdir -p "$plugin/build"
  log=$plugin/build/stable_abi.log start=$(date +%s)
  build_wheel "$py" "$plugin" "$out" "$log" "$@" || exit 1
  echo "[stable_abi_wheels] $plugin: $(( $(date +%s) - start )) s" >&2
}
build examples/third_party_plugin
build plugins/fused_logp
# Each wheel must carry a stable-ABI kernel and the abi3 tag (one wheel for every CPython 3 from 3.10).
"$py" - "$out" <<'PY'
import json, sys, zipfile
from pathlib import Path
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    names = zipfile.ZipFile(wheel).namelist()
    record = json.loads(zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/_build_record.json"))))
    floors = {k: v.get("stable_abi") for k, v in record["kernels"].items()}
    assert "-abi3-" in wheel.name and any(floors.values()), f"{wheel.name}: not a stable-ABI abi3 wheel ({floors})"
    print(f"{wheel.name}  {wheel.stat().st_size / 2**20:.1f} MiB  stable_abi {floors}")
PY
