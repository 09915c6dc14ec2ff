#!/usr/bin/env bash
# One device-tool call: several tune_decode.py runs (each argument is one run's argument string), e.g.
# candidate kernels (--kernel NAME=FILE or NAME=variant:V) against the library kernel, full cursor cycles,
# graph-captured; with GPU_TESTS=1, then the op's GPU test matrix (tests/test_op_gpu.py) on the library kernel.
#   usage: GPU_TESTS=1 bash benchmarks/run_device_variants.sh "--hv 32 --batch 512 --state fp32 --kernel p2=variant:prefetch2" ...
set -u
source benchmarks/device_setup.sh || exit 1
i=0
for run in "$@"; do
  i=$((i + 1))
  timeout "${RUN_TIMEOUT:-400}" python3 benchmarks/tune_decode.py --tag "tune_$i" $run 2>&1 | grep -E "us/step|copy|FAILED|regs=" \
    | sed -E 's/, .launch_cooperative.*//' | cut -c1-200
done
if [ "${GPU_TESTS:-0}" = 1 ]; then
  echo "== $(date +%T) gpu op tests"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_op_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "rc=$?"; tail -3 "$OUT/gpu_tests.log"
fi
