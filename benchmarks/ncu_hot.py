"""Summarize an Nsight Compute SASS source page (``ncu --import R --page source --csv --print-source sass``).

Prints the column totals and the instructions with the most warp-stall samples, each with its non-zero per-reason
samples, so the hot spots of a kernel come back from the device as a few lines of text. Writes nothing::

    ncu ... -o report python3 benchmarks/profile_decode.py ...      # see profile_decode.py
    ncu --import report.ncu-rep --page source --csv --print-source sass > report.sass.csv
    python3 benchmarks/ncu_hot.py report.sass.csv [--top 45]
"""

from __future__ import annotations

import argparse
import csv


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(lines: list[str], top: int = 45) -> list[str]:
    """The report's text lines for the CSV ``lines`` of ncu's SASS source page (banner lines are skipped)."""
    quoted = [ln for ln in lines if ln.startswith('"')]
    # newer ncu versions put a "Kernel Name" line above the header: the header is the first line naming the address
    start = next((i for i, ln in enumerate(quoted) if ln.startswith('"Address"')), 0)
    reader = csv.reader(quoted[start:])
    header = next(reader, [])
    rows = [dict(zip(header, rec)) for rec in reader]  # extra trailing fields (ncu adds some) are dropped
    if not rows:
        return ["ncu_hot: no rows"]
    cols = list(rows[0].keys())
    numeric = [c for c in cols if all(_num(r.get(c) or "0") is not None for r in rows[:50])]
    totals = {c: sum(_num(r.get(c) or "0") or 0.0 for r in rows) for c in numeric}
    out = [f"ncu_hot: {len(rows)} SASS rows; columns with non-zero totals:"]
    out += [f"  {c}: {t:.0f}" for c, t in totals.items() if t]
    key = next((c for c in numeric if "Sampling (All" in c), None) or next((c for c in numeric if "Sampl" in c), None)
    if key is None:
        return out + [f"ncu_hot: no sampling column; columns: {cols}"]
    src = next((c for c in cols if c.lower() == "source"), cols[1])
    addr = next((c for c in cols if "address" in c.lower()), cols[0])
    stall_cols = [c for c in numeric if c != key and totals[c] and ("stall" in c.lower() or "Sampl" in c)]
    out.append(f"top {top} by {key} (share of {totals[key]:.0f}):")
    for r in sorted(rows, key=lambda r: -(_num(r.get(key) or "0") or 0.0))[:top]:
        v = _num(r.get(key) or "0") or 0.0
        parts = [f"{c.split('(')[-1].rstrip(')')[:22]}={_num(r.get(c) or '0'):.0f}" for c in stall_cols
                 if (_num(r.get(c) or "0") or 0) >= 0.1 * v and (_num(r.get(c) or "0") or 0) > 0]
        out.append(f"{100 * v / max(totals[key], 1):5.1f}% {r[addr]:>6} {r[src][:70]:70s} {' '.join(parts)[:160]}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv_path", help="ncu's SASS source page as CSV")
    ap.add_argument("--top", type=int, default=45, help="instructions to list")
    args = ap.parse_args(argv)
    with open(args.csv_path, newline="") as f:
        print("\n".join(summarize(list(f), args.top)))


if __name__ == "__main__":
    main()
