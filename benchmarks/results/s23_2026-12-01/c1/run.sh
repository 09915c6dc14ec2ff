#!/usr/bin/env bash
# session 23 call 1: fused-advance cursor read A/B (base = HEAD 69b9acf, v1 = relaxed read + count after the
# input loads, v2 = relaxed read + count at the program's end), then the 9 key-tile op GPU tests
set -u
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT/ab"
for shape in "--heads 4 --batch 128 --state bf16" "--heads 16 --batch 8 --state bf16" "--heads 32 --batch 1 --state bf16"; do
  for side in base v1 v2 base; do
    if [ $side = base ]; then pkg=ab_base; else pkg=abv/$side; fi
    tag="$(echo $shape | tr -d ' -' )_$side"
    echo "== $(date +%T) $side: $shape"
    PYTHONPATH=$PWD/$pkg:$PYTHONPATH timeout 100 python3 benchmarks/bench_decode.py --out "$OUT/ab" --no-plot \
      --ring-layout predecayed --fused-advance --only ours --no-eager --no-repeat $shape --tag "$tag" 2>&1 \
      | grep -E "^\| *[0-9]|rror|FAIL" | cut -c1-200
    python3 -c "import json,sys; r=json.load(open('$OUT/ab/$tag.json'))['results'][0]; print({k: round(v,3) for k,v in r.items() if k.endswith('_us')})" 2>&1 | tail -1
  done
done
echo "== $(date +%T) key-tile op tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider $(cat abv/keytile_op_ids.txt) 2>&1 | tail -4
(cd "$OUT" && tar czf ab.tgz ab && rm -rf ab)
