#!/usr/bin/env bash
# The GPU harness, for a bare H200 machine (torch preinstalled, no network):
#   bash scripts/gpu_check.sh OUT_DIR [build] [variants] [test] [sanitize] [smoke] [variant-tests] [stable] [bench]
#     [sonicmoe-warm] [sonicmoe] [liger-warm] [liger-logp] [liger] [peers] [profile] [hbm] [ab]
#   (default: build test sanitize bench)
# One device call runs at most 10 minutes: run "build test sanitize" in one call and "bench" in the next (the machine
# keeps what the first installed while it stays warm, 30 s after a call).
# Installs the core and every plugin from the working tree (no build isolation, no index), runs the gpu-marked tests,
# compute-sanitizer memcheck, racecheck and synccheck on each plugin's small-shape script, the benchmarks (with peers from .peers/
# when present), and prints a short table last. JSON and logs go to OUT_DIR.
# build and variants install a plugin from its wheel in .device_wheels when scripts/device_wheels.sh built one here for
# the same sources and it imports there (no compiling: carry .device_wheels), else compile it.
# variants: builds each revision staged by scripts/stage_variant.sh under .variants/ (carry it) into its own site dir
# (/tmp/variants/NAME, kept while the machine stays warm). variant-tests: the gpu-marked tests and the sanitizer scripts
# of each built variant's plugins against that variant (its site first on PYTHONPATH; AB_VARIANTS names a subset), one
# variant after another, after the test and sanitize phases; a variant's plugin with the tree's sources is passed by
# there and in smoke (session 21: fused_logp's unchanged suite beside flash_moe's cost 139 s and ran out of memory).
# ab: runs bench/ab.py on each ';'-separated command of AB_BENCH (e.g. AB_BENCH="bench/bench_flash_moe.py
# --mxfp8-only") for the tree and each built variant (AB_VARIANTS names a subset; quotes inside a command keep an
# argument with spaces together). profile: Nsight Compute on one
# script (PROFILE, PROFILE_KERNELS, PROFILE_COUNT, PROFILE_SET; e.g. PROFILE="bench/diagnostics/profile_fused_logp.py"
# PROFILE_KERNELS="fused_logp_(fwd|bwd)_kernel" PROFILE_COUNT=6; PROFILE_SKIP: matching launches skipped first);
# profile_sass.csv beside the details page holds the warp-state samples of every SASS instruction, profile_sass.txt
# their summary (bench/diagnostics/ncu_sass.py).
# BENCHES="bench_a bench_b" limits the bench phase to those scripts (default: every bench/bench_*.py); TEST_SUITES
# (test folders or files), SANITIZE_SCRIPTS and STABLE_SUITES (space-separated paths) limit the test, sanitize and
# stable phases likewise.
# peers: nothing but the carried peer wheels' install (every call does it first): a call that only carries a folder.
# liger-warm, liger-logp, liger: issue 62's peers (scripts/peer_wheels.sh liger, and lck), their comments below.
# stable: installs the stable-ABI wheels built elsewhere by scripts/stable_abi_wheels.sh (carry .stable_wheels, or
# STABLE_WHEELS=DIR) into their own site dir (/tmp/stable_site) under this machine's torch, requires the ported
# kernels to be available from it, and runs their gpu-marked tests and sanitizer scripts against it; a later ab phase
# on the warm machine adds that site as the variant "stable-wheel" (AB_ROUNDS: rounds, default 2).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_check.sh OUT_DIR [build] [variants] [test] [sanitize] [smoke] [variant-tests] [stable] [bench] [sonicmoe-warm] [sonicmoe] [liger-warm] [liger-logp] [liger] [peers] [profile] [hbm] [ab]}; shift
phases=${*:-build test sanitize bench}
mkdir -p "$out"
py=${PYTHON:-python3}
# The image's default CXX wraps g++ with a static libstdc++: extensions built with it crash formatting a TORCH_CHECK.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
# Build every manifest's CUDA for this GPU, also kernels not yet enabled by default (their GPU tests run here).
export PRIME_KERNELS_ARCH=${PRIME_KERNELS_ARCH:-native}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
pip_offline() { "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation "$@"; }
. scripts/lib/wheels.sh
kit=$(kit_hash)
# Whether each compiled module of the plugin at PLUGIN_DIR imports here (from SITE first, when given).
compiled_modules_import() {  # PLUGIN_DIR [SITE]
  local manifest package
  manifest=$(ls "$1"/*/kernel.toml 2>/dev/null | head -n 1) || return 1
  package=$(basename "$(dirname "$manifest")")
  PYTHONPATH=${2:+$2:}${PYTHONPATH:-} "$py" -c 'import importlib, importlib.util, sys, torch
for name in ("_C", "_C_stable"):
    module = sys.argv[1] + "." + name
    if importlib.util.find_spec(module):
        importlib.import_module(module)' "$package"
}
# Installs the plugin at PLUGIN_DIR (into SITE with --target, else into this python) from its wheel built elsewhere
# (scripts/device_wheels.sh; carry .device_wheels) when one matches its sources and its compiled modules import here,
# else compiles it from source; says which, output in LOG.
install_plugin() {  # PLUGIN_DIR LOG [SITE]
  local plugin=$1 log=$2 site=${3:-} wheel
  # --upgrade: replace what an earlier install left in SITE; --force-reinstall: a warm machine's install of the same
  # version (another revision of the tree) is otherwise kept as "already satisfied"
  local target=(${site:+--target "$site" --upgrade}) replace=()
  [ -z "$site" ] && replace=(--force-reinstall)
  wheel=$(ls .device_wheels/"$(basename "$plugin")-$(plugin_hash "$plugin" "$kit")"/*.whl 2>/dev/null | head -n 1)
  if [ -n "$wheel" ] && pip_offline "${target[@]}" "${replace[@]}" "$wheel" > "$log" 2>&1 \
      && compiled_modules_import "$plugin" "$site" >> "$log" 2>&1; then
    echo "prebuilt"
    return 0
  fi
  [ -n "$wheel" ] && echo "[gpu_check] $wheel does not import here: compiling $plugin" >> "$log"
  rm -rf "$plugin/build"
  pip_offline "${target[@]}" "${replace[@]}" "$plugin" >> "$log" 2>&1 && echo "compiled"
}
plugins=$(ls -d plugins/*/ examples/*/ 2>/dev/null | while read -r p; do [ -f "$p/pyproject.toml" ] && echo "$p"; done)
phase() { case " $phases " in *" $1 "*) return 0;; *) return 1;; esac; }
results="$out/phases.tsv"; : > "$results"
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$results"; }
# The gpu-marked tests of SUITE, logged to LOG.log / LOG.xml and recorded as PHASE LABEL (exit 5, no gpu-marked test
# in the suite, counts as 0); the environment of the call (PYTHONPATH, CUDA_VISIBLE_DEVICES) reaches pytest.
gpu_tests() {  # PHASE LABEL SUITE LOG
  timeout 420 "$py" -m pytest -m gpu "$3" -q -p no:cacheprovider -rs --junitxml="$4.xml" > "$4.log" 2>&1
  local code=$?; [ "$code" = 5 ] && code=0
  record "$1" "$2" "exit $code; $(tail -n 1 "$4.log")"
  grep -E '^(FAILED|ERROR)' "$4.log"
}
# compute-sanitizer TOOL on SCRIPT, logged to LOG and recorded as PHASE LABEL (its error or hazard summary).
sanitizer() {  # PHASE LABEL TOOL SCRIPT LOG
  timeout 300 compute-sanitizer --tool "$3" --error-exitcode 3 "$py" "$4" > "$5" 2>&1
  local code=$?
  record "$1" "$2" "exit $code; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$5" | tail -n 1)"
}

# Peer wheels: .peers/ (../shared/bench/peer-wheels.sh) or .peers1/ .peers2/ ... (scripts/peer_wheels.sh, carried one
# per call while the machine stays warm), into /tmp/peers; .peers_lck1/ ... (scripts/peer_wheels.sh lck) into
# /tmp/peers_lck, which only the liger phase puts on its path. A wheel split into parts may have them in several
# folders: one whose parts have not all come yet is left for a later call ("incomplete"), the others are installed.
install_peer_wheels() {  # LABEL TARGET FOLDER...
  local label=$1 target=$2 wheels=/tmp/peer_wheels/$1 folder first wheel bad=0 incomplete=""
  shift 2
  mkdir -p "$wheels"
  for folder in "$@"; do cp "$folder"/*.whl "$wheels"/ 2>/dev/null; done
  for first in $(for folder in "$@"; do ls "$folder"/*.part_aa 2>/dev/null; done); do
    wheel=$(basename "${first%.part_aa}")
    for folder in "$@"; do ls "$folder/$wheel".part_* 2>/dev/null; done | while read -r part; do
      echo "$(basename "$part") $part"; done | sort | cut -d' ' -f2 | xargs cat > "$wheels/$wheel"
  done
  : > "$out/peers-$label-install.log"
  for wheel in "$wheels"/*.whl; do
    [ -f "$wheel.installed" ] && continue  # by an earlier call on this warm machine
    if ! "$py" -m zipfile -t "$wheel" > /dev/null 2>&1; then incomplete="$incomplete $(basename "$wheel")"; continue; fi
    if "$py" -m pip install -q --no-index --no-deps --upgrade --target "$target" "$wheel" \
        >> "$out/peers-$label-install.log" 2>&1; then touch "$wheel.installed"; else bad=$((bad + 1)); fi
  done
  record peers "$label: $(ls "$wheels"/*.whl | wc -l) wheels into $target${incomplete:+; incomplete (parts to come):$incomplete}" \
    "exit $bad; $(grep -m 1 -i error "$out/peers-$label-install.log")"
}
if ls -d .peers/ .peers[0-9]*/ > /dev/null 2>&1; then
  install_peer_wheels main /tmp/peers $(ls -d .peers/ .peers[0-9]*/ 2>/dev/null)
  export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages:/tmp/peers/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}
fi
ls -d .peers_lck[0-9]*/ > /dev/null 2>&1 && install_peer_wheels lck /tmp/peers_lck $(ls -d .peers_lck[0-9]*/)

if phase build; then
  start=$(date +%s)
  pip_offline . && record build core ok || record build core FAILED
  for p in $plugins; do
    ( s=$(date +%s)
      if how=$(install_plugin "$p" "$out/build-$(basename "$p").log"); then r=ok; else r=FAILED how=; fi
      record build "$(basename "$p") ($how $(( $(date +%s) - s )) s)" "$r" ) &
  done
  wait
  echo "[gpu_check] build took $(( $(date +%s) - start )) s"
  "$py" -m prime_kernels | tee "$out/status.txt"
  "$py" -m prime_kernels --json > "$out/status.json"
fi

# SonicMoE's compile caches, filled by one background process per shape (SONIC_SHAPES) in a session of its own
# (setsid), so that it outlives this call while the machine stays warm: the first calls compile for minutes each, on
# the CPU, in parallel, while a later phase of this call (not a timing one: the warm-ups load the GPU) or the next
# call runs. The sonicmoe phase waits for them (SONIC_WARM_WAIT seconds at most) and times in its own processes (the
# autotuning choices are not cached), its logs in OUT.
sonic_warm_dir=/tmp/sonic_warm
sonic_cache_env() {
  if [ ! -d .sonic_cache ] && ls .sonic_cache_tgz/sonic_cache.tgz.part_* > /dev/null 2>&1; then
    cat .sonic_cache_tgz/sonic_cache.tgz.part_* | tar xz
  fi
  export QUACK_CACHE_DIR=$PWD/.sonic_cache/quack TRITON_CACHE_DIR=$PWD/.sonic_cache/triton
}
if phase sonicmoe-warm; then
  sonic_cache_env
  mkdir -p "$sonic_warm_dir"
  for shape in ${SONIC_SHAPES:-qwen3-30b-a3b deepseek-v3 mixtral}; do
    setsid nohup timeout "${SONIC_WARM_TIMEOUT:-1500}" "$py" bench/bench_flash_moe.py --sonicmoe-warm --shapes "$shape" \
      > "$sonic_warm_dir/$shape.log" 2>&1 < /dev/null &
    echo $! > "$sonic_warm_dir/$shape.pid"
    record sonicmoe-warm "$shape" "started (pid $!)"
    disown $!  # out of the job table: the later phases' `wait`s (and the call) do not wait for the compiles
  done
fi

# Liger's Triton fused MoE compiles every autotuning config on its first call per (dim, hidden) and (dim, top_k) (240
# kernels, one after another, on the CPU: minutes): one background process per distinct shape (LIGER_WARM_SHAPES),
# in a session of its own (setsid) so that it outlives this call while the machine stays warm, runs that first call
# at a small problem and so fills Triton's cache (liger_cache) while a later phase of this call (not a timing one: the
# warm-ups load the GPU) or the next call runs. The liger phase waits for them (LIGER_WARM_WAIT seconds at most) and
# times each shape in a process of its own, whose first call autotunes again at that shape on a quiet GPU, loading
# the compiled kernels (the choices are not cached: Liger tunes in each process).
liger_warm_dir=/tmp/liger_warm liger_cache=/tmp/liger_triton_cache
if phase liger-warm; then
  mkdir -p "$liger_warm_dir"
  for shape in ${LIGER_WARM_SHAPES:-qwen3-30b-a3b deepseek-v3 mixtral sonicmoe-7b}; do
    TRITON_CACHE_DIR=$liger_cache setsid nohup timeout "${LIGER_WARM_TIMEOUT:-1500}" "$py" bench/bench_flash_moe.py \
      --liger-warm --shapes "$shape" > "$liger_warm_dir/$shape.log" 2>&1 < /dev/null &
    echo $! > "$liger_warm_dir/$shape.pid"
    record liger-warm "$shape" "started (pid $!)"
    disown $!
  done
fi

# The staged variants build on the CPUs while the GPU runs the tests (a warm machine keeps them for later calls).
if phase variants; then
  for v in .variants/*/; do
    [ -d "$v/plugins" ] || continue
    name=$(basename "$v")
    [ "$(cat "/tmp/variants/$name/.built" 2>/dev/null)" = "$(cat "$v/COMMIT")" ] && continue
    ( ok=1 hows=
      for p in "$v"/plugins/*/; do
        how=$(install_plugin "${p%/}" "$out/build-$name-$(basename "$p").log" "/tmp/variants/$name") || ok=0
        hows="$hows $how"
      done
      if [ $ok = 1 ]; then cp "$v/COMMIT" "/tmp/variants/$name/.built"; r=ok; else r=FAILED; fi
      record variants "build $name ($(cat "$v/COMMIT"),$hows)" "$r" ) &
  done
fi

# Tests and sanitizer runs are not timed: they share the GPU, all at once, to save device minutes.
if phase test; then
  # One pytest process per suite: a kernel fault poisons its CUDA context, and must not fail the other plugins' tests.
  # They run side by side where the card holds them all (an H200); on an 80 GB H100, fused_logp's 9 GiB logits
  # beside flash_moe's 22 GiB ran out of memory (session 29: two or three fused_logp tests failed with OOM, passing
  # alone), so there the suites of LARGE_SUITES run one after another, beside the small suites and the sanitizer
  # runs (small shapes), which start at once.
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  large=" ${LARGE_SUITES:-plugins/fused_logp/tests plugins/flash_moe/tests} " one_by_one=()
  for suite in ${TEST_SUITES:-tests plugins/*/tests examples/*/tests}; do
    [ -e "$suite" ] || { record test "$suite" "not found"; continue; }
    case "$large" in
      *" ${suite%/} "*) [ "${gpu_mib:-0}" -lt 100000 ] && { one_by_one+=("$suite"); continue; };;
    esac
    gpu_tests test "$suite" "$suite" "$out/gpu-tests-$(echo "$suite" | tr / _)" &
  done
  ( for suite in "${one_by_one[@]}"; do gpu_tests test "$suite" "$suite" "$out/gpu-tests-$(echo "$suite" | tr / _)"
    done ) &
