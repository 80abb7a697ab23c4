#!/usr/bin/env bash
# Idempotent set-up for building and running linux_aarch64 (GH200 / GB200) wheels on this x86_64 Debian machine, no
# aarch64 hardware and no binfmt_misc needed. Prints last (stdout) the path of an aarch64 CPython 3.11 that runs under
# qemu-user in a venv holding PyPI's aarch64 torch: a wrapper script that is also the aarch64 build environment (step 3).
# Install into that venv with scripts/lib/aarch64.sh's aarch64_pip; this tree's core is installed there each run.
# Usage: bash scripts/cross_aarch64.sh [DIR]   (default .cross/aarch64, ignored by git; ~5.5 GB, ~4 min the first time)
# Environment: PRIME_KERNELS_TORCH (default: setup.sh's pin; PyPI's aarch64 torch is the CUDA build).
# How each blocker was met: docs/notes/building.md (cross-building for aarch64).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(realpath -m "${1:-.cross/aarch64}")
torch_pin=${PRIME_KERNELS_TORCH:-$(sed -n 's/^torch_pin=//p' scripts/setup.sh)}
log() { echo "[cross_aarch64] $*" >&2; }
# shellcheck source=lib/aarch64.sh
. scripts/lib/aarch64.sh
mkdir -p "$root"

# 1. Host tools from Debian: the cross compiler, qemu-user, ninja (an aarch64 ninja from PyPI would not run here).
apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600 "$@" >&2; }
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64-static >/dev/null \
   || ! command -v ninja >/dev/null; then
  log "installing g++-aarch64-linux-gnu, qemu-user-static and ninja-build (apt)"
  apt_get update && apt_get install -y --no-install-recommends g++-aarch64-linux-gnu qemu-user-static ninja-build
fi

