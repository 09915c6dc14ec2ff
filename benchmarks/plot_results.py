#!/usr/bin/env python3
"""PNG plots and a Markdown table from ``bench_decode.py``'s results: us/step and % of the byte floor vs batch.

Plots: one line per (heads, state dtype), ours solid, FLA's packed decode dashed, same colour; one pair of figures
(time, % of floor) per (ring length L, lower_bound) present in the results. Table: one Markdown row per shape with
``xFLA = fla_us / ours_us`` (below 1.00: FLA is faster) and a ``faster`` column, then a line counting the shapes
where FLA is faster::

    python3 benchmarks/plot_results.py benchmarks/out/bench_decode.json [more.json ...] [--out DIR]
    python3 benchmarks/plot_results.py part1.json part2.json --table table.md --no-plots

Writes ``<stem>_time_vs_batch_L<L>_lb<lb>.png`` and ``<stem>_pct_floor_vs_batch_L<L>_lb<lb>.png`` next to the first
results file (or into ``--out``) and, with ``--table``, the Markdown file. Several files (a sweep run in parts) are
merged in the order given: a timed row of a later file replaces the row of the same shape from an earlier one (a
re-run after a change), a row the earlier file skipped (time budget) is filled in, and an untimed row never replaces
a timed one. (A CSV written by bench_decode works too.) The plots need matplotlib (Agg backend, no display); the
table does not.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load_results(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    path = Path(path)
    if path.suffix == ".csv":
        rows = []
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                rows.append({k: _num(v) for k, v in row.items()})
        return rows, {}
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, {}
    return data.get("results", []), data.get("meta", {})


def _num(v: Any) -> Any:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        return v
    if v in ("None", "none"):
        return None
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


def _ok(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _lb_key(v: Any) -> str:
    return "none" if v is None else f"{float(v):g}"


SHAPE_KEYS = ("H", "HV", "K", "V", "B", "L", "state", "cache", "act", "lower_bound")


def shape_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two rows the same benchmark shape (the lower bound normalized: None / -5 / -5.0)."""
    return tuple(_lb_key(row.get(k)) if k == "lower_bound" else row.get(k) for k in SHAPE_KEYS)


