# The content hash that names a plugin's built wheel folder (<plugin>-<hash>): the plugin's source files and the core's
# build kit (the manifest reader, the build code, the shared headers it compiles against). Sourced by setup.sh,
# device_wheels.sh and gpu_check.sh, which must agree on it: a wheel is reused only where this hash matches.
# Build outputs (build/, dist/, *.so, *.egg-info, the build record, caches) are not sources.
kit_hash() {  # [CORE_ROOT]: the tree whose core builds the plugin (default .)
  (cd "${1:-.}" && cat prime_kernels_core/build.py prime_kernels_core/manifest.py prime_kernels_core/csrc/* \
     prime_kernels_core/include/prime_kernels/*) | sha1sum | cut -c1-12
}
plugin_hash() {  # PLUGIN_DIR KIT_HASH
  (cd "$1" && find . -type f -not -path './build/*' -not -path './dist/*' -not -path '*/__pycache__/*' \
     -not -path '*/.pytest_cache/*' -not -name '*.so' -not -name '_build_record.json' -not -path '*.egg-info*' \
     | LC_ALL=C sort | xargs -r sha1sum; echo "$2") | sha1sum | cut -c1-12
}
