#!/usr/bin/env bash
# One short device-tool call: persistent grids with a register cap (candidates VT:VC:WARPS:MAXNREG:PER_SM)
# against the pinned choice at the large-batch shapes.  usage: bash benchmarks/run_device_probe.sh
set -u
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
source benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
tail -1 "$OUT/setup.log"
timeout 150 python3 benchmarks/tune_decode.py --hv 32 8 --batch 512 --state fp32 bf16 \
  --cands 128:16:4:0:4 128:16:4:80:6 128:16:4:64:8 128:16:4:96:5 --budget-s 110 2>&1 \
  | grep -E "us/step|copy|FAILED|best" | cut -c1-300