# 2. An aarch64 sysroot of Debian's python3.11 and the libraries it and torch load, unpacked rather than installed:
# a multiarch install of libpython3.11-dev:arm64 would upgrade the host's python3.11 to the same version.
sysroot=$root/sysroot
if [ ! -x "$sysroot/usr/bin/python3.11" ]; then
  dpkg --print-foreign-architectures | grep -qx arm64 || { log "adding the arm64 package architecture"; dpkg --add-architecture arm64; }
  apt_get update
  # Dependencies of python3.11 and its headers, with libstdc++ and libgomp (torch's); no recommends; arm64 only.
  packages=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
      --no-enhances --no-pre-depends python3.11:arm64 libpython3.11-dev:arm64 libstdc++6:arm64 libgomp1:arm64 \
    | grep -E '^[a-z0-9][^ ]*:arm64$' | sort -u)
  debs=$root/debs && rm -rf "$debs" && mkdir -p "$debs"
  log "downloading $(echo "$packages" | wc -w) arm64 packages into $debs"
  (cd "$debs" && apt-get download -q -o APT::Sandbox::User=root $packages >&2)
  rm -rf "$sysroot" && mkdir -p "$sysroot"
  for deb in "$debs"/*.deb; do dpkg -x "$deb" "$sysroot"; done
  rm -rf "$debs"
fi
# qemu-user looks up every path in its prefix first: torch's cpuinfo reads /proc/cpuinfo, and the x86 host's makes
# `import torch` segfault. This one describes a Neoverse V2 core (implementer 0x41, part 0xd4f), Grace's.
mkdir -p "$sysroot/proc"
cat > "$sysroot/proc/cpuinfo" <<'EOF'
processor	: 0
BogoMIPS	: 2000.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh bti
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x0
CPU part	: 0xd4f
CPU revision	: 0

EOF

# oneDNN's xbyak_aarch64 reads the core's MIDR_EL1 from sysfs (the same Neoverse V2: 0x41, variant 0, 0xd4f, r0p0).
midr=$sysroot/sys/devices/system/cpu/cpu0/regs/identification
mkdir -p "$midr" && echo 0x00000000410fd4f0 > "$midr/midr_el1"

# 3. A venv whose python is a wrapper script: qemu runs the sysroot's python3.11 with argv[0] set to the wrapper, so that
# sys.executable (and every `sys.executable -m ...` child, as `python -m build` and the build kit start) is the wrapper
# again, a script this machine runs. The wrapper is also the aarch64 build environment: the compilers it hands to
# setuptools and nvcc are the cross ones (Debian's g++-aarch64-linux-gnu; nvcc unchanged: device code does not depend
# on the host), with step 5's CUDA_HOME and step 6's headers.
venv=$root/venv
site=$(aarch64_site "$venv/bin/python")
mkdir -p "$venv/bin" "$site"
printf 'home = %s\ninclude-system-site-packages = false\nversion = 3.11\n' "$sysroot/usr/bin" > "$venv/pyvenv.cfg"
cuda=$root/cuda
{
  echo '#!/bin/sh'
  echo "export CC=aarch64-linux-gnu-gcc CXX=aarch64-linux-gnu-g++ CUDA_HOME='$cuda'"
  echo "export CPATH='$sysroot/usr/include/python3.11:$root/include'"
  echo "QEMU_LD_PREFIX='$sysroot' exec qemu-aarch64-static -0 \"\$0\" '$sysroot/usr/bin/python3.11' \"\$@\""
} > "$venv/bin/python"
chmod +x "$venv/bin/python"

# 4. Its packages, for the aarch64 platform (scripts/lib/aarch64.sh). The pip ninja only satisfies the plugins' build
# requirements: the host's ninja (step 1) is the one on PATH.
want="torch==$torch_pin"
if [ "$(cat "$root/installed" 2>/dev/null)" != "$want" ]; then
  log "installing aarch64 $want and the build and test tools into $venv (up to 3 GB the first time)"
  rm -rf "$site" && mkdir -p "$site"
  aarch64_pip "$venv/bin/python" "torch==$torch_pin" pluggy pytest build wheel "setuptools>=64" numpy ninja
  echo "$want" > "$root/installed"
fi

# 5. A CUDA_HOME for aarch64 hosts: nvcc with an aarch64 -ccbin looks in targets/aarch64-linux/{include,lib}. nvcc reads
# nvcc.profile beside the path it was started by (TOP = that folder's parent), so links suffice: the x86_64 toolkit's
# programs and headers (the aarch64 runtime wheel's are the same files), and the aarch64 libcudart torch depends on.
host_cuda=${HOST_CUDA_HOME:-/usr/local/cuda}
rm -rf "$cuda" && mkdir -p "$cuda/bin" "$cuda/targets/aarch64-linux/lib"
for f in "$host_cuda"/bin/*; do ln -s "$f" "$cuda/bin/"; done
ln -s "$host_cuda/nvvm" "$cuda/nvvm" && ln -s "$host_cuda/include" "$cuda/include"
ln -s "$host_cuda/include" "$cuda/targets/aarch64-linux/include"
for f in "$site"/nvidia/cu*/lib/libcudart.so.*; do  # none under a CPU-only torch
  [ -e "$f" ] && ln -sf "$f" "$cuda/targets/aarch64-linux/lib/" && ln -sf "$f" "$cuda/targets/aarch64-linux/lib/libcudart.so"
done
ln -s targets/aarch64-linux/lib "$cuda/lib64"

# 6. Debian's pyconfig.h includes <aarch64-linux-gnu/python3.11/pyconfig.h>: a folder holding only that goes on the
# compilers' path (the sysroot's usr/include would put its C headers before libstdc++'s).
mkdir -p "$root/include/aarch64-linux-gnu"
ln -sfn "$sysroot/usr/include/aarch64-linux-gnu/python3.11" "$root/include/aarch64-linux-gnu/python3.11"

# 7. This tree's core: the build kit the aarch64 builds import (pure Python; pip builds it in isolation).
env -u PIP_FIND_LINKS python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps \
  --upgrade --target "$site" . 2>&1 | { grep -v 'already exists. Specify --upgrade' || true; } >&2

log "ready: $("$venv/bin/python" -c 'import platform, torch; print(platform.machine(), "torch", torch.__version__)' 2>&1 | tail -n 1)"
echo "$venv/bin/python"
