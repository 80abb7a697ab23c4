# Installing into the aarch64 venv of scripts/cross_aarch64.sh, shared by it, release.sh and the CI job: this machine's
# pip does the work for the aarch64 platform (pip under emulation is slow). pip does not widen a manylinux tag to older
# ones, and torch's CUDA libraries are tagged 2_17 to 2_28: every tag is named.
AARCH64_PLATFORMS=""
for n in $(seq 28 -1 17); do AARCH64_PLATFORMS+=" --platform manylinux_2_${n}_aarch64"; done
AARCH64_PLATFORMS+=" --platform manylinux2014_aarch64 --platform linux_aarch64"

aarch64_site() {  # AARCH64_PYTHON: its venv's site-packages
  echo "$(dirname "$(dirname "$1")")/lib/python3.11/site-packages"
}
aarch64_pip() {  # AARCH64_PYTHON PIP_INSTALL_ARGS...: aarch64 binaries (or pure wheels) into that venv, replacing
  local site; site=$(aarch64_site "$1"); shift
  # This machine's pip config names local x86_64 folders and caps torch at what lies there; neither applies here.
  # No cache: aarch64 wheels are of no use to this machine's pip, and torch's would hold a second ~3 GB on the disk.
  # shellcheck disable=SC2086
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --disable-pip-version-check --no-cache-dir \
    --root-user-action=ignore --target "$site" --upgrade --only-binary=:all: --python-version 3.11 --implementation cp \
    --abi cp311 --abi abi3 --abi none $AARCH64_PLATFORMS "$@" 2>&1 | { grep -v 'already exists. Specify --upgrade' || true; } >&2
}
