# Building plugin wheels, shared by setup.sh, stable_abi_wheels.sh, device_wheels.sh and (the hashes) gpu_check.sh.
# The content hash names a plugin's built wheel folder (<plugin>-<hash>): the plugin's source files and the core's build
# kit (the manifest reader, the build code, the shared headers it compiles against); its users must agree on it: a
# wheel is reused only where this hash matches. Build outputs (build/, dist/, *.so, *.egg-info, the build record,
# caches) are not sources.

# The H200's build arch, for wheels built on a machine without it (PRIME_KERNELS_ARCH=native gives it there).
DEVICE_ARCH=9.0a
# The CuTe DSL the CuTe plugins are built with, here and for the device: the GPU image's release and CUDA flavour
# (shipped objects serve only those; built so, they are byte-identical to the image's own build).
CUTE_DSL_REQUIREMENT="nvidia-cutlass-dsl[cu13]==4.8.1"

kit_hash() {  # [CORE_ROOT]: the tree whose core builds the plugin (default .)
  (cd "${1:-.}" && cat prime_kernels_core/build.py prime_kernels_core/manifest.py prime_kernels_core/jit_manifest.py \
     prime_kernels_core/jit_build.py prime_kernels_core/cute_build.py prime_kernels_core/cute_compile.py \
     prime_kernels_core/cute_signature.py prime_kernels_core/csrc/* \
     prime_kernels_core/include/prime_kernels/*) | sha1sum | cut -c1-12
}
plugin_hash() {  # PLUGIN_DIR KIT_HASH
  (cd "$1" && find . -type f -not -path './build/*' -not -path './dist/*' -not -path '*/__pycache__/*' \
     -not -path '*/.pytest_cache/*' -not -name '*.so' -not -name '_build_record.json' -not -path '*.egg-info*' \
     | LC_ALL=C sort | xargs -r sha1sum; echo "$2") | sha1sum | cut -c1-12
}
# One wheel of PLUGIN_DIR into OUT_DIR by PYTHON (no build isolation: against its torch), compiler output in LOG, with
# VAR=VALUE settings; on failure the log's last error lines go to stderr and it returns 1.
build_wheel() {  # PYTHON PLUGIN_DIR OUT_DIR LOG [VAR=VALUE ...]
  local py=$1 plugin=$2 out=$3 log=$4; shift 4
  env "$@" "$py" -m build --wheel --no-isolation --outdir "$out" "$plugin" > "$log" 2>&1 && return 0
  echo "FAILED to build $plugin; full compiler output: $log; its last error lines:" >&2
  { grep -iE 'error|fatal' "$log" || tail -n 20 "$log"; } | tail -n 15 | cut -c1-300 >&2
  return 1
}
