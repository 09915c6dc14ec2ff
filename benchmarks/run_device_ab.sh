#!/usr/bin/env bash
# One device-tool call: A/B timings of the library kernel against candidate files (tune_decode.py runs,
# each argument one run's argument string), then the op's GPU test matrix on the library kernel.
#   usage: bash benchmarks/run_device_ab.sh "--hv 32 --batch 512 --state fp32 --default-only --kernel rev=FILE" ...
set -u
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
source benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
tail -1 "$OUT/setup.log"; rm -f "$OUT/setup.log"
i=0
for run in "$@"; do
  i=$((i + 1))
  timeout 150 python3 benchmarks/tune_decode.py $run 2>&1 | grep -E "us/step|FAILED|regs=" | sed -E 's/, .launch_cooperative.*//' | cut -c1-160
  mv "$OUT/tune.json" "$OUT/tune_$i.json" 2>/dev/null
done
echo "== $(date +%T) gpu op tests"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_op_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$OUT/gpu_tests.log"
