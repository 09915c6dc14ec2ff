#!/usr/bin/env bash
# One device-tool call: Helion config keys the hand sweeps never tried (load eviction policies, loop
# unrolling, program order) on top of the pinned choices, then Helion's own autotuner at HV32 B512 fp32.
# usage (device tool, carry .devwheels):  bash benchmarks/run_device_autotune.sh
# env: AUTOTUNE_S (autotuner budget, default 200), SHAPES (tune_decode shape args), OVERRIDES=0 (skip the
# override sweep), GPU_TESTS=1 (the GPU test matrix before the autotuner)
set -u
source benchmarks/device_setup.sh || exit 1
LOG="$OUT/autotune.log"
step() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
# load_eviction_policies index -> load: 1, 13 checkpoint chunks; 4, 14 ring deltas; 5, 6 ring gates/keys;
# 7, 8, 9, 12, 15 q, k, a, b, v; 16-18 the flush replay's key, delta and gate rows (Helion's order of the
# kernel's loads, read from its generated code for the batch path)
OVR=( --override 'again={}' --override 'ev_state_first={"load_eviction_policies":["","first","","","","","","","","","","","","first","","","","",""]}' --override 'ev_state_first_ring_last={"load_eviction_policies":["","first","","","last","last","last","","","","","","","first","last","","last","last","last"]}' --override 'ev_stream_first={"load_eviction_policies":["","first","","","first","first","first","first","first","first","","","first","first","first","first","","",""]}' --override 'unroll_chunk2={"range_unroll_factors":[0,2,0]}' --override 'unroll_replay2={"range_unroll_factors":[0,0,2]}' --override 'order_heads_first={"loop_orders":[[1,2,0,3]]}' )
if [ "${OVERRIDES:-1}" != 0 ]; then
step "tune_decode overrides"
timeout 240 python3 benchmarks/tune_decode.py ${SHAPES:---hv 32 8 --batch 512 --state fp32 bf16} --default-only \
  "${OVR[@]}" --tag tune_overrides >> "$LOG" 2>&1; echo "rc=$?"
grep -E "us/step|best|FAILED" "$LOG" | tail -40
fi
if [ "${GPU_TESTS:-0}" != 0 ]; then
  step "gpu tests"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_op_gpu.py tests/test_pool.py \
    tests/test_cursor_kernel.py >> "$LOG" 2>&1
  echo "rc=$?"; grep -E "passed|failed|Error|FAILED" "$LOG" | tail -8
  cp "$OUT/gpu_op_errors.json" "$OUT/gpu_op_errors_autotune_call.json" 2>/dev/null
fi
step "helion autotuner"
timeout ${AUTOTUNE_TIMEOUT:-330} python3 benchmarks/autotune_decode.py --hv 32 --batch 512 --state fp32 --budget-s ${AUTOTUNE_S:-200} \
  >> "$LOG" 2>&1; echo "rc=$?"
grep -E "autotune:|us/step" "$LOG" | tail -6
