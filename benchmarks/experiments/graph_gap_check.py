"""How much of a small-batch timing is the gap between CUDA graph replays; GPU only.

Times the library op over full cursor cycles of disjoint slot sets with ``tune_decode.time_cycle``,
once with one graph per slot set (16 launches, the harness of sessions 1-8) and once with 16 sets per
graph, a few rounds each. On the H200 (ninth session) HV = 8, B = 1 took 6.2 us/step with one set per
graph (4.4 on the first timing of a process) and 3.9 with 16 sets per graph, while the host issued
0.02-0.06 us per step; so ``time_cycle`` now puts >= 256 launches in each graph.

    python benchmarks/experiments/graph_gap_check.py --hv 8 32 --batch 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tune_decode as td  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hv", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ring", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_gap_check.py needs a CUDA GPU")
    L = args.ring
    rows = []
    for HV in args.hv:
        n = td.slot_sets(args.batch, HV, L, torch.float32, 240.0)
        prob = td.make_problem(args.batch, HV, HV, L, torch.float32, n)
        for rnd in range(args.rounds):
            for sets_per_graph in (1, 16):
                us = td.time_cycle(prob, td.op_launch(None), L, min_launches=sets_per_graph * L)
                rows.append(dict(HV=HV, B=args.batch, round=rnd, sets_per_graph=sets_per_graph, us=us))
                print(rows[-1], flush=True)
        del prob
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "graph_gap.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
