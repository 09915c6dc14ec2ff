#!/usr/bin/env bash
# One device-tool call on a one- or two-GPU machine (carry .devwheels): runs of the benchmarks and tests in one chain
# per GPU, the chains at once (CUDA_VISIBLE_DEVICES). Each argument is one run, "GPU|TOOL|ARGS", TOOL one of
#   bench   bench_decode.py --out $OUT --no-plot ARGS (give each its own --tag);
#   tune    tune_decode.py ARGS (results in $OUT/<tag>.json);
#   pytest  python3 -m pytest -q ARGS, e.g. "-m gpu tests/test_fused_advance.py" (the last 25 lines go to the log);
#   py      python3 ARGS with OUT=$OUT/chains, e.g. "benchmarks/bench_pool_overhead.py --quick" (the last 40 lines).
# ARGS are split on spaces, so no argument can hold one (a pytest -k expression with "or" cannot: name test ids
# instead). Every run is cut at $RUN_TIMEOUT seconds (default 300); each chain's log is $OUT/chain<GPU>.log, and the
# result files and logs are packed into $OUT/chains.tgz (the device tool returns few files). Prints the runs'
# summary lines.
#   usage: bash benchmarks/run_device_chains.sh "0|bench|--heads 8 --batch 1 --tag a" "1|tune|--hv 8 --batch 1 --tag b"
set -u
source benchmarks/device_setup.sh || exit 1
mkdir -p "$OUT/chains"
chain() {  # chain(gpu): the runs of that GPU, in order
  for run in "${RUNS[@]}"; do
    IFS='|' read -r gpu tool args <<< "$run"
    [ "$gpu" = "$1" ] || continue
    echo "== $(date +%T) gpu $gpu $tool $args"
    case $tool in
      bench) CUDA_VISIBLE_DEVICES=$gpu timeout "${RUN_TIMEOUT:-300}" python3 benchmarks/bench_decode.py \
               --out "$OUT/chains" --no-plot $args 2>&1 | grep -E "^\[|Error|error" | cut -c1-170 ;;
      tune) CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/chains" timeout "${RUN_TIMEOUT:-300}" python3 benchmarks/tune_decode.py \
              $args 2>&1 | grep -E "us/step|FAILED|Error" | cut -c1-170 ;;
      pytest) CUDA_VISIBLE_DEVICES=$gpu timeout "${RUN_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider $args \
                2>&1 | tail -25 ;;
      py) CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/chains" timeout "${RUN_TIMEOUT:-300}" python3 $args 2>&1 | tail -40 ;;
      *) echo "unknown tool $tool" ;;
    esac
    echo "== $(date +%T) gpu $gpu rc=${PIPESTATUS[0]}"
  done
}
RUNS=("$@")
for gpu in $(printf '%s\n' "$@" | cut -d'|' -f1 | sort -u); do
  chain "$gpu" > "$OUT/chains/chain$gpu.log" 2>&1 &
done
wait
cat "$OUT"/chains/chain*.log
(cd "$OUT" && tar czf chains.tgz chains && rm -rf chains)
