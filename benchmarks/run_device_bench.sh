#!/usr/bin/env bash
# The baseline table on one H200: ours (the pool's decode step on pre-decayed rings, with its cursor advance) against
# FLA 0.6.0's packed in-place decode at the standard shapes (benchmarks/bench_shapes.py: 70 shapes in priority
# order), graph-captured, averaged over full cursor cycles (benchmarks/bench_decode.py).
#   usage (on the GPU machine, .devwheels carried):  bash benchmarks/run_device_bench.sh
#   env:  BENCH_ARGS      more bench_decode.py arguments, e.g. "--quick", "--start-at 40", "--ring-layout sglang",
#                         "--override value_tile=64 --tag vt64"
#         BENCH_BUDGET_S  seconds in which shapes are started (default 450; the rest are listed as skipped: run again
#                         with --start-at N and merge the parts with benchmarks/plot_results.py)
# Writes $OUT/<tag>.json and $OUT/<tag>.csv (tag bench_decode unless BENCH_ARGS gives --tag) and
# $OUT/bench_decode.log, and prints the summary and the table (ours_us, fla_us, xFLA = fla_us / ours_us, win, and a
# last line counting the shapes where FLA is faster). Exit status: bench_decode.py's (1: a check said WRONG).
set -u
source benchmarks/device_setup.sh || exit 1
budget=${BENCH_BUDGET_S:-450}
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout $((budget + 100)) python3 benchmarks/bench_decode.py --no-plot --budget-s "$budget" ${BENCH_ARGS:-} \
  > "$OUT/bench_decode.log" 2>&1
rc=$?
if grep -q "^== bench_decode" "$OUT/bench_decode.log"; then
  sed -n '/^== bench_decode/,$p' "$OUT/bench_decode.log"
else
  tail -n 40 "$OUT/bench_decode.log"
fi
echo "bench_decode rc=$rc"
exit $rc
