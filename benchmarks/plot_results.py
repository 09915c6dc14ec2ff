#!/usr/bin/env python3
"""PNG plots from bench_decode's results: us/step vs batch and % of the byte floor vs batch.

One line per (heads, state dtype): ours solid, FLA packed dashed, same colour. One pair of figures per
(ring length L, lower_bound) present in the results::

    python3 benchmarks/plot_results.py benchmarks/out/bench_decode.json [more.json ...] [--out DIR]

(A CSV written by bench_decode works too.) Needs matplotlib; uses the Agg backend (no display).
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


def make_plots(results_path: str | Path | list[str | Path], out: str | Path | None = None) -> list[Path]:
    """Write the PNGs next to the (first) results file (or into ``out``); return their paths.
    Several results files (e.g. a sweep run in two parts) are merged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    paths = [Path(p) for p in (results_path if isinstance(results_path, (list, tuple)) else [results_path])]
    rows, meta = [], {}
    for path in paths:
        more, m = load_results(path)
        rows += more
        meta = meta or m
    out_dir = Path(out) if out else paths[0].resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = paths[0].stem
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
    args = p.parse_args(argv)
    try:
        paths = make_plots(args.results, args.out)
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
