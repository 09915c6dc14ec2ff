"""``bench_decode.py``'s outputs: the compact table it prints, the JSON and CSV files, and the dry run's
plan with model byte floors. Merging parts of a sweep, Markdown tables and plots are
``plot_results.py``'s."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_plan import Shape
from tp_replayssm.byte_model import floor_us, packed_bytes, replay_bytes

REPO = Path(__file__).resolve().parents[1]


def log(*args: object) -> None:
    print(*args, flush=True)


def out_dir(args: argparse.Namespace) -> Path:
    if args.out:
        d = Path(args.out)
    elif os.environ.get("OUT"):
        d = Path(os.environ["OUT"])
    else:
        d = REPO / "benchmarks" / "out"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _fmt(v: Any, spec: str, width: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-".rjust(width)
    try:
        return format(v, spec).rjust(width)
    except (TypeError, ValueError):
        return str(v)[:width].rjust(width)


TABLE_COLUMNS = [
    # (header, key, format, width)
    ("heads", None, "", 6), ("B", "B", "d", 4), ("L", "L", "d", 3), ("st", "state", "", 4), ("lb", None, "", 4),
    ("ours_us", "ours_us", ".1f", 8), ("op_us", "ours_op_us", ".1f", 7), ("fused", "ours_fused_us", ".1f", 6),
    ("fla_us", "fla_us", ".1f", 7),
    ("xFLA", "speedup_vs_fla", ".2f", 5), ("GB/s", "ours_gbps", ".0f", 5), ("%flr", "ours_pct_floor", ".0f", 4),
    ("fla%f", "fla_pct_floor", ".0f", 5), ("floor", "floor_replay_us", ".1f", 6),
    ("eager", "ours_eager_us", ".1f", 6), ("host", "ours_host_us", ".1f", 5),
    ("rep%", "ours_spread_pct", ".1f", 4), ("err", "ours_err_out", ".0e", 6), ("chk", None, "", 5),
]


def table_lines(results: list[dict[str, Any]], baselines: Sequence[str]) -> list[str]:
    cols = list(TABLE_COLUMNS)
    for name in baselines:
        cols.insert(9, (f"{name[:6]}", f"{name}_us", ".1f", 7))
    head = " ".join(h.rjust(w) for h, _, _, w in cols)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = []
        for h, key, spec, w in cols:
            if h == "heads":
                cells.append((str(r["HV"]) if r["H"] == r["HV"] else f"{r['H']}x{r['HV']}").rjust(w))
            elif h == "lb":
                cells.append(("none" if r["lower_bound"] is None else f"{r['lower_bound']:g}").rjust(w))
            elif h == "chk":
                c = r.get("ours_check", "-")
                if r.get("fla_check") == "WRONG":
                    c = c + "/F!"
                cells.append(c.rjust(w))
            else:
                cells.append(_fmt(r.get(key), spec, w))
        line = " ".join(cells)
        err = r.get("error") or r.get("ours_error") or r.get("skipped")
        if err:
            line += f"  !{err[:70]}"
        elif r.get("fla_error"):
            line += f"  !fla: {r['fla_error'][:60]}"
        lines.append(line)
    return lines


def write_outputs(results: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace) -> Path:
    d = out_dir(args)
    jpath = d / f"{args.tag}.json"
    with open(jpath, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    keys: list[str] = []
    for r in results:
        for k in r:
            if k not in keys and not k.endswith("trace"):
                keys.append(k)
    with open(d / f"{args.tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(r)
    return jpath


COLUMN_HELP = """\
columns: heads = HV (or HxHV for GQA); ours_us = our op + cursor advance, us/step, graph-captured, median over
replays of full L-step cursor cycles; op_us = the same without the advance kernel; fused = the op with the advance
fused into it (--fused-advance); fla_us = FLA packed in-place decode us/step (graph); xFLA = fla_us/ours_us;
GB/s = replay model bytes / ours_us; %flr = replay byte floor (model bytes / measured copy bandwidth) / ours_us;
fla%f = FLA's packed byte floor / fla_us; floor = replay floor us; eager = ours us/step without a graph (op +
advance); host = CPU us inside one op call; rep% = change of ours_us
when timed again after FLA (noise); err = rel. error of out vs the reference; chk = ok/WRONG (out, flushed
checkpoints, appended ring entries, padding rows, untouched checkpoints), /F! = FLA's out disagrees."""


def dry_run(plan: list[Shape], args: argparse.Namespace) -> None:
    log(f"plan: {len(plan)} shapes; floors at an assumed copy bandwidth of {args.assume_bw:.0f} GB/s")
    log(f"{'shape':34s} {'replay MB':>10s} {'floor us':>9s} {'packed MB':>10s} {'floor us':>9s}")
    for s in plan:
        cfg = s.config(args.cache_dtype, args.act_dtype)
        rb, pb = replay_bytes(cfg).total, packed_bytes(cfg).total
        log(f"{s.label:34s} {rb / 1e6:10.2f} {floor_us(rb, args.assume_bw):9.1f} {pb / 1e6:10.2f} "
            f"{floor_us(pb, args.assume_bw):9.1f}")
