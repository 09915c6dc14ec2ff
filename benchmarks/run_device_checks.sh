#!/usr/bin/env bash
# One run on one H200: every GPU test (pytest -n 8 -m gpu tests/; the multi-GPU ones skip on one GPU), then the
# baseline benchmark (run_device_bench.sh) in the time the call has left. Everything is written under $OUT/checks/ and
# packed into ONE file, $OUT/checks.tgz (a remote run may bring back only a few files): checks.log (what this script
# printed), gpu_tests.log, gpu_failures.log (each failure's traceback, written as it happened), the tests' own outputs
# (gpu_op_errors.json), bench_decode.{json,csv,log}.
#   usage (on the GPU machine, .devwheels carried):  bash benchmarks/run_device_checks.sh
#   env:  TEST_ARGS     pytest arguments after "-m gpu" (default tests/)
#         TEST_TIMEOUT  seconds for the tests (default 300)
#         BENCH=0       the tests only; BENCH_ARGS is passed on to bench_decode.py (e.g. "--quick")
#         CALL_S        the call's limit in seconds (default 590); the benchmark's budget is what is left, less 100
# The tests need pytest and pytest-xdist among the carried wheels; without xdist they run in one process (slower).
set -u
start=$SECONDS
source benchmarks/device_setup.sh || exit 1
packed=$OUT
export OUT=$OUT/checks
mkdir -p "$OUT"

checks() {
  local workers="-n 8"
  if ! python3 -c "import xdist" 2>/dev/null; then
    workers=""
    echo "pytest-xdist is not among the carried wheels: the GPU tests run in one process"
  fi
  echo "== $(date +%T) GPU tests"
  # shellcheck disable=SC2086  # workers and TEST_ARGS are lists of arguments
  # each failure's traceback goes to gpu_failures.log as it happens (tests/_fail_log.py)
  TP_REPLAYSSM_FAIL_LOG="$OUT/gpu_failures.log" timeout "${TEST_TIMEOUT:-300}" python3 -m pytest $workers -m gpu -q \
    -p no:cacheprovider ${TEST_ARGS:-tests} > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?"
  grep -E "passed|failed|[0-9] error|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 20
  grep -s "^===== FAILED" "$OUT/gpu_failures.log"
  if [ "${BENCH:-1}" != 0 ]; then
    local left=$(( ${CALL_S:-590} - (SECONDS - start) - 100 ))
    if [ "$left" -ge 30 ]; then
      echo "== $(date +%T) baseline benchmark, shapes started within $left s"
      BENCH_BUDGET_S=$left bash benchmarks/run_device_bench.sh
    else
      echo "== no time left for the baseline benchmark ($left s)"
    fi
  fi
}

checks 2>&1 | tee "$OUT/checks.log"
(cd "$packed" && tar czf checks.tgz checks && rm -rf checks)
echo "packed into $packed/checks.tgz"