fi

if phase sanitize; then
  # With more than one GPU the sanitizer runs take the last one, away from the test suites.
  gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
  sanitize_gpu=$(( gpus > 1 ? gpus - 1 : 0 ))
  for script in ${SANITIZE_SCRIPTS:-plugins/*/tests/sanitize_*.py examples/*/tests/sanitize_*.py}; do
    [ -f "$script" ] || continue
    for tool in memcheck racecheck synccheck; do
      name="$(basename "$script" .py)-$tool"
      CUDA_VISIBLE_DEVICES=$sanitize_gpu sanitizer sanitize "$name" "$tool" "$script" "$out/$name.log" &
    done
  done
fi
wait

# smoke: each built variant's sanitize scripts (small shapes against the CPU op, exit 1 on a mismatch) under a short
# timeout, before any timing: a protocol slip in a new kernel shows here as a hang or a wrong result, not as a timed-out
# A/B call. Diagnostic builds (.variants/NAME/DIAGNOSTIC) are passed by. A variant whose check failed is marked
# (/tmp/variants/NAME/.smoke_failed, while the machine stays warm) and the ab phase leaves it out.
# The variants of AB_VARIANTS (default: every staged one) to check for correctness: built and not diagnostic; those
# not built are recorded under PHASE.
checkable_variants() {  # PHASE
  local name
  for name in ${AB_VARIANTS:-$(ls .variants 2>/dev/null)}; do
    [ -f ".variants/$name/DIAGNOSTIC" ] && continue
    if [ -f "/tmp/variants/$name/.built" ]; then echo "$name"; else record "$1" "$name" "not built"; fi
  done
}

