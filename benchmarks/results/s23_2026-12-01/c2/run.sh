#!/usr/bin/env bash
# session 23 call 2: fused step, base (HEAD) vs v1 (relaxed cursor read, count after the input loads), bf16 state
set -u
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT/ab2"
i=0
for shape in "--heads 32,8 --batch 8,32" "--heads 12,16 --batch 32,128" "--heads 4 --batch 8,512" "--heads 12,8 --batch 1"; do
  i=$((i + 1))
  for side in base v1; do
    if [ $side = base ]; then pkg=ab_base; else pkg=abv/$side; fi
    echo "== $(date +%T) $side: $shape"
    PYTHONPATH=$PWD/$pkg:$PYTHONPATH timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/ab2" --no-plot \
      --ring-layout predecayed --fused-advance --only ours --no-eager --no-repeat --state bf16 $shape \
      --tag "g${i}_$side" > "$OUT/ab2/g${i}_$side.log" 2>&1; echo "rc=$?"
    python3 -c "
import json; d=json.load(open('$OUT/ab2/g${i}_$side.json'))
for r in d['results']: print(r.get('HV'), r.get('B'), r.get('ours_fused_us'), r.get('ours_op_us'), r.get('ours_check'), r.get('floor_replay_us'))" 2>&1 | tail -6
  done
done
(cd "$OUT" && tar czf ab2.tgz ab2 && rm -rf ab2)
