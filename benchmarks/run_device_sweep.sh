#!/usr/bin/env bash
# One device-tool call: a GPU smoke test of the op, then the config sweep behind tp_replayssm/configs.py
# (candidates VT:VC:WARPS[:MAXNREG[:PER_SM]][:mma], see benchmarks/launch_args.py).
# usage (device tool, carry .devwheels):  bash benchmarks/run_device_sweep.sh
set -u
source benchmarks/device_setup.sh || exit 1
timeout 120 python3 -m pytest -x -q -p no:cacheprovider tests/test_op_gpu.py \
  -k "(H8-HV8 and 8-fp32) or (H16-HV32 and 64-bf16) or (H32-HV32 and 1-fp32)" 2>&1 | tail -3
# large batches: one program (one warp) per (row, head) streaming the value chunks
timeout 200 python3 benchmarks/tune_decode.py --hv 32 8 --batch 512 --state fp32 bf16 \
  --cands 128:16:1 128:8:1 64:16:1 128:16:4 --budget-s 170 --tag tune_large 2>&1 | grep -E "us/step|copy|FAILED|regs=|best" | cut -c1-100
# small batches: split V across programs
timeout 150 python3 benchmarks/tune_decode.py --hv 32 8 --batch 1 8 --state fp32 \
  --cands 16:16:2 16:16:4 32:32:4 64:32:4 32:16:1 64:16:1 --budget-s 120 --tag tune_small 2>&1 \
  | grep -E "us/step|FAILED|regs=|best" | cut -c1-100