# Whether the staged variant NAME's plugin PLUGIN has the tree's sources (the tree's phases test it: passed by).
same_as_tree() {  # NAME PLUGIN
  [ "$(plugin_hash ".variants/$1/plugins/$2" "$kit")" = "$(plugin_hash "plugins/$2" "$kit")" ]
}

if phase smoke; then
  wait  # the variants phase builds in the background
  for name in $(checkable_variants smoke); do
    rm -f "/tmp/variants/$name/.smoke_failed"
    for script in .variants/"$name"/plugins/*/tests/sanitize_*.py; do
      [ -f "$script" ] || continue
      same_as_tree "$name" "$(basename "$(dirname "$(dirname "$script")")")" && continue
      ( log="$out/smoke-$name-$(basename "$script" .py).log"
        PYTHONPATH=/tmp/variants/$name${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=2 timeout 150 "$py" "$script" \
          > "$log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || touch "/tmp/variants/$name/.smoke_failed"
        record smoke "$name $(basename "$script")" "exit $rc; $(tail -n 1 "$log" | cut -c1-120)" ) &
    done
  done
  wait  # all at once: small shapes, one GPU
fi

if phase variant-tests; then
  wait  # the variants phase builds in the background
  for name in $(checkable_variants variant-tests); do
    site=/tmp/variants/$name
    for p in .variants/"$name"/plugins/*/; do
      plugin=$(basename "$p")
      if same_as_tree "$name" "$plugin"; then
        record variant-tests "$name $plugin" "passed by: the tree's sources"
        continue
      fi
      log="$out/variant-$name-$plugin"
      PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} gpu_tests variant-tests "$name $plugin tests" "plugins/$plugin/tests" \
        "$log-tests" &
      for script in plugins/"$plugin"/tests/sanitize_*.py; do
        [ -f "$script" ] || continue
        for tool in memcheck racecheck synccheck; do
          check="$(basename "$script" .py)-$tool"
          PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} sanitizer variant-tests "$name $check" "$tool" "$script" \
            "$log-$check.log" &
        done
      done
    done
    wait
  done
