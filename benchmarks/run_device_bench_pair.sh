#!/usr/bin/env bash
# One device-tool call on the two-GPU machine (kind nvidia-h200-x2, carry .devwheels): two bench_decode.py
# runs at once, each pinned to one GPU (CUDA_VISIBLE_DEVICES), so a sweep takes half the device time (the
# twelfth session's sweep ran this way). Each argument is one run's argument string; results go to
# $OUT/<tag>.{json,csv} (give each run its own --tag), logs beside them, all packed into $OUT/bench_pair.tgz
# (the device tool returns few files). Merge the parts here with benchmarks/plot_results.py.
#   usage: bash benchmarks/run_device_bench_pair.sh "--heads 32,8 --state fp32 --tag part0 --budget-s 400" \
#                                                   "--heads 32,8 --state bf16 --tag part1 --budget-s 400"
set -u
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT/pair"
gpu=0
for run in "$@"; do
  ( CUDA_VISIBLE_DEVICES=$gpu timeout "${RUN_TIMEOUT:-540}" python3 benchmarks/bench_decode.py --out "$OUT/pair" \
      --no-plot $run > "$OUT/pair/gpu$gpu.log" 2>&1
    echo "== gpu $gpu rc=$? $(date +%T): $run"; tail -n 30 "$OUT/pair/gpu$gpu.log" | cut -c1-140 ) > "$OUT/pair/gpu$gpu.txt" &
  gpu=$((gpu + 1))
done
wait
cat "$OUT"/pair/gpu*.txt
(cd "$OUT" && tar czf bench_pair.tgz pair && rm -rf pair)
