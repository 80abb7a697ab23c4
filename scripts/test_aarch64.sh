#!/usr/bin/env bash
# Runs aarch64 wheels where no aarch64 machine is: installs them next to the aarch64 torch of scripts/cross_aarch64.sh
# and, under qemu-user, shows the kernels' status on the CPU and runs each installed plugin's CPU tests (the
# conformance kit, the ops against float64; GPU tests skip). Extra pytest arguments after --.
#   bash scripts/test_aarch64.sh WHEEL_OR_DIR... [-- PYTEST_ARGS]   (a folder: the newest aarch64 and pure wheel of
#                                                                    each distribution in it)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/aarch64.sh
. scripts/lib/aarch64.sh
wheels=() pytest_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; pytest_args=("$@"); break ;;
    *) if [ -d "$1" ]; then
         # ls -t: newest first; the first file of each distribution name wins.
         while read -r w; do wheels+=("$w"); done < <(ls -t "$1"/*-linux_aarch64.whl "$1"/*-any.whl 2>/dev/null \
           | grep -v -- '+cpu' | awk -F/ '{split($NF, p, "-"); if (!seen[p[1]]++) print}')
       else wheels+=("$1"); fi
       shift ;;
  esac
done
[ ${#wheels[@]} -gt 0 ] || { echo "test_aarch64.sh: no aarch64 or pure wheels given" >&2; exit 2; }
py=$(bash scripts/cross_aarch64.sh)
aarch64_pip "$py" --no-deps "${wheels[@]}"
echo "[test_aarch64] installed: ${wheels[*]##*/}" >&2
# Each plugin folder whose package one of the wheels holds; its tests run from the repository root (not the plugin's
# folder, whose source tree would shadow the installed package).
tests=() kernels=()
for manifest in plugins/*/*/kernel.toml examples/*/*/kernel.toml; do
  package=$(basename "$(dirname "$manifest")")
  printf '%s\n' "${wheels[@]##*/}" | grep -q "^${package}-" || continue
  tests+=("$(dirname "$(dirname "$manifest")")/tests")
  kernels+=($(sed -n 's/^\[\([A-Za-z0-9_]*\)\]$/\1/p' "$manifest"))  # its kernels' tables
done
"$py" -m prime_kernels --device cpu --require "${kernels[@]}"  # each one's CPU implementation must be available
start=$(date +%s)
status=0
"$py" -m pytest "${tests[@]}" -q -p no:cacheprovider "${pytest_args[@]}" || status=$?
echo "[test_aarch64] pytest exited $status after $(( $(date +%s) - start )) s under qemu (${tests[*]})" >&2
exit "$status"
