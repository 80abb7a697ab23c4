#!/usr/bin/env bash
# The peer libraries' wheels for the GPU machine (Python 3.12, x86_64, no network there), one set per machine:
#   bash scripts/peer_wheels.sh [sonicmoe|liger|lck]   -> .peers1/ .peers2/ ... (lck: .peers_lck1/ ...), ignored by git
# Each folder holds at most PEER_FOLDER_MIB (default 52) MiB, so that it travels in one device call beside the tree and
# .device_wheels (64 MiB in all); wheels over 50 MB are split into 50 MB parts. Carry one folder per device call while
# the machine stays warm (each call replaces only the paths it carries): scripts/gpu_check.sh copies every carried
# folder's wheels into /tmp/peer_wheels (kept while the machine is warm), joins the parts once all have come and installs
# .peers*/'s into /tmp/peers, .peers_lck*/'s into /tmp/peers_lck (only the liger phase puts that one on its path).
# Sets:
# - sonicmoe (default; issue 26): sonic-moe 0.1.2.post1 (uploaded 2026-04-20 20:19 UTC) with the quack-kernels of that
#   day, 0.3.11 (its floor), and the CuTe DSL it pins, 4.4.2.
# - liger (issue 62; the set of ../shared/bench/peer-wheels.sh less nvidia-cutlass, which nothing here imports):
#   liger-kernel 0.8.5 (its Triton fused MoE needs only the device's Triton; its CuTe-DSL SM90 lm-head kernels need the
#   CuTe DSL 4.8.1, apache-tvm-ffi and cuda-bindings, the latter on the device), cut-cross-entropy 25.1.1 and
#   quack-kernels 0.6.5 (bench_linear_logp's and bench_fused_logp's other peers). liger-kernel goes first into
#   .peers1: the liger-warm phase needs nothing else.
# - lck (issue 62): liger-kernel's "lck" extra, liger-cute-kernels 0.8.5 (one wheel, manylinux_2_35, built with CUDA
#   12.9: it loads libcudart.so.12), with its "cu12" extra's NVSHMEM (nvidia-nvshmem-cu12 3.6.5) and the CUDA 12.9
#   runtime (the device's are CUDA 13's); 238 MB: five folders. Needs the liger set's liger-kernel and apache-tvm-ffi.
set -euo pipefail
cd "$(dirname "$0")/.."
set_name=${1:-sonicmoe}
case "$set_name" in
  sonicmoe) prefix=.peers first="" platforms=()
    wheels=(sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-base==4.4.2
            nvidia-cutlass-dsl-libs-cu13==4.4.2 "apache-tvm-ffi>=0.1.6,<0.2" torch-c-dlpack-ext) ;;
  liger) prefix=.peers first=liger_kernel- platforms=()
    wheels=(liger-kernel==0.8.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
            nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi>=0.1.6,<0.2"
            torch-c-dlpack-ext cut-cross-entropy==25.1.1 quack-kernels==0.6.5) ;;
  lck) prefix=.peers_lck first="" platforms=(--platform manylinux_2_35_x86_64)
    wheels=(liger-cute-kernels==0.8.5 nvidia-nvshmem-cu12==3.6.5 nvidia-cuda-runtime-cu12==12.9.79) ;;
  *) echo "usage: peer_wheels.sh [sonicmoe|liger|lck] (unknown set: $set_name)" >&2; exit 2 ;;
esac
capacity=$(( ${PEER_FOLDER_MIB:-52} * 1048576 ))
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$tmp" "${wheels[@]}"
for w in "$tmp"/*.whl; do
  if [ "$(stat -c %s "$w")" -gt 52428800 ]; then split -b 50M "$w" "$w.part_" && rm "$w"; fi
done
# The folders of this prefix only: .peers[0-9]* (sonicmoe, liger: one of them at a time) or .peers_lck[0-9]*.
rm -rf "$prefix"[0-9]*
# First fit into folders of at most $capacity bytes: the set's first wheel (if any), then largest first.
order() {
  if [ -z "$first" ]; then ls -S "$tmp"; return; fi
  ls "$tmp" | grep "^$first" || true
  ls -S "$tmp" | grep -v "^$first" || true
}
n=0
for f in $(order); do
  size=$(stat -c %s "$tmp/$f") placed=""
  for d in $(seq 1 "$n"); do
    if [ $(( $(du -sb "$prefix$d" | cut -f1) + size )) -le "$capacity" ]; then placed=$d; break; fi
  done
  [ -z "$placed" ] && { n=$((n + 1)); placed=$n; mkdir -p "$prefix$placed"; }
  mv "$tmp/$f" "$prefix$placed/"
done
rmdir "$tmp"
for d in $(seq 1 "$n"); do echo "$prefix$d: $(du -sh "$prefix$d" | cut -f1) $(ls "$prefix$d" | tr '\n' ' ')"; done
