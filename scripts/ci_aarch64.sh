#!/usr/bin/env bash
# CI's aarch64 job: the example plugin cross-built for linux_aarch64 as a release builds it (fat, PRIME_KERNELS_REQUIRE=1,
# the release check: ELF machine, archs, cubins, libstdc++ dynamic), then installed next to the aarch64 torch and its
# tests run under qemu-user (scripts/test_aarch64.sh). The big plugins' aarch64 wheels: bash scripts/release.sh --aarch64.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
aarch64_py=$(bash scripts/cross_aarch64.sh)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$py" -m prime_kernels_core.release --wheelhouse "$out" --python "$aarch64_py" examples/third_party_plugin
bash scripts/test_aarch64.sh "$out"
