#!/usr/bin/env bash
# Nsight Compute profile of the tensor-core verify kernel at one or more shapes (GPU machine, carry .devwheels):
# per shape the kernel's key metrics (duration, occupancy, issue rate, DRAM throughput) and its hottest SASS
# instructions with their stall reasons (benchmarks/ncu_hot.py). Reports stay under $OUT.
#   usage: SHAPES="8x8 32x128" STATES="bf16" bash benchmarks/profile_verify.sh      (HVxB pairs)
set -u
source benchmarks/device_setup.sh || exit 1
for state in ${STATES:-bf16}; do
  for shape in ${SHAPES:-32x8 32x128}; do
    hv=${shape%x*}; b=${shape#*x}; rep="$OUT/verify_${state}_hv${hv}_b${b}"
    echo "== $(date +%T) verify HV$hv B$b $state"
    timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --kernel-name regex:verify_mma --launch-skip 3 \
      --launch-count 1 --set full --import-source yes -f -o "$rep" \
      python3 benchmarks/bench_spec.py --batch "$b" --heads "$hv" --state "$state" --rep-ms 5 \
      > "$rep.log" 2>&1 || { echo "ncu rc=$?"; tail -5 "$rep.log"; }
    [ -f "$rep.ncu-rep" ] || continue
    ncu --import "$rep.ncu-rep" --page details --csv 2>/dev/null | grep -E \
      '"(Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|Warp Cycles Per Issued Instruction|Issue Slots Busy|Executed Ipc Active|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Hit Rate|L2 Hit Rate|Waves Per SM|Grid Size|Block Size)"' \
      | awk -F'","' '{print $(NF-2)": "$NF" "$(NF-1)}' | tr -d '"'
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>/dev/null
    python3 benchmarks/ncu_hot.py "$rep.sass.csv" --top "${TOP:-40}"
  done
done
