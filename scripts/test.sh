#!/usr/bin/env bash
# The test command: set up (idempotent), then every CPU test (core, build kit, each plugin). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
export PRIME_KERNELS_WHEELHOUSE=${PRIME_KERNELS_WHEELHOUSE:-dist}
"$py" -m pytest tests plugins/*/tests examples/*/tests -q -p no:cacheprovider "$@"
