#!/usr/bin/env bash
# One device-tool call: Nsight Compute counters of the decode kernel (needs a Firecracker machine; see
# the device tool's KINDS.md): the details page, the warp-stall breakdown and the SASS hot spots.
# usage: bash benchmarks/run_device_ncu.sh [name:profile_decode args ...]
set -u
source benchmarks/device_setup.sh || exit 1
uname -r
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
 --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section SourceCounters"
prof() {  # name, profile_decode args...
  local name=$1; shift
  timeout 150 ncu --clock-control none --kernel-name regex:replayssm --launch-skip 3 --launch-count 1 $SECTIONS \
    --import-source no -f -o "$OUT/$name" python3 benchmarks/profile_decode.py "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; tail -1 "$OUT/$name.log"
  ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name.txt" 2>&1
  echo "== stall samples (raw page)" >> "$OUT/$name.txt"
  ncu --import "$OUT/$name.ncu-rep" --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
for name, unit, val in zip(rows[0], rows[1], rows[2]):
    if 'pcsamp' in name or 'warp_latency' in name or 'stall' in name:
        print(name, unit, val)" >> "$OUT/$name.txt" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>/dev/null
  python3 benchmarks/ncu_hot.py "$OUT/$name.sass.csv" >> "$OUT/$name.txt" 2>&1
  rm -f "$OUT/$name.sass.csv" "$OUT/$name.log" "$OUT/$name.ncu-rep"
}
if [ $# -eq 0 ]; then
  set -- "hv32_b512_fp32_c8:--hv 32 --batch 512 --state fp32 --cursor 8" \
         "hv32_b512_fp32_c15:--hv 32 --batch 512 --state fp32 --cursor 15"
fi
for spec in "$@"; do prof "${spec%%:*}" ${spec#*:}; done