fi

if phase stable; then
  site=/tmp/stable_site wheels=${STABLE_WHEELS:-.stable_wheels}
  rm -rf "$site"
  if "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$site" "$wheels"/*.whl \
      > "$out/stable-install.log" 2>&1; then r=ok; else r=FAILED; fi
  record stable "install $(ls "$wheels" | tr '\n' ' ')" "$r"
  # The site comes first on sys.path: the registry and the imports take its copies of these distributions.
  # --require: the ported kernels must be available here (a gpu test of an unavailable kernel would only skip).
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$py" -m prime_kernels --require fused_logp linear_logp residual_rmsnorm \
    > "$out/stable-status.txt" 2>&1
  record stable "status: fused_logp, linear_logp and residual_rmsnorm available from $site" "exit $?"
  cat "$out/stable-status.txt"
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$py" -c 'import prime_kernels_fused_logp.ops as f, pk_example_rmsnorm.ops as e
print("stable modules:", f._C_stable.__file__, e._C_stable.__file__)' 2>&1 | tee -a "$out/stable-status.txt"
  # shellcheck disable=SC2206
  suites=(${STABLE_SUITES:-examples/third_party_plugin/tests plugins/fused_logp/tests})
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} timeout 420 "$py" -m pytest -m gpu "${suites[@]}" -q \
    -p no:cacheprovider -rs --junitxml="$out/stable-tests.xml" > "$out/stable-tests.log" 2>&1
  record stable "gpu tests (${suites[*]})" "exit $?; $(tail -n 1 "$out/stable-tests.log")"
  for script in examples/third_party_plugin/tests/sanitize_residual_rmsnorm.py plugins/fused_logp/tests/sanitize_fused_logp.py \
      plugins/fused_logp/tests/sanitize_linear_logp.py; do
    for tool in memcheck racecheck synccheck; do
      name="stable-$(basename "$script" .py)-$tool"
      PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} sanitizer stable "$name" "$tool" "$script" "$out/$name.log" &
    done
  done
  wait
  [ "$r" = ok ] && touch "$site/.installed"  # the ab phase adds this site as the variant "stable-wheel"
fi

# A benchmark JSON's run block (date, COMMIT, GPU, torch: what bench/summary.py needs), where the script wrote none.
stamp_run() {
  [ -f "$1" ] || return 0
  "$py" -c 'import sys; sys.path.insert(0, "bench"); import common; common.stamp_run(*sys.argv[1:])' "$1" "$2"
}

if phase bench; then
  for bench in bench/bench_*.py; do
    [ -f "$bench" ] || continue
    name=$(basename "$bench" .py)
    [ -n "${BENCHES:-}" ] && case " $BENCHES " in *" $name "*) ;; *) continue;; esac
    timeout 420 "$py" "$bench" --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
    record bench "$name" "exit ${PIPESTATUS[0]}"
    stamp_run "$out/$name.json" "$name"
  done
fi

if phase sonicmoe; then
  # SonicMoE (the .peers wheels) against ours, one shape per process (SONIC_SHAPES: names without spaces;
  # SONIC_TIMEOUT seconds each): its first call at a shape compiles and autotunes its kernels for minutes (session 21
  # on an H100: > 450 s at Qwen3-30B-A3B, 56 s for the next process). The compiled kernels go to .sonic_cache (quack's
  # persistent .o cache and Triton's), packed after each shape into OUT/sonic_cache.tgz.part_* (15 MiB parts: a file
  # comes back up to 16 MiB) and keep them here in .sonic_cache_tgz/, carried when a later call must start a fresh
  # machine (unpacked the cache is ~200 MB, over the 64 MiB a call carries; packed ~21-29 MB for the three shapes; an
  # ignored folder, so a new checkout starts without it). The autotuning choices are not cached: SonicMoE tunes on
  # the GPU that times it. Logs: OUT/sonicmoe.log (the warm-ups', then each shape's), rows in OUT/sonicmoe-SHAPE.json.
  sonic_cache_env
  waited=0
  warming() { for pid in $(cat "$sonic_warm_dir"/*.pid 2>/dev/null); do kill -0 "$pid" 2>/dev/null && return 0; done
              return 1; }
  while warming && [ "$waited" -lt "${SONIC_WARM_WAIT:-540}" ]; do
    sleep 5; waited=$((waited + 5))
  done
  # every log into one file (a call brings back eight files): the warm-ups', then each shape's
  log="$out/sonicmoe.log"
  for warm in "$sonic_warm_dir"/*.log; do
    [ -e "$warm" ] || continue
    { echo "== warm-up $(basename "$warm" .log)"; cat "$warm"; } >> "$log"
    record sonicmoe-warm "$(basename "$warm" .log)" "after ${waited} s of waiting: $(tail -n 1 "$warm" | cut -c1-200)"
  done
  for shape in ${SONIC_SHAPES:-qwen3-30b-a3b deepseek-v3 mixtral}; do
    echo "== $shape" >> "$log"
    timeout "${SONIC_TIMEOUT:-420}" "$py" bench/bench_flash_moe.py --sonicmoe --shapes "$shape" \
      --json "$out/sonicmoe-$shape.json" >> "$log" 2>&1
    code=$?
    stamp_run "$out/sonicmoe-$shape.json" bench_flash_moe
    record sonicmoe "$shape" "exit $code; $(awk -v head="== $shape" '$0 == head {on = 1; next} /^== / {on = 0}
      on && /^sonicmoe / {last = $0} END {print last}' "$log" | cut -c1-200)"
    rm -f "$out"/sonic_cache.tgz.part_*
    tar cz .sonic_cache | split -b 15M - "$out/sonic_cache.tgz.part_"
  done
fi

# Waits for the liger-warm processes (LIGER_WARM_WAIT seconds at most: their autotuning loads the GPU) and puts their
# logs, once, into OUT/liger.log.
liger_warm_waited=""
wait_liger_warm() {
  [ -n "$liger_warm_waited" ] && return
  local waited=0 pid warm busy
  while [ "$waited" -lt "${LIGER_WARM_WAIT:-300}" ]; do
    busy=""
    for pid in $(cat "$liger_warm_dir"/*.pid 2>/dev/null); do kill -0 "$pid" 2>/dev/null && busy=1; done
    [ -z "$busy" ] && break
    sleep 5; waited=$((waited + 5))
  done
  for warm in "$liger_warm_dir"/*.log; do
    [ -e "$warm" ] || continue
    { echo "== warm-up $(basename "$warm" .log)"; cat "$warm"; } >> "$out/liger.log"
    record liger-warm "$(basename "$warm" .log)" "after ${waited} s of waiting: $(tail -n 1 "$warm" | cut -c1-200)"
  done
  liger_warm_waited=1
}

if phase liger-logp; then
  # Liger's SM90 lm-head kernels against linear_logp (issue 62): needs the liger set's CuTe DSL (.peers1 and .peers2)
  wait_liger_warm
  timeout "${LIGER_LOGP_TIMEOUT:-540}" "$py" bench/bench_linear_logp.py --liger --json "$out/liger-logp.json" 2>&1 \
    | tee "$out/liger-logp.log"
  record liger-logp "bench_linear_logp.py --liger" "exit ${PIPESTATUS[0]}"
fi

if phase liger; then
  # Liger's Triton MoE and, where .peers_lck* installed and its probe passes, the liger-cute-kernels MoE, against ours
  # and the grouped-mm path (issue 62), one process per ';'-separated entry of LIGER_SHAPES (bench_flash_moe.py's
  # names, ',' joins several in one process; LIGER_TIMEOUT seconds each), after the liger-warm processes (above).
  # Logs: OUT/liger.log (the warm-ups', the lck probe's, then each entry's), rows in OUT/liger-N.json.
  wait_liger_warm
  log="$out/liger.log"
  liger_env=(env TRITON_CACHE_DIR=$liger_cache) lck_flag=--no-lck
  if [ -d /tmp/peers_lck/liger_cute_kernels ]; then
    # its own site (NVSHMEM and the CUDA 12 runtime it links) for these processes only
    liger_env+=(PYTHONPATH=/tmp/peers_lck${PYTHONPATH:+:$PYTHONPATH}
                LD_LIBRARY_PATH=/tmp/peers_lck/nvidia/cuda_runtime/lib:/tmp/peers_lck/nvidia/nvshmem/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH})
    echo "== lck probe" >> "$log"
    "${liger_env[@]}" timeout 300 "$py" bench/peer_moe.py --probe-lck >> "$log" 2>&1 && lck_flag=--lck-probed
    # a probe that fails skips lck (its reason in liger.log), not the phase
    record liger "lck probe" "$([ "$lck_flag" = --lck-probed ] && echo "passed: timed" || echo "skipped (liger.log)")"
  else
    record liger "lck" "not installed (no .peers_lck* carried: scripts/peer_wheels.sh lck)"
  fi
  IFS=';' read -ra liger_entries <<< "${LIGER_SHAPES:-qwen3-30b-a3b;deepseek-v3;mixtral;qwen3-30b-a3b T=1024;qwen3-30b-a3b T=65536;sonicmoe-7b}"
  for i in "${!liger_entries[@]}"; do
    echo "== ${liger_entries[$i]}" >> "$log"
    "${liger_env[@]}" timeout "${LIGER_TIMEOUT:-420}" "$py" bench/bench_flash_moe.py --liger $lck_flag \
      --shapes "${liger_entries[$i]}" --json "$out/liger-$i.json" >> "$log" 2>&1
    record liger "${liger_entries[$i]}" "exit $?"
  done
fi

if phase profile; then
  # Nsight Compute on PROFILE (a script and its arguments), the kernels matching PROFILE_KERNELS (a regex), at most
  # PROFILE_COUNT launches, PROFILE_SET sections; the report and its details page go to OUT (clocks left alone).
  # shellcheck disable=SC2086
  timeout 540 ncu --clock-control none --set "${PROFILE_SET:-full}" -c "${PROFILE_COUNT:-8}" \
    ${PROFILE_SKIP:+--launch-skip "$PROFILE_SKIP"} \
    -k "regex:${PROFILE_KERNELS:?PROFILE_KERNELS: a regex}" --export "$out/profile" --force-overwrite \
    "$py" ${PROFILE:?PROFILE: a script and its arguments} > "$out/profile.log" 2>&1
  record profile "$PROFILE" "exit $?; $(tail -n 1 "$out/profile.log")"
  ncu --import "$out/profile.ncu-rep" --page details > "$out/profile.txt" 2>&1
  # the warp-state samples per SASS instruction (where a kernel's warps wait: mainloop or epilogue)
  ncu --import "$out/profile.ncu-rep" --page source --print-source sass --csv > "$out/profile_sass.csv" 2>&1
  "$py" bench/diagnostics/ncu_sass.py "$out/profile_sass.csv" > "$out/profile_sass.txt" 2>&1
fi

if phase hbm; then
  # Nsight Compute's HBM and L2 counters (bench/diagnostics/ncu_hbm.py's METRICS) of PROFILE's launches matching PROFILE_KERNELS
  # (at most PROFILE_COUNT), one line per launch in hbm.txt; e.g. PROFILE="bench/diagnostics/profile_flash_moe.py --shape
  # deepseek-v3 --backward --plain --calls 2" PROFILE_KERNELS="moe_gemm_kernel" PROFILE_COUNT=8.
  metrics=$("$py" -c 'import sys; sys.path.insert(0, "bench/diagnostics"); import ncu_hbm; print(ncu_hbm.METRICS)')
  # shellcheck disable=SC2086
  timeout 540 ncu --clock-control none --csv --print-units base --metrics "$metrics" -c "${PROFILE_COUNT:-8}" \
    -k "regex:${PROFILE_KERNELS:?PROFILE_KERNELS: a regex}" "$py" ${PROFILE:?PROFILE: a script and its arguments} \
    > "$out/hbm.csv" 2> "$out/hbm.log"
  code=$?
  "$py" bench/diagnostics/ncu_hbm.py < "$out/hbm.csv" > "$out/hbm.txt" 2>> "$out/hbm.log"
  record hbm "$PROFILE" "exit $code; $(wc -l < "$out/hbm.txt") launches in hbm.txt"
  cat "$out/hbm.txt"
fi

if phase ab; then
  variant_args=()
  for name in ${AB_VARIANTS:-$(ls .variants 2>/dev/null)}; do
    [ -f "/tmp/variants/$name/.built" ] || continue
    if [ -f "/tmp/variants/$name/.smoke_failed" ]; then record ab "$name" "left out: its smoke check failed"; continue; fi
    variant_args+=(--variant "$name=/tmp/variants/$name")
  done
  case " ${AB_VARIANTS:-stable-wheel} " in  # the stable phase's site, unless AB_VARIANTS leaves it out
    *" stable-wheel "*) [ -f /tmp/stable_site/.installed ] && variant_args+=(--variant stable-wheel=/tmp/stable_site);;
  esac
  IFS=';' read -ra ab_benches <<< "${AB_BENCH:?AB_BENCH names the benchmark}"
  for i in "${!ab_benches[@]}"; do
    # split as the shell would, so a quoted argument keeps its spaces ("--shapes 'qwen3-30b-a3b T=1024'")
    eval "bench_args=(${ab_benches[$i]})"
    timeout 540 "$py" bench/ab.py --rounds "${AB_ROUNDS:-2}" --json "$out/ab-$i.json" "${variant_args[@]}" \
      -- "${bench_args[@]}" \
      2>&1 | tee -a "$out/ab.log"
    record ab "bench/ab.py ${ab_benches[$i]}" "exit ${PIPESTATUS[0]}"
  done
fi

echo; echo "== gpu_check summary =="
# The device copy of the tree has no .git: pass COMMIT=<hash> from the machine that sent it.
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
"$py" -c 'import sys, torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| commit", sys.argv[1])' "$commit"
awk -F'\t' '{ printf "%-9s %-40s %s\n", $1, $2, $3 }' "$results"
for log in "$out"/bench_*.log; do
  [ -f "$log" ] || continue
  echo "-- $(basename "$log" .log)"; grep -E '^\||^ours' "$log" | tail -n 8
done
[ -f "$out/liger.log" ] && { echo "-- liger MoE (ms)"; grep -E '^liger |^  (ours|liger-|grouped-mm)' "$out/liger.log"; }
[ -f "$out/liger-logp.log" ] && { echo "-- liger lm-head"; grep -E '^\||skipped' "$out/liger-logp.log"; }
[ -f "$out/ab.log" ] && { echo "-- A/B (median ms over rounds, ratio to the tree)"; grep -E '^\|' "$out/ab.log"; }
! grep -qE 'FAILED|failed|exit [1-9]' "$results"
