#!/usr/bin/env bash
# The peer libraries' wheels for the GPU machine (Python 3.12, x86_64, no network there), after
# ../shared/bench/peer-wheels.sh's pattern, here SonicMoE's set (issue 26):
#   bash scripts/peer_wheels.sh            -> .peers1/ .peers2/ ... (ignored by git), each under one call's 64 MiB
# sonic-moe 0.1.2.post1 (uploaded 2026-04-20 20:19 UTC) with the quack-kernels of that day, 0.3.11 (01:08 UTC; its
# floor), and the CuTe DSL it pins, 4.4.2 (libs-base and libs-cu13 are 74 and 78 MB: split into 50 MB parts).
# Carry one folder per device call while the machine stays warm (each call replaces only the paths it carries), the
# last call runs the bench: scripts/gpu_check.sh joins the parts of every .peers*/ folder and installs the wheels into
# /tmp/peers.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$tmp" \
  sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-base==4.4.2 \
  nvidia-cutlass-dsl-libs-cu13==4.4.2 "apache-tvm-ffi>=0.1.6,<0.2" torch-c-dlpack-ext
for w in "$tmp"/*.whl; do
  if [ "$(stat -c %s "$w")" -gt 52428800 ]; then split -b 50M "$w" "$w.part_" && rm "$w"; fi
done
rm -rf .peers[0-9]*
# First fit, largest first, into folders of at most 60 MiB.
n=0
for f in $(ls -S "$tmp"); do
  size=$(stat -c %s "$tmp/$f") placed=""
  for d in $(seq 1 "$n"); do
    if [ $(( $(du -sb ".peers$d" | cut -f1) + size )) -le 62914560 ]; then placed=$d; break; fi
  done
  [ -z "$placed" ] && { n=$((n + 1)); placed=$n; mkdir -p ".peers$placed"; }
  mv "$tmp/$f" ".peers$placed/"
done
rmdir "$tmp"
for d in $(seq 1 "$n"); do echo ".peers$d: $(du -sh ".peers$d" | cut -f1) $(ls ".peers$d" | tr '\n' ' ')"; done
