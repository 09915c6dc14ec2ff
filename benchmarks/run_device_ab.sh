#!/usr/bin/env bash
# One device-tool call (carry .devwheels): the op alone (tune_decode.py --default-only) timed with a baseline copy of
# the package and then with the working tree's, shape group by shape group, so both see the same GPU state. The
# baseline is a folder holding a tp_replayssm/ package (not git-ignored, so the device tool copies it), e.g.
#   git worktree add /tmp/base HEAD && mkdir ab_base && cp -r /tmp/base/tp_replayssm ab_base/
# Each argument after the folder is one group of tune_decode.py arguments (split on spaces, give no --tag); the
# results go to $OUT/ab/base_<i>.json and new_<i>.json, the log to $OUT/ab/ab.log, packed into $OUT/ab.tgz. A group
# that starts with "new:" runs with the working tree's package only (e.g. one that times --kernel variants).
#   usage: bash benchmarks/run_device_ab.sh ab_base "--hv 4 --batch 128 --state bf16 --ring-layout predecayed" ...
set -u
source benchmarks/device_setup.sh || exit 1
base=$(cd "$1" && pwd); shift
mkdir -p "$OUT/ab"
i=0
for args in "$@"; do
  i=$((i + 1))
  sides="base new"
  case $args in new:*) sides=new; args=${args#new:} ;; esac
  for side in $sides; do
    echo "== $(date +%T) $side $i: $args"
    if [ $side = base ]; then pp="$base:$PYTHONPATH"; else pp="$PYTHONPATH"; fi
    PYTHONPATH=$pp OUT="$OUT/ab" timeout "${RUN_TIMEOUT:-200}" python3 benchmarks/tune_decode.py --default-only $args \
      --tag "${side}_$i" 2>&1 | grep -E "us/step|FAILED|Error" | cut -c1-170
  done
done > "$OUT/ab/ab.log" 2>&1
cat "$OUT/ab/ab.log"
(cd "$OUT" && tar czf ab.tgz ab && rm -rf ab)
