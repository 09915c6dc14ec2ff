#!/usr/bin/env bash
# One device-tool call on the two-GPU machine (kind nvidia-h200-x2, carry .devwheels), one process per GPU
# (CUDA_VISIBLE_DEVICES):
# - GPU 1: the GPU tests selected by $GPU_TESTS (pytest arguments after `-m gpu`; log $OUT/gpu_tests.log), then
#   a bench_decode.py run with the arguments $BENCH1 (if set);
# - GPU 0: a bench_decode.py run with the arguments $BENCH0 (if set), then tune_decode.py once per argument
#   string of the command line (give each its own --tag: results in $OUT/<tag>.json).
# bench_decode.py writes $OUT/<tag>.{json,csv} (give BENCH0 and BENCH1 their own --tag), logs $OUT/bench{0,1}.log.
#   usage: GPU_TESTS='tests/test_op_gpu.py -k predecayed' BENCH0='--heads 8 --batch 128 --tag b0' \
#          bash benchmarks/run_device_tune_and_tests.sh "--hv 12 --batch 128 --state bf16 --tag t1" ...
set -u
source benchmarks/device_setup.sh || exit 1
bench() {  # bench(gpu, args)
  CUDA_VISIBLE_DEVICES=$1 timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_decode.py --out "$OUT" --no-plot $2 \
    > "$OUT/bench$1.log" 2>&1
  echo "== $(date +%T) gpu $1 bench_decode rc=$?: $2"; grep -E "^\| *[0-9]" "$OUT/bench$1.log" | cut -c1-160
}
(
  if [ -n "${GPU_TESTS:-}" ]; then
    CUDA_VISIBLE_DEVICES=1 timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS \
      > "$OUT/gpu_tests.log" 2>&1
    echo "== $(date +%T) gpu tests rc=$?" >> "$OUT/gpu_tests.log"
  fi
  if [ -n "${BENCH1:-}" ]; then bench 1 "$BENCH1" > "$OUT/bench1.txt"; fi
) &
if [ -n "${BENCH0:-}" ]; then bench 0 "$BENCH0"; fi
for run in "$@"; do
  echo "== $(date +%T) tune_decode $run"
  CUDA_VISIBLE_DEVICES=0 timeout "${RUN_TIMEOUT:-400}" python3 benchmarks/tune_decode.py $run 2>&1 \
    | grep -E "us/step|copy|FAILED|Error|regs=" | sed -E 's/, .launch_cooperative.*//' | cut -c1-200
done
wait
tail -4 "$OUT/gpu_tests.log" 2>/dev/null
cat "$OUT/bench1.txt" 2>/dev/null || true
