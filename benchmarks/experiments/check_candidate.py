"""Correctness of candidate decode kernels on the GPU before they are timed or adopted.

Runs the scenario of ``tests/test_op_gpu.py`` (``_decode_scenario.kimi_scenario``: a full ring cycle
plus one step, forced flushes, NaN-poisoned outputs and unread ring entries, sentinel-filled unused
slots) with each candidate swapped into the op, and prints the worst errors against the reference and
the float64 plain recurrence with a PASS / FAIL verdict from the tests' tolerances.

    python benchmarks/experiments/check_candidate.py --kernel dot=variant:NAME --hv 32 8 --batch 8 64 256
    python benchmarks/experiments/check_candidate.py --kernel c=FILE --override '{"range_num_stages": [0, 0]}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=FILE")
    ap.add_argument("--hv", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--state", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--override", default=None, metavar="JSON",
                    help="config keys replaced in each shape's pinned choice (as tune_decode.py --override)")
    args = ap.parse_args()
    from _decode_scenario import OUT_TOL, PLAIN64_TOL, kimi_scenario, run_scenario
    from experiments.variants import load_kernel
    from tune_decode import pinned_with, use_kernel

    from tp_replayssm import configs, ops

    failures = 0
    for spec in args.kernel:
        name, path = spec.split("=", 1)
        use_kernel(load_kernel(path))
        for HV, B, sname in itertools.product(args.hv, args.batch, args.state):
            sdt = torch.float32 if sname == "fp32" else torch.bfloat16
            sc = kimi_scenario(HV, HV, B, sdt)
            if args.override:
                configs.FORCED = pinned_with(B, HV, sc.L, sdt, json.loads(args.override))
            try:
                w = run_scenario(sc, ops.replayssm_decode)
                ok = (w.out_vs_reference <= OUT_TOL[sc.act_dtype]
                      and max(w.out_vs_plain64, w.state_vs_plain64) <= PLAIN64_TOL)
                verdict = "PASS" if ok else "FAIL"
                detail = (f"out/ref {w.out_vs_reference:.2e} out/plain64 {w.out_vs_plain64:.2e} "
                          f"state/plain64 {w.state_vs_plain64:.2e} flushes {w.flushes}")
            except Exception as exc:  # noqa: BLE001 - report and go on
                ok, verdict, detail = False, "FAIL", f"{type(exc).__name__}: {str(exc)[-300:]}"
            failures += not ok
            print(f"check {name} HV={HV} B={B} {sname}: {verdict} {detail}", flush=True)
        use_kernel(None)
    configs.FORCED = None
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
