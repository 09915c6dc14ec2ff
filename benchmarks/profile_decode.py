"""Launch the decode op at one shape for Nsight Compute (``ncu``) to profile; GPU only.

Builds the problem of ``tune_decode.py`` (``--warmup + --launches`` disjoint slot sets, so every launch reads its
state from DRAM), then launches the op once per slot set with every row at ring cursor ``--cursor`` (``--ring - 1``
is the flush step): the first ``--warmup`` launches compile and warm up, profile the later ones. ``--ring-layout``
picks the rings' layout (the pool's default ``predecayed``, or ``sglang``), ``--override field=value,...`` a
launch plan other than the library's (``benchmarks/plan_args.py``). Writes nothing itself; ncu writes its report::

    ncu --clock-control none --kernel-name regex:replayssm --launch-skip 3 --launch-count 1 \\
        python3 benchmarks/profile_decode.py --hv 32 --batch 512 --state fp32 --cursor 8

``ncu_hot.py`` summarizes the report's SASS source page.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_args import build_plan, override_arg  # noqa: E402
from tune_decode import make_problem, op_launch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hv", type=int, default=32, help="value heads (H = HV)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--state", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--ring", type=int, default=16)
    ap.add_argument("--cursor", type=int, default=8, help="ring cursor of every row (ring-1 = flush step)")
    ap.add_argument("--lower-bound", type=float, default=None, help="the gate's lower_bound (default: none)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--ring-layout", choices=["predecayed", "sglang"], default="predecayed")
    ap.add_argument("--override", type=override_arg, default={}, metavar="FIELD=VALUE,...",
                    help="fields of the library's launch plan to replace, e.g. 'value_tile=64,num_warps=1'")
    args = ap.parse_args(argv)
    if not 0 <= args.cursor < args.ring:
        ap.error(f"--cursor must be in [0, {args.ring}), got {args.cursor}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sdt = torch.float32 if args.state == "fp32" else torch.bfloat16
    plan = build_plan(batch=args.batch, heads=args.hv, ring_length=args.ring, state=args.state,
                      layout=args.ring_layout, lower_bound=args.lower_bound, override=args.override) \
        if args.override else None
    prob = make_problem(args.batch, args.hv, args.hv, args.ring, sdt, n_sets=args.warmup + args.launches,
                        ring_layout=args.ring_layout)
    launch = op_launch(plan, args.ring_layout, args.lower_bound)
    for slots in prob["slot_sets"]:  # a fresh slot set per launch: state comes from HBM
        launch(prob, slots, args.cursor)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
