#!/usr/bin/env bash
# The main job: set up (idempotent), print the status table, run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
"$py" -m prime_kernels
"$py" scripts/demo.py
