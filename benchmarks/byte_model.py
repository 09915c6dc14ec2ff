#!/usr/bin/env python3
"""Print the decode byte model (``tp_replayssm.kernels.byte_model``) for one or more shapes; no GPU needed.

The fewest bytes one decode step must move through device memory: per shape, the cycle-mean bytes of one ReplaySSM
step split into its terms (checkpoint read and write, ring read and write, inputs, parameters, outputs), the total
for FLA's packed decode (the whole state read and written every step), and each total's floor (bytes / copy
bandwidth) in microseconds. ``--ring-layout predecayed`` (the pool's default) counts one ring key per value head,
``sglang`` one per q/k head. Prints a table; writes nothing::

    python3 benchmarks/byte_model.py --heads 32 --batch 512 --ring 16 --state fp32 --bw 4300
    python3 benchmarks/byte_model.py --heads 8,16x32 --batch 1,128,512 --state fp32,bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tp_replayssm.kernels.byte_model import DecodeConfig, floor_us, packed_bytes, replay_bytes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="32,8", help="HV (H = HV) or HxHV, comma list")
    p.add_argument("--batch", default="512")
    p.add_argument("--ring", default="16")
    p.add_argument("--state", default="fp32,bf16")
    p.add_argument("--cache", default="bf16")
    p.add_argument("--ring-layout", choices=["predecayed", "sglang"], default="predecayed",
                   help="predecayed: one ring key per value head; sglang: one per q/k head")
    p.add_argument("--act", default="bf16")
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--bw", type=float, default=4300.0, help="copy bandwidth in GB/s (read + write)")
    a = p.parse_args(argv)
    heads = []
    for item in a.heads.split(","):
        h, _, hv = item.strip().lower().partition("x")
        heads.append((int(h), int(hv or h)))
    terms = ("state_read", "state_write", "ring_read", "ring_write", "inputs", "params", "outputs")
    print(f"bandwidth {a.bw:.0f} GB/s; MB = 1e6 bytes; replay = cycle mean over L phases; {a.ring_layout} rings")
    print(f"{'H/HV':>6} {'B':>4} {'L':>3} {'st':>4} | " + " ".join(f"{t:>11}" for t in terms)
          + f" | {'replay MB':>9} {'floor us':>8} | {'packed MB':>9} {'floor us':>8}")
    for H, HV in heads:
        for L in map(int, a.ring.split(",")):
            for st in a.state.split(","):
                for B in map(int, a.batch.split(",")):
                    cfg = DecodeConfig(B, H, HV, key_dim=a.key_dim, value_dim=a.value_dim, ring_length=L,
                                       state_dtype=st.strip(), cache_dtype=a.cache, act_dtype=a.act,
                                       keys_per_value_head=a.ring_layout == "predecayed")
                    r, pk = replay_bytes(cfg), packed_bytes(cfg)
                    d = r.as_dict()
                    print(f"{H:>2}/{HV:<3} {B:>4} {L:>3} {st:>4} | "
                          + " ".join(f"{d[t] / 1e6:11.3f}" for t in terms)
                          + f" | {r.total / 1e6:9.2f} {floor_us(r.total, a.bw):8.1f}"
                          + f" | {pk.total / 1e6:9.2f} {floor_us(pk.total, a.bw):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
