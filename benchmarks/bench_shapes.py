"""The shapes ``bench_decode.py`` times: the :class:`Shape` record, the standard and quick shape lists, and the
grid flags (``--heads 32,16x32 --batch 1,8 --state fp32,bf16 --ring 16 --lower-bound none,-5``) turned into a
list. Pure Python (no torch); ``tests/test_byte_model.py`` checks the lists on CPU."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from tp_replayssm.kernels.byte_model import DecodeConfig

STATE_DTYPES = ("fp32", "bf16")
ALL_B = (1, 8, 32, 128, 512)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark shape: ``H`` q/k heads, ``HV`` value heads, batch ``B``, ring length ``L``, checkpoint dtype
    ``state``, gate ``lower_bound`` ``lb`` (None: unbounded), key and value widths ``K``, ``V``."""

    H: int
    HV: int
    B: int
    L: int
    state: str  # "fp32" | "bf16"
    lb: float | None
    K: int = 128
    V: int = 128

    @property
    def label(self) -> str:
        heads = f"{self.HV}" if self.H == self.HV else f"{self.H}x{self.HV}"
        lb = "" if self.lb is None else f" lb{self.lb:g}"
        return f"HV{heads} B{self.B} L{self.L} {self.state}{lb}"

    def config(self, cache: str, act: str, ring_layout: str = "predecayed") -> DecodeConfig:
        """The byte model's description of one step at this shape (the pre-decayed layout keeps one ring key
        per value head)."""
        return DecodeConfig(self.B, self.H, self.HV, key_dim=self.K, value_dim=self.V, ring_length=self.L,
                            state_dtype=self.state, cache_dtype=cache, act_dtype=act, lower_bound=self.lb,
                            keys_per_value_head=ring_layout == "predecayed")


def _dedupe(shapes: list[Shape]) -> list[Shape]:
    seen: set[Shape] = set()
    out = []
    for s in shapes:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def _grid(heads: Sequence[tuple[int, int]], batches: Sequence[int], rings: Sequence[int],
          states: Sequence[str], lbs: Sequence[float | None], K: int = 128, V: int = 128) -> list[Shape]:
    return [Shape(H, HV, B, L, st, lb, K, V)
            for (H, HV) in heads for L in rings for lb in lbs for st in states for B in batches]


def standard_shapes() -> list[Shape]:
    """The baseline table's shapes, in priority order (a run cut by its time budget keeps the first ones): the full
    batch sweep at the Kimi-Linear head counts of TP1 and TP4, spot checks at other head counts, GQA, a bounded
    gate and a shorter ring."""
    both = ("fp32", "bf16")
    shapes = []
    shapes += _grid([(32, 32), (8, 8)], ALL_B, (16,), both, (None,))  # 20: TP1 / TP4 of Kimi-Linear
    shapes += _grid([(16, 16), (12, 12), (4, 4)], (1, 8, 128, 512), (16,), both, (None,))  # 24
    shapes += _grid([(16, 32)], (8, 128, 512), (16,), both, (None,))  # 6: GQA HV = 2H
    shapes += _grid([(32, 32), (8, 8)], (8, 512), (16,), both, (-5.0,))  # 8: bounded gate
    shapes += _grid([(32, 32), (8, 8)], (1, 128, 512), (8,), both, (None,))  # 12: L = 8
    return _dedupe(shapes)


def quick_shapes() -> list[Shape]:
    """Eight shapes across the launch regimes (``--quick``)."""
    return [
        Shape(32, 32, 512, 16, "fp32", None),
        Shape(32, 32, 512, 16, "bf16", None),
        Shape(8, 8, 512, 16, "fp32", None),
        Shape(8, 8, 512, 16, "bf16", None),
        Shape(32, 32, 128, 16, "fp32", None),
        Shape(8, 8, 1, 16, "fp32", None),
        Shape(32, 32, 8, 16, "fp32", None),
        Shape(16, 32, 128, 16, "bf16", -5.0),
    ]


def _parse_heads(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if "x" in item:
            h, hv = item.split("x", 1)
            out.append((int(h), int(hv)))
        else:
            out.append((int(item), int(item)))
    return out


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parse_lbs(text: str) -> list[float | None]:
    out: list[float | None] = []
    for x in text.split(","):
        x = x.strip().lower()
        if x in ("none", "no", "-", ""):
            out.append(None)
        else:
            out.append(float(x))
    return out


def shapes_from_args(args: argparse.Namespace) -> list[Shape]:
    """The shapes ``bench_decode.py``'s arguments name: a grid when any grid flag is given, else the quick or the
    standard list; then ``--start-at`` / ``--max-shapes``."""
    grid_flags = (args.heads, args.batch, args.state, args.ring, args.lower_bound)
    if any(f is not None for f in grid_flags):
        shapes = _grid(
            _parse_heads(args.heads or "32,8"),
            _parse_ints(args.batch or ",".join(map(str, ALL_B))),
            _parse_ints(args.ring or "16"),
            [s.strip() for s in (args.state or "fp32,bf16").split(",") if s.strip()],
            _parse_lbs(args.lower_bound or "none"),
            args.key_dim, args.value_dim,
        )
    elif args.quick:
        shapes = quick_shapes()
    else:
        shapes = standard_shapes()
    for s in shapes:
        if s.state not in STATE_DTYPES:
            raise SystemExit(f"bench_decode: unknown state dtype {s.state!r}; use fp32 or bf16")
        if s.HV % s.H:
            raise SystemExit(f"bench_decode: HV % H must be 0; got H={s.H}, HV={s.HV}")
    shapes = shapes[args.start_at:]
    if args.max_shapes:
        shapes = shapes[: args.max_shapes]
    return _dedupe(shapes)
