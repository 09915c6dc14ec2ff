#!/usr/bin/env bash
# session 23 call 3: the fused advance's / pool's / cursor kernel's GPU tests on the working tree (count_after_loads),
# then HV12 B8 and HV4 B32 bf16 fused step, base (HEAD 69b9acf) vs the working tree
set -u
source benchmarks/device_setup.sh || exit 1
echo "== $(date +%T) gpu tests"
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_advance.py tests/test_pool.py \
  tests/test_cursor_kernel.py > "$OUT/gpu_tests.log" 2>&1; echo "rc=$?"; tail -5 "$OUT/gpu_tests.log"
mkdir -p "$OUT/ab3"
for side in base new; do
  if [ $side = base ]; then pp=$PWD/ab_base:$PYTHONPATH; else pp=$PYTHONPATH; fi
  echo "== $(date +%T) $side"
  PYTHONPATH=$pp timeout 70 python3 benchmarks/bench_decode.py --out "$OUT/ab3" --no-plot --ring-layout predecayed \
    --fused-advance --only ours --no-eager --no-repeat --state bf16 --heads 12,4 --batch 8,32 --tag "g_$side" \
    > "$OUT/ab3/g_$side.log" 2>&1; echo "rc=$?"
  python3 -c "
import json; d=json.load(open('$OUT/ab3/g_$side.json'))
for r in d['results']: print(r.get('HV'), r.get('B'), r.get('ours_fused_us'), r.get('ours_op_us'), r.get('ours_check'))" 2>&1 | tail -4
done
