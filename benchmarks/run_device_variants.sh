#!/usr/bin/env bash
# One device-tool call: several tune_decode.py runs (each argument is one run's argument string), e.g.
# candidate kernel files (--kernel NAME=FILE) against the library kernel, full cursor cycles, graph-captured.
#   usage: bash benchmarks/run_device_variants.sh "--hv 32 --batch 512 --state fp32 --kernel p2=benchmarks/experiments/prefetch2.py" ...
set -u
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
source benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
tail -1 "$OUT/setup.log"; rm -f "$OUT/setup.log"
i=0
for run in "$@"; do
  i=$((i + 1))
  timeout 400 python3 benchmarks/tune_decode.py $run 2>&1 | grep -E "us/step|copy|FAILED|regs=" | sed -E 's/, .launch_cooperative.*//' | cut -c1-200
  mv "$OUT/tune.json" "$OUT/tune_$i.json" 2>/dev/null
done