def merge_results(paths: list[str | Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of several results files, merged in the order given (module docstring), in first-seen
    order of their shapes, and the first file's meta."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    for path in paths:
        rows, m = load_results(path)
        meta = meta or m
        for r in rows:
            key = shape_key(r)
            if key not in merged or _ok(r.get("ours_us")) or not _ok(merged[key].get("ours_us")):
                merged[key] = r
    return list(merged.values()), meta


def _cell(v: Any, spec: str) -> str:
    return format(v, spec) if _ok(v) else "-"


def _label(row: dict[str, Any]) -> str:
    """bench_decode's label of a row's shape (``HV8 B512 L16 bf16``, ``HV16x32 B8 L16 fp32 lb-5``)."""
    if row.get("label"):
        return str(row["label"])
    heads = str(row["HV"]) if row["H"] == row["HV"] else f"{row['H']}x{row['HV']}"
    lb = "" if row.get("lower_bound") is None else f" lb{float(row['lower_bound']):g}"
    return f"HV{heads} B{row['B']} L{row['L']} {row['state']}{lb}"


def faster(row: dict[str, Any]) -> str | None:
    """"ours" or "FLA": the side with less time per step at this row's shape (None unless both were timed)."""
    if not (_ok(row.get("ours_us")) and _ok(row.get("fla_us"))):
        return None
    return "FLA" if row["fla_us"] < row["ours_us"] else "ours"


def fla_summary(rows: list[dict[str, Any]]) -> str:
    """How many of the shapes timed on both sides FLA is faster at, and which."""
    both = [r for r in rows if faster(r)]
    fla = [r for r in both if faster(r) == "FLA"]
    names = ", ".join(_label(r) for r in fla)
    return f"FLA faster at {len(fla)} of {len(both)} shapes timed on both sides" + (f": {names}" if fla else "")


def table_markdown(rows: list[dict[str, Any]]) -> str:
    """One Markdown row per shape, grouped by (L, lower_bound), heads descending, then state, batch; then the
    :func:`fla_summary` line."""
    head = ("| L | lb | heads | state | B | ours us | op us | fused us | % floor | FLA us | xFLA | faster | check |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    order = sorted(rows, key=lambda r: (int(r["L"]), _lb_key(r.get("lower_bound")), -int(r["HV"]), -int(r["H"]),
                                       str(r["state"]), -int(r["B"])))
    for r in order:
        heads = str(r["HV"]) if r["H"] == r["HV"] else f"{r['H']}x{r['HV']}"
        speedup = r["fla_us"] / r["ours_us"] if _ok(r.get("fla_us")) and _ok(r.get("ours_us")) else None
        check = r.get("ours_check") or ("skipped" if r.get("skipped") else "-")
        lines.append(f"| {r['L']} | {_lb_key(r.get('lower_bound'))} | {heads} | {r['state']} | {r['B']} | "
                     f"{_cell(r.get('ours_us'), '.1f')} | {_cell(r.get('ours_op_us'), '.1f')} | "
                     f"{_cell(r.get('ours_fused_us'), '.1f')} | "
                     f"{_cell(r.get('ours_pct_floor'), '.0f')} | {_cell(r.get('fla_us'), '.1f')} | "
                     f"{_cell(speedup, '.2f')} | {faster(r) or '-'} | {check} |")
    return "\n".join(lines + ["", fla_summary(rows)]) + "\n"


def make_plots(results_path: str | Path | list[str | Path], out: str | Path | None = None,
               stem: str | None = None) -> list[Path]:
    """Write the PNGs next to the (first) results file (or into ``out``), their names starting with ``stem``
    (default: the first file's name); return their paths.
    Several results files (e.g. a sweep run in parts) are merged (:func:`merge_results`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    paths = [Path(p) for p in (results_path if isinstance(results_path, (list, tuple)) else [results_path])]
    rows, meta = merge_results(paths)
    out_dir = Path(out) if out else paths[0].resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or paths[0].stem
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("B") is None or r.get("L") is None:
            continue
        groups[(int(r["L"]), _lb_key(r.get("lower_bound")))].append(r)

    written: list[Path] = []
    subtitle = " ".join(str(x) for x in (meta.get("gpu"), meta.get("date")) if x)
    copy = (meta.get("copy") or {}).get("copy_gbps")
    for (L, lb), rs in sorted(groups.items()):
        lines: dict[tuple[int, int, str], list[dict[str, Any]]] = defaultdict(list)
        for r in rs:
            lines[(int(r["H"]), int(r["HV"]), str(r["state"]))].append(r)
        keys = sorted(lines, key=lambda k: (-k[1], k[0], k[2]))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        figs = {
            "time": ("us per step (graph, cycle mean)", "ours_us", "fla_us", True),
            "pct_floor": ("% of byte floor (model bytes / copy bandwidth)", "ours_pct_floor", "fla_pct_floor", False),
        }
        for kind, (ylabel, ours_key, fla_key, logy) in figs.items():
            fig, ax = plt.subplots(figsize=(8, 5.5))
            drew = False
            for i, key in enumerate(keys):
                H, HV, st = key
                color = colors[i % len(colors)]
                name = f"HV{HV}" if H == HV else f"H{H}/HV{HV}"
                pts = sorted(lines[key], key=lambda r: r["B"])
                for metric, style, marker, suffix in ((ours_key, "-", "o", ""), (fla_key, "--", "x", " FLA")):
                    xs = [r["B"] for r in pts if _ok(r.get(metric))]
                    ys = [r[metric] for r in pts if _ok(r.get(metric))]
                    if xs:
                        ax.plot(xs, ys, style, marker=marker, color=color, label=f"{name} {st}{suffix}")
                        drew = True
            if not drew:
                plt.close(fig)
                continue
            ax.set_xscale("log", base=2)
            bs = sorted({int(r["B"]) for r in rs})
            ax.set_xticks(bs)
            ax.set_xticklabels([str(b) for b in bs])
            ax.minorticks_off() if not logy else None
            if logy:
                ax.set_yscale("log")
            else:
                ax.set_ylim(0, 105)
                ax.axhline(100, color="gray", lw=0.8)
            ax.set_xlabel("batch B (rows, one token each)")
            ax.set_ylabel(ylabel)
            title = f"KDA decode, L={L}, lower_bound={lb}"
            if copy:
                title += f", copy {copy:.0f} GB/s"
            ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            first = ax.legend(fontsize=7, ncol=2, loc="best")
            ax.add_artist(first)
            ax.legend(handles=[Line2D([], [], color="k", ls="-", marker="o", label="ours (ReplaySSM)"),
                               Line2D([], [], color="k", ls="--", marker="x", label="FLA packed")],
                      fontsize=7, loc="lower right" if logy else "upper left")
            fig.tight_layout()
            path = out_dir / f"{stem}_{kind}_vs_batch_L{L}_lb{lb}.png"
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_decode .json or .csv (several are merged)")
    p.add_argument("--out", help="output folder (default: next to the results)")
    p.add_argument("--stem", help="start of the PNG names (default: the first results file's name)")
    p.add_argument("--table", help="also write the merged rows as a Markdown table to this file")
    p.add_argument("--no-plots", action="store_true", help="only the table")
    args = p.parse_args(argv)
    if args.table:
        Path(args.table).write_text(table_markdown(merge_results(args.results)[0]))
        print(args.table, flush=True)
    if args.no_plots:
        return 0
    try:
        paths = make_plots(args.results, args.out, args.stem)
    except ImportError as exc:
        print(f"plot_results: matplotlib is needed ({exc})", flush=True)
        return 2
    for path in paths:
        print(path, flush=True)
    if not paths:
        print("plot_results: nothing to plot (no timed rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
