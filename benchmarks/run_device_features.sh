#!/usr/bin/env bash
# One run on one H200: GPU tests, then the benchmarks of the pool's features around the decode kernel
# (conv, verify + commit, fork/export/import, the TP KDA layer), each stage under its own time limit, so that a stage
# cut short still leaves the others' results. Everything lands in $OUT/features/ and is packed into ONE file,
# $OUT/features.tgz (a remote run may bring back only a few files).
#   usage (on the GPU machine, .devwheels carried):  bash benchmarks/run_device_features.sh
#   env:  STAGES        which stages, in order (default "tests spec conv lifecycle layer")
#         TEST_ARGS     pytest arguments after "-m gpu" (default tests/); TEST_TIMEOUT seconds (default 270)
#         SPEC_ARGS, CONV_ARGS, LIFECYCLE_ARGS, LAYER_ARGS: arguments of each benchmark (defaults below)
#         SPEC_S, CONV_S, LIFECYCLE_S, LAYER_S: each stage's time limit in seconds
set -u
source benchmarks/device_setup.sh || exit 1
packed=$OUT
export OUT=$OUT/features
mkdir -p "$OUT"

stage() {  # name, seconds, command...
  local name=$1 secs=$2
  shift 2
  echo "== $(date +%T) $name (limit ${secs}s): $*"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc"
  tail -n "${TAIL:-30}" "$OUT/$name.log" | grep -v "Warning\|warn("
}

run() {
  for s in ${STAGES:-tests spec conv lifecycle layer}; do
    case $s in
      tests)
        # shellcheck disable=SC2086  # TEST_ARGS is a list of arguments
        # -v: one line per test as it ends, so a stage cut by its limit still names what failed; each failure's
        # traceback goes to gpu_failures.log as it happens (tests/_fail_log.py)
        export TP_REPLAYSSM_FAIL_LOG="$OUT/gpu_failures.log"
        stage gpu_tests "${TEST_TIMEOUT:-270}" python3 -m pytest -n "${WORKERS:-14}" -m gpu -v -rfE \
          -p no:cacheprovider --timeout 200 ${TEST_ARGS:-tests}
        grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | grep -v "^E " | sort -u | head -n 40
        grep -s "^===== FAILED" "$OUT/gpu_failures.log"
        ;;
      spec)
        # shellcheck disable=SC2086
        stage bench_spec "${SPEC_S:-90}" python3 benchmarks/bench_spec.py --out "$OUT" ${SPEC_ARGS:---quick}
        ;;
      conv)
        # shellcheck disable=SC2086
        stage bench_conv "${CONV_S:-70}" python3 benchmarks/bench_conv.py --out "$OUT/bench_conv.json" \
          ${CONV_ARGS:---shapes 8x8,32x128 --state bf16 --budget-s 40}
        ;;
      lifecycle)
        # shellcheck disable=SC2086
        stage bench_lifecycle "${LIFECYCLE_S:-60}" python3 benchmarks/bench_lifecycle.py --out "$OUT" \
          ${LIFECYCLE_ARGS:---states fp32 --export-slots 1,32 --reps 10}
        ;;
      layer)
        # shellcheck disable=SC2086
        stage bench_layer "${LAYER_S:-80}" python3 benchmarks/bench_layer.py --out "$OUT" \
          ${LAYER_ARGS:---batch 8,64}
        ;;
      *) echo "unknown stage $s" ;;
    esac
  done
}

run 2>&1 | tee "$OUT/features.log"
(cd "$packed" && tar czf features.tgz features && rm -rf features)
echo "packed into $packed/features.tgz"
