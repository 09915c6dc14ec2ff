#!/usr/bin/env bash
# One device-tool call: the GPU tests, the decode benchmark against FLA, the pool-overhead benchmark,
# the placement-check cost and the launcher on CUDA.
# usage (device tool, carry .devwheels):  bash benchmarks/run_device_checks.sh
# env: BENCH_DECODE=0 / PLACEMENT=0 / LAUNCHER=0 skip those steps (to fit one call with a longer test run);
# GPU_TEST_FILES replaces the test files. Since the tensor-core flush (tenth session) the whole GPU matrix
# needs more than 320 s (compiles): BENCH_DECODE=0 PLACEMENT=0 LAUNCHER=0 TEST_TIMEOUT=450 fits one call
set -u
source benchmarks/device_setup.sh || exit 1
LOG="$OUT/checks.log"
step() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
step "gpu tests"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
  ${GPU_TEST_FILES:-tests/test_op_gpu.py tests/test_pool.py tests/test_cursor_kernel.py} >> "$LOG" 2>&1
echo "rc=$?"; grep -E "passed|failed|Error|FAILED" "$LOG" | tail -8
if [ "${BENCH_DECODE:-1}" != 0 ]; then
  step "bench_decode --quick"
  timeout 110 python3 benchmarks/bench_decode.py --quick --budget-s 75 >> "$LOG" 2>&1; echo "rc=$?"
  grep -E "^\| *[0-9]" "$LOG" | tail -9
fi
step "bench_pool_overhead --quick"
timeout 75 python3 benchmarks/bench_pool_overhead.py --quick --eager-calls 100 >> "$LOG" 2>&1; echo "rc=$?"
tail -12 "$LOG"
if [ "${PLACEMENT:-1}" != 0 ]; then
  step "bench_placement --device cuda"
  timeout 45 torchrun --standalone --nproc-per-node 1 benchmarks/bench_placement.py --device cuda --shape kimi-linear \
    >> "$LOG" 2>&1; echo "rc=$?"; tail -6 "$LOG"
fi
[ "${LAUNCHER:-1}" != 0 ] || { rm -f "$OUT"/*.png; exit 0; }
step "launcher --device cuda"
timeout 60 torchrun --standalone --nproc-per-node 1 launch/decode.py --device cuda --shape kimi-linear --steps 12 \
  >> "$LOG" 2>&1; echo "rc=$?"; tail -14 "$LOG"
rm -f "$OUT"/*.png
