#!/usr/bin/env bash
# Release wheels of the core and every plugin (fat: every arch each kernel lists; PRIME_KERNELS_REQUIRE=1), each plugin
# wheel checked from its own files, then the pin lines a consumer pastes:
#   bash scripts/release.sh [WHEELHOUSE]          (default: wheelhouse/)
# Needs a CUDA toolkit whose major matches the venv's torch; no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
# shellcheck disable=SC2046
"$py" -m prime_kernels_core.release --wheelhouse "${1:-wheelhouse}" . $(ls -d plugins/*/ examples/*/)
