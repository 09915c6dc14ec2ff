"""Launch the decode op at one shape for Nsight Compute (``ncu``) to profile; GPU only.

Builds the same problem as ``tune_decode.py`` (disjoint slot sets so the state streams from HBM),
runs ``--warmup`` launches at ring cursor ``--cursor`` (compile + caches) and then ``--launches`` more;
profile the later ones with ``ncu --kernel-name regex:replayssm --launch-skip <warmup>``.

    ncu --clock-control none --kernel-name regex:replayssm --launch-skip 3 --launch-count 1 \
        python benchmarks/profile_decode.py --hv 32 --batch 512 --state fp32 --cursor 8

``--kernel FILE`` or ``--kernel variant:NAME`` profiles a candidate kernel function instead of the
library's (same signature; see ``benchmarks/experiments/variants.py``). ``--ring-layout predecayed`` profiles the
pool's pre-decayed layout (softplus gate), ``--config VT:VC:WARPS[:MAXNREG[:PER_SM]][:mma[N]]`` one forced launch
choice (``benchmarks/launch_args.py``) instead of the pinned one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_args import FORMAT, launch_spec_arg  # noqa: E402
from tune_decode import make_problem, op_launch, use_kernel  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hv", type=int, default=32)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--state", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--ring", type=int, default=16)
    ap.add_argument("--cursor", type=int, default=8, help="ring cursor of every row (ring-1 = flush step)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--kernel", default=None, help="a candidate kernel: FILE or variant:NAME")
    ap.add_argument("--ring-layout", choices=["spec", "predecayed"], default="spec")
    ap.add_argument("--config", default=None, metavar=FORMAT, type=launch_spec_arg,
                    help="one forced launch choice instead of the pinned one")
    args = ap.parse_args(argv)
    if not 0 <= args.cursor < args.ring:
        ap.error(f"--cursor must be in [0, {args.ring}), got {args.cursor}")
    return args


def main() -> None:
    args = parse_args()
    sdt = torch.float32 if args.state == "fp32" else torch.bfloat16
    predecayed = args.ring_layout == "predecayed"
    prob = make_problem(args.batch, args.hv, args.hv, args.ring, sdt, n_sets=args.warmup + args.launches,
                        predecayed=predecayed)
    if args.kernel:
        from experiments.variants import load_kernel

        use_kernel(load_kernel(args.kernel))
    launch = op_launch(args.config.launch_choice() if args.config else None, predecayed)
    for slots in prob["slot_sets"]:  # a fresh slot set per launch: state comes from HBM
        launch(prob, slots, args.cursor)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
