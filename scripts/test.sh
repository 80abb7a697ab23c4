#!/usr/bin/env bash
# The test command: set up (idempotent), then every CPU test (core, build kit, each plugin). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
export PRIME_KERNELS_WHEELHOUSE=${PRIME_KERNELS_WHEELHOUSE:-dist}
# As setup.sh: torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper outside the toolkit (the tests build too).
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
"$py" -m pytest tests plugins/*/tests examples/*/tests -q -p no:cacheprovider "$@"
