#!/usr/bin/env bash
# One run: an A/B of the pool's decode step between another checkout of the library and this one
# (benchmarks/bench_pool_step.py run twice, graph-captured, cycle-averaged), after a selection of GPU tests.
#   usage (on the GPU machine; carry .devwheels and the folder BASE, which holds the other checkout's tp_replayssm/):
#     BASE=.devab/base_pkg TESTS="tests/test_slot_safety.py tests/test_op_gpu.py" bash benchmarks/run_device_ab.sh
#   env: SHAPES_BF16 / SHAPES_FP32 (HVxB lists for bench_pool_step), TEST_TIMEOUT (default 240 s), STEP_ARGS (the
#   bench's form options, default "--both"; below B = 128 a one-layer cycle keeps the state in L2, so time small
#   batches with "--forms decode" or "--layers 8 --forms fused,decode+advance": docs/pitfalls.md), ROUNDS (default 1:
#   the sides alternate, one process each, per round). BENCH=spec times verify + commit instead
#   (benchmarks/bench_spec.py, HV32, one process per side, shape and round): SPEC_RUNS, a list of "state:batch" (default
#   "bf16:8 bf16:32 bf16:128 fp32:32 fp32:128"); each row's package path is printed from its json; SPEC_ARGS, more
#   bench_spec options for every side (e.g. "--layers 8"). EDIT_ARGS adds a third side, this checkout with those
#   bench options (a plan edit: "--override pinned_loads=true --fused-override pinned_loads=true" for
#   bench_pool_step, "--override early_params=true" for bench_spec); without BASE only this checkout's sides run
set -u
source benchmarks/device_setup.sh || exit 1
if [ -n "${TESTS:-}" ]; then
  echo "== $(date +%T) GPU tests: $TESTS"
  # shellcheck disable=SC2086  # TESTS is a list of paths
  TP_REPLAYSSM_FAIL_LOG="$OUT/gpu_failures.log" timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -n 8 -m gpu -q \
    -p no:cacheprovider $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 25
  grep -s "^===== FAILED" "$OUT/gpu_failures.log"
fi
sides="${BASE:+base} new${EDIT_ARGS:+ edit}"
side_env() {  # path: the PYTHONPATH of side $1 (base: BASE's package first); extra: its bench options
  if [ "$1" = base ]; then path=/tmp/site:$PWD/$BASE:$PWD; else path=/tmp/site:$PWD; fi
  if [ "$1" = edit ]; then extra=$EDIT_ARGS; else extra=; fi
}
if [ "${BENCH:-step}" = spec ]; then
  for round in $(seq 1 "${ROUNDS:-1}"); do
    for run in ${SPEC_RUNS:-bf16:8 bf16:32 bf16:128 fp32:32 fp32:128}; do
      for side in $sides; do
        side_env $side
        out="$OUT/spec_${side}_${run/:/_b}_r$round"
        # shellcheck disable=SC2086  # SPEC_ARGS and EDIT_ARGS are lists of options
        PYTHONPATH=$path timeout 110 python3 benchmarks/bench_spec.py --batch "${run#*:}" --heads 32 \
          --state "${run%%:*}" --rep-ms 50 ${SPEC_ARGS:-} $extra --out "$out" 2>&1 | tail -n 1 \
          | sed "s/^/$side r$round: /"
        python3 -c "import json, sys; print('  package:', json.load(open(sys.argv[1]))['meta']['package'])" \
          "$out/bench_spec.json" 2>/dev/null
      done
    done
  done
  exit 0
fi
bf16=${SHAPES_BF16-8x1,32x1,8x8,32x8,8x32,8x128,32x128,8x512}
fp32=${SHAPES_FP32-8x8,32x128}
for round in $(seq 1 "${ROUNDS:-1}"); do
  for side in $sides; do
    side_env $side
    echo "== $(date +%T) $side r$round"
    for spec in "bf16 $bf16" "fp32 $fp32"; do
      set -- $spec
      [ -n "${2:-}" ] || continue  # (an empty shape list skips that dtype)
      # shellcheck disable=SC2086  # STEP_ARGS and EDIT_ARGS are lists of options
      PYTHONPATH=$path python3 benchmarks/bench_pool_step.py ${STEP_ARGS:---both} $extra --state "$1" --shapes "$2" \
        --out "$OUT/step_${side}_$1_r$round.json" 2>&1 | grep -v Warning
    done
  done
done
