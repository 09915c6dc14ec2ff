"""``bench_decode.py``'s outputs: the compact table it prints (with the shapes where FLA is faster counted and
named), the JSON and CSV files, and the dry run's shape list with model byte floors and launch plans. Merging parts
of a sweep, Markdown tables and plots are ``plot_results.py``'s."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench_shapes import Shape
from tp_replayssm.kernels.byte_model import floor_us, packed_bytes, replay_bytes

REPO = Path(__file__).resolve().parents[1]


def log(*args: object) -> None:
    print(*args, flush=True)


def out_dir(args: argparse.Namespace) -> Path:
    """``--out``, else ``$OUT``, else ``benchmarks/out`` (created)."""
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
    ("xFLA", "speedup_vs_fla", ".2f", 5), ("win", None, "", 4), ("GB/s", "ours_gbps", ".0f", 5), ("%flr", "ours_pct_floor", ".0f", 4),
    ("fla%f", "fla_pct_floor", ".0f", 5), ("floor", "floor_replay_us", ".1f", 6),
    ("eager", "ours_eager_us", ".1f", 6), ("host", "ours_host_us", ".1f", 5),
    ("rep%", "ours_spread_pct", ".1f", 4), ("err", "ours_err_out", ".0e", 6), ("chk", None, "", 5),
]


def faster(row: dict[str, Any]) -> str | None:
    """"ours" or "FLA": which of the two took less time per step at this row's shape (None unless both ran)."""
    ours, fla = row.get("ours_us"), row.get("fla_us")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (ours, fla)):
        return None
    return "FLA" if fla < ours else "ours"


def fla_summary(results: list[dict[str, Any]]) -> str:
    """One line: at how many of the shapes timed on both sides FLA is faster, and which."""
    both = [r for r in results if faster(r) is not None]
    fla = [r for r in both if faster(r) == "FLA"]
    if not both:
        return "FLA vs ours: no shape was timed on both sides"
    line = f"FLA faster at {len(fla)} of {len(both)} shapes timed on both sides"
    if fla:
        worst = min(fla, key=lambda r: r["fla_us"] / r["ours_us"])
        line += (f" (xFLA down to {worst['fla_us'] / worst['ours_us']:.2f} at {worst.get('label', '?')}): "
                 + ", ".join(str(r.get("label", "?")) for r in fla))
    return line


def table_lines(results: list[dict[str, Any]], baselines: Sequence[str]) -> list[str]:
    """The compact table (one line per shape, errors and skips noted at the end of the line), then the
    :func:`fla_summary` line."""
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
            elif h == "win":
                cells.append((faster(r) or "-").rjust(w))
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
    lines.append(fla_summary(results))
    return lines


def write_outputs(results: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace) -> Path:
    """``<out>/<tag>.json`` (meta and every row) and ``<out>/<tag>.csv`` (the rows, tracebacks left out); returns
    the JSON's path."""
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
columns: heads = HV (or HxHV for GQA); ours_us = ours as the pool runs it (decode on the slot-indexed cursor table +
the pool's cursor advance), us/step, graph-captured, median over replays of full L-step cursor cycles; op_us = the
op alone (row cursors, constant write_pos, no advance); fused = the decode with the advance fused into it
(--fused-advance); fla_us = FLA's packed in-place decode, us/step (graph); xFLA = fla_us / ours_us (below 1: FLA
is faster); win = which is faster; GB/s = replay model bytes / ours_us; %flr = replay byte floor (model bytes /
measured copy bandwidth) / ours_us; fla%f = FLA's packed byte floor / fla_us; floor = replay floor us; eager =
ours us/step without a graph (decode + advance); host = CPU us inside one decode call; rep% = change of ours_us
when timed again after FLA (noise); err = rel. error of out vs the reference; chk = ok/WRONG (out, flushed
checkpoints, appended ring entries, padding rows, untouched checkpoints), /F! = FLA's out disagrees."""


def plan_label(plan: Any) -> str:
    """A launch plan in a few characters: ``value_tile/value_chunk/warps``, then ``capN`` (register cap), ``mma``
    (tensor-core chunks), ``tiny``, ``vtN`` (vector tiles) and ``pdN`` (the pre-decayed mode) where set."""
    parts = [f"{plan.value_tile}/{plan.value_chunk}/{plan.num_warps}w"]
    parts += [f"cap{plan.maxnreg}"] if plan.maxnreg else []
    parts += ["mma"] if plan.tensor_core_chunks else []
    parts += ["tiny"] if plan.tiny_batch else []
    parts += [f"vt{plan.vector_tiles}"] if plan.vector_tiles else []
    parts += [f"pd{plan.predecayed_ring}"] if plan.predecayed_ring else []
    return " ".join(parts)


def dry_run(shapes: list[Shape], args: argparse.Namespace, plans: Callable[[Shape], dict[str, Any]]) -> None:
    """The shape list with the model's byte floors at ``--assume-bw`` and ours' launch plan (``plans(shape)["pool"]``,
    with ``--override`` applied) per shape; no GPU."""
    log(f"{len(shapes)} shapes, {args.ring_layout} ring layout; floors at an assumed copy bandwidth of "
        f"{args.assume_bw:.0f} GB/s; ours' launch plan (value tile/chunk/warps ...)")
    log(f"{'shape':30s} {'replay MB':>10s} {'floor us':>9s} {'packed MB':>10s} {'floor us':>9s}  plan")
    for s in shapes:
        cfg = s.config(args.cache_dtype, args.act_dtype, args.ring_layout)
        rb, pb = replay_bytes(cfg).total, packed_bytes(cfg).total
        log(f"{s.label:30s} {rb / 1e6:10.2f} {floor_us(rb, args.assume_bw):9.1f} {pb / 1e6:10.2f} "
            f"{floor_us(pb, args.assume_bw):9.1f}  {plan_label(plans(s)['pool'])}")
