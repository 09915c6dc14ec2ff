#!/usr/bin/env bash
# One device-tool call on the two-GPU machine (kind nvidia-h200-x2, carry .devwheels): the two-GPU NCCL
# tests (launcher end to end, placement faults on real devices, TP equivalence), the launcher's timing
# on 2 ranks, the placement-check cost over NCCL ranks; then, with GPU_TESTS=1, the one-GPU test matrix
# and, with BENCH=1, bench_decode --quick.
#   usage: GPU_TESTS=1 BENCH=1 bash benchmarks/run_device_multigpu.sh
set -u
source benchmarks/device_setup.sh || exit 1
LOG="$OUT/multigpu.log"
step() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$LOG"
step "two-GPU tests"
timeout "${MULTI_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -m multigpu -rA tests/test_multigpu.py \
  tests/test_op_gpu.py tests/test_cursor_kernel.py >> "$LOG" 2>&1
echo "rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOG" | tail -14
step "launcher, 2 NCCL ranks, kimi-linear 20 layers"
timeout 90 torchrun --standalone --nproc-per-node 2 launch/decode.py --device cuda --shape kimi-linear --steps 24 \
  --batch 64 --ring-length 16 --max-len 40 --min-len 8 >> "$LOG" 2>&1; echo "rc=$?"
grep -E "RESULT|throughput|rank [01] cuda|host time|pool build" "$LOG" | tail -7
step "bench_placement, 2 NCCL ranks"
timeout 60 torchrun --standalone --nproc-per-node 2 benchmarks/bench_placement.py --device cuda --shape kimi-linear \
  >> "$LOG" 2>&1; echo "rc=$?"; tail -4 "$LOG"
if [ "${GPU_TESTS:-0}" = 1 ]; then
  step "one-GPU test matrix"
  timeout "${TEST_TIMEOUT:-260}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_op_gpu.py tests/test_pool.py \
    tests/test_cursor_kernel.py > "$OUT/gpu_tests.log" 2>&1
  echo "rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
fi
if [ "${BENCH:-0}" = 1 ]; then
  step "bench_decode --quick"
  timeout "${BENCH_TIMEOUT:-110}" python3 benchmarks/bench_decode.py --quick --budget-s 75 >> "$LOG" 2>&1; echo "rc=$?"
  grep -E "^\| *[0-9]" "$LOG" | tail -9
fi
rm -f "$OUT"/*.png
