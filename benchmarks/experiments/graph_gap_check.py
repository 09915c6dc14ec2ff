"""How much of a small-batch timing is the gap between CUDA graph replays; GPU only.

Times the library op over full cursor cycles of disjoint slot sets (as ``tune_decode.py``) with one
graph per slot set (16 launches, the harness of sessions 1-8) and with 16 sets per graph, a few rounds
each, and prints the device time and the host time per step. On the H200 (ninth session) HV = 8, B = 1
took 6.2 us/step with one set per graph (4.4 on the first timing of a process) and 3.9 with 16 sets
per graph, so ``tune_decode.time_cycle`` now puts >= 256 launches in each graph.

    python benchmarks/experiments/graph_gap_check.py --hv 8 32 --batch 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tune_decode as td  # noqa: E402


def time_grouped(prob: dict, launch, L: int, sets_per_graph: int, reps: int = 20) -> tuple[float, float]:  # noqa: ANN001
    """(device us per step, host us per step of the replay loop), graphs of ``sets_per_graph`` sets."""
    sets = prob["slot_sets"]
    for slots in sets:
        for c in range(L):
            launch(prob, slots, c)
    torch.cuda.synchronize()
    graphs = []
    for i in range(0, len(sets), sets_per_graph):
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for slots in sets[i:i + sets_per_graph]:
                for c in range(L):
                    launch(prob, slots, c)
        graphs.append(gr)
    for gr in graphs:
        gr.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, host = [], []
    for _ in range(reps):
        s.record()
        h0 = time.perf_counter()
        for gr in graphs:
            gr.replay()
        host.append((time.perf_counter() - h0) * 1e6 / (len(sets) * L))
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (len(sets) * L))
    return statistics.median(times), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hv", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_gap_check.py needs a CUDA GPU")
    rows = []
    for HV in args.hv:
        n = td.slot_sets(args.batch, HV, 16, torch.float32, 240.0)
        prob = td.make_problem(args.batch, HV, HV, 16, torch.float32, n)
        for rnd in range(args.rounds):
            for per in (1, 16):
                us, host = time_grouped(prob, td.op_launch(None), 16, per)
                rows.append(dict(HV=HV, B=args.batch, round=rnd, sets_per_graph=per, us=us, host_us_per_step=host))
                print(rows[-1], flush=True)
        del prob
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "graph_gap.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
