#!/usr/bin/env bash
# Release wheels of the core and every plugin (fat: every arch each kernel lists; PRIME_KERNELS_REQUIRE=1), each plugin
# wheel checked from its own files, then the pin lines a consumer pastes:
#   bash scripts/release.sh [--aarch64] [--cpu] [WHEELHOUSE]          (default: wheelhouse/)
# --aarch64: linux_aarch64 wheels (GH200, GB200) beside the x86_64 ones, cross-built here (scripts/cross_aarch64.sh
#            sets up the compilers and an emulated aarch64 Python, ~5.5 GB once), and each aarch64 wheel's CPU tests
#            run under qemu (scripts/test_aarch64.sh); the pin lines carry platform_machine markers.
# --cpu:     also each plugin's CPU-only wheel (+cpu..., no device code) for CPU-only torch, for every platform built.
# Needs a CUDA toolkit whose major matches the venv's torch; no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
aarch64="" cpu=() wheelhouse=wheelhouse
for arg in "$@"; do
  case $arg in
    --aarch64) aarch64=1 ;;
    --cpu) cpu=(--cpu) ;;
    -*) echo "release.sh: unknown option $arg (known: --aarch64, --cpu)" >&2; exit 2 ;;
    *) wheelhouse=$arg ;;
  esac
done
py=$(bash scripts/setup.sh)
# As setup.sh: torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper outside the toolkit.
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
pythons=(--python "$py")
if [ -n "$aarch64" ]; then
  aarch64_py=$(bash scripts/cross_aarch64.sh)
  pythons+=(--python "$aarch64_py")
fi
# shellcheck disable=SC2046
"$py" -m prime_kernels_core.release --wheelhouse "$wheelhouse" "${pythons[@]}" "${cpu[@]}" . $(ls -d plugins/*/ examples/*/)
[ -z "$aarch64" ] || bash scripts/test_aarch64.sh "$wheelhouse"
